"""mDNS helpers both discovering modes share (peers and pipeline stages): which of this host's
addresses to announce, which of a multi-homed node's addresses to dial, and one log line
instead of a traceback when python-zeroconf loses a network link, and a browser whose questions
are answered by multicast."""

from __future__ import annotations

import errno
import ipaddress
import logging
from collections.abc import Callable, Sequence

import ifaddr
from zeroconf import DNSQuestionType, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser

__all__ = ["browse", "default_addresses", "local_ipv4_networks", "pick_host", "quiet_zeroconf_network_errors"]


#: send/receive errors of a network that went away: a link down, an address removed
_NETWORK_ERRNOS = frozenset({errno.ENETUNREACH, errno.ENETDOWN, errno.EHOSTUNREACH, errno.EHOSTDOWN,
                             errno.EADDRNOTAVAIL, errno.ENODEV, errno.ENOBUFS, errno.EPERM})


class _ZeroconfNetworkErrors(logging.Filter):
    """Turns python-zeroconf's log records of expected network errors into one line.

    python-zeroconf logs a failed send or receive (``Error with socket ...``) with the
    exception's traceback, as a warning the first time per socket and at debug afterwards.
    For the errors of a link that went down the traceback says nothing useful: the record
    keeps its level and loses the traceback, and says what it means. Other records, and
    other exceptions, pass unchanged.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, OSError) and exc.errno in _NETWORK_ERRNOS:
            record.msg = (f"mDNS: {record.getMessage()} (a network link is down or an address went "
                          "away; discovery goes on and recovers when it is back)")
            record.args = ()
            record.exc_info = None
            record.exc_text = None
        return True


_ZEROCONF_FILTER = _ZeroconfNetworkErrors()


def quiet_zeroconf_network_errors() -> None:
    """Install the filter on python-zeroconf's logger (every module of it logs there); idempotent."""
    zeroconf_log = logging.getLogger("zeroconf")
    if _ZEROCONF_FILTER not in zeroconf_log.filters:
        zeroconf_log.addFilter(_ZEROCONF_FILTER)


def browse(zc: Zeroconf, service_type: str,
           handler: Callable[[Zeroconf, str, str, ServiceStateChange], None]) -> AsyncServiceBrowser:
    """Browse for ``service_type``, every question asking for a multicast answer (QM).

    python-zeroconf's default first question asks for a unicast answer (QU). The answer goes to
    port 5353 of the asking host, and when more than one mDNS socket is bound there (another
    swarmtrain process, Avahi, several roles on one machine) the kernel hands it to one of them,
    not necessarily the asker. The asker then learns nothing until its next question, a second
    later. A multicast answer reaches every socket, so the first question finds what is there.
    """
    return AsyncServiceBrowser(zc, service_type, handlers=[handler], question_type=DNSQuestionType.QM)


def local_ipv4_networks() -> list[ipaddress.IPv4Interface]:
    """This host's IPv4 interface addresses, loopback included."""
    out = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if ip.is_IPv4 and isinstance(ip.ip, str):
                out.append(ipaddress.IPv4Interface(f"{ip.ip}/{ip.network_prefix}"))
    return out


def pick_host(addresses: Sequence[str], local: Sequence[ipaddress.IPv4Interface]) -> str | None:
    """The address of a multi-homed peer to use: one on a subnet we share, else any."""
    ips = [ipaddress.IPv4Address(a) for a in addresses]
    for ip in ips:
        if not ip.is_loopback and any(ip in net.network for net in local if not net.is_loopback):
            return str(ip)
    ranked = sorted(ips, key=lambda ip: ip.is_loopback)
    return str(ranked[0]) if ranked else None


def default_addresses(host: str, local: Sequence[ipaddress.IPv4Interface]) -> list[str]:
    """`host` if it is one IPv4 address, else every non-loopback one (else loopback)."""
    try:
        ip = ipaddress.IPv4Address(host)
    except ValueError:
        ip = ipaddress.IPv4Address(0)
    if not ip.is_unspecified:
        return [str(ip)]
    return [str(n.ip) for n in local if not n.is_loopback] or ["127.0.0.1"]
