"""The router's HTTP surface: the routes of vLLM's server, API keys, the OpenAPI spec.

- ``POST /v1/completions``, ``POST /v1/chat/completions``: journaled, resumable generations
  (:class:`~fleetward.migration.serving.Serving`);
- every other vLLM endpoint, passed through (:mod:`~fleetward.migration.passthrough`'s ``ROUTES``);
- ``GET /v1/models``: every worker's model card merged (one worker asked per model), with the router's
  ``fleetward`` status of each model (where its text comes from);
- ``GET /health``, ``GET /metrics``, ``GET /fleetward/v1/progress`` (the per-worker token progress the
  supervisor's stream-progress detector reads);
- with ``routing.checkpoint_store: peers``, the copies other routers keep here (``/fleetward/v1/replicas``,
  :mod:`~fleetward.migration.replicas`; the admin token as a bearer token; not in the spec).

A body over ``routing.max_request_bytes`` is answered 413 (:mod:`.guard`). Every error, an unknown route (404)
or method (405) included, has the OpenAI shape
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

from fleetward.migration.adapters import ADAPTER_ROUTES
from fleetward.migration.apikeys import ApiKey
from fleetward.migration.downstream import StreamResponse
from fleetward.migration.guard import BodyLimit
from fleetward.migration.journal import Kind
from fleetward.migration.openapi import keyed_spec, openapi_adapters, openapi_passthrough, openapi_post, operation_id
from fleetward.migration.passthrough import ROUTES, Route
from fleetward.migration.replicas import NotClaimable, authorized
from fleetward.migration.router import Router
from fleetward.migration.serving import Serving
from fleetward.migration.wire import RouterError

__all__ = ["router_app"]

_MODELS_TIMEOUT_S = 2.0


def router_app(router: Router) -> FastAPI:
    """The router's app; its spec (``/openapi.json``) is :mod:`.openapi`'s."""
    serving = Serving(router)
    app = FastAPI(title="fleetward router", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.add_middleware(BodyLimit, limit=router.config.max_request_bytes, refused=router.metrics.too_large.inc)

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
        if serving.api_keys is not None:
            key = api_key(serving, request)
            if isinstance(key, RouterError):
                return key.response()
        return JSONResponse({"object": "list", "data": await merged_models(router)})

    @app.get("/fleetward/v1/progress")
    async def progress() -> JSONResponse:
        return JSONResponse({"router": router.id, "ts": router.clock.wall(), **router.progress.view()})

    @app.post("/v1/completions", operation_id="completions", openapi_extra=openapi_post(Kind.COMPLETION))
    async def completions(request: Request) -> Response:
        return await keyed(serving, request, lambda owner: serving.handle(request, Kind.COMPLETION, owner=owner))

    @app.post("/v1/chat/completions", operation_id="chat_completions", openapi_extra=openapi_post(Kind.CHAT))
    async def chat(request: Request) -> Response:
        return await keyed(serving, request, lambda owner: serving.handle(request, Kind.CHAT, owner=owner))

    if router.replicas is not None:
        _replica_routes(app, router)

    for route in ROUTES:
        app.add_api_route(route.path, _passthrough(serving, route), methods=[route.method],
                          operation_id=operation_id(route), openapi_extra=openapi_passthrough(route))

    for path in ADAPTER_ROUTES:  # LoRA adapters loaded or unloaded on every routable worker (.adapters)
        app.add_api_route(path, _adapters(serving), methods=["POST"], operation_id=path.strip("/").replace("/", "_"),
                          openapi_extra=openapi_adapters(path))

    if serving.api_keys is not None:  # the spec says which operations take a key, and what a key adds
        keyed_spec(app.openapi())
    return app


def _adapters(serving: Serving) -> Callable[[Request], Awaitable[Response]]:
    async def change(request: Request) -> Response:
        return await keyed(serving, request, lambda _owner: serving.router.adapters.change(request))

    return change


def _replica_routes(app: FastAPI, router: Router) -> None:
    replicas = router.replicas
    assert replicas is not None
    refused = JSONResponse({"error": {"message": "a router's copies need the admin token", "type": "Unauthorized",
                                      "param": None, "code": 401}}, status_code=401)

    @app.post("/fleetward/v1/replicas", include_in_schema=False)
    async def write(request: Request) -> Response:
        if not authorized(request.headers.get("authorization", ""), router.admin_token):
            return refused
        return JSONResponse(replicas.apply(await request.body()))

    @app.get("/fleetward/v1/replicas/{rid}", include_in_schema=False)
    async def tokens(rid: str, request: Request) -> Response:
        if not authorized(request.headers.get("authorization", ""), router.admin_token):
            return refused
        n = replicas.tokens(rid)
        return JSONResponse({"tokens": n}) if n is not None else JSONResponse({"tokens": None}, status_code=404)

    @app.post("/fleetward/v1/replicas/{rid}/claim", include_in_schema=False)
    async def claim(rid: str, request: Request) -> Response:
        if not authorized(request.headers.get("authorization", ""), router.admin_token):
            return refused
        body = orjson.loads(await request.body())
        try:
            j = replicas.claim(rid, by=str(body["by"]), key=body.get("key"))
        except NotClaimable as exc:
            return JSONResponse({"why": exc.why}, status_code=409)
        if j is None:
            return JSONResponse({"journal": None}, status_code=404)
        return Response(orjson.dumps(j.checkpoint(str(body["by"]))), media_type="application/json")


def _passthrough(serving: Serving, route: Route) -> Callable[[Request], Awaitable[Response]]:
    async def relay(request: Request) -> Response:
        return await keyed(serving, request, lambda _owner: serving.relay(route, request))

    relay.__name__ = operation_id(route)
    return relay


async def merged_models(router: Router) -> list[dict[str, Any]]:
    """Each model's card as its workers give it (one routable worker asked per model, at once), vLLM's fields
    (``root``, ``max_model_len``, ``permission``) included; a model whose worker did not answer gets a card of
    the router's own. Either way with ``"fleetward": {"detokenizer", ...}``: where the router's text for the
    model comes from."""
    session = router.upstream.session
    now = int(router.clock.wall())

    async def card(model: str) -> dict[str, Any]:
        picked = router.placement.pick(model, [])
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

    cards = await asyncio.gather(*(card(m) for m in router.placement.models()))
    # each LoRA adapter as a worker that serves it lists it, after the base models
    return [*cards, *({**c, "fleetward": router.text_status(str(c["parent"]))} for c in router.adapters.cards())]


def api_key(serving: Serving, request: Request) -> ApiKey | RouterError:
    """The API key the request carries, or the 401 that refuses it."""
    assert serving.api_keys is not None
    key = serving.api_keys.check(request.headers.get("authorization"))
    if isinstance(key, ApiKey):
        return key
    serving.metrics.auth_failures.labels(key).inc()
    message = ("missing API key: send it as Authorization: Bearer <key>" if key == "missing"
               else "incorrect API key provided")
    return RouterError(401, message, headers={"WWW-Authenticate": "Bearer"})


async def keyed(serving: Serving, request: Request,
                handle: Callable[[str | None], Awaitable[Response]]) -> Response:
    """``handle(owner)`` under the request's API key, when the router takes keys (``owner`` is its name, else
    None): 401 without a known key, 429 when the key has ``max_concurrency`` requests in flight; its slot is
    held until the answer (or the stream) ends, or the client goes away."""
    if serving.api_keys is None:
        return await handle(None)
    key = api_key(serving, request)
    if isinstance(key, RouterError):
        return key.response()
    if not key.acquire():
        serving.metrics.key_requests.labels(key.name, "over_limit").inc()
        return RouterError(429, f"API key {key.name!r} has {key.limit} requests in flight, its limit; retry "
                           "when one ends", retry_after=1).response()
    serving.metrics.key_requests.labels(key.name, "accepted").inc()
    try:
        response = await handle(key.name)
    except BaseException:
        key.release()
        raise
    if not isinstance(response, StreamingResponse | StreamResponse):
        key.release()
        return response
    released = False
    before = response.background

    def release() -> None:  # once: when the stream ends, or after the response if it never started
        nonlocal released
        if not released:
            released = True
            key.release()

    async def after() -> None:
        release()
        if before is not None:
            await before()

    response.background = BackgroundTask(after)
    if isinstance(response, StreamResponse):  # it runs its background once the stream ended
        return response
    inner = response.body_iterator

    async def held() -> AsyncIterator[Any]:
        try:
            async for chunk in inner:
                yield chunk
        finally:
            release()

    response.body_iterator = held()
    return response
