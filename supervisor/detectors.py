"""Detectors: each turns one kind of observation into :class:`~fleetward.supervisor.signals.Signal` values.

They are sans-IO: the caller feeds observations with an injected clock, so each one is tested
without sleeping. Each reports a change only when its verdict about a worker changes: ``ok`` after a
non-ok signal clears it. Every detector is a :class:`Detector`: a ``name`` (the ``detector`` of its
signals, ``signals/<worker>/<name>`` in etcd) and ``forget(worker)`` for a worker that left; how it is
fed is its own (``observe``, ``scraped``, ...), and whatever it returns is a list of signals. A new
detector is a class here, fed by the agent (host evidence) or the controller (behaviour), and a row
below.

==================  =========  ==================================================================================
detector            runs in    says
==================  =========  ==================================================================================
process             agent      fatal the moment a process of the worker's tree exits (pidfd, no polling)
engine-frozen       agent      fatal when an engine process is stopped (SIGSTOP/T state), or when the engine
                               processes are not scheduled at all (no CPU time, no context switch) for
                               ``stall_s`` while work waits on them (frozen by the cgroup freezer, stuck in
                               the kernel); suspect when they use no CPU for ``no_progress_s`` while requests
                               run. Work is requests running per the worker's metrics, or the agent's own
                               probe: an engine that shows no progress gets a one-token request (at most
                               every ``probe_interval_s``), so an idle one is checked too
engine-busy         agent      evidence, never a verdict: the engine processes compute (CPU), said on change
                               (:class:`EngineActivity`); weighed by the controller against an unanswered canary
gpu                 agent      per the Xid/ECC policy table: restart, quarantine, or degraded (throttling)
stream-progress     controller suspect when a router reports the worker silent past its adaptive allowance
                               while it has work in flight (the router's ProgressModel: long prompts get longer)
canary              controller a tiny greedy generation with a deadline; golden outputs catch wrong tokens. One
                               unanswered while the worker's token counters moved (:class:`EngineProgress`,
                               read as it leaves and when it times out) waited behind work: busy, not failed
metrics             controller suspect when vLLM's token counters stop moving while requests run, or scrapes
                               fail
==================  =========  ==================================================================================
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.supervisor.signals import Severity, Signal

__all__ = [
    "Detector",
    "EngineActivity",
    "EngineFrozenDetector",
    "EngineProgress",
    "EngineSample",
    "GoldenBook",
    "MetricsDetector",
    "StreamProgressDetector",
    "golden_key",
    "parse_prometheus",
    "weigh_computing",
]


class Detector(Protocol):
    """What every detector is (see the module docstring)."""

    name: str

    def forget(self, worker: str) -> None:
        """Drop what is known of ``worker`` (it left, or a fresh process of it starts)."""
        ...


class _Verdicts:
    """Remembers the last severity per worker so only changes become signals."""

    def __init__(self, name: str, clock: Clock) -> None:
        self.name = name
        self.clock = clock
        self.last: dict[str, Severity] = {}

    def say(self, worker: str, severity: Severity, reason: str, **extra: Any) -> list[Signal]:
        if self.last.get(worker, Severity.OK) is severity:
            return []
        self.last[worker] = severity
        return [Signal(worker, self.name, severity, reason, self.clock.wall(), dict(extra))]

    def forget(self, worker: str) -> None:
        self.last.pop(worker, None)


# -- stream progress ------------------------------------------------------------------------------------


@dataclass
class WorkerProgressView:
    in_flight: int = 0
    silent_for_s: float = 0.0
    allowed_silence_s: float = 0.0
    stalled: bool = False
    routers: int = 0


class StreamProgressDetector:
    """Combines the routers' published views (``GET /fleetward/v1/progress``) into per-worker verdicts.

    A worker is stalled when any router has work in flight on it and has seen no token from it for longer
    than that router's allowance. Views older than ``stale_after_s`` (a router that stopped answering) are
    ignored.
    """

    name = "stream-progress"

    def __init__(self, *, clock: Clock = SYSTEM_CLOCK, stale_after_s: float = 5.0) -> None:
        self.clock = clock
        self.stale_after_s = stale_after_s
        self._views: dict[str, tuple[float, Mapping[str, Any]]] = {}
        self._verdicts = _Verdicts(self.name, clock)
        self.workers: dict[str, WorkerProgressView] = {}
        self._stalls: dict[tuple[str, str], int] = {}  # (router, worker) -> stall count last seen

    def observe(self, router: str, view: Mapping[str, Any]) -> None:
        self._views[router] = (self.clock.monotonic(), view)

    def router_gone(self, router: str) -> None:
        self._views.pop(router, None)

    def forget(self, worker: str) -> None:
        self.workers.pop(worker, None)
        self._verdicts.forget(worker)
        self._stalls = {k: v for k, v in self._stalls.items() if k[1] != worker}

    def check(self) -> list[Signal]:
        now = self.clock.monotonic()
        merged: dict[str, WorkerProgressView] = collections.defaultdict(WorkerProgressView)
        moved: dict[str, int] = {}
        for router, (seen, view) in list(self._views.items()):
            if now - seen > self.stale_after_s:
                continue
            for worker, w in (view.get("workers") or {}).items():
                stalls = int(w.get("stalls", 0))
                before = self._stalls.get((router, worker))
                self._stalls[(router, worker)] = stalls
                if before is not None and stalls > before:
                    moved[worker] = moved.get(worker, 0) + stalls - before
                m = merged[worker]
                m.routers += 1
                m.in_flight += int(w.get("in_flight", 0))
                silent, allowed = float(w.get("silent_for_s", 0.0)), float(w.get("allowed_silence_s", 0.0))
                if int(w.get("in_flight", 0)) and silent > allowed:
                    if not m.stalled or silent - allowed > m.silent_for_s - m.allowed_silence_s:
                        m.silent_for_s, m.allowed_silence_s = silent, allowed
                    m.stalled = True
                elif not m.stalled:
                    m.silent_for_s = max(m.silent_for_s, silent)
                    m.allowed_silence_s = max(m.allowed_silence_s, allowed)
        self.workers = dict(merged)
        out: list[Signal] = []
        for worker, m in self.workers.items():
            if worker in moved and not m.stalled:
                # A router already moved the streams away (so it has nothing in flight there now): the
                # silence it saw is the evidence. A canary decides.
                out += self._verdicts.say(worker, Severity.SUSPECT,
                                          f"a router moved its streams away {moved[worker]} time(s): no token "
                                          "within the allowed silence")
            elif m.stalled:
                out += self._verdicts.say(worker, Severity.SUSPECT,
                                          f"no token for {m.silent_for_s:.2f}s with {m.in_flight} request(s) in "
                                          f"flight (allowed {m.allowed_silence_s:.2f}s)",
                                          silent_for_s=m.silent_for_s, allowed_silence_s=m.allowed_silence_s)
            else:
                out += self._verdicts.say(worker, Severity.OK, "tokens flowing")
        for worker in [w for w in self._verdicts.last if w not in self.workers]:
            out += self._verdicts.say(worker, Severity.OK, "no work in flight")
        return out

    def silent(self, worker: str) -> bool | None:
        """Whether routers see the worker silent with work in flight (None: they have no work on it)."""
        m = self.workers.get(worker)
        if m is None or not m.in_flight:
            return None
        return m.stalled

    def in_flight(self, worker: str) -> int:
        m = self.workers.get(worker)
        return m.in_flight if m else 0

    def answered(self, routers: Iterable[str], since: float) -> bool:
        """Whether each of ``routers`` gave its view at ``since`` (monotonic) or later: only then is a count of 0
        in flight known to be 0, and not a router that did not answer (a view from before a busy router went
        quiet still says what ran then)."""
        return all(r in self._views and self._views[r][0] >= since for r in routers)

    def in_flight_now(self, worker: str) -> int:
        """Requests in flight on ``worker`` as the routers' latest views say (stale ones left out), summed:
        without waiting for the next :meth:`check`."""
        now = self.clock.monotonic()
        return sum(int(((view.get("workers") or {}).get(worker) or {}).get("in_flight", 0))
                   for seen, view in self._views.values() if now - seen <= self.stale_after_s)

    def allowance(self, worker: str) -> float | None:
        m = self.workers.get(worker)
        return m.allowed_silence_s if m and m.allowed_silence_s else None


# -- metrics --------------------------------------------------------------------------------------------


def parse_prometheus(text: str, names: Iterable[str]) -> dict[str, float]:
    """Sum of the samples of each wanted metric (labels ignored), from the text exposition format."""
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        name = line[:name_end]
        if name not in wanted:
            continue
        try:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[-1])
        except ValueError:
            continue
    return out


RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
GENERATED = "vllm:generation_tokens_total"
PROMPT = "vllm:prompt_tokens_total"


def _tokens(metrics: Mapping[str, float]) -> float | None:
    """The engine's work done, in tokens: prompt tokens prefilled plus tokens generated (None: not exported)."""
    if GENERATED not in metrics and PROMPT not in metrics:
        return None
    return metrics.get(GENERATED, 0.0) + metrics.get(PROMPT, 0.0)


