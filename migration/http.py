"""The router's HTTP surface: the routes of vLLM's server, API keys, the OpenAPI spec.

- ``POST /v1/completions``, ``POST /v1/chat/completions``: journaled, resumable generations
  (:class:`~fleetward.migration.router.Router`);
- every other vLLM endpoint, passed through (:mod:`~fleetward.migration.passthrough`'s ``ROUTES``);
- ``GET /v1/models``: every worker's model card merged (one worker asked per model), with the router's
  ``fleetward`` status of each model (where its text comes from);
- ``GET /health``, ``GET /metrics``, ``GET /fleetward/v1/progress`` (the per-worker token progress the
  supervisor's stream-progress detector reads).

Every error, an unknown route (404) or method (405) included, has the OpenAI shape
``{"error": {"message", "type", "param", "code"}}``. With ``routing.api_keys_file`` every API route takes a
key (``Authorization: Bearer``): 401 without a known one, 429 past its ``max_concurrency``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from fleetward.migration.apikeys import ApiKey
from fleetward.migration.journal import Kind, request_schema
from fleetward.migration.passthrough import ROUTES, Route
from fleetward.migration.router import Router, RouterError

__all__ = ["router_app"]

_MODELS_TIMEOUT_S = 2.0


def router_app(router: Router) -> FastAPI:
    # The OpenAPI spec (/openapi.json) describes the bodies the handlers parse themselves (_openapi_post).
    app = FastAPI(title="fleetward router", docs_url=None, redoc_url=None, openapi_url="/openapi.json")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # Starlette's own refusals (no such route: 404; a route without this method: 405) in the OpenAI
        # error shape of every other answer here, instead of FastAPI's {"detail": ...}.
        method, path = request.method, request.url.path
        if exc.status_code == 404:
            message = f"no route {method} {path} on this router"
        elif exc.status_code == 405:
            message = f"{path} does not take {method}; it takes {(exc.headers or {}).get('Allow', 'nothing')}"
        else:
            message = str(exc.detail)
        return RouterError(exc.status_code, message, headers=exc.headers).response()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if router.accepting else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if router.api_keys is not None:
            key = api_key(router, request)
            if isinstance(key, RouterError):
                return key.response()
        return JSONResponse({"object": "list", "data": await merged_models(router)})

    @app.get("/fleetward/v1/progress")
    async def progress() -> JSONResponse:
        return JSONResponse({"router": router.id, "ts": router.clock.wall(), **router.progress.view()})

    @app.post("/v1/completions", operation_id="completions", openapi_extra=_openapi_post(Kind.COMPLETION))
    async def completions(request: Request) -> Response:
        return await keyed(router, request, lambda owner: router.handle(request, Kind.COMPLETION, owner=owner))

    @app.post("/v1/chat/completions", operation_id="chat_completions", openapi_extra=_openapi_post(Kind.CHAT))
    async def chat(request: Request) -> Response:
        return await keyed(router, request, lambda owner: router.handle(request, Kind.CHAT, owner=owner))

    for route in ROUTES:
        app.add_api_route(route.path, _passthrough(router, route), methods=[route.method],
                          operation_id=_operation_id(route), openapi_extra=_openapi_passthrough(route))

    if router.api_keys is not None:  # the spec says which operations take a key, and what a key adds
        spec = app.openapi()
        spec.setdefault("components", {})["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
        keyed_routes = [("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/v1/models", "get"),
                        *((r.path, r.method.lower()) for r in ROUTES)]
        for path, method in keyed_routes:
            operation = spec["paths"][path][method]
            operation["security"] = [{"apiKey": []}]
            operation["responses"]["401"] = {"description": "a missing or unknown API key"}
            operation["responses"]["429"] = {"description": "the key has max_concurrency requests in flight"}
            if path in ("/v1/completions", "/v1/chat/completions"):
                operation["responses"]["404"]["description"] += " (or another key's request)"
    return app


def _passthrough(router: Router, route: Route) -> Callable[[Request], Awaitable[Response]]:
    async def relay(request: Request) -> Response:
        return await keyed(router, request, lambda _owner: router.relay(route, request))

    relay.__name__ = _operation_id(route)
    return relay


async def merged_models(router: Router) -> list[dict[str, Any]]:
    """Each model's card as its workers give it (one routable worker asked per model, at once), vLLM's fields
    (``root``, ``max_model_len``, ``permission``) included; a model whose worker did not answer gets a card of
    the router's own. Either way with ``"fleetward": {"detokenizer", ...}``: where the router's text for the
    model comes from."""
    session = router.upstream.session
    now = int(router.clock.wall())

    async def card(model: str) -> dict[str, Any]:
        picked = router.pick(model, [])
        if picked is not None:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError,
                                     TypeError, KeyError):
                async with session.get(picked[1] + "/v1/models",
                                       timeout=aiohttp.ClientTimeout(total=_MODELS_TIMEOUT_S)) as r:
                    if r.status == 200:
                        cards = orjson.loads(await r.read())["data"]
                        found = next((c for c in cards if isinstance(c, dict) and c.get("id") == model), None)
                        if found is not None:
                            return {**found, "fleetward": router.text_status(model)}
        return {"id": model, "object": "model", "created": now, "owned_by": "fleetward", "root": model,
                "parent": None, "fleetward": router.text_status(model)}

    return list(await asyncio.gather(*(card(m) for m in router.models())))


def api_key(router: Router, request: Request) -> ApiKey | RouterError:
    """The API key the request carries, or the 401 that refuses it."""
    assert router.api_keys is not None
    key = router.api_keys.check(request.headers.get("authorization"))
    if isinstance(key, ApiKey):
        return key
    router.metrics.auth_failures.labels(key).inc()
    message = ("missing API key: send it as Authorization: Bearer <key>" if key == "missing"
               else "incorrect API key provided")
    return RouterError(401, message, headers={"WWW-Authenticate": "Bearer"})


async def keyed(router: Router, request: Request, handle: Callable[[str | None], Awaitable[Response]]) -> Response:
    """``handle(owner)`` under the request's API key, when the router takes keys (``owner`` is its name, else
    None): 401 without a known key, 429 when the key has ``max_concurrency`` requests in flight; its slot is
    held until the answer (or the stream) ends, or the client goes away."""
    if router.api_keys is None:
        return await handle(None)
    key = api_key(router, request)
    if isinstance(key, RouterError):
        return key.response()
    if not key.acquire():
        router.metrics.key_requests.labels(key.name, "over_limit").inc()
        return RouterError(429, f"API key {key.name!r} has {key.limit} requests in flight, its limit; retry "
                           "when one ends", retry_after=1).response()
    router.metrics.key_requests.labels(key.name, "accepted").inc()
    try:
        response = await handle(key.name)
    except BaseException:
        key.release()
        raise
    if not isinstance(response, StreamingResponse):
        key.release()
        return response
    inner, released = response.body_iterator, False
    before = response.background

    def release() -> None:  # once: when the stream ends, or after the response if it never started
        nonlocal released
        if not released:
            released = True
            key.release()

    async def held() -> AsyncIterator[Any]:
        try:
            async for chunk in inner:
                yield chunk
        finally:
            release()

    async def after() -> None:
        release()
        if before is not None:
            await before()

    response.body_iterator = held()
    response.background = BackgroundTask(after)
    return response


def _operation_id(route: Route) -> str:
    name = route.path.strip("/").replace("/", "_").replace("{", "").replace("}", "")
    return f"{route.method.lower()}_{name}"


def _openapi_passthrough(route: Route) -> dict[str, Any]:
    """What the spec says of a passed-through operation: the worker answers for its body."""
    extra: dict[str, Any] = {
        "description": f"Passed through to a healthy worker of the request's model (vLLM's `{route.path}`); the "
                       "worker's answer is the router's.",
        "responses": {"200": {"description": "the worker's answer"},
                      "400": {"description": "a request the worker refused, or no model where the fleet serves "
                                             "several"},
                      "404": {"description": "an unknown model"},
                      "503": {"description": "no healthy worker could answer"}},
    }
    if route.method == "POST" and route.model == "form":
        extra["requestBody"] = {"required": True, "content": {"multipart/form-data": {"schema": {
            "type": "object", "properties": {"model": {"type": "string"}, "file": {"type": "string",
                                                                                   "format": "binary"}}}}}}
    elif route.method == "POST":
        extra["requestBody"] = {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "properties": {"model": {"type": "string", "minLength": 1}},
            "additionalProperties": True}}}}
    return extra


def _openapi_post(kind: Kind) -> dict[str, Any]:
    """What the OpenAPI spec says of a generation request the handler parses itself: body, headers, the resume.

    The link says a 200's ``X-Request-Id`` resumes the request: the same body with ``Last-Event-ID``.
    """
    operation = "completions" if kind is Kind.COMPLETION else "chat_completions"
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": request_schema(kind)}}},
        "parameters": [
            {"name": "Last-Event-ID", "in": "header", "required": False,
             "description": "resume a request: <request id>:<tokens the client holds>",
             "schema": {"type": "string", "pattern": "^[^:]+:[0-9]+$"}},
            {"name": "X-Fleetward-Event-Ids", "in": "header", "required": False,
             "description": "1: every SSE event carries id: <request id>:<tokens the client holds>",
             "schema": {"type": "string", "enum": ["1"]}},
            {"name": "X-Fleetward-Trace", "in": "header", "required": False,
             "description": "1: every chunk says which worker made it", "schema": {"type": "string", "enum": ["1"]}},
        ],
        "responses": {
            "200": {"description": "the completion, or its server-sent events with `stream`",
                    "headers": {"X-Request-Id": {"schema": {"type": "string"}}},
                    "links": {"Resume": {"operationId": operation, "requestBody": "$request.body",
                                         "parameters": {"header.Last-Event-ID": "{$response.header.X-Request-Id}:0"}}}},
            "400": {"description": "a malformed request, the parameter named"},
            "404": {"description": "an unknown model, or a resume of an unknown request"},
            "409": {"description": "a resume of a request that cannot be continued exactly (it is left alone)"},
            "503": {"description": "no worker can take it now, or the router is starting or stopping"},
        },
    }
