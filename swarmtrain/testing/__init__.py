"""Test and benchmark helpers: a simulated LAN of network namespaces (needs root)."""

from swarmtrain.testing.lan import Host, LanError, SimulatedLAN, cleanup_stale, netns_available

__all__ = ["Host", "LanError", "SimulatedLAN", "cleanup_stale", "netns_available"]
