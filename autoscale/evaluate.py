"""One trace, every policy, the same SLA and worker model: what ``fleetward replay --simulate`` runs.

The capacity model is measured first (:func:`~.simulate.profile_capacity` on request lengths drawn from
the trace), and every policy that needs one gets the same model: fleetward's planner, the Dynamo-style
planner, and the oracle, whose worker-hours are the floor for it. Static provisioning gets the workers
the trace's peak interval needs. Every run starts with the workers the first interval needs.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fleetward.autoscale.capacity import CapacityModel, Sla
from fleetward.autoscale.planner import POLICIES, DynamoStyle, Oracle, Planner, Policy, Reactive, StaticPeak
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

    def summary(self) -> dict[str, object]:
        return {
            "trace": {"name": self.trace.name, "format": self.trace.format, "requests": len(self.trace.requests),
                      "duration_s": round(self.trace.duration_s, 1)},
            "sla": {"ttft_s": self.sla.ttft_s, "itl_s": self.sla.itl_s},
            "capacity": {"per_worker_rps": round(self.per_worker, 3), "startup_s": self.capacity.startup_s},
            "policies": {name: r.summary() for name, r in self.results.items()},
        }


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
    first = max(min_workers, math.ceil(rates[0] / per_worker) if rates else 1)
    ev = Evaluation(trace, sla, capacity, per_worker, interval_s, rates)

    def make(name: str) -> Policy:
        if name == "fleetward":
            return Planner(capacity, sla, min_workers=min_workers, max_workers=top, predictor=predictor)
        if name == "static-peak":
            return StaticPeak(max(peak, min_workers))
        if name == "reactive":
            return Reactive(min_workers=min_workers, max_workers=top)
        if name == "dynamo-style":
            return DynamoStyle(capacity, sla, min_workers=min_workers, max_workers=top)
        return Oracle(capacity, sla, rates, interval_s, min_workers=min_workers, max_workers=top)

    for name in policies:
        policy = make(name)
        ev.results[name] = simulate(
            trace.requests, policy, sla=sla, startup_s=startup_s, config=config, interval_s=interval_s,
            initial_workers=max(peak, min_workers) if name == "static-peak" else first,
            failures_per_worker_hour=failures_per_worker_hour, migration=migration, seed=seed,
            on_progress=functools.partial(progress, name) if progress is not None else None)
    return ev
