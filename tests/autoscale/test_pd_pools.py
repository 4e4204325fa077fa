"""Prefill/decode pools in the autoscaler, sans IO: scripted observations in, decisions and gauges out.

A prefill pool is sized from prompt tokens/s against TTFT, a decode pool from output tokens/s against ITL
(docs/autoscale.md, "Prefill/decode pools"); an aggregated pool stays in requests/s against both. The
observation test drives the real :class:`Observer` over an in-memory HTTP transport and a manual clock.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from fleetward.autoscale.actuate import Actuator
from fleetward.autoscale.capacity import CapacityModel, CapacityPoint, PoolCapacity, Sla
from fleetward.autoscale.daemon import Autoscaler, PoolRecord, capacity_for, pool_capacity
from fleetward.autoscale.observe import Observer
from fleetward.autoscale.planner import DynamoStyle, Observation, Planner
from fleetward.fleet.bus import EventBus
from fleetward.fleet.clock import ManualClock
from fleetward.fleet.config import AutoscaleConfig
from fleetward.fleet.errors import ConfigError
from fleetward.fleet.etcd import StateStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.registry import FleetSnapshot
from fleetward.fleet.worker import HealthRecord, HealthState, Role, WorkerRecord

SLA = Sla(ttft_s=2.0, itl_s=0.05)
INTERVAL = 30.0
# An aggregated worker measured at 500-token prompts and 100-token answers: within the SLA up to 4 req/s (ITL
# crosses 50 ms halfway between 3 and 5 req/s; TTFT only far beyond). An idle worker's p99 TTFT is 0.1 s.
AGGREGATED = CapacityModel.from_points([CapacityPoint(1, 0.1, 0.02), CapacityPoint(3, 0.2, 0.04),
                                        CapacityPoint(5, 0.5, 0.06), CapacityPoint(7, 30.0, 0.2)], startup_s=60.0)
MODEL = CapacityModel(AGGREGATED.points, AGGREGATED.startup_s, mean_input=500.0, mean_output=100.0)


def obs(k: int, role: Role, rate: float, mean_input: float, mean_output: float, healthy: int = 1,
        **kw: Any) -> Observation:
    # What observe.py gives each pool: a prefill pool's workers answer one token each, so no output length.
    return Observation(now=k * INTERVAL, interval_s=INTERVAL, arrival_rate=rate, healthy=healthy,
                       mean_input=mean_input, mean_output=0.0 if role == "prefill" else mean_output, **kw)


def planner(role: Role, **kw: Any) -> Planner:
    options: dict[str, Any] = {"predictor": "constant", "headroom": 0.0, "min_workers": 1, "max_workers": 64}
    options.update(kw)
    return Planner(PoolCapacity.derived(MODEL, role), SLA, **options)


def run(role: Role, series: list[tuple[float, float]], rate: float = 10.0) -> list[int]:
    """The planner's decisions for ``role`` over (mean_input, mean_output) intervals at a constant ``rate``."""
    p = planner(role)
    return [p.decide(obs(k, role, rate, i, o)).desired for k, (i, o) in enumerate(series)]


# -- capacity -------------------------------------------------------------------------------------------


def test_a_decode_worker_carries_the_aggregated_workers_itl_bound_load_in_output_tokens() -> None:
    decode = PoolCapacity.derived(MODEL, "decode")
    assert decode.unit == "output tok/s"
    assert decode.max_rate(SLA) == pytest.approx(4.0 * 100)  # where ITL crosses its target; TTFT is not its SLO
    # A TTFT target no aggregated load meets does not matter to a decode pool; the aggregated pool refuses it.
    assert decode.max_rate(Sla(ttft_s=0.01, itl_s=0.05)) == pytest.approx(400)
    with pytest.raises(ConfigError, match="no measured load meets the SLA"):
        PoolCapacity.derived(MODEL, "aggregated").max_rate(Sla(ttft_s=0.01, itl_s=0.05))


