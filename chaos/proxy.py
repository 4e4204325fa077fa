"""The network fault proxy: an asyncio TCP proxy with composable, run-time switchable toxics.

Components are wired through a :class:`Proxy` (client → router, router → worker, anything → etcd,
anything → broker): the proxy listens on a loopback port and forwards every accepted connection to its
upstream. Toxics, in the spirit of Toxiproxy, change what flows:

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
:class:`SseCut`     (HTTP) a ``text/event-stream`` response is cut (FIN, or RST) right after ``after_events``
                    events were delivered: the client gets exactly that many events, then EOF
:class:`SseStall`   (HTTP) after ``after_events`` events, the response's events are held (the connection stays
                    open) until the toxic is removed; then they flow again, none lost
:class:`SseCorrupt` (HTTP) one token id in ``token_ids`` of a ``data:`` JSON event is changed
:class:`SseDropDone` (HTTP) ``data: [DONE]`` is dropped; the response still ends properly
==================  ===========================================================================================

Toxics compose: each applies in the order it was added, and may be added or removed at any time; open
connections see the change at their next piece of data. ``toxicity`` is the chance a toxic affects a given
connection (SSE toxics: a given response), ``streams`` (SSE toxics) caps how many responses it affects.
Each toxic counts what it did (``hits``), and the proxy counts connections and bytes (:class:`ProxyStats`),
which is what a fault's ``verify`` reads.

HTTP: a proxy made with ``http=True`` parses the downstream side as HTTP/1.1 responses (keep-alive,
several responses per connection, ``Content-Length``, chunked, read-until-close, 1xx). Chunked
``text/event-stream`` responses (what uvicorn and vLLM send) are de-chunked, split into events, passed
through the SSE toxics and re-framed one event per chunk; every other body passes byte for byte. SSE
toxics need ``http=True``. Not handled: responses to ``HEAD`` (the proxy does not parse requests), and
``Upgrade``; a head it cannot parse turns the rest of that connection into plain bytes.

A proxy with several upstreams (an etcd cluster behind one address) connects each new connection to the
first upstream that accepts, starting from the one that worked last; a connection that ends without one
byte from its upstream (a paused server still accepts) moves the start to the next upstream.

:class:`Link` is a named set of proxies faulted together (e.g. ``agent->etcd``: one proxy per etcd
member); :class:`ProxyRegistry` finds links by name or glob (``*->etcd``).

:class:`IptablesFilter` is the optional kernel backend (root and the ``iptables`` command): it drops or
resets TCP traffic to or from loopback ports. This kernel has no netem, so latency and bandwidth exist only
in the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import itertools
import json
import logging
import os
import random
import shutil
import socket
import struct
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from fleetward.fleet.tokenizer import VOCAB_SIZE

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

log = logging.getLogger(__name__)

Direction = Literal["upstream", "downstream", "both"]
_READ = 65536
_QUEUE = 64  # pieces read ahead per direction before TCP backpressure takes over
_ids = itertools.count(1)


class _Close(Exception):
    """End the connection: FIN both ways, or RST both ways when ``reset``."""

    def __init__(self, reset: bool = False) -> None:
        super().__init__("reset" if reset else "close")
        self.reset = reset


# -- toxics -------------------------------------------------------------------------------------------------


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
        if rate_bps < 1:
            raise ValueError("rate_bps must be >= 1")
        self.rate_bps = rate_bps

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


class Reset(Toxic):
    """Connection level: ``direction`` is ignored. ``hits`` counts connections reset."""

    kind = "reset"

    def __init__(self, timeout_ms: float = 0.0, **kw: object) -> None:
        kw.setdefault("direction", "both")
        super().__init__(**kw)  # type: ignore[arg-type]
        if timeout_ms < 0:
            raise ValueError("timeout_ms must be >= 0")
        self.timeout_ms = timeout_ms

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


class Blackhole(Toxic):
    """``hits`` counts bytes swallowed."""

    kind = "blackhole"

    def __init__(self, timeout_ms: float = 0.0, **kw: object) -> None:
        kw.setdefault("direction", "both")
        super().__init__(**kw)  # type: ignore[arg-type]
        if timeout_ms < 0:
            raise ValueError("timeout_ms must be >= 0")
        self.timeout_ms = timeout_ms
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
        if bytes < 0:
            raise ValueError("bytes must be >= 0")
        self.bytes = bytes
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


class _SseToxic(Toxic):
    sse = True

    def __init__(self, *, streams: int | None = None, **kw: object) -> None:
        kw["direction"] = "downstream"
        super().__init__(**kw)  # type: ignore[arg-type]
        self.streams = streams
        self._taken = 0

    def picks_response(self, resp: _Response) -> bool:
        key = -resp.id
        if key not in self._chosen:
            ok = self.streams is None or self._taken < self.streams
            ok = ok and (self.toxicity >= 1.0 or self._rng.random() < self.toxicity)
            self._chosen[key] = ok
            self._taken += ok
        return self._chosen[key]


class SseCut(_SseToxic):
    """``hits`` counts responses cut."""

    kind = "sse_cut"

    def __init__(self, after_events: int, reset: bool = False, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        if after_events < 0:
            raise ValueError("after_events must be >= 0")
        self.after_events = after_events
        self.reset = reset

    async def event(self, conn: _Conn, resp: _Response, event: bytes) -> bytes | None:
        if self.picks_response(resp) and resp.events >= self.after_events:
            self.hits += 1
            raise _Close(self.reset)
        return event

    async def delivered(self, conn: _Conn, resp: _Response) -> None:
        if self.picks_response(resp) and resp.events >= self.after_events:
            self.hits += 1
            raise _Close(self.reset)


class SseStall(_SseToxic):
    """``hits`` counts responses stalled."""

    kind = "sse_stall"

    def __init__(self, after_events: int = 0, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.after_events = after_events

    async def event(self, conn: _Conn, resp: _Response, event: bytes) -> bytes | None:
        if self.picks_response(resp) and resp.events >= self.after_events and not self.is_removed:
            self.hits += 1
            await self.hold()
        return event


class SseCorrupt(_SseToxic):
    """Changes ``token_ids[index]`` of ``count`` token-carrying events per response, from event
    ``after_events`` on, to ``(id + 1) % vocab_size``. ``hits`` counts events changed."""

    kind = "sse_corrupt"

    def __init__(self, after_events: int = 0, count: int = 1, index: int = 0, vocab_size: int = VOCAB_SIZE,
                 **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.after_events = after_events
        self.count = count
        self.index = index
        self.vocab_size = vocab_size
        self._done: dict[int, int] = {}
        self.changed: list[tuple[int, int]] = []  # (old id, new id), for verify and tests

    async def event(self, conn: _Conn, resp: _Response, event: bytes) -> bytes | None:
        if (not self.picks_response(resp) or resp.events < self.after_events
                or self._done.get(resp.id, 0) >= self.count):
            return event
        lines = event.split(b"\n")
        for i, line in enumerate(lines):
            if not line.startswith(b"data:") or line[5:].strip() in (b"", b"[DONE]"):
                continue
            try:
                body = json.loads(line[5:])
            except ValueError:
                return event
            choices = body.get("choices") if isinstance(body, dict) else None
            ids = choices[0].get("token_ids") if choices and isinstance(choices[0], dict) else None
            if not ids or not -len(ids) <= self.index < len(ids):
                return event
            old = ids[self.index]
            ids[self.index] = (old + 1) % self.vocab_size
            self.changed.append((old, ids[self.index]))
            lines[i] = b"data: " + json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
            self._done[resp.id] = self._done.get(resp.id, 0) + 1
            self.hits += 1
            return b"\n".join(lines)
        return event


class SseDropDone(_SseToxic):
    """``hits`` counts ``[DONE]`` events dropped."""

    kind = "sse_drop_done"

    async def event(self, conn: _Conn, resp: _Response, event: bytes) -> bytes | None:
        if self.picks_response(resp) and any(line.strip() == b"data: [DONE]" for line in event.split(b"\n")):
            self.hits += 1
            return None
        return event


# -- the proxy --------------------------------------------------------------------------------------------


@dataclass
class ProxyStats:
    """Counters since the proxy started (``upstream`` = client → server bytes)."""

    connections_total: int = 0
    connections_open: int = 0
    connect_failures: int = 0  # no upstream accepted
    resets: int = 0  # connections this proxy ended with RST
    bytes_in: dict[str, int] = field(default_factory=lambda: {"upstream": 0, "downstream": 0})
    bytes_out: dict[str, int] = field(default_factory=lambda: {"upstream": 0, "downstream": 0})
    responses: int = 0  # HTTP responses seen (http proxies)
    sse_events: int = 0  # SSE events delivered (http proxies)

    def snapshot(self) -> dict[str, object]:
        return {"connections_total": self.connections_total, "connections_open": self.connections_open,
                "connect_failures": self.connect_failures, "resets": self.resets,
                "bytes_in": dict(self.bytes_in), "bytes_out": dict(self.bytes_out),
                "responses": self.responses, "sse_events": self.sse_events}


class Proxy:
    """A TCP proxy on ``listen`` in front of ``upstreams`` (``(host, port)`` pairs, failover in order).

    Life: ``await start()`` (binds; ``port`` 0 picks a free one), then :attr:`address` / :attr:`url`;
    ``await aclose()`` closes the listener and every connection. Toxics: :meth:`add`, :meth:`remove`,
    :meth:`clear`, at any time. :meth:`disable` stops listening (connections are refused) and resets the
    open connections; :meth:`enable` listens again on the same port.
    """

    def __init__(self, name: str, upstreams: Sequence[tuple[str, int]] | tuple[str, int], *,
                 listen: tuple[str, int] = ("127.0.0.1", 0), http: bool = False,
                 connect_timeout: float = 5.0) -> None:
        self.name = name
        self.upstreams = self._norm(upstreams)
        self.host, self.port = listen
        self.http = http
        self.connect_timeout = connect_timeout
        self.stats = ProxyStats()
        self._toxics: list[Toxic] = []
        self._conns: set[_Conn] = set()
        self._server: asyncio.Server | None = None
        self._preferred = 0

    @staticmethod
    def _norm(upstreams: Sequence[tuple[str, int]] | tuple[str, int]) -> list[tuple[str, int]]:
        if len(upstreams) == 2 and isinstance(upstreams[1], int):
            return [(str(upstreams[0]), int(upstreams[1]))]  # a single (host, port)
        out = [(str(h), int(p)) for h, p in upstreams]  # type: ignore[misc]
        if not out:
            raise ValueError("a proxy needs at least one upstream")
        return out

    def __repr__(self) -> str:
        ups = ",".join(f"{h}:{p}" for h, p in self.upstreams)
        return f"<Proxy {self.name} {self.host}:{self.port} -> {ups} toxics={[t.name for t in self._toxics]}>"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def is_listening(self) -> bool:
        return self._server is not None

    @property
    def connections(self) -> int:
        return len(self._conns)

    def set_upstreams(self, upstreams: Sequence[tuple[str, int]] | tuple[str, int]) -> None:
        """Point new connections elsewhere (e.g. a worker restarted on another port)."""
        self.upstreams = self._norm(upstreams)
        self._preferred = 0

    async def start(self) -> Proxy:
        if self._server is None:
            self._server = await asyncio.start_server(self._accept, self.host, self.port, reuse_address=True,
                                                      limit=_READ * 4)
            self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aenter__(self) -> Proxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _stop_listening(self, *, reset: bool) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        await self._close_all(reset=reset)
        if server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1.0)

    async def aclose(self) -> None:
        """Stop listening, reset every connection, release held toxics."""
        for t in self._toxics:
            t.removed.set()
        self._toxics.clear()
        await self._stop_listening(reset=True)

    async def _close_all(self, *, reset: bool) -> None:
        conns = list(self._conns)
        for c in conns:
            c.abort(reset=reset)
        for c in conns:
            await c.finished()

    async def disable(self) -> None:
        """Refuse new connections (nothing listens) and reset the open ones: the component is "down"."""
        await self._stop_listening(reset=True)

    async def enable(self) -> None:
        await self.start()

    # -- toxics -------------------------------------------------------------------------------------------

    @property
    def toxics(self) -> list[Toxic]:
        return list(self._toxics)

    def add(self, toxic: Toxic) -> Toxic:
        """Apply ``toxic`` to open and new connections; returns it (keep it to read ``hits``)."""
        if toxic.sse and not self.http:
            raise ValueError(f"{toxic.kind} needs an HTTP-aware proxy (Proxy(..., http=True)); {self.name} is not")
        if any(t.name == toxic.name for t in self._toxics):
            raise ValueError(f"{self.name} already has a toxic named {toxic.name}")
        self._toxics.append(toxic)
        for c in list(self._conns):
            toxic.attach(c)
        return toxic

    def remove(self, toxic: Toxic | str) -> None:
        """Remove a toxic (by object or name); held data flows again. Removing an absent one is a no-op."""
        name = toxic if isinstance(toxic, str) else toxic.name
        for t in list(self._toxics):
            if t.name == name:
                self._toxics.remove(t)
                t.removed.set()

    def clear(self) -> None:
        for t in list(self._toxics):
            self.remove(t)

    def _active(self, direction: str, *, sse: bool) -> list[Toxic]:
        return [t for t in self._toxics if t.sse == sse and t.on(direction)]

    # -- connections --------------------------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(self, reader, writer)
        self._conns.add(conn)
        self.stats.connections_total += 1
        self.stats.connections_open += 1
        try:
            await conn.run()
        finally:
            self._conns.discard(conn)
            self.stats.connections_open -= 1

    async def _connect_upstream(self) -> tuple[int, asyncio.StreamReader, asyncio.StreamWriter] | None:
        n = len(self.upstreams)
        for k in range(n):
            i = (self._preferred + k) % n
            host, port = self.upstreams[i]
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=_READ * 4),
                                                        self.connect_timeout)
            except (OSError, TimeoutError):
                continue
            self._preferred = i
            return i, reader, writer
        self.stats.connect_failures += 1
        return None

    def _suspect(self, index: int) -> None:
        """A connection to upstream ``index`` ended without one byte from it (e.g. a SIGSTOPped server,
        whose kernel still accepts): the next connection tries the next upstream first."""
        if len(self.upstreams) > 1 and self._preferred == index:
            self._preferred = (index + 1) % len(self.upstreams)


def _abort(writer: asyncio.StreamWriter | None, *, reset: bool) -> None:
    if writer is None or (writer.transport.is_closing() and not reset):
        return
    if reset:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
    else:
        writer.close()


class _Conn:
    """One client connection and its upstream connection: two pumps, each reader → queue → writer."""

    def __init__(self, proxy: Proxy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.id = next(_ids)
        self.proxy = proxy
        self.client = (reader, writer)
        self.upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self.upstream_index = 0
        self.from_upstream = 0  # bytes the upstream sent on this connection
        self.tainted = False  # lost data to a blackhole
        self.swallow: Toxic | None = None  # a blackhole took the connection before it was connected
        self.done = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._main: asyncio.Task[None] | None = None
        self._finished = asyncio.Event()
        self._reset = False
        self._aborted = False
        self._http = _HttpDownstream(self) if proxy.http else None

    def spawn(self, coro: object) -> None:
        """A helper task owned by this connection (cancelled when it ends)."""
        if self.done:
            coro.close()  # type: ignore[attr-defined]
            return
        task: asyncio.Task[None] = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def abort(self, *, reset: bool) -> None:
        """End the connection now (from a toxic, a pump or the proxy)."""
        if self.done:
            return
        self._reset = self._reset or reset
        if not self._aborted:
            self._aborted = True
            if self._main is not None:
                self._main.cancel()

    async def finished(self) -> None:
        await self._finished.wait()

    async def run(self) -> None:
        self._main = asyncio.current_task()
        try:
            await self._run()
        except asyncio.CancelledError:
            if not self._aborted:
                raise
            if self._main is not None:
                self._main.uncancel()  # our own abort: the connection simply ends
        except _Close as c:
            self._reset = self._reset or c.reset
        except OSError:
            self._reset = True
        finally:
            self._cleanup()

    def _cleanup(self) -> None:
        if self.done:
            return
        self.done = True
        for t in list(self._tasks):
            t.cancel()
        if self._reset:
            self.proxy.stats.resets += 1
        if self.upstream is not None and self.from_upstream == 0:
            self.proxy._suspect(self.upstream_index)
        _abort(self.client[1], reset=self._reset)
        _abort(self.upstream[1] if self.upstream else None, reset=self._reset)
        self._finished.set()

    async def _run(self) -> None:
        for t in self.proxy.toxics:
            await t.before_connect(self)
            if self.swallow is not None:
                break
        if self.swallow is not None:
            await self._swallow(self.swallow)
            return
        connected = await self.proxy._connect_upstream()
        if connected is None:
            return
        self.upstream_index, *pair = connected
        self.upstream = (pair[0], pair[1])
        for t in self.proxy.toxics:
            t.attach(self)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._pump("upstream", self.client[0], self.upstream[1]))
            tg.create_task(self._pump("downstream", self.upstream[0], self.client[1]))

    async def _swallow(self, toxic: Toxic) -> None:
        reader = self.client[0]
        while True:
            data = await reader.read(_READ)
            if not data:
                return
            self.proxy.stats.bytes_in["upstream"] += len(data)
            self.tainted = True
            toxic.hits += len(data)

    async def _read(self, direction: str, src: asyncio.StreamReader,
                    queue: asyncio.Queue[tuple[float, bytes]]) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await src.read(_READ)
                self.proxy.stats.bytes_in[direction] += len(data)
                if direction == "downstream":
                    self.from_upstream += len(data)
                await queue.put((loop.time(), data))
                if not data:
                    return
        except OSError:  # the peer reset: pass the reset on
            self.abort(reset=True)

    async def _pump(self, direction: str, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """Deliver one direction until its EOF; a toxic's :class:`_Close` or a broken socket ends the
        whole connection (through :meth:`abort`, so nothing here raises into the task group)."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(_QUEUE)
        self.spawn(self._read(direction, src, queue))
        try:
            while True:
                arrived, data = await queue.get()
                if not data:
                    break
                if self._http is not None and direction == "downstream":
                    async for out in self._http.feed(data):
                        await self._chain(direction, out, arrived, dst)
                else:
                    await self._chain(direction, data, arrived, dst)
            for t in self.proxy._active(direction, sse=False):
                if not await t.eof(self, direction):
                    return  # swallowed: the other side never learns
            if dst.can_write_eof() and not dst.transport.is_closing():
                dst.write_eof()
        except _Close as c:
            self.abort(reset=c.reset)
        except OSError:
            self.abort(reset=True)

    async def _chain(self, direction: str, data: bytes, arrived: float, dst: asyncio.StreamWriter) -> None:
        toxics = self.proxy._active(direction, sse=False)

        async def step(i: int, piece: bytes) -> None:
            if i == len(toxics):
                if piece:
                    dst.write(piece)
                    await dst.drain()
                    self.proxy.stats.bytes_out[direction] += len(piece)
                return
            async for out in toxics[i].data(self, direction, piece, arrived):
                await step(i + 1, out)

        await step(0, data)


