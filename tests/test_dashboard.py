"""The live dashboard in headless Chromium, against a real coordinator and two workers.

Chromium renders the page served by the coordinator's HTTP port, runs its polling script for
a few seconds of virtual time and dumps the resulting DOM; the test reads the DOM: the workers
of the running cluster are in the table, the state says running and the loss chart has points.

Chromium is the Debian package (`apt-get install -y chromium`). With the environment variable
``SWARMTRAIN_DASHBOARD_SCREENSHOT=docs/dashboard.png`` the test also writes a screenshot there
(that is how the one in the docs is made).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import tempfile
import urllib.request
from pathlib import Path

import pytest
from test_ps_inprocess import coordinator, worker  # the in-process cluster helpers

from swarmtrain.app.ops import serve_coordinator

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOT_ENV = "SWARMTRAIN_DASHBOARD_SCREENSHOT"


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise AssertionError("headless Chromium is needed: apt-get install -y chromium")


async def _history_of(url: str, points: int, timeout: float = 90) -> None:
    """Wait until the node's sampled history (``/api/history``, one point a second) holds
    ``points`` points."""
    def count() -> int:
        with urllib.request.urlopen(url + "api/history", timeout=10) as reply:
            return len(json.loads(reply.read()))

    loop = asyncio.get_running_loop()
    async with asyncio.timeout(timeout):
        while await loop.run_in_executor(None, count) < points:
            await asyncio.sleep(0.5)


async def run_chromium(url: str, *extra: str, budget_ms: int = 8000, timeout: float = 120) -> str:
    """Chromium's stdout after loading ``url`` headless for ``budget_ms`` of virtual time."""
    with tempfile.TemporaryDirectory(prefix="swarm-chromium-") as profile:
        proc = await asyncio.create_subprocess_exec(
            chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-dev-shm-usage", f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}",
            *extra, url, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise AssertionError(f"chromium did not finish within {timeout} s") from None
    assert proc.returncode == 0, f"chromium exited {proc.returncode}: {err.decode()[-2000:]}"
    return out.decode()


def test_dashboard_shows_the_workers_state_and_a_live_loss_chart() -> None:
    screenshot = os.environ.get(SCREENSHOT_ENV, "")

    async def main() -> str:
        c = coordinator(**{"training.min_workers": 2, "training.max_steps": 0,
                           "training.eval_interval_sec": 1.0})
        await c.start()
        # a snapshot per request: Chromium's virtual time polls faster than real time, and its
        # 8 s of polling must see 8 s of changing status
        http = await serve_coordinator(c, "127.0.0.1", 0, max_age=0)
        # throttled workers: the run must still be going while Chromium polls it
        ws = [worker(c.port, **{"training.worker_id": name, "training.speed": speed})
              for name, speed in (("laptop-a", 0.2), ("desktop-b", 0.4))]
        tasks = [asyncio.create_task(w.run_async()) for w in ws]
        url = f"http://127.0.0.1:{http.port}/"
        try:
            async with asyncio.timeout(60):
                while c.version < 10 or not c.metrics or len(c._connected()) < 2:
                    await asyncio.sleep(0.05)
            dom = await run_chromium(url, "--dump-dom")
            if screenshot:
                await _history_of(url, points=20)  # charts with a history worth looking at
                await run_chromium(url, f"--screenshot={ROOT / screenshot}", "--window-size=1280,900",
                                   "--hide-scrollbars", budget_ms=15000)
            await asyncio.wait_for(c.shutdown_cluster("test done"), 30)
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            return dom
        finally:
            for t in tasks:
                t.cancel()
            await http.close()
            await c.close()

    dom = asyncio.run(main())
    rows = re.findall(r'<tr class="worker[^"]*" data-worker="([^"]+)"', dom)
    assert sorted(rows) == ["desktop-b", "laptop-a"], dom[-3000:]
    assert re.search(r'<span id="state" class="running">running</span>', dom), dom[:3000]
    loss_chart = re.search(r'<svg class="chart" id="chart-loss" data-points="(\d+)"[^>]*>(.*?)</svg>',
                           dom, re.S)
    assert loss_chart, dom[:3000]
    points = int(loss_chart.group(1))
    assert points >= 4, f"the loss chart has {points} points after 8 s of polling"
    assert loss_chart.group(2).count('class="point"') == points
    throughput = re.search(r'id="chart-throughput" data-points="(\d+)"', dom)
    assert throughput and int(throughput.group(1)) >= 1
    assert re.search(r'id="metric">accuracy 0\.\d+<', dom), "held-out accuracy missing"
    assert 'class="event"' in dom and "listening" in dom
    if screenshot:
        assert (ROOT / screenshot).stat().st_size > 10_000
