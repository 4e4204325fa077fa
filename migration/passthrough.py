"""Every other endpoint of vLLM's server, passed through to a healthy worker of the request's model.

The router journals, checkpoints and migrates completions and chat completions (:mod:`.router`). vLLM
serves more that fleets use every day; those requests are relayed here, byte for byte both ways:

=============================================  ==========  ==================================================
path                                           label       the model comes from
=============================================  ==========  ==================================================
``POST /v1/responses``                         responses   the JSON body (see "Responses" below)
``GET /v1/responses/{id}``, ``POST .../cancel``  responses   the worker that holds the response
``POST /v1/embeddings``, ``/v2/embed``         embeddings  the JSON body
``POST /pooling``                              pooling     the JSON body
``POST /classify``                             classify    the JSON body
``POST /score``, ``/v1/score``                 score       the JSON body
``POST /rerank``, ``/v1/rerank``, ``/v2/rerank``  rerank    the JSON body
``POST /tokenize``, ``/detokenize``            tokenize…   the JSON body (optional: vLLM's default model)
``POST /v1/audio/transcriptions``              audio       the multipart form's ``model`` field
``POST /v1/audio/translations``                audio       the multipart form's ``model`` field
``GET /version``                               version     any worker
=============================================  ==========  ==================================================

A request without a model goes to the fleet's one model (as vLLM serves its one model); with several, it is
refused (400, naming them); an unknown model is a 404 in vLLM's words. The worker is picked as for a
generation (:meth:`Picker.pick`: routable, serving the model, not silent with work in flight, not shunned,
least loaded). A request is tried on another worker when its worker fails before the client got a byte: the
connection fails, the worker answers 5xx (not 501), or its answer breaks off before the router has it all.
Answers up to ``BUFFER_LIMIT`` with a ``Content-Length`` are read whole before the client gets any of them,
so a body that breaks off is retried whole; larger ones and streams are relayed as they come. A worker's 4xx
is the client's to read, passed on unchanged. A request that ``routing.poison_workers`` workers failed while
serving it (a 5xx other than 503, or an answer that broke off) is sent to no other (:mod:`.poison`), and a
retry after a 5xx draws on the router's retry budget (:mod:`.budget`).

Once the client has bytes, the request stays on its worker. When that worker fails mid-stream (it dies, is
found unhealthy, or the router finds it silent), the client's stream ends cleanly: an SSE stream with an
error event after its last whole event (``data: {"error": ...}`` and ``data: [DONE]`` as vLLM writes
errors; for ``/v1/responses``, the Responses API's ``event: error`` with the next ``sequence_number``), any
other body with its connection cut (never a short body that looks whole).

Responses: vLLM's Responses API streams text but no token ids, so a response cannot be continued on
another worker exactly the way a chat stream is: it fails over before its first byte only, and otherwise
ends with the error event above (docs/operations.md). A response stored on a worker
(``VLLM_ENABLE_RESPONSES_API_STORE``) is found where it lives: ``GET /v1/responses/{id}``, its cancel, and a
new response with ``previous_response_id`` go to the worker that answers for that id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import aiohttp
import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from fleetward.migration import wire
from fleetward.migration.budget import RetryBudget
from fleetward.migration.guard import without_transfer_params
from fleetward.migration.metrics import RouterMetrics
from fleetward.migration.poison import body_digest, poison_error
from fleetward.migration.wire import RouterError

__all__ = ["BUFFER_LIMIT", "ROUTES", "Passthrough", "Picker", "Route"]

log = logging.getLogger(__name__)

BUFFER_LIMIT = 16 * 1024 * 1024  # answers up to this size are read whole, so a broken one is retried whole
_LOOKUP_TIMEOUT_S = 2.0
_SEQUENCE = re.compile(rb'"sequence_number":\s*(\d+)')
_KEEP_HEADERS = ("content-type", "content-length", "x-request-id")


@dataclass(frozen=True, slots=True)
class Route:
    """A vLLM endpoint the router relays: where, how it is called, the ``endpoint`` label of its metrics,
    where the model is named, and how a stream of it ends when its worker fails mid-way."""

    path: str
    method: Literal["GET", "POST"]
    label: str
    model: Literal["json", "form", "none", "stored"]
    stream_error: Literal["data", "event"] = "data"


ROUTES: tuple[Route, ...] = (
    Route("/v1/responses", "POST", "responses", "json", "event"),
    Route("/v1/responses/{response_id}", "GET", "responses", "stored", "event"),
    Route("/v1/responses/{response_id}/cancel", "POST", "responses", "stored"),
    Route("/v1/embeddings", "POST", "embeddings", "json"),
    Route("/v2/embed", "POST", "embeddings", "json"),
    Route("/pooling", "POST", "pooling", "json"),
    Route("/classify", "POST", "classify", "json"),
    Route("/score", "POST", "score", "json"),
    Route("/v1/score", "POST", "score", "json"),
    Route("/rerank", "POST", "rerank", "json"),
    Route("/v1/rerank", "POST", "rerank", "json"),
    Route("/v2/rerank", "POST", "rerank", "json"),
    Route("/tokenize", "POST", "tokenize", "json"),
    Route("/detokenize", "POST", "detokenize", "json"),
    Route("/v1/audio/transcriptions", "POST", "audio", "form"),
    Route("/v1/audio/translations", "POST", "audio", "form"),
    Route("/version", "GET", "version", "none"),
)


class Picker(Protocol):
    """What the relay needs of the router: the fleet's models, and a worker for a request."""

    def models(self) -> list[str]:
        """Models some registered worker serves."""
        ...

    def is_adapter(self, name: str) -> bool:
        """A LoRA adapter some worker serves (requests name it as their model)."""
        ...

    def pick(self, model: str | None, tried: list[str]) -> tuple[str, str] | None:
        """A worker (id, base URL) for ``model`` (None: any model) that is none of ``tried``, or None."""
        ...

    def routable(self) -> list[tuple[str, str]]:
        """Every worker (id, base URL) a request may go to now, of any model."""
        ...


