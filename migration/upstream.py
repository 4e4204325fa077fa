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

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
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
        raise UpstreamError("error_event", str(message), body=data)
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


def _data_lines(event: bytes) -> list[bytes]:
    return [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]


class UpstreamStream:
    """One open stream; iterate for chunks, :meth:`abort` to cut it from another task."""

    def __init__(self, response: aiohttp.ClientResponse, worker: str) -> None:
        self.response = response
        self.worker = worker
        self.abort_reason: str | None = None
        self.finished = False

    def abort(self, reason: str) -> None:
        if self.abort_reason is None and not self.finished:
            self.abort_reason = reason
            self.response.close()

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        got_finish = False
        done = False
        buf = b""
        try:
            # Whatever the socket has, split into SSE events here: one read per network read instead of
            # a readline per line (aiohttp's line reader dominated the router's per-token cost).
            async for data in self.response.content.iter_any():
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


IDLE_S = 4.0  # how long an idle pooled connection to a worker is kept


class Upstream:
    """A pooled HTTP client to workers."""

    def __init__(self, *, connect_timeout: float = 2.0, limit: int = 0) -> None:
        self._connect_timeout = connect_timeout
        self._limit = limit
        self._session: aiohttp.ClientSession | None = None

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
        assert self._session is not None, "Upstream.start() first"
        try:
            response = await self._session.post(url + path, data=orjson.dumps(body),
                                                headers={"content-type": "application/json"})
        except (TimeoutError, aiohttp.ClientConnectionError, OSError) as exc:
            raise UpstreamError("connect", f"{url}: {type(exc).__name__}: {exc}") from exc
        stream: UpstreamStream | None = None
        try:
            if response.status != 200:
                raw = await response.read()
                try:
                    detail = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    detail = {"error": {"message": raw.decode(errors="replace")[:500], "code": response.status}}
                err = detail.get("error") if isinstance(detail, dict) else None
                message = err.get("message", "") if isinstance(err, dict) else str(detail)[:500]
                raise UpstreamError("status", message, status=response.status, body=detail)
            stream = UpstreamStream(response, worker)
            yield stream
        finally:
            if stream is not None and stream.finished:
                response.release()  # keep the connection for the next request
            else:
                response.close()  # the worker sees the disconnect and cancels the generation
