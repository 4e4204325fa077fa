"""What a client may not make the router hold or pass on: a body past its size, a worker-to-worker parameter.

- :class:`BodyLimit`, ASGI middleware: a request body over ``routing.max_request_bytes`` is answered 413 in the
  OpenAI error shape before the router holds it (by its ``Content-Length``, or counted as a chunked body
  arrives), so one client cannot fill a router's memory; the body is read whole by every handler otherwise.
- :func:`without_transfer_params`: ``kv_transfer_params`` and ``ec_transfer_params`` (any ``*_transfer_params``)
  are how the router tells a worker where to pull or push KV (prefill/decode, planned moves); a client's own
  would point a worker's connector at any address it likes. They are taken out of every client body before
  it is journaled or passed on, and counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleetward.migration.wire import error_body

__all__ = ["BodyLimit", "strip_transfer_params", "without_transfer_params"]

_SUFFIX = "_transfer_params"


class BodyLimit:
    """ASGI middleware: 413 for a request body over ``limit`` bytes (module docstring); ``refused`` is called
    for each one refused."""

    def __init__(self, app: ASGIApp, *, limit: int, refused: Callable[[], None] = lambda: None) -> None:
        self.app = app
        self.limit = limit
        self.refused = refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None:
            if length.isdigit() and int(length) > self.limit:
                await self._refuse(send, int(length))
                return
            await self.app(scope, receive, send)  # the server reads no more than it says
            return
        # No length (chunked): read it here, up to the limit, then hand the app what came.
        kept: list[Message] = []
        size = 0
        while True:
            message = await receive()
            kept.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                await self._refuse(send, size)
                return
            if not message.get("more_body"):
                break

        async def replay() -> Message:
            return kept.pop(0) if kept else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, size: int) -> None:
        self.refused()
        body = orjson.dumps(error_body(413, f"the request body ({size} bytes) is over this router's limit of "
                                            f"{self.limit} bytes (routing.max_request_bytes)"))
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def strip_transfer_params(body: dict[str, Any]) -> list[str]:
    """Take every ``*_transfer_params`` key out of ``body`` (in place); the keys taken."""
    taken = [k for k in body if isinstance(k, str) and k.endswith(_SUFFIX)]
    for k in taken:
        del body[k]
    return taken


def without_transfer_params(raw: bytes) -> tuple[bytes, list[str]]:
    """A JSON body as bytes without its ``*_transfer_params`` keys, and the keys taken; ``raw`` itself when it
    has none or is not a JSON object (the worker refuses that in its own words)."""
    if _SUFFIX.encode() not in raw:
        return raw, []
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw, []
    if not isinstance(body, dict):
        return raw, []
    taken = strip_transfer_params(body)
    return (orjson.dumps(body), taken) if taken else (raw, [])
