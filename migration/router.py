"""The router: an OpenAI-compatible front door whose streams survive worker failures.

Request life (docs/architecture.md, "Request life and migration"): validate → journal → pick a healthy
worker → stream tokens to the client, journaling each → on failure (connect error, reset, EOF without
finish, 5xx, in-band error, worker silent past its adaptive allowance, worker turned unhealthy in etcd)
resume on another worker from prompt + emitted tokens, up to ``migration_limit`` times within the
request's deadline. Journals are checkpointed
to etcd by :class:`~fleetward.migration.checkpoint.Checkpointer`; a client that lost its connection (or
its router) reconnects to any replica with ``Last-Event-ID`` and continues from the checkpoint.

:class:`Router` holds the requests in flight, the attempt loop (:meth:`Router.relay`; the tokens go by
callbacks, :mod:`.relay`) and the router's
reactions to the fleet (workers that die, turn unhealthy or go silent have their streams moved). Beside it:

- :mod:`.serving`: what an HTTP request becomes (validation, admission, resume, the SSE stream or the whole
  answer); :mod:`.http`: the routes and API keys; :mod:`.openapi`: the spec;
- :mod:`.prefill`: the prefill step of prefill/decode (docs/pd.md);
- :mod:`.registration`: the router's record in etcd, under a lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import uuid
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from fleetward.fleet.bus import EventBus
from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.config import RouterConfig
from fleetward.fleet.errors import ConfigError
from fleetward.fleet.etcd import StateStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.loops import LoopMetrics, Loops
from fleetward.fleet.registry import FleetView
from fleetward.fleet.telemetry import link_gauges
from fleetward.fleet.worker import HealthState
from fleetward.migration.adapters import Adapters
from fleetward.migration.budget import RetryBudget, throttled_kind
from fleetward.migration.checkpoint import Checkpointer
from fleetward.migration.journal import Journal
from fleetward.migration.metrics import RouterMetrics
from fleetward.migration.moves import MoveOrder, Moves
from fleetward.migration.passthrough import Passthrough
from fleetward.migration.placement import Placement
from fleetward.migration.poison import body_digest, broke_under, named, poison_error
from fleetward.migration.policy import RoutingPolicy, make_policy, prefix_key
from fleetward.migration.prefill import KvTries, Prefill
from fleetward.migration.progress import ProgressModel
from fleetward.migration.registration import Registration
from fleetward.migration.relay import Output, Relay
from fleetward.migration.replicas import PeerLink, Replicas
from fleetward.migration.text import TextSources
from fleetward.migration.upstream import Upstream, UpstreamError, UpstreamStream
from fleetward.migration.wire import RouterError

__all__ = ["Active", "Router", "RouterError"]

log = logging.getLogger(__name__)

# Health states in which a worker's open streams are moved elsewhere at once.
_EVACUATE = {HealthState.UNHEALTHY, HealthState.DEAD, HealthState.RESTARTING, HealthState.QUARANTINED}


@dataclass
class Active:
    journal: Journal
    worker: str | None = None
    stream: UpstreamStream | None = None
    detached_at: float | None = None
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    move: MoveOrder | None = None  # a planned move about to stop its stream (.moves)


@dataclass(slots=True)
class _Tries:
    """One request's attempts so far: what the attempt loop carries from one attempt to the next."""

    failed: list[str] = field(default_factory=list)  # the workers it failed on, in order
    reason: str = ""  # why the last attempt failed
    opened: bool = False  # an upstream accepted it (``emit(None)`` went out)
    failed_at: float | None = None  # when the client got its last token before the current failure
    last_token_at: float | None = None
    kv: KvTries = field(default_factory=KvTries)
    move: MoveOrder | None = None  # the planned move under way (.moves): from its stop to its next first token
    planned: int = 0  # planned moves so far (they do not count against migration_limit)
    broke: dict[str, str] = field(default_factory=dict)  # worker -> why, for those that failed serving it (.poison)
    throttled: int = 0  # its retries that drew on the retry budget (.budget): given back if it is served
    last: UpstreamError | None = None  # its last failure, when the retry budget is to decide the next attempt