@dataclass(frozen=True)
class EngineProgress:
    """What a worker's own counters say of its engine between two readings: the evidence that a canary which
    went unanswered waited behind work (the engine completes steps: busy) or on an engine that completes none.

    ``tokens`` is the prompt and generated tokens counted between the readings, ``over_s`` the time between
    them; ``running`` and ``waiting`` the requests in the engine at the second reading (every client's, those
    that do not come through a router too)."""

    tokens: float
    over_s: float
    running: float = 0.0
    waiting: float = 0.0

    @property
    def busy(self) -> bool:
        return self.tokens > 0

    def describe(self) -> str:
        load = f"{self.running:.0f} request(s) running, {self.waiting:.0f} waiting"
        if self.busy:
            return f"its engine computed {self.tokens:.0f} token(s) in the last {self.over_s:.1f}s ({load})"
        return f"its token counters stood still for {self.over_s:.1f}s ({load})"


@dataclass
class _MetricsState:
    failures: int = 0
    tokens: float | None = None  # prompt + generated tokens at the last reading
    tokens_since: float = 0.0  # when they last moved (or nothing ran)
    read_at: float | None = None  # the last reading


class MetricsDetector:
    """vLLM counters that stop moving while requests run; scrapes that fail. It also keeps the last reading of
    each worker's token counters, so a reading taken when a canary goes unanswered says whether the engine
    made progress since the one taken as it left (:meth:`progress`)."""

    name = "metrics"
    wanted = (RUNNING, WAITING, GENERATED, PROMPT)

    def __init__(self, *, clock: Clock = SYSTEM_CLOCK, frozen_after_s: float = 10.0, failures: int = 2) -> None:
        self.clock = clock
        self.frozen_after_s = frozen_after_s
        self.failures = failures
        self._state: dict[str, _MetricsState] = collections.defaultdict(_MetricsState)
        self._verdicts = _Verdicts(self.name, clock)

    def _read(self, st: _MetricsState, tokens: float | None, running: float, now: float) -> bool:
        """Take a reading; whether the counters stood still with requests running since the one before."""
        st.failures = 0
        st.read_at = now
        if tokens is None:
            return False
        if st.tokens is None or tokens != st.tokens or running <= 0:
            st.tokens, st.tokens_since = tokens, now
            return False
        return True

    def scraped(self, worker: str, metrics: Mapping[str, float], *, computing_s: float = 0.0) -> list[Signal]:
        """A scrape's counters. ``computing_s``: how long they may stand still instead of ``frozen_after_s``
        while the node agent sees the engine's processes compute (one long step; 0: it does not)."""
        st = self._state[worker]
        now = self.clock.monotonic()
        running = metrics.get(RUNNING, 0.0)
        if _tokens(metrics) is None:
            self._read(st, None, running, now)
            return self._verdicts.say(worker, Severity.OK, "scraped")
        if not self._read(st, _tokens(metrics), running, now):
            return self._verdicts.say(worker, Severity.OK, "counters moving")
        if now - st.tokens_since >= max(self.frozen_after_s, computing_s):
            return self._verdicts.say(worker, Severity.SUSPECT,
                                      f"token counters ({GENERATED}, {PROMPT}) frozen for "
                                      f"{now - st.tokens_since:.1f}s while {running:.0f} request(s) run")
        return []

    def record(self, worker: str, metrics: Mapping[str, float]) -> tuple[float, float] | None:
        """Take a reading of ``worker``'s counters outside the scrapes; it and when (monotonic), as :meth:`last`."""
        tokens = _tokens(metrics)
        self._read(self._state[worker], tokens, metrics.get(RUNNING, 0.0), self.clock.monotonic())
        return self.last(worker) if tokens is not None else None

    def last(self, worker: str) -> tuple[float, float] | None:
        """The tokens of ``worker``'s last reading and when it was taken (monotonic); None when it has none."""
        st = self._state.get(worker)
        if st is None or st.tokens is None or st.read_at is None:
            return None
        return st.tokens, st.read_at

    def progress(self, worker: str, metrics: Mapping[str, float],
                 since: tuple[float, float]) -> EngineProgress | None:
        """A fresh reading of ``worker``'s counters (kept, as :meth:`record`) against the reading ``since``
        (tokens, when), e.g. the one taken as a canary left; None when the worker exports no token counters."""
        if self.record(worker, metrics) is None:
            return None
        tokens, at = since
        return EngineProgress(max(0.0, (_tokens(metrics) or 0.0) - tokens), self.clock.monotonic() - at,
                              metrics.get(RUNNING, 0.0), metrics.get(WAITING, 0.0))

    def still_for(self, worker: str) -> float:
        """How long ``worker``'s token counters have stood still with requests running, as last read (0: they
        moved at the last reading, or nothing ran, or they were never read)."""
        st = self._state.get(worker)
        if st is None or st.tokens is None or st.read_at is None:
            return 0.0
        return st.read_at - st.tokens_since

    def failed(self, worker: str, error: str) -> list[Signal]:
        st = self._state[worker]
        st.failures += 1
        if st.failures >= self.failures:
            return self._verdicts.say(worker, Severity.SUSPECT, f"/metrics scrape failed {st.failures} times: {error}")
        return []

    def forget(self, worker: str) -> None:
        self._state.pop(worker, None)
        self._verdicts.forget(worker)


