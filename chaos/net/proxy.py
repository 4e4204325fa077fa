"""The fault proxy: an asyncio TCP proxy with composable, run-time switchable toxics.

Components are wired through a :class:`Proxy` (client → router, router → worker, anything → etcd,
anything → broker): the proxy listens on a loopback port and forwards every accepted connection to its
upstream, through the toxics (:mod:`fleetward.chaos.net.toxics`, :mod:`fleetward.chaos.net.sse`) it holds.
It counts connections and bytes in :class:`ProxyStats`.

A proxy with several upstreams (an etcd cluster behind one address) connects each new connection to the
first upstream that accepts, starting from the one that worked last; a connection that ends without one
byte from its upstream (a paused server still accepts) moves the start to the next upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetward.chaos.net.sse import _HttpDownstream
from fleetward.chaos.net.toxics import Toxic, _Close, _ids

__all__ = ["Proxy", "ProxyStats"]

_READ = 65536
_QUEUE = 64  # pieces read ahead per direction before TCP backpressure takes over


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
        pairs: Sequence[tuple[str, int]] = upstreams  # type: ignore[assignment]  # not a single pair: a sequence
        out = [(str(h), int(p)) for h, p in pairs]
        if not out:
            raise ValueError("a proxy needs at least one upstream")
        return out

    def __repr__(self) -> str:
        ups = ",".join(f"{h}:{p}" for h, p in self.upstreams)
        return f"<Proxy {self.name} {self.host}:{self.port} -> {ups} toxics={[t.name for t in self._toxics]}>"

    @property
    def address(self) -> str:
        """``host:port`` the proxy listens on; a proxy made with port 0 has its port once started."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """:attr:`address` as an ``http://`` base URL (what a client of an HTTP upstream is given)."""
        return "http://" + self.address

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

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """A helper task owned by this connection (cancelled when it ends)."""
        if self.done:
            coro.close()
            return
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
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
        self.upstream_index, reader, writer = connected
        self.upstream = (reader, writer)
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
