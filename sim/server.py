"""The simulated worker: vLLM 0.32's OpenAI-compatible HTTP API over :class:`~.simengine.SimEngine`.

Run it as its own process::

    python -m fleetward.sim.server --host H --port P [--config-json '{...SimConfig...}'] [--model-name M]

or build the ASGI app in-process with :func:`create_app`. The admin token comes from
``FLEETWARD_ADMIN_TOKEN`` (a random one when unset; never logged).

Endpoints
---------
- ``POST /v1/completions``, ``POST /v1/chat/completions``: stream and non-stream, byte for byte in vLLM's
  shapes (key order included; see ``tests/data/vllm-0.32``). ``prompt`` is text, a list of token ids, or
  a one-element list of either. Honoured: ``max_tokens`` (chat: ``max_completion_tokens`` too; clamped to
  the context left, as vLLM does), ``ignore_eos``, ``stop`` (str or list), ``stop_token_ids``,
  ``include_stop_str_in_output``, ``return_token_ids``, ``stream_options.include_usage`` and
  ``continuous_usage_stats``, ``min_tokens``, ``add_generation_prompt`` (chat), the ``X-Request-Id``
  header. Accepted and ignored, because the simulated model is greedy and deterministic: ``temperature``,
  ``top_p``, ``top_k``, ``min_p``, ``seed``, the penalties, ``logit_bias``, ``bad_words``,
  ``allowed_token_ids``, ``priority``, ``user`` (and any other key vLLM would accept). Refused with a 400
  naming the parameter: ``n`` other than 1 (every choice would be identical), several prompts in one
  request, ``echo``, ``logprobs``/``prompt_logprobs``/``top_logprobs``, beam search.
- ``GET /health`` (200, empty body, also while hung), ``GET /metrics`` (vLLM's metric names and labels),
  ``GET /v1/models`` (with ``max_model_len``).
- Admin, behind ``Authorization: Bearer <token>`` (401 without a token, 403 with a wrong one):

  - ``GET /admin/faults`` → ``{"hang": false, "slowdown": 1.0, "error_rate": 0.0,
    "wrong_tokens": {"probability": 0.0}, "wrong_tokens_after": null, "crash_after_tokens": null,
    "reset_after_tokens": null}`` (``crash_after_tokens`` reads the tokens still to come before the crash);
  - ``POST /admin/faults`` with any of ``{"clear": true}`` (applied first), ``{"hang": bool}``,
    ``{"slowdown": factor > 0}``, ``{"error_rate": 0..1}``, ``{"wrong_tokens": {"probability": 0..1}}``,
    ``{"wrong_tokens_after": k | null}``, ``{"crash_after_tokens": k | null}``,
    ``{"reset_after_tokens": k | null}`` (k >= 0; see *Connection faults*), ``{"fail_inflight": true}``
    (every open request gets vLLM's EngineCore error: in band plus ``[DONE]`` on streams, a 500
    otherwise), ``{"reset_inflight": true}`` (applied after ``fail_inflight``), ``{"crash": true}``
    (answers 202, then the process ends at once with ``os._exit(137)``, as if killed; other keys are
    ignored). Answers the switches as ``GET`` does, plus ``"failed_inflight": n`` / ``"reset_inflight": n``
    (requests failed / cut) when those were given;
  - ``GET /admin/state`` → live ``running``, ``waiting``, ``kv_usage``, ``kv_blocks_used``,
    ``kv_blocks_total``, ``steps``, ``hung``, ``stalled`` (the loop noticed the hang and is parked),
    ``preemptions``, ``generation_tokens``, ``faults``, ``model``.

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
returned without completing response."

Failures look like vLLM's: ``{"error": {"message", "type", "param", "code"}}``; while ``error_rate`` hits,
new requests get the 500 a dead EngineCore gives. A client that disconnects (stream or not) aborts its
request in the engine, freeing its batch slot and KV blocks.

One module (over 600 lines) because it is the whole OpenAI-compatible surface of a vLLM server, which
the tests compare field by field with the real one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import hmac
import json
import logging
import os
import secrets
import signal
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from pydantic import SecretStr, ValidationError
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.config import SimConfig, admin_token_from_env
from fleetward.fleet.errors import WorkerError
from fleetward.sim.engine import (
    ENGINE_DEAD_MESSAGE,
    EngineStats,
    Faults,
    Histogram,
    RequestCut,
    SamplingSpec,
    SimEngine,
    SimRequest,
)
from fleetward.sim.tokenizer import VOCAB_SIZE, encode, render_chat

__all__ = ["SimWorker", "create_app", "main"]

log = logging.getLogger("fleetward.simworker")

_enc = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_DONE = b"data: [DONE]\n\n"
_COMPLETION_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default
CRASH_EXIT_CODE = 137  # what a shell reports for a SIGKILLed process


def _crash_process() -> None:
    logging.getLogger("fleetward.simworker").warning("crash requested through /admin/faults: exiting now")
    for h in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            h.flush()
    os._exit(CRASH_EXIT_CODE)


class _ApiError(WorkerError):
    """A request the worker refuses; becomes vLLM's error body (never leaves this module)."""

    def __init__(self, message: str, *, status: int = 400, err_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message, status=status)
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.status}}


