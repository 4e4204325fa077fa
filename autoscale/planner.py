"""Scaling policies, sans IO: one :class:`Observation` per planning interval in, one :class:`Decision` out.

Every policy sees the same observation (what the fleet's shared channels give: arrival rate, request
lengths, TTFT/ITL percentiles, queue depth, KV use, healthy capacity) and answers with the number of
*healthy* workers the pool should have. Workers that are unhealthy, draining or quarantined are not in
``healthy``, so a policy that keeps its answer makes the actuator replace them.

- :class:`Planner` (fleetward's): the predicted load over the time a new worker needs to start, plus a margin
  learned from how far recent forecasts fell short (at least ``headroom``), in the units the work costs
  (an aggregated pool's requests weighed by their prompt and output tokens against the mix the capacity was
  measured at), turned into workers by the measured :class:`~fleetward.autoscale.capacity.CapacityModel`,
  times a trust factor learned from intervals that met the SLA at high load; up at once, down only after
  ``down_stable`` intervals all wanting fewer, by at least ``hysteresis``; a feedback step up while the SLA
  is being missed.
- :class:`StaticPeak`: provisioning for the peak, never changing.
- :class:`Reactive`: a Kubernetes-HPA-like rule on queue depth and KV use per worker (10 % tolerance,
  a 5-minute scale-down stabilisation window).
- :class:`DynamoStyle`: Dynamo's planner shape: last interval's load over the interpolated per-worker
  throughput, scaled by a correction factor (observed over expected latency); reactive, no lookahead.

The oracle is not here: it plans by no rule but searches the simulator with the whole trace known
(:mod:`fleetward.autoscale.oracle`).

The planner and the Dynamo-style policy plan a pool in its own unit of work
(:class:`~fleetward.autoscale.capacity.PoolCapacity`): an aggregated pool in requests/s against TTFT and
ITL; a prefill pool in prompt tokens/s (arrival rate x mean prompt length) against TTFT only; a decode pool
in output tokens/s (arrival rate x mean output length, i.e. its concurrent streams at the ITL target)
against ITL only. The observation's latencies are the routers' (end to end): a prefill pool looks at its
TTFT, a decode pool at its ITL.

Times come in with the observation (``now``), never from a clock: the planner is tested on scripted
series and driven by the simulator at any speed.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from fleetward.autoscale.capacity import SLOS, CapacityModel, PoolCapacity, Sla
from fleetward.autoscale.predict import Predictor, make_predictor
from fleetward.fleet.errors import ConfigError

__all__ = ["POLICIES", "Decision", "DynamoStyle", "Observation", "Planner", "Policy", "Reactive", "StaticPeak",
           "check_bounds"]


@dataclass(frozen=True, slots=True)
class Observation:
    """One planning interval of one pool, as the shared channels show it."""

    now: float
    interval_s: float
    arrival_rate: float  # requests/s over the interval
    healthy: int  # serving and healthy (not draining, not quarantined)
    starting: int = 0  # asked for, not serving yet
    mean_input: float = 0.0  # prompt tokens per request (0: none finished in the interval)
    mean_output: float = 0.0  # output tokens per request (0: none finished, or a prefill pool: not observed)
    ttft_p99: float | None = None  # of requests whose first token came in the interval
    itl_p99: float | None = None  # of requests that finished in the interval (their mean ITL)
    queue_depth: int = 0  # requests waiting in the workers' queues
    kv_usage: float = 0.0  # mean KV-cache use over healthy workers, 0..1
    unhealthy: int = 0  # counted for the reason only


@dataclass(frozen=True, slots=True)
class Decision:
    desired: int  # healthy workers wanted (starting ones count towards it)
    reason: str


class Policy(Protocol):
    name: str

    def decide(self, obs: Observation) -> Decision: ...


def check_bounds(min_workers: int, max_workers: int) -> None:
    if min_workers < 0 or max_workers < 1 or min_workers > max_workers:
        raise ConfigError(f"autoscale bounds: min {min_workers}, max {max_workers}: need 0 <= min <= max and max >= 1")


def _clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, n))


def _pool(capacity: CapacityModel | PoolCapacity) -> PoolCapacity:
    return capacity if isinstance(capacity, PoolCapacity) else PoolCapacity.measured(capacity, "aggregated")


class _Work:
    """A pool's unit of work per request: for an aggregated pool, what a request of the interval's mix costs
    against one of the mix the capacity was measured at (the work model: prompt tokens and output tokens;
    1 without it); the mean prompt (prefill) or output (decode) tokens otherwise. The last interval that saw
    any when this one saw none; at first, the mix the capacity was measured at."""

    def __init__(self, pool: PoolCapacity) -> None:
        self.role, self.curve = pool.role, pool.curve
        self.per_request = 1.0 if pool.role == "aggregated" else (pool.tokens_per_request or 0.0)

    def observe(self, obs: Observation) -> float:
        if self.role == "aggregated":
            if obs.mean_input > 0:  # smoothed: an interval's mix is a small sample of the service's
                cost = self.curve.relative_cost(obs.mean_input, obs.mean_output)
                self.per_request += _MIX_SMOOTHING * (cost - self.per_request)
            return self.per_request
        seen = obs.mean_input if self.role == "prefill" else obs.mean_output if self.role == "decode" else 0.0
        if seen > 0:
            self.per_request = seen
        return self.per_request

    def missed(self, obs: Observation, sla: Sla) -> bool:
        slos = SLOS[self.role]
        return ("ttft" in slos and obs.ttft_p99 is not None and obs.ttft_p99 > sla.ttft_for(obs.mean_input)) or \
               ("itl" in slos and obs.itl_p99 is not None and obs.itl_p99 > sla.itl_s)


_MIX_SMOOTHING = 0.2  # an exponential average of the intervals' request cost: about the last five intervals


class Planner:
    """fleetward's planner (module docstring)."""

    name = "fleetward"

    def __init__(self, capacity: CapacityModel | PoolCapacity, sla: Sla, *, min_workers: int = 1,
                 max_workers: int = 64, predictor: Predictor | str = "holt-winters", headroom: float = 0.1,
                 hysteresis: int = 1, down_stable: int = 6, miss_intervals: int = 2, margin_quantile: float = 0.95,
                 margin_history: int = 40, trust_max: float = 1.25) -> None:
        check_bounds(min_workers, max_workers)
        self.pool = _pool(capacity)
        self.capacity, self.sla = self.pool.curve, sla
        self.per_worker = self.pool.max_rate(sla)  # in the pool's unit; raises when no load meets the SLA
        self._work = _Work(self.pool)
        self.min, self.max = min_workers, max_workers
        self.predictor = make_predictor(predictor) if isinstance(predictor, str) else predictor
        self.headroom, self.hysteresis, self.down_stable = headroom, hysteresis, down_stable
        self._wants: deque[int] = deque(maxlen=down_stable)
        self._current = min_workers
        self.miss_intervals = miss_intervals
        self._misses = 0
        self.margin_quantile = margin_quantile
        self._errors: deque[float] = deque(maxlen=margin_history)  # recent intervals' need minus its forecast
        self._last_forecast: float | None = None
        self.trust_max, self.trust = trust_max, 1.0  # how far past the capacity model the fleet has proven to carry

    def resume(self, desired: int) -> None:
        """Continue from a decision made elsewhere (the previous leader's): scale down from it only after
        ``down_stable`` intervals agree, as if this planner had made it."""
        self._current = max(self.min, min(self.max, desired))
        self._wants.clear()

    def decide(self, obs: Observation) -> Decision:
        self.predictor.observe(obs.arrival_rate)
        lead = max(1, math.ceil(self.capacity.startup_s / obs.interval_s) + 1)
        forecast = self.predictor.forecast(lead)
        predicted = max([obs.arrival_rate, *forecast])
        per_request = self._work.observe(obs)  # an aggregated pool: the mix's cost against the profiled one
        backlog = obs.queue_depth / obs.interval_s  # queued requests, to be served within one interval
        margin = self._margin(obs, forecast[0])
        rate = max(predicted * (1 + self.headroom), predicted + margin)
        load = (rate + backlog) * per_request
        self._learn(obs, per_request)
        need = math.ceil(load / (self.per_worker * self.trust)) if load > 0 else 0
        # Feedback for what the capacity model did not foresee: the SLA missed for several intervals in a
        # row while the workers are busy (a single long prompt's prefill stalls a batch for one interval:
        # no worker more would help that). Only the pool's own SLOs count.
        missed = self._work.missed(obs, self.sla)
        have = obs.healthy + obs.starting
        busy = obs.arrival_rate * per_request > 0.5 * self.per_worker * max(1, obs.healthy)
        self._misses = self._misses + 1 if missed and busy else 0
        missed = self._misses >= self.miss_intervals
        if missed and obs.starting == 0:
            need = max(need, have + 1)
            self._misses = 0
        need = _clamp(need, self.min, self.max)
        self._wants.append(need)
        if self.pool.role == "aggregated":
            why = (f"predicted {predicted:.2f} req/s over {lead} interval(s), {obs.queue_depth} queued, "
                   f"{self.per_worker:.2f} req/s per worker")
        else:
            why = (f"predicted {predicted:.2f} req/s x {per_request:.0f} {self.pool.unit.split()[0]} tokens over "
                   f"{lead} interval(s), {obs.queue_depth} queued, {self.per_worker:.0f} {self.pool.unit} per worker")
        if predicted + margin > predicted * (1 + self.headroom):
            why += f"; {margin:.2f} req/s above the forecast, as recent intervals needed"
        if self.trust > 1.0:
            why += f"; {self.trust:.2f}x the capacity model, as the SLA held"
        if missed:
            why += "; SLA missed last interval"
        if need > self._current:
            self._current = need
            self._wants.clear()
            self._wants.append(need)
            return Decision(need, "up: " + why)
        # Fewer: only when every recent interval agreed, by at least the hysteresis (no flapping on noise).
        if len(self._wants) == self.down_stable and max(self._wants) <= self._current - self.hysteresis:
            self._current = max(self._wants)
            self._wants.clear()
            return Decision(self._current, "down: " + why)
        return Decision(self._current, "hold: " + why)

    def _learn(self, obs: Observation, per_request: float) -> None:
        """The trust in the capacity model, learned from the fleet: 2 % more for each interval that met the
        pool's SLOs with its workers at least half loaded by the model's measure (none starting), 10 % less for
        each interval that missed them (slow up, fast down), between 1 and ``trust_max``. A
        capacity measured on one worker under Poisson load is a floor for a fleet behind least-loaded routing;
        the trust finds how far above it this fleet's traffic may go."""
        if self.trust_max <= 1.0 or not obs.healthy:
            return
        seen = [obs.ttft_p99 if slo == "ttft" else obs.itl_p99 for slo in SLOS[self.pool.role]]
        if any(v is None for v in seen):
            return  # an interval without latencies says nothing either way
        used = obs.arrival_rate * per_request / (obs.healthy * self.per_worker * self.trust)
        if self._work.missed(obs, self.sla):
            self.trust = max(1.0, self.trust * 0.9)
        elif used > 0.5 and obs.starting == 0:
            self.trust = min(self.trust_max, self.trust * 1.02)

    def _margin(self, obs: Observation, predicted: float) -> float:
        """The rate to plan above the forecast, learned online: the ``margin_quantile`` of how far the recent
        intervals' arrival rate exceeded the forecast made for them one interval before. Smooth traffic learns
        a small margin (the fixed headroom then rules); traffic that jumps without warning learns to keep the
        capacity its jumps need."""
        if self._last_forecast is not None:
            self._errors.append(obs.arrival_rate - self._last_forecast)
        self._last_forecast = predicted
        if len(self._errors) < _MIN_ERRORS:
            return 0.0
        errors = sorted(self._errors)
        return max(0.0, errors[min(len(errors) - 1, int(self.margin_quantile * len(errors)))])