def test_a_prefill_worker_carries_its_prefill_share_short_of_the_queue_the_ttft_target_allows() -> None:
    prefill = PoolCapacity.derived(MODEL, "prefill")
    full = 500 / 0.1  # prompt tokens/s of a worker computing prompts back to back
    loose, tight = prefill.max_rate(SLA), prefill.max_rate(Sla(ttft_s=0.3, itl_s=0.05))
    assert tight < loose < full
    assert loose > 4.0 * 500, "more than the aggregated worker's prompt tokens/s: it does no decoding"
    assert prefill.curve.ttft_at(loose) == pytest.approx(SLA.ttft_s, rel=0.02)
    # ITL is not a prefill pool's SLO: a target none of the aggregated points meets changes nothing.
    assert prefill.max_rate(Sla(ttft_s=2.0, itl_s=0.001)) == pytest.approx(loose)
    with pytest.raises(ConfigError, match=r"prefill pool .*no load meets the SLA \(TTFT 0.05 s\)"):
        prefill.max_rate(Sla(ttft_s=0.05, itl_s=0.05))  # one prompt alone takes longer


def test_a_pool_capacity_file_is_read_in_its_tokens_and_judged_on_its_own_slo(tmp_path: Path) -> None:
    # A prefill worker measured with max_tokens 1 at 1000-token prompts: its ITL column is no SLO of its pool.
    path = tmp_path / "prefill.json"
    measured = CapacityModel.from_points([CapacityPoint(2, 0.2, 0.5), CapacityPoint(6, 1.0, 0.5),
                                          CapacityPoint(10, 3.0, 0.5)], startup_s=30.0)
    path.write_text(json.dumps({**json.loads(measured.to_json()), "mean_input": 1000}))
    config = AutoscaleConfig(pools=("prefill", "decode"), prefill_capacity=path)
    prefill = pool_capacity(config, MODEL, "prefill")
    assert prefill.max_rate(SLA) == pytest.approx(8 * 1000)  # TTFT crosses 2 s halfway between 6 and 10 req/s
    assert prefill.startup_s == 30.0 and "measured" in prefill.source
    assert pool_capacity(config, MODEL, "decode").max_rate(SLA) == pytest.approx(400)  # no file: derived
    # Without the mix it was measured at, a file says nothing in tokens.
    path.write_text(measured.to_json())
    with pytest.raises(ConfigError, match='add "mean_input"'):
        pool_capacity(config, MODEL, "prefill")


def test_the_mix_survives_the_json_and_an_aggregated_file_is_unchanged(tmp_path: Path) -> None:
    assert "mean_input" not in AGGREGATED.to_json()
    (tmp_path / "m.json").write_text(MODEL.to_json())
    assert CapacityModel.load(tmp_path / "m.json") == MODEL


def test_pools_without_a_mix_or_a_file_of_their_own_are_refused_at_start_up(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="prefill_capacity"):
        capacity_for(AutoscaleConfig(pools=("prefill", "decode"), per_worker_rps=4), backend="vllm")
    # Every pool with its own file: no aggregated model is needed, even for vLLM workers.
    for role, key in (("prefill", "mean_input"), ("decode", "mean_output")):
        (tmp_path / f"{role}.json").write_text(json.dumps({**json.loads(AGGREGATED.to_json()), key: 100}))
    config = AutoscaleConfig(pools=("prefill", "decode"), prefill_capacity=tmp_path / "prefill.json",
                             decode_capacity=tmp_path / "decode.json")
    capacity_for(config, backend="vllm")


def test_the_simulated_worker_profiled_at_start_gives_both_pools_a_capacity() -> None:
    config = AutoscaleConfig(pools=("prefill", "decode"))
    model = capacity_for(config, backend="sim")  # it records the mix it profiled at
    for role in config.pools:
        assert pool_capacity(config, model, role).max_rate(SLA) > 0, role


# -- the planner ----------------------------------------------------------------------------------------


def test_a_prefill_pool_scales_with_prompt_length_at_a_constant_rate_and_a_decode_pool_does_not() -> None:
    series = [(500.0, 100.0), (2000.0, 100.0), (8000.0, 100.0)]
    per_worker = planner("prefill").per_worker
    prefill = run("prefill", series)
    assert prefill == [math.ceil(10 * i / per_worker) for i, _ in series]
    assert prefill[0] < prefill[1] < prefill[2]
    assert run("decode", series) == [3, 3, 3]  # 10 req/s x 100 output tokens over 400 output tok/s per worker