def _invalid(loc: str, msg: str, kind: str, value: object) -> _ApiError:
    """A schema error worded like vLLM's RequestValidationError handler (type "Bad Request")."""
    if isinstance(value, (list, tuple, dict)):
        value = f"<{type(value).__name__} of {len(value)} items>"
    detail = {"type": kind, "loc": f"body.{loc}" if loc else "body", "msg": msg, "input": value}
    return _ApiError(f"1 validation error:\n  {detail}", err_type="Bad Request",
                     param=f"body.{loc}" if loc else "body")


def _engine_dead() -> _ApiError:
    return _ApiError(ENGINE_DEAD_MESSAGE, status=500, err_type="InternalServerError")


def _json_response(body: dict[str, Any], status: int = 200) -> Response:
    return Response(_enc(body).encode(), status_code=status, media_type="application/json")


def _error_response(err: _ApiError) -> Response:
    return _json_response(err.body(), err.status)


def _stream_error(err: WorkerError) -> bytes:
    # vLLM writes this one with json.dumps' default separators.
    body = {"error": {"message": err.message, "type": "InternalServerError", "param": None, "code": 500}}
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()


def _ids_json(ids: Iterable[int]) -> str:
    return "[" + ",".join(map(str, ids)) + "]"


def _usage_json(prompt: int, completion: int) -> str:
    return (f'"usage":{{"prompt_tokens":{prompt},"total_tokens":{prompt + completion},'
            f'"completion_tokens":{completion}}}')


# -- request parsing ----------------------------------------------------------------------------------


def _opt_int(body: dict[str, Any], key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise _invalid(key, "Input should be a valid integer", "int_type", v)
    return v


def _opt_bool(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _invalid(key, "Input should be a valid boolean", "bool_type", v)
    return v


def _int_list(v: object) -> list[int] | None:
    if isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return v
    return None


@dataclass(slots=True)
class _Parsed:
    prompt_ids: list[int]
    spec: SamplingSpec
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    role: str = "assistant"


class _Metrics(Collector):
    """vLLM's engine metrics (names, labels, buckets) read from :class:`EngineStats` at scrape time."""

    def __init__(self, stats: EngineStats, model_name: str) -> None:
        self._stats = stats
        self._labels = ["model_name", "engine"]
        self._values = [model_name, "0"]

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        g = GaugeMetricFamily(name, doc, labels=self._labels)
        g.add_metric(self._values, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        c = CounterMetricFamily(name, doc, labels=self._labels)
        c.add_metric(self._values, value)
        return c

    def _histogram(self, name: str, doc: str, h: Histogram) -> Metric:
        m = HistogramMetricFamily(name, doc, labels=self._labels)
        m.add_metric(self._values, [(floatToGoString(b), c) for b, c in h.cumulative()], h.sum)
        return m

    def collect(self) -> Iterable[Metric]:
        s = self._stats
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                          s.running)
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                          s.waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                          s.kv_usage)
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                            s.preemptions)
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.",
                            s.generation_tokens)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*self._labels, "finished_reason"])
        for reason, n in s.finished.items():
            success.add_metric([*self._values, reason], n)
        yield success
        yield self._histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", s.ttft)
        yield self._histogram("vllm:inter_token_latency_seconds",
                              "Histogram of inter-token latency in seconds.", s.itl)
        yield self._histogram("vllm:e2e_request_latency_seconds",
                              "Histogram of e2e request latency in seconds.", s.e2e)
        yield self._histogram("vllm:request_queue_time_seconds",
                              "Histogram of time spent in WAITING phase for request.", s.queue)


