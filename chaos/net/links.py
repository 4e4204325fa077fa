"""Links: named sets of proxies faulted together, and the registry that finds them.

:class:`Link` is a named set of proxies faulted together (e.g. ``agent->etcd``: one proxy per etcd
member); :class:`ProxyRegistry` finds links by name or glob (``*->etcd``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from fleetward.chaos.net.proxy import Proxy, ProxyStats
from fleetward.chaos.net.toxics import Toxic

__all__ = ["Link", "ProxyRegistry"]


@dataclass
class Link:
    """A named set of proxies that are faulted together (``agent->etcd``: one proxy per etcd member)."""

    name: str
    proxies: list[Proxy]
    probe: str = "tcp"  # how a fault checks the link end to end: http, etcd, mqtt or tcp

    @property
    def http(self) -> bool:
        return all(p.http for p in self.proxies)

    def add(self, toxic: Toxic) -> Toxic:
        """The same toxic on every proxy of the link (its ``hits`` add up)."""
        for p in self.proxies:
            p.add(toxic)
        return toxic

    def remove(self, toxic: Toxic | str) -> None:
        for p in self.proxies:
            p.remove(toxic)

    def clear(self) -> None:
        for p in self.proxies:
            p.clear()

    @property
    def toxics(self) -> list[Toxic]:
        seen: dict[str, Toxic] = {}
        for p in self.proxies:
            for t in p.toxics:
                seen.setdefault(t.name, t)
        return list(seen.values())

    def stats(self) -> ProxyStats:
        total = ProxyStats()
        for p in self.proxies:
            s = p.stats
            total.connections_total += s.connections_total
            total.connections_open += s.connections_open
            total.connect_failures += s.connect_failures
            total.resets += s.resets
            total.responses += s.responses
            total.sse_events += s.sse_events
            for d in ("upstream", "downstream"):
                total.bytes_in[d] += s.bytes_in[d]
                total.bytes_out[d] += s.bytes_out[d]
        return total

    async def disable(self) -> None:
        for p in self.proxies:
            await p.disable()

    async def enable(self) -> None:
        for p in self.proxies:
            await p.enable()

    async def aclose(self) -> None:
        for p in self.proxies:
            await p.aclose()


class ProxyRegistry:
    """Every link of a fleet, by name. Names are ``<from>-><to>``, e.g. ``router->worker:node-w0``,
    ``client->router:r0``, ``agent->etcd``, ``r0->broker``; :meth:`select` takes globs (``*->etcd``)."""

    def __init__(self) -> None:
        self._links: dict[str, Link] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._links

    def __iter__(self) -> Iterator[Link]:
        return iter(list(self._links.values()))

    @property
    def names(self) -> list[str]:
        return sorted(self._links)

    def get(self, name: str) -> Link:
        try:
            return self._links[name]
        except KeyError:
            raise KeyError(f"no link named {name!r}; links: {', '.join(self.names) or 'none'}") from None

    def select(self, pattern: str) -> list[Link]:
        return [self._links[n] for n in self.names if fnmatch.fnmatchcase(n, pattern)]

    async def add(self, name: str, upstreams: Sequence[tuple[str, int]] | tuple[str, int], *,
                  http: bool = False, per_upstream: bool = False, probe: str | None = None) -> Link:
        """Start a link: one proxy with failover over ``upstreams``, or one proxy each (``per_upstream``)."""
        if name in self._links:
            raise ValueError(f"link {name} exists already")
        ups = Proxy._norm(upstreams)
        groups = [[u] for u in ups] if per_upstream else [ups]
        proxies = [await Proxy(f"{name}#{i}" if per_upstream else name, g, http=http).start()
                   for i, g in enumerate(groups)]
        link = self._links[name] = Link(name, proxies, probe or ("http" if http else "tcp"))
        return link

    async def aclose(self) -> None:
        for link in list(self._links.values()):
            await link.aclose()
        self._links.clear()
