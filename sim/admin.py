"""The simulated worker's admin endpoints: its fault switches and live state, behind the admin token.

Behind ``Authorization: Bearer <token>`` (401 without a token, 403 with a wrong one):

- ``GET /admin/faults`` → ``{"hang": false, "slowdown": 1.0, "error_rate": 0.0,
  "wrong_tokens": {"probability": 0.0}, "wrong_tokens_after": null, "crash_after_tokens": null,
  "reset_after_tokens": null, "kv": {...}}`` (``crash_after_tokens`` reads the tokens still to come before
  the crash; ``kv`` the KV fault rules of :mod:`.kvfaults`);
- ``POST /admin/faults`` with any of ``{"clear": true}`` (applied first), ``{"hang": bool}``,
  ``{"slowdown": factor > 0}``, ``{"error_rate": 0..1}``, ``{"wrong_tokens": {"probability": 0..1}}``,
  ``{"wrong_tokens_after": k | null}``, ``{"crash_after_tokens": k | null}``,
  ``{"reset_after_tokens": k | null}`` (k >= 0; see *Connection faults*), ``{"kv": {"add": rule}}``,
  ``{"kv": {"remove": id}}``, ``{"kv": {"clear": true}}``, ``{"fail_inflight": true}`` (every open request
  gets vLLM's EngineCore error: in band plus ``[DONE]`` on streams, a 500 otherwise),
  ``{"reset_inflight": true}`` (applied after ``fail_inflight``), ``{"crash": true}`` (answers 202, then
  the process ends at once with ``os._exit(137)``, as if killed; other keys are ignored). Answers the
  switches as ``GET`` does, plus ``"failed_inflight": n`` / ``"reset_inflight": n`` (requests failed /
  cut) when those were given;
- ``GET /admin/state`` → live ``running``, ``waiting``, ``kv_usage``, ``kv_blocks_used``,
  ``kv_blocks_total``, ``steps``, ``hung``, ``stalled`` (the loop noticed the hang and is parked),
  ``preemptions``, ``generation_tokens``, ``faults``, ``model``, ``kv`` (the KV transfer counts).

Connection faults
-----------------
``crash_after_tokens: k`` (also preset at start with ``--faults-json``, counted from start): the engine
emits exactly k more tokens, counted from when the switch is set, across all requests, then no more
(requests keep arriving and queue). The process then ends through the same path as ``{"crash": true}``
(``os._exit(137)``) as soon as every token the engine has emitted, before or after the switch, has
been handed to the HTTP server: each stream's chunk carrying it was given to uvicorn's ``send``, which
returned; finished non-stream responses were sent the same way; and the answer to the ``POST`` that
set the switch too. uvicorn writes to the socket at once, so those bytes are in the kernel's send
buffer, and the kernel delivers them (then a FIN) after the process is gone; the one exception is a
client that stopped reading until the buffer filled, whose unsent bytes are lost as with a real kill
(and whose pending ``send`` delays the crash until it reads again). So with streams only, clients see
exactly k more tokens in total, then the connections break (an incomplete chunked body, or a refused
connection for requests arriving later). A non-stream request still generating when the budget runs
out gets no response; its tokens count towards k. ``clear`` or ``null`` disarms; a new k restarts the
count.

``reset_inflight: true``: every request the engine has not finished (running or queued) is aborted
(slot and KV blocks freed at once, unless the engine is hung: then once it runs again) and its
connection is dropped: a stream ends mid-body without ``[DONE]`` and without an error event, even if
tokens were waiting for it; a non-stream request gets the head of a 200 response and then the
connection closes (ASGI cannot drop a connection before a response starts; the server would answer
500), so the client sees a body that ends before it began (httpx: ``RemoteProtocolError``). Both count
as ``finished_reason="abort"``. New requests are served as usual.

``reset_after_tokens: k``: a request that reaches k output tokens without having finished is cut the
same way once the chunk carrying its k-th token has been sent: a stream delivers exactly k tokens, then
its connection drops. Requests that finish at k tokens or fewer end normally; requests already past k
when the switch is set are cut at their next step without a further token. Non-stream requests are cut
too (the head of a 200, then the drop). The switch stays until cleared.

The drop is a clean close (FIN) by the server, not a TCP RST; uvicorn logs each one as "ASGI callable
returned without completing response." (:mod:`.responses`).
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
from collections.abc import Callable
from typing import Any

from pydantic import SecretStr
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response

from fleetward.sim.engine import Faults, SimEngine
from fleetward.sim.kvfaults import KvFaultHook, KvRule
from fleetward.sim.kvtransfer import KvTransfer
from fleetward.sim.protocol import ApiError
from fleetward.sim.responses import Released, json_response

__all__ = ["Admin", "parse_faults"]

log = logging.getLogger("fleetward.simworker")


class Admin:
    """``/admin/faults`` and ``/admin/state`` (module docstring) over one worker's engine and KV transfer.

    ``crash`` is what ``{"crash": true}`` calls once the answer is sent.
    """

    def __init__(self, token: SecretStr | str, engine: SimEngine, kv: KvTransfer, model_name: str,
                 crash: Callable[[], None]) -> None:
        self._token = (token.get_secret_value() if isinstance(token, SecretStr) else token).encode()
        self._engine = engine
        self._kv = kv
        self._model_name = model_name
        self._crash = crash

    def _refuse(self, request: Request) -> Response | None:
        header = request.headers.get("authorization")
        if not header:
            return Response('{"error":"missing bearer token"}', status_code=401,
                            media_type="application/json", headers={"WWW-Authenticate": "Bearer"})
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._token):
            return Response('{"error":"wrong token"}', status_code=403, media_type="application/json")
        return None

    async def get_faults(self, request: Request) -> Response:
        if (refused := self._refuse(request)) is not None:
            return refused
        return json_response({**self._engine.faults.to_json(), "kv": self._kv.hook.to_json()})

    async def state(self, request: Request) -> Response:
        if (refused := self._refuse(request)) is not None:
            return refused
        return json_response({**self._engine.state(), "model": self._model_name, "kv": self._kv.stats})

    async def post_faults(self, request: Request) -> Response:
        if (refused := self._refuse(request)) is not None:
            return refused
        try:
            body = json.loads(await request.body())
            new, crash, fail_inflight, reset_inflight = parse_faults(body, self._engine.faults)
            kv_change = _kv_change(body, self._kv.hook)
        except (ValueError, ApiError) as exc:
            msg = exc.message if isinstance(exc, ApiError) else f"not JSON: {exc}"
            return json_response({"error": msg}, 400)
        if crash:
            log.warning("crash requested through /admin/faults")
            return Response('{"crash":true}', status_code=202, media_type="application/json",
                            background=BackgroundTask(self._crash))
        release = self._engine.hold_crash()  # a spent crash_after_tokens waits for this answer to be sent
        try:
            faults = self._engine.update_faults(new)
            if body.get("clear") is True:
                self._kv.hook.clear()
            kv_change()
            out = {**faults.to_json(), "kv": self._kv.hook.to_json()}
            if fail_inflight:
                out["failed_inflight"] = self._engine.fail_inflight()
            if reset_inflight:
                out["reset_inflight"] = self._engine.reset_inflight()
            log.info("faults now %s", out)
        except BaseException:
            release()
            raise
        return Released(out, 200, release)


def parse_faults(body: object, current: Faults) -> tuple[Faults, bool, bool, bool]:
    """The engine switches ``body`` (``POST /admin/faults``'s) sets over ``current``, and whether it asks for
    ``crash``, ``fail_inflight`` and ``reset_inflight``. Raises :class:`ApiError` naming a bad switch."""
    if not isinstance(body, dict):
        raise ApiError("expected a JSON object")
    known = {"clear", "crash", "hang", "slowdown", "error_rate", "wrong_tokens", "wrong_tokens_after",
             "crash_after_tokens", "reset_after_tokens", "fail_inflight", "reset_inflight", "kv"}
    if unknown := sorted(set(body) - known):
        raise ApiError(f"unknown fault switch(es) {unknown}; known: {sorted(known)}")

    def flag(key: str) -> bool:
        v = body.get(key, False)
        if not isinstance(v, bool):
            raise ApiError(f"{key}: expected true or false, got {v!r}")
        return v

    def number(key: str, v: object, lo: float, hi: float, *, lo_open: bool = False) -> float:
        left = "(" if lo_open else "["
        wrong = ApiError(f"{key}: expected a number in {left}{lo}, {hi}], got {v!r}")
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise wrong
        if not (lo < v if lo_open else lo <= v) or v > hi:
            raise wrong
        return float(v)

    cur = Faults() if flag("clear") else Faults(**vars(current))
    if "hang" in body:
        cur.hang = flag("hang")
    if "slowdown" in body:
        cur.slowdown = number("slowdown", body["slowdown"], 0, 1e6, lo_open=True)
    if "error_rate" in body:
        cur.error_rate = number("error_rate", body["error_rate"], 0, 1)
    if "wrong_tokens" in body:
        wt = body["wrong_tokens"]
        if wt is None:
            cur.wrong_tokens_probability = 0.0
        elif isinstance(wt, dict) and set(wt) <= {"probability"}:
            cur.wrong_tokens_probability = number("wrong_tokens.probability",
                                                  wt.get("probability", 1.0), 0, 1)
        else:
            raise ApiError(f'wrong_tokens: expected {{"probability": p}} or null, got {wt!r}')

    def count(key: str) -> int | None:
        k = body[key]
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ApiError(f"{key}: expected a token count >= 0 or null, got {k!r}")
        return k

    if "wrong_tokens_after" in body:
        cur.wrong_tokens_after = count("wrong_tokens_after")
    if "crash_after_tokens" in body:
        cur.crash_after_tokens = count("crash_after_tokens")
    if "reset_after_tokens" in body:
        cur.reset_after_tokens = count("reset_after_tokens")
    return cur, flag("crash"), flag("fail_inflight"), flag("reset_inflight")


def _kv_change(body: dict[str, Any], hook: KvFaultHook) -> Callable[[], None]:
    """The ``kv`` switch (:mod:`fleetward.sim.kvfaults`), checked now and applied by the returned call."""
    if "kv" not in body:
        return lambda: None
    op = body["kv"]
    if not isinstance(op, dict) or len(op) != 1 or next(iter(op)) not in ("add", "remove", "clear"):
        raise ApiError(f'kv: expected {{"add": rule}}, {{"remove": id}} or {{"clear": true}}, got {op!r}')
    if "add" in op:
        try:
            rule = KvRule.parse(op["add"])
        except ValueError as exc:
            raise ApiError(str(exc)) from None
        return functools.partial(hook.add, rule)
    if "remove" in op:
        if not isinstance(op["remove"], str):
            raise ApiError(f"kv.remove: a rule id, got {op['remove']!r}")
        return functools.partial(hook.remove, op["remove"])
    if op["clear"] is not True:
        raise ApiError(f"kv.clear: expected true, got {op['clear']!r}")
    return hook.clear
