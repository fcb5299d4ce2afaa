"""A worker's links to the parameter servers of a sharded cluster other than the leader.

The worker registers with the leader (server 0) as with a lone coordinator; the leader's
REGISTER_ACK lists every server and the partition's fingerprint. The worker computes the
partition itself (:mod:`swarmtrain.roles.ps.partition`), refuses to train if it differs, and
opens one :class:`ServerLink` per other server: a connection, a replica of that server's
group, and the queue its answers arrive in. Only the leader's START, PAUSE, RESUME, ASSIGN
and SHUTDOWN count; another server's SHUTDOWN means that server is going away (the worker
waits for it to come back).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from swarmtrain.compression import Compressed
from swarmtrain.errors import ConnectionLost, RefusedError, SwarmError, SwarmTimeout
from swarmtrain.roles.ps.replica import Replica
from swarmtrain.transport import Connection
from swarmtrain.wire import Error, Message, Shutdown, Update, Weights

__all__ = ["ServerLink", "ServerLost", "total_norm"]

log = logging.getLogger("swarmtrain.worker")

#: codecs whose ``values`` part is the decoded gradient's values (so has its norm)
_VALUES_ARE_THE_GRADIENT = frozenset({"none", "fp16", "topk"})


class ServerLost(ConnectionLost):
    """A parameter server other than the leader was lost or cannot be reached: the worker
    connects again (from the leader on, with backoff) and trains once every server is back."""

    def __init__(self, index: int, address: str, why: str) -> None:
        super().__init__(f"parameter server {index} at {address}: {why}")
        self.index, self.address, self.why = index, address, why


@dataclass
class ServerLink:
    """One parameter server (not the leader) as a worker sees it."""

    index: int
    address: str
    replica: Replica
    conn: Connection | None = None
    replies: asyncio.Queue[Message | BaseException] = field(default_factory=asyncio.Queue)
    reader: asyncio.Task[None] | None = None

    async def read(self) -> None:
        """Put this server's answers in :attr:`replies`, until the connection fails (the
        failure is put there too, for the training loop to raise)."""
        assert self.conn is not None
        try:
            while True:
                msg = await self.conn.recv()
                if isinstance(msg, Update | Weights):
                    self.replies.put_nowait(msg)
                elif isinstance(msg, Shutdown):
                    raise ServerLost(self.index, self.address,
                                     f"shut down ({msg.reason or 'no reason given'})")
                elif isinstance(msg, Error):
                    if msg.fatal:
                        raise RefusedError(msg.code, msg.message)
                    log.warning("parameter server %d reports: %.300s [%s]", self.index, msg.message, msg.code)
                # START, PAUSE, RESUME and ASSIGN: the leader's count, this server's not
        except RefusedError as exc:
            self.replies.put_nowait(exc)
        except (SwarmError, ConnectionError) as exc:
            self.replies.put_nowait(exc if isinstance(exc, ServerLost)
                                    else ServerLost(self.index, self.address, f"lost ({exc})"))

    async def next_answer(self, timeout: float) -> None:
        """Apply this server's next answer (an UPDATE) to its replica.

        Raises:
            SwarmTimeout: no answer within ``timeout`` seconds.
            SwarmError: the connection failed (what :meth:`read` put in the queue).
        """
        try:
            async with asyncio.timeout(timeout):
                item = await self.replies.get()
        except TimeoutError:
            raise SwarmTimeout("update", timeout,
                               f"no answer from parameter server {self.index} at {self.address}") from None
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, Update):
            self.replica.apply_update(item)
        elif isinstance(item, Weights):
            self.replica.load_full(item.tensors, item.version)

    def apply_ready(self) -> None:
        """Apply what has arrived (the final weights at the end of the run), raising nothing."""
        while not self.replies.empty():
            item = self.replies.get_nowait()
            if isinstance(item, Weights):
                self.replica.load_full(item.tensors, item.version)

    async def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
            await asyncio.gather(self.reader, return_exceptions=True)
            self.reader = None
        if self.conn is not None:
            await self.conn.close()
            self.conn = None


def total_norm(compressed: Mapping[str, Compressed]) -> float:
    """The L2 norm of a whole compressed gradient, as each server's screen would compute it on
    its slice; 0.0 (unknown: each server judges its slice alone) for codecs whose wire values
    are not the gradient's (QSGD)."""
    parts = []
    for c in compressed.values():
        values = c.parts.get("values")
        if c.codec not in _VALUES_ARE_THE_GRADIENT or values is None:
            return 0.0
        parts.append(float(torch.linalg.vector_norm(values, dtype=torch.float32)))
    norm = math.sqrt(sum(n * n for n in parts))
    return norm if math.isfinite(norm) else math.nan
