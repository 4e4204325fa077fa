"""The simulator and the live fleet agree: one small trace, the same planner, replayed in the fleet simulator
and against live simulated workers (real processes, router, supervisor and the autoscaler daemon).

The tolerance, stated: at 80 % of the simulator's planning intervals the live planner's desired count equals
the simulator's within two intervals of lag or lead, and it is never off by more than one worker; the peak
and the final count are equal; and the live run cuts no stream. Why not exact: the live planner's intervals
are not aligned with the trace's start, and it counts arrivals between two scrapes of the routers, so a
load change that falls inside one of its intervals is seen as an intermediate rate. A scale-down then
takes an intermediate step (3 → 2 → 1 where the simulator goes 3 → 1), which lasts ``down_stable``
intervals.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import pytest

from fleetward.autoscale.actuate import LocalActuator
from fleetward.autoscale.capacity import CapacityModel, CapacityPoint, Sla
from fleetward.autoscale.daemon import Autoscaler
from fleetward.autoscale.live import replay_live
from fleetward.autoscale.planner import Planner
from fleetward.autoscale.simulate import IntervalRecord, simulate
from fleetward.autoscale.traces import Trace, TraceRequest
from fleetward.chaos.harness import TestFleet
from fleetward.fleet.config import AutoscaleConfig, SimConfig

SIM = SimConfig(decode_step_ms=5.0, decode_ms_per_seq=0.05, prefill_ms_per_token=0.01, seed=5)
SLA = Sla(ttft_s=2.0, itl_s=0.05)
CAPACITY = CapacityModel((CapacityPoint(3.0, 0.0, 0.0), CapacityPoint(3.003, 1e9, 1e9)), startup_s=1.0)
INTERVAL = 1.0
CONFIG = AutoscaleConfig(interval_s=INTERVAL, min_workers=1, max_workers=4, predictor="constant", headroom=0.0,
                         down_stable=3, drain_deadline_s=2.0, margin_quantile=0.0, capacity_trust_max=1.0)


def step_trace() -> Trace:
    """1.5 req/s for 10 s, 7.5 req/s for 15 s, 1.5 req/s for 15 s (evenly spaced): 1 worker, then 3, then 1
    at 3 req/s per worker, each far from a boundary."""
    reqs: list[TraceRequest] = []
    t = 0.0
    for rate, until in ((1.5, 10.0), (7.5, 25.0), (1.5, 40.0)):
        while t < until:
            reqs.append(TraceRequest(round(t, 4), 32, 24))
            t += 1 / rate
    return Trace("step", "servegen", tuple(reqs))


def planner() -> Planner:
    """The planner with its learned parts off: in a 40-second trace the margin would learn the one step as a
    jump to keep (it is tested in the simulator and sans IO), and the trust would follow latencies that the
    two fleets measure differently (simulated against a live router's histograms)."""
    return Planner(CAPACITY, SLA, min_workers=CONFIG.min_workers, max_workers=CONFIG.max_workers,
                   predictor=CONFIG.predictor, headroom=CONFIG.headroom, down_stable=CONFIG.down_stable,
                   margin_quantile=CONFIG.margin_quantile, trust_max=CONFIG.capacity_trust_max)


@pytest.fixture
def sim_config() -> SimConfig:
    return SIM


def desired_at(timeline: Sequence[IntervalRecord], t: float) -> int:
    """The planner's count in force at ``t`` (a step function of its decisions)."""
    current = timeline[0].desired
    for r in timeline:
        if r.t > t:
            break
        current = r.desired
    return current


async def test_the_simulator_and_the_live_fleet_make_the_same_decisions(fleet: TestFleet) -> None:
    trace = step_trace()
    sim = simulate(trace.requests, planner(), sla=SLA, startup_s=CAPACITY.startup_s, config=SIM, interval_s=INTERVAL,
                   initial_workers=1, drain_deadline_s=CONFIG.drain_deadline_s)
    actuator = LocalActuator(fleet.store, fleet.keys, fleet.admin_token)
    scaler = Autoscaler(CONFIG, store=fleet.store, bus=fleet.bus, keys=fleet.keys, capacity=CAPACITY,
                        actuator=actuator, autoscaler_id="as-live", policy_factory=planner)
    task = asyncio.create_task(scaler.run())
    try:
        await asyncio.wait_for(scaler.leading.wait(), 30)
        live, records = await replay_live(trace, router=fleet.routers[0].url, model="sim-tiny", store=fleet.store,
                                          keys=fleet.keys, bus=fleet.bus, sla=SLA)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await actuator.aclose()
    assert live.cut_streams == 0 and live.failed == 0 and len(records) == len(trace.requests)
    assert live.met == len(records), "every request within the SLA on an unsaturated fleet"
    sim_desired = [r.desired for r in sim.timeline]
    live_desired = [r.desired for r in live.timeline]
    assert max(sim_desired) == max(live_desired) == 3 and sim_desired[-1] == live_desired[-1] == 1
    span = trace.duration_s
    points = [r.t for r in sim.timeline if r.t <= span]
    near = {t: {desired_at(sim.timeline, t + d * INTERVAL) for d in (-2, -1, 0, 1, 2)} for t in points}
    agree = [t for t in points if desired_at(live.timeline, t) in near[t]]
    close = [t for t in points if min(abs(desired_at(live.timeline, t) - n) for n in near[t]) <= 1]
    report = (f"sim  {[(round(r.t, 1), r.desired) for r in sim.timeline]}\n"
              f"live {[(round(r.t, 1), r.desired) for r in live.timeline]}")
    assert len(close) == len(points), f"off by more than one worker at {sorted(set(points) - set(close))}:\n{report}"
    assert len(agree) >= 0.8 * len(points), (
        f"decisions disagree beyond two intervals at {sorted(set(points) - set(agree))}:\n{report}")
