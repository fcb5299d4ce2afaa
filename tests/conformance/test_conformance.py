"""Every model of the zoo through every mode, at the samples one plain PyTorch process
trains on: the held-out metric within a stated bound of the one-process run, and a trained
state that is whole (every ``state_dict`` key, a strict load into a fresh model, frozen
parameters untouched, BatchNorm statistics trained, tied weights equal, replicas identical).

The bar (issue #15, must-have 8), the same for every mode:

- a classifier's held-out accuracy >= the one-process accuracy - ``ACCURACY_MARGIN``;
- a language model's held-out loss <= ``LOSS_FACTOR`` x the one-process loss;
- on the mean of ``Case.repeats`` runs for a model whose random draws in training differ from
  run to run (LayerDrop, whose members draw from one generator in arrival order), and of
  ``Case.timing_repeats`` parameter-server runs for a model whose held-out metric dips for a
  few steps at a time (BERT): there the order gradients land in makes each run another course.

The parameter server runs as the docs recommend for quality: bounded asynchrony
(``aggregate_samples`` = the batch, each of the 2 workers computing half of it). Applying
every gradient on arrival instead cost GPT-2 18 % here (3.05 vs 2.59): see
``benchmarks/bench_async.py`` for the methods tried. The bounds are the issue's, not fitted.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from typing import Any

import pytest
import torch

from .harness import Case, Outcome, state_problems, train_one_process, train_peer, train_pipeline, train_ps
from .zoo import CASES, SEQUENTIAL

pytestmark = pytest.mark.timeout(120)

ACCURACY_MARGIN = 0.03
LOSS_FACTOR = 1.05
#: a run's samples may differ from the case's by this fraction (or two batches): a bounded-
#: asynchrony window that has its samples still waits for a worker due on its weights, and
#: takes a third gradient when the other worker, answered after the hold, sent again meanwhile.
#: Quiet runs stay within two batches; with the suite and two busy loops beside them the
#: parameter server applied 0.4-0.7 % more (19,328 of 19,200).
SAMPLE_SLACK = 0.02


def _timed(names: list[str]) -> list[Any]:
    """``names`` as parameters, each with a timeout for its repeats: LayerDrop's five pipeline
    runs took 25 s on the clean-clone CI and over 120 s with two busy loops beside the suite
    (each run 5 s quiet, 23-28 s so loaded: every micro-batch crosses threads and sockets)."""
    return [pytest.param(n, marks=pytest.mark.timeout(max(120, 60 * CASES[n].ps_repeats))) for n in names]


@functools.cache
def reference(name: str) -> Outcome:
    """The one-process run of a case (computed once per session; deterministic)."""
    return train_one_process(CASES[name])


def check(case: Case, train: Callable[[Case], Outcome], repeats: int | None = None) -> Outcome:
    """Train ``repeats`` (default ``case.repeats``) times; every run's state must be whole and
    its samples right, and the mean metric must meet the bar. Returns the last run."""
    ref = reference(case.name)
    runs = [train(case) for _ in range(repeats or case.repeats)]
    out = runs[-1]
    got, want = statistics.fmean(r.metrics[case.metric] for r in runs), ref.metrics[case.metric]
    print(f"{case.name} {out.mode}: {case.metric} {got:.4f} (mean of {len(runs)}: "
          f"{', '.join(f'{r.metrics[case.metric]:.4f}' for r in runs)}) vs one process {want:.4f}; "
          f"{out.samples} samples in {out.seconds:.1f} s ({out.samples_per_sec:.0f}/s; one process "
          f"{ref.samples_per_sec:.0f}/s); {out.extra}")
    problems = [p for r in runs for p in state_problems(case, r)]
    for r in runs:  # (SAMPLE_SLACK: a parameter-server window may wait past its samples)
        slack = max(2 * case.batch_size, SAMPLE_SLACK * case.samples)
        assert abs(r.samples - case.samples) <= slack, (r.samples, case.samples)
    if case.higher_is_better:
        bound_ok = got >= want - ACCURACY_MARGIN
        bound = f"{case.metric} {got:.4f} < one process {want:.4f} - {ACCURACY_MARGIN}"
    else:
        bound_ok = got <= LOSS_FACTOR * want
        bound = f"{case.metric} {got:.4f} > {LOSS_FACTOR} x one process {want:.4f}"
    assert not problems and bound_ok, "; ".join(problems + ([] if bound_ok else [bound]))
    return out


def test_one_process_references_learn() -> None:
    """The references themselves: far above chance, so the comparisons mean something."""
    floors = {"gpt2": ("loss", 3.0), "bert": ("accuracy", 0.9), "resnet": ("accuracy", 0.95),
              "frozen": ("accuracy", 0.9), "layerdrop": ("accuracy", 0.93), "lstm": ("accuracy", 0.9),
              "bf16": ("accuracy", 0.9)}
    for name, (metric, floor) in floors.items():
        got = reference(name).metrics[metric]
        assert (got <= floor) if metric == "loss" else (got >= floor), (name, metric, got)
        assert not state_problems(CASES[name], reference(name)), name


@pytest.mark.parametrize("name", _timed(list(CASES)))
def test_parameter_server_two_workers(name: str) -> None:
    out = check(CASES[name], train_ps, CASES[name].ps_repeats)
    if name == "gpt2":  # the tie survives on every worker: one tensor, not two copies
        for model in out.models:
            head, wte = model.get_submodule("lm_head").weight, model.get_submodule("transformer.wte").weight
            assert isinstance(head, torch.Tensor) and isinstance(wte, torch.Tensor)
            assert head.data_ptr() == wte.data_ptr()


@pytest.mark.parametrize("name", _timed(list(CASES)))
def test_peer_mode_per_step_averaging(name: str) -> None:
    check(CASES[name], lambda case: train_peer(case, mode="step"))


@pytest.mark.parametrize("name", _timed(list(CASES)))
def test_peer_mode_diloco(name: str) -> None:
    """DiLoCo's outer step as plain averaging (outer SGD lr 1, no momentum): at 25-60 rounds of
    10 inner steps the default Nesterov outer step (lr 0.7, momentum 0.9, tuned for hundreds of
    inner steps over thousands of rounds) overshoots: BERT stayed at chance with it."""
    check(CASES[name], lambda case: train_peer(case, mode="diloco", inner_steps=10, outer_lr=1.0,
                                               outer_momentum=0.0))


@pytest.mark.parametrize("name", _timed(SEQUENTIAL))
def test_pipeline_two_stages(name: str) -> None:
    check(CASES[name], lambda case: train_pipeline(case, stages=2))


@pytest.mark.parametrize("name", ["resnet", "frozen", "lstm"])
def test_the_pipeline_is_one_process_at_the_same_micro_batches_bit_for_bit(name: str) -> None:
    """The synchronous schedule steps once per batch of ``chunks`` micro-batches: what one
    process computes accumulating the same micro-batches, to the bit (held-out loss and
    accuracy). Against one process at the whole batch the ResNet loses 0.028 accuracy (0.955 vs
    0.983): BatchNorm normalises each micro-batch of 16 on its own, in one process as in the
    pipeline. (LayerDrop draws its layers in another order; bf16 sums in another order.)"""
    case = CASES[name]
    ref = train_one_process(case, chunks=2)
    out = train_pipeline(case, stages=2, chunks=2)
    assert out.metrics == ref.metrics, (out.metrics, ref.metrics)
    assert not state_problems(case, out)


@pytest.mark.parametrize("name,downlink", [("gpt2", "uniform"), ("resnet", "fp16"), ("bf16", "uniform"),
                                           ("bf16", "fp16"), ("resnet", "half")])
def test_parameter_server_with_a_lossy_downlink(name: str, downlink: str) -> None:
    """The shared downlink log with a lossy codec (4-bit uniform: chains of several entries;
    fp16), or the half downlink (every answer the weights rounded to float16, fp16's default),
    on models nobody here wrote, BatchNorm and a bf16 model included: the same bound against
    one process, and every worker ends on the master (the final weights)."""
    lossy = {"compression.downlink": downlink}
    out = check(CASES[name], lambda case: train_ps(case, coordinator_overrides=lossy),
                CASES[name].ps_repeats)
    sent = out.extra["downlink"]
    assert sent["drift"] <= 0.01, sent
    if downlink == "half":  # no log: the rounded weights answer, within one rounding of the master
        assert sent["codec"] == "half" and sent["answers"]["chain"] == 0 and sent["answers"]["full"] > 0, sent
        assert 0.0 < sent["drift"] < 2.0 ** -11, sent
    elif not (name == "bf16" and downlink == "fp16"):
        assert sent["answers"]["chain"] > 0, sent  # the log answered
    else:  # an fp16 delta is as large as the bf16 weights: the weights go instead
        assert sent["answers"]["chain"] == 0 and sent["answers"]["full"] > 0, sent
