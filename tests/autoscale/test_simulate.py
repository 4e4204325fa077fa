"""The fleet simulator: conservation, drain without a cut, failures with and without migration, and the
oracle as the floor, on small synthetic traces (seeded, so every run is the same)."""

from __future__ import annotations

import random

import pytest

from fleetward.autoscale.capacity import Sla
from fleetward.autoscale.evaluate import evaluate
from fleetward.autoscale.planner import StaticPeak
from fleetward.autoscale.simulate import DEFAULT_WORKER, profile_capacity, simulate
from fleetward.autoscale.traces import Trace, TraceRequest

SLA = Sla(ttft_s=2.0, itl_s=0.05)


def poisson(rates: list[tuple[float, float]], *, seed: int = 1) -> list[TraceRequest]:
    """Requests at ``rate`` req/s for ``seconds``, one phase after another."""
    rng = random.Random(seed)
    out, start = [], 0.0
    for rate, seconds in rates:
        t = start
        while True:
            t += rng.expovariate(rate)
            if t >= start + seconds:
                break
            out.append(TraceRequest(t, rng.randint(200, 2000), rng.randint(20, 300)))
        start += seconds
    return out


def test_one_worker_under_light_load_serves_every_request_within_the_sla() -> None:
    reqs = poisson([(1.0, 300)])
    r = simulate(reqs, StaticPeak(1), sla=SLA, startup_s=45, initial_workers=1)
    assert r.requests == len(reqs) and r.failed == 0 and r.sla_attainment == 1.0
    assert r.worker_hours == pytest.approx(reqs[-1].arrival_s / 3600, rel=0.05)
    # Mean ITL at a small batch is the one-sequence step of the latency model.
    assert r.itl_p99 is not None and DEFAULT_WORKER.step_seconds(1) <= r.itl_p99 < SLA.itl_s


def test_capacity_is_measured_rising_and_more_load_means_more_latency() -> None:
    cap = profile_capacity(poisson([(1.0, 600)]), startup_s=45, duration_s=300)
    itls = [p.itl_p99 for p in cap.points]
    assert len(cap.points) >= 10 and itls[-1] > itls[0]
    assert 0 < cap.max_rate(SLA) < cap.points[-1].rate


def test_scale_down_drains_and_failures_migrate_so_no_stream_is_cut() -> None:
    trace = Trace("step", "servegen", tuple(poisson([(2.0, 600), (25.0, 900), (2.0, 900)])))
    ev = evaluate(trace, policies=["fleetward"], sla=SLA, startup_s=45, failures_per_worker_hour=6.0)
    r = ev.results["fleetward"]
    assert r.scale_events >= 2 and max(x.healthy for x in r.timeline) > min(x.healthy for x in r.timeline)
    assert r.cut_streams == 0 and r.failed == 0 and r.migrated > 0
    worse = evaluate(trace, policies=["fleetward"], sla=SLA, startup_s=45, failures_per_worker_hour=6.0,
                     migration=False).results["fleetward"]
    assert worse.failed > 0 and worse.sla_attainment < r.sla_attainment


def test_the_oracle_meets_the_sla_with_fewer_worker_hours_than_static_peak_and_the_planner() -> None:
    """Steps of 10x in one instant: only the oracle, which starts workers ahead, meets the SLA through them
    with few workers; static provisioning meets it with the most."""
    trace = Trace("wave", "servegen", tuple(poisson([(2.0, 900), (20.0, 900), (2.0, 900), (12.0, 900)], seed=5)))
    ev = evaluate(trace, sla=SLA, startup_s=45)
    r = ev.results
    assert r["oracle"].sla_attainment >= 0.99 and r["static-peak"].sla_attainment >= 0.99
    assert r["oracle"].worker_hours < r["fleetward"].worker_hours < r["static-peak"].worker_hours
    assert all(r.cut_streams == 0 and r.requests == len(trace.requests) for r in ev.results.values())
    again = evaluate(trace, sla=SLA, startup_s=45)
    assert {n: r.summary() for n, r in again.results.items()} == {n: r.summary() for n, r in ev.results.items()}


def test_chunked_prefill_spares_the_running_streams_a_long_prompts_stall() -> None:
    """Steady short requests on one worker, and every 20 s a 40,000-token prompt: computed at once, each holds
    the batch for 2 s and the streams running then miss the ITL target; in 512-token chunks they do not. The
    price, as in vLLM: a prompt that arrives behind the long one waits for all of its chunks (its TTFT grows).
    Every request is served either way."""
    rng = random.Random(3)
    reqs = [TraceRequest(t / 2, rng.randint(100, 300), rng.randint(20, 60)) for t in range(240)]
    reqs += [TraceRequest(5.0 + 20 * k, 40_000, 20) for k in range(6)]
    reqs.sort(key=lambda r: r.arrival_s)
    whole = simulate(reqs, StaticPeak(1), sla=SLA, startup_s=0, initial_workers=1,
                     config=DEFAULT_WORKER.model_copy(update={"chunked_prefill_tokens": 0}))
    chunked = simulate(reqs, StaticPeak(1), sla=SLA, startup_s=0, initial_workers=1, config=DEFAULT_WORKER)
    assert whole.requests == chunked.requests == len(reqs) and whole.failed == chunked.failed == 0
    assert whole.itl_p99 is not None and chunked.itl_p99 is not None
    assert whole.itl_p99 > SLA.itl_s > chunked.itl_p99
    assert whole.ttft_p99 is not None and chunked.ttft_p99 is not None and chunked.ttft_p99 > whole.ttft_p99