def test_a_decode_pool_scales_with_output_length_at_a_constant_rate_and_a_prefill_pool_does_not() -> None:
    series = [(500.0, 50.0), (500.0, 200.0), (500.0, 800.0)]
    assert run("decode", series) == [2, 5, 20]  # 10 req/s x output tokens / 400 per worker
    prefill = run("prefill", series)
    assert prefill == [prefill[0]] * 3


def test_an_aggregated_pool_plans_in_requests_whatever_the_lengths() -> None:
    p = Planner(MODEL, SLA, predictor="constant", headroom=0.0)
    decisions = [p.decide(obs(k, "aggregated", 10.0, i, o)) for k, (i, o) in enumerate([(500, 50), (8000, 800)])]
    assert [d.desired for d in decisions] == [3, 3]
    assert decisions[0].reason == "up: predicted 10.00 req/s over 3 interval(s), 0 queued, 4.00 req/s per worker"


def test_a_pool_without_lengths_this_interval_keeps_the_last_it_saw() -> None:
    p = planner("decode")
    assert p.decide(obs(0, "decode", 10.0, 500, 200)).desired == 5
    assert p.decide(obs(1, "decode", 10.0, 0.0, 0.0)).desired == 5  # nothing finished: 200 tokens still


def test_each_pool_steps_up_only_for_its_own_slo_missed() -> None:
    # Busy workers (above half their capacity), the SLA missed two intervals running: one more worker, but only
    # for the pool whose SLO it is.
    cases: tuple[tuple[Role, dict[str, float], dict[str, float]], ...] = (
        ("prefill", {"ttft_p99": 5.0}, {"itl_p99": 1.0}), ("decode", {"itl_p99": 1.0}, {"ttft_p99": 5.0}))
    for role, missed, other in cases:
        p = planner(role)
        first = p.decide(obs(0, role, 10.0, 2000, 200, healthy=1)).desired
        for k in (1, 2, 3):
            assert p.decide(obs(k, role, 10.0, 2000, 200, healthy=first, **other)).desired == first, role
        p.decide(obs(4, role, 10.0, 2000, 200, healthy=first, **missed))
        stepped = p.decide(obs(5, role, 10.0, 2000, 200, healthy=first, **missed))
        assert stepped.desired == first + 1 and "SLA missed" in stepped.reason, role


def test_the_dynamo_style_policy_corrects_each_pool_by_its_own_latency() -> None:
    prefill = DynamoStyle(PoolCapacity.derived(MODEL, "prefill"), SLA, max_workers=64)
    decode = DynamoStyle(PoolCapacity.derived(MODEL, "decode"), SLA, max_workers=64)
    short_p = prefill.decide(obs(0, "prefill", 10.0, 500, 100)).desired
    short_d = decode.decide(obs(0, "decode", 10.0, 500, 100)).desired
    base_p = prefill.decide(obs(0, "prefill", 10.0, 4000, 100)).desired
    base_d = decode.decide(obs(0, "decode", 10.0, 500, 400)).desired
    assert base_p > short_p and base_d > short_d
    assert base_d == 10  # 10 req/s x 400 output tokens over 400 output tok/s per worker
    # Latency worse than the capacity model expects at each worker's load moves a pool by its own SLO only.
    assert decode.decide(obs(1, "decode", 10.0, 500, 400, healthy=base_d, itl_p99=0.2)).desired > base_d
    assert prefill.decide(obs(1, "prefill", 10.0, 4000, 100, healthy=base_p, itl_p99=0.2)).desired == base_p
    assert prefill.decide(obs(1, "prefill", 10.0, 4000, 100, healthy=base_p, ttft_p99=20.0)).desired > base_p
    assert decode.decide(obs(1, "decode", 10.0, 500, 400, healthy=base_d, ttft_p99=20.0)).desired == base_d


# -- what the daemon observes and reports ---------------------------------------------------------------


