"""The supervisor controller's HTTP side: the control API and the live fleet page, over a
:class:`~fleetward.supervisor.controller.Controller` (which keeps the control loop and the fenced writes).

With the bearer token (operators, the autoscaler):

- ``GET /v1/workers``;
- ``POST /v1/workers/<id>/drain`` (``{"deadline_s", "then": "stop"|"restart", "by"}``), ``.../undrain``,
  ``.../restart``;
- ``POST /v1/workers/<id>/quarantine/clear``;
- ``POST /v1/moves`` (``{"request"}`` or ``{"from"}``, and ``"to"`` if wanted): a planned move of a stream, or
  of every stream on a worker, with its KV (the routers carry it out: :mod:`fleetward.migration.moves`);
- ``POST /v1/workers`` (``{"id", "node", "role", "reason"}``): start a new worker on a node (its agent
  carries it out; the autoscaler's scale-up). Idempotent per id: asking again is answered, not repeated.

Without it, read-only: ``GET /health``, ``GET /metrics``, the live fleet page ``GET /`` with its feed
``GET /v1/fleet`` (:class:`FleetFeed`) and the runbooks ``GET /runbooks/<name>.md`` (see
:mod:`fleetward.supervisor.fleetpage`).

A command is applied by the leader, or refused with why: 401 without the token, 400 for a malformed body,
404 for an unknown worker, 409 from a standby (with the leader's address) or when the worker's state
refuses it. Never "accepted" and then nothing.
"""

from __future__ import annotations

import hmac
import json
import math
import re
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from fleetward.fleet.config import ID_PATTERN
from fleetward.fleet.errors import StoreError
from fleetward.fleet.worker import ROLES, HealthState
from fleetward.supervisor.fleetpage import page_html, parse_alerts, runbook_html
from fleetward.supervisor.health import Command, DrainRequested, QuarantineCleared, RestartRequested, Undrain

if TYPE_CHECKING:
    from fleetward.supervisor.controller import Controller

__all__ = ["FleetFeed", "build_app"]

_WORKER_ID = re.compile(ID_PATTERN)
_HTTP_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)


class FleetFeed:
    """What the fleet page polls (``GET /v1/fleet``): the controller's view, and Prometheus' alerts."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self._alerts: tuple[float, list[dict[str, Any]] | None, str | None] = (-1e9, None, None)

    async def view(self) -> dict[str, Any]:
        """What the fleet page shows (read-only: worker ids, states and reasons, as ``/metrics`` and events do)."""
        c = self.controller
        machine = c.machine if c.leading.is_set() else None
        workers = []
        for wid, ws in sorted((machine.workers if machine is not None else {}).items()):
            rec = c.workers.get(wid)
            workers.append({"id": wid, "node": ws.node or (rec.node if rec else ""), "role": rec.role if rec else "",
                            "url": rec.url if rec else "", "state": ws.state.value, "detector": ws.detector,
                            "reason": ws.reason, "since": ws.since, "in_flight": c.progress.in_flight(wid),
                            "restarts": ws.restart_count})
        alerts, error = await self._alerts_now()
        return {"cluster": c.keys.cluster, "now": c.clock.wall(),
                "controller": {"id": c.id, "leading": c.leading.is_set(),
                               "leader": None if c.leading.is_set() else await self._leader_or_none()},
                "prometheus": c.config.prometheus_url, "alerts": alerts, "alerts_error": error,
                "workers": workers, "events": c.timeline.recent(),
                "faults_active": c.timeline.faults_by_family()}

    async def _leader_or_none(self) -> dict[str, Any] | None:
        try:
            return await self.controller.leader()
        except StoreError:
            return None

    async def _alerts_now(self) -> tuple[list[dict[str, Any]] | None, str | None]:
        """Prometheus' pending and firing alerts (asked at most once a second, however many pages poll)."""
        c = self.controller
        url = c.config.prometheus_url.rstrip("/")
        if not url:
            return None, None
        at, alerts, error = self._alerts
        if c.clock.monotonic() - at < 1.0:
            return alerts, error
        try:
            status, body = await c.fetch("GET", f"{url}/api/v1/alerts", timeout=2.0)
            if status != 200:
                raise ValueError(f"HTTP {status}")
            alerts, error = parse_alerts(orjson.loads(body)), None
        except (*_HTTP_ERRORS, ValueError, TypeError, AttributeError) as exc:
            alerts, error = None, f"Prometheus at {url} did not answer: {type(exc).__name__}: {exc}"
        self._alerts = (c.clock.monotonic(), alerts, error)
        return alerts, error


