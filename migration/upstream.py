"""The router's client to workers: streamed completions relayed chunk by chunk, in the socket's own callback.

A streamed request runs on a kept-alive connection of the router's own (:class:`_Conn`, an asyncio
protocol). httptools parses the response as its bytes arrive, :class:`SseReader` splits the body into
events and parses each, and every chunk goes to the stream's :class:`Sink` in the same ``data_received``
call: no task, queue or stream reader per token (docs/benchmarks.md section 1, "The hot path"). Whole answers
(:meth:`Upstream.call`) and passed-through requests stay on aiohttp.

Every way a worker can fail a stream becomes one :class:`UpstreamError` with a ``kind``:

============  =====================================================================================
connect       could not connect (refused, unreachable, connect timeout), or the connection closed
              before the worker answered
status        answered with an error status before streaming (``status`` holds it; 4xx = the request
              is bad and must not be retried elsewhere, 5xx = the worker is)
reset         the connection broke mid-stream
eof           the stream ended without a finish reason (or without ``[DONE]`` before one)
error_event   vLLM's in-band ``data: {"error": ...}`` (e.g. its engine died mid-stream; ``status`` holds its
              ``code``: a 4xx is the request's fault, as for ``status``)
aborted       the router aborted the stream on purpose (``reason`` says why: stalled, unhealthy, ...)
bad_chunk     a chunk that is not valid JSON or lacks token ids
============  =====================================================================================

Aborting a stream closes its connection, which is also how the worker learns to cancel the generation.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

import aiohttp
import httptools
import orjson

__all__ = ["MAX_EVENT_BYTES", "Chunk", "Sink", "SseReader", "Upstream", "UpstreamError", "UpstreamStream"]


class UpstreamError(Exception):
    def __init__(self, kind: str, message: str, *, status: int | None = None,
                 body: dict[str, Any] | None = None) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message
        self.status = status
        self.body = body

    @property
    def is_client_error(self) -> bool:
        """The worker refused the request itself, with a 4xx status or an in-band error whose code is a 4xx
        (vLLM validates a streamed request's prompt after its 200: ``Token id 7205 is out of vocabulary``):
        retrying elsewhere would be refused too. A 429 is the worker's load, not the request."""
        return self.kind in ("status", "error_event") and self.status is not None and 400 <= self.status < 500 \
            and self.status not in (408, 429)


@dataclass(slots=True)
class Chunk:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: str | int | None
    prompt_token_ids: list[int] | None
    logprobs: Any
    fingerprint: str | None = None  # the worker's system_fingerprint (vLLM sends it on the last chunk)


def _bad(why: str, payload: bytes) -> UpstreamError:
    return UpstreamError("bad_chunk", f"{why}: {payload[:120]!r}")


def _ids(value: Any) -> bool:
    return type(value) is list and all(type(t) is int for t in value)


def _parse(payload: bytes) -> Chunk | None:
    """One ``data:`` payload: a :class:`Chunk`, None (the usage chunk), or :class:`UpstreamError` whatever it
    holds (``bad_chunk`` when it is not the shape vLLM sends, ``error_event`` for its in-band error)."""
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise UpstreamError("bad_chunk", f"not JSON: {payload[:120]!r}") from exc
    if type(data) is not dict:
        raise _bad("not a JSON object", payload)
    if "error" in data:
        err = data["error"]
        message = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        code = err.get("code") if isinstance(err, dict) else None
        raise UpstreamError("error_event", str(message), body=data,
                            status=code if type(code) is int and 100 <= code < 600 else None)
    choices = data.get("choices")
    if not choices:
        return None  # the usage chunk
    c = choices[0] if type(choices) is list else None
    if type(c) is not dict:
        raise _bad("choices is not a list of objects", payload)
    delta = c.get("delta")
    if delta is not None and type(delta) is not dict:
        raise _bad("delta is not an object", payload)
    text = (delta.get("content") or "") if delta is not None else (c.get("text") or "")
    prompt_ids = c.get("prompt_token_ids") or data.get("prompt_token_ids")
    token_ids = c.get("token_ids")
    finish, stop = c.get("finish_reason"), c.get("stop_reason")
    if token_ids is None:
        if delta is not None and not text and finish is None:
            token_ids = []  # chat's opening role chunk
        else:
            raise UpstreamError("bad_chunk", "chunk without token_ids (worker ignored return_token_ids?)")
    if not (type(text) is str and _ids(token_ids) and (prompt_ids is None or _ids(prompt_ids))
            and (finish is None or type(finish) is str)
            and (stop is None or type(stop) is str or type(stop) is int)):
        raise _bad("text, token ids or finish reason of the wrong type", payload)
    fingerprint = data.get("system_fingerprint")
    return Chunk(token_ids, text, finish, stop, prompt_ids, c.get("logprobs"),
                 fingerprint if type(fingerprint) is str else None)


# The most a worker's event, or its error body, may hold while the router waits for its end: vLLM's largest
# (a chunk of several tokens with 20 logprobs each) is kilobytes. A worker that sends more is broken or
# hostile, and the router's memory is not its to fill.
MAX_EVENT_BYTES = 16 * 2**20


class SseReader:
    """A worker's SSE body, fed as the socket gives it (split anywhere, several events at once), into chunks.

    Sans-IO. :meth:`feed` hands each chunk to ``on_chunk`` as soon as its event is whole, and raises
    :class:`UpstreamError` for a chunk that is an in-band error or not vLLM's shape (the chunks before it
    have gone out), or for an event that grows past ``max_event`` bytes before it ends (``bad_chunk``).
    :meth:`end` is the end of the body: it raises ``eof`` unless a finish reason came.
    """

    __slots__ = ("_buf", "done", "got_finish", "max_event")

    def __init__(self, max_event: int = MAX_EVENT_BYTES) -> None:
        self._buf = b""
        self.done = False  # ``data: [DONE]`` came: nothing after it is read
        self.got_finish = False
        self.max_event = max_event

    def feed(self, data: bytes, on_chunk: Any) -> None:
        if self.done:
            return
        buf = self._buf + data if self._buf else data
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        *events, self._buf = buf.split(b"\n\n")
        self._events(events, on_chunk)
        if len(self._buf) > self.max_event:
            self._buf = b""
            raise UpstreamError("bad_chunk", f"an event of more than {self.max_event} bytes without its end")

    def _events(self, events: list[bytes], on_chunk: Any) -> None:
        for event in events:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    self.done = True
                    return
                chunk = _parse(payload)
                if chunk is None:
                    continue
                if chunk.finish_reason is not None:
                    self.got_finish = True
                on_chunk(chunk)

    def end(self, on_chunk: Any) -> None:
        if not self.done and self._buf.strip():  # a last event without its blank line, then EOF
            buf, self._buf = self._buf, b""
            self._events([buf], on_chunk)
        if not self.got_finish:
            raise UpstreamError("eof", "stream ended without a finish reason")


class Sink(Protocol):
    """Where a stream's chunks go, called from the connection's callbacks (the router's relay)."""

    def opened(self, stream: UpstreamStream) -> None:
        """The worker accepted the request (its 200 and headers came); chunks follow."""

    def chunk(self, chunk: Chunk) -> bool:
        """One chunk; True once the stream needs no more (a finish reason, the router's stop string)."""

    def flush(self) -> None:
        """The end of one read from the socket: what the chunks before produced can go out now."""


class UpstreamStream:
    """One streamed request to a worker. :meth:`abort` cuts it (from anywhere); :meth:`pause` and
    :meth:`resume` stop and restart reading from the worker (the client's backpressure)."""

    __slots__ = ("_conn", "abort_reason", "ended", "finished", "reader", "sink", "worker")

    def __init__(self, worker: str, sink: Sink) -> None:
        self.worker = worker
        self.sink = sink
        self.reader = SseReader()
        self.abort_reason: str | None = None
        self.finished = False  # the worker finished it (its connection can carry the next request)
        self._conn: _Conn | None = None
        self.ended: asyncio.Future[None] | None = None  # the stream's end (its exception: how it failed)

    def abort(self, reason: str) -> None:
        if self.abort_reason is None and not self.finished:
            self.abort_reason = reason
            if self._conn is not None:
                self._conn.close()
            self.fail(UpstreamError("aborted", reason))

    def pause(self) -> None:
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.pause_reading()

    def resume(self) -> None:
        if self._conn is not None and self._conn.transport is not None and not self._conn.closed:
            self._conn.transport.resume_reading()

    def fail(self, exc: BaseException) -> None:
        if self.ended is not None and not self.ended.done():
            self.ended.set_exception(exc)

    def _complete(self) -> None:
        if self.ended is not None and not self.ended.done():
            self.ended.set_result(None)

    # called by the connection
    def _body(self, data: bytes) -> None:
        if self.ended is None or self.ended.done():
            return  # finished (the rest of the body is read and dropped), failed or aborted
        try:
            self.reader.feed(data, self._chunk)
        except BaseException as exc:  # the attempt's outcome, raised where it is awaited
            self.fail(exc)
            assert self._conn is not None
            self._conn.close()

    def _chunk(self, chunk: Chunk) -> None:
        if self.ended is not None and not self.ended.done() and self.sink.chunk(chunk):
            self.finished = chunk.finish_reason is not None
            self._complete()
            self.reader.done = True  # nothing after the end is relayed

    def _end(self) -> None:
        if self.ended is None or self.ended.done():
            return
        try:
            self.reader.end(self._chunk)
        except BaseException as exc:
            self.fail(exc)
            return
        self._complete()

    def _lost(self, why: str) -> None:
        if self.abort_reason is not None:
            self.fail(UpstreamError("aborted", self.abort_reason))
        else:
            self.fail(UpstreamError("reset", why))


class _Conn(asyncio.Protocol):
    """One HTTP/1.1 connection to a worker, its responses parsed by httptools as the bytes arrive.

    One response at a time. A 200's body goes to its :class:`UpstreamStream` in the same callback; any other
    status's body is kept whole for the error. Kept alive for the next request once a response ended whole.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._waiter: asyncio.Future[None] | None = None
        self.then: Any = None  # called once the response in progress ended whole (it goes back to the pool)
        self.expiry: asyncio.TimerHandle | None = None  # while idle in the pool: when it is closed (IDLE_S)
        self._reset(None)

    def _reset(self, stream: UpstreamStream | None) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.stream = stream
        self.status = 0
        self.complete = False
        self.keep_alive = False
        self.got_bytes = False
        self.body: list[bytes] = []
        self.kept = 0  # bytes of a non-200 body kept
        self.error: str | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one without subclassing it

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        stream = self.stream
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = f"bad HTTP from the worker: {exc}"
            self.close()
        if stream is not None and self.status == 200:
            stream.sink.flush()  # what this read produced (its HTTP chunks, its events) goes out as one write

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()
        then, self.then = self.then, None
        if then is not None:
            then()  # not kept: closed
        if self.stream is not None and self.status == 200 and not self.complete:
            self.stream._lost(self.error or (f"{type(exc).__name__}: {exc}" if exc is not None
                                             else "the worker closed the connection mid-stream"))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()
        if self.status == 200 and self.stream is not None:
            self.stream.sink.opened(self.stream)

    def on_body(self, body: bytes) -> None:
        if self.status == 200 and self.stream is not None:
            self.stream._body(body)
        elif self.error is None:
            self.body.append(body)
            self.kept += len(body)
            if self.kept > MAX_EVENT_BYTES:  # an error body past any error's size: the connection goes
                self.error = f"an error body of more than {MAX_EVENT_BYTES} bytes"
                self.body = [b'{"error": {"message": "the worker\'s error body was too large", "code": 502}}']
                self.close()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()
        if self.status == 200 and self.stream is not None:
            self.stream._end()
        then, self.then = self.then, None
        if then is not None:
            then()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _next(self) -> None:
        """Until the response's headers or its end come, or the connection goes."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def answered(self) -> None:
        """Until the response's headers came, or the connection went."""
        while not self.status and not self.closed:
            await self._next()

    async def whole(self) -> bytes:
        """The rest of a (non-200) response's body."""
        while not self.complete and not self.closed:
            await self._next()
        return b"".join(self.body)

    def request(self, raw: bytes, stream: UpstreamStream) -> None:
        self._reset(stream)
        stream._conn = self
        if stream.ended is None:
            stream.ended = asyncio.get_running_loop().create_future()
        if not self.open:
            # the worker's close or a reset came between the connect (or the pool) and this write: uvloop raises on
            # a write to a closed transport, so the request is not written and fails as not answered
            self.closed = True
            self.error = "the connection closed before the request was sent"
            return
        assert self.transport is not None
        self.transport.write(raw)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    @property
    def open(self) -> bool:
        """Neither side closed it (its transport may be closing before :meth:`connection_lost` comes)."""
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    @property
    def reusable(self) -> bool:
        return self.complete and self.keep_alive and self.open


IDLE_S = 4.0  # how long an idle pooled connection to a worker is kept


class Upstream:
    """The router's clients to workers: its own kept-alive connections for streams, aiohttp for the rest."""

    def __init__(self, *, connect_timeout: float = 2.0, limit: int = 0) -> None:
        self._connect_timeout = connect_timeout
        self._limit = limit
        self._session: aiohttp.ClientSession | None = None
        self._pool: dict[tuple[str, str, int], list[_Conn]] = {}  # idle kept-alive stream connections
        self._busy: set[_Conn] = set()
        self._ssl: ssl.SSLContext | None = None

    async def start(self) -> None:
        # An idle connection is closed here before the worker closes it (uvicorn's, and so vLLM's, idle timeout is
        # 5 s): a worker's close that never arrived (a partition dropped its FIN) must not be found by a request.
        connector = aiohttp.TCPConnector(limit=self._limit, keepalive_timeout=IDLE_S, enable_cleanup_closed=True)
        timeout = aiohttp.ClientTimeout(total=None, connect=self._connect_timeout, sock_read=None)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False)

    @property
    def session(self) -> aiohttp.ClientSession:
        """The pooled session (for requests relayed as they are: :mod:`~fleetward.migration.passthrough`)."""
        assert self._session is not None, "Upstream.start() first"
        return self._session

    async def aclose(self) -> None:
        for conns in self._pool.values():
            for conn in conns:
                if conn.expiry is not None:
                    conn.expiry.cancel()
                conn.close()
        self._pool.clear()
        for conn in list(self._busy):
            conn.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(self, url: str, path: str, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        """One request answered whole (not streamed): its JSON body, or :class:`UpstreamError`."""
        assert self._session is not None, "Upstream.start() first"
        try:
            async with self._session.post(url + path, data=orjson.dumps(body),
                                          headers={"content-type": "application/json"},
                                          timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                raw = await response.read()
                status = response.status
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise UpstreamError("connect", f"{url}: {type(exc).__name__}: {exc}") from exc
        if status != 200:
            raise UpstreamError("status", raw.decode(errors="replace")[:500], status=status)
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise UpstreamError("protocol", f"{url}: not JSON: {raw[:200]!r}") from exc
        if not isinstance(answer, dict):
            raise UpstreamError("protocol", f"{url}: not a JSON object")
        return answer

    async def stream(self, url: str, path: str, body: dict[str, Any], stream: UpstreamStream) -> None:
        """POST ``body`` to ``url + path`` and relay the streamed answer to ``stream.sink`` until it ends (a
        finish reason, or the sink needs no more); raises :class:`UpstreamError` when it fails. A kept-alive
        connection the worker closed meanwhile is replaced by a fresh one before the request counts as failed.
        Cancelling this closes the connection (the worker cancels the generation)."""
        scheme, host, port = _origin(url)
        payload = orjson.dumps(body)
        raw = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
               f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload
        key = (scheme, host, port)
        conn: _Conn | None = None
        try:
            for pooled in (True, False):
                conn = self._idle(key) if pooled else None
                if conn is None:
                    pooled = False
                    conn = await self._connect(url, key)
                self._busy.add(conn)
                conn.request(raw, stream)
                await conn.answered()
                if conn.status:
                    break
                conn.close()
                self._busy.discard(conn)
                if pooled and not conn.got_bytes:
                    continue  # the worker had closed this kept-alive connection: a fresh one
                why = conn.error or "the worker closed the connection before answering"
                raise UpstreamError("connect", f"{url}: {why}")
            assert conn is not None
            if conn.status != 200:
                raise _status_error(conn.status, await conn.whole())
            assert stream.ended is not None
            await stream.ended
        finally:
            stream._conn = None
            if conn is not None:
                self._busy.discard(conn)
                self._release(key, conn, stream)

    def _release(self, key: tuple[str, str, int], conn: _Conn, stream: UpstreamStream) -> None:
        if not stream.finished or conn.closed:
            conn.close()  # the worker sees the disconnect and cancels the generation
            return
        conn.stream = None  # what is left of the body (``[DONE]``) is read and dropped
        if conn.complete:
            self._keep(key, conn)
        else:
            self._busy.add(conn)
            conn.then = lambda: self._keep(key, conn)

    def _keep(self, key: tuple[str, str, int], conn: _Conn) -> None:
        self._busy.discard(conn)
        if not conn.reusable:
            conn.close()
            return
        self._pool.setdefault(key, []).append(conn)
        # closed once idle for IDLE_S even if no request comes to this worker again (a worker that left)
        conn.expiry = asyncio.get_running_loop().call_later(IDLE_S, self._expire, key, conn)

    def _expire(self, key: tuple[str, str, int], conn: _Conn) -> None:
        idle = self._pool.get(key)
        if idle is not None and conn in idle:
            idle.remove(conn)
            if not idle:
                del self._pool[key]
        conn.close()

    def _idle(self, key: tuple[str, str, int]) -> _Conn | None:
        idle = self._pool.get(key)
        now = asyncio.get_running_loop().time()
        while idle:
            conn = idle.pop()
            fresh = conn.expiry is not None and conn.expiry.when() > now  # its expiry may be late on a busy loop
            if conn.expiry is not None:
                conn.expiry.cancel()
                conn.expiry = None
            if fresh and conn.open:
                return conn
            conn.close()
        return None

    async def _connect(self, url: str, key: tuple[str, str, int]) -> _Conn:
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        context = None
        if scheme == "https":
            context = self._ssl = self._ssl or ssl.create_default_context()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(_Conn, host, port, ssl=context),
                                             self._connect_timeout)
        except (TimeoutError, OSError) as exc:
            raise UpstreamError("connect", f"{url}: {type(exc).__name__}: {exc}") from exc
        return conn


def _status_error(status: int, raw: bytes) -> UpstreamError:
    try:
        detail = orjson.loads(raw)
    except orjson.JSONDecodeError:
        detail = {"error": {"message": raw.decode(errors="replace")[:500], "code": status}}
    err = detail.get("error") if isinstance(detail, dict) else None
    message = err.get("message", "") if isinstance(err, dict) else str(detail)[:500]
    return UpstreamError("status", message, status=status, body=detail if isinstance(detail, dict) else None)


def _origin(url: str) -> tuple[str, str, int]:
    parsed = urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise UpstreamError("connect", f"{url}: a worker's URL must be http:// or https://")
    return parsed.scheme, parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)
