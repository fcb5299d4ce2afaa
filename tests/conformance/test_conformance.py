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

import pytest
import torch

from .bar import CASES, check, reference, timed
from .harness import state_problems, train_ps

pytestmark = pytest.mark.timeout(300)  # (above HANG_GUARD_S, the harness's own guard on a run)


def test_one_process_references_learn() -> None:
    """The references themselves: far above chance, so the comparisons mean something."""
    floors = {"gpt2": ("loss", 3.0), "bert": ("accuracy", 0.9), "resnet": ("accuracy", 0.95),
              "frozen": ("accuracy", 0.9), "layerdrop": ("accuracy", 0.93), "lstm": ("accuracy", 0.9),
              "bf16": ("accuracy", 0.9)}
    for name, (metric, floor) in floors.items():
        got = reference(name).metrics[metric]
        assert (got <= floor) if metric == "loss" else (got >= floor), (name, metric, got)
        assert not state_problems(CASES[name], reference(name)), name


@pytest.mark.parametrize("name", timed(list(CASES)))
def test_parameter_server_two_workers(name: str) -> None:
    out = check(CASES[name], train_ps, CASES[name].ps_repeats)
    if name == "gpt2":  # the tie survives on every worker: one tensor, not two copies
        for model in out.models:
            head, wte = model.get_submodule("lm_head").weight, model.get_submodule("transformer.wte").weight
            assert isinstance(head, torch.Tensor) and isinstance(wte, torch.Tensor)
            assert head.data_ptr() == wte.data_ptr()


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
