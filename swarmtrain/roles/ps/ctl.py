"""A small authenticated client for controlling a running coordinator (`swarmtrain ctl`)."""

from __future__ import annotations

from swarmtrain.errors import RefusedError, SwarmError
from swarmtrain.transport import Timeouts, connect
from swarmtrain.transport.identity import Identity, node_identity
from swarmtrain.transport.tls import TLSConfig
from swarmtrain.wire import CheckpointMsg, Error, Message, Pause, Resume, Shutdown, StatusRequest

__all__ = ["COMMANDS", "ctl_request"]

COMMANDS: dict[str, type[Message]] = {
    "status": StatusRequest,
    "pause": Pause,
    "resume": Resume,
    "checkpoint": CheckpointMsg,
    "shutdown": Shutdown,
}


async def ctl_request(
    host: str, port: int, command: str, *, secret: bytes | None, timeout: float = 30.0,
    tls: TLSConfig | None = None, identity: Identity | None = None,
) -> Message:
    """Send one control command and return the coordinator's answer (over TLS with ``tls``).

    The handshake proves ``identity`` (this machine's node key by default), so the coordinator
    logs and records the command with a verified node id next to the address.

    Raises:
        SwarmError: unknown command, unreachable coordinator, wrong secret, or an ERROR answer.
    """
    if command not in COMMANDS:
        raise SwarmError(f"unknown command {command!r}; choose one of {', '.join(COMMANDS)}")
    if identity is None:
        identity = node_identity("the coordinator records this command by its address only")
    conn = await connect(host, port, secret=secret, tls=tls, role="ctl", identity=identity,
                         timeouts=Timeouts(connect=min(timeout, 10.0), handshake=min(timeout, 10.0)))
    try:
        await conn.send(COMMANDS[command]())
        reply = await conn.recv(timeout=timeout, phase=f"ctl {command}")
    finally:
        await conn.close()
    if isinstance(reply, Error):
        raise RefusedError(reply.code, reply.message)
    return reply