def build_app(controller: Controller) -> FastAPI:
    """The control API and the fleet page of ``controller`` (see the module docstring)."""
    feed = FleetFeed(controller)
    # The OpenAPI spec (/openapi.json) describes the bodies the handlers parse themselves, and the token.
    app = FastAPI(title="fleetward supervisor", docs_url=None, redoc_url=None, openapi_url="/openapi.json")

    def authorised(request: Request) -> bool:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return bool(controller.admin_token) and scheme.lower() == "bearer" and \
            hmac.compare_digest(given.strip().encode(), controller.admin_token.encode())

    async def command(request: Request, event: Command) -> Response:
        """An operator's command: applied, or refused with why (never "accepted" and then nothing)."""
        if not authorised(request):
            return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401)
        machine = controller.machine
        if not controller.leading.is_set() or machine is None:
            return JSONResponse({"error": "not the leader", "leader": await controller.leader()}, status_code=409)
        ws = machine.workers.get(event.worker)
        if ws is None:
            known = sorted(machine.workers)
            return JSONResponse({"error": f"no worker {event.worker!r} in this cluster (workers: "
                                          f"{', '.join(known) or 'none'})", "workers": known}, status_code=404)
        why = machine.admit(event)
        if why is not None:
            return JSONResponse({"error": f"{event.worker}: {why}", "state": ws.state.value}, status_code=409)
        if isinstance(event, DrainRequested | RestartRequested):
            # What runs on it now, as the routers say: a drain ends at once only when nothing does.
            answered = await controller.read_progress()
            in_flight = controller.progress.in_flight_now(event.worker)
            controller.submit(controller.load_of(event.worker, in_flight, answered))
        controller.submit(event)
        return JSONResponse({"accepted": True, "leader": controller.id, "state": ws.state.value,
                             "what": _what(event, ws.state)})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(controller.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def page() -> Response:
        return HTMLResponse(page_html(), headers={"cache-control": "no-cache"})

    @app.get("/v1/fleet")
    async def fleet() -> Response:
        return JSONResponse(await feed.view(), headers={"cache-control": "no-store"})

    @app.get("/runbooks/{name}.md", response_class=HTMLResponse)
    async def runbook(name: str) -> Response:
        body = runbook_html(name)
        if body is None:
            return JSONResponse({"error": f"no runbook {name!r}"}, status_code=404)
        return HTMLResponse(body)

    @app.get("/v1/workers", openapi_extra=_ADMIN)
    async def workers(request: Request) -> Response:
        if not authorised(request):
            return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401)
        machine = controller.machine if controller.leading.is_set() else None
        out = {wid: ws.record().to_json().decode() for wid, ws in (machine.workers.items() if machine else [])}
        return JSONResponse({"leader": controller.leading.is_set(), "id": controller.id,
                             "workers": {k: json.loads(v) for k, v in out.items()}})

    @app.post("/v1/workers", operation_id="start_worker", openapi_extra=_openapi_start())
    async def start(request: Request) -> Response:
        if not authorised(request):
            return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401)
        try:
            body = await request.json()
            wid, node = str(body["id"]), str(body["node"])
            role, reason = str(body.get("role", "aggregated")), str(body.get("reason", "asked for"))
            if not _WORKER_ID.fullmatch(wid) or not _WORKER_ID.fullmatch(node):
                raise ValueError("id and node must be 1-63 of [A-Za-z0-9_.-], starting with a letter or digit")
            if role not in ROLES:
                raise ValueError(f"role must be one of {', '.join(ROLES)}")
        except (ValueError, TypeError, KeyError, json.JSONDecodeError) as exc:
            return JSONResponse({"error": f"bad start request: {exc!s} (needs id and node)"}, status_code=400)
        machine = controller.machine
        if not controller.leading.is_set() or machine is None:
            return JSONResponse({"error": "not the leader", "leader": await controller.leader()}, status_code=409)
        ws = machine.workers.get(wid)
        if ws is not None or wid in controller.workers:
            state = ws.state.value if ws is not None else "registered"
            return JSONResponse({"error": f"{wid}: a worker with this id exists ({state}); `undrain` or "
                                          "`restart` brings a stopped one back", "state": state}, status_code=409)
        created = await controller.issue_start(wid, node, role=role, reason=reason)
        return JSONResponse({"accepted": True, "leader": controller.id, "worker": wid, "node": node, "new": created,
                             "what": f"starting {wid} on {node}" if created else f"{wid} was asked for already"})

    @app.post("/v1/workers/{worker}/drain", operation_id="drain", openapi_extra=_openapi_drain())
    async def drain(worker: str, request: Request) -> Response:
        if not authorised(request):  # before the body: a caller without the token learns nothing of it
            return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401)
        try:
            body = await request.json() if await request.body() else {}
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            then = body.get("then", "cordon")
            deadline = float(body.get("deadline_s", controller.config.drain_timeout_s))
            if not math.isfinite(deadline) or deadline < 0:
                raise ValueError(f"deadline_s must be a finite number of seconds, 0 or more, not {deadline}")
            if then not in ("cordon", "stop", "restart"):
                raise ValueError("then must be cordon, stop or restart")
            by = body.get("by", "operator")
            if by not in ("operator", "autoscaler"):
                raise ValueError("by must be operator or autoscaler")
        except (ValueError, TypeError) as exc:
            return JSONResponse({"error": f"bad drain request: {exc}"}, status_code=400)
        return await command(request, DrainRequested(worker, deadline, then, by))

    @app.post("/v1/moves", operation_id="move", openapi_extra=_openapi_move())
    async def move(request: Request) -> Response:
        if not authorised(request):
            return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401)
        try:
            body = await request.json() if await request.body() else {}
            if not isinstance(body, dict) or set(body) - {"request", "from", "to"}:
                raise ValueError("the body is a JSON object with request or from, and to if wanted")
            rid, source, to = body.get("request"), body.get("from"), body.get("to")
            if (rid is None) == (source is None):
                raise ValueError("name either a request (its id) or the worker to move streams from")
            if not all(v is None or (isinstance(v, str) and v) for v in (rid, source, to)):
                raise ValueError("request, from and to are non-empty strings")
        except ValueError as exc:  # JSONDecodeError is a ValueError
            return JSONResponse({"error": f"bad move request: {exc}"}, status_code=400)
        machine = controller.machine
        if not controller.leading.is_set() or machine is None:
            return JSONResponse({"error": "not the leader", "leader": await controller.leader()}, status_code=409)
        for wid in (source, to):
            if wid is not None and wid not in machine.workers:
                known = sorted(machine.workers)
                return JSONResponse({"error": f"no worker {wid!r} in this cluster (workers: "
                                              f"{', '.join(known) or 'none'})", "workers": known}, status_code=404)
        order = await controller.order_move("operator", request=rid, source=source, to=to)
        what = f"moving request {rid}" if rid else f"moving every stream off {source}"
        return JSONResponse({"accepted": True, "leader": controller.id, "order": order,
                             "what": what + (f" to {to}" if to else "") + ", with its KV; routers that hold "
                             "none of them do nothing"})

    @app.post("/v1/workers/{worker}/undrain", operation_id="undrain", openapi_extra=_ADMIN)
    async def undrain(worker: str, request: Request) -> Response:
        return await command(request, Undrain(worker))

    @app.post("/v1/workers/{worker}/restart", operation_id="restart", openapi_extra=_ADMIN)
    async def restart(worker: str, request: Request) -> Response:
        return await command(request, RestartRequested(worker))

    @app.post("/v1/workers/{worker}/quarantine/clear", operation_id="clear_quarantine", openapi_extra=_ADMIN)
    async def clear(worker: str, request: Request) -> Response:
        return await command(request, QuarantineCleared(worker))

    spec = app.openapi()
    spec.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return app