# -- HTTP responses and SSE events ---------------------------------------------------------------------------


@dataclass
class _Response:
    id: int
    status: int
    sse: bool
    mode: Literal["none", "chunked", "length", "eof"]
    rewrite: bool
    events: int = 0  # events delivered
    pending: bytearray = field(default_factory=bytearray)  # SSE bytes not yet a whole event
    trailer: bytearray = field(default_factory=bytearray)


class _HttpDownstream:
    """Incremental HTTP/1.1 response parser; SSE responses go through the SSE toxics event by event."""

    def __init__(self, conn: _Conn) -> None:
        self.conn = conn
        self.buf = bytearray()
        self.state = "head"
        self.raw = False
        self.resp: _Response | None = None
        self.left = 0
        self._length = 0

    async def feed(self, data: bytes) -> AsyncIterator[bytes]:
        if self.raw:
            yield data
            return
        self.buf += data
        while True:
            if self.state == "head":
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(self.buf) > 65536:
                        self.raw = True
                        yield bytes(self.buf)
                        self.buf.clear()
                    return
                head = bytes(self.buf[:end + 4])
                del self.buf[:end + 4]
                resp = self._parse_head(head)
                if resp is None:
                    self.raw = True
                    yield head + bytes(self.buf)
                    self.buf.clear()
                    return
                self.conn.proxy.stats.responses += 1
                yield head
                self.resp = resp
                self.state = {"none": "head", "chunked": "size", "length": "length", "eof": "eof"}[resp.mode]
                self.left = self._length if resp.mode == "length" else 0
                if resp.mode == "length" and self.left == 0:
                    self.state = "head"
            elif self.state == "length":
                if not self.buf:
                    return
                n = min(self.left, len(self.buf))
                piece = bytes(self.buf[:n])
                del self.buf[:n]
                self.left -= n
                yield piece
                if self.left == 0:
                    self.state = "head"
            elif self.state == "eof":
                if not self.buf:
                    return
                piece = bytes(self.buf)
                self.buf.clear()
                async for out in self._body(piece):
                    yield out
                return
            elif self.state == "size":
                end = self.buf.find(b"\r\n")
                if end < 0:
                    return
                line = bytes(self.buf[:end])
                try:
                    size = int(line.split(b";")[0].strip(), 16)
                except ValueError:
                    self.raw = True
                    yield bytes(self.buf)
                    self.buf.clear()
                    return
                assert self.resp is not None
                if not self.resp.rewrite:
                    yield bytes(self.buf[:end + 2])
                del self.buf[:end + 2]
                if size == 0:
                    self.state = "trailer"
                else:
                    self.state, self.left = "data", size
            elif self.state == "data":
                if not self.buf:
                    return
                n = min(self.left, len(self.buf))
                piece = bytes(self.buf[:n])
                del self.buf[:n]
                self.left -= n
                async for out in self._body(piece):
                    yield out
                if self.left == 0:
                    self.state = "crlf"
            elif self.state == "crlf":
                if len(self.buf) < 2:
                    return
                assert self.resp is not None
                if not self.resp.rewrite:
                    yield bytes(self.buf[:2])
                del self.buf[:2]
                self.state = "size"
            elif self.state == "trailer":
                end = self.buf.find(b"\r\n")
                if end < 0:
                    return
                line = bytes(self.buf[:end + 2])
                del self.buf[:end + 2]
                assert self.resp is not None
                if not self.resp.rewrite:
                    yield line
                else:
                    self.resp.trailer += line
                if line == b"\r\n":
                    if self.resp.rewrite:
                        if self.resp.pending:  # a last event without its blank line
                            rest = bytes(self.resp.pending)
                            self.resp.pending.clear()
                            yield self._frame(rest)
                        yield b"0\r\n" + bytes(self.resp.trailer)
                    self.state = "head"

    def _parse_head(self, head: bytes) -> _Response | None:
        try:
            lines = head.decode("latin-1").split("\r\n")
            version, status_s, *_ = lines[0].split(" ", 2)
            if not version.startswith("HTTP/1."):
                return None
            status = int(status_s)
        except (ValueError, UnicodeDecodeError):
            return None
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        sse = headers.get("content-type", "").lower().startswith("text/event-stream")
        mode: Literal["none", "chunked", "length", "eof"]
        self._length = 0
        if 100 <= status < 200 or status in (204, 304):
            mode = "none"
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            mode = "chunked"
        elif "content-length" in headers:
            mode = "length"
            try:
                self._length = int(headers["content-length"])
            except ValueError:
                return None
        else:
            mode = "eof"
        rewrite = sse and mode in ("chunked", "eof")
        return _Response(next(_ids), status, sse, mode, rewrite)

    def _frame(self, payload: bytes) -> bytes:
        assert self.resp is not None
        if self.resp.mode == "chunked":
            return f"{len(payload):x}\r\n".encode() + payload + b"\r\n"
        return payload

    async def _body(self, piece: bytes) -> AsyncIterator[bytes]:
        resp = self.resp
        assert resp is not None
        if not resp.rewrite:
            yield piece
            return
        resp.pending += piece
        while True:
            cut = _event_end(resp.pending)
            if cut < 0:
                return
            event = bytes(resp.pending[:cut])
            del resp.pending[:cut]
            toxics = [t for t in self.conn.proxy._active("downstream", sse=True)]
            out: bytes | None = event
            for t in toxics:
                out = await t.event(self.conn, resp, out)
                if out is None:
                    break
            if out is None:
                continue
            yield self._frame(out)
            resp.events += 1
            self.conn.proxy.stats.sse_events += 1
            for t in toxics:
                await t.delivered(self.conn, resp)


