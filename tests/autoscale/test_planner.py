"""The planners, sans IO: scripted observations in, decisions out; the time is the observation's."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from fleetward.autoscale.capacity import CapacityModel, CapacityPoint, Sla
from fleetward.autoscale.planner import DynamoStyle, Observation, Planner, Reactive
from fleetward.fleet.errors import ConfigError

SLA = Sla(ttft_s=2.0, itl_s=0.05)
# One worker meets the SLA up to 4 req/s (ITL crosses 50 ms halfway between 3 and 5 req/s).
CAPACITY = CapacityModel.from_points([CapacityPoint(1, 0.1, 0.02), CapacityPoint(3, 0.2, 0.04),
                                      CapacityPoint(5, 0.5, 0.06), CapacityPoint(7, 30.0, 0.2)], startup_s=60.0)
INTERVAL = 30.0


def obs(k: int, rate: float, healthy: int, **kw: object) -> Observation:
    return Observation(now=k * INTERVAL, interval_s=INTERVAL, arrival_rate=rate, healthy=healthy, **kw)  # type: ignore[arg-type]


def planner(**kw: object) -> Planner:
    """A planner without the learned parts (margin, trust) unless asked: the rule alone."""
    options: dict[str, object] = {"predictor": "constant", "headroom": 0.0, "min_workers": 1, "max_workers": 20,
                                  "margin_quantile": 0.0, "trust_max": 1.0}
    options.update(kw)
    return Planner(CAPACITY, SLA, **options)  # type: ignore[arg-type]


def test_the_capacity_model_interpolates_where_latency_crosses_the_target() -> None:
    assert CAPACITY.max_rate(SLA) == pytest.approx(4.0)
    assert CAPACITY.max_rate(Sla(ttft_s=2.0, itl_s=0.5)) == pytest.approx(7 - 2 * (30 - 2) / 29.5, rel=0.05)
    assert CAPACITY.itl_at(4.0) == pytest.approx(0.05)
    with pytest.raises(ConfigError, match="no measured load meets the SLA"):
        CAPACITY.max_rate(Sla(ttft_s=0.01, itl_s=0.05))
    with pytest.raises(ConfigError, match="bounds"):
        planner(min_workers=5, max_workers=2)


def test_a_step_in_load_scales_up_at_the_next_decision_and_down_only_after_it_stays_low() -> None:
    p = planner(down_stable=4)
    assert p.decide(obs(0, 2.0, 1)).desired == 1
    up = p.decide(obs(1, 30.0, 1))
    assert up.desired == 8 and up.reason.startswith("up")  # 30 / 4 per worker, at once
    # Load falls back: the desired count holds for down_stable intervals, then falls.
    held = [p.decide(obs(k, 2.0, 8)).desired for k in range(2, 5)]
    assert held == [8, 8, 8]
    down = p.decide(obs(5, 2.0, 8))
    assert down.desired == 1 and down.reason.startswith("down")


def test_noise_around_a_level_does_not_flap() -> None:
    rng = random.Random(3)
    p = planner(headroom=0.1, hysteresis=2)
    decisions = [p.decide(obs(k, 20.0 * (1 + rng.uniform(-0.1, 0.1)), 6)).desired for k in range(200)]
    changes = sum(a != b for a, b in itertools.pairwise(decisions[10:]))
    assert changes <= 2, decisions


def test_bounds_hold_and_a_missed_sla_adds_a_worker() -> None:
    p = planner(max_workers=5)
    assert p.decide(obs(0, 1000.0, 1)).desired == 5
    q = planner(min_workers=3)
    assert q.decide(obs(0, 0.0, 3)).desired == 3
    r = planner()
    assert r.decide(obs(0, 3.0, 1)).desired == 1
    # One slow interval (a long prompt's prefill) is not a reason; two in a row on busy workers are.
    assert r.decide(obs(1, 3.0, 1, itl_p99=0.2)).desired == 1
    missed = r.decide(obs(2, 3.0, 1, itl_p99=0.2))
    assert missed.desired == 2 and "SLA missed" in missed.reason
    idle = planner()
    assert [idle.decide(obs(k, 0.5, 1, itl_p99=0.2)).desired for k in range(4)] == [1, 1, 1, 1]


def test_unhealthy_workers_do_not_count_so_the_decision_keeps_asking_for_them() -> None:
    p = planner()
    assert p.decide(obs(0, 16.0, 4)).desired == 4
    # Two of the four are quarantined: healthy 2, the load unchanged: still 4 (the actuator replaces two).
    assert p.decide(obs(1, 16.0, 2, unhealthy=2)).desired == 4


def test_the_planner_scales_ahead_of_a_ramp_by_the_start_up_time() -> None:
    """A ramp of +1 req/s per interval: with a trend-aware predictor the planner asks, at each interval,
    for what the load will be once a worker started now is serving (60 s = 2 intervals later)."""
    p = planner(predictor="holt-winters")
    ahead = []
    for k in range(40):
        d = p.decide(obs(k, float(k), 10))
        ahead.append(d.desired)
    # By the end (the predictor has learnt the trend), each decision covers the rate 2-3 intervals on.
    for k in range(30, 40):
        assert ahead[k] >= -(-(k + 2) // 4), (k, ahead[k])
    reactive = planner(predictor="constant")
    late = [reactive.decide(obs(k, float(k), 10)).desired for k in range(40)]
    assert sum(ahead[30:]) > sum(late[30:])


def test_dynamo_style_corrects_by_latency() -> None:
    dyn = DynamoStyle(CAPACITY, SLA, max_workers=20)
    base = dyn.decide(obs(0, 16.0, 4)).desired
    slow = dyn.decide(obs(1, 16.0, 4, itl_p99=2 * CAPACITY.itl_at(4.0))).desired
    assert (base, slow) == (4, 8)


def test_reactive_follows_queue_depth_and_waits_out_its_stabilisation_window() -> None:
    hpa = Reactive(queue_target=4.0, max_workers=20, down_window_s=300)
    assert hpa.decide(obs(0, 0, 4, queue_depth=32)).desired == 8
    assert hpa.decide(obs(1, 0, 8, queue_depth=0)).desired == 8  # within 5 minutes of wanting 8
    assert hpa.decide(obs(12, 0, 8, queue_depth=0)).desired == 1


def test_the_margin_is_learned_from_forecasts_that_fell_short() -> None:
    """Smooth load learns no margin (the headroom rules); load that jumps without warning learns to keep the
    capacity of its jumps, and forgets it once the jumps have left its history."""
    smooth = planner(margin_quantile=0.95, margin_history=10)
    assert [smooth.decide(obs(k, 8.0, 2)).desired for k in range(20)][-1] == 2
    jumpy = planner(margin_quantile=0.95, margin_history=10)
    rates = [0.0, 0.0, 0.0, 16.0] * 5  # bursts of 16 req/s after silences: 4 workers while it lasts
    wanted = [jumpy.decide(obs(k, r, 4)).desired for k, r in enumerate(rates)]
    assert min(wanted[8:]) >= 4, "between bursts it keeps what a burst needs"
    for k in range(20, 40):
        last = jumpy.decide(obs(k, 1.0, 4)).desired
    assert last == 1, "ten quiet intervals later the bursts are out of its history"


def test_capacity_trust_grows_while_the_sla_holds_at_high_load_and_falls_back_when_it_is_missed() -> None:
    p = planner(trust_max=1.25)
    for k in range(30):  # 3 workers at 11 req/s: above the model's 4 req/s each x 0.5, and within the SLA
        p.decide(obs(k, 11.0, 3, ttft_p99=0.5, itl_p99=0.03))
    assert p.trust == pytest.approx(1.25)
    assert p.decide(obs(30, 11.0, 3)).desired == 3  # 11 / (4 x 1.25) -> 3, where the model alone says 3 too
    assert planner().decide(obs(0, 18.0, 3)).desired == 5 and p.decide(obs(31, 18.0, 3)).desired == 4
    p.decide(obs(32, 18.0, 4, ttft_p99=0.5, itl_p99=0.2))  # missed: trust falls back
    assert p.trust < 1.25


def test_an_aggregated_pool_weighs_requests_by_the_work_they_cost() -> None:
    """With the work model, prompts twice as long as those the capacity was measured at cost more workers."""
    work = dataclasses.replace(CAPACITY, mean_input=1000.0, mean_output=100.0, prefill_tokens_per_s=10_000.0,
                               decode_s_per_token=0.001)
    assert work.relative_cost(1000.0, 100.0) == pytest.approx(1.0)
    assert work.relative_cost(3000.0, 100.0) == pytest.approx(2.0)  # (0.3 s + 0.1 s) / (0.1 s + 0.1 s)
    same = Planner(work, SLA, predictor="constant", headroom=0.0, margin_quantile=0.0, trust_max=1.0)
    longer = Planner(work, SLA, predictor="constant", headroom=0.0, margin_quantile=0.0, trust_max=1.0)
    for k in range(30):  # the mix is smoothed over intervals: it settles
        a = same.decide(obs(k, 8.0, 2, mean_input=1000.0, mean_output=100.0)).desired
        b = longer.decide(obs(k, 8.0, 2, mean_input=3000.0, mean_output=100.0)).desired
    assert (a, b) == (2, 4)
    assert CAPACITY.relative_cost(3000.0, 100.0) == 1.0, "a model without the work plans in requests/s"
