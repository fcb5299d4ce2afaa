"""asyncio TCP transport: authenticated handshake, optional mutual TLS, heartbeats, bounded
send queues."""

from swarmtrain.transport.connection import Connection, Timeouts
from swarmtrain.transport.endpoints import Server, connect, is_loopback_host, start_server
from swarmtrain.transport.tls import TLSConfig

__all__ = ["Connection", "Timeouts", "Server", "TLSConfig", "connect", "start_server", "is_loopback_host"]
