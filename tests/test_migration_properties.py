"""Property: under any fault schedule, every client stream equals the fault-free reference, or fails with a
reason and what it delivered is an exact prefix of the reference.

Real simulated worker processes behind a real router process; faults are real (SIGKILL of a worker,
engine hang with /health still 200, vLLM's in-band engine error, connection resets, slowdowns), fired
when the clients together have received a given number of tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fleetward.chaos.harness import TestFleet
from fleetward.chaos.workload import sse_lines
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.config import RouterConfig, SimConfig, SupervisorConfig
from fleetward.sim.model import SimModel

SIM = SimConfig(decode_step_ms=3.0, decode_ms_per_seq=0.05, prefill_ms_per_token=0.01, seed=11)
MODEL = SimModel(seed=SIM.seed)
WORKERS = 4
FAULTS = ("crash", "hang", "engine_error", "reset", "slow")


@dataclass(frozen=True)
class Fault:
    at_tokens: int
    kind: str
    worker: int


@dataclass(frozen=True)
class Req:
    prompt: tuple[int, ...]
    max_tokens: int


requests_st = st.lists(
    st.builds(Req, st.lists(st.integers(35, 126), min_size=1, max_size=40).map(tuple), st.integers(5, 90)),
    min_size=1, max_size=8)
faults_st = st.lists(st.builds(Fault, st.integers(0, 250), st.sampled_from(FAULTS), st.integers(0, WORKERS - 1)),
                     max_size=3)


class Harness:
    """A fleet on its own event loop, driven synchronously from hypothesis examples."""

    def __init__(self, etcd: str, mqtt: str, run_dir: Any) -> None:
        self.loop = asyncio.new_event_loop()
        routing = RouterConfig(stall_floor_s=0.4, migration_limit=4, checkpoint_interval_ms=50)
        supervisor = SupervisorConfig(restart_budget=10_000, backoff_initial_s=0.05, backoff_max_s=0.2)
        self.fleet = TestFleet(etcd=etcd, mqtt=mqtt, cluster="migration-props", run_dir=run_dir, workers=WORKERS,
                               backend=SimBackend(SIM), routing=routing, supervisor=supervisor)
        self.run(self.fleet.start())
        self.router = self.run(self.fleet.start_router("props"))
        self.fired: dict[str, int] = {}

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    async def restore(self) -> None:
        """Clear fault switches; the supervisor restarts what the example killed or hung."""
        await self.fleet.restore(timeout=60)

    def close(self) -> None:
        self.run(self.fleet.aclose())
        self.loop.close()


@pytest.fixture(scope="module")
def harness(etcd_endpoint: str, broker_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    h = Harness(etcd_endpoint, broker_endpoint, tmp_path_factory.mktemp("props"))
    try:
        yield h
    finally:
        h.close()


async def fire(h: Harness, fault: Fault) -> None:
    fleet = h.fleet
    wid = fleet.worker_ids[fault.worker]
    if not fleet.processes(wid):
        return  # already dead
    h.fired[fault.kind] = h.fired.get(fault.kind, 0) + 1
    try:
        if fault.kind == "crash":
            fleet.kill(wid)
        elif fault.kind == "hang":
            await fleet.fault(wid, hang=True)
        elif fault.kind == "engine_error":
            await fleet.fault(wid, fail_inflight=True)
        elif fault.kind == "reset":
            await fleet.fault(wid, reset_inflight=True)
        else:
            await fleet.fault(wid, slowdown=6.0)
    except httpx.HTTPError:
        pass  # the worker died under us: a fault too


async def one_example(h: Harness, reqs: list[Req], faults: list[Fault]) -> list[tuple[Req, list[int], Any]]:
    pending = sorted(faults, key=lambda f: f.at_tokens)
    received = 0
    lock = asyncio.Lock()

    async def tick(n: int) -> None:
        nonlocal received
        async with lock:
            received += n
            while pending and pending[0].at_tokens <= received:
                await fire(h, pending.pop(0))

    async def one(client: httpx.AsyncClient, req: Req) -> tuple[Req, list[int], Any]:
        tokens: list[int] = []
        error = None
        finishes = []
        body = {"model": "sim-tiny", "prompt": list(req.prompt), "max_tokens": req.max_tokens, "stream": True,
                "return_token_ids": True}
        async with client.stream("POST", h.router.url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return req, tokens, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            async for line in sse_lines(r.aiter_bytes()):
                if not line.startswith("data: {"):
                    continue
                data = orjson.loads(line[6:])
                if "error" in data:
                    error = data["error"]["message"]
                    continue
                for choice in data["choices"]:
                    tokens.extend(choice["token_ids"])
                    if choice["finish_reason"]:
                        finishes.append(choice["finish_reason"])
                    await tick(len(choice["token_ids"]))
        assert error is not None or finishes == ["length"], f"one finish reason per stream, got {finishes}"
        return req, tokens, error

    await tick(0)
    async with httpx.AsyncClient(timeout=60) as client:
        results = await asyncio.gather(*(one(client, r) for r in reqs))
    await h.restore()
    return results


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(reqs=requests_st, faults=faults_st)
@example(reqs=[Req((40, 41, 42), 60)] * 4, faults=[Fault(50, "crash", 0), Fault(90, "crash", 1)])
@example(reqs=[Req((50, 51), 60)] * 4, faults=[Fault(40, "hang", 2)])
@example(reqs=[Req((60,), 70)] * 4, faults=[Fault(30, "engine_error", 3), Fault(60, "reset", 0)])
@example(reqs=[Req((70, 71, 72, 73), 80)] * 3, faults=[Fault(20, "slow", 1), Fault(45, "reset", 1)])
def test_every_stream_equals_the_reference_under_any_fault_schedule(harness: Harness, reqs: list[Req],
                                                                    faults: list[Fault]) -> None:
    results = harness.run(one_example(harness, reqs, faults))
    for req, tokens, error in results:
        expected = MODEL.continuation(list(req.prompt), req.max_tokens)
        if error is None:
            assert tokens == expected, "a completed stream must equal the fault-free reference"
        else:
            assert tokens == expected[: len(tokens)], f"a failed stream delivered a wrong token ({error})"
            assert any(w in error for w in ("no healthy worker", "migration_limit", "deadline")), error
    if not faults:
        assert all(error is None for _, _, error in results), "no fault, no failure"


def test_the_schedules_above_really_fired_faults_and_migrated_streams(harness: Harness) -> None:
    """Guards the property above against passing vacuously."""
    assert set(harness.fired) == set(FAULTS), harness.fired
    metrics = httpx.get(harness.router.url + "/metrics").text
    migrations = sum(float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("fleetward_router_migrations_total"))
    assert migrations >= 10
