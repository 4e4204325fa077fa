"""The health state machine: signals in, verdicts and actions out. Sans-IO.

States (``fleet.worker.HealthState``) and what moves a worker between them::

    starting ──canary ok──▶ ready ◀──canary ok xN── suspect
       │                      │  suspect/degraded signal ─▶│
       │ canary fails xN      │ fatal signal               │ canary fails (and the worker is silent),
       ▼                      ▼                            │ or suspicion not resolved in time
    unhealthy ◀───────────────┴────────────────────────────┘
       │ within the crash-loop budget            │ budget spent, or a GPU error that retires hardware
       ▼                                         ▼
    restarting ──agent restarted it──▶ starting  quarantined ──cleared + self-test passes──▶ restarting
       │ the backend failed to start every retry
       ▼
     dead                                        draining ──no work left / deadline──▶ dead | restarting

Hysteresis: a suspect signal (a stream stall reported by a router, a metrics freeze, throttling) makes
a worker *suspect*, still routable, and triggers a canary. Only a confirmed failure makes it unhealthy:
the canary fails while the worker is also silent. A canary that went unanswered while the worker's own
token counters moved waited behind work (a busy engine, not a hung one): it is evidence of nothing, and a
ready worker stays ready. A fatal signal acts at once: the process exited, the engine stopped, or the GPU
reported a fatal Xid. Leaving *suspect* takes ``recover_canaries`` good canaries in a row with no suspicion
left active.

Every transition is a :class:`SetHealth` action: the controller persists it to ``health/<id>`` with its
reason, detector and restart history, then publishes ``health.changed``. Remediation is an
:class:`AgentAction` (restart, stop, selftest) carried out by the worker's node agent. Its id is
deterministic (``<worker>.restart.<n>``), so a new leader that replays the same decision writes the same
action and nothing is done twice. A quarantine is written to ``quarantine/<node>/<gpu>`` (:class:`Quarantine`)
and lifted (:class:`LiftQuarantine`) once an operator cleared it and the GPU passed its self-test.

A drain whose deadline passes with streams still open first asks the routers to move them with their KV
(:class:`MoveStreams`, for ``drain_move_s``); what is still there after that is moved as after a failure
(the worker turns unhealthy), and the drain ends. It ends earlier the moment nothing is left in flight.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.worker import HealthRecord, HealthState
from fleetward.supervisor.signals import Severity, Signal

__all__ = [
    "ActionDone",
    "AgentAction",
    "CanaryDone",
    "Command",
    "Deregistered",
    "DrainRequested",
    "Forget",
    "GivenUp",
    "HealthMachine",
    "HealthPolicy",
    "LiftQuarantine",
    "Load",
    "MoveStreams",
    "Publish",
    "Quarantine",
    "QuarantineCleared",
    "Registered",
    "RestartRequested",
    "RunCanary",
    "SetHealth",
    "SignalSeen",
    "Tick",
    "Undrain",
    "WorkerState",
]

S = HealthState


# -- inputs ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Registered:
    """``workers/<id>`` was written: a worker process registered, or one already known registered again
    (its agent renewed a lost lease; a new leader reads the registry). ``pid`` tells a fresh process apart."""

    worker: str
    node: str
    gpus: tuple[int, ...] = ()
    pid: int | None = None


@dataclass(frozen=True)
class Deregistered:
    worker: str


@dataclass(frozen=True)
class GivenUp:
    """A server fleetward did not start was given up (its ``attach/`` entry deleted: ``fleetward worker remove``,
    or a Kubernetes pod's sidecar on its way out): it leaves, and no record of it stays."""

    worker: str


@dataclass(frozen=True)
class SignalSeen:
    signal: Signal


@dataclass(frozen=True)
class CanaryDone:
    worker: str
    ok: bool
    reason: str = ""
    wrong_tokens: bool = False
    silent: bool | None = None  # the routers' view right now: is the worker emitting nothing while busy?
    unreachable: bool = False  # no TCP connection could be made: the network, not evidence about the worker
    inconclusive: bool = False  # timed out while the controller's own loop ran late: not evidence either
    # Unanswered in time, what the worker's own counters said of its engine meanwhile
    # (:class:`~fleetward.supervisor.detectors.EngineProgress`): ``busy`` when it computed tokens (the canary
    # waited behind work: not evidence of a hang), else what stood still ("" when they could not be read).
    busy: bool = False
    evidence: str = ""


@dataclass(frozen=True)
class ActionDone:
    worker: str
    action_id: str
    kind: str
    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class DrainRequested:
    """An operator's drain: no new work; open streams finish, or move elsewhere after ``deadline_s``. Then
    the worker stays cordoned (``cordon``: out of routing until undrained), or is stopped, or restarted."""

    worker: str
    deadline_s: float = 60.0
    then: Literal["cordon", "stop", "restart"] = "cordon"
    by: Literal["operator", "autoscaler"] = "operator"  # who asked: an autoscaler's drain is a scale-down


@dataclass(frozen=True)
class RestartRequested:
    """An operator's restart: a graceful one (drained at once, streams move, then restarted); a stopped or
    dead worker is simply started again."""

    worker: str


@dataclass(frozen=True)
class Undrain:
    worker: str


@dataclass(frozen=True)
class QuarantineCleared:
    worker: str


@dataclass(frozen=True)
class Load:
    worker: str
    in_flight: int


@dataclass(frozen=True)
class Tick:
    pass


Event = (Registered | Deregistered | GivenUp | SignalSeen | CanaryDone | ActionDone | DrainRequested | RestartRequested
         | Undrain | QuarantineCleared | Load | Tick)
Command = DrainRequested | RestartRequested | Undrain | QuarantineCleared


# -- outputs --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SetHealth:
    worker: str
    record: HealthRecord
    previous: HealthState | None


@dataclass(frozen=True)
class Forget:
    """Delete the worker's ``health/`` record: it is no longer part of the fleet."""

    worker: str


@dataclass(frozen=True)
class RunCanary:
    worker: str
    urgent: bool = False


@dataclass(frozen=True)
class AgentAction:
    worker: str
    node: str
    kind: Literal["restart", "stop", "selftest"]
    action_id: str
    delay_s: float = 0.0
    reason: str = ""


@dataclass(frozen=True)
class Quarantine:
    worker: str
    node: str
    gpus: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class LiftQuarantine:
    """The GPUs passed their self-test after an operator cleared the quarantine: back in service."""

    worker: str
    node: str
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class Publish:
    kind: str
    data: dict[str, Any]


@dataclass(frozen=True)
class MoveStreams:
    """A drain's deadline passed with streams open: the routers move them, with their KV (``moves/``)."""

    worker: str
    trigger: Literal["drain", "scale-down"]


Action = SetHealth | Forget | RunCanary | AgentAction | Quarantine | LiftQuarantine | Publish | MoveStreams


@dataclass(frozen=True)
class HealthPolicy:
    recover_canaries: int = 2  # good canaries in a row to leave suspect
    drain_move_s: float = 15.0  # after a drain's deadline: the routers' time to move its streams with their KV
    start_canary_failures: int = 5  # failed canaries of a starting worker before it is unhealthy
    suspect_timeout_s: float = 30.0  # suspicion that nothing resolves becomes unhealthy
    restart_budget: int = 3  # restarts allowed within the window; one more is a crash loop
    restart_window_s: float = 600.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0

    def backoff(self, restarts_in_window: int) -> float:
        """Delay before restart number ``restarts_in_window`` (1-based): 0 for the first, then exponential."""
        if restarts_in_window <= 1:
            return 0.0
        return float(min(self.backoff_max_s, self.backoff_initial_s * 2 ** (restarts_in_window - 2)))


@dataclass
class WorkerState:
    id: str
    node: str = ""
    gpus: tuple[int, ...] = ()
    state: HealthState = S.STARTING
    reason: str = ""
    detector: str = ""
    since: float = 0.0
    registered: bool = False
    signals: dict[str, Signal] = field(default_factory=dict)  # active, non-ok, by detector
    canary_streak: int = 0
    canary_failures: int = 0
    suspect_since: float | None = None
    restarts: list[float] = field(default_factory=list)  # wall times of restarts within the window
    restart_count: int = 0  # all restarts ever
    action_seq: int = 0  # actions issued for this worker ever (makes their ids unique and replayable)
    pending: str | None = None  # action id the agent has not finished
    drain_deadline: float | None = None
    drain_then: str = "cordon"
    drain_by: str = "operator"
    moving_until: float | None = None  # wall: past a drain's deadline, the routers move its streams until then
    draining_stop: bool = False  # a stop action that ends a drain is pending
    cordoned: bool = False  # an operator took it out of routing until undrained (kept across restarts)
    in_flight: int = 0
    pid: int | None = None  # the process that registered last

    def record(self) -> HealthRecord:
        extra: dict[str, Any] = {"node": self.node, "gpus": list(self.gpus), "restarts": self.restarts,
                                 "restart_count": self.restart_count, "action_seq": self.action_seq}
        if self.pending:
            extra["pending"] = self.pending
        if self.pid is not None:
            extra["pid"] = self.pid
        if self.cordoned:
            extra["cordoned"] = True
        if self.drain_deadline is not None or self.state is S.DRAINING:
            extra["drain"] = {"deadline": self.drain_deadline, "then": self.drain_then, "by": self.drain_by,
                              "moving_until": self.moving_until}
        return HealthRecord(self.state, reason=self.reason, detector=self.detector, since=self.since, extra=extra)

    @classmethod
    def from_record(cls, worker: str, rec: HealthRecord) -> WorkerState:
        x = rec.extra
        ws = cls(worker, node=str(x.get("node", "")), gpus=tuple(x.get("gpus", ())), state=rec.state,
                 reason=rec.reason, detector=rec.detector, since=rec.since,
                 restarts=[float(t) for t in x.get("restarts", [])], restart_count=int(x.get("restart_count", 0)),
                 action_seq=int(x.get("action_seq", 0)), pending=x.get("pending"),
                 pid=int(x["pid"]) if x.get("pid") is not None else None, cordoned=bool(x.get("cordoned")))
        drain = x.get("drain")
        if drain:
            deadline = drain.get("deadline")
            ws.drain_deadline = float(deadline) if deadline is not None else None
            ws.drain_then = str(drain.get("then", "cordon"))
            ws.drain_by = str(drain.get("by", "operator"))
            moving = drain.get("moving_until")
            ws.moving_until = float(moving) if moving is not None else None
        return ws


class HealthMachine:
    """All workers' health. ``observe(event)`` returns the actions to carry out, in order."""

    def __init__(self, policy: HealthPolicy | None = None, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.policy = policy or HealthPolicy()
        self.clock = clock
        self.workers: dict[str, WorkerState] = {}

    def load(self, worker: str, record: HealthRecord) -> None:
        """Take over the persisted state of a worker (a new leader starting from etcd)."""
        self.workers[worker] = WorkerState.from_record(worker, record)

    def _ws(self, worker: str) -> WorkerState:
        ws = self.workers.get(worker)
        if ws is None:
            ws = self.workers[worker] = WorkerState(worker, since=self.clock.wall())
        return ws

    def _set(self, ws: WorkerState, state: HealthState, reason: str, detector: str) -> list[Action]:
        previous = ws.state
        if state is previous and reason == ws.reason:
            return []
        ws.state, ws.reason, ws.detector, ws.since = state, reason, detector, self.clock.wall()
        if state is S.SUSPECT and previous is not S.SUSPECT:
            ws.suspect_since = self.clock.monotonic()
            ws.canary_streak = 0
        elif state is not S.SUSPECT:
            ws.suspect_since = None
        return [SetHealth(ws.id, ws.record(), previous)]

    # -- the machine ------------------------------------------------------------------------------------

    def observe(self, event: Event) -> list[Action]:
        match event:
            case Registered():
                return self._registered(event)
            case Deregistered():
                return self._deregistered(event)
            case GivenUp():
                self.workers.pop(event.worker, None)
                return [Forget(event.worker)]
            case SignalSeen():
                return self._signal(event.signal)
            case CanaryDone():
                return self._canary(event)
            case ActionDone():
                return self._action_done(event)
            case DrainRequested():
                return self._drain(event)
            case RestartRequested():
                ws = self._ws(event.worker)
                if ws.state is S.DEAD:
                    return self._start_again(ws, "restarted by an operator")
                return self._drain(DrainRequested(event.worker, 0.0, "restart"))
            case Undrain():
                ws = self._ws(event.worker)
                if ws.state is S.DEAD:
                    return self._start_again(ws, "undrained by an operator: it was stopped, starting it again")
                if ws.state is not S.DRAINING:
                    return []
                ws.drain_deadline, ws.cordoned = None, False
                return [*self._set(ws, S.STARTING, "drain cancelled", "operator"), RunCanary(ws.id, urgent=True)]
            case QuarantineCleared():
                ws = self._ws(event.worker)
                if ws.state is not S.QUARANTINED:
                    return []
                ws.restarts.clear()
                return self._agent(ws, "selftest", "quarantine cleared by an operator: self-test first")
            case Load():
                loaded = self.workers.get(event.worker)
                if loaded is None:
                    return []
                loaded.in_flight = event.in_flight
                if (loaded.state is S.DRAINING and loaded.drain_deadline is not None and event.in_flight == 0
                        and loaded.pending is None):
                    return self._finish_drain(loaded, "drained: no request left in flight")
                return []
            case Tick():
                return self._tick()
        raise TypeError(f"unknown event {event!r}")

    def _registered(self, e: Registered) -> list[Action]:
        ws = self._ws(e.worker)
        ws.node, ws.gpus, ws.registered = e.node, e.gpus, True
        if ws.pending is not None and e.pid is not None and e.pid == ws.pid:
            # The process a pending action is about to replace registered again (a renewed lease, or a new
            # leader reading the registry): not the fresh process the action will bring. Taking it for one
            # would clear the action, canary a process that is going away, and restart it once more.
            return []
        fresh = e.pid is None or e.pid != ws.pid
        ws.pid = e.pid if e.pid is not None else ws.pid
        if fresh:
            ws.signals.pop("process", None)  # what was said of the old process was acted on
        if ws.state in (S.QUARANTINED, S.DRAINING):
            return []
        if ws.cordoned:  # restarted while cordoned: it serves again, still out of routing
            ws.pending = None
            return self._set(ws, S.DRAINING, "cordoned: restarted, out of routing until undrained", "operator")
        if ws.state is S.SUSPECT and ws.pending is None:
            # Nothing changed (a lease renewal), or a new leader read a suspicion its predecessor had not
            # confirmed yet: its canary confirms or clears it (its own detectors start from nothing).
            return [RunCanary(ws.id, urgent=True)]
        if ws.state is S.READY and ws.pending is None:
            return []  # a lease renewal re-registered it; nothing changed
        ws.pending = None
        ws.canary_failures = 0
        return [*self._set(ws, S.STARTING, "registered: waiting for a canary", "agent"), RunCanary(ws.id, True)]

    def _deregistered(self, e: Deregistered) -> list[Action]:
        ws = self.workers.get(e.worker)
        if ws is None:
            return []
        ws.registered = False
        if ws.state in (S.RESTARTING, S.QUARANTINED, S.DEAD, S.UNHEALTHY) or ws.pending:
            return []
        if ws.state is S.DRAINING:
            return self._set(ws, S.DEAD, "drained and stopped", "supervisor")
        return self._set(ws, S.DEAD, "deregistered: its node agent stopped or lost it", "registry")

    def _signal(self, sig: Signal) -> list[Action]:
        ws = self._ws(sig.worker)
        if sig.severity is Severity.OK:
            ws.signals.pop(sig.detector, None)
            if ws.state is S.SUSPECT and not ws.signals:
                return [RunCanary(ws.id, urgent=True)]  # confirm recovery
            return []
        ws.signals[sig.detector] = sig
        if ws.state in (S.QUARANTINED, S.DEAD):
            return []
        action = sig.extra.get("action")
        if action == "dead":  # e.g. the backend never started: restarting would fail the same way
            return self._set(ws, S.DEAD, sig.reason, sig.detector)
        if action == "quarantine":
            return self._quarantine(ws, sig.reason, sig.detector)
        if sig.severity is Severity.FATAL:
            if ws.state in (S.RESTARTING, S.UNHEALTHY) and ws.pending:
                return []  # already being handled
            return self._unhealthy(ws, sig.reason, sig.detector, hang=bool(sig.extra.get("hang")))
        if ws.state in (S.READY, S.STARTING):
            out = self._set(ws, S.SUSPECT, sig.reason, sig.detector)
            return [*out, RunCanary(ws.id, urgent=True)]
        return []

    def _canary(self, e: CanaryDone) -> list[Action]:
        ws = self._ws(e.worker)
        if e.ok:
            ws.canary_failures = 0
            if ws.state is S.STARTING:
                return self._set(ws, S.READY, "canary passed", "canary")
            if ws.state is S.SUSPECT:
                ws.canary_streak += 1
                if self._suspicions(ws):
                    return []  # a detector still suspects it: wait for that detector to clear
                if ws.canary_streak >= self.policy.recover_canaries:
                    return self._set(ws, S.READY, f"{ws.canary_streak} canaries passed", "canary")
                return [RunCanary(ws.id, urgent=True)]
            return []
        # Decide nothing on a worker that cannot be reached (its lease decides) or on a measure the controller
        # spoilt (its own loop ran late): ask again.
        if e.unreachable or e.inconclusive:
            return [] if ws.state is S.READY else [RunCanary(ws.id, urgent=True)]
        if e.busy and not e.wrong_tokens:
            # The engine computed tokens while the canary waited: busy, not hung (a long prefill, scoring
            # requests, a queue). A ready worker stays ready; a suspect or starting one is asked again (the
            # controller gives that canary a longer deadline) and this one does not count against it.
            return [] if ws.state is S.READY else [RunCanary(ws.id, urgent=True)]
        if e.wrong_tokens and ws.state in (S.READY, S.SUSPECT, S.STARTING):
            return self._unhealthy(ws, e.reason, "canary")
        if ws.state is S.STARTING:
            ws.canary_failures += 1
            if ws.canary_failures >= self.policy.start_canary_failures:
                return self._unhealthy(ws, f"never passed a canary after starting: {e.reason}", "canary")
            return [RunCanary(ws.id, urgent=True)]
        if ws.state is S.READY:
            evidence = f"; {e.evidence}" if e.evidence else ""
            out = self._set(ws, S.SUSPECT, f"canary failed: {e.reason}{evidence}", "canary")
            return [*out, RunCanary(ws.id, urgent=True)]
        if ws.state is S.SUSPECT:
            ws.canary_streak = 0
            if e.silent is False:
                return [RunCanary(ws.id, urgent=True)]  # it still emits tokens for others: inconclusive
            # Name what raised the suspicion: a router's stall report stays the evidence even if the router
            # has since moved its streams away (and so reports the worker idle now).
            detector = f"{ws.detector}+canary" if ws.detector and ws.detector != "canary" else "canary"
            evidence = f"; {e.evidence}" if e.evidence else ""
            return self._unhealthy(ws, f"{ws.reason}; confirmed: canary failed ({e.reason}){evidence}", detector,
                                   hang=True)
        return []

    def _suspicions(self, ws: WorkerState) -> list[Signal]:
        return [s for s in ws.signals.values() if s.severity is not Severity.OK and s.detector != "canary"]

    def _unhealthy(self, ws: WorkerState, reason: str, detector: str, *, hang: bool = False) -> list[Action]:
        out: list[Action] = self._set(ws, S.UNHEALTHY, reason, detector)
        if hang:
            out.append(Publish("hang.detected", {"worker": ws.id, "reason": reason, "detector": detector}))
        return out + self._remediate(ws, reason)

    def _remediate(self, ws: WorkerState, reason: str) -> list[Action]:
        now = self.clock.wall()
        ws.restarts = [t for t in ws.restarts if now - t < self.policy.restart_window_s]
        if len(ws.restarts) >= self.policy.restart_budget:
            return self._quarantine(ws, f"crash loop: {len(ws.restarts)} restarts within "
                                        f"{self.policy.restart_window_s:.0f}s; last: {reason}", "supervisor")
        ws.restarts.append(now)
        ws.restart_count += 1
        delay = self.policy.backoff(len(ws.restarts))
        act = self._agent(ws, "restart", reason, delay=delay)  # first: the persisted record names it
        return self._set(ws, S.RESTARTING, f"restart {len(ws.restarts)}/{self.policy.restart_budget} "
                                           f"in {delay:.1f}s after: {reason}", "supervisor") + act

    def _quarantine(self, ws: WorkerState, reason: str, detector: str) -> list[Action]:
        act = self._agent(ws, "stop", reason)
        out: list[Action] = self._set(ws, S.QUARANTINED, reason, detector)
        out.append(Quarantine(ws.id, ws.node, ws.gpus, reason))
        out.append(Publish("quarantine", {"worker": ws.id, "node": ws.node, "gpus": list(ws.gpus), "reason": reason}))
        return out + act

    def _agent(self, ws: WorkerState, kind: Literal["restart", "stop", "selftest"], reason: str, *,
               delay: float = 0.0) -> list[Action]:
        ws.action_seq += 1
        action_id = f"{ws.id}.{kind}.{ws.action_seq}"
        ws.pending = action_id
        out: list[Action] = [AgentAction(ws.id, ws.node, kind, action_id, delay, reason)]
        if kind == "restart":
            out.append(Publish("restart", {"worker": ws.id, "node": ws.node, "reason": reason, "delay_s": delay,
                                           "attempt": len(ws.restarts)}))
        return out

    def _action_done(self, e: ActionDone) -> list[Action]:
        if e.worker not in self.workers:
            return []  # a start for a worker that never registered (a failed one is a ``start`` signal)
        ws = self._ws(e.worker)
        if ws.pending != e.action_id:
            return []  # a stale or foreign action
        ws.pending = None
        if e.kind == "restart":
            if e.ok:
                return []  # the worker registers again; a canary decides
            return self._set(ws, S.DEAD, f"failed to start: {e.reason}", "agent")
        if e.kind == "selftest":
            if e.ok:
                ws.restart_count += 1
                act = self._agent(ws, "restart", "back from quarantine")
                return [*self._set(ws, S.RESTARTING, "self-test passed: restarting", "selftest"),
                        LiftQuarantine(ws.id, ws.node, ws.gpus), *act]
            return self._set(ws, S.QUARANTINED, f"self-test failed: {e.reason}", "selftest")
        if e.kind == "stop" and ws.draining_stop:
            ws.draining_stop = False
            return self._set(ws, S.DEAD, "drained and stopped", "supervisor")
        return []

    def admit(self, command: Command) -> str | None:
        """Why ``command`` cannot apply to its worker in its present state (an operator is told, 409), or
        None when it applies. The worker must be known (the caller answers 404 otherwise)."""
        ws = self.workers[command.worker]
        state, pending = ws.state, ws.pending is not None
        match command:
            case DrainRequested():
                if state is S.DRAINING and ws.drain_deadline is not None:
                    return "it is being drained already (`fleetward undrain` cancels that)"
                if state is S.DRAINING and command.then == "cordon":
                    return "it is cordoned already (`fleetward undrain` takes it back)"
                if state in (S.DEAD, S.QUARANTINED):
                    return f"it is {state.value} ({ws.reason}): nothing runs on it to drain"
                if state is S.RESTARTING or pending:
                    return f"a {'restart' if state is S.RESTARTING else 'remediation'} is under way ({ws.reason})"
            case RestartRequested():
                if state is S.QUARANTINED:
                    return "it is quarantined: `fleetward unquarantine` runs the GPU self-test, then restarts it"
                if state is S.RESTARTING or pending:
                    return f"it is being restarted already ({ws.reason})"
            case Undrain():
                if state not in (S.DRAINING, S.DEAD):
                    return f"it is not drained: it is {state.value}"
                if state is S.DEAD and pending:
                    return "it is being stopped"
            case QuarantineCleared():
                if state is not S.QUARANTINED:
                    return f"it is not quarantined: it is {state.value}"
        return None

    def _start_again(self, ws: WorkerState, reason: str) -> list[Action]:
        ws.restart_count += 1
        ws.drain_deadline, ws.cordoned = None, False
        act = self._agent(ws, "restart", reason)
        return [*self._set(ws, S.RESTARTING, reason, "operator"), *act]

    def _drain(self, e: DrainRequested) -> list[Action]:
        ws = self._ws(e.worker)
        if ws.state in (S.DEAD, S.QUARANTINED):
            return []
        ws.drain_deadline = self.clock.wall() + e.deadline_s
        ws.drain_then, ws.drain_by, ws.moving_until = e.then, e.by, None
        ws.cordoned = ws.cordoned or e.then == "cordon"
        out = self._set(ws, S.DRAINING, f"draining (then {e.then}) within {e.deadline_s:.0f}s", "operator")
        if ws.in_flight == 0:
            out += self._finish_drain(ws, "drained: nothing was in flight")
        return out

    def _finish_drain(self, ws: WorkerState, reason: str) -> list[Action]:
        ws.drain_deadline = ws.moving_until = None
        if ws.drain_then == "cordon":
            return self._set(ws, S.DRAINING, f"cordoned until undrained ({reason})", "operator")
        if ws.drain_then == "restart":
            ws.restart_count += 1
            act = self._agent(ws, "restart", reason)
            return [*self._set(ws, S.RESTARTING, reason + "; restarting", "supervisor"), *act]
        ws.draining_stop = True
        return self._agent(ws, "stop", reason)

    def _tick(self) -> list[Action]:
        out: list[Action] = []
        mono, wall = self.clock.monotonic(), self.clock.wall()
        for ws in self.workers.values():
            degraded_only = bool(ws.signals) and all(s.severity is Severity.DEGRADED for s in ws.signals.values())
            if ws.state is S.SUSPECT and ws.suspect_since is not None and not degraded_only \
                    and mono - ws.suspect_since > self.policy.suspect_timeout_s:
                out += self._unhealthy(ws, f"{ws.reason}; unresolved for {self.policy.suspect_timeout_s:.0f}s",
                                       ws.detector or "supervisor")
            elif ws.state is S.DRAINING and ws.drain_deadline is not None and wall > ws.drain_deadline \
                    and ws.pending is None:
                out += self._past_deadline(ws, wall)
        return out

    def _past_deadline(self, ws: WorkerState, wall: float) -> list[Action]:
        """A drain's deadline passed: the routers move what is left with its KV (for ``drain_move_s``), then
        whatever is still there is moved by computing it again (unhealthy evacuates), and the drain ends."""
        if ws.moving_until is None and ws.in_flight > 0 and self.policy.drain_move_s > 0:
            ws.moving_until = wall + self.policy.drain_move_s
            trigger: Literal["drain", "scale-down"] = "scale-down" if ws.drain_by == "autoscaler" else "drain"
            return [*self._set(ws, S.DRAINING, f"drain deadline passed: moving {ws.in_flight} stream(s) with their "
                               f"KV (then {ws.drain_then})", "supervisor"), MoveStreams(ws.id, trigger)]
        if ws.moving_until is not None and wall <= ws.moving_until:
            return []
        # Tell routers to move what is left (unhealthy evacuates), then stop.
        return [*self._set(ws, S.UNHEALTHY, "drain deadline passed: migrating the remaining streams", "supervisor"),
                *self._finish_drain(ws, "drain deadline passed")]

    def states(self) -> dict[str, HealthState]:
        return {w: ws.state for w, ws in self.workers.items()}

    def active_workers(self) -> Iterable[WorkerState]:
        return (ws for ws in self.workers.values() if ws.state not in (S.DEAD,))
