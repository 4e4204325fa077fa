"""The network fault layer: a TCP proxy with run-time switchable toxics, links of proxies, and iptables.

Components are wired through a :class:`Proxy` (client → router, router → worker, anything → etcd,
anything → broker): the proxy listens on a loopback port and forwards every accepted connection to its
upstream. Toxics, in the spirit of Toxiproxy, change what flows; they compose, and may be added or removed
at any time.

Modules:

- :mod:`.toxics`: the :class:`Toxic` base and the byte toxics (:class:`Latency`, :class:`Bandwidth`,
  :class:`Slicer`, :class:`Reset`, :class:`Blackhole`, :class:`LimitData`, :class:`SlowClose`,
  :class:`Partition`), with the table of what each does;
- :mod:`.sse`: the SSE toxics (:class:`SseCut`, :class:`SseStall`, :class:`SseCorrupt`,
  :class:`SseDropDone`) and the HTTP/1.1 response parser of ``http=True`` proxies that feeds them events;
- :mod:`.proxy`: :class:`Proxy` (connections, upstream failover) and its counters, :class:`ProxyStats`;
- :mod:`.links`: :class:`Link`, a named set of proxies faulted together, and :class:`ProxyRegistry`, which
  finds links by name or glob;
- :mod:`.iptables`: :class:`IptablesFilter`, the optional kernel backend (root and ``iptables``).
"""

from __future__ import annotations

from fleetward.chaos.net.iptables import IptablesFilter
from fleetward.chaos.net.links import Link, ProxyRegistry
from fleetward.chaos.net.proxy import Proxy, ProxyStats
from fleetward.chaos.net.sse import SseCorrupt, SseCut, SseDropDone, SseStall
from fleetward.chaos.net.toxics import (
    Bandwidth,
    Blackhole,
    Direction,
    Latency,
    LimitData,
    Partition,
    Reset,
    Slicer,
    SlowClose,
    Toxic,
)

__all__ = [
    "Bandwidth",
    "Blackhole",
    "Direction",
    "IptablesFilter",
    "Latency",
    "LimitData",
    "Link",
    "Partition",
    "Proxy",
    "ProxyRegistry",
    "ProxyStats",
    "Reset",
    "Slicer",
    "SlowClose",
    "SseCorrupt",
    "SseCut",
    "SseDropDone",
    "SseStall",
    "Toxic",
]
