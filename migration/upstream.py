"""The router's client to workers: one streaming completion, parsed chunk by chunk.

Every way a worker can fail a stream becomes one :class:`UpstreamError` with a ``kind``:

============  =====================================================================================
connect       could not connect (refused, unreachable, connect timeout)
status        answered with an error status before streaming (``status`` holds it; 4xx = the request
              is bad and must not be retried elsewhere, 5xx = the worker is)
reset         the connection broke mid-stream
eof           the stream ended without a finish reason (or without ``[DONE]`` before one)
error_event   vLLM's in-band ``data: {"error": ...}`` (e.g. its engine died mid-stream)
aborted       the router aborted the stream on purpose (``reason`` says why: stalled, unhealthy, ...)
bad_chunk     a chunk that is not valid JSON or lacks token ids
============  =====================================================================================

Aborting a stream closes its connection, which is also how the worker learns to cancel the generation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import aiohttp
import httptools
import orjson

__all__ = ["Chunk", "Upstream", "UpstreamError", "UpstreamStream"]


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
        """The worker refused the request itself (4xx): retrying elsewhere would be refused too."""
        return self.kind == "status" and self.status is not None and 400 <= self.status < 500 and self.status != 429


@dataclass(slots=True)
class Chunk:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: str | int | None
    prompt_token_ids: list[int] | None
    logprobs: Any


def _parse(payload: bytes) -> Chunk | None:
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise UpstreamError("bad_chunk", f"not JSON: {payload[:120]!r}") from exc
    if "error" in data:
        err = data["error"]
        message = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        raise UpstreamError("error_event", message, body=data)
    choices = data.get("choices")
    if not choices:
        return None  # the usage chunk
    c = choices[0]
    delta = c.get("delta")
    text = (delta.get("content") or "") if delta is not None else (c.get("text") or "")
    prompt_ids = c.get("prompt_token_ids") or data.get("prompt_token_ids")
    token_ids = c.get("token_ids")
    if token_ids is None:
        if delta is not None and not text and c.get("finish_reason") is None:
            token_ids = []  # chat's opening role chunk
        else:
            raise UpstreamError("bad_chunk", "chunk without token_ids (worker ignored return_token_ids?)")
    return Chunk(token_ids, text, c.get("finish_reason"), c.get("stop_reason"), prompt_ids, c.get("logprobs"))


def _data_lines(event: bytes) -> list[bytes]:
    return [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]


class UpstreamStream:
    """One open stream; iterate for chunks, :meth:`abort` to cut it from another task.

    ``source`` yields the response body as the socket delivers it; ``close`` cuts the connection.
    """

    def __init__(self, source: AsyncIterator[bytes], close: Callable[[], None], worker: str) -> None:
        self._source = source
        self._close = close
        self.worker = worker
        self.abort_reason: str | None = None
        self.finished = False

    def abort(self, reason: str) -> None:
        if self.abort_reason is None and not self.finished:
            self.abort_reason = reason
            self._close()

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        got_finish = False
        done = False
        buf = b""
        try:
            # Whatever the socket has, split into SSE events here: one read per network read instead of
            # a readline per line.
            async for data in self._source:
                buf = buf + data if buf else data
                if b"\r" in buf:
                    buf = buf.replace(b"\r\n", b"\n")
                *events, buf = buf.split(b"\n\n")
                for event in events:
                    for payload in _data_lines(event):
                        if payload == b"[DONE]":
                            done = True
                            break
                        chunk = _parse(payload)
                        if chunk is None:
                            continue
                        if chunk.finish_reason is not None:
                            got_finish = True
                        yield chunk
                    if done:
                        break
                if done:
                    break
            if not done and buf.strip():  # a last event without its blank line, then EOF
                for payload in _data_lines(buf):
                    if payload == b"[DONE]":
                        break
                    chunk = _parse(payload)
                    if chunk is not None:
                        got_finish = got_finish or chunk.finish_reason is not None
                        yield chunk
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
            if self.abort_reason is not None:
                raise UpstreamError("aborted", self.abort_reason) from exc
            raise UpstreamError("reset", f"{type(exc).__name__}: {exc}") from exc
        if self.abort_reason is not None:
            raise UpstreamError("aborted", self.abort_reason)
        if not got_finish:
            raise UpstreamError("eof", "stream ended without a finish reason")
        self.finished = True


class _Conn(asyncio.Protocol):
    """One HTTP/1.1 connection to a worker, its responses parsed by httptools as bytes arrive.

    The lean path for streams: the body goes to the reader as the socket delivers it, with no stream
    reader, flow control or per-read bookkeeping in between (issue 15: aiohttp's ``StreamReader`` was a
    fifth of the router's per-token CPU). One response at a time; kept alive for the next request.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.got_bytes = False
        self.body: list[bytes] = []
        self.error: str | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one without subclassing it

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = f"bad HTTP from the worker: {exc}"
            self.close()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        """Until something arrives (bytes, the end, the connection's loss)."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def request(self, raw: bytes) -> None:
        self._reset()
        assert self.transport is not None
        self.transport.write(raw)

    def take(self) -> bytes:
        body = self.body
        self.body = []
        return body[0] if len(body) == 1 else b"".join(body)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; ConnectionError when the connection goes before the response ends."""
        while True:
            if self.body:
                yield self.take()
                continue
            if self.complete:
                return
            if self.closed:
                raise ConnectionError(self.error or "the worker closed the connection mid-response")
            await self.wait()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    @property
    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed and self.transport is not None \
            and not self.transport.is_closing()


class Upstream:
    """A pooled HTTP client to workers."""

    def __init__(self, *, connect_timeout: float = 2.0, limit: int = 0) -> None:
        self._connect_timeout = connect_timeout
        self._limit = limit
        self._session: aiohttp.ClientSession | None = None  # for whole answers (call)
        self._pool: dict[tuple[str, int], list[_Conn]] = {}  # idle kept-alive stream connections

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=self._limit, keepalive_timeout=30, enable_cleanup_closed=True)
        timeout = aiohttp.ClientTimeout(total=None, connect=self._connect_timeout, sock_read=None)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False)

    async def aclose(self) -> None:
        for conns in self._pool.values():
            for conn in conns:
                conn.close()
        self._pool.clear()
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

    @contextlib.asynccontextmanager
    async def open(self, worker: str, url: str, path: str, body: dict[str, Any]) -> AsyncIterator[UpstreamStream]:
        """A streamed request on a pooled connection of its own (see :class:`_Conn`)."""
        host, port = _host_port(url)
        payload = orjson.dumps(body)
        raw = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
               f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload
        conn: _Conn | None = None
        stream: UpstreamStream | None = None
        try:
            for pooled in (True, False):
                conn = self._idle(host, port) if pooled else None
                if conn is None:
                    pooled = False
                    conn = await self._connect(url, host, port)
                conn.request(raw)
                while not conn.headers_done and not conn.closed:
                    await conn.wait()
                if conn.headers_done:
                    break
                conn.close()
                if pooled and not conn.got_bytes:
                    continue  # the worker had closed this kept-alive connection: a fresh one
                why = conn.error or "the worker closed the connection before answering"
                raise UpstreamError("connect", f"{url}: {why}")
            assert conn is not None
            if conn.status != 200:
                while not conn.complete and not conn.closed:
                    await conn.wait()
                rawbody = conn.take()
                try:
                    detail = orjson.loads(rawbody)
                except orjson.JSONDecodeError:
                    detail = {"error": {"message": rawbody.decode(errors="replace")[:500], "code": conn.status}}
                err = detail.get("error") if isinstance(detail, dict) else None
                message = err.get("message", "") if isinstance(err, dict) else str(detail)[:500]
                raise UpstreamError("status", message, status=conn.status, body=detail)
            stream = UpstreamStream(conn.chunks(), conn.close, worker)
            yield stream
        finally:
            if conn is not None:
                if stream is not None and stream.finished and conn.reusable:
                    self._pool.setdefault((host, port), []).append(conn)  # kept for the next request
                else:
                    conn.close()  # the worker sees the disconnect and cancels the generation

    def _idle(self, host: str, port: int) -> _Conn | None:
        idle = self._pool.get((host, port))
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def _connect(self, url: str, host: str, port: int) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(_Conn, host, port), self._connect_timeout)
        except (TimeoutError, OSError) as exc:
            raise UpstreamError("connect", f"{url}: {type(exc).__name__}: {exc}") from exc
        return conn


def _host_port(url: str) -> tuple[str, int]:
    parsed = urlsplit(url)
    if parsed.scheme != "http" or not parsed.hostname:
        raise UpstreamError("connect", f"{url}: only http:// worker URLs are supported for streams")
    return parsed.hostname, parsed.port or 80
