"""A busy engine is not a hung one: a canary that waits behind long engine steps restarts nothing.

Clients beside the router are normal (a gateway while servers are adopted, a batch job, an evaluation harness):
the routers see none of their work. Here two of them send scoring requests straight to the one worker, as
lm-eval-harness's loglikelihood request does: a long prompt, one token asked for, each prompt one long engine
step. The engine stays in steps of about 3 s, past the canary's deadline (the product's 2 s), so canaries go
unanswered in time. The worker's own counters say the engine computes meanwhile: busy, so it stays ready.
One step longer than a canary and the watch after it (a cold code path) moves no counter, but the node agent
sees the engine's processes compute (CPU): busy too. The same load over a hung engine (the simulated worker's
hang switch: no step completes, nothing computes) is still named a hang, its verdict saying what stood still.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from testkit import BusRecorder, fleet_sim

from fleetward.chaos.harness import TestFleet
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.config import SupervisorConfig
from fleetward.fleet.registry import read_fleet

pytestmark = pytest.mark.asyncio(loop_scope="module")

# 2 ms a prompt token: a 750-token prompt is a 1.5 s prefill, and two of them share each step (3 s). The steps
# compute (a core busy for their time), as an engine's do: what the node agent's CPU evidence sees.
SIM = fleet_sim(seed=11, prefill_ms_per_token=2.0, compute_steps=True)
PROMPT_LEN = 750
COLD_LEN = 3600  # one step of 7.2 s: a cold code path, a first-use compile
# The product's canary deadline (2 s) and busy bound; a canary every second instead of every 15 s, so that many
# fall inside a step.
SUPERVISOR = SupervisorConfig(canary_interval_s=1.0, restart_budget=100, backoff_initial_s=0.05, backoff_max_s=0.2)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(etcd_endpoint: str, broker_endpoint: str,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TestFleet]:
    async with TestFleet(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster="busy-engine",
                         run_dir=tmp_path_factory.mktemp("busy-engine"), workers=1, backend=SimBackend(SIM),
                         supervisor=SUPERVISOR) as f:
        f.events = BusRecorder(f.bus)  # type: ignore[attr-defined]
        await f.events.subscribed.wait()  # type: ignore[attr-defined]
        yield f


class Scoring:
    """Clients sending scoring requests straight to a worker, one after another each, until stopped."""

    def __init__(self, url: str, clients: int = 2, prompt_len: int = PROMPT_LEN) -> None:
        self.url = url
        self.prompt_len = prompt_len
        self.answered = 0
        self.failed: list[str] = []
        self.stop = asyncio.Event()
        self.tolerate_failures = False  # once the worker is made to hang: its restart cuts what is under way
        self._tasks = [asyncio.create_task(self._client(k)) for k in range(clients)]

    async def _client(self, k: int) -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            n = 0
            while not self.stop.is_set():
                n += 1
                prompt = [(k * 31 + n * 13 + i * 7) % 200 + 20 for i in range(self.prompt_len)]
                try:
                    r = await client.post(f"{self.url}/v1/completions", json={
                        "model": SIM.model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0})
                except httpx.HTTPError as exc:
                    if not self.tolerate_failures:
                        self.failed.append(f"{type(exc).__name__}: {exc}")
                    await asyncio.sleep(0.2)
                    continue
                if r.status_code == 200:
                    self.answered += 1
                elif not self.tolerate_failures:
                    self.failed.append(f"HTTP {r.status_code}: {r.text[:200]}")

    async def aclose(self) -> None:
        self.stop.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def canaries(fleet: TestFleet, result: str) -> float:
    registry = fleet.controllers[0][0].metrics.registry
    return registry.get_sample_value("fleetward_supervisor_canaries_total", {"result": result}) or 0.0


async def worker_url(fleet: TestFleet, worker: str) -> str:
    return (await read_fleet(fleet.store, fleet.keys)).workers[worker].url


async def test_canaries_that_wait_behind_long_steps_restart_nothing(fleet: TestFleet, wait_until: Any) -> None:
    events = fleet.events  # type: ignore[attr-defined]
    await fleet.wait_healthy()
    (worker,) = fleet.worker_ids
    mark = events.mark()
    before = {r: canaries(fleet, r) for r in ("busy", "failed")}

    def unanswered() -> float:
        return sum(canaries(fleet, r) - before[r] for r in before)

    load = Scoring(await worker_url(fleet, worker))
    try:
        # Three canaries unanswered in time on the busy engine: without the engine's progress as evidence, the
        # first two of them in a row made the worker suspect, then unhealthy, and restarted it.
        await wait_until(lambda: unanswered() >= 3, timeout=90, message="three canaries unanswered in time")
    finally:
        await load.aclose()
    assert events.of("health.changed", worker, mark) == [], "the busy worker stayed ready"
    assert canaries(fleet, "failed") == before["failed"], "each one waited behind the engine's work: busy"
    assert not load.failed, load.failed
    assert load.answered >= 4
    assert not events.of("restart", worker, mark) and not events.of("hang.detected", worker, mark)
    assert (await read_fleet(fleet.store, fleet.keys)).health[worker].state.value == "ready"


async def test_one_step_longer_than_two_canaries_that_computes_restarts_nothing(fleet: TestFleet,
                                                                                wait_until: Any) -> None:
    """Steps of 7.2 s: a canary and the watch after it (2 s and 2 s) see the token counters stand still, but
    the node agent sees the engine's processes compute: one long step, not a hang."""
    events = fleet.events  # type: ignore[attr-defined]
    await fleet.wait_healthy()
    (worker,) = fleet.worker_ids
    controller = fleet.controllers[0][0]
    mark = events.mark()
    before = {r: canaries(fleet, r) for r in ("busy", "failed")}
    load = Scoring(await worker_url(fleet, worker), clients=1, prompt_len=COLD_LEN)
    try:
        await wait_until(lambda: worker in controller._computing, timeout=60,
                         message="the agent says the engine computes")
        await wait_until(lambda: sum(canaries(fleet, r) - before[r] for r in before) >= 2, timeout=90,
                         message="two canaries unanswered in time")
    finally:
        await load.aclose()
    assert events.of("health.changed", worker, mark) == [], "the computing worker stayed ready"
    assert canaries(fleet, "failed") == before["failed"], "each one waited on a step that computes: busy"
    assert not load.failed, load.failed
    assert not events.of("restart", worker, mark) and not events.of("hang.detected", worker, mark)


async def test_the_same_load_on_a_hung_engine_is_named_a_hang(fleet: TestFleet, wait_until: Any) -> None:
    events = fleet.events  # type: ignore[attr-defined]
    await fleet.wait_healthy()
    (worker,) = fleet.worker_ids
    load = Scoring(await worker_url(fleet, worker))
    try:
        await wait_until(lambda: load.answered >= 2, timeout=60, message="the scoring load is served")
        mark = events.mark()
        load.tolerate_failures = True
        await fleet.fault(worker, hang=True)  # no step completes; /health and /metrics still answer
        await wait_until(lambda: events.of("hang.detected", worker, mark), timeout=90, message="hang detected")
    finally:
        await load.aclose()
    (hang,) = events.of("hang.detected", worker, mark)[:1]
    assert "canary" in hang.data["detector"], hang.data
    assert "stood still" in hang.data["reason"], hang.data  # the verdict says what the counters showed
    await wait_until(lambda: events.of("restart", worker, mark), timeout=30, message="restart issued")
    await fleet.wait_healthy()
