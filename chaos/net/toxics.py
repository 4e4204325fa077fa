"""Toxics: what a :class:`~fleetward.chaos.net.Proxy` does to the data it forwards, in the spirit of Toxiproxy.

This module holds the :class:`Toxic` base and the byte (TCP) toxics; the SSE toxics, which act on the events
of HTTP responses, are in :mod:`fleetward.chaos.net.sse`.

==================  ===========================================================================================
toxic               effect (``direction``: ``upstream`` = client → server, ``downstream`` = server → client)
==================  ===========================================================================================
:class:`Latency`    every piece of data is delivered ``latency_ms`` (± ``jitter_ms``) after it arrived; order is
                    kept and throughput is not reduced (pieces are pipelined)
:class:`Bandwidth`  at most ``rate_bps`` bytes per second
:class:`Slicer`     data is cut into pieces of ``average_size`` ± ``size_variation`` bytes, ``delay_ms`` apart
:class:`Reset`      every connection (open ones and new ones) is reset (TCP RST, ``SO_LINGER`` 0) on both sides
                    ``timeout_ms`` after the toxic first saw it
:class:`Blackhole`  connections are accepted and read, nothing is delivered; with ``timeout_ms`` > 0 they are
                    closed after that long. Swallowed data is lost: when the toxic is removed, connections
                    that lost data are reset (their byte streams are broken), new ones pass
:class:`LimitData`  a connection is closed once ``bytes`` bytes went through in the toxic's direction
:class:`SlowClose`  a close (FIN) is passed on ``delay_ms`` late
:class:`Partition`  nothing is delivered in the toxic's direction, nothing is lost: data waits (the proxy reads
                    a bounded amount, then TCP backpressure stops the sender, as in a real partition) and flows
                    again when the toxic is removed; new connections are not connected upstream until then.
                    ``direction="both"`` is a two-way partition
==================  ===========================================================================================

Toxics compose: each applies in the order it was added, and may be added or removed at any time; open
connections see the change at their next piece of data. ``toxicity`` is the chance a toxic affects a given
connection (SSE toxics: a given response), ``streams`` (SSE toxics) caps how many responses it affects.
Each toxic counts what it did (``hits``), and the proxy counts connections and bytes
(:class:`~fleetward.chaos.net.ProxyStats`), which is what a fault's ``verify`` reads.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, ClassVar, Literal, TypeVar

if TYPE_CHECKING:
    # Only the hooks' signatures name them: the proxy and the HTTP parser import this module, not the reverse.
    from fleetward.chaos.net.proxy import _Conn
    from fleetward.chaos.net.sse import _Response

__all__ = [
    "Bandwidth",
    "Blackhole",
    "Direction",
    "Latency",
    "LimitData",
    "Partition",
    "Reset",
    "Slicer",
    "SlowClose",
    "Toxic",
]

Direction = Literal["upstream", "downstream", "both"]
# One counter for toxic names, connection ids and response ids (the proxy and the HTTP parser draw from it
# too), so an id is unique within the process whichever module made it.
_ids = itertools.count(1)
_N = TypeVar("_N", int, float)


def _checked(name: str, value: _N, low: int) -> _N:
    """``value``, or a ValueError naming the constructor argument when it is below ``low``."""
    if value < low:
        raise ValueError(f"{name} must be >= {low}")
    return value


class _Close(Exception):
    """End the connection: FIN both ways, or RST both ways when ``reset``."""

    def __init__(self, reset: bool = False) -> None:
        super().__init__("reset" if reset else "close")
        self.reset = reset


class Toxic:
    """One fault on a proxy. Subclasses override the hooks they need; the defaults pass everything."""

    kind: ClassVar[str] = "toxic"
    sse: ClassVar[bool] = False  # acts on SSE events (needs an http proxy) rather than bytes

    def __init__(self, *, direction: Direction = "downstream", toxicity: float = 1.0, name: str | None = None,
                 seed: int | None = None) -> None:
        if not 0.0 <= toxicity <= 1.0:
            raise ValueError(f"toxicity must be within 0..1, got {toxicity}")
        self.direction: Direction = direction
        self.toxicity = toxicity
        self.name = name or f"{self.kind}-{next(_ids)}"
        self.hits = 0  # how often it acted (bytes, events, connections: per toxic, see each)
        self._rng = random.Random(seed)
        self._chosen: dict[int, bool] = {}
        self._removed: asyncio.Event | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.direction} hits={self.hits}>"

    @property
    def removed(self) -> asyncio.Event:
        if self._removed is None:
            self._removed = asyncio.Event()
        return self._removed

    @property
    def is_removed(self) -> bool:
        return self._removed is not None and self._removed.is_set()

    def on(self, direction: str) -> bool:
        return self.direction in (direction, "both")

    def picks(self, key: int) -> bool:
        """Whether this toxic affects the connection (or response) ``key``: drawn once, by ``toxicity``."""
        if key not in self._chosen:
            self._chosen[key] = self.toxicity >= 1.0 or self._rng.random() < self.toxicity
        return self._chosen[key]

    async def hold(self) -> None:
        """Wait until the toxic is removed (what partitions and stalls do)."""
        await self.removed.wait()

    # hooks: connection level
    async def before_connect(self, conn: _Conn) -> None:
        """A new connection, before the proxy connects upstream (hold, swallow or reset it here)."""

    def attach(self, conn: _Conn) -> None:
        """The toxic meets an open connection (added while it is open, or the connection is new)."""

    async def data(self, conn: _Conn, direction: str, data: bytes, arrived: float) -> AsyncIterator[bytes]:
        """Transform one piece of data; yield what goes on (each yield is delivered before resuming)."""
        yield data

    async def eof(self, conn: _Conn, direction: str) -> bool:
        """The sender closed its side; return False to swallow the close."""
        return True

    # hooks: SSE events (http proxies, text/event-stream responses)
    async def event(self, conn: _Conn, resp: _Response, event: bytes) -> bytes | None:
        """Before an event is delivered: return it (maybe changed), or None to drop it."""
        return event

    async def delivered(self, conn: _Conn, resp: _Response) -> None:
        """After an event was delivered."""

    def describe(self) -> dict[str, object]:
        body: dict[str, object] = {"kind": self.kind, "name": self.name, "direction": self.direction,
                                   "toxicity": self.toxicity, "hits": self.hits}
        body.update({k: v for k, v in vars(self).items() if not k.startswith("_") and k not in body})
        return body


class Latency(Toxic):
    kind = "latency"

    def __init__(self, latency_ms: float, jitter_ms: float = 0.0, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        if latency_ms < 0 or jitter_ms < 0:
            raise ValueError("latency_ms and jitter_ms must be >= 0")
        self.latency_ms = latency_ms
        self.jitter_ms = jitter_ms
        self._release: dict[tuple[int, str], float] = {}

    async def data(self, conn: _Conn, direction: str, data: bytes, arrived: float) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        jitter = self._rng.uniform(-self.jitter_ms, self.jitter_ms) if self.jitter_ms else 0.0
        key = (conn.id, direction)
        # Never before an earlier piece: order is kept, pieces are pipelined (throughput is not reduced).
        release = max(self._release.get(key, 0.0), arrived + max(0.0, self.latency_ms + jitter) / 1000)
        self._release[key] = release
        self.hits += 1
        delay = release - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        yield data


class Bandwidth(Toxic):
    kind = "bandwidth"

    def __init__(self, rate_bps: int, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.rate_bps = _checked("rate_bps", rate_bps, 1)

    async def data(self, conn: _Conn, direction: str, data: bytes, arrived: float) -> AsyncIterator[bytes]:
        step = max(1, self.rate_bps // 20)  # ~50 ms worth per piece
        for i in range(0, len(data), step):
            piece = data[i:i + step]
            self.hits += len(piece)
            yield piece
            await asyncio.sleep(len(piece) / self.rate_bps)


class Slicer(Toxic):
    kind = "slicer"

    def __init__(self, average_size: int = 8, size_variation: int = 0, delay_ms: float = 1.0, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        if average_size < 1 or not 0 <= size_variation < average_size or delay_ms < 0:
            raise ValueError("need average_size >= 1, 0 <= size_variation < average_size, delay_ms >= 0")
        self.average_size = average_size
        self.size_variation = size_variation
        self.delay_ms = delay_ms

    async def data(self, conn: _Conn, direction: str, data: bytes, arrived: float) -> AsyncIterator[bytes]:
        i = 0
        while i < len(data):
            n = self.average_size + self._rng.randint(-self.size_variation, self.size_variation)
            piece = data[i:i + n]
            i += n
            self.hits += 1
            yield piece
            if i < len(data) and self.delay_ms:
                await asyncio.sleep(self.delay_ms / 1000)


class _TimedToxic(Toxic):
    """A toxic that acts on a connection ``timeout_ms`` after it met it; ``direction`` defaults to both."""

    def __init__(self, timeout_ms: float = 0.0, **kw: object) -> None:
        kw.setdefault("direction", "both")
        super().__init__(**kw)  # type: ignore[arg-type]
        self.timeout_ms = _checked("timeout_ms", timeout_ms, 0)


class Reset(_TimedToxic):
    """Connection level: ``direction`` is ignored. ``hits`` counts connections reset."""

    kind = "reset"

    async def _later(self, conn: _Conn) -> None:
        await asyncio.sleep(self.timeout_ms / 1000)
        if not self.is_removed and not conn.done:
            self.hits += 1
            conn.abort(reset=True)

    def attach(self, conn: _Conn) -> None:
        if self.picks(conn.id):
            conn.spawn(self._later(conn))

    async def before_connect(self, conn: _Conn) -> None:
        if self.picks(conn.id) and self.timeout_ms == 0:
            self.hits += 1
            raise _Close(reset=True)


class Blackhole(_TimedToxic):
    """``hits`` counts bytes swallowed."""

    kind = "blackhole"

    def __init__(self, timeout_ms: float = 0.0, **kw: object) -> None:
        super().__init__(timeout_ms, **kw)
        self._victims: set[int] = set()

    def _touch(self, conn: _Conn) -> None:
        if conn.id in self._victims:
            return
        self._victims.add(conn.id)
        conn.spawn(self._watch(conn))

    async def _watch(self, conn: _Conn) -> None:
        """Close after ``timeout_ms``; once removed, reset a connection that lost data."""
        try:
            if self.timeout_ms:
                async with asyncio.timeout(self.timeout_ms / 1000):
                    await self.hold()
            else:
                await self.hold()
        except TimeoutError:
            conn.abort(reset=False)
            return
        if conn.tainted:
            conn.abort(reset=True)

    async def before_connect(self, conn: _Conn) -> None:
        if self.on("upstream") and self.picks(conn.id):
            conn.swallow = self
            self._touch(conn)

    async def data(self, conn: _Conn, direction: str, data: bytes, arrived: float) -> AsyncIterator[bytes]:
        if not self.picks(conn.id):
            yield data
            return
        self._touch(conn)
        conn.tainted = True
        self.hits += len(data)
        return

    async def eof(self, conn: _Conn, direction: str) -> bool:
        return not self.picks(conn.id)


class LimitData(Toxic):
    """``hits`` counts connections closed."""

    kind = "limit_data"

    def __init__(self, bytes: int, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.bytes = _checked("bytes", bytes, 0)
        self._passed: dict[tuple[int, str], int] = {}

    async def data(self, conn: _Conn, direction: str, data: bytes, arrived: float) -> AsyncIterator[bytes]:
        if not self.picks(conn.id):
            yield data
            return
        key = (conn.id, direction)
        left = self.bytes - self._passed.get(key, 0)
        if left > 0:
            piece = data[:left]
            self._passed[key] = self._passed.get(key, 0) + len(piece)
            yield piece
            left -= len(piece)
        if left <= 0:
            self.hits += 1
            raise _Close()


class SlowClose(Toxic):
    kind = "slow_close"

    def __init__(self, delay_ms: float, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.delay_ms = delay_ms

    async def eof(self, conn: _Conn, direction: str) -> bool:
        if self.picks(conn.id):
            self.hits += 1
            await asyncio.sleep(self.delay_ms / 1000)
        return True


class Partition(Toxic):
    """``hits`` counts pieces (and new connections) held."""

    kind = "partition"

    def __init__(self, **kw: object) -> None:
        kw.setdefault("direction", "both")
        super().__init__(**kw)  # type: ignore[arg-type]

    async def before_connect(self, conn: _Conn) -> None:
        # A TCP handshake needs both directions: a new connection waits whichever way the partition cuts.
        if self.picks(conn.id):
            self.hits += 1
            await self.hold()

    async def data(self, conn: _Conn, direction: str, data: bytes, arrived: float) -> AsyncIterator[bytes]:
        if self.picks(conn.id) and not self.is_removed:
            self.hits += 1
            await self.hold()
        yield data

    async def eof(self, conn: _Conn, direction: str) -> bool:
        if self.picks(conn.id):
            await self.hold()
        return True