class Router:
    def __init__(self, config: RouterConfig, *, store: StateStore, bus: EventBus, keys: Keys,
                 router_id: str | None = None, url: str = "", public_url: str | None = None,
                 clock: Clock = SYSTEM_CLOCK,
                 policy: RoutingPolicy | None = None, admin_token: str | None = None) -> None:
        self.config = config
        self.store = store
        self.bus = bus
        self.keys = keys
        self.id = router_id or f"router-{uuid.uuid4().hex[:8]}"
        self.url = url  # this process's own address (registered: metrics, stream progress)
        self.public_url = public_url or url  # where clients reach it (shared by the processes of a group)
        self.clock = clock
        self.policy = policy or make_policy(config.policy, slack=config.affinity_slack)
        # A store that was away lets every lease lapse at once, the workers' with the rest: what vanished while
        # this router could not reach it is kept until written again or seen failing (FleetView's hold).
        self.view = FleetView(store, keys, on_change=self._on_fleet_change, hold=self._store_was_away,
                              hold_s=config.store_outage_hold_s, clock=clock)
        self.upstream = Upstream()
        self.progress = ProgressModel(clock=clock, floor_s=config.stall_floor_s,
                                      itl_multiplier=config.itl_multiplier,
                                      prefill_s_per_token=config.prefill_s_per_token)
        self.checkpointer = Checkpointer(store, keys, self.id, interval_s=config.checkpoint_interval_ms / 1000,
                                         ttl_s=config.checkpoint_ttl_s, incremental=config.checkpoint_incremental,
                                         clock=clock, on_lost=self._on_lost)
        self.checkpointer.enabled = config.checkpoints
        if config.checkpoints and config.checkpoint_store == "peers":
            if not admin_token:
                raise ConfigError("checkpoints kept with peers need the admin token (FLEETWARD_ADMIN_TOKEN): routers "
                                  "authenticate each other's copies with it", field="routing.checkpoint_store")
            self.checkpointer.replicas = Replicas(clock=clock)
            self.checkpointer.peers = PeerLink(lambda: self.upstream.session, admin_token, self.id,
                                               lambda: self.view.fleet.routers, shun_s=config.lease_ttl_s,
                                               clock=clock)
        self.admin_token = admin_token if self.replicas is not None else None
        self.registration = Registration(store, keys, self.id, url=self.url, public_url=self.public_url,
                                         ttl_s=config.lease_ttl_s, checkpointer=self.checkpointer, clock=clock)
        self.active: dict[str, Active] = {}
        self.metrics = RouterMetrics()
        # Read when scraped: a record held (FleetView) changes nothing the change callback hears of.
        self.metrics.workers_held.set_function(lambda: len({ident for _, ident in self.view.held}))
        link_gauges(self.metrics.registry, store=store, bus=bus)
        # Every background task of the router: its loops (restarted when they crash, counted in
        # fleetward_loop_restarts_total) and the tokenizer loads (one-off). Requests own their own tasks.
        self.loops = Loops(service="router", metrics=LoopMetrics(self.metrics.registry), clock=clock)
        self.texts = TextSources(config.tokenizers, loops=self.loops)
        self.prefill = Prefill(config, view=self.view, upstream=self.upstream, metrics=self.metrics, clock=clock)
        self.placement = Placement(config, view=self.view, progress=self.progress, policy=self.policy,
                                   relayed=lambda: self.passthrough.load())
        self.retry_budget = RetryBudget(config.retry_budget_tokens, config.retry_budget_ratio)
        self.metrics.retry_tokens.set(self.retry_budget.tokens)
        self.passthrough = Passthrough(self.placement, lambda: self.upstream.session, metrics=self.metrics,
                                       attempts=config.migration_limit + 1, budget=self.retry_budget,
                                       poison_workers=config.poison_workers, on_poison=self._poisoned)
        self.adapters = Adapters(lambda: self.upstream.session, self.placement.routable,
                                 interval_s=config.adapters_interval_s, clock=clock)
        self.placement.adapters = self.adapters
        self.moves = Moves(config.moves, active=self.active, placement=self.placement, view=self.view,
                           prefill=self.prefill, store=store, keys=keys, bus=bus, metrics=self.metrics, clock=clock,
                           router_id=self.id)
        self.metrics.checkpoint_lag.set_function(lambda: self.checkpointer.lag_s)
        self.metrics.replica_bytes.set_function(lambda: self.replicas.held_bytes if self.replicas is not None else 0)
        self.checkpointer.on_flush = self.metrics.checkpoint_flush.observe
        self.checkpointer.on_slice = self.metrics.checkpoint_slice.observe
        self._accepting = False
        self.orphans: set[str] = set()
        self.fingerprints: dict[str, str] = {}  # each worker's system_fingerprint, as its last stream sent it
        self._seen_flushes = self._seen_txns = self._seen_bytes = 0
        self._side: set[asyncio.Future[None]] = set()

    @property
    def replicas(self) -> Replicas | None:
        """The copies this router holds of its peers' checkpoints (``routing.checkpoint_store: peers``)."""
        return self.checkpointer.replicas

    # -- life -------------------------------------------------------------------------------------------

    @property
    def accepting(self) -> bool:
        """Serving requests: started, and not shutting down."""
        return self._accepting

    async def start(self) -> None:
        """Load the fleet at revision R, watch from R+1, register; serving only once the state is whole."""
        await self.upstream.start()
        if self.config.checkpoints:
            await self.checkpointer.start()
        self.loops.start()
        self._run("fleet-view", self.view.run)
        await self.view.loaded.wait()
        await self._find_orphans()
        if self.config.checkpoints:
            self._run("checkpoints", self.checkpointer.run)
        self._run("monitor", self._monitor)
        self._run("moves", self.moves.run)
        self._run("adapters", self.adapters.run)
        self._run("move-orders", self.moves.watch)
        await self.registration.start()
        self._run("registration", self.registration.run)
        # Everything loaded so far (modules, the fleet) lives as long as the process: keep it out of the
        # cyclic collector, whose full passes over it otherwise stall the loop for many milliseconds
        # under load (the p99 of inter-token latency).
        gc.freeze()
        self._accepting = True

    def _run(self, name: str, loop: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.loops.metrics.restarts.labels(self.loops.service, name)  # exported at 0 from the start
        self.loops.run(name, loop)

    async def _find_orphans(self) -> None:
        """The checkpoints of dead routers: resumable here until their lease expires."""
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
        await self.loops.aclose()
        # Keep the checkpoints of unfinished streams resumable on a replica: their lease runs out on its own.
        await self.checkpointer.aclose(revoke=not self.checkpointer.live)
        await self.registration.aclose()
        await self.upstream.aclose()
        await self.texts.aclose()

    # -- fleet ------------------------------------------------------------------------------------------

    def _store_was_away(self) -> bool:
        """Whether this router lost touch with the store within two leases' time (its own keepalives failed or
        its lease lapsed): then a worker's record that vanishes may have lapsed with it (FleetView's hold)."""
        if self.config.store_outage_hold_s <= 0:
            return False
        at = self.registration.troubled_at
        return at is not None and self.clock.monotonic() - at < 2 * self.config.lease_ttl_s

    def _on_fleet_change(self, section: str, worker: str) -> None:
        fleet = self.view.fleet
        self.metrics.workers_routable.set(len(fleet.routable()))
        seen = self.placement.seen_models
        new_models = {rec.model for rec in fleet.workers.values()} - seen
        seen.update(new_models)
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
                self.fingerprints.pop(worker, None)

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
        """Abort streams on stalled workers; forget detached requests whose clients did not come back;
        rebalance (``routing.moves.rebalance``)."""
        balanced = self.clock.monotonic()
        while True:
            await self.clock.sleep(0.05)
            self._abort_stalled()
            self._forget_detached()
            self._mirror_checkpoint_counters()
            moves = self.config.moves
            if moves.rebalance and self.clock.monotonic() - balanced >= moves.rebalance_interval_s:
                balanced = self.clock.monotonic()
                self.moves.rebalance()

    def _abort_stalled(self) -> None:
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

    def _forget_detached(self) -> None:
        now = self.clock.monotonic()
        for rid, a in list(self.active.items()):
            if a.detached_at is not None and now - a.detached_at > self.config.detached_grace_s:
                self.release(rid)

    def _mirror_checkpoint_counters(self) -> None:
        cp = self.checkpointer
        self.metrics.checkpoint_flushes.inc(cp.flushes - self._seen_flushes)
        self.metrics.checkpoint_txns.inc(cp.txns - self._seen_txns)
        self.metrics.checkpoint_bytes.inc(cp.bytes_written - self._seen_bytes)
        self._seen_flushes, self._seen_txns, self._seen_bytes = cp.flushes, cp.txns, cp.bytes_written

    def release(self, rid: str) -> None:
        """The request is over here (finished, failed, or its client gone for good): forget it."""
        a = self.active.pop(rid, None)
        if a is not None:
            self.checkpointer.done(a.journal)
            self.metrics.in_flight.set(len(self.active))

    def text_status(self, model: str) -> dict[str, Any]:
        """Where the router's text of ``model`` comes from (``/v1/models`` says it)."""
        if not self.config.detokenize:
            return {"detokenizer": "worker", "why": "routing.detokenize is off"}
        return self.texts.status(model)

    # -- generation -------------------------------------------------------------------------------------

    async def relay(self, j: Journal, out: Output) -> None:
        """The attempt loop: attempts until the journal is finished, their tokens relayed to ``out`` as they
        arrive (:mod:`.relay`); ``out.opened()`` once the first upstream accepted.

        Raises :class:`RouterError` when the request cannot be served (before ``opened``: the HTTP status to
        answer; after: the reason for the in-band error). Cancelling it closes the upstream connection.
        """
        t = _Tries()
        if j.vocab is None and self.config.detokenize:  # a LoRA adapter's text is its base model's
            j.vocab = await self.texts.get(self.adapters.base_of(j.model) or j.model)
        try:
            while not j.is_done:
                self._check_limits(j, t.reason, t.planned)
                await self._check_poison(j, t)
                self._check_budget(j, t)
                move = t.move
                worker, url, load = self._choose(j, t.failed, t.reason, move)
                path, body = j.upstream_request()
                prefilled_on: str | None = None
                if move is not None:  # a planned move: the KV comes from the worker the stream left (.moves)
                    body = await self.moves.carry(j, move, path, body)
                elif t.kv.use_prefill:
                    body, prefilled_on = await self.prefill.run(j, path, body, load, t.kv.excluded)
                await self._begin(j, worker, t)
                try:
                    await self._attempt(j, worker, url, path, body, out, t)
                except UpstreamError as exc:
                    await self._attempt_failed(j, worker, exc, t, prefilled_on)
            self.retry_budget.served(refund=t.throttled)
            self.metrics.retry_tokens.set(self.retry_budget.tokens)
        finally:
            a = self.active.get(j.id)
            if a is not None and a.move is not None:  # it ended before the move could stop it
                self.moves.release(a.move)
                a.move = None
            if t.move is not None:
                await self.moves.done(t.move, "failed", None, request=j.id)

    async def _attempt_failed(self, j: Journal, worker: str, exc: UpstreamError, t: _Tries,
                              prefilled_on: str | None) -> None:
        """Why the attempt on ``worker`` ended, and what the next one is: a planned move (stopped for it, or
        its KV refused: computed again on the same worker), a P/D retry, or a migration."""
        move, a = t.move, self.active[j.id]
        if move is not None:
            if self.moves.refused(j, move, exc, worker):
                j.attempts -= 1
                t.kv.retry = True  # the same move goes on: not another migration
                return
            t.move = None
            await self.moves.done(move, "reprefill", None, request=j.id)
        if a.move is not None:  # stopped for a planned move (another one, if the one before fell back)
            order = self.moves.stopped(a, exc)
            if order is not None:
                t.move, t.planned = order, t.planned + 1
                t.reason = f"move: {order.trigger}"
                if t.failed_at is None:
                    t.failed_at = t.last_token_at if t.last_token_at is not None else self.clock.monotonic()
                return
        # A decode worker that refused its KV is fine: tried again, not as a migration (.prefill).
        if not self.prefill.refused(j, exc, prefilled_on, worker, t.kv):
            self._failed(j, worker, exc, t)

    def _check_limits(self, j: Journal, reason: str, planned: int = 0) -> None:
        """Raises :class:`RouterError` when the request may not have another attempt: it cannot be resumed
        exactly, it used up ``migration_limit`` (``planned`` moves do not count), or its deadline passed."""
        if j.attempts > 0:
            why_not = j.resumable()
            if why_not is not None:
                self.metrics.migration_failures.labels("not_resumable").inc()
                raise RouterError(502, f"the worker failed mid-stream ({reason}) and this request cannot be "
                                  f"resumed exactly: {why_not}")
            if j.attempts - planned > self.config.migration_limit:
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

    def _check_budget(self, j: Journal, t: _Tries) -> None:
        """Raises :class:`RouterError` with the worker's own failure when it was one the retry budget throttles
        and the budget is spent (:mod:`.budget`): a fleet that fails requests is not sent each of them again."""
        exc, t.last = t.last, None
        if exc is None:
            return
        admitted = self.retry_budget.admit()
        self.metrics.retry_tokens.set(self.retry_budget.tokens)
        if admitted:
            t.throttled += 1
            return
        self.metrics.retries_refused.inc()
        log.info("request %s: not tried again (%s): the retry budget is spent", j.id, t.reason)
        body = exc.body if exc.status is not None and exc.body else None
        raise RouterError(exc.status or 503, f"{exc.message} (not tried on another worker: the fleet is failing "
                          "requests and the router's retry budget is spent)" if body is None else exc.message,
                          body=body, retry_after=self.config.retry_after_s if (exc.status or 503) == 503 else None)

    async def _check_poison(self, j: Journal, t: _Tries) -> None:
        """Raises :class:`RouterError` (500) once ``routing.poison_workers`` workers failed while serving the
        request: not sent to another, as it may be what breaks them (:mod:`.poison`); counted, logged and
        published with a hash of its body."""
        limit = self.config.poison_workers
        if not limit or len(t.broke) < limit:
            return
        digest = body_digest(j.body)
        await self._poisoned(j.id, digest, j.model, t.broke, tokens=len(j.emitted))
        raise poison_error(j.id, digest, t.broke)

    async def _poisoned(self, request: str, digest: str, model: str | None, broke: Mapping[str, str], *,
                        tokens: int = 0) -> None:
        """A request sent to no other worker (journaled, or passed through: .passthrough): counted, logged and
        published as the ``poison`` event."""
        self.metrics.migration_failures.labels("poison").inc()
        log.warning("request %s (body sha256 %s) not sent to another worker: %d failed while serving it (%s)",
                    request, digest, len(broke), named(broke))
        await self.bus.publish("poison", request=request, body_sha256=digest, worker=list(broke)[-1],
                               workers=list(broke), reasons=list(broke.values()), model=model, tokens=tokens)

    def _choose(self, j: Journal, failed: list[str], reason: str,
                move: MoveOrder | None = None) -> tuple[str, str, dict[str, int]]:
        """The worker for the next attempt, its URL, and the load it was chosen by; raises
        :class:`RouterError` when there is none (404: a model no worker ever served; 503: none can now).
        A planned ``move`` goes to the worker it names, else anywhere but the worker it leaves, else (none
        left meanwhile) back to that one, which computes only the stream's tail from the KV it holds."""
        placement = self.placement
        candidates, known = placement.candidates(j.model, failed if move is None else [*failed, move.source])
        if move is not None:
            fleet = self.view.fleet
            if move.to in candidates:
                return move.to, fleet.workers[move.to].url, placement.load()
            candidates = [w for w in candidates if w != move.source]
            if not candidates and move.source in fleet.workers:
                move.kv = False
                return move.source, fleet.workers[move.source].url, placement.load()
        if not candidates:
            if not known and not failed and placement.models() and j.model not in placement.seen_models:
                valid = ", ".join(placement.models())
                raise RouterError(404, f"The model `{j.model}` does not exist. Valid aliases: {valid}.",
                                  param="model")
            if j.attempts > 0:
                self.metrics.migration_failures.labels("no_worker").inc()
            raise RouterError(503, "no healthy worker can take this request now"
                              + (f" (last failure: {reason})" if reason else ""),
                              retry_after=self.config.retry_after_s)
        load = placement.load()
        key = None
        if self.config.affinity_tokens:
            prompt = j.prompt_ids if j.prompt_ids is not None else j.body.get("prompt") or str(
                j.body.get("messages"))
            key = prefix_key(prompt, self.config.affinity_tokens)
        worker = self.policy.choose(candidates, load, key)
        return worker, self.view.fleet.workers[worker].url, load

    async def _begin(self, j: Journal, worker: str, t: _Tries) -> None:
        """Count the attempt on ``worker``; one after a failure is a migration (published on the bus)."""
        previous = j.worker
        j.attempts += 1
        self.metrics.upstream_attempts.labels("first" if j.attempts == 1 else "move" if t.kv.retry or t.move
                                              else "retry").inc()
        j.worker = worker
        j.dirty = True
        if j.attempts > 1 and not t.kv.retry:
            j.migrations += 1
            trigger = t.reason.split(":")[0] if t.reason else "unknown"
            self.metrics.migrations.labels(trigger).inc()
            await self.bus.publish("migration", request=j.id, worker=worker, from_worker=previous,
                                   reason=t.reason, tokens=len(j.emitted), attempt=j.attempts, router=self.id)
        t.kv.retry = False

    async def _attempt(self, j: Journal, worker: str, url: str, path: str, body: dict[str, Any], out: Output,
                       t: _Tries) -> None:
        """One attempt: open the stream on ``worker`` and relay its tokens into the journal and ``out`` until
        it finishes; raises :class:`UpstreamError` when the attempt fails. The tokens go by callbacks
        (:class:`~fleetward.migration.relay.Relay`): this awaits only the attempt's end."""
        prompt_len = len(body["prompt"]) if isinstance(body.get("prompt"), list) else len(
            orjson.dumps(body.get("prompt") or body.get("messages")))
        active = self.active[j.id]
        active.worker = worker
        self.progress.dispatched(worker, j.id, prompt_len)

        def moved(stall_s: float) -> None:  # a planned move's first token on its destination
            move, t.move = t.move, None
            assert move is not None
            self._spawn(self.moves.done(move, None, stall_s, request=j.id, worker=worker))

        relay = Relay(j, worker, out, t, active, progress=self.progress, metrics=self.metrics, clock=self.clock,
                      on_moved=moved, fingerprints=self.fingerprints)
        try:
            await self.upstream.stream(url, path, body, UpstreamStream(worker, relay))
        finally:
            relay.close()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Side work the relay's callbacks start (they cannot await): held until it ends."""
        task = asyncio.ensure_future(work)
        self._side.add(task)
        task.add_done_callback(self._side.discard)

    def _failed(self, j: Journal, worker: str, exc: UpstreamError, t: _Tries) -> None:
        """The attempt on ``worker`` failed: the next goes elsewhere. A worker's refusal of the request itself
        (a 4xx, or an in-band error with a 4xx code) is the client's answer (:class:`RouterError` with the
        worker's body), never retried: another worker would refuse it too."""
        if exc.is_client_error:
            log.debug("request %s: worker %s refused it (%s %s); answered as it was", j.id, worker, exc.status,
                      exc.message)
            raise RouterError(exc.status or 400, exc.message, body=exc.body) from None
        t.reason = f"{exc.kind}: {exc.message}" if exc.kind != "aborted" else exc.message
        self.metrics.upstream_errors.labels(exc.kind).inc()
        log.info("request %s: attempt %d on %s failed (%s) after %d tokens", j.id, j.attempts, worker,
                 t.reason, len(j.emitted))
        t.failed.append(worker)
        if exc.kind in ("connect", "reset") and self.view.held:
            self.view.forget(worker)  # kept through a store outage, and now seen failing where it serves
        if broke_under(exc):
            t.broke[worker] = t.reason
        if self.retry_budget.enabled and throttled_kind(exc.kind, len(j.emitted)):
            t.last = exc  # the next attempt is the retry budget's to allow
        # The stall the client sees runs from its last token (a hang is only noticed after the worker's
        # allowed silence), or from the failure when none came yet.
        if t.failed_at is None:
            t.failed_at = t.last_token_at if t.last_token_at is not None else self.clock.monotonic()
