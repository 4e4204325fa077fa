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
"""

from __future__ import annotations

import heapq
import itertools
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

__all__ = ["FleetResult", "IntervalRecord", "p99", "profile_capacity", "simulate"]

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
            prompt = req.input + req.generated
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
                "migrated": self.migrated}


def p99(values: list[float]) -> float | None:
    """The nearest-rank 99th percentile of ``values`` (sorted in place); None for none."""
    if not values:
        return None
    values.sort()
    return values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]


def _mean_itl(r: _Req) -> float:
    assert r.first_token is not None and r.finish is not None
    return (r.finish - r.first_token) / (r.output - 1) if r.output > 1 else 0.0


def simulate(requests: Sequence[TraceRequest], policy: Policy, *, sla: Sla, startup_s: float,
             config: SimConfig = DEFAULT_WORKER, interval_s: float = 30.0, initial_workers: int = 1,
             failures_per_worker_hour: float = 0.0, migration: bool = True, drain_deadline_s: float = 300.0,
             seed: int = 0, on_progress: Callable[[float], None] | None = None) -> FleetResult:
    """Run ``requests`` through a fleet that ``policy`` scales; see the module docstring."""
    rng = random.Random(seed)
    seq = itertools.count()
    events: list[tuple[float, int, str, int]] = []
    workers: dict[int, _Worker] = {}
    ids = itertools.count()
    pending: deque[_Req] = deque()  # every serving worker full (or none serving): requests wait at the router
    reqs: list[_Req] = []
    stats = {"failed": 0, "migrated": 0, "scale_events": 0}
    done_in_interval: list[_Req] = []
    arrivals_in_interval: list[_Req] = []
    timeline: list[IntervalRecord] = []
    reasons: list[str] = []
    end_of_trace = requests[-1].arrival_s if requests else 0.0
    finished = 0

    def push(t: float, kind: str, ref: int) -> None:
        heapq.heappush(events, (t, next(seq), kind, ref))

    def reschedule(w: _Worker) -> None:
        w.version += 1
        t = w.next_event()
        if t is not None:
            push(t, "worker", w.id * 1_000_000_000 + w.version % 1_000_000_000)

    def start_worker(t: float) -> None:
        w = _Worker(next(ids), config, t, startup_s)
        workers[w.id] = w
        push(w.ready_at, "ready", w.id)

    def serving() -> list[_Worker]:
        return [w for w in workers.values() if w.state == "ready"]

    def route(t: float, batch: Sequence[_Req]) -> None:
        ready = serving()
        touched: dict[int, _Worker] = {}
        for r in batch:
            w = min(ready, key=lambda x: (x.load, x.id)) if ready else None
            if w is None or w.load >= config.max_num_seqs:
                pending.append(r)
                continue
            w.advance(t)
            w.queue.append(r)
            w.admit(t)
            touched[w.id] = w
        for w in touched.values():
            reschedule(w)

    def complete(t: float, w: _Worker) -> None:
        nonlocal finished
        w.advance(t)
        done = w.finish_due(t)
        finished += len(done)
        done_in_interval.extend(done)
        while pending and w.state == "ready" and w.load < config.max_num_seqs:
            w.queue.append(pending.popleft())
        w.admit(t)
        if w.state == "draining" and not w.load:
            stop(t, w)
        else:
            reschedule(w)

    def stop(t: float, w: _Worker) -> None:
        w.state, w.stopped_at = "stopped", t
        w.version += 1

    def displace(t: float, w: _Worker, *, failure: bool) -> None:
        nonlocal finished
        w.advance(t)
        moved = w.take_all(t)
        stop(t, w)
        if failure and not migration:
            for r in moved:
                if r.first_token is not None:
                    r.failed = True
                    finished += 1
                    stats["failed"] += 1
                else:
                    route(t, [r])
            return
        for r in moved:
            if r.first_token is not None:
                r.migrations += 1
                stats["migrated"] += 1
        route(t, moved)

    def actuate(t: float, desired: int) -> None:
        starting = [w for w in workers.values() if w.state == "starting"]
        ready = serving()
        have = len(starting) + len(ready)
        if desired > have:
            stats["scale_events"] += 1
            for w in [w for w in workers.values() if w.state == "draining"][: desired - have]:
                w.state = "ready"  # undrain before starting anew
                have += 1
                reschedule(w)
            for _ in range(desired - have):
                start_worker(t)
        elif desired < have:
            stats["scale_events"] += 1
            extra = have - desired
            for w in sorted(starting, key=lambda x: -x.ready_at)[:extra]:
                stop(t, w)
                extra -= 1
            for w in sorted(ready, key=lambda x: (x.load, -x.id))[:extra]:
                w.state = "draining"
                w.advance(t)
                queued = list(w.queue)
                w.queue.clear()
                route(t, queued)
                if not w.attempts and not w.pf:
                    stop(t, w)
                else:
                    push(t + drain_deadline_s, "deadline", w.id)

    def observe(t: float) -> Observation:
        ready = serving()
        ttft = p99([r.first_token - r.arrival for r in done_in_interval if r.first_token is not None])
        itl = p99([_mean_itl(r) for r in done_in_interval])
        n = len(arrivals_in_interval)
        return Observation(
            now=t, interval_s=interval_s, arrival_rate=n / interval_s, healthy=len(ready),
            starting=sum(w.state == "starting" for w in workers.values()),
            mean_input=sum(r.input for r in arrivals_in_interval) / n if n else 0.0,
            mean_output=sum(r.output for r in arrivals_in_interval) / n if n else 0.0,
            ttft_p99=ttft, itl_p99=itl, queue_depth=sum(len(w.queue) for w in ready) + len(pending),
            kv_usage=sum(w.kv_used for w in ready) / (len(ready) * config.kv_capacity_tokens) if ready else 0.0)

    for _ in range(initial_workers):
        w = _Worker(next(ids), config, 0.0, 0.0)
        w.state = "ready"
        workers[w.id] = w
    it = iter(requests)
    nxt = next(it, None)
    if nxt is not None:
        push(nxt.arrival_s, "arrive", 0)
    push(interval_s, "plan", 0)
    if failures_per_worker_hour > 0:
        push(rng.expovariate(failures_per_worker_hour / 3600.0), "fail", 0)
    t = 0.0
    while events:
        t, _, kind, ref = heapq.heappop(events)
        if kind == "arrive":
            assert nxt is not None
            r = _Req(len(reqs), nxt.arrival_s, max(1, nxt.input_tokens), max(1, nxt.output_tokens))
            reqs.append(r)
            arrivals_in_interval.append(r)
            route(t, [r])
            nxt = next(it, None)
            if nxt is not None:
                push(nxt.arrival_s, "arrive", 0)
        elif kind == "worker":
            w = workers[ref // 1_000_000_000]
            if w.state in ("ready", "draining") and ref % 1_000_000_000 == w.version % 1_000_000_000:
                complete(t, w)
        elif kind == "ready":
            w = workers[ref]
            if w.state == "starting":
                w.state = "ready"
                w.t0 = t
                waiting = list(pending)
                pending.clear()
                route(t, waiting)
        elif kind == "deadline":
            w = workers[ref]
            if w.state == "draining":
                displace(t, w, failure=False)  # still running at the deadline: migrate, never cut
        elif kind == "fail":
            ready = serving()
            if ready:
                displace(t, rng.choice(ready), failure=True)
            alive = max(1, len(serving()))
            push(t + rng.expovariate(failures_per_worker_hour * alive / 3600.0), "fail", 0)
        elif kind == "plan":
            obs = observe(t)
            decision = policy.decide(obs)
            reasons.append(f"{t:.0f}s {decision.desired}: {decision.reason}")
            timeline.append(IntervalRecord(t, obs.arrival_rate, decision.desired, obs.healthy, obs.starting,
                                           obs.ttft_p99, obs.itl_p99))
            actuate(t, decision.desired)
            done_in_interval.clear()
            arrivals_in_interval.clear()
            if on_progress is not None:
                on_progress(min(t, end_of_trace))
            if nxt is not None or finished < len(reqs) or pending:
                push(t + interval_s, "plan", 0)
        if nxt is None and finished >= len(reqs) and not pending:
            break
    worker_hours = sum(((w.stopped_at if w.stopped_at is not None else t) - w.started_at)
                       for w in workers.values()) / 3600.0
    met = sum(1 for r in reqs if not r.failed and r.first_token is not None and r.finish is not None
              and r.first_token - r.arrival <= sla.ttft_s and _mean_itl(r) <= sla.itl_s)
    served = [r for r in reqs if not r.failed and r.first_token is not None and r.finish is not None]
    return FleetResult(policy.name, len(reqs), met, stats["failed"], 0, stats["migrated"], worker_hours,
                       stats["scale_events"], p99([r.first_token - r.arrival for r in served]),  # type: ignore[operator]
                       p99([_mean_itl(r) for r in served]), timeline, reasons)


def profile_capacity(sample: Sequence[TraceRequest], *, startup_s: float, config: SimConfig = DEFAULT_WORKER,
                     duration_s: float = 600.0, seed: int = 0, sla: Sla | None = None) -> CapacityModel:
    """Measure one simulated worker at rising Poisson load, with request lengths drawn from ``sample``:
    the capacity model the planners use (the same measurement ``fleetward profile`` makes on a live worker)."""
    rng = random.Random(seed)
    points: list[CapacityPoint] = []
    rate = 0.05
    for _ in range(80):
        t, reqs = 0.0, []
        while True:
            t += rng.expovariate(rate)
            if t > duration_s:
                break
            s = rng.choice(sample)
            reqs.append(TraceRequest(t, s.input_tokens, s.output_tokens))
        if len(reqs) >= 20:
            result = simulate(reqs, StaticPeak(1), sla=sla or Sla(), startup_s=0.0, config=config,
                              interval_s=duration_s)
            if result.ttft_p99 is not None and result.itl_p99 is not None:
                points.append(CapacityPoint(rate, result.ttft_p99, result.itl_p99))
                if result.ttft_p99 > 60.0:  # far past any SLA: the queue only grows from here
                    break
        rate *= 1.15
    return CapacityModel.from_points(points, startup_s)
