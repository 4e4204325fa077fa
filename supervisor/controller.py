"""The supervisor controller: one leader per cluster turns signals into health verdicts and actions.

Any number of controllers campaign in an etcd election (``leader/supervisor/``); one leads and the others
stand by. The leader:

1. reads the key space at revision R: workers, health, signals, pending actions. Its state comes from
   etcd (``health/<id>`` records carry restart history, pending actions and drains), so a standby that
   takes over continues where the old leader stopped;
2. watches ``workers/``, ``signals/`` and ``actions/`` from R+1, polls every router's stream progress,
   scrapes workers' ``/metrics``, runs canaries, and feeds all of it to the
   :class:`~fleetward.supervisor.health.HealthMachine`, one event at a time;
3. carries out the machine's actions with **fenced** writes. Every transaction includes the election's
   fence, so a deposed leader's writes fail and two controllers never both act. Remediation is written
   as ``actions/<node>/<id>`` for the node's agent. The ids are deterministic, and a create-only compare
   makes them idempotent, so nothing is done twice across a failover.

The control API (bearer token) serves operators and the autoscaler:

- ``GET /v1/workers``;
- ``POST /v1/workers/<id>/drain`` (``{"deadline_s", "then": "stop"|"restart"}``), ``.../undrain``,
  ``.../restart``;
- ``POST /v1/workers/<id>/quarantine/clear``;
- ``POST /v1/workers`` (``{"id", "node", "role", "reason"}``): start a new worker on a node (its agent
  carries it out; the autoscaler's scale-up). Idempotent per id: asking again is answered, not repeated;
- ``GET /health``, ``GET /metrics``.

Read-only, without the token: the live fleet page ``GET /`` with its feed ``GET /v1/fleet`` and the runbooks
``GET /runbooks/<name>.md`` (see :mod:`fleetward.supervisor.fleetpage`).

A standby answers 409 with the leader's address.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import re
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from fleetward.fleet.bus import EVENT_KINDS, FAULT_FAMILIES, EventBus
from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.config import ID_PATTERN, Access, SupervisorConfig
from fleetward.fleet.election import Election, LeadershipLost, lead_forever
from fleetward.fleet.errors import StoreError
from fleetward.fleet.etcd import Compare, Delete, Put, StateStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.lease import LeaseKeeper
from fleetward.fleet.registry import read_leader
from fleetward.fleet.signing import ActionSigner
from fleetward.fleet.telemetry import link_gauges
from fleetward.fleet.worker import ROLES, HealthRecord, HealthState, WorkerRecord
from fleetward.supervisor.detectors import (
    Detector,
    GoldenBook,
    MetricsDetector,
    StreamProgressDetector,
    golden_key,
    parse_prometheus,
)
from fleetward.supervisor.fleetpage import Timeline, page_html, parse_alerts, runbook_html
from fleetward.supervisor.health import (
    ActionDone,
    AgentAction,
    CanaryDone,
    Command,
    Deregistered,
    DrainRequested,
    Event,
    HealthMachine,
    HealthPolicy,
    LiftQuarantine,
    Load,
    Publish,
    Quarantine,
    QuarantineCleared,
    Registered,
    RestartRequested,
    RunCanary,
    SetHealth,
    SignalSeen,
    Tick,
    Undrain,
)
from fleetward.supervisor.signals import Severity, Signal

__all__ = ["Controller", "LeadershipLost"]

log = logging.getLogger(__name__)

_WORKER_ID = re.compile(ID_PATTERN)
_HTTP_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)


class _Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.leader = Gauge("fleetward_supervisor_is_leader", "1 while this controller leads.", registry=r)
        self.leaderships = Counter("fleetward_supervisor_leadership_changes",
                                   "Times this controller became the leader.", registry=r)
        self.transitions = Counter("fleetward_supervisor_health_transitions",
                                   "Health transitions by new state and detector.", ["state", "detector"], registry=r)
        self.signals = Counter("fleetward_supervisor_signals", "Signals seen by detector and severity.",
                               ["detector", "severity"], registry=r)
        self.canaries = Counter("fleetward_supervisor_canaries", "Canaries by result.", ["result"], registry=r)
        self.actions = Counter("fleetward_supervisor_actions", "Remediations issued to agents.", ["kind"],
                               registry=r)
        self.worker_restarts = Counter("fleetward_supervisor_worker_restarts", "Restarts issued, by worker: one "
                                       "restarted again and again is crash-looping (a series per worker).",
                                       ["worker"], registry=r)
        self.hangs = Counter("fleetward_supervisor_hangs_detected", "Silent hangs confirmed.", registry=r)
        self.failures = Counter("fleetward_supervisor_failures", "Workers found failed while serving (crashed, hung, "
                                "failing canaries): the verdict unhealthy or quarantined from ready or suspect.",
                                registry=r)
        for kind in ("restart", "stop", "selftest", "start"):  # at 0 from the start, so increase() sees the first
            self.actions.labels(kind)
        self.quarantines = Counter("fleetward_supervisor_quarantines", "Quarantines issued.", registry=r)
        self.workers = Gauge("fleetward_supervisor_workers", "Workers by health state.", ["state"], registry=r)
        self.canary_latency = Histogram("fleetward_supervisor_canary_seconds", "Canary latency (passed ones).",
                                        buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5), registry=r)
        self.detection = Histogram(
            "fleetward_supervisor_detection_seconds",
            "From a failure's first evidence (a crash seen, the last token of a stalled stream, a failing canary "
            "sent) to the verdict unhealthy or quarantined, by the detector that decided.", ["detector"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60), registry=r)
        for detector in ("process", "engine-frozen", "stream-progress", "metrics", "canary", "gpu"):
            self.detection.labels(detector)  # exported at 0 from the start, so rate() sees the first detection
        self.faults = Gauge("fleetward_chaos_faults_active",
                            "Chaos faults in effect in the cluster, by family (from the fault.start and fault.stop "
                            "events chaos runs publish).", ["family"], registry=r)
        for family in FAULT_FAMILIES:
            self.faults.labels(family).set(0)


class Controller:
    def __init__(self, config: SupervisorConfig, *, store: StateStore, bus: EventBus, keys: Keys,
                 controller_id: str | None = None, url: str = "", admin_token: str = "",
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config
        self.store = store
        self.bus = bus
        self.keys = keys
        self.id = controller_id or f"controller-{uuid.uuid4().hex[:8]}"
        self.url = url
        self.admin_token = admin_token
        self._signer = ActionSigner(admin_token) if admin_token else None
        self.clock = clock
        self.policy = HealthPolicy(recover_canaries=config.recover_canaries, suspect_timeout_s=config.suspect_timeout_s,
                                   restart_budget=config.restart_budget, restart_window_s=config.restart_window_s,
                                   backoff_initial_s=config.backoff_initial_s, backoff_max_s=config.backoff_max_s)
        self.machine: HealthMachine | None = None
        self.election: Election | None = None
        self.leading = asyncio.Event()
        self.metrics = _Metrics()
        link_gauges(self.metrics.registry, store=store, bus=bus)
        self.workers: dict[str, WorkerRecord] = {}
        self.routers: dict[str, str] = {}
        self.progress = StreamProgressDetector(clock=clock)
        self.metrics_detector = MetricsDetector(clock=clock, frozen_after_s=config.metrics_frozen_after_s)
        self.golden = GoldenBook(quorum=config.golden_quorum)
        self.detectors: tuple[Detector, ...] = (self.progress, self.metrics_detector)
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._canaries: dict[str, asyncio.Task[None]] = {}
        self._last_canary: dict[str, float] = {}
        self._canary_done: dict[str, float] = {}
        self._signal_revision: dict[str, int] = {}  # signals/ key -> mod revision already submitted
        self._onset: dict[str, float] = {}  # worker -> wall time of the first evidence of its current failure
        self.timeline = Timeline()
        self._alerts: tuple[float, list[dict[str, Any]] | None, str | None] = (-1e9, None, None)
        # aiohttp, not httpx: with a connection per worker, httpx's pool scans every connection on each request
        # (two thirds of the controller's CPU at 1,000 workers, see docs/benchmarks.md); aiohttp keys by origin.
        self._http: aiohttp.ClientSession | None = None
        self.on_action: Callable[[Any], None] | None = None  # tests and benchmarks observe decisions

    # -- election ---------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Campaign, lead until leadership is lost, campaign again; until cancelled."""

        def leading(election: Election) -> None:
            self.election = election
            log.info("controller %s leads cluster %s", self.id, self.keys.cluster)
            self.leading.set()
            self.metrics.leader.set(1)
            self.metrics.leaderships.inc()

        def stepped_down() -> None:
            self.leading.clear()
            self.metrics.leader.set(0)
            for t in self._canaries.values():
                t.cancel()
            self._canaries.clear()

        follower = asyncio.create_task(self._follow_events(), name="controller-events")
        try:
            await lead_forever(self.store, self.keys.leader("supervisor"), name=f"controller {self.id}",
                               candidate=json.dumps({"id": self.id, "url": self.url}), ttl_s=self.config.lease_ttl_s,
                               lead=self._lead, on_leading=leading, on_stepped_down=stepped_down, clock=self.clock)
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
            if self._http is not None:
                await self._http.close()

    async def _follow_events(self) -> None:
        """The cluster's events into the page's timeline, and the chaos faults in effect into their gauge."""
        async for event in self.bus.subscribe(EVENT_KINDS):
            self.timeline.add(event)
            if event.kind in ("fault.start", "fault.stop"):
                active = self.timeline.faults_by_family()
                family = str(event.data.get("family") or "unknown")
                for f in {*active, family}:
                    self.metrics.faults.labels(f).set(active.get(f, 0))

    async def leader(self) -> dict[str, Any] | None:
        leader = await read_leader(self.store, self.keys)
        return None if leader is None else leader.to_json()

    # -- leading ----------------------------------------------------------------------------------------

    async def _lead(self, lease: LeaseKeeper) -> None:
        self.machine = machine = HealthMachine(self.policy, clock=self.clock)
        self._events = asyncio.Queue()
        # The sections the leader needs, all as of one revision R (not the whole cluster prefix:
        # ``requests/`` can hold tens of MB of checkpoints, more than one gRPC response carries).
        first = await self.store.get_prefix(self.keys.workers)
        revision = first.revision
        items = list(first.items)
        for prefix in (self.keys.health, self.keys.signals, self.keys.actions, self.keys.routers):
            items += (await self.store.get_prefix(prefix, revision=revision)).items
        health: dict[str, HealthRecord] = {}
        signals: list[Signal] = []
        actions: list[dict[str, Any]] = []
        self.workers.clear()
        self.routers.clear()
        self._signal_revision.clear()
        for kv in items:
            key = kv.key
            try:
                if key.startswith(self.keys.workers):
                    self.workers[key[len(self.keys.workers):]] = WorkerRecord.from_json(kv.value)
                elif key.startswith(self.keys.health):
                    health[key[len(self.keys.health):]] = HealthRecord.from_json(kv.value)
                elif key.startswith(self.keys.signals):
                    signals.append(Signal.from_json(kv.value))
                    self._signal_revision[key[len(self.keys.signals):]] = kv.mod_revision
                elif key.startswith(self.keys.actions):
                    actions.append(orjson.loads(kv.value))
                elif key.startswith(self.keys.routers):
                    self.routers[key[len(self.keys.routers):]] = orjson.loads(kv.value).get("url", "")
            except (ValueError, KeyError) as exc:
                log.warning("ignoring malformed %s: %s", key, exc)
        for wid, rec in health.items():
            machine.load(wid, rec)
        boot: list[Event] = []
        for wid, worker in self.workers.items():
            boot.append(Registered(wid, worker.node, worker.gpus, worker.pid))
        for wid, ws in machine.workers.items():
            if wid not in self.workers and ws.state in (HealthState.READY, HealthState.SUSPECT, HealthState.STARTING):
                boot.append(Deregistered(wid))
        boot += [SignalSeen(s) for s in signals]
        boot += [self._action_event(a) for a in actions if a.get("status") in ("done", "failed")]
        for e in boot:
            await self._apply(machine.observe(e))
        # Pending actions the old leader wrote stay as they are: the agent carries them out once.
        try:
            await self._lead_tasks(machine, revision, lease)
        except ExceptionGroup as group:
            # A task lost the lead (its lease expired, a fenced write failed) or the store: the TaskGroup
            # wraps that in a group, which ``run`` must see as itself to campaign again rather than die.
            lost, other = group.split((LeadershipLost, StoreError))
            if other is not None or lost is None:
                raise
            cause: BaseException = lost
            while isinstance(cause, BaseExceptionGroup):
                cause = cause.exceptions[0]
            raise cause from None

    async def _lead_tasks(self, machine: HealthMachine, revision: int, lease: LeaseKeeper) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._brain(machine))
            tg.create_task(self._watch(self.keys.workers, revision + 1, self._on_worker))
            tg.create_task(self._watch(self.keys.signals, revision + 1, self._on_signal))
            tg.create_task(self._watch(self.keys.actions, revision + 1, self._on_action))
            tg.create_task(self._watch(self.keys.routers, revision + 1, self._on_router))
            tg.create_task(self._poll_progress())
            tg.create_task(self._scrape_metrics())
            tg.create_task(self._schedule_canaries())
            tg.create_task(self._tick())
            tg.create_task(self._prune_actions())
            tg.create_task(self._lease_watch(lease))

    async def _prune_actions(self) -> None:
        """Delete finished actions (done, failed, refused) older than ``actions_retention_s``: without it,
        ``actions/`` grows by every restart, stop and self-test the fleet ever had. Pending and claimed ones
        stay, and one changed since it was read is left for the next sweep."""
        retention = self.config.actions_retention_s
        while True:
            await self.clock.sleep(max(1.0, min(600.0, retention / 4)))
            cutoff = self.clock.wall() - retention
            for kv in (await self.store.get_prefix(self.keys.actions)).items:
                try:
                    body = orjson.loads(kv.value)
                    finished = body.get("status") in ("done", "failed", "refused")
                    old = float(body.get("done_at") or body.get("issued_at") or 0.0) < cutoff
                except (ValueError, TypeError, AttributeError):
                    continue
                if finished and old:
                    await self._fenced([Compare(kv.key, "mod", "==", kv.mod_revision)], [Delete(kv.key)])

    async def _lease_watch(self, lease: LeaseKeeper) -> None:
        await lease.lost.wait()
        raise LeadershipLost("the leadership lease expired")

    async def _brain(self, machine: HealthMachine) -> None:
        """The one consumer of events: the machine sees them strictly in order."""
        while True:
            event = await self._events.get()
            if isinstance(event, SignalSeen) and event.signal.severity in (Severity.SUSPECT, Severity.FATAL):
                sig = event.signal
                began = (sig.ts or self.clock.wall()) - float(sig.extra.get("silent_for_s") or 0.0)
                self._first_evidence(machine, sig.worker, began)
            await self._apply(machine.observe(event))
            if isinstance(event, Tick):
                counts: dict[str, int] = {}
                for st in machine.states().values():
                    counts[st.value] = counts.get(st.value, 0) + 1
                for state in HealthState:
                    self.metrics.workers.labels(state.value).set(counts.get(state.value, 0))

    def submit(self, event: Event) -> None:
        self._events.put_nowait(event)

    def _first_evidence(self, machine: HealthMachine, worker: str, wall: float) -> None:
        """Remember when a serving worker's failure was first evident (the start of its detection latency)."""
        ws = machine.workers.get(worker)
        if ws is not None and ws.state in (HealthState.READY, HealthState.SUSPECT):
            self._onset[worker] = min(wall, self._onset.get(worker, wall))

    def _verdict(self, worker: str, state: HealthState, previous: HealthState | None, detector: str) -> None:
        onset = self._onset.pop(worker, None) if state is not HealthState.SUSPECT else None
        if (state in (HealthState.UNHEALTHY, HealthState.QUARANTINED)
                and previous in (HealthState.READY, HealthState.SUSPECT)):
            self.metrics.failures.inc()
            if onset is not None:
                self.metrics.detection.labels(detector or "-").observe(max(0.0, self.clock.wall() - onset))

    async def _watch(self, prefix: str, start: int,
                     handle: Callable[[str, str, bytes, int], Awaitable[None] | None]) -> None:
        async for ev in self.store.watch_prefix(prefix, start_revision=start):
            try:
                pending = handle(ev.kind, ev.key[len(prefix):], ev.value, ev.revision)
                if pending is not None:
                    await pending
            except (ValueError, KeyError) as exc:
                log.warning("ignoring malformed %s: %s", ev.key, exc)

    async def _on_worker(self, kind: str, wid: str, value: bytes, _: int) -> None:
        if kind == "delete":
            # Each prefix has its own watch stream, so this deletion can arrive before the signal its agent wrote
            # just before it ("process exited": restart it) and turn a crash into "deregistered" (dead). Read
            # the worker's signals first: as of now they include everything written before the deletion.
            snap = await self.store.get_prefix(f"{self.keys.signals}{wid}/")
            for kv in sorted(snap.items, key=lambda kv: kv.mod_revision):
                self._on_signal("put", kv.key[len(self.keys.signals):], kv.value, kv.mod_revision)
            self.workers.pop(wid, None)
            for detector in self.detectors:
                detector.forget(wid)
            self.submit(Deregistered(wid))
            return
        rec = WorkerRecord.from_json(value)
        self.workers[wid] = rec
        self.submit(Registered(wid, rec.node, rec.gpus, rec.pid))

    def _on_signal(self, kind: str, key: str, value: bytes, revision: int) -> None:
        if kind != "put" or revision <= self._signal_revision.get(key, 0):
            return  # already seen (read ahead of its watch event by _on_worker)
        self._signal_revision[key] = revision
        sig = Signal.from_json(value)
        self.metrics.signals.labels(sig.detector, sig.severity.value).inc()
        self.submit(SignalSeen(sig))

    def _on_action(self, kind: str, _: str, value: bytes, __: int) -> None:
        if kind != "put":
            return
        body = orjson.loads(value)
        if body.get("status") in ("done", "failed"):
            self.submit(self._action_event(body))

    def _on_router(self, kind: str, rid: str, value: bytes, _: int) -> None:
        if kind == "delete":
            self.routers.pop(rid, None)
            self.progress.router_gone(rid)
        else:
            self.routers[rid] = orjson.loads(value).get("url", "")

    @staticmethod
    def _action_event(body: dict[str, Any]) -> ActionDone:
        return ActionDone(body["worker"], body["id"], body["kind"], body.get("status") == "done",
                          body.get("reason_done", ""))

    # -- carrying out the machine's decisions -----------------------------------------------------------

    async def _fenced(self, compare: list[Compare], puts: Sequence[Put | Delete]) -> bool:
        assert self.election is not None
        result = await self.store.txn([self.election.fence, *compare], puts)
        if result.succeeded:
            return True
        fenced = await self.store.txn([self.election.fence], [])
        if not fenced.succeeded:
            raise LeadershipLost("a fenced write failed: another controller leads")
        return False  # only the other comparisons failed

    def _signed(self, action: dict[str, Any]) -> dict[str, Any]:
        """An agent action with the leader's signature (fleet/signing.py), when there is an admin token."""
        return self._signer.sign(action) if self._signer is not None else action

    async def _apply(self, actions: list[Any]) -> None:
        for action in actions:
            if self.on_action is not None:
                self.on_action(action)
            match action:
                case SetHealth():
                    rec = action.record
                    await self._fenced([], [Put(self.keys.health_of(action.worker), rec.to_json())])
                    self.metrics.transitions.labels(rec.state.value, rec.detector or "-").inc()
                    self._verdict(action.worker, rec.state, action.previous, rec.detector)
                    await self.bus.publish("health.changed", worker=action.worker, state=rec.state.value,
                                           previous=action.previous.value if action.previous else None,
                                           reason=rec.reason, detector=rec.detector)
                    log.info("worker %s: %s -> %s (%s: %s)", action.worker,
                             action.previous.value if action.previous else "-", rec.state.value, rec.detector,
                             rec.reason)
                case RunCanary():
                    self._start_canary(action.worker, urgent=action.urgent)
                case AgentAction():
                    body = {"id": action.action_id, "worker": action.worker, "node": action.node,
                            "kind": action.kind, "delay_s": action.delay_s, "reason": action.reason,
                            "status": "pending", "issued_by": self.id, "issued_at": self.clock.wall()}
                    key = self.keys.action(action.node or "unknown", action.action_id)
                    created = await self._fenced([Compare(key, "create", "==", 0)],
                                                 [Put(key, orjson.dumps(self._signed(body)))])
                    if created:
                        self.metrics.actions.labels(action.kind).inc()
                        if action.kind == "restart":
                            self.metrics.worker_restarts.labels(action.worker).inc()
                case Quarantine():
                    gpus = action.gpus or (f"worker-{action.worker}",)
                    record = orjson.dumps({"worker": action.worker, "reason": action.reason,
                                           "since": self.clock.wall()})
                    await self._fenced([], [Put(self.keys.quarantine_of(action.node, g), record) for g in gpus])
                    self.metrics.quarantines.inc()
                case LiftQuarantine():
                    gpus = action.gpus or (f"worker-{action.worker}",)
                    await self._fenced([], [Delete(self.keys.quarantine_of(action.node, g)) for g in gpus])
                case Publish():
                    if action.kind == "hang.detected":
                        self.metrics.hangs.inc()
                    await self.bus.publish(action.kind, **action.data)

    # -- detectors that run here ------------------------------------------------------------------------

    async def _poll_progress(self) -> None:
        while True:
            await self.clock.sleep(self.config.progress_interval_s)
            routers = list(self.routers.items())

            async def one(rid: str, url: str) -> None:
                try:
                    status, body = await self._fetch("GET", f"{url}/fleetward/v1/progress", timeout=1.0)
                    if status == 200:
                        self.progress.observe(rid, orjson.loads(body))
                except (*_HTTP_ERRORS, ValueError):
                    pass  # a router that does not answer ages out of the view

            await asyncio.gather(*(one(rid, url) for rid, url in routers if url))
            for sig in self.progress.check():
                self.metrics.signals.labels(sig.detector, sig.severity.value).inc()
                self.submit(SignalSeen(sig))
            if self.machine is not None:
                for wid, ws in self.machine.workers.items():
                    if ws.state is HealthState.DRAINING:
                        self.submit(Load(wid, self.progress.in_flight(wid)))

    async def _scrape_metrics(self) -> None:
        limit = asyncio.Semaphore(32)
        while True:
            await self.clock.sleep(self.config.metrics_interval_s)

            async def one(wid: str, url: str) -> None:
                async with limit:
                    try:
                        status, body = await self._fetch("GET", f"{url}/metrics", timeout=2.0)
                    except _HTTP_ERRORS as exc:
                        signals = self.metrics_detector.failed(wid, f"{type(exc).__name__}: {exc}")
                    else:
                        text = body.decode(errors="replace")
                        signals = (self.metrics_detector.scraped(wid, parse_prometheus(text, MetricsDetector.wanted))
                                   if status == 200 else self.metrics_detector.failed(wid, f"HTTP {status}"))
                for sig in signals:
                    self.submit(SignalSeen(sig))

            await asyncio.gather(*(one(w, r.url) for w, r in list(self.workers.items())))

    async def _schedule_canaries(self) -> None:
        """Routine canaries for idle workers (busy ones prove themselves by emitting tokens)."""
        while True:
            await self.clock.sleep(1.0)
            if self.machine is None:
                continue
            now = self.clock.monotonic()
            for wid, ws in self.machine.workers.items():
                if ws.state is not HealthState.READY or wid not in self.workers or self.progress.in_flight(wid):
                    continue
                if now - self._last_canary.get(wid, 0.0) >= self.config.canary_interval_s:
                    self._start_canary(wid, urgent=False)

    async def _tick(self) -> None:
        while True:
            await self.clock.sleep(0.25)
            self.submit(Tick())

    def _start_canary(self, worker: str, *, urgent: bool) -> None:
        running = self._canaries.get(worker)
        if running is not None and not running.done():
            return
        self._last_canary[worker] = self.clock.monotonic()
        self._canaries[worker] = asyncio.create_task(self._canary(worker, urgent), name=f"canary-{worker}")

    async def _canary(self, worker: str, urgent: bool) -> None:
        previous = self._canary_done.get(worker)
        if previous is not None:  # back-to-back urgent canaries are spaced, never a storm
            await self.clock.sleep(max(0.0, previous + 0.2 - self.clock.monotonic()))
        try:
            await self._canary_once(worker, urgent)
        finally:
            self._canary_done[worker] = self.clock.monotonic()

    async def _canary_once(self, worker: str, urgent: bool) -> None:
        rec = self.workers.get(worker)
        if rec is None:
            return
        deadline = self.config.canary_timeout_s
        allowance = self.progress.allowance(worker)
        if urgent and allowance:
            deadline = max(0.5, min(deadline, allowance))
        started = self.clock.monotonic()
        body = {"model": rec.model, "prompt": self.config.canary_prompt, "max_tokens": self.config.canary_max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        ok, reason, wrong = False, "", False
        try:
            async with asyncio.timeout(deadline):
                status, answer = await self._fetch("POST", f"{rec.url}/v1/completions", body=body,
                                                   timeout=deadline + 1)
            if status != 200:
                reason = f"HTTP {status}: {answer[:200].decode(errors='replace')}"
            else:
                tokens = orjson.loads(answer)["choices"][0].get("token_ids") or []
                key = golden_key(rec.model, rec.engine, rec.device)
                elapsed = self.clock.monotonic() - started
                if self.golden.check(key, tokens, worker=worker) is False:
                    reason = await self._confirm_wrong(worker, key, tokens, body, deadline)
                    wrong = bool(reason)
                ok = not wrong
                if ok:
                    self.metrics.canary_latency.observe(elapsed)
        except TimeoutError:
            reason = f"no answer within {deadline:.2f}s"
        except (*_HTTP_ERRORS, ValueError, KeyError, IndexError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        self.metrics.canaries.labels("ok" if ok else ("wrong" if wrong else "failed")).inc()
        if not ok and self.machine is not None:  # the canary was sent into the failure
            self._first_evidence(self.machine, worker, self.clock.wall() - (self.clock.monotonic() - started))
        self.submit(CanaryDone(worker, ok, reason, wrong_tokens=wrong, silent=self.progress.silent(worker)))

    async def _confirm_wrong(self, worker: str, key: str, tokens: list[int], body: dict[str, Any],
                             deadline: float) -> str:
        """Why ``worker``'s canary output (other than the golden of ``key``) is wrong, or "" when it is not.

        Greedy output can change without a fault: batch composition on a loaded GPU, an engine or driver
        update the key does not see. So a mismatch is confirmed before a verdict: by a ready peer of the same
        key asked the same canary now (it gives the golden: the worker is wrong; it does not: the golden no
        longer holds and is learned again), else by the worker asked again (the golden now: a passing fault)."""
        golden = list(self.golden.golden[key])
        states = self.machine.workers if self.machine is not None else {}
        peers = [w for w, r in self.workers.items() if w != worker and golden_key(r.model, r.engine, r.device) == key
                 and (ws := states.get(w)) is not None and ws.state is HealthState.READY]
        for asked in [*peers[:1], worker]:
            rec = self.workers.get(asked)
            if rec is None:
                continue
            try:
                async with asyncio.timeout(deadline):
                    status, answer = await self._fetch("POST", f"{rec.url}/v1/completions", body=body,
                                                       timeout=deadline + 1)
                again = orjson.loads(answer)["choices"][0].get("token_ids") or [] if status == 200 else None
            except (TimeoutError, *_HTTP_ERRORS, ValueError, KeyError, IndexError):
                again = None
            if again is None:
                continue  # no answer from the peer: ask the worker itself
            if asked != worker:
                if again == golden:
                    return (f"wrong tokens: {tokens} where {key} gives {golden} (its peer {asked} gave that "
                            "just now)")
                log.warning("canary golden of %s no longer holds: %s, a ready peer of %s, gave %s too (not %s): "
                            "learning it again", key, asked, worker, again, golden)
                self.golden.forget(key)
                return ""
            if again == golden:
                return ""
            return f"wrong tokens twice: {tokens}, then {again}, where {key} gives {golden} (no peer to ask)"
        return ""

    async def _fetch(self, method: str, url: str, *, timeout: float, body: Any = None) -> tuple[int, bytes]:
        """One HTTP request to a worker or router: its status and body."""
        if self._http is None:
            self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256, limit_per_host=8),
                                               json_serialize=lambda o: orjson.dumps(o).decode())
        async with self._http.request(method, url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status, await r.read()

    # -- the fleet page's feed ----------------------------------------------------------------------------

    async def fleet_view(self) -> dict[str, Any]:
        """What the fleet page shows (read-only: worker ids, states and reasons, as ``/metrics`` and events do)."""
        machine = self.machine if self.leading.is_set() else None
        workers = []
        for wid, ws in sorted((machine.workers if machine is not None else {}).items()):
            rec = self.workers.get(wid)
            workers.append({"id": wid, "node": ws.node or (rec.node if rec else ""), "role": rec.role if rec else "",
                            "url": rec.url if rec else "", "state": ws.state.value, "detector": ws.detector,
                            "reason": ws.reason, "since": ws.since, "in_flight": self.progress.in_flight(wid),
                            "restarts": ws.restart_count})
        alerts, error = await self._alerts_now()
        return {"cluster": self.keys.cluster, "now": self.clock.wall(),
                "controller": {"id": self.id, "leading": self.leading.is_set(),
                               "leader": None if self.leading.is_set() else await self._leader_or_none()},
                "prometheus": self.config.prometheus_url, "alerts": alerts, "alerts_error": error,
                "workers": workers, "events": self.timeline.recent(),
                "faults_active": self.timeline.faults_by_family()}

    async def _leader_or_none(self) -> dict[str, Any] | None:
        try:
            return await self.leader()
        except StoreError:
            return None

    async def _alerts_now(self) -> tuple[list[dict[str, Any]] | None, str | None]:
        """Prometheus' pending and firing alerts (asked at most once a second, however many pages poll)."""
        url = self.config.prometheus_url.rstrip("/")
        if not url:
            return None, None
        at, alerts, error = self._alerts
        if self.clock.monotonic() - at < 1.0:
            return alerts, error
        try:
            status, body = await self._fetch("GET", f"{url}/api/v1/alerts", timeout=2.0)
            if status != 200:
                raise ValueError(f"HTTP {status}")
            alerts, error = parse_alerts(orjson.loads(body)), None
        except (*_HTTP_ERRORS, ValueError, TypeError, AttributeError) as exc:
            alerts, error = None, f"Prometheus at {url} did not answer: {type(exc).__name__}: {exc}"
        self._alerts = (self.clock.monotonic(), alerts, error)
        return alerts, error

    # -- control API ------------------------------------------------------------------------------------

    def app(self) -> FastAPI:
        # The OpenAPI spec (/openapi.json) describes the bodies the handlers parse themselves, and the token.
        app = FastAPI(title="fleetward supervisor", docs_url=None, redoc_url=None, openapi_url="/openapi.json")

        def authorised(request: Request) -> bool:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            return bool(self.admin_token) and scheme.lower() == "bearer" and \
                hmac.compare_digest(given.strip().encode(), self.admin_token.encode())

        async def command(request: Request, event: Command) -> Response:
            """An operator's command: applied, or refused with why (never "accepted" and then nothing)."""
            if not authorised(request):
                return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401)
            machine = self.machine
            if not self.leading.is_set() or machine is None:
                return JSONResponse({"error": "not the leader", "leader": await self.leader()}, status_code=409)
            ws = machine.workers.get(event.worker)
            if ws is None:
                known = sorted(machine.workers)
                return JSONResponse({"error": f"no worker {event.worker!r} in this cluster (workers: "
                                              f"{', '.join(known) or 'none'})", "workers": known}, status_code=404)
            why = machine.admit(event)
            if why is not None:
                return JSONResponse({"error": f"{event.worker}: {why}", "state": ws.state.value}, status_code=409)
            self.submit(event)
            return JSONResponse({"accepted": True, "leader": self.id, "state": ws.state.value,
                                 "what": _what(event, ws.state)})

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/", response_class=HTMLResponse)
        async def page() -> Response:
            return HTMLResponse(page_html(), headers={"cache-control": "no-cache"})

        @app.get("/v1/fleet")
        async def fleet() -> Response:
            return JSONResponse(await self.fleet_view(), headers={"cache-control": "no-store"})

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
            machine = self.machine if self.leading.is_set() else None
            out = {wid: ws.record().to_json().decode() for wid, ws in (machine.workers.items() if machine else [])}
            return JSONResponse({"leader": self.leading.is_set(), "id": self.id,
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
            machine = self.machine
            if not self.leading.is_set() or machine is None:
                return JSONResponse({"error": "not the leader", "leader": await self.leader()}, status_code=409)
            ws = machine.workers.get(wid)
            if ws is not None or wid in self.workers:
                state = ws.state.value if ws is not None else "registered"
                return JSONResponse({"error": f"{wid}: a worker with this id exists ({state}); `undrain` or "
                                              "`restart` brings a stopped one back", "state": state}, status_code=409)
            action_id = f"{wid}.start"
            key = self.keys.action(node, action_id)
            action = {"id": action_id, "worker": wid, "node": node, "kind": "start", "role": role, "delay_s": 0.0,
                      "reason": reason, "status": "pending", "issued_by": self.id, "issued_at": self.clock.wall()}
            created = await self._fenced([Compare(key, "create", "==", 0)],
                                         [Put(key, orjson.dumps(self._signed(action)))])
            if created:
                self.metrics.actions.labels("start").inc()
            return JSONResponse({"accepted": True, "leader": self.id, "worker": wid, "node": node, "new": created,
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
                deadline = float(body.get("deadline_s", self.config.drain_timeout_s))
                if not math.isfinite(deadline) or deadline < 0:
                    raise ValueError(f"deadline_s must be a finite number of seconds, 0 or more, not {deadline}")
                if then not in ("cordon", "stop", "restart"):
                    raise ValueError("then must be cordon, stop or restart")
            except (ValueError, TypeError) as exc:
                return JSONResponse({"error": f"bad drain request: {exc}"}, status_code=400)
            return await command(request, DrainRequested(worker, deadline, then))

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
        "then": {"type": "string", "enum": ["cordon", "stop", "restart"]}}}, required=False)


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
            return (f"draining: no new work goes to it; its open streams finish, or move to other workers after "
                    f"{deadline:g} s; {after}")
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


async def serve_controller(config: SupervisorConfig, *, etcd: str, mqtt: str, cluster: str, admin_token: str,
                           controller_id: str | None = None,
                           on_ready: Callable[[Controller], None] | None = None,
                           etcd_access: Access | None = None, mqtt_access: Access | None = None) -> None:
    """Run a controller process: campaign and lead, control API on ``config.port``, until SIGTERM."""
    from fleetward.fleet.bus import MqttBus
    from fleetward.fleet.etcd import EtcdStore
    from fleetward.fleet.launch import serve_app
    from fleetward.fleet.procs import ensure_port

    port = ensure_port(config.host, config.port, name="supervisor controller")
    store = EtcdStore(etcd, access=etcd_access)
    await store.get(Keys(cluster).root)
    bus = await MqttBus(mqtt, cluster, access=mqtt_access).start()
    controller = Controller(config, store=store, bus=bus, keys=Keys(cluster), controller_id=controller_id,
                            url=f"http://{config.host}:{port}", admin_token=admin_token)

    try:
        await serve_app(controller.app(), host=config.host, port=port, main=controller.run, name="controller",
                        on_ready=None if on_ready is None else lambda: on_ready(controller))
    finally:
        await bus.aclose()
        await store.aclose()
