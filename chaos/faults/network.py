"""Network faults: every toxic of the fault proxy as a fault on a link, plus the kernel backend.

Targets name links (``Target(kind="link", ids=("router->worker:node-w0",))``, globs allowed:
``*->etcd``), or the component behind them: ``kind="worker"`` means ``router->worker:<id>``,
``kind="router"`` ``client->router:<id>``, ``kind="etcd"`` every ``*->etcd`` link, ``kind="broker"``
every ``*->broker`` link. The fleet must have been started with the links (``TestFleet(proxy_workers=True,
proxy_clients=True, proxy_control=True)``).

``verify`` waits until the toxic acted (its ``hits`` moved), sending probe traffic through the link while
it waits (``probe: true``): ``GET /health`` and a short streamed completion on HTTP links, ``/health`` on
etcd links, an MQTT CONNECT on broker links. A fault on a link nobody uses and with probes off does not
verify: it did nothing. ``recover`` removes the toxic (held data flows again); ``verify_recovered`` waits
until a probe passes through the link.

Every toxic of the proxy is one fault, declared in one row of :data:`_TOXIC_FAULTS`: its name, summary,
parameters model and toxic class. The toxic is built from the parameters by name (``latency_ms`` goes to
``Latency(latency_ms=...)``); ``probe`` and the timeouts stay with the fault. SSE toxics need HTTP links and
verify with a streamed completion.

``network.down`` (the link's proxies stop listening) and ``network.partition_kernel`` are not toxics and are
written out. ``network.partition_kernel`` drops (or resets) packets to and from the link's upstream ports
with iptables, so every client of that component is cut off, not only the link's (root and the iptables
command).
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import inspect
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import httpx
from pydantic import Field

from fleetward.chaos.fault import FaultContext, Target
from fleetward.chaos.faults._base import (
    BaseFault,
    FaultParams,
    FaultUnavailable,
    ParamsT,
    catalogued,
    eventually,
)
from fleetward.chaos.net import (
    Bandwidth,
    Blackhole,
    IptablesFilter,
    Latency,
    LimitData,
    Link,
    Partition,
    Reset,
    Slicer,
    SlowClose,
    SseCorrupt,
    SseCut,
    SseDropDone,
    SseStall,
    Toxic,
)

__all__ = ["LinkFault", "link_names", "probe_link"]

_MQTT_CONNECT = bytes([0x10, 0x17, 0x00, 0x04]) + b"MQTT" + bytes([0x04, 0x02, 0x00, 0x3C, 0x00, 0x0B]) + b"fw-probe-01"


def link_names(ctx: FaultContext, target: Target) -> list[str]:
    """The link names a target means (see the module docstring)."""
    if target.kind == "link":
        return ctx.resolve(target)
    if target.kind == "worker":
        return [f"router->worker:{w}" for w in ctx.resolve(target)]
    if target.kind == "router":
        return [f"client->router:{r}" for r in ctx.resolve(target)]
    if target.kind in ("etcd", "broker"):
        names: list[str] = ctx.service("proxies").names
        found = fnmatch.filter(names, f"*->{target.kind}")
        if not found:
            raise FaultUnavailable(f"the fleet has no links to {target.kind} (start it with proxy_control=True)")
        return found
    raise FaultUnavailable(f"a network fault targets links, workers, routers, etcd or the broker, not {target.kind}")


async def _probe_one(kind: str, host: str, port: int, timeout: float, *, sse: bool,
                     upstream: tuple[str, int]) -> bool:
    try:
        async with asyncio.timeout(timeout):
            if kind in ("http", "etcd"):
                async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
                    if not sse:
                        return (await client.get(f"http://{host}:{port}/health")).status_code == 200
                    models = (await client.get(f"http://{upstream[0]}:{upstream[1]}/v1/models")).json()
                    body = {"model": models["data"][0]["id"], "prompt": [40, 41], "max_tokens": 8, "stream": True,
                            "return_token_ids": True}
                    async with client.stream("POST", f"http://{host}:{port}/v1/completions", json=body) as r:
                        text = (await r.aread()).decode(errors="replace")
                    return r.status_code == 200 and "data: [DONE]" in text
            reader, writer = await asyncio.open_connection(host, port)
            try:
                if kind == "mqtt":
                    writer.write(_MQTT_CONNECT)
                    await writer.drain()
                    ack = await reader.readexactly(4)
                    writer.write(bytes([0xE0, 0x00]))  # DISCONNECT
                    return ack[0] == 0x20 and ack[3] == 0
                return True
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
    except (OSError, TimeoutError, httpx.HTTPError, asyncio.IncompleteReadError, KeyError, ValueError, IndexError):
        return False


async def probe_link(link: Link, *, timeout: float = 2.0, sse: bool = False) -> bool:
    """Whether traffic passes end to end through every proxy of the link (see the module docstring)."""
    results = [await _probe_one(link.probe, p.host, p.port, timeout, sse=sse and link.probe == "http",
                                upstream=p.upstreams[0]) for p in link.proxies]
    return all(results)


class LinkParams(FaultParams):
    direction: Literal["upstream", "downstream", "both"] = Field(
        "downstream", description="upstream: client → server; downstream: server → client")
    toxicity: float = Field(1.0, ge=0, le=1, description="chance that a given connection is affected")
    probe: bool = Field(True, description="send probe traffic through the link while verifying")


class SseParams(FaultParams):
    toxicity: float = Field(1.0, ge=0, le=1, description="chance that a given response is affected")
    streams: int | None = Field(None, ge=1, description="affect at most this many responses (None: all)")
    probe: bool = Field(True, description="stream a short completion through the link while verifying")


class LinkFault(BaseFault[ParamsT]):
    """A toxic on every targeted link (subclasses say which)."""

    family = "network"
    sse_probe: ClassVar[bool] = False

    def setup(self) -> None:
        self._added: list[tuple[Link, Toxic]] = []

    def toxics(self) -> list[Toxic]:
        raise NotImplementedError

    def links(self, ctx: FaultContext) -> list[Link]:
        return [ctx.service(f"proxy:{n}") for n in self.targets]

    async def inject(self, ctx: FaultContext) -> None:
        self.targets = link_names(ctx, self.target)
        for link in self.links(ctx):
            for toxic in self.toxics():
                link.add(toxic)
                self._added.append((link, toxic))

    @property
    def hits(self) -> int:
        return sum(t.hits for _, t in self._added)

    async def verify(self, ctx: FaultContext) -> bool:
        if not self._added:
            return False
        params: Any = self.params  # LinkParams or SseParams: both say whether to probe
        probes: list[asyncio.Task[bool]] = []
        try:
            async def acted() -> bool:
                if self.hits > 0:
                    return True
                if params.probe and all(t.done() for t in probes):
                    for link in {id(k): k for k, _ in self._added}.values():
                        probes.append(asyncio.create_task(probe_link(link, timeout=2.0, sse=self.sse_probe)))
                return False

            ok = await eventually(acted, self.params.verify_timeout_s, 0.05)
        finally:
            for t in probes:
                t.cancel()
            for t in probes:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        self.detail["hits"] = self.hits
        return ok

    async def recover(self, ctx: FaultContext) -> None:
        for link, toxic in self._added:
            link.remove(toxic)

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        links = {id(k): k for k, _ in self._added}.values()
        if any(toxic in link.toxics for link, toxic in self._added):
            return False

        async def through() -> bool:
            return all([await probe_link(k, timeout=2.0) for k in links])

        return await eventually(through, self.params.recover_timeout_s, 0.2)


# -- one fault per toxic ----------------------------------------------------------------------------------------


class LatencyParams(LinkParams):
    latency_ms: float = Field(200.0, ge=0)
    jitter_ms: float = Field(0.0, ge=0)


class BandwidthParams(LinkParams):
    rate_bps: int = Field(2048, ge=1, description="bytes per second")


class SlicerParams(LinkParams):
    average_size: int = Field(8, ge=1)
    size_variation: int = Field(4, ge=0)
    delay_ms: float = Field(2.0, ge=0)


class ResetParams(LinkParams):
    timeout_ms: float = Field(0.0, ge=0, description="how long a connection lives before its RST")


class BlackholeParams(LinkParams):
    direction: Literal["upstream", "downstream", "both"] = "both"
    timeout_ms: float = Field(0.0, ge=0, description="> 0: close swallowed connections after this long")


class LimitDataParams(LinkParams):
    bytes: int = Field(1024, ge=0, description="bytes a connection may carry in the direction before it is closed")


class SlowCloseParams(LinkParams):
    delay_ms: float = Field(1000.0, ge=0)


class PartitionParams(LinkParams):
    direction: Literal["upstream", "downstream", "both"] = Field(
        "both", description="both: two-way; upstream/downstream: one-way (requests arrive, answers do not)")


class SseCutParams(SseParams):
    after_events: int = Field(8, ge=0, description="events delivered before the cut")
    reset: bool = Field(False, description="cut with RST instead of FIN")


class SseStallParams(SseParams):
    after_events: int = Field(8, ge=0, description="events delivered before the stall")


class SseCorruptParams(SseParams):
    after_events: int = Field(4, ge=0, description="the first token-carrying event at or after this one")
    count: int = Field(1, ge=1, description="events changed per response")


@dataclass(frozen=True)
class _ToxicFault:
    """One catalogued fault that is one toxic on every targeted link.

    Each parameter of ``params`` goes to the toxic's constructor argument of the same name, except the
    fault's own (``probe``, the timeouts) and those in ``ignored``; a parameter the toxic does not take is
    an error when the catalogue is built, not a silently dropped setting.
    """

    name: str
    summary: str
    params: type[FaultParams]
    toxic: type[Toxic]
    sse_probe: bool = False  # verify with a streamed completion (SSE toxics always do)
    ignored: tuple[str, ...] = ()  # parameters the fault takes but does not pass to the toxic


_TOXIC_FAULTS = (
    _ToxicFault("network.latency",
                "delay every piece of data on a link by latency_ms ± jitter_ms (order kept, throughput not)",
                LatencyParams, Latency),
    _ToxicFault("network.bandwidth", "limit a link to rate_bps bytes per second", BandwidthParams, Bandwidth),
    _ToxicFault("network.slicer",
                "cut a link's data into small packets (average_size ± size_variation bytes) delay_ms apart",
                SlicerParams, Slicer),
    # A reset acts on whole connections: the toxic keeps its own direction (both) whatever the parameter says.
    _ToxicFault("network.reset",
                "reset (TCP RST) every connection on a link, open and new, timeout_ms after it is seen",
                ResetParams, Reset, ignored=("direction",)),
    _ToxicFault("network.blackhole",
                "accept and read, deliver nothing (data is lost); on recovery such connections are reset",
                BlackholeParams, Blackhole),
    # Probed with a streamed completion: a /health answer is shorter than the default budget, never reaching it.
    _ToxicFault("network.limit_data", "close each connection once it carried `bytes` bytes in the direction",
                LimitDataParams, LimitData, sse_probe=True),
    _ToxicFault("network.slow_close", "pass a connection's close (FIN) on delay_ms late", SlowCloseParams, SlowClose),
    _ToxicFault("network.partition",
                "partition a link one way or both ways: nothing is delivered, nothing is lost; it flows on recovery",
                PartitionParams, Partition),
    _ToxicFault("network.sse_cut", "cut an SSE response after N events (the client sees exactly N, then EOF)",
                SseCutParams, SseCut),
    _ToxicFault("network.sse_stall",
                "stall SSE responses after N events, connection kept open; they flow again on recovery",
                SseStallParams, SseStall),
    _ToxicFault("network.sse_corrupt",
                "change a token id in the token_ids of an SSE data event (HTTP 200, wrong token)",
                SseCorruptParams, SseCorrupt),
    _ToxicFault("network.sse_drop_done", "drop `data: [DONE]` from SSE responses (they still end properly)",
                SseParams, SseDropDone),
)

# Parameters every link fault has for itself (how it verifies and recovers), never for its toxic.
_FAULT_ONLY = frozenset(FaultParams.model_fields) | {"probe"}


def _constructor_arguments(toxic: type[Toxic]) -> frozenset[str]:
    """The named arguments ``toxic`` takes, its bases' included (a subclass passes ``**kw`` on to them)."""
    names: set[str] = set()
    for cls in toxic.__mro__[:toxic.__mro__.index(Toxic) + 1]:
        init = vars(cls).get("__init__")
        if init is not None:
            names.update(p.name for p in inspect.signature(init).parameters.values()
                         if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self")
    return frozenset(names)


class _OneToxicFault(LinkFault[ParamsT]):
    """A :class:`LinkFault` whose one toxic is built from its parameters (see :class:`_ToxicFault`)."""

    toxic: ClassVar[type[Toxic]]
    arguments: ClassVar[tuple[str, ...]]  # the parameters passed on to the toxic, by name

    def toxics(self) -> list[Toxic]:
        return [self.toxic(**{name: getattr(self.params, name) for name in self.arguments})]

    async def inject(self, ctx: FaultContext) -> None:
        if self.toxic.sse:
            self.targets = link_names(ctx, self.target)
            for link in self.links(ctx):
                if not link.http:
                    raise FaultUnavailable(f"{self.name} needs an HTTP link; {link.name} is plain TCP")
        await super().inject(ctx)


def _catalogue(entry: _ToxicFault) -> type[LinkFault]:
    """Make ``entry``'s fault class and register it in the catalogue."""
    passed = set(entry.params.model_fields) - _FAULT_ONLY - set(entry.ignored)
    unknown = passed - _constructor_arguments(entry.toxic)
    if unknown:
        raise TypeError(f"{entry.name}: {entry.toxic.__name__} takes no {', '.join(sorted(unknown))}")

    class Fault(_OneToxicFault[FaultParams]):
        name = entry.name
        Params = entry.params  # a class made at run time: its params named outright
        toxic = entry.toxic
        arguments = tuple(sorted(passed))
        sse_probe = entry.sse_probe or entry.toxic.sse

    Fault.__name__ = Fault.__qualname__ = "Net" + entry.name.removeprefix("network.").title().replace("_", "")
    catalogued(entry.summary, target="link")(Fault)
    return Fault


for _entry in _TOXIC_FAULTS:
    _catalogue(_entry)


# -- faults that are not toxics -----------------------------------------------------------------------------------


class DownParams(FaultParams):
    pass


@catalogued("take a link down: nothing listens (connection refused) and open connections are reset", target="link")
class NetDown(BaseFault[DownParams]):
    name = "network.down"
    family = "network"

    def setup(self) -> None:
        self._down: list[Link] = []

    async def inject(self, ctx: FaultContext) -> None:
        self.targets = link_names(ctx, self.target)
        for n in self.targets:
            link: Link = ctx.service(f"proxy:{n}")
            self._down.append(link)
            await link.disable()

    async def verify(self, ctx: FaultContext) -> bool:
        async def refused() -> bool:
            for link in self._down:
                for p in link.proxies:
                    try:
                        _, w = await asyncio.open_connection(p.host, p.port)
                    except OSError:
                        continue
                    w.close()
                    return False
            return True

        return bool(self._down) and await eventually(refused, self.params.verify_timeout_s)

    async def recover(self, ctx: FaultContext) -> None:
        for link in self._down:
            await link.enable()

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        async def through() -> bool:
            return all([await probe_link(k) for k in self._down])

        return await eventually(through, self.params.recover_timeout_s, 0.2)


class KernelPartitionParams(FaultParams):
    action: Literal["drop", "reset"] = Field("drop", description="drop: silent partition; reset: RST")


@catalogued("iptables: drop (or reset) every packet to and from the link's upstream ports (root)",
            needs_root=True, target="link")
class NetPartitionKernel(BaseFault[KernelPartitionParams]):
    name = "network.partition_kernel"
    family = "network"

    def setup(self) -> None:
        self._filter: IptablesFilter | None = None
        self._ports: list[tuple[str, int]] = []
        self._links: list[Link] = []

    async def inject(self, ctx: FaultContext) -> None:
        reason = IptablesFilter.unavailable_reason()
        if reason:
            raise FaultUnavailable(reason)
        self.targets = link_names(ctx, self.target)
        self._links = [ctx.service(f"proxy:{n}") for n in self.targets]
        self._filter = IptablesFilter(f"{self.targets[0]}"[:20])
        p = self.params
        for link in self._links:
            for proxy in link.proxies:
                for host, port in proxy.upstreams:
                    self._ports.append((host, port))
                    await self._filter.block(port, action=p.action)
        self.detail["ports"] = [port for _, port in self._ports]

    async def verify(self, ctx: FaultContext) -> bool:
        async def cut() -> bool:
            for host, port in self._ports:
                try:
                    async with asyncio.timeout(0.5):
                        _, w = await asyncio.open_connection(host, port)
                    w.close()
                    return False
                except (OSError, TimeoutError):
                    continue
            return True

        return bool(self._ports) and await eventually(cut, self.params.verify_timeout_s)

    async def recover(self, ctx: FaultContext) -> None:
        if self._filter is not None:
            await self._filter.clear()

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        async def through() -> bool:
            return all([await probe_link(k) for k in self._links])

        return await eventually(through, self.params.recover_timeout_s, 0.2)
