"""The client's side of a streamed answer: vLLM's SSE events, written to the client's socket as they are made.

The request itself goes through FastAPI as every other (keys, validation, admission, resume: :mod:`.serving`),
and so do the response's headers and its end. The events between them do not: :class:`SseOutput` encodes them
in the relay's callbacks (:mod:`.relay`) and writes what one upstream read produced as one HTTP chunk, straight
to the client's transport, which :class:`ClientConnection` (the router's HTTP protocol: uvicorn's httptools
protocol, plus the transport in the request's scope) hands over. No task, queue, generator or ASGI message per
token (docs/benchmarks.md section 1).

Backpressure is the transports' own: once the client's transport is past its high-water mark, the stream's
upstream is paused (it stops reading its worker) until the client's transport drains. A slow client holds up
its own stream only.

Served by another ASGI server (no :class:`ClientConnection`), the same events go out as ASGI messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Protocol

from starlette.responses import Response
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from fleetward.fleet.clock import Clock
from fleetward.migration import wire
from fleetward.migration.journal import Journal
from fleetward.migration.metrics import RouterMetrics
from fleetward.migration.progress import ProgressModel
from fleetward.migration.upstream import UpstreamStream
from fleetward.migration.wire import RouterError

__all__ = ["ClientConnection", "ClientStream", "SseOutput", "StreamResponse", "until_disconnected"]

log = logging.getLogger(__name__)

EXTENSION = "fleetward.client"  # the scope's extension that holds the request's ClientConnection


class ClientStream(Protocol):
    """What a streamed response's connection writes and holds back: one request's :class:`SseOutput`, or
    the choices of one request together (:class:`~fleetward.migration.fanout.FanOut`)."""

    write: Callable[[bytes], None]

    @property
    def rid(self) -> str:
        """The response's id."""

    def pending(self) -> bytes:
        """What was made before the response went out (taken)."""

    def pause(self) -> None:
        """The client's transport is full: stop reading the workers until it drains."""

    def resume(self) -> None:
        """The client's transport drained."""