class Metrics:
    """The /metrics of a router, two prefill and one decode worker, as counters that tests move on."""

    def __init__(self) -> None:
        self.received = 0.0
        self.ttft: dict[str, float] = {"0.5": 0.0, "2.5": 0.0, "+Inf": 0.0}
        self.itl: dict[str, float] = {"0.025": 0.0, "0.1": 0.0, "+Inf": 0.0}
        self.workers = {w: {"vllm:prompt_tokens_total": 0.0, "vllm:generation_tokens_total": 0.0,
                            "vllm:request_success_total": 0.0, "vllm:num_requests_waiting": 0.0,
                            "vllm:num_requests_running": 0.0, "vllm:kv_cache_usage_perc": 0.0}
                        for w in ("p1", "p2", "d1")}

    def text(self, host: str) -> str:
        if host == "r0":
            lines = [f"fleetward_router_requests_received_total {self.received}"]
            lines += [f'fleetward_router_time_to_first_token_seconds_bucket{{le="{le}"}} {n}'
                      for le, n in self.ttft.items()]
            lines += [f'fleetward_router_time_per_output_token_seconds_bucket{{le="{le}"}} {n}'
                      for le, n in self.itl.items()]
            return "\n".join(lines) + "\n"
        return "".join(f"{name} {v}\n" for name, v in self.workers[host].items())

    def serve(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=self.text(request.url.host))

    def finish(self, worker: str, requests: int, prompt: int, output: int) -> None:
        w = self.workers[worker]
        w["vllm:request_success_total"] += requests
        w["vllm:prompt_tokens_total"] += requests * prompt
        w["vllm:generation_tokens_total"] += requests * output


def fleet() -> FleetSnapshot:
    snap = FleetSnapshot("c", routers={"r0": {"url": "http://r0"}})
    for wid, role in (("p1", "prefill"), ("p2", "prefill"), ("d1", "decode")):
        snap.workers[wid] = WorkerRecord(wid, f"http://{wid}", cast(Role, role), "m", "n1", "sim")
        snap.health[wid] = HealthRecord(HealthState.READY)
    return snap


async def test_each_pool_observes_its_own_lengths_and_reports_only_the_slos_that_apply() -> None:
    metrics, clock = Metrics(), ManualClock()
    http = httpx.AsyncClient(transport=httpx.MockTransport(metrics.serve))
    observer = Observer(cast(StateStore, None), Keys("c"), clock=clock, http=http)
    pools: tuple[Role, ...] = ("aggregated", "prefill", "decode")
    config = AutoscaleConfig(pools=pools, ttft_s=2.0, itl_s=0.05)
    scaler = Autoscaler(config, store=cast(StateStore, None), bus=cast(EventBus, None), keys=Keys("c"),
                        capacity=MODEL, actuator=cast(Actuator, None), clock=clock, observer=observer)
    try:
        await observer.observe(pools, INTERVAL, fleet=fleet())  # the baseline
        # 300 requests in 30 s: each prefilled with max_tokens 1 on p1 or p2, then decoded on d1.
        metrics.received = 300
        metrics.finish("p1", 200, prompt=600, output=1)
        metrics.finish("p2", 100, prompt=300, output=1)
        metrics.finish("d1", 300, prompt=500, output=120)
        metrics.ttft = {"0.5": 270.0, "2.5": 300.0, "+Inf": 300.0}
        metrics.itl = {"0.025": 150.0, "0.1": 300.0, "+Inf": 300.0}
        clock.advance(INTERVAL)
        seen = await observer.observe(pools, INTERVAL, fleet=fleet())
        for pool, (o, _) in seen.items():
            scaler._gauges(pool, PoolRecord(pool), o)
    finally:
        await http.aclose()
    prefill, decode = seen["prefill"][0], seen["decode"][0]
    assert prefill.arrival_rate == decode.arrival_rate == pytest.approx(10.0)
    assert prefill.mean_input == pytest.approx(500) and prefill.mean_output == 0.0  # not the one token per prefill
    assert decode.mean_output == pytest.approx(120)
    assert prefill.healthy == 2 and decode.healthy == 1

    def attainment(pool: str, slo: str) -> float | None:
        return scaler.metrics.registry.get_sample_value("fleetward_autoscaler_sla_attainment_ratio",
                                                        {"pool": pool, "slo": slo})

    ttft_share, itl_share = (270 + 30 * 1.5 / 2) / 300, (150 + 150 * 0.025 / 0.075) / 300
    assert attainment("prefill", "ttft") == pytest.approx(ttft_share) and attainment("prefill", "itl") is None
    assert attainment("decode", "itl") == pytest.approx(itl_share) and attainment("decode", "ttft") is None
    assert attainment("aggregated", "ttft") == pytest.approx(ttft_share)
    assert attainment("aggregated", "itl") == pytest.approx(itl_share)