# The control API's commands, for the OpenAPI spec: the bearer token, and the answers every command can give.
_ADMIN: dict[str, Any] = {
    "security": [{"bearer": []}],
    "responses": {"401": {"description": "missing or wrong bearer token"},
                  "404": {"description": "no such worker"},
                  "409": {"description": "not the leader (its address given), or the worker's state refuses it"}},
}


def _with_body(schema: dict[str, Any], *, required: bool,
               links: dict[str, Any] | None = None) -> dict[str, Any]:
    """A command that takes a JSON body (a malformed one is a 400 saying what is wrong)."""
    responses: dict[str, Any] = {**_ADMIN["responses"], "400": {"description": "a malformed body, what is wrong said"}}
    if links:
        responses["200"] = {"description": "accepted", "links": links}
    return {"security": _ADMIN["security"], "responses": responses,
            "requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}}


def _openapi_drain() -> dict[str, Any]:
    return _with_body({"type": "object", "additionalProperties": False, "properties": {
        "deadline_s": {"type": "number", "minimum": 0, "description": "open streams move elsewhere after it"},
        "then": {"type": "string", "enum": ["cordon", "stop", "restart"]},
        "by": {"type": "string", "enum": ["operator", "autoscaler"],
               "description": "who drains: an autoscaler's drain is a scale-down"}}}, required=False)


def _openapi_move() -> dict[str, Any]:
    name = {"type": "string", "minLength": 1}
    return _with_body({"type": "object", "additionalProperties": False, "properties": {
        "request": {**name, "description": "the request to move (the response's id)"},
        "from": {**name, "description": "move every stream on this worker"},
        "to": {**name, "description": "where to (default: wherever the router would place it)"}}}, required=True)


def _openapi_start() -> dict[str, Any]:
    """Starting a worker, linked to the commands on the worker it started."""
    name = {"type": "string", "pattern": ID_PATTERN}
    body = {"type": "object", "required": ["id", "node"], "additionalProperties": False, "properties": {
        "id": name, "node": name, "role": {"type": "string", "enum": list(ROLES)}, "reason": {"type": "string"}}}
    links = {op.title(): {"operationId": op, "parameters": {"path.worker": "$request.body#/id"}}
             for op in ("drain", "undrain", "restart")}
    return _with_body(body, required=True, links=links)


def _what(command: Command, state: HealthState) -> str:
    """What an accepted command does to a worker in ``state``, in words (the CLI prints it)."""
    match command:
        case DrainRequested(deadline_s=deadline, then=then):
            after = {"cordon": "it then stays out of routing (cordoned) until `fleetward undrain`",
                     "stop": "it is then stopped", "restart": "it is then restarted"}[then]
            return (f"draining: no new work goes to it; its open streams finish, or move to other workers with "
                    f"their KV after {deadline:g} s; {after}")
        case RestartRequested():
            if state is HealthState.DEAD:
                return "starting it again"
            return "restarting it gracefully: its open streams move to other workers, then it restarts"
        case Undrain():
            if state is HealthState.DEAD:
                return "it was stopped: starting it again"
            return "taking it back into routing once a canary passes"
        case QuarantineCleared():
            return "the GPU self-test runs first; when it passes the worker is restarted"
    return "accepted"