def _event_end(buf: bytearray) -> int:
    """End (exclusive, separator included) of the first complete SSE event in ``buf``, or -1."""
    ends = [i + n for sep, n in ((b"\n\n", 2), (b"\r\n\r\n", 4), (b"\r\r", 2)) if (i := buf.find(sep)) >= 0]
    return min(ends) if ends else -1


# -- links and the registry --------------------------------------------------------------------------------


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

    def __iter__(self) -> Iterable[Link]:  # type: ignore[override]
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


# -- the kernel backend ------------------------------------------------------------------------------------


class IptablesFilter:
    """Drop or reset loopback TCP traffic to or from ports, in a chain of its own (root and ``iptables``).

    Every rule lives in the chain ``FW-<name>``, jumped to from ``OUTPUT`` for the loopback interface;
    :meth:`clear` removes the jump and the chain, so nothing is left behind. It affects every process that
    talks to those ports, not only one link.
    """

    def __init__(self, name: str) -> None:
        self.chain = ("FW-" + "".join(c if c.isalnum() else "-" for c in name))[:28]
        self._installed = False

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why the kernel backend cannot be used here, or None when it can."""
        if os.geteuid() != 0:
            return "the iptables backend needs root"
        if shutil.which("iptables") is None:
            return "the iptables command is not installed (Debian: apt-get install iptables)"
        return None

    @staticmethod
    async def _run(*args: str, check: bool = True) -> int:
        proc = await asyncio.create_subprocess_exec("iptables", "-w", *args, stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        if check and proc.returncode:
            raise RuntimeError(f"iptables {' '.join(args)}: {err.decode().strip()}")
        return proc.returncode or 0

    async def _ensure(self) -> None:
        if self._installed:
            return
        reason = self.unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        await self._run("-N", self.chain, check=False)
        await self._run("-I", "OUTPUT", "-o", "lo", "-j", self.chain)
        self._installed = True

    async def block(self, port: int, *, action: Literal["drop", "reset"] = "drop",
                    direction: Literal["to", "from", "both"] = "both") -> None:
        """Drop (silently: a partition) or reset (RST) TCP segments to and/or from ``port`` on loopback."""
        await self._ensure()
        target = ["-j", "DROP"] if action == "drop" else ["-j", "REJECT", "--reject-with", "tcp-reset"]
        if direction in ("to", "both"):
            await self._run("-A", self.chain, "-p", "tcp", "--dport", str(port), *target)
        if direction in ("from", "both"):
            await self._run("-A", self.chain, "-p", "tcp", "--sport", str(port), *target)

    async def clear(self) -> None:
        """Remove every rule, the jump and the chain (idempotent)."""
        if shutil.which("iptables") is None:
            return
        while await self._run("-D", "OUTPUT", "-o", "lo", "-j", self.chain, check=False) == 0:
            pass
        await self._run("-F", self.chain, check=False)
        await self._run("-X", self.chain, check=False)
        self._installed = False
