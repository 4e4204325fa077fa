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

The control API (bearer token: operators and the autoscaler) and the live fleet page are its HTTP side, in
:mod:`fleetward.supervisor.api`: commands go to the leader's machine through :meth:`Controller.submit`, and a
new worker is asked for with :meth:`Controller.issue_start`. A standby answers 409 with the leader's address.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import orjson
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fleetward.fleet.bus import EVENT_KINDS, FAULT_FAMILIES, EventBus
from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.config import Access, SupervisorConfig
from fleetward.fleet.election import Election, LeaderElected, Leadership, LeadershipLost, lead_forever
from fleetward.fleet.errors import StoreError
from fleetward.fleet.etcd import Compare, Delete, Put, StateStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.lease import LeaseKeeper
from fleetward.fleet.loops import LoopMetrics, Loops
from fleetward.fleet.moveorders import MoveOrderRecord
from fleetward.fleet.registry import read_leader
from fleetward.fleet.signing import ActionSigner
from fleetward.fleet.telemetry import link_gauges
from fleetward.fleet.worker import HealthRecord, HealthState, WorkerRecord
from fleetward.supervisor.api import build_app
from fleetward.supervisor.detectors import (
    Detector,
    EngineActivity,
    EngineProgress,
    GoldenBook,
    MetricsDetector,
    StreamProgressDetector,
    golden_key,
    parse_prometheus,
    weigh_computing,
)
from fleetward.supervisor.fleetpage import Timeline
from fleetward.supervisor.health import (
    ActionDone,
    AgentAction,
    CanaryDone,
    Deregistered,
    Event,
    Forget,
    GivenUp,
    HealthMachine,
    HealthPolicy,
    LiftQuarantine,
    Load,
    MoveStreams,
    Publish,
    Quarantine,
    Registered,
    RunCanary,
    SetHealth,
    SignalSeen,
    Tick,
)
from fleetward.supervisor.signals import Severity, Signal

__all__ = ["Controller", "LeadershipLost"]

log = logging.getLogger(__name__)

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
        self.canaries = Counter("fleetward_supervisor_canaries", "Canaries by result (ok, wrong, failed; unreachable: "
                                "no TCP connection to the worker, inconclusive: the controller's own loop ran late, "
                                "busy: unanswered while the worker's engine computed tokens; none of these three "
                                "says the worker is broken).", ["result"],
                                registry=r)
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