class _Broken(Exception):
    """A worker's answer broke off after the client had part of it: the client's connection is cut."""


class Passthrough:
    """The relay (module docstring), counted in the router's metrics (``fleetward_router_requests`` by
    ``route.label``). A worker's open relays are aborted together (:meth:`abort`) when the router gives up on
    the worker."""

    def __init__(self, picker: Picker, session: Callable[[], aiohttp.ClientSession], *, metrics: RouterMetrics,
                 attempts: int, budget: RetryBudget | None = None, poison_workers: int = 0,
                 on_poison: Callable[[str, str, str | None, Mapping[str, str]], Awaitable[None]] | None = None
                 ) -> None:
        self.picker = picker
        self.poison_workers = poison_workers
        self.on_poison = on_poison  # (request, body digest, model, workers): counted, logged, published
        self.budget = budget or RetryBudget(0)
        self._session = session
        self._attempts = max(1, attempts)
        self.metrics = metrics
        self._open: dict[str, set[aiohttp.ClientResponse]] = {}
        self._aborted: dict[aiohttp.ClientResponse, str] = {}  # cut by abort(): why

    def _count(self, endpoint: str, outcome: str) -> None:
        self.metrics.requests.labels(endpoint, outcome).inc()

    # -- the fleet's side --------------------------------------------------------------------------------

    def abort(self, worker: str, reason: str) -> int:
        """Cut every relay open on ``worker`` (it is unhealthy, gone or silent); returns how many."""
        open_ = self._open.pop(worker, set())
        for response in open_:
            self._aborted[response] = reason
            response.close()
        return len(open_)

    # -- requests ----------------------------------------------------------------------------------------

    async def handle(self, route: Route, request: Request) -> Response:
        """Relay ``request`` (module docstring); count it under ``route.label``."""
        body = await request.body()
        if route.model == "json":
            body, taken = without_transfer_params(body)  # a worker-to-worker parameter is not a client's (.guard)
            self.metrics.transfer_params_taken(taken)
        try:
            target: str | None = None
            if route.model == "stored":
                target = await self._holder(request.path_params["response_id"])
                model = None
            else:
                model, previous = await self._model(route, request, body)
                if previous is not None:
                    target = await self._holder(previous)
        except RouterError as exc:
            self._count(route.label, f"http_{exc.status}")
            return exc.response()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k in ("content-type", "accept")}
        return await self._relay(route, path, body, headers, model, target)

    async def _model(self, route: Route, request: Request, body: bytes) -> tuple[str | None, str | None]:
        """The model a request names (None: any worker), and for a response, the stored one it continues."""
        if route.model == "none":
            return None, None
        named: Any = None
        previous: Any = None
        if route.model == "json":
            with contextlib.suppress(orjson.JSONDecodeError):
                data = orjson.loads(body)
                if isinstance(data, dict):
                    named, previous = data.get("model"), data.get("previous_response_id")
        else:
            with contextlib.suppress(Exception):  # a malformed form is the worker's to refuse, in its words
                form = await request.form()
                named = form.get("model")
        previous = previous if isinstance(previous, str) and previous else None
        models = self.picker.models()
        if isinstance(named, str) and named:
            if named not in models and not self.picker.is_adapter(named):
                raise RouterError(404, f"The model `{named}` does not exist. Valid aliases: {', '.join(models)}.",
                                  param="model")
            return named, previous
        if len(models) > 1:
            raise RouterError(400, f"model is required: this router serves several models ({', '.join(models)})",
                              param="model")
        return (models[0] if models else None), previous

    async def _holder(self, response_id: str) -> str | None:
        """The worker that stores response ``response_id`` (it answers GET /v1/responses/{id}), or None."""
        workers = self.picker.routable()
        if not workers:
            return None
        session = self._session()

        async def holds(worker: str, url: str) -> str | None:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with session.get(f"{url}/v1/responses/{response_id}",
                                       timeout=aiohttp.ClientTimeout(total=_LOOKUP_TIMEOUT_S)) as r:
                    return worker if r.status == 200 else None
            return None

        found = await asyncio.gather(*(holds(w, u) for w, u in workers))
        return next((w for w in found if w is not None), None)

    async def _relay(self, route: Route, path: str, body: bytes, headers: dict[str, str], model: str | None,
                     target: str | None) -> Response:
        tried: list[str] = []
        last: tuple[int, bytes, str] | None = None  # a worker's 5xx, answered if no worker does better
        throttled, after_5xx = 0, False  # retries after a worker's 5xx drew on the retry budget (.budget)
        broke: dict[str, str] = {}  # worker -> why, for those that failed while serving it (.poison)
        for _ in range(self._attempts):
            if self.poison_workers and len(broke) >= self.poison_workers:
                return await self._poisoned(route, path, body, model, broke)
            if after_5xx:
                if not self.budget.admit():
                    self.metrics.retries_refused.inc()
                    break  # the fleet is failing requests: the worker's answer, at once
                throttled, after_5xx = throttled + 1, False
            if target is not None:  # the one worker that can answer (a stored response)
                picked = None if target in tried else next(
                    ((w, u) for w, u in self.picker.routable() if w == target), None)
            else:
                picked = self.picker.pick(model, tried)
            if picked is None:
                break
            worker, url = picked
            tried.append(worker)
            self.metrics.upstream_attempts.labels("first" if len(tried) == 1 else "retry").inc()
            try:
                upstream = await self._session().request(route.method, url + path, data=body or None,
                                                         headers=headers)
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                log.info("%s %s: worker %s unreachable (%s); trying another", route.method, path, worker, exc)
                self.metrics.passthrough_retries.labels(route.label, "connect").inc()
                continue
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                # It had the request: it died, or cut or timed out the connection, before answering.
                log.info("%s %s: worker %s failed before answering (%s); trying another", route.method, path,
                         worker, exc)
                self.metrics.passthrough_retries.labels(route.label, "broken").inc()
                broke[worker] = f"no answer: {str(exc) or type(exc).__name__}"
                continue
            self._open.setdefault(worker, set()).add(upstream)
            relayed = False  # the client gets this answer as it comes: the stream releases it when done
            try:
                if upstream.status >= 500 and upstream.status != 501:
                    raw = await upstream.read()
                    last = (upstream.status, raw, upstream.headers.get("content-type", "application/json"))
                    log.info("%s %s: worker %s answered %d; trying another", route.method, path, worker,
                             upstream.status)
                    self.metrics.passthrough_retries.labels(route.label, "status").inc()
                    after_5xx = self.budget.enabled
                    if upstream.status != 503:  # 503: the worker's load, not the request
                        broke[worker] = f"HTTP {upstream.status}"
                    continue
                self.budget.served(refund=throttled)
                size = upstream.content_length
                if size is not None and size <= BUFFER_LIMIT:
                    raw = await upstream.read()
                    if upstream in self._aborted or len(raw) != size:
                        raise aiohttp.ClientPayloadError(self._aborted.get(upstream, "the answer broke off"))
                    self._count(route.label, _outcome(upstream.status))
                    return Response(raw, status_code=upstream.status, headers=_headers(upstream, whole=True))
                first = await upstream.content.readany()
                relayed = True
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                log.info("%s %s: worker %s broke off before the client had a byte (%s); trying another",
                         route.method, path, worker, exc)
                self.metrics.passthrough_retries.labels(route.label, "broken").inc()
                broke[worker] = f"its answer broke off: {self._aborted.get(upstream) or exc}"
                continue
            finally:
                if not relayed:
                    self._release(worker, upstream)
            # Counted and released at the stream's end (released after the response too, in case the client
            # left before it started).
            return StreamingResponse(self._stream(route, worker, upstream, first), status_code=upstream.status,
                                     headers=_headers(upstream, whole=False),
                                     background=BackgroundTask(self._release, worker, upstream))
        if last is not None:
            status, raw, ctype = last
            self._count(route.label, f"http_{status}")
            return Response(raw, status_code=status, media_type=ctype)
        self._count(route.label, "no_worker")
        which = f"model {model}" if model else "any model"
        return RouterError(503, f"no healthy worker of {which} could answer {route.method} {path}"
                       + (f" (tried {', '.join(tried)})" if tried else "")).response()

    async def _poisoned(self, route: Route, path: str, body: bytes, model: str | None,
                        broke: Mapping[str, str]) -> Response:
        """``routing.poison_workers`` workers failed while serving this request: it goes to no other (.poison);
        the router counts, logs and publishes it (``on_poison``)."""
        request, digest = f"{route.method} {path}", body_digest(body)
        self._count(route.label, "poison")
        if self.on_poison is not None:
            await self.on_poison(request, digest, model, broke)
        return poison_error(request, digest, broke).response()

    def load(self) -> dict[str, int]:
        """Relays open per worker (the picker adds them to a worker's load)."""
        return {w: len(open_) for w, open_ in self._open.items()}

    def _release(self, worker: str, upstream: aiohttp.ClientResponse) -> None:
        """Done with a worker's answer (idempotent)."""
        open_ = self._open.get(worker)
        if open_ is not None:
            open_.discard(upstream)
            if not open_:
                self._open.pop(worker, None)
        self._aborted.pop(upstream, None)
        upstream.release()

    async def _stream(self, route: Route, worker: str, upstream: aiohttp.ClientResponse,
                      first: bytes) -> AsyncIterator[bytes]:
        sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        pending = b""  # an SSE event not yet whole: held until it is, so an error event never follows half of one
        last_seq = -1
        outcome = "client_disconnected"  # counted once the stream ends, however it ends
        try:
            data = first
            while data:  # readany() answers b"" at the end of the body only
                if not sse:
                    yield data
                else:
                    pending += data
                    cut = pending.rfind(b"\n\n")
                    if cut >= 0:
                        whole, pending = pending[:cut + 2], pending[cut + 2:]
                        seqs = _SEQUENCE.findall(whole)
                        if seqs:
                            last_seq = int(seqs[-1])
                        yield whole
                data = await upstream.content.readany()
            if upstream in self._aborted:  # closed under the reader, which may have taken it for the end
                raise aiohttp.ClientConnectionError(self._aborted[upstream])
            if pending.strip():
                yield pending
            outcome = _outcome(upstream.status)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            outcome = "failed_stream"
            self.metrics.passthrough_cut.labels(route.label).inc()
            cause = self._aborted.get(upstream) or type(exc).__name__
            why = f"worker {worker} failed mid-stream ({cause}); this request cannot be resumed on another worker"
            log.warning("%s: %s", upstream.url.path, why)
            if not sse:
                raise _Broken(why) from exc
            if route.stream_error == "event":
                yield (b"event: error\ndata: " + orjson.dumps(
                    {"type": "error", "code": "worker_failed", "message": why, "param": None,
                     "sequence_number": last_seq + 1}) + b"\n\n")
            else:
                yield wire.error_event(502, why) + wire.DONE
        finally:
            self._count(route.label, outcome)
            self._release(worker, upstream)


def _outcome(status: int) -> str:
    return "ok" if status < 400 else f"http_{status}"


def _headers(upstream: aiohttp.ClientResponse, *, whole: bool) -> dict[str, str]:
    keep = {k: v for k in _KEEP_HEADERS if (v := upstream.headers.get(k)) is not None}
    if not whole:
        keep.pop("content-length", None)  # relayed as it comes: a body cut short must not look whole
    return keep