# -- engine frozen (agent) ------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineSample:
    """One look at a worker's engine processes: (pid, name, status, cpu seconds) each, and its load.

    ``switches`` is their context switches, summed (a process that is scheduled at all switches); with the
    CPU time it tells whether they ran since the last look. ``running_read_at`` is when ``running_requests``
    was read (the agent's monotonic clock), ``probe_sent_at`` when the agent's own request to the engine was
    sent, if it is still unanswered.
    """

    processes: tuple[tuple[int, str, str, float], ...]
    running_requests: int | None = None  # from the worker's own metrics, when known
    switches: int | None = None
    running_read_at: float | None = None
    probe_sent_at: float | None = None
    # The server process in front of the engine (vLLM's API server), when it is another process: its CPU
    # time and context switches. A probe waits on the engine only once the server ran to hand it on.
    server: tuple[float, int] | None = None
    # The server's threads' time on a CPU or waiting in a run queue, summed (ns, /proc/.../schedstat), when
    # readable: how much CPU it asked for. A server that asks for little, look after look, is not working on
    # the probe any more: it handed it on, and waits.
    server_demand_ns: int | None = None


@dataclass
class _EngineState:
    cpu: float = -1.0
    cpu_since: float = 0.0
    ran: tuple[float, int] | None = None  # (cpu, switches) at the last look that showed the engine ran
    ran_at: float = 0.0  # when that look was
    work_since: float | None = None  # first evidence of waiting work since the engine last ran
    evidence_since: float | None = None  # of it, what holds until the engine runs (requests it counts)
    ran_last: bool = True  # the last look showed the engine ran (or did not measure it)
    fatal: str = ""  # "stopped" or "stall" while the last verdict is fatal
    probe_done_at: float = float("-inf")
    server: tuple[float, int] | None = None  # the server process's (cpu, switches) at the last look
    server_ran_at: float = float("-inf")  # the last look that showed the server ran
    server_ran_after: float = float("-inf")  # the look before it: that run came after this time
    server_demand: int | None = None  # the server's demand (ns) at the last look
    settled_at: float | None = None  # the first look of the run, after the probe, that showed the server settled
    seen_at: float = float("-inf")  # the last look at all
    watched_since: float = float("-inf")  # the start of the looks without a gap longer than stall_s