class _EventStream(StreamingResponse):
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


class _Released(Response):
    """A JSON response that runs ``on_close`` once it is sent (or sending failed)."""

    def __init__(self, body: dict[str, Any], status: int, on_close: Callable[[], None]) -> None:
        super().__init__(_enc(body).encode(), status_code=status, media_type="application/json")
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _Cut(Response):
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


class SimWorker:
    """One simulated worker: its config, engine, metrics and the ASGI app (:attr:`app`) serving them.

    ``crash`` is what ``{"crash": true}`` calls after answering, and what a spent ``crash_after_tokens``
    budget calls (default: end the process at once); tests running the app in-process pass something
    harmless. ``faults`` are the switches the worker starts with (a worker can start already faulty).
    """

    def __init__(self, config: SimConfig, *, admin_token: SecretStr | str | None = None,
                 clock: Clock = SYSTEM_CLOCK, crash: Callable[[], None] = _crash_process,
                 faults: Faults | None = None) -> None:
        self.config = config
        self.model_name = config.model_name
        self.clock = clock
        self.engine = SimEngine(config, clock=clock, crash=self._crash_after_tokens, faults=faults)
        token = admin_token if admin_token is not None else admin_token_from_env()
        self._token = (token.get_secret_value() if isinstance(token, SecretStr) else token).encode()
        self._crash = crash
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Metrics(self.engine.stats, self.model_name))
        digest = hashlib.sha256(f"{self.model_name}:{config.seed}:{config.eos_probability}".encode())
        self.system_fingerprint = f"fleetward-sim-{digest.hexdigest()[:8]}"
        self._model_json = _enc(self.model_name)
        self._fingerprint_json = _enc(self.system_fingerprint)

        app = FastAPI(lifespan=self._lifespan, openapi_url=None, docs_url=None, redoc_url=None)
        app.state.worker = self
        app.state.engine = self.engine
        r = app.router
        r.add_route("/v1/completions", self._completions, methods=["POST"])
        r.add_route("/v1/chat/completions", self._chat_completions, methods=["POST"])
        r.add_route("/health", self._health, methods=["GET"])
        r.add_route("/metrics", self._metrics, methods=["GET"])
        r.add_route("/v1/models", self._models, methods=["GET"])
        r.add_route("/admin/faults", self._get_faults, methods=["GET"])
        r.add_route("/admin/faults", self._post_faults, methods=["POST"])
        r.add_route("/admin/state", self._state, methods=["GET"])
        self.app = app

    def _crash_after_tokens(self) -> None:
        log.warning("crash_after_tokens: the token budget is spent and handed to the HTTP server")
        self._crash()

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        async with asyncio.TaskGroup() as tg:
            engine = tg.create_task(self.engine.run(), name="sim-engine")
            try:
                yield
            finally:
                engine.cancel()

    # -- plain endpoints ----------------------------------------------------------------------------

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def _metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def _models(self, request: Request) -> Response:
        now = int(self.clock.wall())
        card = {"id": self.model_name, "object": "model", "created": now, "owned_by": "vllm",
                "root": self.model_name, "parent": None, "max_model_len": self.config.max_model_len,
                "permission": [{"id": f"modelperm-{secrets.token_hex(8)}", "object": "model_permission",
                                "created": now, "allow_create_engine": False, "allow_sampling": True,
                                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*", "group": None,
                                "is_blocking": False}]}
        return _json_response({"object": "list", "data": [card]})

    # -- admin --------------------------------------------------------------------------------------

    def _refuse(self, request: Request) -> Response | None:
        header = request.headers.get("authorization")
        if not header:
            return Response('{"error":"missing bearer token"}', status_code=401,
                            media_type="application/json", headers={"WWW-Authenticate": "Bearer"})
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._token):
            return Response('{"error":"wrong token"}', status_code=403, media_type="application/json")
        return None

    async def _get_faults(self, request: Request) -> Response:
        if (refused := self._refuse(request)) is not None:
            return refused
        return _json_response(self.engine.faults.to_json())

    async def _state(self, request: Request) -> Response:
        if (refused := self._refuse(request)) is not None:
            return refused
        return _json_response({**self.engine.state(), "model": self.model_name})

    async def _post_faults(self, request: Request) -> Response:
        if (refused := self._refuse(request)) is not None:
            return refused
        try:
            body = json.loads(await request.body())
            new, crash, fail_inflight, reset_inflight = self._parse_faults(body)
        except (ValueError, _ApiError) as exc:
            msg = exc.message if isinstance(exc, _ApiError) else f"not JSON: {exc}"
            return _json_response({"error": msg}, 400)
        if crash:
            log.warning("crash requested through /admin/faults")
            return Response('{"crash":true}', status_code=202, media_type="application/json",
                            background=BackgroundTask(self._crash))
        release = self.engine.hold_crash()  # a spent crash_after_tokens waits for this answer to be sent
        try:
            faults = self.engine.update_faults(new)
            out = faults.to_json()
            if fail_inflight:
                out["failed_inflight"] = self.engine.fail_inflight()
            if reset_inflight:
                out["reset_inflight"] = self.engine.reset_inflight()
            log.info("faults now %s", out)
        except BaseException:
            release()
            raise
        return _Released(out, 200, release)

    def _parse_faults(self, body: object) -> tuple[Faults, bool, bool, bool]:
        if not isinstance(body, dict):
            raise _ApiError("expected a JSON object")
        known = {"clear", "crash", "hang", "slowdown", "error_rate", "wrong_tokens", "wrong_tokens_after",
                 "crash_after_tokens", "reset_after_tokens", "fail_inflight", "reset_inflight"}
        if unknown := sorted(set(body) - known):
            raise _ApiError(f"unknown fault switch(es) {unknown}; known: {sorted(known)}")

        def flag(key: str) -> bool:
            v = body.get(key, False)
            if not isinstance(v, bool):
                raise _ApiError(f"{key}: expected true or false, got {v!r}")
            return v

        def number(key: str, v: object, lo: float, hi: float, *, lo_open: bool = False) -> float:
            left = "(" if lo_open else "["
            wrong = _ApiError(f"{key}: expected a number in {left}{lo}, {hi}], got {v!r}")
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise wrong
            if not (lo < v if lo_open else lo <= v) or v > hi:
                raise wrong
            return float(v)

        cur = Faults() if flag("clear") else Faults(**vars(self.engine.faults))
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
                raise _ApiError(f'wrong_tokens: expected {{"probability": p}} or null, got {wt!r}')
        def count(key: str) -> int | None:
            k = body[key]
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
                raise _ApiError(f"{key}: expected a token count >= 0 or null, got {k!r}")
            return k

        if "wrong_tokens_after" in body:
            cur.wrong_tokens_after = count("wrong_tokens_after")
        if "crash_after_tokens" in body:
            cur.crash_after_tokens = count("crash_after_tokens")
        if "reset_after_tokens" in body:
            cur.reset_after_tokens = count("reset_after_tokens")
        return cur, flag("crash"), flag("fail_inflight"), flag("reset_inflight")

    # -- completions --------------------------------------------------------------------------------

    async def _read_json(self, request: Request) -> object:
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            raise _ApiError("1 validation error:\n  Unsupported Media Type: Only 'application/json' is "
                            "allowed", err_type="Bad Request")
        raw = await request.body()
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            detail = {"type": "json_invalid", "loc": f"body.{exc.pos}", "msg": "JSON decode error",
                      "input": {}, "ctx": {"error": exc.msg}}
            raise _ApiError(f"1 validation error:\n  {detail}", err_type="Bad Request",
                            param=f"body.{exc.pos}") from None
        except UnicodeDecodeError as exc:
            raise _invalid("", "JSON decode error", "json_invalid", str(exc)) from None

    def _request_id(self, request: Request, body: dict[str, Any], prefix: str) -> str:
        rid = request.headers.get("x-request-id") or body.get("request_id")
        return f"{prefix}{rid if isinstance(rid, str) and rid else secrets.token_hex(8)}"

    def _parse(self, body: object, *, chat: bool) -> _Parsed:
        """Validate like vLLM, in vLLM's order: schema, model, max_tokens, prompt length, vocabulary."""
        if not isinstance(body, dict):
            raise _invalid("", "Input should be a valid dictionary", "dict_type", body)
        role = "assistant"
        if chat:
            messages = body.get("messages")
            if messages is None:
                raise _invalid("messages", "Field required", "missing", body)
            if not isinstance(messages, list) or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
                raise _invalid("messages", "Input should be a list of messages with a role", "list_type",
                               messages)
            add_generation_prompt = _opt_bool(body, "add_generation_prompt", True)
            if not add_generation_prompt and messages:
                role = messages[-1]["role"]
            prompt: object = None
            mt_param = "max_tokens"
            if body.get("max_completion_tokens") is not None:
                mt_param = "max_completion_tokens"
            max_tokens = _opt_int(body, mt_param)
        else:
            prompt = body.get("prompt")
            if prompt is None or prompt == "" or prompt == []:
                raise _ApiError("Either prompt or prompt_embeds must be provided and non-empty.",
                                err_type="Bad Request", param="prompt")
            if not isinstance(prompt, (str, list)):
                raise _invalid("prompt", "Input should be a valid string or list", "union_type", prompt)
            mt_param = "max_tokens"
            max_tokens = _opt_int(body, "max_tokens")
            if max_tokens is None:
                max_tokens = _COMPLETION_DEFAULT_MAX_TOKENS
        stream = _opt_bool(body, "stream", False)
        stream_options = body.get("stream_options")
        include_usage = continuous_usage = False
        if stream_options is not None:
            if not isinstance(stream_options, dict):
                raise _invalid("stream_options", "Input should be a valid dictionary", "dict_type",
                               stream_options)
            if stream_options and not stream:
                raise _ApiError("Stream options can only be defined when `stream=True`.",
                                err_type="Bad Request", param="stream_options")
            include_usage = bool(stream_options.get("include_usage"))
            continuous_usage = include_usage and bool(stream_options.get("continuous_usage_stats"))
        ignore_eos = _opt_bool(body, "ignore_eos", False)
        include_stop = _opt_bool(body, "include_stop_str_in_output", False)
        return_token_ids = _opt_bool(body, "return_token_ids", False)
        stop = body.get("stop")
        if stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stops = (stop,) if stop else ()
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            stops = tuple(s for s in stop if s)
        else:
            raise _invalid("stop", "Input should be a valid string or list of strings", "union_type", stop)
        stop_ids = body.get("stop_token_ids")
        if stop_ids is not None and _int_list(stop_ids) is None:
            raise _invalid("stop_token_ids", "Input should be a list of integers", "list_type", stop_ids)
        n = _opt_int(body, "n")
        if n is not None and n < 1:
            raise _ApiError(f"n must be at least 1, got {n}.", param="n")
        if n is not None and n > 1:
            raise _ApiError(f"n={n} is not supported by the simulated worker: its model is greedy and "
                            "deterministic, so every choice would be the same; send n=1", param="n")
        for key in ("echo", "use_beam_search"):
            if body.get(key):
                raise _ApiError(f"{key} is not supported by the simulated worker", param=key)
        for key in ("logprobs", "prompt_logprobs", "top_logprobs"):
            v = body.get(key)
            if v is not None and v is not False and not (key == "top_logprobs" and v == 0):
                raise _ApiError(f"{key} is not supported by the simulated worker", param=key)
        min_tokens = _opt_int(body, "min_tokens") or 0
        if min_tokens < 0:
            raise _ApiError(f"min_tokens must be greater than or equal to 0, got {min_tokens}.",
                            param="min_tokens")

        model = body.get("model")
        if model is not None and model != self.model_name:
            raise _ApiError(f"The model `{model}` does not exist. Valid aliases: {self.model_name}.",
                            status=404, err_type="NotFoundError", param="model")

        max_len = self.config.max_model_len
        if max_tokens is not None and max_tokens > max_len:
            raise _ApiError(f"{mt_param}={max_tokens} cannot be greater than max_model_len={max_len}. "
                            "Please request fewer output tokens.", param=mt_param)

        if chat:
            prompt_ids = encode(render_chat(body["messages"], add_generation_prompt=add_generation_prompt))
        else:
            prompt_ids = self._prompt_ids(prompt)
        if len(prompt_ids) > max_len:
            raise _ApiError(f"This model's maximum context length is {max_len} tokens. However, your prompt "
                            f"contains {len(prompt_ids)} input tokens, which exceeds this limit even without "
                            "any output tokens. Please reduce the length of the input prompt.",
                            param="input_tokens")
        budget = max_len - len(prompt_ids)
        max_tokens = budget if max_tokens is None else min(max_tokens, budget)
        if max_tokens < 1:
            raise _ApiError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
        if min_tokens > max_tokens:
            raise _ApiError(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got "
                            f"{min_tokens}.", param="min_tokens")
        if prompt_ids and (min(prompt_ids) < 0 or max(prompt_ids) >= VOCAB_SIZE):
            bad = min(prompt_ids) if min(prompt_ids) < 0 else max(prompt_ids)
            raise _ApiError(f"Token id {bad} is out of vocabulary")

        spec = SamplingSpec(max_tokens=max_tokens, ignore_eos=ignore_eos, stop=stops,
                            stop_token_ids=frozenset(stop_ids or ()), include_stop_str_in_output=include_stop,
                            min_tokens=min_tokens)
        return _Parsed(prompt_ids, spec, stream, include_usage, continuous_usage, return_token_ids, role)

    @staticmethod
    def _prompt_ids(prompt: object) -> list[int]:
        if isinstance(prompt, str):
            return encode(prompt)
        assert isinstance(prompt, list)
        if (ids := _int_list(prompt)) is not None:
            return list(ids)
        if len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise _ApiError(f"the simulated worker takes one prompt per request, got {len(prompt)}; send "
                            "them as separate requests", param="prompt")
        if len(prompt) == 1:
            only = prompt[0]
            if isinstance(only, str) and only:
                return encode(only)
            if (ids := _int_list(only)) is not None and ids:
                return list(ids)
            if only == "" or only == []:
                raise _ApiError("Either prompt or prompt_embeds must be provided and non-empty.",
                                err_type="Bad Request", param="prompt")
        raise _invalid("prompt", "Input should be a string, a list of token ids, or a list of those",
                       "union_type", prompt)

    async def _completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def _chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, *, chat: bool) -> Response:
        try:
            body = await self._read_json(request)
            parsed = self._parse(body, chat=chat)
            assert isinstance(body, dict)
            if self.engine.draw_error():
                raise _engine_dead()
        except _ApiError as exc:
            return _error_response(exc)
        rid = self._request_id(request, body, "chatcmpl-" if chat else "cmpl-")
        created = int(self.clock.wall())
        req = self.engine.submit(parsed.prompt_ids, parsed.spec, rid)
        release = functools.partial(self.engine.release, req)
        if parsed.stream:
            events = (self._chat_events if chat else self._completion_events)(req, parsed, rid, created)
            return _EventStream(events, release)
        try:
            outcome = await self._await_or_abort(request, req)
        except BaseException:
            release()
            raise
        if isinstance(outcome, RequestCut):
            return _Cut(outcome, release)
        if outcome is not None:
            err = _engine_dead() if outcome.status >= 500 else _ApiError(outcome.message)
        elif req.finish_reason == "abort":
            err = _ApiError("Client disconnected")
        else:
            build = self._chat_body if chat else self._completion_body
            return _Released(build(req, parsed, rid, created), 200, release)
        return _Released(err.body(), err.status, release)

    async def _await_or_abort(self, request: Request, req: SimRequest) -> WorkerError | RequestCut | None:
        """Wait for ``req`` to finish; abort it in the engine if the client disconnects first."""

        async def watch_disconnect() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.engine.abort(req)

        async with asyncio.TaskGroup() as tg:
            watcher = tg.create_task(watch_disconnect())
            try:
                await req.wait_finished()
            except (WorkerError, RequestCut) as exc:
                return exc
            finally:
                watcher.cancel()
        return None

    # -- response bodies ----------------------------------------------------------------------------

    def _usage(self, req: SimRequest) -> dict[str, Any]:
        p, c = len(req.prompt_ids), len(req.output_ids)
        return {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c,
                "prompt_tokens_details": None, "completion_tokens_details": None}

    def _completion_body(self, req: SimRequest, p: _Parsed, rid: str, created: int) -> dict[str, Any]:
        rt = p.return_token_ids
        choice = {"index": 0, "text": req.output_text, "logprobs": None, "finish_reason": req.finish_reason,
                  "stop_reason": req.stop_reason, "token_ids": list(req.output_ids) if rt else None,
                  "prompt_logprobs": None, "prompt_token_ids": p.prompt_ids if rt else None,
                  "routed_experts": None}
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": [choice], "service_tier": None, "system_fingerprint": self.system_fingerprint,
                "usage": self._usage(req), "kv_transfer_params": None, "ec_transfer_params": None,
                "metrics": None}

    def _chat_body(self, req: SimRequest, p: _Parsed, rid: str, created: int) -> dict[str, Any]:
        rt = p.return_token_ids
        message = {"role": p.role, "content": req.output_text, "refusal": None, "annotations": None,
                   "audio": None, "function_call": None, "reasoning": None}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": req.finish_reason,
                  "stop_reason": req.stop_reason, "token_ids": list(req.output_ids) if rt else None,
                  "routed_experts": None}
        return {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": [choice], "service_tier": None, "system_fingerprint": self.system_fingerprint,
                "usage": self._usage(req), "prompt_logprobs": None,
                "prompt_token_ids": p.prompt_ids if rt else None, "prompt_text": None,
                "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}

    def _usage_event(self, rid: str, obj: str, created: int, prompt: int, completion: int) -> bytes:
        return (f'data: {{"id":{_enc(rid)},"object":"{obj}","created":{created},"model":{self._model_json},'
                f'"choices":[],{_usage_json(prompt, completion)},'
                f'"system_fingerprint":{self._fingerprint_json}}}\n\n').encode()

    async def _completion_events(self, req: SimRequest, p: _Parsed, rid: str,
                                 created: int) -> AsyncGenerator[bytes, None]:
        head = (f'data: {{"id":{_enc(rid)},"object":"text_completion","created":{created},'
                f'"model":{self._model_json},"choices":[{{"index":0,"text":')
        rt = p.return_token_ids
        prompt_json = _ids_json(p.prompt_ids) if rt else "null"
        n_prompt = len(p.prompt_ids)
        tail = f',"system_fingerprint":{self._fingerprint_json}' if not p.include_usage else ""
        try:
            while True:
                d = await req.next_output()
                fin = d.finish_reason
                parts = [head, _enc(d.text), ',"logprobs":null,"finish_reason":',
                         "null" if fin is None else f'"{fin}"', ',"stop_reason":',
                         "null" if d.stop_reason is None else _enc(d.stop_reason), ',"prompt_token_ids":',
                         prompt_json, ',"token_ids":', _ids_json(d.token_ids) if rt else "null", "}]"]
                prompt_json = "null"
                if p.continuous_usage:
                    parts += [",", _usage_json(n_prompt, d.num_output_tokens)]
                if fin is not None:
                    parts.append(tail)
                parts.append("}\n\n")
                yield "".join(parts).encode()
                if fin is not None:
                    break
            if p.include_usage:
                yield self._usage_event(rid, "text_completion", created, n_prompt, len(req.output_ids))
        except WorkerError as exc:
            yield _stream_error(exc)
        yield _DONE

    async def _chat_events(self, req: SimRequest, p: _Parsed, rid: str,
                           created: int) -> AsyncGenerator[bytes, None]:
        head = (f'data: {{"id":{_enc(rid)},"object":"chat.completion.chunk","created":{created},'
                f'"model":{self._model_json},"choices":[{{"index":0,"delta":')
        rt = p.return_token_ids
        n_prompt = len(p.prompt_ids)
        tail = f',"system_fingerprint":{self._fingerprint_json}' if not p.include_usage else ""
        first = True
        try:
            while True:
                d = await req.next_output()
                if first:  # vLLM sends the role chunk when the first output arrives
                    usage = "," + _usage_json(n_prompt, 0) if p.continuous_usage else ""
                    yield (f'{head}{{"role":{_enc(p.role)},"content":""}},"logprobs":null,'
                           f'"finish_reason":null}}]{usage},'
                           f'"prompt_token_ids":{_ids_json(p.prompt_ids) if rt else "null"},'
                           f'"prompt_text":null}}\n\n').encode()
                    first = False
                fin = d.finish_reason
                parts = [head, '{"content":', _enc(d.text), '},"logprobs":null,"finish_reason":']
                if fin is None:
                    parts.append("null")
                else:
                    parts += [f'"{fin}","stop_reason":',
                              "null" if d.stop_reason is None else _enc(d.stop_reason)]
                parts += [',"token_ids":', _ids_json(d.token_ids) if rt else "null", "}]"]
                if p.continuous_usage:
                    parts += [",", _usage_json(n_prompt, d.num_output_tokens)]
                if fin is not None:
                    parts.append(tail)
                parts.append("}\n\n")
                yield "".join(parts).encode()
                if fin is not None:
                    break
            if p.include_usage:
                yield self._usage_event(rid, "chat.completion.chunk", created, n_prompt, len(req.output_ids))
        except WorkerError as exc:
            yield _stream_error(exc)
        yield _DONE


def create_app(config: SimConfig, *, admin_token: SecretStr | str | None = None, clock: Clock = SYSTEM_CLOCK,
               crash: Callable[[], None] = _crash_process) -> FastAPI:
    """The simulated worker's ASGI app (the engine runs in its lifespan; ``app.state.engine`` is it).

    ``admin_token`` defaults to :func:`~fleetward.fleet.config.admin_token_from_env`.
    """
    return SimWorker(config, admin_token=admin_token, clock=clock, crash=crash).app


class _Server(uvicorn.Server):
    """uvicorn's server, except that a signal which asked for a graceful shutdown is not raised again
    afterwards: a worker stopped by SIGTERM exits 0, which is what "stopped cleanly" means to a supervisor.
    Signal handlers only record (uvicorn's ``handle_exit``); a second Ctrl-C forces the exit."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m fleetward.sim.server",
        description="A simulated vLLM worker (OpenAI-compatible API, fault switches).")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--config-json", default=None, help="a SimConfig as JSON")
    ap.add_argument("--model-name", default=None, help="served model name (overrides the config's)")
    ap.add_argument("--faults-json", default=None, help="fault switches to start with, as POST /admin/faults "
                    "takes them (e.g. {\"crash_after_tokens\": 100})")
    ap.add_argument("--access-log", action="store_true", help="log every HTTP request")
    ap.add_argument("--log-level", default="info")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Serve one simulated worker until SIGTERM/SIGINT; return the exit code."""
    args = _parser().parse_args(argv)
    try:
        config = SimConfig.model_validate_json(args.config_json) if args.config_json else SimConfig()
        if args.model_name:
            config = SimConfig.model_validate({**config.model_dump(), "model_name": args.model_name})
    except ValidationError as exc:
        print(f"simworker: bad --config-json: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(stream=sys.stdout, level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    token_from_env = bool(os.environ.get("FLEETWARD_ADMIN_TOKEN"))
    worker = SimWorker(config, admin_token=admin_token_from_env())
    if args.faults_json:
        try:
            faults, *_ = worker._parse_faults(json.loads(args.faults_json))
        except (ValueError, _ApiError) as exc:
            print(f"simworker: bad --faults-json: {exc}", file=sys.stderr)
            return 2
        worker.engine.update_faults(faults)
    log.info("fleetward sim worker starting: model %r on http://%s:%d, pid %d, max_model_len %d, "
             "max_num_seqs %d, kv %d tokens, admin token %s", config.model_name, args.host, args.port,
             os.getpid(), config.max_model_len, config.max_num_seqs, config.kv_capacity_tokens,
             "from FLEETWARD_ADMIN_TOKEN" if token_from_env
             else "random (set FLEETWARD_ADMIN_TOKEN to use the admin endpoints)")
    server = _Server(uvicorn.Config(
        worker.app, host=args.host, port=args.port, log_config=None, log_level=args.log_level,
        access_log=args.access_log, timeout_graceful_shutdown=3, lifespan="on"))
    server.run()
    log.info("fleetward sim worker stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
