"""The router: an OpenAI-compatible front door whose streams survive worker failures.

Request life (docs/architecture.md, "Request life and migration"): validate → journal → pick a healthy
worker → stream tokens to the client, journaling each → on failure (connect error, reset, EOF without
finish, 5xx, in-band error, worker silent past its adaptive allowance, worker turned unhealthy in etcd)
resume on another worker from prompt + emitted tokens, up to ``migration_limit`` times within the
request's deadline. Journals are checkpointed
to etcd by :class:`~fleetward.migration.checkpoint.Checkpointer`; a client that lost its connection (or
its router) reconnects to any replica with ``Last-Event-ID`` and continues from the checkpoint.

Endpoints (the app is :mod:`~fleetward.migration.http`): ``POST /v1/completions`` and
``POST /v1/chat/completions`` are served here; every other vLLM endpoint is passed through to a worker
(:mod:`~fleetward.migration.passthrough`).

One module because the request life reads as one story: validation, routing, streaming, stitching and
migration share the journal and the upstream attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fleetward.fleet.bus import EventBus
from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.config import RouterConfig
from fleetward.fleet.etcd import StateStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.kv import KV_ERROR_TYPE
from fleetward.fleet.lease import LeaseKeeper
from fleetward.fleet.registry import FleetView
from fleetward.fleet.telemetry import link_gauges
from fleetward.fleet.worker import HealthState
from fleetward.migration import wire
from fleetward.migration.apikeys import ApiKeys
from fleetward.migration.checkpoint import Checkpointer, NotResumable
from fleetward.migration.journal import Journal, Kind, RequestRefused, new_request_id, validate_body
from fleetward.migration.metrics import RouterMetrics
from fleetward.migration.passthrough import Passthrough, Route
from fleetward.migration.policy import RoutingPolicy, make_policy, prefix_key
from fleetward.migration.progress import ProgressModel
from fleetward.migration.text import TextSources
from fleetward.migration.upstream import Upstream, UpstreamError, UpstreamStream
from fleetward.migration.wire import RouterError

__all__ = ["Router", "RouterError"]

log = logging.getLogger(__name__)

# Health states in which a worker's open streams are moved elsewhere at once.
_EVACUATE = {HealthState.UNHEALTHY, HealthState.DEAD, HealthState.RESTARTING, HealthState.QUARANTINED}


@dataclass(slots=True)
class Out:
    tokens: list[int]
    text: str
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: Any = None
    worker: str = ""
    n: int = 0  # completion tokens in the journal once this chunk is in (the SSE id's token index)
    attempt: int = 0


@dataclass
class Active:
    journal: Journal
    worker: str | None = None
    stream: UpstreamStream | None = None
    detached_at: float | None = None
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)


class Router:
    def __init__(self, config: RouterConfig, *, store: StateStore, bus: EventBus, keys: Keys,
                 router_id: str | None = None, url: str = "", public_url: str | None = None,
                 clock: Clock = SYSTEM_CLOCK,
                 policy: RoutingPolicy | None = None) -> None:
        self.config = config
        self.store = store
        self.bus = bus
        self.keys = keys
        self.id = router_id or f"router-{uuid.uuid4().hex[:8]}"
        self.url = url  # this process's own address (registered: metrics, stream progress)
        self.public_url = public_url or url  # where clients reach it (shared by the processes of a group)
        self.clock = clock
        self.policy = policy or make_policy(config.policy, slack=config.affinity_slack)
        self.view = FleetView(store, keys, on_change=self._on_fleet_change)
        self.upstream = Upstream()
        self.progress = ProgressModel(clock=clock, floor_s=config.stall_floor_s,
                                      itl_multiplier=config.itl_multiplier,
                                      prefill_s_per_token=config.prefill_s_per_token)
        self.checkpointer = Checkpointer(store, keys, self.id, interval_s=config.checkpoint_interval_ms / 1000,
                                         ttl_s=config.checkpoint_ttl_s, incremental=config.checkpoint_incremental,
                                         clock=clock, on_lost=self._on_lost)
        self.checkpointer.enabled = config.checkpoints
        self.active: dict[str, Active] = {}
        self.texts = TextSources(config.tokenizers)
        self.metrics = RouterMetrics()
        link_gauges(self.metrics.registry, store=store, bus=bus)
        # API keys on the public API (routing.api_keys_file): None when it is open.
        self.api_keys = ApiKeys.load(config.api_keys_file, default_limit=config.api_key_max_concurrency) \
            if config.api_keys_file is not None else None
        if self.api_keys is not None:
            for name in self.api_keys.names:
                self.metrics.key_requests.labels(name, "accepted")
                self.metrics.key_requests.labels(name, "over_limit")
        self.passthrough = Passthrough(self, lambda: self.upstream.session, metrics=self.metrics,
                                       attempts=config.migration_limit + 1)
        self.metrics.checkpoint_lag.set_function(lambda: self.checkpointer.lag_s)
        self.checkpointer.on_flush = self.metrics.checkpoint_flush.observe
        self.checkpointer.on_slice = self.metrics.checkpoint_slice.observe
        self._tasks: list[asyncio.Task[Any]] = []
        self._lease: LeaseKeeper | None = None
        self._accepting = False
        self.orphans: set[str] = set()
        self._seen_flushes = self._seen_txns = self._seen_bytes = 0
        self._seen_models: set[str] = set()  # a model whose workers all died is unavailable (503), not unknown

    # -- life -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the fleet at revision R, watch from R+1, register; serving only once the state is whole."""
        await self.upstream.start()
        if self.config.checkpoints:
            await self.checkpointer.start()
        self._tasks.append(asyncio.create_task(self.view.run(), name="router-fleet-view"))
        await self.view.loaded.wait()
        # Keys only: checkpoints are bound to their router's checkpoint lease (``checkpoint_lease`` in its
        # ``routers/`` record), so the owner is known without reading 10,000 values of several kB each.
        snap = await self.store.get_prefix(self.keys.requests, keys_only=True)
        live_leases = {r.get("checkpoint_lease") for r in self.view.fleet.routers.values()} - {None}
        cut = len(self.keys.requests)
        self.orphans.update(kv.key[cut:] for kv in snap.items
                            if kv.lease not in live_leases and "/" not in kv.key[cut:])  # bases, not deltas
        if self.orphans:
            log.info("%d request checkpoint(s) of dead routers are resumable until their lease expires",
                     len(self.orphans))
        if self.config.checkpoints:
            self._tasks.append(asyncio.create_task(self.checkpointer.run(), name="router-checkpoints"))
        self._tasks.append(asyncio.create_task(self._monitor(), name="router-monitor"))
        self._started_at = self.clock.wall()
        await self._register()
        self._tasks.append(asyncio.create_task(self._keep_registered(), name="router-registration"))
        # Everything loaded so far (modules, the fleet) lives as long as the process: keep it out of the
        # cyclic collector, whose full passes over it otherwise stall the loop for many milliseconds
        # under load (the p99 of inter-token latency).
        gc.freeze()
        self._accepting = True

    async def _register(self) -> None:
        self._lease = await LeaseKeeper(self.store, self.config.lease_ttl_s, clock=self.clock).start()
        info = {"id": self.id, "url": self.url, "public_url": self.public_url, "started_at": self._started_at,
                "pid": os.getpid(),
                "checkpoint_lease": self.checkpointer.lease.id if self.checkpointer.lease is not None else None}
        await self.store.put(self.keys.router(self.id), orjson.dumps(info), lease=self._lease.id)

    async def _keep_registered(self) -> None:
        """Register again under new leases when etcd let one expire (e.g. a partition longer than its TTL).

        A lost checkpoint lease took every checkpoint with it: they are all written again at the next flush.
        """
        while True:
            assert self._lease is not None
            lease, cp = self._lease, self.checkpointer.lease
            waits = [asyncio.ensure_future(lease.lost.wait())]
            if cp is not None:
                waits.append(asyncio.ensure_future(cp.lost.wait()))
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            if cp is not None and cp.lost.is_set():
                log.warning("router %s: checkpoint lease expired; checkpointing everything again", self.id)
                await self.checkpointer.renew()
            log.warning("router %s: registration lease %s; registering again", self.id,
                        "expired" if lease.lost.is_set() else "kept, checkpoint lease renewed")
            await lease.aclose(revoke=not lease.lost.is_set())
            await self._register()

    async def aclose(self) -> None:
        """Stop taking requests, let open streams finish (``drain_timeout_s``), cancel the rest, deregister."""
        self._accepting = False
        deadline = self.clock.monotonic() + self.config.drain_timeout_s
        while any(a.detached_at is None for a in self.active.values()) and self.clock.monotonic() < deadline:
            await self.clock.sleep(0.05)
        for a in list(self.active.values()):
            for t in list(a.tasks):
                t.cancel()
        with contextlib.suppress(Exception):
            await self.checkpointer.flush()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        # Keep the checkpoints of unfinished streams resumable on a replica: their lease runs out on its own.
        await self.checkpointer.aclose(revoke=not self.checkpointer.live)
        if self._lease is not None:
            await self._lease.aclose()
            self._lease = None
        await self.upstream.aclose()
        await self.texts.aclose()

    # -- fleet ------------------------------------------------------------------------------------------

    def _on_fleet_change(self, section: str, worker: str) -> None:
        fleet = self.view.fleet
        self.metrics.workers_routable.set(len(fleet.routable()))
        new_models = {rec.model for rec in fleet.workers.values()} - self._seen_models
        self._seen_models.update(new_models)
        for model in new_models:  # exported at 0 from the start: rate() sees the first request of a model
            self.metrics.ttft.labels(model)
            self.metrics.itl.labels(model)
        for rec in (fleet.workers.values() if section == "*" else
                    [fleet.workers[worker]] if section == "workers" and worker in fleet.workers else []):
            self.texts.want(rec.model, rec.tokenizer)
        if section not in ("workers", "health"):
            return
        health = fleet.health.get(worker)
        gone = worker not in fleet.workers
        if gone or (health is not None and health.state in _EVACUATE):
            why = "worker deregistered" if gone else f"worker {health.state.value}: {health.reason}"  # type: ignore[union-attr]
            self._evacuate(worker, why)
            if gone:
                self.progress.forget(worker)

    def _evacuate(self, worker: str, reason: str) -> None:
        for a in self.active.values():
            if a.worker == worker and a.stream is not None:
                a.stream.abort(reason)
        self.passthrough.abort(worker, reason)

    def _on_lost(self, request_id: str) -> None:
        a = self.active.get(request_id)
        if a is not None:
            for t in list(a.tasks):
                t.cancel()

    async def _monitor(self) -> None:
        """Abort streams on stalled workers; forget detached requests whose clients did not come back."""
        while True:
            await self.clock.sleep(0.05)
            for worker, silent, allowed in self.progress.stalled():
                reason = f"stalled: no token for {silent:.2f}s with work in flight (allowed {allowed:.2f}s)"
                aborted = 0
                for a in self.active.values():
                    if a.worker == worker and a.stream is not None and a.stream.abort_reason is None:
                        a.stream.abort(reason)
                        aborted += 1
                aborted += self.passthrough.abort(worker, reason)
                if aborted:
                    log.warning("worker %s %s; migrating %d stream(s)", worker, reason, aborted)
                    self.progress.stall_acted_on(worker)
            now = self.clock.monotonic()
            for rid, a in list(self.active.items()):
                if a.detached_at is not None and now - a.detached_at > self.config.detached_grace_s:
                    self._release(rid)
            self._mirror_checkpoint_counters()

    def _mirror_checkpoint_counters(self) -> None:
        cp = self.checkpointer
        self.metrics.checkpoint_flushes.inc(cp.flushes - self._seen_flushes)
        self.metrics.checkpoint_txns.inc(cp.txns - self._seen_txns)
        self.metrics.checkpoint_bytes.inc(cp.bytes_written - self._seen_bytes)
        self._seen_flushes, self._seen_txns, self._seen_bytes = cp.flushes, cp.txns, cp.bytes_written

    def _release(self, rid: str) -> None:
        a = self.active.pop(rid, None)
        if a is not None:
            self.checkpointer.done(a.journal)
            self.metrics.in_flight.set(len(self.active))

    def _candidates(self, model: str, failed: list[str]) -> tuple[list[str], bool]:
        """Workers a request may go to next, and whether any registered worker serves ``model`` at all.

        Routable (health), serving the model, not stalled right now and not shunned (its streams were moved
        away for silence and it has shown no life since), unless every such worker is; preferably one this
        request has not failed on yet, else any but the one it failed on last (a worker that reset one
        stream may serve the next), else whatever is left.
        """
        fleet = self.view.fleet
        known = False
        ok: list[str] = []
        shunned: list[str] = []
        for wid, rec in fleet.workers.items():
            if rec.model != model:
                continue
            known = True
            h = fleet.health.get(wid)
            if h is None or not h.state.is_routable or rec.role == "prefill":
                continue
            if self.progress.silent_for(wid) > self.progress.allowed_silence(wid):
                continue
            ready_since = h.since if h.state is HealthState.READY else None
            if self.progress.shunned(wid, hold_s=self.config.stall_hold_s, ready_since=ready_since):
                shunned.append(wid)
                continue
            ok.append(wid)
        ok = ok or shunned
        fresh = [w for w in ok if w not in failed]
        if fresh:
            return fresh, known
        not_last = [w for w in ok if not failed or w != failed[-1]]
        return (not_last or ok), known

    async def _prefill(self, j: Journal, path: str, body: dict[str, Any], load: dict[str, int],
                       exclude: set[str]) -> tuple[dict[str, Any], str | None]:
        """Prefill/decode: have a prefill worker compute the prompt's KV first, when the model has any.

        Returns the decode request and the prefill worker it carries KV from (None: no KV, the decode worker
        computes the prompt). The prefill worker answers one token; the decode request then carries the
        ``kv_transfer_params`` it answered with (vLLM's disaggregated-serving protocol; a connector that finds
        KV by prompt, like vLLM's ExampleConnector, needs none), plus whether the decode worker must check the
        transfer (``verify``) and what it does when a check fails (``kv_load_failure_policy``). A resumed stream
        is prefilled again, prompt and emitted tokens. A prefill that fails costs time, not tokens: the decode
        worker then computes the prompt itself, as an aggregated worker would (docs/pd.md). ``exclude``: prefill
        workers whose KV this request could not use.
        """
        fleet = self.view.fleet
        prefill = sorted(wid for wid, rec in fleet.workers.items()
                         if rec.role == "prefill" and rec.model == j.model and wid not in exclude
                         and (h := fleet.health.get(wid)) is not None and h.state.is_routable)
        if not prefill:
            return body, None
        worker = min(prefill, key=lambda w: load.get(w, 0))
        ask = {**body, "stream": False, "max_tokens": 1, "min_tokens": 0,
               "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
        ask.pop("stream_options", None)
        started = self.clock.monotonic()
        try:
            answer = await self.upstream.call(fleet.workers[worker].url, path, ask,
                                              timeout=self.config.prefill_timeout_s)
        except UpstreamError as exc:
            self.metrics.prefills.labels("failed").inc()
            log.warning("%s: prefill on %s failed (%s); the decode worker computes the prompt itself", j.id,
                        worker, exc)
            return body, None
        self.metrics.prefills.labels("ok").inc()
        self.metrics.prefill_seconds.observe(self.clock.monotonic() - started)
        kv = answer.get("kv_transfer_params")
        if not isinstance(kv, dict):
            return body, worker
        policy = "recompute" if self.config.kv_failure_policy == "recompute" else "fail"
        return {**body, "kv_transfer_params": {**kv, "verify": self.config.kv_verify,
                                               "kv_load_failure_policy": policy}}, worker

    @staticmethod
    def _kv_refusal(exc: UpstreamError) -> str | None:
        """The kind of KV failure when a decode worker refused the KV it was given (a 502 of error type
        ``KVTransferError``, the kind in ``param``), else None."""
        err = exc.body.get("error") if exc.status == 502 and isinstance(exc.body, dict) else None
        if not isinstance(err, dict) or err.get("type") != KV_ERROR_TYPE:
            return None
        return str(err.get("param"))

    def _kv_failed(self, j: Journal, exc: UpstreamError, kind: str, prefilled_on: str, worker: str,
                   retries: int) -> bool:
        """A decode worker refused the KV from ``prefilled_on``: whether to prefill again (else the next try
        goes without prefill); raises :class:`RouterError` under ``kv_failure_policy: fail``."""
        self.metrics.kv_failures.labels(kind).inc()
        policy = self.config.kv_failure_policy
        log.warning("request %s: the KV transfer %s -> %s failed (%s: %s); kv_failure_policy %s", j.id,
                    prefilled_on, worker, kind, exc.message, policy)
        if policy == "fail":
            raise RouterError(502, f"the KV transfer from prefill worker {prefilled_on} to decode worker {worker} "
                              f"failed ({kind}: {exc.message}) and routing.kv_failure_policy is fail")
        return policy == "retry" and retries < self.config.kv_retries

    def text_status(self, model: str) -> dict[str, Any]:
        if not self.config.detokenize:
            return {"detokenizer": "worker", "why": "routing.detokenize is off"}
        return self.texts.status(model)

    def models(self) -> list[str]:
        models = {rec.model for rec in self.view.fleet.workers.values()}
        self._seen_models |= models
        return sorted(models)

    def _load(self) -> dict[str, int]:
        """Requests in flight per worker: streams and passed-through requests."""
        load = {w: p.in_flight for w, p in self.progress.workers.items()}
        for w, k in self.passthrough.load().items():
            load[w] = load.get(w, 0) + k
        return load

    def pick(self, model: str | None, tried: list[str]) -> tuple[str, str] | None:
        """A worker for a passed-through request (:class:`~fleetward.migration.passthrough.Picker`)."""
        models = [model] if model is not None else self.models()
        candidates = [w for m in models for w in self._candidates(m, tried)[0] if w not in tried]
        if not candidates:
            return None
        worker = self.policy.choose(candidates, self._load(), None)
        return worker, self.view.fleet.workers[worker].url

    def routable(self) -> list[tuple[str, str]]:
        fleet = self.view.fleet
        return [(w, fleet.workers[w].url) for m in self.models() for w in self._candidates(m, [])[0]]

    # -- generation -------------------------------------------------------------------------------------

    async def generate(self, j: Journal) -> AsyncGenerator[Out | None, None]:
        """Attempts until the journal is finished. Yields ``None`` once the first upstream accepted.

        Raises :class:`RouterError` when the request cannot be served (before the first yield: the HTTP
        status to answer; after: the reason for the in-band error).
        """
        async for batch in self.batches(j):
            for item in batch:
                yield item

    async def batches(self, j: Journal) -> AsyncGenerator[list[Out | None], None]:
        """:meth:`generate`, with everything that is ready at once in one list: what the upstream reader
        produced while the client's side was busy. The client's side writes one list as one socket write.

        Upstream reading runs in its own task and never waits for the client: a slow client must not make
        a healthy worker look silent (backpressure would stop the reads), and what the worker produced is
        journaled (and checkpointed) as it arrives.
        """
        queue: asyncio.Queue[Out | BaseException | type[StopAsyncIteration] | None] = asyncio.Queue()

        async def produce() -> None:
            try:
                await self._produce(j, queue.put_nowait)
                queue.put_nowait(StopAsyncIteration)
            except RouterError as exc:
                queue.put_nowait(exc)

        producer = asyncio.create_task(produce(), name=f"upstream-{j.id}")
        try:
            while True:
                item = await queue.get()
                batch: list[Out | None] = []
                while True:
                    if item is StopAsyncIteration or isinstance(item, BaseException):
                        break
                    batch.append(item)  # type: ignore[arg-type]
                    if queue.empty():
                        item = None
                        break
                    item = queue.get_nowait()
                if batch:
                    yield batch
                if item is StopAsyncIteration:
                    return
                if isinstance(item, BaseException):
                    raise item
        finally:
            producer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await producer

    async def _produce(self, j: Journal, emit: Callable[[Out | None], None]) -> None:
        """The attempt loop behind :meth:`generate`: ``emit(None)`` once opened, then every :class:`Out`."""
        failed: list[str] = []
        opened = False
        failed_at: float | None = None  # when the client got its last token before the current failure
        last_token_at: float | None = None
        uncounted = 0  # tokens sent but not yet added to the tokens counter
        reason = ""
        kv_excluded: set[str] = set()  # prefill workers whose KV a decode worker refused for this request
        kv_retries = 0
        kv_retry = False  # the try about to start repeats one whose KV was refused (not a migration)
        use_prefill = True
        if j.vocab is None and self.config.detokenize:
            j.vocab = await self.texts.get(j.model)
        while not j.is_done:
            if j.attempts > 0:
                why_not = j.resumable()
                if why_not is not None:
                    self.metrics.migration_failures.labels("not_resumable").inc()
                    raise RouterError(502, f"the worker failed mid-stream ({reason}) and this request cannot be "
                                      f"resumed exactly: {why_not}")
                if j.attempts > self.config.migration_limit:
                    self.metrics.migration_failures.labels("limit").inc()
                    raise RouterError(503 if not j.emitted else 502,
                                      f"gave up after {j.attempts} attempts (migration_limit="
                                      f"{self.config.migration_limit}); last failure: {reason}",
                                      retry_after=self.config.retry_after_s)
            if self.clock.wall() > j.deadline:
                if j.attempts > 0:
                    self.metrics.migration_failures.labels("deadline").inc()
                raise RouterError(504, f"request deadline passed after {j.attempts} attempt(s); last failure: "
                                  f"{reason}")
            candidates, known = self._candidates(j.model, failed)
            if not candidates:
                if not known and not failed and self.models() and j.model not in self._seen_models:
                    valid = ", ".join(self.models())
                    raise RouterError(404, f"The model `{j.model}` does not exist. Valid models: {valid}.",
                                      param="model")
                if j.attempts > 0:
                    self.metrics.migration_failures.labels("no_worker").inc()
                raise RouterError(503, "no healthy worker can take this request now"
                                  + (f" (last failure: {reason})" if reason else ""),
                                  retry_after=self.config.retry_after_s)
            load = self._load()
            key = None
            if self.config.affinity_tokens:
                prompt = j.prompt_ids if j.prompt_ids is not None else j.body.get("prompt") or str(
                    j.body.get("messages"))
                key = prefix_key(prompt, self.config.affinity_tokens)
            worker = self.policy.choose(candidates, load, key)
            url = self.view.fleet.workers[worker].url
            path, body = j.upstream_request()
            prefilled_on: str | None = None
            if use_prefill:
                body, prefilled_on = await self._prefill(j, path, body, load, kv_excluded)
            prompt_len = len(body["prompt"]) if isinstance(body.get("prompt"), list) else len(
                orjson.dumps(body.get("prompt") or body.get("messages")))
            previous = j.worker
            j.attempts += 1
            j.worker = worker
            j.dirty = True
            if j.attempts > 1 and not kv_retry:
                j.migrations += 1
                trigger = reason.split(":")[0] if reason else "unknown"
                self.metrics.migrations.labels(trigger).inc()
                await self.bus.publish("migration", request=j.id, worker=worker, from_worker=previous,
                                       reason=reason, tokens=len(j.emitted), attempt=j.attempts, router=self.id)
            kv_retry = False
            active = self.active[j.id]
            active.worker = worker
            self.progress.dispatched(worker, j.id, prompt_len)
            try:
                async with self.upstream.open(worker, url, path, body) as stream:
                    active.stream = stream
                    use_prefill = True  # a later resume of this stream is prefilled again
                    if not opened:
                        opened = True
                        emit(None)
                    chunks = 0
                    async for chunk in stream:
                        chunks += 1
                        if not chunks % 16:
                            # Buffered upstream data never suspends the read: yield, so one fast stream
                            # cannot starve the others, the stall monitor and the lease keepalives.
                            self.metrics.tokens.inc(uncounted)  # the counter takes a lock: not per token
                            uncounted = 0
                            await asyncio.sleep(0)
                        if chunk.prompt_token_ids is not None and j.prompt_ids is None:
                            j.prompt_ids = list(chunk.prompt_token_ids)
                        if chunk.fingerprint is not None:
                            j.fingerprint = chunk.fingerprint
                        if not chunk.token_ids and chunk.finish_reason is None:
                            continue
                        self.progress.token(worker, j.id, len(chunk.token_ids))
                        last_token_at = self.clock.monotonic()
                        if failed_at is not None:
                            self.metrics.stall.observe(last_token_at - failed_at)
                            failed_at = None
                        tokens, text, finish = j.record(chunk.token_ids, chunk.text, chunk.finish_reason,
                                                        chunk.stop_reason)
                        uncounted += len(tokens)
                        logprobs = chunk.logprobs
                        if logprobs is not None and j.kind is Kind.COMPLETION and not j.body.get("echo"):
                            logprobs = j.logprobs_offsets(logprobs)
                        emit(Out(tokens, text, finish, j.stop_reason, logprobs, worker, len(j.emitted), j.attempts))
                        if finish is not None:
                            stream.finished = stream.finished or chunk.finish_reason is not None
                            break
            except UpstreamError as exc:
                if prefilled_on is not None and (kv_kind := self._kv_refusal(exc)) is not None:
                    # The decode worker is fine; the KV it was given is not. Try again, not as a migration.
                    kv_excluded.add(prefilled_on)
                    use_prefill = self._kv_failed(j, exc, kv_kind, prefilled_on, worker, kv_retries)
                    kv_retries += use_prefill
                    j.attempts -= 1
                    kv_retry = True
                    continue
                if exc.is_client_error and not j.emitted:
                    raise RouterError(exc.status or 400, exc.message, body=exc.body) from None
                reason = f"{exc.kind}: {exc.message}" if exc.kind != "aborted" else exc.message
                self.metrics.upstream_errors.labels(exc.kind).inc()
                log.info("request %s: attempt %d on %s failed (%s) after %d tokens", j.id, j.attempts, worker,
                         reason, len(j.emitted))
                failed.append(worker)
                # The stall the client sees runs from its last token (a hang is only noticed after the
                # worker's allowed silence), or from the failure when none came yet.
                if failed_at is None:
                    failed_at = last_token_at if last_token_at is not None else self.clock.monotonic()
            finally:
                self.metrics.tokens.inc(uncounted)
                uncounted = 0
                active.stream = None
                self.progress.finished(worker, j.id)

    # -- HTTP (the app and API keys: migration/http.py) ---------------------------------------------------

    @property
    def accepting(self) -> bool:
        """Serving requests: started, and not shutting down."""
        return self._accepting

    def app(self) -> FastAPI:
        from fleetward.migration.http import router_app

        return router_app(self)

    async def relay(self, route: Route, request: Request) -> Response:
        """Any other vLLM endpoint: passed through to a worker (:mod:`~fleetward.migration.passthrough`)."""
        if not self._accepting:
            self.metrics.requests.labels(route.label, "unavailable").inc()
            return RouterError(503, "router is starting or shutting down", retry_after=1).response()
        return self._shed(route.label) or await self.passthrough.handle(route, request)

    def _shed(self, endpoint: str) -> Response | None:
        """The 503 for a new request when the router holds ``routing.max_in_flight`` already, else None."""
        held = len(self.active) + sum(self.passthrough.load().values())
        if held < self.config.max_in_flight:
            return None
        self.metrics.shed.labels("in_flight").inc()
        self.metrics.requests.labels(endpoint, "shed").inc()
        return RouterError(503, f"this router holds {held} requests, its limit (routing.max_in_flight); retry "
                           "shortly or on another router", retry_after=1).response()

    async def handle(self, request: Request, kind: Kind, *, owner: str | None) -> Response:
        """A generation request; ``owner`` is the name of the API key it came with (None: no keys), and only
        a request with the same key may resume it."""
        endpoint = kind.value
        if not self._accepting:
            self.metrics.requests.labels(endpoint, "unavailable").inc()
            return RouterError(503, "router is starting or shutting down", retry_after=1).response()
        raw = await request.body()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            self.metrics.requests.labels(endpoint, "bad_request").inc()
            return RouterError(400, f"malformed JSON body: {exc}").response()
        try:
            validate_body(body, kind)
        except RequestRefused as exc:
            self.metrics.requests.labels(endpoint, "bad_request").inc()
            return RouterError(exc.status, exc.message, param=exc.param).response()

        last_event = request.headers.get("last-event-id")
        skip = 0
        if last_event:
            try:
                j, skip = await self._resume(last_event, kind, owner)
            except RouterError as exc:
                self.metrics.requests.labels(endpoint, "resume_failed").inc()
                return exc.response()
        else:
            shed = self._shed(endpoint)
            if shed is not None:
                return shed
            j = Journal(id=new_request_id(kind), kind=kind, body=body, created=self.clock.wall(),
                        deadline=self.clock.wall() + self.config.request_timeout_s, owner=owner)
            self.active[j.id] = Active(j)
            self.metrics.received.labels(endpoint).inc()
            if self.config.checkpoints:
                self.checkpointer.track(j)
        self.metrics.in_flight.set(len(self.active))
        if j.body.get("stream"):
            ids = self.config.event_ids or request.headers.get("x-fleetward-event-ids") == "1"
            return await self._stream(j, skip, trace=request.headers.get("x-fleetward-trace") == "1", ids=ids)
        return await self._complete(j, request)

    async def _resume(self, last_event: str, kind: Kind, owner: str | None) -> tuple[Journal, int]:
        """The request ``Last-Event-ID`` names, taken over by this stream. Another key's request is unknown
        here (404, as for a wrong id: its existence is not revealed), and its stream is left alone."""
        rid, _, n = last_event.rpartition(":")
        if not rid or not n.isdigit():
            raise RouterError(400, f"Last-Event-ID must be <request id>:<token index>, got {last_event!r}")
        if not self.config.checkpoints:
            raise RouterError(409, "this router does not checkpoint requests (checkpoints are off)")
        unknown = RouterError(404, f"request {rid} is unknown, finished, or its checkpoint expired")

        def cannot(why: str) -> RouterError:
            return RouterError(409, f"request {rid} cannot be resumed exactly: {why}. It was left as it was; send "
                               "it again without Last-Event-ID to start over")

        a = self.active.get(rid)
        if a is not None:  # the same router still holds it (the client came back before we let go)
            if a.journal.owner != owner:
                raise unknown
            why = a.journal.resumable()
            if why is not None:  # a new attempt would be a migration it cannot have; its stream goes on
                raise cannot(why)
            for t in list(a.tasks):
                t.cancel()
            j = a.journal
            self.active[rid] = Active(j)
        else:
            try:
                claimed = await self.checkpointer.claim(rid, owner=owner)
            except NotResumable as exc:
                raise cannot(exc.why) from None
            if claimed is None:
                raise unknown
            j = claimed
            self.active[rid] = Active(j)
            self.orphans.discard(rid)
        if j.kind is not kind:
            raise RouterError(400, f"request {rid} is a {j.kind.value} request; resume it on {j.kind.path}")
        j.deadline = max(j.deadline, self.clock.wall() + 1)
        return j, int(n)

    async def _stream(self, j: Journal, skip: int, *, trace: bool = False, ids: bool = False) -> Response:
        agen = self._client_events(j, skip, trace=trace, ids=ids)
        try:
            first = await agen.__anext__()  # b"" once a worker took it: the answer is a stream from here on
        except RouterError as exc:
            self._release(j.id)
            self.metrics.requests.labels(j.kind.value, f"http_{exc.status}").inc()
            return exc.response()

        async def body() -> AsyncIterator[bytes]:
            task = asyncio.current_task()
            active = self.active.get(j.id)
            if active is not None and task is not None:
                active.tasks.add(task)
            finished = False
            try:
                if first:
                    yield first
                async for chunk in agen:
                    yield chunk
                finished = True
            finally:
                await agen.aclose()
                if active is not None and task is not None:
                    active.tasks.discard(task)
                if finished or j.is_done:
                    self._release(j.id)
                elif active is not None and self.active.get(j.id) is active:
                    # The client went away mid-stream: the upstream is cancelled (its connection closed);
                    # the checkpoint stays resumable for detached_grace_s.
                    active.detached_at = self.clock.monotonic()
                    self.metrics.requests.labels(j.kind.value, "client_disconnected").inc()

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": j.id})

    async def _client_events(self, j: Journal, skip: int, *, trace: bool = False,
                             ids: bool = False) -> AsyncGenerator[bytes, None]:
        """SSE bytes for the client: replay (on resume), then live tokens, then usage and ``[DONE]``; the
        events vLLM would send for the request (:mod:`~fleetward.migration.wire`). Before its first event,
        ``b""`` once a worker accepted the request (the response starts; later failures are in-band).

        With ``trace`` (request header ``X-Fleetward-Trace: 1``) every chunk also carries
        ``"fleetward": {"worker", "attempt"}``: which worker produced it (chaos histories use this). With
        ``ids`` every event carries ``id: <request id>:<tokens the client holds>``.
        """
        started = self.clock.monotonic()
        encoder = wire.StreamEncoder(j, ids=ids)
        opened = False  # the client has its stream's first event
        n = len(j.emitted)
        if skip < n:  # replay what the checkpoint has and the client lacks
            yield (encoder.opening() if skip == 0 else b"") + encoder.event(
                n, tokens=j.emitted[skip:], text=j.text_after(skip), finish_reason=j.finish_reason,
                stop_reason=j.stop_reason, first=skip == 0)
            opened = True
        to_skip = max(0, skip - n)  # the client has tokens the checkpoint lacks: regenerate, don't resend
        gen = self.batches(j)
        # What the client holds so far. Ids come from each chunk's own count (``Out.n``), never from the
        # journal, which the upstream reader may already have advanced past what this event carries.
        delivered = max(skip, n)
        first_at, first_n = 0.0, -1  # when and at which count this stream's first token went out
        signalled = opened
        try:
            async for batch in gen:
                parts: list[bytes] = []  # the batch's events, written to the client at once
                for out in batch:
                    if out is None:
                        if not signalled:
                            signalled = True
                            yield b""
                        continue
                    tokens, text = out.tokens, out.text
                    if to_skip:
                        dropped = min(to_skip, len(tokens))
                        to_skip -= dropped
                        tokens = tokens[dropped:]
                        if dropped:  # the client has these tokens' text too: only what the rest add is new
                            ends = j.text_ends
                            text = j.text[ends[out.n - len(tokens) - 1]:ends[out.n - 1]] if tokens else ""
                        if not tokens and out.finish_reason is None:
                            continue
                    if first_n < 0 and tokens:  # this stream's first tokens (chat or completion)
                        first_at, first_n = self.clock.monotonic(), out.n
                        if out.n == len(tokens):  # and the request's first: not a resume's
                            self.metrics.ttft.labels(j.model).observe(first_at - started)
                    first = not opened and delivered == 0
                    if first:
                        parts.append(encoder.opening())
                    extra = {"fleetward": {"worker": out.worker, "attempt": out.attempt}} if trace else None
                    parts.append(encoder.event(out.n, tokens=tokens, text=text, finish_reason=out.finish_reason,
                                               stop_reason=out.stop_reason, logprobs=out.logprobs, first=first,
                                               extra=extra))
                    delivered = out.n
                    opened = signalled = True
                if parts:
                    yield parts[0] if len(parts) == 1 else b"".join(parts)
        except RouterError as exc:
            if not signalled:
                raise
            self.metrics.requests.labels(j.kind.value, f"failed_{exc.status}").inc()
            yield encoder.error(delivered, exc.status, exc.message)
            yield wire.DONE
            return
        finally:
            await gen.aclose()
        if j.wants_usage:  # in a stream: stream_options.include_usage
            yield encoder.wrap(delivered, wire.usage_chunk(j))
        if first_n >= 0 and delivered > first_n:
            self.metrics.itl.labels(j.model).observe(
                (self.clock.monotonic() - first_at) / (delivered - first_n))
        self.metrics.requests.labels(j.kind.value, "ok").inc()
        yield wire.DONE

    async def _complete(self, j: Journal, request: Request) -> Response:
        """A non-streamed request: generated through the same resumable stream, answered at the end.

        If the client goes away first, the generation is cancelled (its upstream connection closes, so the
        worker stops too) rather than run to the end for nobody.
        """
        active = self.active[j.id]

        async def run() -> None:
            async for _ in self.generate(j):
                pass

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.create_task(run(), name=f"complete-{j.id}")
        watch = asyncio.create_task(disconnected(), name=f"watch-{j.id}")
        active.tasks.add(work)
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                self.metrics.requests.labels(j.kind.value, "client_disconnected").inc()
                return Response(status_code=499)
            work.result()
        except RouterError as exc:
            self.metrics.requests.labels(j.kind.value, f"http_{exc.status}").inc()
            return exc.response()
        except asyncio.CancelledError:
            if work.cancelled():  # another replica claimed the request (see _on_lost)
                return RouterError(409, f"request {j.id} continues on another router").response()
            raise
        finally:
            watch.cancel()
            active.tasks.discard(work)
            self._release(j.id)
        self.metrics.requests.labels(j.kind.value, "ok").inc()
        return JSONResponse(wire.final_response(j), headers={"X-Request-Id": j.id})
