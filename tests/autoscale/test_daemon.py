"""The autoscaler daemon on a live fleet: real etcd, a real broker, a real supervisor controller process, a real
router process and simulated workers as processes.

- Scale-up under load, then scale-down while long streams run: the retired workers are drained, their
  streams move to the survivor after the drain deadline, and every stream equals the model's fault-free
  continuation (the chaos checkers' alignment finds no lost, duplicated or corrupted token).
- Leader failover between deciding and acting: the new leader finishes what the old one decided, once.
- What the daemon reads: the Prometheus histogram arithmetic and the pools' membership, without IO.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import orjson
import pytest
from testkit import metric

from fleetward.autoscale.actuate import LocalActuator, NewWorker
from fleetward.autoscale.capacity import CapacityModel, CapacityPoint
from fleetward.autoscale.daemon import Autoscaler, PoolRecord
from fleetward.autoscale.observe import Observer, fraction_within, histogram_quantile
from fleetward.chaos.alignment import align
from fleetward.chaos.harness import TestFleet
from fleetward.chaos.workload import sse_lines
from fleetward.fleet.bus import Event
from fleetward.fleet.config import AutoscaleConfig, SimConfig
from fleetward.fleet.registry import FleetSnapshot, read_fleet
from fleetward.fleet.worker import HealthRecord, HealthState, WorkerRecord
from fleetward.sim.model import SimModel
from fleetward.sim.tokenizer import encode

SIM = SimConfig(decode_step_ms=15.0, decode_ms_per_seq=0.05, prefill_ms_per_token=0.01, seed=11)
MODEL = SimModel(seed=SIM.seed)
CAPACITY = CapacityModel((CapacityPoint(2.0, 0.0, 0.0), CapacityPoint(2.002, 1e9, 1e9)), startup_s=1.0)


# -- without IO -----------------------------------------------------------------------------------------


def test_histogram_quantile_interpolates_within_the_bucket_as_prometheus_does() -> None:
    buckets = {0.1: 50.0, 0.5: 90.0, 1.0: 100.0, math.inf: 100.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.7, buckets) == pytest.approx(0.1 + 0.4 * (20 / 40))
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * (9 / 10))
    assert histogram_quantile(0.99, {0.1: 0.0, math.inf: 0.0}) is None
    assert histogram_quantile(0.99, {0.1: 1.0, math.inf: 10.0}) == 0.1  # in +Inf: the highest finite bound


def test_the_share_within_an_sla_inverts_the_quantile() -> None:
    buckets = {0.1: 50.0, 0.5: 90.0, 1.0: 100.0, math.inf: 100.0}
    for q in (0.3, 0.5, 0.7, 0.95):
        bound = histogram_quantile(q, buckets)
        assert bound is not None and fraction_within(bound, buckets) == pytest.approx(q)
    assert fraction_within(2.0, buckets) == 1.0
    assert fraction_within(2.0, {0.1: 1.0, math.inf: 10.0}) == pytest.approx(0.1)  # +Inf: nothing known within
    assert fraction_within(0.1, {0.1: 0.0, math.inf: 0.0}) is None


def test_a_pool_counts_serving_starting_and_the_rest_and_places_unregistered_workers() -> None:
    fleet = FleetSnapshot("c")

    def worker(wid: str, role: Any = "aggregated") -> None:
        fleet.workers[wid] = WorkerRecord(wid, f"http://{wid}", role, "m", "n1", "sim")

    for wid in ("a", "b", "c", "p"):
        worker(wid, "prefill" if wid == "p" else "aggregated")
    fleet.health |= {"a": HealthRecord(HealthState.READY), "b": HealthRecord(HealthState.SUSPECT),
                     "c": HealthRecord(HealthState.DRAINING), "p": HealthRecord(HealthState.READY),
                     "s": HealthRecord(HealthState.STARTING, extra={"node": "n2"}),
                     "d": HealthRecord(HealthState.DEAD), "q": HealthRecord(HealthState.QUARANTINED)}
    view = Observer.view(fleet, "aggregated", {"d": "prefill"})
    assert view.serving() == ["a", "b"] and view.starting() == ["s"]
    assert set(view.members) == {"a", "b", "c", "s", "q"}, "d was placed in prefill by what the autoscaler knew"
    assert view.members["s"].node == "n2"
    view.running = {"a": 3.0, "b": 1.0}
    assert view.least_loaded(1) == ["b"]
    assert Observer.view(fleet, "prefill", {"d": "prefill"}).members.keys() == {"p", "d"}


def test_a_pool_record_survives_its_json() -> None:
    rec = PoolRecord("aggregated", desired=3, asked={"n-w2": "n"}, retiring=["n-w1"], parked=["n-w4"], seq=7)
    assert PoolRecord.from_json(rec.to_json()) == rec


# -- live -----------------------------------------------------------------------------------------------


@pytest.fixture
def sim_config() -> SimConfig:
    return SIM


class Scaler:
    """An autoscaler running in this process against the fleet (its actuator: the real control API)."""

    def __init__(self, fleet: TestFleet, config: AutoscaleConfig, name: str, actuator: Any = None) -> None:
        self.actuator = actuator or LocalActuator(fleet.store, fleet.keys, fleet.admin_token)
        self.scaler = Autoscaler(config, store=fleet.store, bus=fleet.bus, keys=fleet.keys, capacity=CAPACITY,
                                 actuator=self.actuator, autoscaler_id=name)
        self.task = asyncio.create_task(self.scaler.run(), name=name)

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self.actuator.aclose()


@contextlib.asynccontextmanager
async def scale_events(fleet: TestFleet) -> AsyncIterator[list[Event]]:
    seen: list[Event] = []
    subscribed = asyncio.Event()

    async def follow() -> None:
        async for event in fleet.bus.subscribe(["scale"], subscribed=subscribed):
            seen.append(event)

    task = asyncio.create_task(follow())
    await subscribed.wait()
    try:
        yield seen
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def stream(url: str, prompt: list[int], max_tokens: int) -> tuple[list[int], set[str], Any]:
    tokens: list[int] = []
    workers: set[str] = set()
    error = None
    async with httpx.AsyncClient(timeout=120) as client, client.stream(
            "POST", url + "/v1/completions", json={"model": "sim-tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                   "stream": True, "return_token_ids": True},
            headers={"X-Fleetward-Trace": "1"}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in sse_lines(r.aiter_bytes()):
            if line.startswith("data: {"):
                data = orjson.loads(line[6:])
                if "error" in data:
                    error = data["error"]
                    continue
                tokens.extend(data["choices"][0]["token_ids"])
                workers.add(data["fleetward"]["worker"])
    return tokens, workers, error


async def scale_down_moves(router: str) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(router + "/metrics")).text
    return {o: metric(text, "fleetward_router_moves_total", trigger="scale-down", outcome=o)
            for o in ("kv", "reprefill", "failed")}


async def serving(fleet: TestFleet) -> list[str]:
    snap = await read_fleet(fleet.store, fleet.keys)
    return sorted(w.id for w in snap.routable())


async def states(fleet: TestFleet) -> dict[str, str]:
    snap = await read_fleet(fleet.store, fleet.keys)
    return {w: h.state.value for w, h in snap.health.items()}


async def record(fleet: TestFleet) -> PoolRecord | None:
    kv = await fleet.store.get(fleet.keys.scale_of("aggregated"))
    return PoolRecord.from_json(kv.value) if kv else None


def exact(delivered: Sequence[int], expected: Sequence[int]) -> bool:
    anomalies, _, _ = align(delivered, expected)
    return not anomalies and list(delivered) == list(expected)


async def test_scales_up_under_load_and_down_by_draining_without_cutting_a_stream(fleet: TestFleet,
                                                                                   wait_until: Any) -> None:
    # The learned margin is off: it would keep the load's workers for 40 intervals after it stops (what bursty
    # traffic needs), and this test is about the drain that follows.
    config = AutoscaleConfig(interval_s=0.5, min_workers=1, max_workers=3, predictor="constant", down_stable=3,
                             headroom=0.0, drain_deadline_s=1.0, margin_quantile=0.0, capacity_trust_max=1.0)
    router = fleet.routers[0].url
    async with scale_events(fleet) as events:
        scaler = Scaler(fleet, config, "as-0")
        try:
            # Load: 8 short requests/s for a fleet sized at 2 per worker → 3 workers (the maximum).
            pressing = asyncio.Event()

            async def press() -> None:
                k = 0
                async with asyncio.TaskGroup() as tg:
                    while not pressing.is_set():
                        tg.create_task(stream(router, encode(f"load {k}"), 4))
                        k += 1
                        await asyncio.sleep(0.125)  # the load's pace, not a synchronisation

            load = asyncio.create_task(press())
            await wait_until(lambda: _count(serving(fleet), 3), timeout=90, message="scaled up to 3 under load")
            seen_under_load = [(await record(fleet)).observed]  # type: ignore[union-attr]
            # The load stops and long streams start, spread over the three workers: the planner wants 1 again.
            pressing.set()
            await load
            moves_before = await scale_down_moves(router)
            prompts = [encode(f"a long answer {i}: ") for i in range(6)]
            longs = [asyncio.create_task(stream(router, p, 400)) for p in prompts]
            results = await asyncio.gather(*longs)
            await wait_until(lambda: _count(serving(fleet), 1), timeout=90, message="scaled down to 1")
            await wait_until(lambda: _parked(fleet, 2), timeout=60, message="the retired workers stopped")
        finally:
            await scaler.stop()
    for prompt, (tokens, _, error) in zip(prompts, results, strict=True):
        assert error is None and exact(tokens, MODEL.continuation(prompt, 400)), "no stream cut by scale-down"
    moved = [workers for _, workers, _ in results if len(workers) > 1]
    assert moved, "some stream outlived its worker's drain deadline and moved to the survivor"
    moves = {k: v - moves_before[k] for k, v in (await scale_down_moves(router)).items()}
    # With its KV, as a scale-down (a stream may move twice when the two retirements come one after the other,
    # and one starved past its allowance on a busy host migrates without a move: counts are not equalities).
    assert moves["kv"] >= 1 and moves["failed"] == 0, (moves, moved)
    rec = await record(fleet)
    seen = seen_under_load[0]
    rate, mean_output, mean_input = seen["arrival_rate"], seen["mean_output"], seen["mean_input"]
    assert rate is not None and mean_output is not None and mean_input is not None, seen
    # The load as the routers and workers showed it: 8 req/s, 6-8-token prompts, 4-token answers. About, not
    # exactly: one 0.5 s interval's counter deltas over the ~4 requests it finished also hold the prompts of
    # requests admitted in it that finish in the next one, and the supervisors' canaries (13 seen once in CI).
    assert rate > 2 and 2 <= mean_output <= 6 and 2 <= mean_input <= 24
    assert rec is not None and rec.desired == 1 and sorted(rec.parked) == sorted(
        w for w, s in (await states(fleet)).items() if s == "dead")
    ups = [e for e in events if e.data.get("started")]
    downs = [e for e in events if e.data.get("retired")]
    assert sum(len(e.data["started"]) for e in ups) == 2 and sum(len(e.data["retired"]) for e in downs) == 2
    assert all(e.data["pool"] == "aggregated" and e.data["reason"] for e in events)


async def test_scaling_up_again_brings_back_the_workers_it_retired(fleet: TestFleet, wait_until: Any) -> None:
    """Parked workers are revived before new ids are made (ids stay bounded over days of cycles)."""
    up = AutoscaleConfig(interval_s=0.3, min_workers=2, max_workers=2)
    scaler = Scaler(fleet, up, "as-0")
    await wait_until(lambda: _count(serving(fleet), 2), timeout=60, message="min 2")
    await scaler.stop()
    down = AutoscaleConfig(interval_s=0.3, min_workers=1, max_workers=1, drain_deadline_s=0.5)
    scaler = Scaler(fleet, down, "as-1")
    await wait_until(lambda: _parked(fleet, 1), timeout=60, message="max 1: one retired and stopped")
    await scaler.stop()
    parked = (await record(fleet)).parked  # type: ignore[union-attr]
    scaler = Scaler(fleet, up, "as-2")
    await wait_until(lambda: _count(serving(fleet), 2), timeout=60, message="min 2 again")
    await scaler.stop()
    assert set(await serving(fleet)) == {"node-w0", *parked} and (await record(fleet)).parked == []  # type: ignore[union-attr]
    async with httpx.AsyncClient(timeout=5) as client:  # the links and checkpoints, as a live router reports them
        text = (await client.get(fleet.routers[0].url + "/metrics")).text
    for line in ("fleetward_etcd_up 1.0", "fleetward_broker_up 1.0"):
        assert line in text.splitlines()
    lag = next(float(ln.split()[1]) for ln in text.splitlines() if ln.startswith("fleetward_router_checkpoint_lag"))
    assert lag >= 0


class Stalled:
    """An actuator that starts the first worker it is asked for and then never returns: a leader cut off in
    the middle of carrying out its decision."""

    def __init__(self, real: LocalActuator) -> None:
        self.real = real
        self.reached = asyncio.Event()

    async def add(self, pool: str, workers: Sequence[NewWorker], reason: str) -> None:
        await self.real.add(pool, workers[:1], reason)
        self.reached.set()
        await asyncio.Event().wait()

    async def retire(self, pool: str, workers: Sequence[str], deadline_s: float, reason: str) -> None:
        raise AssertionError("nothing to retire here")

    async def aclose(self) -> None:
        await self.real.aclose()


async def test_a_standby_finishes_what_a_failed_leader_decided_once(fleet: TestFleet, wait_until: Any) -> None:
    config = AutoscaleConfig(interval_s=0.3, min_workers=3, max_workers=3)
    stalled = Stalled(LocalActuator(fleet.store, fleet.keys, fleet.admin_token))
    first = Scaler(fleet, config, "as-first", actuator=stalled)
    await asyncio.wait_for(stalled.reached.wait(), 30)
    standby = Scaler(fleet, config, "as-standby")
    decided = await record(fleet)
    assert decided is not None and decided.leader == "as-first" and sorted(decided.asked) == ["node-w1", "node-w2"]
    assert not standby.scaler.leading.is_set(), "one active planner: the standby waits"
    await first.stop()  # the leader dies half-way through acting on its decision
    try:
        await wait_until(lambda: _count(serving(fleet), 3), timeout=90, message="the standby finished the step")
        steps = standby.scaler.steps
        await wait_until(lambda: standby.scaler.steps >= steps + 5, timeout=30, message="five more intervals")
    finally:
        await standby.stop()
    assert await serving(fleet) == ["node-w0", "node-w1", "node-w2"], "the same workers, none started twice"
    assert set(await states(fleet)) == {"node-w0", "node-w1", "node-w2"}
    rec = await record(fleet)
    assert rec is not None and rec.leader == "as-standby" and rec.seq > decided.seq and rec.asked == {}
    started = [k for k in (await fleet.store.get_prefix(fleet.keys.actions)).items if k.key.endswith(".start")]
    assert len(started) == 2, "one start action per worker, whoever asked"


async def _count(names: Any, n: int) -> bool:
    return len(await names) == n


async def _parked(fleet: TestFleet, n: int) -> bool:
    rec = await record(fleet)
    return rec is not None and len(rec.parked) == n
