"""What the pipeline tests share: quick transport timeouts, a bounded event loop run, and
one PyTorch thread per operation (several stage threads share a 2-core machine)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterator
from typing import Any

import torch

from swarmtrain.transport import Timeouts

__all__ = ["FAST_TIMEOUTS", "one_torch_thread", "run_bounded"]

#: transport timeouts for stages and routers on loopback (a dead peer is noticed in seconds)
FAST_TIMEOUTS = Timeouts(connect=5.0, handshake=5.0, heartbeat_interval=1.0, heartbeat_timeout=10.0,
                         send=10.0)


def run_bounded(coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
    """Run ``coro`` in a new event loop; TimeoutError after ``timeout`` seconds."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """PyTorch intra-op threads set to 1 inside (restored after): several compute threads of
    stages in one process would only fight over the cores otherwise."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
