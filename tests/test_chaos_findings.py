"""What a chaos run on a simulated LAN found (issue #19): a resumed coordinator waiting in
silence, a resume missing from the run log, a status file without a clock, an unlabelled
`ctl status`, a frozen worker blaming the coordinator, runs ending past max_steps."""

from __future__ import annotations

import asyncio

from swarmtrain.roles.ps.worker import Worker
from tests.test_ps_inprocess import coordinator, worker

# --- max_steps ---------------------------------------------------------------------------


def test_a_run_stops_applying_at_exactly_max_steps_with_many_workers() -> None:
    # six small-batch workers send gradients faster than the shutdown goes out: before, the
    # ones already queued on the apply thread were applied too (version 21 or 22 of 20)
    c = coordinator(**{"training.min_workers": 6, "training.max_steps": 20})
    ws: list[Worker] = []

    async def main() -> None:
        await c.start()
        ws.extend(worker(c.port, **{"training.worker_id": f"w{i}", "training.batch_size": 4,
                                    "training.probe_seconds": 0.0}) for i in range(6))
        tasks = [asyncio.create_task(w.run_async()) for w in ws]
        await asyncio.wait_for(c.run(), 120)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)

    asyncio.run(main())
    assert c.version == 20, c.version
    assert c.stats["applied"] == 20
    assert sum(r.steps for r in c.workers.values()) == 20
    # what came after the last update was answered 'finished', not applied
    answered = [w.statuses for w in ws]
    assert all(set(s) <= {"applied", "finished"} for s in answered), answered
