"""Process faults on real simulated workers under a real node agent (and the supervisor controller)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from testkit import fleet_serves, fleet_sim, routed_fleet

from fleetward.chaos.fault import CATALOGUE, Target
from fleetward.chaos.faults import BaseFault, FaultUnavailable, cycle
from fleetward.chaos.faults._base import running_tree
from fleetward.chaos.faults.process import FreezerGroup, MemoryGroup
from fleetward.chaos.harness import FleetContext, TestFleet
from fleetward.sim.model import SimModel
from fleetward.supervisor.signals import Severity, Signal

pytestmark = pytest.mark.asyncio(loop_scope="module")

SIM = fleet_sim(seed=5)
MODEL = SimModel(seed=SIM.seed)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(etcd_endpoint: str, broker_endpoint: str,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TestFleet]:
    async with routed_fleet(etcd_endpoint, broker_endpoint, tmp_path_factory.mktemp("proc-faults"), "proc-faults",
                            SIM) as f:
        yield f


@pytest_asyncio.fixture(loop_scope="module")
async def ctx(fleet: TestFleet) -> AsyncIterator[FleetContext]:
    yield fleet.fault_context()
    await fleet.restore(timeout=60)  # whatever a test did, the next one starts from a whole fleet


async def fault_cycle(ctx: FleetContext, name: str, worker: str, **params: Any) -> Any:
    return await cycle(ctx, name, Target(kind="worker", ids=(worker,)), **params)


@pytest.mark.parametrize("scope", ["tree", "root"])
async def test_kill_worker(fleet: TestFleet, ctx: FleetContext, scope: str) -> None:
    old = fleet.handle("node-w0").process.pid
    await fault_cycle(ctx, "process.kill_worker", "node-w0", scope=scope)
    assert fleet.handle("node-w0").process.pid != old
    await fleet_serves(fleet, SIM, f"process.kill_worker {scope}")


async def test_kill_engine_on_the_sim_kills_its_one_process(fleet: TestFleet, ctx: FleetContext) -> None:
    old = fleet.handle("node-w1").process.pid
    fault = await fault_cycle(ctx, "process.kill_engine", "node-w1")
    assert fault.detail["engine_pids"] == {"node-w1": [old]}
    await fleet_serves(fleet, SIM, "process.kill_engine")


async def test_a_silent_hang_keeps_health_green_and_clears(fleet: TestFleet, ctx: FleetContext) -> None:
    fault = await fault_cycle(ctx, "process.hang", "node-w2", mode="silent")
    assert fault.detail["switched"] == ["node-w2"]
    assert not (await fleet.state("node-w2"))["hung"]
    await fleet_serves(fleet, SIM, "silent hang")


async def test_a_frozen_worker_stops_answering_and_resumes(fleet: TestFleet, ctx: FleetContext) -> None:
    fault = await fault_cycle(ctx, "process.hang", "node-w2", mode="freeze")
    assert fault.detail["stopped_pids"]["node-w2"]
    await fleet_serves(fleet, SIM, "freeze")


async def test_a_worker_frozen_by_the_cgroup_freezer_is_named_hung_by_its_agent_and_thaws(
        fleet: TestFleet, ctx: FleetContext, wait_until: Any) -> None:
    """No signal and no stopped process: the idle sim's one process sleeps in the kernel. Its agent sees the
    engine unscheduled, probes it, and names the hang when the probe waits (engine-frozen, fatal)."""
    reason = FreezerGroup.unavailable_reason()
    if reason:
        pytest.skip(reason)
    victim = "node-w2"
    spec = CATALOGUE["process.hang"]
    fault = spec.factory(spec.params(mode="cgroup_freeze"), Target(kind="worker", ids=(victim,)))
    assert isinstance(fault, BaseFault)
    key = fleet.keys.signal(victim, "engine-frozen")
    try:
        await fault.inject(ctx)
        assert await fault.verify(ctx), fault.describe()
        assert fault.detail["stopped_pids"][victim] == [fleet.handle(victim).process.pid]

        async def named_hung() -> Signal | None:
            kv = await fleet.store.get(key)
            sig = Signal.from_json(kv.value) if kv is not None else None
            return sig if sig is not None and sig.severity is Severity.FATAL else None

        sig = await wait_until(named_hung, timeout=30, message="the agent names the frozen engine")
        assert sig.extra.get("hang") is True and "not scheduled" in sig.reason, sig
    finally:
        await fault.recover(ctx)
    assert await fault.verify_recovered(ctx), fault.describe()
    assert not leftover_groups(fault), "the freezer cgroup is gone"
    await fleet_serves(fleet, SIM, "cgroup freeze")


async def test_a_crash_loop_fails_every_start_until_recovered(fleet: TestFleet, ctx: FleetContext) -> None:
    fault = await fault_cycle(ctx, "process.crash_loop", "node-w1", verify_timeout_s=20)
    assert fault.detail["starts"]["node-w1"] >= 1, "it was started, and that start failed"
    await fleet_serves(fleet, SIM, "crash loop")


async def test_a_slow_start_is_seen_starting_and_then_serves(fleet: TestFleet, ctx: FleetContext) -> None:
    await fault_cycle(ctx, "process.slow_start", "node-w0", delay_s=2.0)
    await fleet_serves(fleet, SIM, "slow start")


async def test_the_oom_killer_kills_the_worker_in_its_memory_cgroup_only(fleet: TestFleet, ctx: FleetContext) -> None:
    reason = MemoryGroup.unavailable_reason()
    if reason:
        pytest.skip(reason)
    others = {w: fleet.handle(w).process.pid for w in ("node-w0", "node-w2")}
    fault = await fault_cycle(ctx, "process.oom_kill", "node-w1", verify_timeout_s=30)
    assert fault.detail["oom_kills"]["node-w1"] >= 1
    assert {w: fleet.handle(w).process.pid for w in others} == others, "nothing else was killed"
    assert not leftover_groups(fault), "the cgroup is gone"
    await fleet_serves(fleet, SIM, "oom kill")


def leftover_groups(fault: Any) -> list[str]:
    from pathlib import Path

    return [g["path"] for g in fault.detail["groups"].values() if Path(g["path"]).exists()]


async def test_a_process_fault_on_an_attached_fleet_says_its_processes_are_not_ours() -> None:
    class Attached:  # what a fleet reached through its etcd answers: no process of it is here
        def processes(self, worker: str) -> list[Any]:
            return []

    with pytest.raises(FaultUnavailable, match=r"worker w0 is not available on an attached fleet .* not ours"):
        running_tree(Attached(), "w0")  # type: ignore[arg-type]
