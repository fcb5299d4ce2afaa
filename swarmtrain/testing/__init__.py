"""Test and benchmark helpers: a simulated LAN of network namespaces (needs root), swarmtrain
processes on it (:mod:`swarmtrain.testing.cluster`) and on loopback (:mod:`swarmtrain.testing.procs`)."""

from swarmtrain.testing.lan import Host, LanError, SimulatedLAN, cleanup_stale, netns_available

__all__ = ["Host", "LanError", "SimulatedLAN", "cleanup_stale", "netns_available"]
