"""One trace, every policy, the same SLA and worker model: what ``fleetward replay --simulate`` runs.

The capacity model is measured first (:func:`~.simulate.profile_capacity` on request lengths drawn from
the trace), and the policies that plan by one get the same model: fleetward's planner and the Dynamo-style
planner. The oracle plans by none: it searches the simulator for the fewest workers that keep the SLA in
every interval, with the whole trace known (:mod:`.oracle`). Static provisioning gets the most workers any
interval needs by that search (the peak, sized so that it keeps the SLA). Every run but the oracle's
starts with the workers the capacity model gives the first interval; the oracle starts with its own.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fleetward.autoscale.capacity import CapacityModel, Sla
from fleetward.autoscale.oracle import OracleSchedule, SearchResult, search
from fleetward.autoscale.planner import POLICIES, DynamoStyle, Planner, Policy, Reactive, StaticPeak
from fleetward.autoscale.simulate import DEFAULT_WORKER, FleetResult, profile_capacity, simulate
from fleetward.autoscale.traces import Trace
from fleetward.fleet.config import SimConfig
from fleetward.fleet.errors import ConfigError

__all__ = ["Evaluation", "evaluate"]


@dataclass
class Evaluation:
    trace: Trace
    sla: Sla
    capacity: CapacityModel
    per_worker: float
    interval_s: float
    rates: list[float]
    results: dict[str, FleetResult] = field(default_factory=dict)
    searched: SearchResult | None = None  # the oracle's search, when it ran

    def summary(self) -> dict[str, object]:
        oracle = self.results.get("oracle")
        policies: dict[str, dict[str, object]] = {}
        for name, r in self.results.items():
            policies[name] = r.summary()
            if oracle is not None and oracle.worker_hours > 0:
                policies[name]["worker_hours_x_oracle"] = round(r.worker_hours / oracle.worker_hours, 3)
        out: dict[str, object] = {
            "trace": {"name": self.trace.name, "format": self.trace.format, "requests": len(self.trace.requests),
                      "duration_s": round(self.trace.duration_s, 1)},
            "sla": {"ttft_s": self.sla.ttft_s, "itl_s": self.sla.itl_s, "ttft_per_1k_s": self.sla.ttft_per_1k_s},
            "capacity": {"per_worker_rps": round(self.per_worker, 3), "startup_s": self.capacity.startup_s},
            "policies": policies,
        }
        if self.searched is not None:
            out["oracle_search"] = {"peak_workers": max(self.searched.needed, default=0),
                                    "trials": self.searched.trials}
        return out


def evaluate(trace: Trace, *, policies: Sequence[str] = POLICIES, sla: Sla | None = None, startup_s: float = 45.0,
             interval_s: float = 30.0, min_workers: int = 1, max_workers: int | None = None,
             predictor: str = "holt-winters", failures_per_worker_hour: float = 0.0, migration: bool = True,
             config: SimConfig = DEFAULT_WORKER, seed: int = 0,
             progress: Callable[[str, float], None] | None = None) -> Evaluation:
    """Run each of ``policies`` on ``trace`` in the simulator; ``progress(policy, trace seconds done)``."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ConfigError(f"unknown policy {', '.join(unknown)}; choose from {', '.join(POLICIES)}")
    if not trace.requests:
        raise ConfigError(f"trace {trace.name} has no requests")
    sla = sla or Sla()
    sample = random.Random(seed).sample(list(trace.requests), min(5000, len(trace.requests)))
    capacity = profile_capacity(sample, startup_s=startup_s, config=config, seed=seed, sla=sla)
    per_worker = capacity.max_rate(sla)
    rates = trace.rate_per_interval(interval_s)
    peak = math.ceil(max(rates) / per_worker)
    top = max_workers if max_workers is not None else max(2 * peak, min_workers + 1)
    if peak > top:
        raise ConfigError(f"the trace's peak needs {peak} workers at {per_worker:.2f} req/s each, above "
                          f"max_workers={top}: raise it or scale the trace's rate down")
    # A warm fleet: every policy but the oracle starts with what the opening minutes (the start-up lead) need
    # by the capacity model, as a fleet would that had been running before the trace began.
    lead = math.ceil(startup_s / interval_s) + 1
    first = max(min_workers, math.ceil(max(rates[:lead]) / per_worker) if rates else 1)
    ev = Evaluation(trace, sla, capacity, per_worker, interval_s, rates)
    if "oracle" in policies or "static-peak" in policies:
        ev.searched = search(trace.requests, sla=sla, startup_s=startup_s, interval_s=interval_s, config=config,
                             min_workers=min_workers, max_workers=top,
                             on_progress=functools.partial(progress, "oracle search") if progress else None)
    searched = ev.searched
    static = max(min_workers, max(searched.needed) if searched is not None else peak)

    def make(name: str) -> Policy:
        if name == "fleetward":
            return Planner(capacity, sla, min_workers=min_workers, max_workers=top, predictor=predictor)
        if name == "static-peak":
            return StaticPeak(static)
        if name == "reactive":
            return Reactive(min_workers=min_workers, max_workers=top)
        if name == "dynamo-style":
            return DynamoStyle(capacity, sla, min_workers=min_workers, max_workers=top)
        assert searched is not None
        return OracleSchedule(searched, interval_s)

    for name in policies:
        policy = make(name)
        initial = static if name == "static-peak" else searched.desired[0] if name == "oracle" and searched else first
        if isinstance(policy, Planner):
            policy.resume(initial)  # it plans from the fleet it has, as a daemon taking over does
        ev.results[name] = simulate(
            trace.requests, policy, sla=sla, startup_s=startup_s, config=config, interval_s=interval_s,
            initial_workers=initial, failures_per_worker_hour=failures_per_worker_hour, migration=migration,
            seed=seed, on_progress=functools.partial(progress, name) if progress is not None else None)
    return ev