SETTLED_DEMAND = 0.1  # of one CPU: below it, a server in front of an engine is settled (see _settled)


class EngineFrozenDetector:
    """A stopped engine process, or one not scheduled at all while work waits, is a silent hang; CPU that
    stops moving while requests run is suspect.

    "Not scheduled" is neither CPU time nor a context switch since the engine last ran: a live engine with
    work runs within milliseconds, however loaded the host, so ``stall_s`` of it with work waiting the whole
    time is not load. Work waits when the worker's metrics (read after the engine last ran) count requests
    running, or when the agent's probe is unanswered: :meth:`probe_due` says when an engine that shows no
    progress should get one, so an idle engine is checked too, at most every ``probe_interval_s``. A probe
    reaches the engine through the server in front of it (vLLM's API server), which may hold it a while: on a
    loaded host, or busy with its first request. So a probe counts once the server has *settled* after it was
    sent (each look, scheduled and asking for little CPU: it handed the probe on and waits), and only while
    it stays settled; being scheduled is not enough (vLLM's server wakes every 100 ms, and CI saw a healthy,
    idle prefill server named hung on that rule). Where the server's demand cannot be read, a probe counts
    once the server ran after it was sent, from ``stall_s`` later. Evidence counts only while the looks
    come without a gap longer than ``stall_s``: an observer that was itself held up (a loaded host, a blocked
    event loop) has not watched the engine meanwhile, and starts again.
    """

    name = "engine-frozen"

    def __init__(self, *, clock: Clock = SYSTEM_CLOCK, no_progress_s: float = 5.0, stall_s: float = 1.0,
                 probe_interval_s: float = 2.0) -> None:
        self.clock = clock
        self.no_progress_s = no_progress_s
        self.stall_s = stall_s
        self.probe_interval_s = probe_interval_s
        self._state: dict[str, _EngineState] = collections.defaultdict(_EngineState)
        self._verdicts = _Verdicts(self.name, clock)

    def observe(self, worker: str, sample: EngineSample) -> list[Signal]:
        now = self.clock.monotonic()
        st = self._state[worker]
        stopped = [(pid, name) for pid, name, status, _ in sample.processes if status in ("stopped", "tracing-stop")]
        if stopped:
            pid, name = stopped[0]
            st.fatal = "stopped"
            return self._verdicts.say(worker, Severity.FATAL, f"engine process {pid} ({name}) is stopped "
                                      "(SIGSTOP): it answers nothing while /health may still say 200",
                                      hang=True, pid=pid)
        cpu = sum(p[3] for p in sample.processes)
        ran = self._ran(st, cpu, sample, now)
        if st.fatal == "stopped" or (st.fatal == "stall" and ran):
            st.fatal = ""
            st.cpu, st.cpu_since = cpu, now
            return self._verdicts.say(worker, Severity.OK, "engine running")
        if not ran and st.work_since is not None and now - st.work_since >= self.stall_s:
            st.fatal = "stall"
            waiting = (f"{sample.running_requests} request(s) running" if sample.running_requests
                       else "a probe request unanswered")
            return self._verdicts.say(worker, Severity.FATAL,
                                      f"engine processes not scheduled for {now - st.ran_at:.2f}s (no CPU time, "
                                      f"no context switch) with {waiting}: frozen (cgroup freezer) or stuck in "
                                      "the kernel, while /health may still say 200", hang=True)
        if st.fatal:
            return []
        if cpu != st.cpu or not sample.running_requests:
            st.cpu, st.cpu_since = cpu, now
            return self._verdicts.say(worker, Severity.OK, "engine running")
        if now - st.cpu_since >= self.no_progress_s:
            return self._verdicts.say(worker, Severity.SUSPECT,
                                      f"engine used no CPU for {now - st.cpu_since:.1f}s while "
                                      f"{sample.running_requests} request(s) run")
        return []

    def _ran(self, st: _EngineState, cpu: float, sample: EngineSample, now: float) -> bool:
        """Whether the engine ran since the last look; updates when work was first seen waiting since."""
        if sample.server is not None and sample.server != st.server:
            if st.server is not None:
                st.server_ran_at, st.server_ran_after = now, st.seen_at
            st.server = sample.server
        self._settled(st, sample, now)
        st.ran_last = True
        if now - st.seen_at > self.stall_s:
            st.watched_since, st.evidence_since = now, None
        st.seen_at = now
        if sample.switches is None or not sample.processes:
            st.work_since = None
            return True  # not measured: no stall verdict
        mark = (cpu, sample.switches)
        if mark != st.ran:
            st.ran, st.ran_at, st.work_since, st.evidence_since = mark, now, None, None
            return True
        st.ran_last = False
        seen = []
        if sample.running_requests and sample.running_read_at is not None and sample.running_read_at >= st.ran_at:
            seen.append(max(sample.running_read_at, st.watched_since))
        probe = sample.probe_sent_at
        if probe is not None and sample.server is None:
            # The engine is the server: counted from stall_s after it was sent, so that a look or two shows it.
            seen.append(max(probe, st.ran_at, st.watched_since) + self.stall_s)
        elif probe is not None and sample.server_demand_ns is None and st.server_ran_after >= probe:
            # Without the server's demand: counted once it ran after the probe was sent, twice as long.
            seen.append(max(probe, st.ran_at, st.server_ran_at, st.watched_since) + self.stall_s)
        if seen:
            st.evidence_since = min(seen) if st.evidence_since is None else min(st.evidence_since, *seen)
        # The server settled after the probe: evidence while it stays so (a look that shows it working again,
        # or not scheduled at all, takes it back: it may still be handing the probe on).
        settled = (max(st.settled_at, st.ran_at, st.watched_since)
                   if probe is not None and st.settled_at is not None else None)
        st.work_since = min((t for t in (st.evidence_since, settled) if t is not None), default=None)
        return False

    def _settled(self, st: _EngineState, sample: EngineSample, now: float) -> None:
        """Track the looks that show the server in front of the engine settled since the probe was sent: each
        look entirely after the send, the server was scheduled and asked for under ``SETTLED_DEMAND`` of one
        CPU (measured: an idle vLLM API server 0.2 %, reading its /metrics every look 2-4 %; one handing a
        request on 10-100 %, and a starved one both runs and waits). vLLM's API server wakes every 100 ms
        (uvicorn's tick), so it is scheduled at every look while it lives."""
        demand, before = sample.server_demand_ns, st.server_demand
        st.server_demand = demand
        probe = sample.probe_sent_at
        if probe is None or demand is None or before is None or st.seen_at < probe:
            st.settled_at = None
            return
        quiet = st.server_ran_at == now and 0 <= demand - before < SETTLED_DEMAND * (now - st.seen_at) * 1e9
        if not quiet:
            st.settled_at = None
        elif st.settled_at is None:
            st.settled_at = now

    def ran_last(self, worker: str) -> bool:
        """Whether the last look at ``worker`` showed its engine ran (True when not measured)."""
        st = self._state.get(worker)
        return st is None or st.ran_last

    def probe_due(self, worker: str) -> bool:
        """Whether the engine showed no progress at the last look and its last probe ended long enough ago
        (the caller knows whether one is outstanding)."""
        st = self._state.get(worker)
        if st is None or st.ran_last or st.fatal:
            return False
        return self.clock.monotonic() - st.probe_done_at >= self.probe_interval_s

    def probe_done(self, worker: str) -> None:
        """The agent's probe of ``worker`` was answered, or failed."""
        self._state[worker].probe_done_at = self.clock.monotonic()

    def forget(self, worker: str) -> None:
        self._state.pop(worker, None)
        self._verdicts.forget(worker)


