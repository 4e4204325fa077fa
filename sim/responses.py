"""The simulated worker's HTTP responses: JSON as vLLM writes it, and the responses that hand an engine request
back once sent.

Every response that carries an engine request's answer runs ``on_close`` (the engine's release of the
request: its batch slot and KV blocks) once it is sent, or sending failed, or the client went away.
A request the engine cut (:class:`~.engine.RequestCut`, the ``reset_*`` fault switches) drops its
connection instead of answering: mid-body for a stream (:class:`EventStream`), right after the head of
a 200 otherwise (:class:`Cut`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from fleetward.sim.engine import RequestCut
from fleetward.sim.protocol import ApiError

__all__ = ["Cut", "EventStream", "Released", "enc", "error_response", "json_response"]

log = logging.getLogger("fleetward.simworker")

enc = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
"""JSON as vLLM's responses write it: compact, not ASCII-escaped."""


def json_response(body: dict[str, Any], status: int = 200) -> Response:
    return Response(enc(body).encode(), status_code=status, media_type="application/json")


def error_response(err: ApiError) -> Response:
    return json_response(err.body(), err.status)


class EventStream(StreamingResponse):
    """An SSE response that always closes its generator and then runs ``on_close`` (the engine release),
    whether the stream ended, the client went away, the request was cut, or the server is shutting down.

    A cut (:class:`RequestCut` out of the generator) returns without the final body message: an ASGI app
    that returns with its response incomplete makes the server close the connection there (uvicorn logs
    "ASGI callable returned without completing response."), so the client's chunked body ends unfinished.
    """

    def __init__(self, events: AsyncGenerator[bytes, None], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except RequestCut as exc:
            log.info("%s; dropping the stream mid-body", exc)
        finally:
            try:
                await self._events.aclose()
            finally:
                self._on_close()


class Released(Response):
    """A JSON response that runs ``on_close`` once it is sent (or sending failed)."""

    def __init__(self, body: dict[str, Any], status: int, on_close: Callable[[], None]) -> None:
        super().__init__(enc(body).encode(), status_code=status, media_type="application/json")
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class Cut(Response):
    """Drops the connection of a cut non-stream request, then runs ``on_close``.

    ASGI cannot close a connection before a response starts (the server would answer 500 instead), so
    this sends the head of a chunked 200 response and returns without a body: the server closes the
    connection there, and the client sees a response whose body ends before it began.
    """

    def __init__(self, cut: RequestCut, on_close: Callable[[], None]) -> None:
        super().__init__(status_code=200)
        self._cut = cut
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        log.info("%s; dropping the connection after the response head", self._cut)
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
        finally:
            self._on_close()

