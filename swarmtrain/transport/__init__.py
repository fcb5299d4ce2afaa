"""asyncio TCP transport: authenticated handshake, heartbeats, bounded send queues."""

from swarmtrain.transport.connection import Connection, Timeouts
from swarmtrain.transport.endpoints import Server, connect, is_loopback_host, start_server

__all__ = ["Connection", "Timeouts", "Server", "connect", "start_server", "is_loopback_host"]