@dataclass
class _ActivityState:
    cpu: float = 0.0
    at: float | None = None  # the last look
    high_since: float | None = None  # the start of the looks that showed it computing, in a row
    low_since: float | None = None  # the start of the looks that showed it not computing, in a row
    computing: bool = False  # what was said last


class EngineActivity:
    """Evidence, never a verdict: whether a worker's engine processes are computing now (CPU time at
    ``busy_cpu`` of a core or more, look after look, for ``on_s``; no longer after ``off_s`` under it). Said
    only when it changes, as an ``ok`` signal with ``computing`` and ``since`` (wall time), so a steadily busy
    or idle engine costs no write.

    The controller weighs it against an unanswered canary whose worker's token counters stood still: one
    engine step that outlasts the canary (a cold code path, a first-use compile, a long prefill on a slow
    device) computes; a stopped, frozen or deadlocked engine does not. A step that computes and never returns
    (a spinning kernel, a stalled collective) looks busy too, which is why the controller waits on it only up
    to a bound (``supervisor.canary_busy_max_s``)."""

    name = "engine-busy"

    def __init__(self, *, clock: Clock = SYSTEM_CLOCK, busy_cpu: float = 0.5, on_s: float = 1.0,
                 off_s: float = 3.0) -> None:
        self.clock = clock
        self.busy_cpu = busy_cpu
        self.on_s = on_s
        self.off_s = off_s
        self._state: dict[str, _ActivityState] = collections.defaultdict(_ActivityState)

    def observe(self, worker: str, cpu_s: float) -> list[Signal]:
        """One look: the engine processes' CPU time, summed (seconds)."""
        now = self.clock.monotonic()
        st = self._state[worker]
        before, at = st.cpu, st.at
        st.cpu, st.at = cpu_s, now
        if at is None or now <= at or cpu_s < before:  # the first look, or a new process tree
            return []
        if (cpu_s - before) / (now - at) >= self.busy_cpu:
            st.low_since = None
            st.high_since = at if st.high_since is None else st.high_since
        else:
            st.high_since = None
            st.low_since = at if st.low_since is None else st.low_since
        if not st.computing and st.high_since is not None and now - st.high_since >= self.on_s:
            st.computing = True
            since = self.clock.wall() - (now - st.high_since)
            reason = f"engine processes computing for {now - st.high_since:.1f}s"
            return [Signal(worker, self.name, Severity.OK, reason, self.clock.wall(),
                           {"computing": True, "since": since})]
        if st.computing and st.low_since is not None and now - st.low_since >= self.off_s:
            st.computing = False
            return [Signal(worker, self.name, Severity.OK, "engine processes not computing", self.clock.wall(),
                           {"computing": False})]
        return []

    def forget(self, worker: str) -> list[Signal]:
        """Drop ``worker`` (its process is being replaced); the "not computing" to say if "computing" was said."""
        st = self._state.pop(worker, None)
        if st is None or not st.computing:
            return []
        return [Signal(worker, self.name, Severity.OK, "a new process", self.clock.wall(), {"computing": False})]