class Controller(LeaderElected):
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
                                   drain_move_s=config.drain_move_s,
                                   restart_budget=config.restart_budget, restart_window_s=config.restart_window_s,
                                   backoff_initial_s=config.backoff_initial_s, backoff_max_s=config.backoff_max_s)
        self.machine: HealthMachine | None = None
        self.metrics = _Metrics()
        self.leadership = Leadership(is_leader=self.metrics.leader, changes=self.metrics.leaderships)
        link_gauges(self.metrics.registry, store=store, bus=bus)
        self.workers: dict[str, WorkerRecord] = {}
        self.routers: dict[str, str] = {}
        self.progress = StreamProgressDetector(clock=clock)
        self.metrics_detector = MetricsDetector(clock=clock, frozen_after_s=config.metrics_frozen_after_s)
        self.golden = GoldenBook(quorum=config.golden_quorum)
        self.detectors: tuple[Detector, ...] = (self.progress, self.metrics_detector)
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        # The canaries under way, one per worker at most: owned by ``_loops`` (a failure logged, done ones dropped).
        self._canaries: dict[str, asyncio.Task[None]] = {}
        self._loops = Loops(service="controller", metrics=LoopMetrics(self.metrics.registry), clock=clock).start()
        self._last_canary: dict[str, float] = {}
        self._canary_done: dict[str, float] = {}
        self._busy_deadline: dict[str, float] = {}  # worker -> the deadline its last canary had, when that one was busy
        self._computing: dict[str, float] = {}  # worker -> since when (wall) its agent sees its engine compute
        self._signal_revision: dict[str, int] = {}  # signals/ key -> mod revision already submitted
        self._onset: dict[str, float] = {}  # worker -> wall time of the first evidence of its current failure
        self.timeline = Timeline()
        # aiohttp, not httpx: with a connection per worker, httpx's pool scans every connection on each request
        # (two thirds of the controller's CPU at 1,000 workers, see docs/benchmarks.md); aiohttp keys by origin.
        self._http: aiohttp.ClientSession | None = None
        self._fresh_http: aiohttp.ClientSession | None = None  # canaries: a connection of their own each
        self.on_action: Callable[[Any], None] | None = None  # tests and benchmarks observe decisions

    async def run(self) -> None:
        """Campaign, lead until leadership is lost, campaign again; until cancelled."""

        def leading(election: Election) -> None:
            log.info("controller %s leads cluster %s", self.id, self.keys.cluster)

        def stepped_down() -> None:
            for t in self._canaries.values():
                t.cancel()
            self._canaries.clear()

        self._loops.run("events", self._follow_events)
        try:
            await lead_forever(self.store, self.keys.leader("supervisor"), name=f"controller {self.id}",
                               candidate=json.dumps({"id": self.id, "url": self.url}), ttl_s=self.config.lease_ttl_s,
                               lead=self._lead, leadership=self.leadership, on_leading=leading,
                               on_stepped_down=stepped_down, clock=self.clock)
        finally:
            await self._loops.aclose()
            for session in (self._http, self._fresh_http):
                if session is not None:
                    await session.close()

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
            last = self.workers.pop(wid, None)
            for detector in self.detectors:
                detector.forget(wid)
            self._busy_deadline.pop(wid, None)
            self._computing.pop(wid, None)
            # A server given up (its attach/ entry deleted before its agent deregistered it) leaves no record;
            # any other worker that vanished is dead until it comes back.
            given_up = (last is not None and last.backend == "external"
                        and await self.store.get(self.keys.attached(wid)) is None)
            self.submit(GivenUp(wid) if given_up else Deregistered(wid))
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
        if sig.detector == EngineActivity.name:  # evidence for canaries to weigh, not a verdict for the machine
            log.debug("worker %s: %s", sig.worker, sig.reason)
            if sig.extra.get("computing"):
                self._computing[sig.worker] = float(sig.extra.get("since") or sig.ts)
            else:
                self._computing.pop(sig.worker, None)
            return
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

    def _term(self) -> int:
        """The election revision this leader writes under (its fence): a history shows whose term each action was."""
        return self.election.create_revision if self.election is not None else 0

    def _signed(self, action: dict[str, Any]) -> dict[str, Any]:
        """An agent action with the leader's signature (fleet/signing.py), when there is an admin token."""
        return self._signer.sign(action) if self._signer is not None else action

    async def issue_start(self, worker: str, node: str, *, role: str, reason: str) -> bool:
        """Write the action that starts a new worker on ``node`` (fenced, create-only per id, signed); False when
        it was asked for already."""
        action_id = f"{worker}.start"
        key = self.keys.action(node, action_id)
        action = {"id": action_id, "worker": worker, "node": node, "kind": "start", "role": role, "delay_s": 0.0,
                  "reason": reason, "status": "pending", "issued_by": self.id, "term": self._term(),
                  "issued_at": self.clock.wall()}
        created = await self._fenced([Compare(key, "create", "==", 0)], [Put(key, orjson.dumps(self._signed(action)))])
        if created:
            self.metrics.actions.labels("start").inc()
        return created

    async def order_move(self, trigger: str, *, request: str | None = None, source: str | None = None,
                         to: str | None = None) -> str:
        """Write a ``moves/<id>`` order for the routers (fenced; it lives for a minute): move ``request``, or
        every stream on ``source``, with its KV (:mod:`fleetward.migration.moves`). Returns its id."""
        order = MoveOrderRecord(trigger, request, source, to, issued_by=self.id, issued_at=self.clock.wall())
        order_id = order.new_id()
        lease = await self.store.grant(60)
        await self._fenced([], [Put(self.keys.move(order_id), order.to_json(), lease)])
        log.info("move order %s: %s%s", order_id, f"request {request}" if request else f"every stream off {source}",
                 f" to {to}" if to else "")
        return order_id

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
                case Forget():
                    await self._fenced([], [Delete(self.keys.health_of(action.worker))])
                    log.info("worker %s: given up, its record deleted", action.worker)
                case RunCanary():
                    self._start_canary(action.worker, urgent=action.urgent)
                case AgentAction():
                    body = {"id": action.action_id, "worker": action.worker, "node": action.node,
                            "kind": action.kind, "delay_s": action.delay_s, "reason": action.reason,
                            "status": "pending", "issued_by": self.id, "term": self._term(),
                            "issued_at": self.clock.wall()}
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
                case MoveStreams():
                    await self.order_move(action.trigger, source=action.worker)
                case Publish():
                    if action.kind == "hang.detected":
                        self.metrics.hangs.inc()
                    await self.bus.publish(action.kind, **action.data)

    # -- detectors that run here ------------------------------------------------------------------------

    async def read_progress(self) -> bool:
        """Ask every router for its streams' progress now (``progress``: in flight and silent per worker); whether
        every router that published an address answered (only then is a count of 0 in flight known)."""
        async def one(rid: str, url: str) -> None:
            try:
                status, body = await self.fetch("GET", f"{url}/fleetward/v1/progress", timeout=1.0)
                if status == 200:
                    self.progress.observe(rid, orjson.loads(body))
            except (*_HTTP_ERRORS, ValueError):
                pass  # a router that does not answer ages out of the view

        asked = self.clock.monotonic()
        polled = [(rid, url) for rid, url in self.routers.items() if url]
        await asyncio.gather(*(one(rid, url) for rid, url in polled))
        return self.progress.answered([rid for rid, _ in polled], since=asked)

    @staticmethod
    def load_of(worker: str, in_flight: int, known: bool) -> Load:
        """What the routers say runs on ``worker``; while one of them has not answered, at least one request (a
        drain ends only once every router said nothing runs there)."""
        return Load(worker, in_flight if known else max(in_flight, 1))

    async def _poll_progress(self) -> None:
        while True:
            await self.clock.sleep(self.config.progress_interval_s)
            known = await self.read_progress()
            for sig in self.progress.check():
                self.metrics.signals.labels(sig.detector, sig.severity.value).inc()
                self.submit(SignalSeen(sig))
            if self.machine is not None:
                for wid, ws in self.machine.workers.items():
                    if ws.state is HealthState.DRAINING:
                        self.submit(self.load_of(wid, self.progress.in_flight(wid), known))

    async def _scrape_metrics(self) -> None:
        limit = asyncio.Semaphore(32)
        while True:
            await self.clock.sleep(self.config.metrics_interval_s)

            async def one(wid: str, url: str) -> None:
                async with limit:
                    metrics, error = await self._read_counters(url, timeout=2.0)
                    signals = (self.metrics_detector.scraped(wid, metrics, computing_s=self._computing_bound(wid))
                               if metrics is not None else self.metrics_detector.failed(wid, error))
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
        self._canaries[worker] = self._loops.spawn(f"canary-{worker}", self._canary(worker, urgent))

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
        ws = self.machine.workers.get(worker) if self.machine is not None else None
        if worker in self._busy_deadline and ws is not None and ws.state is HealthState.STARTING:
            # A starting worker is ready only once a canary is answered, and its last one waited behind the engine's
            # work (a server adopted under load): this one waits twice as long, up to canary_busy_max_s. A ready
            # or suspect worker's do not: a busy canary keeps it ready, and a long deadline would hold up the
            # urgent canary that confirms a hang (one canary per worker at a time).
            deadline = max(deadline, min(self.config.canary_busy_max_s, 2 * self._busy_deadline[worker]))
        # The worker's token counters as the canary leaves (unless just read): if it goes unanswered, a reading
        # then says whether the engine computed meanwhile, i.e. whether the canary waited behind work.
        # An urgent canary's is always read afresh: a hang that began after the last reading would otherwise
        # look like tokens computed while the canary waited (the engine's last steps before it).
        last = self.metrics_detector.last(worker)
        recent = last if not urgent and last is not None and self.clock.monotonic() - last[1] <= 1.0 else None
        baseline = asyncio.create_task(self._record_counters(worker, rec.url)) if recent is None else None
        try:
            # A routine canary with the deadline of an idle engine is watched one deadline more (one step may
            # outlast it); a longer deadline, the engine's own measure, or an urgent canary, is not.
            watch_s = 0.0 if urgent or deadline > self.config.canary_timeout_s else deadline
            await self._canary_measure(worker, rec, deadline, recent or baseline, watch_s=watch_s)
        finally:
            if baseline is not None and not baseline.done():
                baseline.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await baseline

    async def _canary_measure(self, worker: str, rec: WorkerRecord, deadline: float,
                              baseline: tuple[float, float] | asyncio.Task[tuple[float, float] | None] | None,
                              *, watch_s: float) -> None:
        started, loop_started = self.clock.monotonic(), asyncio.get_running_loop().time()
        body = {"model": rec.model, "prompt": self.config.canary_prompt, "max_tokens": self.config.canary_max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        ok, reason, wrong, unreachable, inconclusive, timed_out = False, "", False, False, False, False
        try:
            async with asyncio.timeout(deadline):
                status, answer = await self.fetch("POST", f"{rec.url}/v1/completions", body=body,
                                                   timeout=deadline + 1, connect_timeout=deadline / 2, fresh=True)
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
        except aiohttp.ConnectionTimeoutError:  # first: it is a TimeoutError too
            # A hung or frozen worker's kernel still completes the handshake (its listening socket's backlog); a
            # dead one refuses. No handshake at all is the network between here and there: it says nothing of
            # the worker, and the controller never acts on a worker it cannot reach (its lease decides).
            reason = f"no TCP connection within {deadline / 2:.2f}s: the network between the controller and the worker"
            unreachable = True
        except TimeoutError:
            reason, timed_out = f"no answer within {deadline:.2f}s", True
            late = asyncio.get_running_loop().time() - loop_started - deadline
            if late > max(0.25, deadline / 4):
                # The timeout fired that late because this process's own loop did not run (a starved or paused
                # controller): the answer may sit unread in the socket. That measures the controller, not the
                # worker: ask again rather than call a loaded worker hung.
                reason += f", but the controller's own loop ran {late:.2f}s late: that says nothing of the worker"
                inconclusive = True
        except (*_HTTP_ERRORS, ValueError, KeyError, IndexError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        progress = (await self._engine_progress(worker, rec.url, baseline, watch_s=watch_s)
                    if timed_out and not inconclusive else None)
        busy = progress is not None and progress.busy
        evidence = progress.describe() if progress is not None else ""
        if progress is not None and not busy and self._computing_bound(worker):
            busy, evidence = weigh_computing(progress, self.clock.wall() - self._computing[worker],
                                             self.metrics_detector.still_for(worker), self.config.canary_busy_max_s)
        self._busy_deadline.pop(worker, None)
        if busy:
            self._busy_deadline[worker] = deadline
            log.debug("worker %s: canary %s, busy: %s", worker, reason, evidence)
        self.metrics.canaries.labels("ok" if ok else "wrong" if wrong else "unreachable" if unreachable
                                     else "inconclusive" if inconclusive else "busy" if busy else "failed").inc()
        if not (ok or unreachable or inconclusive or busy) and self.machine is not None:  # sent into the failure
            self._first_evidence(self.machine, worker, self.clock.wall() - (self.clock.monotonic() - started))
        self.submit(CanaryDone(worker, ok, reason, wrong_tokens=wrong, silent=self.progress.silent(worker),
                               unreachable=unreachable, inconclusive=inconclusive, busy=busy, evidence=evidence))

    def _computing_bound(self, worker: str) -> float:
        """How long ``worker``'s token counters may stand still as one long step: ``canary_busy_max_s`` while its
        node agent sees its engine compute, unless the routers see its streams stall (their silence past an
        allowance that knows the prompts is evidence of its own: a GPU hang that spins a core is not waited on);
        else 0."""
        if worker not in self._computing or self.progress.silent(worker) is True:
            return 0.0
        return self.config.canary_busy_max_s

    async def _engine_progress(self, worker: str, url: str,
                               baseline: tuple[float, float] | asyncio.Task[tuple[float, float] | None] | None,
                               *, watch_s: float) -> EngineProgress | None:
        """A canary went unanswered: what the worker's own counters say the engine did since it left, read now
        against ``baseline``: the reading as it left (tokens, when), or the task taking it. One engine step may
        outlast the canary's deadline, so counters that stood still while requests run are watched ``watch_s``
        longer (a routine canary's deadline; an urgent one's verdict waits for nothing). None when they cannot
        be read (no /metrics, or it does not answer either)."""
        left = await baseline if isinstance(baseline, asyncio.Task) else baseline  # bounded by its own timeout
        if left is None:
            return None
        now, _ = await self._read_counters(url)
        progress = self.metrics_detector.progress(worker, now, left) if now is not None else None
        if progress is not None and watch_s and not progress.busy and progress.running:
            await self.clock.sleep(watch_s)
            now, _ = await self._read_counters(url)
            progress = self.metrics_detector.progress(worker, now, left) if now is not None else None
        return progress

    async def _record_counters(self, worker: str, url: str) -> tuple[float, float] | None:
        """Read the worker's counters now and keep the reading: its tokens and when (None: not readable)."""
        now, _ = await self._read_counters(url)
        return self.metrics_detector.record(worker, now) if now is not None else None

    async def _read_counters(self, url: str, *, timeout: float = 1.0) -> tuple[dict[str, float] | None, str]:
        """The worker's engine counters from its /metrics (requests running and waiting, tokens prefilled and
        generated), or None and why they could not be read."""
        try:
            status, body = await self.fetch("GET", f"{url}/metrics", timeout=timeout)
        except _HTTP_ERRORS as exc:
            return None, f"{type(exc).__name__}: {exc}"
        if status != 200:
            return None, f"HTTP {status}"
        return parse_prometheus(body.decode(errors="replace"), MetricsDetector.wanted), ""

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
                    status, answer = await self.fetch("POST", f"{rec.url}/v1/completions", body=body,
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

    async def fetch(self, method: str, url: str, *, timeout: float, body: Any = None,
                    connect_timeout: float | None = None, fresh: bool = False) -> tuple[int, bytes]:
        """One HTTP request to a worker or router: its status and body. ``fresh``: on a connection of its own, made
        for it (a canary: whether a connection can be made at all is part of the answer), within
        ``connect_timeout`` (:class:`aiohttp.ConnectionTimeoutError`)."""
        if self._http is None:
            self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256, limit_per_host=8),
                                               json_serialize=lambda o: orjson.dumps(o).decode())
        if fresh and self._fresh_http is None:  # never pooled: every request makes its connection
            self._fresh_http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=256),
                                                     json_serialize=lambda o: orjson.dumps(o).decode())
        session = self._fresh_http if fresh and self._fresh_http is not None else self._http
        timeouts = aiohttp.ClientTimeout(total=timeout, sock_connect=connect_timeout)
        async with session.request(method, url, json=body, timeout=timeouts) as r:
            return r.status, await r.read()

    # -- the control API and the fleet page (supervisor/api.py) ---------------------------------------------

    def app(self) -> FastAPI:
        """The control API and the live fleet page (:func:`~fleetward.supervisor.api.build_app`)."""
        return build_app(self)