_MIN_ERRORS = 4  # intervals of forecast errors before the margin is learned from them


class StaticPeak:
    """Provisioned for the peak: ``workers`` always."""

    name = "static-peak"

    def __init__(self, workers: int) -> None:
        self.workers = workers

    def decide(self, obs: Observation) -> Decision:
        return Decision(self.workers, f"static: {self.workers} for the peak")


class Reactive:
    """HPA-like: desired = ceil(current x metric / target) on the worse of queue depth and KV use per worker."""

    name = "reactive"

    def __init__(self, *, queue_target: float = 4.0, kv_target: float = 0.7, min_workers: int = 1,
                 max_workers: int = 64, tolerance: float = 0.1, down_window_s: float = 300.0) -> None:
        check_bounds(min_workers, max_workers)
        self.queue_target, self.kv_target = queue_target, kv_target
        self.min, self.max, self.tolerance, self.down_window_s = min_workers, max_workers, tolerance, down_window_s
        self._recent: deque[tuple[float, int]] = deque()

    def decide(self, obs: Observation) -> Decision:
        current = max(1, obs.healthy + obs.starting)
        ratio = max(obs.queue_depth / max(1, obs.healthy) / self.queue_target, obs.kv_usage / self.kv_target)
        want = current if abs(ratio - 1) <= self.tolerance else math.ceil(current * ratio)
        want = _clamp(want, self.min, self.max)
        self._recent.append((obs.now, want))
        while self._recent and self._recent[0][0] < obs.now - self.down_window_s:
            self._recent.popleft()
        desired = want if want >= current else max(w for _, w in self._recent)  # HPA's stabilisation window
        return Decision(desired, f"queue {obs.queue_depth}, kv {obs.kv_usage:.2f}: ratio {ratio:.2f}")