class ClientConnection(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol (httptools), which also puts itself in each request's scope
    (``scope["extensions"]["fleetward.client"]``) and tells the stream it serves when its transport drained
    or went."""

    serving: ClientStream | None = None  # the stream being written on this connection
    lost: asyncio.Future[None] | None = None

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {EXTENSION: self}  # type: ignore[dict-item]

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.serving is not None:
            self.serving.resume()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.lost is not None and not self.lost.done():
            self.lost.set_result(None)

    def hold(self, out: ClientStream) -> asyncio.Future[None]:
        """Serve ``out`` on this connection: the future is done when the connection goes."""
        self.serving = out
        self.lost = asyncio.get_running_loop().create_future()
        if self.transport.is_closing():
            self.lost.set_result(None)
        out.write = self._write
        return self.lost

    def let_go(self) -> None:
        self.serving, self.lost = None, None

    def _write(self, data: bytes) -> None:
        transport = self.transport
        if transport.is_closing():
            return
        transport.write(b"%x\r\n%b\r\n" % (len(data), data))  # an HTTP chunk (the response is chunked)
        if self.flow.write_paused and self.serving is not None:
            self.serving.pause()


class SseOutput:
    """One streamed response's events, as vLLM would send them (:mod:`.wire`): the replay of a resumed stream,
    every chunk of tokens, then usage and ``[DONE]``, or the in-band error. An :class:`~.relay.Output`.

    ``skip``: tokens the client already holds (it resumed with ``Last-Event-ID``). With ``trace`` every chunk
    also carries ``"fleetward": {"worker", "attempt"}``; with ``ids`` every event ``id: <request id>:<n>``.
    One choice of several (:class:`~fleetward.migration.fanout.FanOut`) is choice ``index`` of the response
    ``rid``: its events go to the response's writer, which opens the stream and ends it for all of them.
    """

    def __init__(self, j: Journal, skip: int, *, metrics: RouterMetrics, progress: ProgressModel, clock: Clock,
                 trace: bool = False, ids: bool = False, rid: str | None = None, index: int = 0) -> None:
        self.j = j
        self.metrics = metrics
        self.progress = progress
        self.clock = clock
        self.trace = trace
        self.encoder = wire.StreamEncoder(j, ids=ids, rid=rid, index=index)
        self.opening: Callable[[], bytes] = self.encoder.opening  # what the stream's first event follows
        self.started_at = clock.monotonic()
        # done once the response is a stream: a worker accepted the request, or there is a checkpoint to replay
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending: list[bytes] = []
        self.write: Callable[[bytes], None] = self._pending.append  # until the response is under way
        self._parts: list[bytes] = []
        self.paused = False
        self._stream: UpstreamStream | None = None
        self._worker = ""
        n = len(j.emitted)
        self._opened = False  # the client has its stream's first event
        if skip < n:  # replay what the checkpoint has and the client lacks, as soon as the response starts
            self.write((self.encoder.opening() if skip == 0 else b"") + self.encoder.event(
                n, tokens=j.emitted[skip:], text=j.text_after(skip), finish_reason=j.finish_reason,
                stop_reason=j.stop_reason, first=skip == 0))
            self._opened = True
            self.started.set_result(None)
        self.to_skip = max(0, skip - n)  # the client has tokens the checkpoint lacks: regenerate, don't resend
        # What the client holds so far. Ids come from each chunk's own count, never from the journal.
        self.delivered = max(skip, n)
        self.first_at, self.first_n = 0.0, -1  # when and at which count this stream's first token went out

    @property
    def signalled(self) -> bool:
        """The response is a stream: failures from here on are in-band."""
        return self.started.done()

    @property
    def rid(self) -> str:
        return self.encoder.rid or self.j.id

    # -- the relay's side (Output) ----------------------------------------------------------------------

    def opened(self) -> None:
        if not self.started.done():
            self.started.set_result(None)

    def tokens(self, tokens: list[int], text: str, finish_reason: str | None, stop_reason: str | int | None,
               logprobs: Any, worker: str, n: int, attempt: int) -> None:
        j = self.j
        if self.to_skip:
            dropped = min(self.to_skip, len(tokens))
            self.to_skip -= dropped
            tokens = tokens[dropped:]
            if dropped:  # the client has these tokens' text too: only what the rest add is new
                ends = j.text_ends
                text = j.text[ends[n - len(tokens) - 1]:ends[n - 1]] if tokens else ""
            if not tokens and finish_reason is None:
                return
        if self.first_n < 0 and tokens:  # this stream's first tokens (chat or completion)
            self.first_at, self.first_n = self.clock.monotonic(), n
            if n == len(tokens):  # and the request's first: not a resume's
                self.metrics.ttft.labels(j.model).observe(self.first_at - self.started_at)
        first = not self._opened and self.delivered == 0
        if first:
            self._parts.append(self.opening())
        extra = {"fleetward": {"worker": worker, "attempt": attempt}} if self.trace else None
        self._parts.append(self.encoder.event(n, tokens=tokens, text=text, finish_reason=finish_reason,
                                              stop_reason=stop_reason, logprobs=logprobs, first=first,
                                              extra=extra))
        self.delivered = n
        self._opened = True

    def flush(self) -> None:
        parts = self._parts
        if parts:
            self._parts = []
            self.write(parts[0] if len(parts) == 1 else b"".join(parts))

    def reading(self, stream: UpstreamStream | None, worker: str) -> None:
        self._stream, self._worker = stream, worker
        if self.paused:
            self._hold()

    # -- backpressure -----------------------------------------------------------------------------------

    def pause(self) -> None:
        """The client's transport is full: stop reading the worker until it drains."""
        if not self.paused:
            self.paused = True
            self._hold()

    def _hold(self) -> None:
        if self._stream is not None:
            self._stream.pause()
            self.progress.paused(self._worker, self.j.id)

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            if self._stream is not None:
                self.progress.resumed(self._worker, self.j.id)
                self._stream.resume()

    # -- the end ----------------------------------------------------------------------------------------

    def finish(self) -> None:
        """The stream ended whole: usage (when asked for) and ``[DONE]``."""
        j = self.j
        if j.wants_usage:  # in a stream: stream_options.include_usage
            self._parts.append(self.encoder.wrap(self.delivered, wire.usage_chunk(j)))
        self.observe_itl()
        self.metrics.requests.labels(j.kind.value, "ok").inc()
        self._parts.append(wire.DONE)
        self.flush()

    def observe_itl(self) -> None:
        """The stream's mean inter-token latency, once it ended whole."""
        if self.first_n >= 0 and self.delivered > self.first_n:
            self.metrics.itl.labels(self.j.model).observe(
                (self.clock.monotonic() - self.first_at) / (self.delivered - self.first_n))

    def fail(self, exc: RouterError) -> None:
        """The stream cannot go on: vLLM's in-band error, then ``[DONE]``."""
        self.metrics.requests.labels(self.j.kind.value, f"failed_{exc.status}").inc()
        self._parts += (self.encoder.error(self.delivered, exc.status, exc.message, exc.body), wire.DONE)
        self.flush()

    def pending(self) -> bytes:
        """What was made before the response went out (taken)."""
        data, self._pending = b"".join(self._pending), []
        return data


class StreamResponse(Response):
    """The response of a streamed generation: headers and the end through ASGI, the events between them
    written by :class:`SseOutput` as the relay makes them. ``work`` is the request's generation; it ends when
    the stream does. A client that goes away cancels it (the upstream connection closes, so the worker stops
    too); ``on_end(finished)`` runs once either way."""

    media_type = "text/event-stream"

    def __init__(self, out: ClientStream, work: asyncio.Task[None], *, headers: dict[str, str],
                 on_end: Callable[[bool], None]) -> None:
        self.status_code = 200
        self.background = None
        self.out = out
        self.work = work
        self.on_end = on_end
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished = False
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            conn = scope.get("extensions", {}).get(EXTENSION)
            if isinstance(conn, ClientConnection):
                finished = await self._direct(conn, send)
            else:
                finished = await self._messages(receive, send)
        finally:
            if not self.work.done():
                self.work.cancel()
                with contextlib.suppress(asyncio.CancelledError, RouterError):
                    await self.work
            self.on_end(finished)
            if self.background is not None:
                await self.background()

    async def _direct(self, conn: ClientConnection, send: Send) -> bool:
        pending = self.out.pending()
        lost = conn.hold(self.out)
        try:
            if pending:
                self.out.write(pending)
            await asyncio.wait({self.work, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            conn.let_go()
        if not self.work.done():
            return False  # the client went away
        if self.work.cancelled() or self.work.exception() is not None:
            if not self.work.cancelled():
                log.error("request %s: its stream failed", self.out.rid, exc_info=self.work.exception())
            conn.transport.close()  # cut short (e.g. another router took it over): the client resumes
            return False
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True

    async def _messages(self, receive: Receive, send: Send) -> bool:
        """The same stream through ASGI messages (another server than the router's own)."""
        ready = asyncio.Event()
        pending = self.out.pending()
        buffered: list[bytes] = [pending] if pending else []

        def write(data: bytes) -> None:
            buffered.append(data)
            ready.set()

        self.out.write = write
        gone = asyncio.ensure_future(until_disconnected(receive))
        try:
            while True:
                if not buffered:
                    waiter = asyncio.ensure_future(ready.wait())
                    await asyncio.wait({self.work, gone, waiter}, return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                ready.clear()
                data, buffered[:] = b"".join(buffered), []
                if data:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                if gone.done():
                    return False
                if self.work.done() and not buffered:
                    break
        finally:
            gone.cancel()
        if self.work.cancelled() or self.work.exception() is not None:
            return False
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True


async def until_disconnected(receive: Receive) -> None:
    """Until the client goes away (ASGI's ``http.disconnect``; any body it still sends is dropped)."""
    while (await receive())["type"] != "http.disconnect":
        pass