async def serve_controller(config: SupervisorConfig, *, etcd: str, mqtt: str, cluster: str, admin_token: str,
                           controller_id: str | None = None,
                           on_ready: Callable[[Controller], None] | None = None,
                           etcd_access: Access | None = None, mqtt_access: Access | None = None) -> None:
    """Run a controller process: campaign and lead, control API on ``config.port``, until SIGTERM."""
    from fleetward.fleet.bus import MqttBus
    from fleetward.fleet.etcd import EtcdStore
    from fleetward.fleet.launch import serve_app
    from fleetward.fleet.procs import listening_socket

    sock = listening_socket(config.host, config.port, name="supervisor controller")  # before it is advertised
    port = sock.getsockname()[1]
    store = EtcdStore(etcd, access=etcd_access)
    await store.get(Keys(cluster).root)
    bus = await MqttBus(mqtt, cluster, access=mqtt_access).start()
    controller = Controller(config, store=store, bus=bus, keys=Keys(cluster), controller_id=controller_id,
                            url=f"http://{config.host}:{port}", admin_token=admin_token)

    try:
        await serve_app(controller.app(), sock=sock, main=controller.run, name="controller",
                        on_ready=None if on_ready is None else lambda: on_ready(controller))
    finally:
        await bus.aclose()
        await store.aclose()
