"""Unequal machines: the throttle, the start-up speed probe, fair (sample-weighted)
aggregation, the memory guard, and `swarmtrain profile`."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess

import pytest

from swarmtrain import hardware
from swarmtrain.errors import ConfigError
from swarmtrain.roles.coordinator import Coordinator
from swarmtrain.roles.worker import Worker
from swarmtrain.testing.procs import swarm_cmd
from tests.test_ps_inprocess import DATA, TASK, coordinator, worker

BIG = {"training.batch_size": 256, "training.accumulation_steps": 4}  # compute-dominated steps


def test_quarter_speed_worker_does_about_a_quarter_of_the_steps() -> None:
    async def main() -> tuple[Coordinator, Worker, Worker]:
        c = coordinator(**{"training.min_workers": 2, "training.max_steps": 150})
        await c.start()
        full = worker(c.port, **{"training.worker_id": "full", **BIG})
        quarter = worker(c.port, **{"training.worker_id": "quarter", **BIG, "training.speed": 0.25})
        tasks = [asyncio.create_task(w.run_async()) for w in (full, quarter)]
        await asyncio.wait_for(c.run(), 120)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        return c, full, quarter

    c, full, quarter = asyncio.run(main())
    # steps each worker computed (the coordinator may drop a very stale one, which would skew
    # its count): about 4x; the unthrottled round trip shrinks it, CPU contention stretches it
    ratio = full.steps / quarter.steps
    assert 2.5 <= ratio <= 7.0, ratio
    shares = {w["id"]: w["share"] for w in c.status()["workers"]}
    assert shares["full"] > 0.7 and abs(sum(shares.values()) - 1) < 1e-9
    # the probe ran with the throttle on, and each worker reported its speed when it joined
    assert 0 < quarter.samples_per_sec < full.samples_per_sec
    assert c.workers["quarter"].hardware["profile"] == hardware.detect().profile.value


def test_gradients_are_weighted_by_the_samples_behind_them() -> None:
    async def main() -> Coordinator:
        c = coordinator(**{"training.min_workers": 2, "training.max_steps": 200})
        await c.start()
        ws = [worker(c.port, **{"training.worker_id": "b64", "training.batch_size": 64}),
              worker(c.port, **{"training.worker_id": "b16", "training.batch_size": 16})]
        tasks = [asyncio.create_task(w.run_async()) for w in ws]
        await asyncio.wait_for(c.run(), 120)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        return c

    c = asyncio.run(main())
    w64, w16 = c.workers["b64"].weight, c.workers["b16"].weight
    assert w64 > 1.0 > w16
    assert 3.0 <= w64 / w16 <= 5.0, (w64, w16)  # 64/16 = 4: each sample counts the same


def test_sample_weight_follows_the_running_mean_and_is_clamped() -> None:
    c = coordinator()
    assert c._sample_weight(32) == 1.0  # the first sets the mean
    for _ in range(100):
        c._sample_weight(32)
    assert c._sample_weight(64) == pytest.approx(64 / (0.9 * 32 + 0.1 * 64))
    assert c._sample_weight(1) == 0.05  # 1/31.8 clamped up
    assert c._sample_weight(100_000) == 4.0


def test_a_batch_that_would_not_fit_in_memory_is_refused_before_training() -> None:
    info = dataclasses.replace(hardware.detect(), available_memory_mb=512)
    with pytest.raises(ConfigError, match=r"batch_size 100000 needs about .* MB .* use batch_size <= \d+"):
        hardware.check_fits(info, batch_size=100_000, sample_bytes=64 * 1024, model_bytes=10**6)
    hardware.check_fits(info, batch_size=64, sample_bytes=64 * 1024, model_bytes=10**6)  # fits
    with pytest.raises(ConfigError, match="batch_size"):
        Worker(TASK.build_model(), TASK.loss, DATA.train, batch_size=10**9, secret=b"x",
               sample_bytes=TASK.sample_bytes_estimate())
    with pytest.raises(ConfigError, match="max_memory_mb|available"):
        Worker(TASK.build_model(), TASK.loss, DATA.train, batch_size=4096, max_memory_mb=1,
               secret=b"x", sample_bytes=TASK.sample_bytes_estimate())


def test_profile_command_prints_detection_recommendation_and_probe() -> None:
    r = subprocess.run(swarm_cmd("profile", "--task", "digits", "--probe-seconds", "0.3"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for word in ("Profile", "Memory", "Cores", "Batch size", "Probe", "samples/s"):
        assert word in r.stdout, (word, r.stdout)
    assert hardware.detect().profile.value in r.stdout