def weigh_computing(progress: EngineProgress, computing_for_s: float, still_for_s: float,
                    bound_s: float) -> tuple[bool, str]:
    """An unanswered canary whose worker's token counters stood still, while its node agent sees the engine
    processes compute: one long step (busy), until the counters have stood still ``bound_s``; past it, a step
    that does not return. Whether busy, and the evidence in words."""
    seen = f"{progress.describe()}, and its engine processes have computed for {computing_for_s:.1f}s (node agent)"
    if still_for_s < bound_s:
        return True, f"{seen}: one long step (waited for up to {bound_s:g}s, supervisor.canary_busy_max_s)"
    return False, (f"{seen} with no token for {still_for_s:.1f}s: past supervisor.canary_busy_max_s ({bound_s:g}s), "
                   "a step that does not return")


# -- canary golden outputs ------------------------------------------------------------------------------


def golden_key(model: str, engine: str | None, device: str | None) -> str:
    """What a canary's greedy output depends on: the model, the engine and its version, the device. Workers that
    differ in any may answer the canary prompt with other tokens, healthy both (a rolling vLLM upgrade, a fleet
    of two GPU types), so each such group has its own golden."""
    return f"{model} | {engine or 'engine unknown'} | {device or 'device unknown'}"


@dataclass
class GoldenBook:
    """Known greedy outputs of the canary prompt, per :func:`golden_key`, to catch workers that emit wrong tokens.

    A golden is either configured, or learned: once ``quorum`` workers of a key agreed on an output, it becomes
    that key's golden. A worker that answers differently is only suspect until confirmed (the controller asks a
    peer of the same key, else the worker again); a golden that a healthy peer no longer gives is forgotten and
    learned again. Before a golden exists, outputs are only collected, and no verdict is given.
    """

    quorum: int = 2
    golden: dict[str, tuple[int, ...]] = field(default_factory=dict)
    _votes: dict[str, collections.Counter[tuple[int, ...]]] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter))
    _voters: dict[str, dict[str, tuple[int, ...]]] = field(default_factory=lambda: collections.defaultdict(dict))

    def check(self, key: str, tokens: Iterable[int], *, worker: str = "") -> bool | None:
        """True (matches), False (other tokens than the golden) or None (no golden yet). While learning, each
        worker's latest output counts once."""
        out = tuple(tokens)
        known = self.golden.get(key)
        if known is not None:
            return out == known
        voters = self._voters[key]
        voters[worker or f"anonymous-{len(voters)}"] = out
        votes = self._votes[key] = collections.Counter(voters.values())
        best, count = votes.most_common(1)[0]
        if count >= self.quorum:
            self.golden[key] = best
            return out == best
        return None

    def forget(self, key: str) -> None:
        """The golden of ``key`` no longer holds (a healthy peer gives other tokens): learn it again."""
        self.golden.pop(key, None)
        self._votes.pop(key, None)
        self._voters.pop(key, None)
