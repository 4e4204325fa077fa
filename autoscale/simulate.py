"""A discrete-event fleet simulator that drives the planners of :mod:`.planner` over a request trace.

Workers follow the simulated worker's latency model (:meth:`fleetward.fleet.config.SimConfig.step_seconds`):
every running sequence gets one token per step, a step takes ``decode_step_ms + decode_ms_per_seq x batch``,
and admitting a prompt holds the whole batch for ``prefill_ms_per_token x prompt tokens`` (the prefill
step), which gives the request its first token. With ``chunked_prefill_tokens`` (the default worker's),
prompts are computed in chunks instead, oldest first, each step ``prefill_ms_per_token x chunk`` longer while
the batch keeps decoding; a request's first token comes with its last chunk. Admission is bounded by
``max_num_seqs`` and the KV cache (prompt + output tokens reserved). The simulation is event by event, not
step by step: between events every running sequence of a worker advances at the same rate, so a worker
keeps one virtual token clock and a heap of finishing points, and a day of trace on hundreds of workers
takes seconds.

Around the workers, what the live fleet does: least-loaded routing to serving workers, requests held at the
router while every serving worker has ``max_num_seqs`` of them (so a new worker takes its share of a
backlog at once); workers that take
``startup_s`` to serve; scale-down that drains (no new requests; streams finish, and those still running
at the drain deadline migrate, as the router migrates them); worker failures at a given rate, whose
streams migrate (re-prefill of prompt + tokens so far on another worker) or, with ``migration=False``,
fail. Every planning interval the policy gets an :class:`~.planner.Observation` and the actuator makes
the healthy count match its decision.

A drain is planned, so its streams keep their KV (``kv_moves=True``, the default): a stream decoding at the
drain deadline moves with the whole KV blocks (``kv_block_size`` tokens) of its prompt and the tokens emitted
so far, all but the last token. The transfer takes ``kv_latency_ms / 1000 + the blocks' tokens x
kv_bytes_per_token / (kv_bandwidth_gbps x 1.25e8)`` seconds; the stream is routed when the transfer ends
(holding no worker's slot meanwhile: the worker it left has stopped), and the worker it lands on computes only
the tokens the blocks do not hold (fewer than a block plus one), so its first token there comes no earlier
than the move plus the transfer plus that tail's prefill. A stream whose KV fills no whole block, or that is
still in its prefill at the deadline, re-prefills as before. A failure loses the KV: its streams always
re-prefill. ``kv_moves=False`` makes a drain re-prefill too, as before this model.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetward.autoscale.capacity import CapacityModel, CapacityPoint, Sla
from fleetward.autoscale.planner import Observation, Policy, StaticPeak
from fleetward.autoscale.traces import TraceRequest
from fleetward.fleet.config import SimConfig

__all__ = ["FleetResult", "FleetSim", "IntervalRecord", "measure_work", "p99", "profile_capacity", "simulate"]

# A worker for the simulator: the sim worker's latency model with a batch small enough that the traces
# need a fleet (tens of workers) rather than one or two, and chunked prefill as vLLM V1 always runs it
# (512 prompt tokens per step: a latency-minded --max-num-batched-tokens).
DEFAULT_WORKER = SimConfig(max_num_seqs=64, kv_capacity_tokens=262144, chunked_prefill_tokens=512)
_EPS = 1e-6  # tokens: the virtual clock is a float summed over a day


@dataclass(slots=True)
class _Req:
    id: int
    arrival: float
    input: int
    output: int
    generated: int = 0  # tokens before the current attempt
    first_token: float | None = None
    finish: float | None = None
    failed: bool = False
    migrations: int = 0
    covered: int = 0  # prompt tokens that arrive as KV with the move: not computed at the next admission


@dataclass(slots=True)
class _Attempt:
    req: _Req
    start_v: float
    finish_v: float
    first_at: float  # when this attempt's prefill ends
    kv: int


class _Worker:
    __slots__ = ("attempts", "config", "heap", "id", "kv_used", "paused_until", "pf", "queue", "ready_at",
                 "started_at", "state", "stopped_at", "t0", "v", "version")

    def __init__(self, wid: int, config: SimConfig, now: float, startup_s: float) -> None:
        self.id, self.config = wid, config
        self.state = "starting"
        self.started_at, self.ready_at = now, now + startup_s
        self.stopped_at: float | None = None
        self.attempts: dict[int, _Attempt] = {}
        self.heap: list[tuple[float, int]] = []
        self.queue: deque[_Req] = deque()
        self.pf: deque[list[Any]] = deque()  # chunked prefill: [request, prompt tokens left, kv], in order
        self.v = self.t0 = self.paused_until = 0.0
        self.kv_used = 0
        self.version = 0

    def clone(self, copy_req: Callable[[_Req], _Req]) -> _Worker:
        new = object.__new__(_Worker)
        new.id, new.config, new.state = self.id, self.config, self.state
        new.started_at, new.ready_at, new.stopped_at = self.started_at, self.ready_at, self.stopped_at
        new.attempts = {rid: _Attempt(copy_req(a.req), a.start_v, a.finish_v, a.first_at, a.kv)
                        for rid, a in self.attempts.items()}
        new.heap = list(self.heap)
        new.queue = deque(copy_req(r) for r in self.queue)
        new.pf = deque([copy_req(e[0]), e[1], e[2]] for e in self.pf)
        new.v, new.t0, new.paused_until = self.v, self.t0, self.paused_until
        new.kv_used, new.version = self.kv_used, self.version
        return new

    @property
    def load(self) -> int:
        return len(self.attempts) + len(self.pf) + len(self.queue)

    def step(self) -> float:
        if self.pf:  # a chunk of the oldest prompt rides along with every decode step
            return self.config.step_seconds(len(self.attempts) + 1, self.config.chunked_prefill_tokens)
        return self.config.step_seconds(len(self.attempts))

    def advance(self, t: float) -> None:
        if t <= self.t0:
            return
        if self.config.chunked_prefill_tokens:
            steps = (t - self.t0) / self.step()
            if self.attempts:
                self.v += steps
            left = steps * self.config.chunked_prefill_tokens
            for entry in self.pf:  # events stop the clock at each prompt's end: at most the head finishes here
                used = min(entry[1], left)
                entry[1] -= used
                left -= used
                if left <= 0:
                    break
            self.t0 = t
            return
        active = t - max(self.t0, min(t, self.paused_until)) if self.paused_until > self.t0 else t - self.t0
        if self.attempts and active > 0:
            self.v += active / self.step()
        self.t0 = t

    def _start(self, req: _Req, first_at: float, kv: int) -> None:
        if req.first_token is None:
            req.first_token = first_at
        rest = max(0, req.output - req.generated - 1)  # the prefill step gives one token
        a = _Attempt(req, self.v, self.v + rest, first_at, kv)
        self.attempts[req.id] = a
        heapq.heappush(self.heap, (a.finish_v, req.id))

    def admit(self, t: float) -> list[_Req]:
        """Start queued requests while there is room; returns them (without chunked prefill their first token
        time is set now; with it, when their last chunk is done: :meth:`prefilled`)."""
        c = self.config
        started = []
        while self.queue and len(self.attempts) + len(self.pf) < c.max_num_seqs:
            req = self.queue[0]
            kv = req.input + req.output
            if (self.attempts or self.pf) and self.kv_used + kv > c.kv_capacity_tokens:
                break
            self.queue.popleft()
            prompt = req.input + req.generated - req.covered
            req.covered = 0  # the blocks have landed: a later move or failure starts from this worker's state
            self.kv_used += kv
            if c.chunked_prefill_tokens:
                self.pf.append([req, float(prompt), kv])
            else:
                self.paused_until = max(self.paused_until, t) + c.prefill_ms_per_token * prompt / 1000.0
                self._start(req, self.paused_until, kv)
            started.append(req)
        return started

    def prefilled(self, t: float) -> None:
        """Chunked prefill: prompts whose last chunk is done start decoding (their first token is now)."""
        while self.pf and self.pf[0][1] <= _EPS:
            req, _, kv = self.pf.popleft()
            self._start(req, t, kv)

    def next_event(self) -> float | None:
        while self.heap and self.heap[0][1] not in self.attempts:
            heapq.heappop(self.heap)
        times = []
        if self.heap:
            start = max(self.t0, self.paused_until)
            times.append(start + max(0.0, self.heap[0][0] - self.v) * self.step())
        if self.pf:
            times.append(self.t0 + self.pf[0][1] / self.config.chunked_prefill_tokens * self.step())
        return min(times) if times else None

    def finish_due(self, t: float) -> list[_Req]:
        done = []
        while self.heap and (self.heap[0][1] not in self.attempts or self.heap[0][0] <= self.v + _EPS):
            _, rid = heapq.heappop(self.heap)
            a = self.attempts.pop(rid, None)
            if a is None:
                continue
            self.kv_used -= a.kv
            a.req.finish = max(t, a.first_at)
            done.append(a.req)
        self.prefilled(t)
        return done

    def take_all(self, t: float) -> list[_Req]:
        """Every request here, with the tokens each has so far (the worker stops or dies)."""
        out = list(self.queue)
        self.queue.clear()
        for a in self.attempts.values():
            if t >= a.first_at:
                a.req.generated = min(a.req.output - 1, a.req.generated + 1 + int(self.v - a.start_v + _EPS))
            out.append(a.req)
        out += [entry[0] for entry in self.pf]  # mid-prefill: no token yet
        self.pf.clear()
        self.attempts.clear()
        self.heap.clear()
        self.kv_used = 0
        return out


@dataclass(frozen=True, slots=True)
class IntervalRecord:
    t: float
    arrival_rate: float
    desired: int
    healthy: int
    starting: int
    ttft_p99: float | None
    itl_p99: float | None


@dataclass
class FleetResult:
    policy: str
    requests: int
    met: int
    failed: int
    cut_streams: int  # streams cut by a scale-down: the drain must keep this at 0
    migrated: int
    worker_hours: float
    scale_events: int
    ttft_p99: float | None = None  # over every request that got a first token
    itl_p99: float | None = None  # of the requests' mean ITL, over every finished request
    kv_moves: int = 0  # of the migrated streams, those that took their KV along (a drain's)
    timeline: list[IntervalRecord] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    @property
    def sla_attainment(self) -> float:
        return self.met / self.requests if self.requests else 1.0

    @property
    def goodput_per_worker_hour(self) -> float:
        return self.met / self.worker_hours if self.worker_hours else 0.0

    def summary(self) -> dict[str, Any]:
        return {"sla_attainment": round(self.sla_attainment, 5), "worker_hours": round(self.worker_hours, 3),
                "cut_streams": self.cut_streams, "goodput_per_worker_hour": round(self.goodput_per_worker_hour, 1),
                "scale_events": self.scale_events, "requests": self.requests, "failed": self.failed,
                "migrated": self.migrated, "kv_moves": self.kv_moves}


def p99(values: list[float]) -> float | None:
    """The nearest-rank 99th percentile of ``values`` (sorted in place); None for none."""
    if not values:
        return None
    values.sort()
    return values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]


def _mean_itl(r: _Req) -> float:
    assert r.first_token is not None and r.finish is not None
    return (r.finish - r.first_token) / (r.output - 1) if r.output > 1 else 0.0


class FleetSim:
    """The simulated fleet (module docstring): :meth:`run` drives it with a policy up to a time, :meth:`clone`
    copies the state of what is in flight (not the requests already finished) so that a search can try
    several futures from the same instant (:mod:`.oracle`)."""

    def __init__(self, requests: Sequence[TraceRequest], *, sla: Sla, startup_s: float,
                 config: SimConfig = DEFAULT_WORKER, interval_s: float = 30.0, initial_workers: int = 1,
                 failures_per_worker_hour: float = 0.0, migration: bool = True, drain_deadline_s: float = 300.0,
                 kv_moves: bool = True, seed: int = 0) -> None:
        self.requests, self.sla, self.startup_s, self.config = requests, sla, startup_s, config
        self.interval_s = interval_s
        self.failure_rate, self.migration, self.drain_deadline_s = failures_per_worker_hour, migration, drain_deadline_s
        self.kv_moves = kv_moves
        self.moving: dict[int, _Req] = {}  # streams whose KV is on the wire, by request id
        self.rng = random.Random(seed)
        self.events: list[tuple[float, int, str, int]] = []
        self._seq = 0
        self.workers: dict[int, _Worker] = {}
        self._ids = 0
        self.pending: deque[_Req] = deque()  # every serving worker full (or none serving): held at the router
        self.reqs: list[_Req] = []  # every request that arrived (in a clone: since it was made)
        self.next_index = 0  # the next request of ``requests`` to arrive
        self.open = 0  # arrived and not finished
        self.failed = self.migrated = self.moved_kv = self.scale_events = 0
        self.done_in_interval: list[_Req] = []
        self.arrivals_in_interval: list[_Req] = []
        self.timeline: list[IntervalRecord] = []
        self.reasons: list[str] = []
        self.carried: list[_Req] = []  # in a clone: the requests in flight when it was made
        self.t = 0.0
        for _ in range(initial_workers):
            w = _Worker(self._next_id(), config, 0.0, 0.0)
            w.state = "ready"
            self.workers[w.id] = w
        if requests:
            self._push(requests[0].arrival_s, "arrive", 0)
        self._push(interval_s, "plan", 0)
        if failures_per_worker_hour > 0:
            self._push(self.rng.expovariate(failures_per_worker_hour / 3600.0), "fail", 0)

    # -- state ----------------------------------------------------------------------------------------------

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids - 1

    def _push(self, t: float, kind: str, ref: int) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, ref))

    @property
    def done(self) -> bool:
        return self.next_index >= len(self.requests) and self.open == 0 and not self.pending

    def clone(self) -> FleetSim:
        """An independent copy of the fleet now: workers, what they run, the router's queue, the events to come.
        Requests that finished are not copied: the copy's :attr:`reqs` starts empty."""
        new = object.__new__(FleetSim)
        new.__dict__.update(self.__dict__)
        memo: dict[int, _Req] = {}

        def copy_req(r: _Req) -> _Req:
            c = memo.get(r.id)
            if c is None:
                c = memo[r.id] = _Req(r.id, r.arrival, r.input, r.output, r.generated, r.first_token, r.finish,
                                      r.failed, r.migrations, r.covered)
            return c

        new.workers = {wid: w.clone(copy_req) for wid, w in self.workers.items()}
        new.pending = deque(copy_req(r) for r in self.pending)
        new.moving = {rid: copy_req(r) for rid, r in self.moving.items()}
        new.events = list(self.events)
        new.rng = random.Random()
        new.rng.setstate(self.rng.getstate())
        new.reqs, new.done_in_interval, new.arrivals_in_interval = [], [], []
        new.timeline, new.reasons = [], []
        new.carried = list(memo.values())
        return new

    def serving(self) -> list[_Worker]:
        return [w for w in self.workers.values() if w.state == "ready"]

    # -- what happens -----------------------------------------------------------------------------------------

    def _reschedule(self, w: _Worker) -> None:
        w.version += 1
        t = w.next_event()
        if t is not None:
            self._push(t, "worker", w.id * 1_000_000_000 + w.version % 1_000_000_000)

    def _route(self, t: float, batch: Sequence[_Req]) -> None:
        ready = self.serving()
        touched: dict[int, _Worker] = {}
        limit = self.config.max_num_seqs
        for r in batch:
            w = min(ready, key=lambda x: (x.load, x.id)) if ready else None
            if w is None or w.load >= limit:
                self.pending.append(r)
                continue
            w.advance(t)
            w.queue.append(r)
            w.admit(t)
            touched[w.id] = w
        for w in touched.values():
            self._reschedule(w)

    def _complete(self, t: float, w: _Worker) -> None:
        w.advance(t)
        done = w.finish_due(t)
        self.open -= len(done)
        self.done_in_interval.extend(done)
        while self.pending and w.state == "ready" and w.load < self.config.max_num_seqs:
            w.queue.append(self.pending.popleft())
        w.admit(t)
        if w.state == "draining" and not w.load:
            self._stop(t, w)
        else:
            self._reschedule(w)

    def _stop(self, t: float, w: _Worker) -> None:
        w.state, w.stopped_at = "stopped", t
        w.version += 1

    def _displace(self, t: float, w: _Worker, *, failure: bool) -> None:
        w.advance(t)
        keeps_kv = self.kv_moves and not failure
        decoding = {rid for rid, a in w.attempts.items() if t >= a.first_at} if keeps_kv else set()
        moved = w.take_all(t)
        self._stop(t, w)
        if failure:
            for r in moved:
                r.covered = 0  # KV that had come here for a request still queued is lost with the worker
        if failure and not self.migration:
            for r in moved:
                if r.first_token is not None:
                    r.failed = True
                    self.open -= 1
                    self.failed += 1
                else:
                    self._route(t, [r])
            return
        for r in moved:
            if r.first_token is not None:
                r.migrations += 1
                self.migrated += 1
        if decoding:
            moved = [r for r in moved if not (r.id in decoding and self._move_kv(t, r))]
        self._route(t, moved)

    def _move_kv(self, t: float, r: _Req) -> bool:
        """Send ``r``'s whole KV blocks on the wire, to be routed when they arrive; False when it fills no block."""
        c = self.config
        covered = (r.input + r.generated - 1) // c.kv_block_size * c.kv_block_size
        if covered <= 0:
            return False
        r.covered = covered
        self.moved_kv += 1
        self.moving[r.id] = r
        self._push(t + c.kv_latency_ms / 1000.0 + covered * c.kv_bytes_per_token / (c.kv_bandwidth_gbps * 1.25e8),
                   "kv", r.id)
        return True

    def actuate(self, t: float, desired: int) -> None:
        """Make the serving and starting workers ``desired``: undrain, then start (ready after ``startup_s``);
        or stop starting ones, then drain the least loaded (their streams finish, or move at the deadline)."""
        starting = [w for w in self.workers.values() if w.state == "starting"]
        ready = self.serving()
        have = len(starting) + len(ready)
        if desired > have:
            self.scale_events += 1
            for w in [w for w in self.workers.values() if w.state == "draining"][: desired - have]:
                w.state = "ready"  # undrain before starting anew
                have += 1
                self._reschedule(w)
            for _ in range(desired - have):
                w = _Worker(self._next_id(), self.config, t, self.startup_s)
                self.workers[w.id] = w
                if self.startup_s > 0:
                    self._push(w.ready_at, "ready", w.id)
                else:
                    self._ready(t, w)
        elif desired < have:
            self.scale_events += 1
            extra = have - desired
            for w in sorted(starting, key=lambda x: -x.ready_at)[:extra]:
                self._stop(t, w)
                extra -= 1
            for w in sorted(ready, key=lambda x: (x.load, -x.id))[:extra]:
                w.state = "draining"
                w.advance(t)
                queued = list(w.queue)
                w.queue.clear()
                self._route(t, queued)
                if not w.attempts and not w.pf:
                    self._stop(t, w)
                else:
                    self._push(t + self.drain_deadline_s, "deadline", w.id)

    def _ready(self, t: float, w: _Worker) -> None:
        w.state = "ready"
        w.t0 = t
        waiting = list(self.pending)
        self.pending.clear()
        self._route(t, waiting)

    def observe(self, t: float) -> Observation:
        """The interval that ends at ``t``, as a policy sees it."""
        ready = self.serving()
        done = self.done_in_interval
        ttft = p99([r.first_token - r.arrival for r in done if r.first_token is not None])
        itl = p99([_mean_itl(r) for r in done])
        arrivals = self.arrivals_in_interval
        n = len(arrivals)
        return Observation(
            now=t, interval_s=self.interval_s, arrival_rate=n / self.interval_s, healthy=len(ready),
            starting=sum(w.state == "starting" for w in self.workers.values()),
            mean_input=sum(r.input for r in arrivals) / n if n else 0.0,
            mean_output=sum(r.output for r in arrivals) / n if n else 0.0,
            ttft_p99=ttft, itl_p99=itl,
            queue_depth=sum(len(w.queue) for w in ready) + len(self.pending),
            kv_usage=sum(w.kv_used for w in ready) / (len(ready) * self.config.kv_capacity_tokens) if ready else 0.0)

    def run(self, policy: Policy | None, *, until: float = math.inf,
            on_progress: Callable[[float], None] | None = None) -> None:
        """Handle every event before ``until`` (or to the end of the trace and its streams). At each planning
        interval ``policy`` decides and the fleet is made to match; without one the fleet stays as it is."""
        end_of_trace = self.requests[-1].arrival_s if self.requests else 0.0
        events = self.events
        while events and events[0][0] < until:
            t, _, kind, ref = heapq.heappop(events)
            self.t = t
            if kind == "arrive":
                nxt = self.requests[self.next_index]
                r = _Req(self.next_index, nxt.arrival_s, max(1, nxt.input_tokens), max(1, nxt.output_tokens))
                self.next_index += 1
                self.open += 1
                self.reqs.append(r)
                self.arrivals_in_interval.append(r)
                self._route(t, [r])
                if self.next_index < len(self.requests):
                    self._push(self.requests[self.next_index].arrival_s, "arrive", 0)
            elif kind == "worker":
                w = self.workers[ref // 1_000_000_000]
                if w.state in ("ready", "draining") and ref % 1_000_000_000 == w.version % 1_000_000_000:
                    self._complete(t, w)
            elif kind == "ready":
                w = self.workers[ref]
                if w.state == "starting":
                    self._ready(t, w)
            elif kind == "deadline":
                w = self.workers[ref]
                if w.state == "draining":
                    self._displace(t, w, failure=False)  # still running at the deadline: migrate, never cut
            elif kind == "kv":
                self._route(t, [self.moving.pop(ref)])  # its KV arrived: on to a worker
            elif kind == "fail":
                ready = self.serving()
                if ready:
                    self._displace(t, self.rng.choice(ready), failure=True)
                alive = max(1, len(self.serving()))
                self._push(t + self.rng.expovariate(self.failure_rate * alive / 3600.0), "fail", 0)
            elif kind == "plan":
                if policy is not None:
                    obs = self.observe(t)
                    decision = policy.decide(obs)
                    self.reasons.append(f"{t:.0f}s {decision.desired}: {decision.reason}")
                    self.timeline.append(IntervalRecord(t, obs.arrival_rate, decision.desired, obs.healthy,
                                                        obs.starting, obs.ttft_p99, obs.itl_p99))
                    self.actuate(t, decision.desired)
                self.done_in_interval.clear()
                self.arrivals_in_interval.clear()
                if on_progress is not None:
                    on_progress(min(t, end_of_trace))
                if not self.done:
                    self._push(t + self.interval_s, "plan", 0)
            if self.done:
                break

    def met(self, r: _Req) -> bool:
        """``r`` finished within the SLA (its own TTFT target, by its prompt length, and the ITL target)."""
        return (not r.failed and r.first_token is not None and r.finish is not None
                and r.first_token - r.arrival <= self.sla.ttft_for(r.input) and _mean_itl(r) <= self.sla.itl_s)

    def met_so_far(self, r: _Req) -> bool:
        """``r`` is within the SLA as far as it got by now (:attr:`t`): finished and met; or its first token in
        time and every token since at the ITL target on average; or still waiting for its first token and not
        late yet."""
        if r.finish is not None or r.failed:
            return self.met(r)
        target = self.sla.ttft_for(r.input)
        if r.first_token is None:
            return self.t - r.arrival <= target
        if r.first_token - r.arrival > target:
            return False
        tokens = self._tokens_so_far(r)
        return tokens <= 1 or (self.t - r.first_token) / (tokens - 1) <= self.sla.itl_s

    def _tokens_so_far(self, r: _Req) -> float:
        for w in self.workers.values():
            a = w.attempts.get(r.id)
            if a is not None:
                w.advance(self.t)
                return r.generated + 1 + (w.v - a.start_v)
        return r.generated + 1

    def result(self, name: str) -> FleetResult:
        t = self.t
        worker_hours = sum(((w.stopped_at if w.stopped_at is not None else t) - w.started_at)
                           for w in self.workers.values()) / 3600.0
        served = [r for r in self.reqs if not r.failed and r.first_token is not None and r.finish is not None]
        return FleetResult(name, len(self.reqs), sum(1 for r in served if self.met(r)), self.failed, 0,
                           self.migrated, worker_hours, self.scale_events,
                           p99([r.first_token - r.arrival for r in served]),  # type: ignore[operator]
                           p99([_mean_itl(r) for r in served]), self.moved_kv, self.timeline, self.reasons)


def simulate(requests: Sequence[TraceRequest], policy: Policy, *, sla: Sla, startup_s: float,
             config: SimConfig = DEFAULT_WORKER, interval_s: float = 30.0, initial_workers: int = 1,
             failures_per_worker_hour: float = 0.0, migration: bool = True, drain_deadline_s: float = 300.0,
             kv_moves: bool = True, seed: int = 0, on_progress: Callable[[float], None] | None = None) -> FleetResult:
    """Run ``requests`` through a fleet that ``policy`` scales; see the module docstring."""
    sim = FleetSim(requests, sla=sla, startup_s=startup_s, config=config, interval_s=interval_s,
                   initial_workers=initial_workers, failures_per_worker_hour=failures_per_worker_hour,
                   migration=migration, drain_deadline_s=drain_deadline_s, kv_moves=kv_moves, seed=seed)
    sim.run(policy, on_progress=on_progress)
    return sim.result(policy.name)


def profile_capacity(sample: Sequence[TraceRequest], *, startup_s: float, config: SimConfig = DEFAULT_WORKER,
                     duration_s: float = 600.0, seed: int = 0, sla: Sla | None = None, workers: int = 4,
                     min_requests: int = 400) -> CapacityModel:
    """Measure what one simulated worker carries at rising Poisson load, with request lengths drawn from
    ``sample``: the capacity model the planners use, with the mix it was measured at and the work model
    (:func:`measure_work`).

    The load is offered to ``workers`` workers behind the router's least-loaded routing, and each point is
    per worker: what one worker carries *in a fleet*, where a short prompt goes to another worker rather than
    wait behind a long one's prefill (with heavy-tailed prompts a lone worker's p99 TTFT is that wait, and
    says nothing of a fleet's). Each rate runs ``duration_s`` or until ``min_requests`` arrived, whichever is
    longer: a p99 of a few dozen requests is their maximum, noise that would decide the capacity."""
    sla = sla or Sla()
    rng = random.Random(seed)
    points: list[CapacityPoint] = []
    rate = 0.05
    for _ in range(80):
        t, reqs = 0.0, []
        length = max(duration_s, min_requests / (rate * workers))
        while True:
            t += rng.expovariate(rate * workers)
            if t > length:
                break
            s = rng.choice(sample)
            reqs.append(TraceRequest(t, s.input_tokens, s.output_tokens))
        if len(reqs) >= 20:
            sim = FleetSim(reqs, sla=sla, startup_s=0.0, config=config, interval_s=length, initial_workers=workers)
            sim.run(StaticPeak(workers))
            served = [r for r in sim.reqs if r.first_token is not None and r.finish is not None]
            ttft = p99([sla.base_ttft(r.first_token - r.arrival, r.input) for r in served])  # type: ignore[operator]
            itl = p99([_mean_itl(r) for r in served])
            if ttft is not None and itl is not None:
                points.append(CapacityPoint(rate, ttft, itl))
                if ttft > 60.0:  # far past any SLA: the queue only grows from here
                    break
        rate *= 1.15
    prefill, decode = measure_work(config)
    return CapacityModel(tuple(points), startup_s, sum(r.input_tokens for r in sample) / len(sample),
                         sum(r.output_tokens for r in sample) / len(sample), prefill, decode, sla.ttft_per_1k_s)


def measure_work(config: SimConfig = DEFAULT_WORKER, *, prompt_tokens: int = 8192,
                 output_tokens: int = 256) -> tuple[float, float]:
    """The work model of one simulated worker, measured as ``fleetward profile`` measures a live one: prompt
    tokens/s (one long prompt alone, one token of answer) and seconds per output token at a full batch
    (``max_num_seqs`` one-token prompts answered at once: their mean ITL over the batch)."""
    sla = Sla(math.inf, math.inf)
    alone = FleetSim([TraceRequest(0.0, prompt_tokens, 1)], sla=sla, startup_s=0.0, config=config)
    alone.run(StaticPeak(1))
    first = alone.reqs[0].first_token
    assert first is not None
    batch = config.max_num_seqs
    full = FleetSim([TraceRequest(0.0, 1, output_tokens)] * batch, sla=sla, startup_s=0.0, config=config)
    full.run(StaticPeak(1))
    itl = sum(_mean_itl(r) for r in full.reqs) / batch
    return prompt_tokens / max(first, 1e-9), itl / batch