class DynamoStyle:
    """Dynamo-planner-like: last interval's load / interpolated per-worker capacity, times a correction
    factor of observed over expected latency; reactive. A prefill pool's load is prompt tokens/s and its
    correction TTFT's; a decode pool's is output tokens/s and ITL's (an aggregated pool: requests/s, ITL)."""

    name = "dynamo-style"

    def __init__(self, capacity: CapacityModel | PoolCapacity, sla: Sla, *, min_workers: int = 1,
                 max_workers: int = 64) -> None:
        check_bounds(min_workers, max_workers)
        self.pool = _pool(capacity)
        self.capacity, self.sla, self.min, self.max = self.pool.curve, sla, min_workers, max_workers
        self.per_worker = self.pool.max_rate(sla)
        self._work = _Work(self.pool)

    def decide(self, obs: Observation) -> Decision:
        serving = max(1, obs.healthy)
        load = obs.arrival_rate * self._work.observe(obs)
        expected = self.pool.latency_at(load / serving)
        observed = obs.ttft_p99 if self.pool.role == "prefill" else obs.itl_p99
        correction = 1.0
        if observed is not None and expected > 0:
            correction = min(2.0, max(0.5, observed / expected))
        need = math.ceil(load * correction / self.per_worker) if load > 0 else 0
        if self.pool.role != "aggregated":
            return Decision(_clamp(need, self.min, self.max),
                            f"{load:.0f} {self.pool.unit}, correction {correction:.2f}")
        return Decision(_clamp(need, self.min, self.max),
                        f"{obs.arrival_rate:.2f} req/s, correction {correction:.2f}")


POLICIES = ("fleetward", "static-peak", "reactive", "dynamo-style", "oracle")
