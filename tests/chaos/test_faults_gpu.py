"""GPU faults through the fake GPU health source, on simulated workers under a real node agent and controller.

Each fault is driven through inject → verify (the supervisor reacted as its Xid/ECC policy says) → recover
(the GPU is reset; a quarantine is cleared through the control API) → verify recovered (ready and serving).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from testkit import fleet_sim

from fleetward.chaos.fakegpu import FakeGpuSource
from fleetward.chaos.fault import CATALOGUE, Target
from fleetward.chaos.faults import FaultUnavailable, cycle
from fleetward.chaos.harness import FleetContext, TestFleet
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.config import SupervisorConfig
from fleetward.fleet.registry import read_fleet

pytestmark = pytest.mark.asyncio(loop_scope="module")

SIM = fleet_sim(seed=13)
SUPERVISOR = SupervisorConfig(gpu_poll_interval_s=0.1, restart_budget=1000, backoff_initial_s=0.05, backoff_max_s=0.2,
                              canary_interval_s=5.0, canary_timeout_s=1.0)
RESTART_XIDS = (13, 31, 43)
QUARANTINE_XIDS = (48, 63, 64, 74, 79, 92, 94, 95)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(etcd_endpoint: str, broker_endpoint: str, tmp_path_factory: pytest.TempPathFactory
                ) -> AsyncIterator[TestFleet]:
    async with TestFleet(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster="gpu-faults", workers=2,
                         backend=SimBackend(SIM), supervisor=SUPERVISOR, gpu=FakeGpuSource(2), gpus_per_worker=1,
                         run_dir=tmp_path_factory.mktemp("gpu-faults")) as f:
        yield f


@pytest_asyncio.fixture(loop_scope="module")
async def ctx(fleet: TestFleet) -> AsyncIterator[FleetContext]:
    yield fleet.fault_context()
    await fleet.wait_workers_routable(len(fleet.worker_ids), timeout=60)


async def gpu_cycle(ctx: FleetContext, name: str, worker: str = "node-w0", **params: Any) -> Any:
    return await cycle(ctx, name, Target(kind="worker", ids=(worker,)), **params)


async def health(fleet: TestFleet, worker: str) -> Any:
    return (await read_fleet(fleet.store, fleet.keys)).health[worker]


@pytest.mark.parametrize("code", RESTART_XIDS)
async def test_an_application_xid_restarts_the_worker(fleet: TestFleet, ctx: FleetContext, code: int) -> None:
    before = (await health(fleet, "node-w0")).extra.get("restart_count", 0)
    fault = await gpu_cycle(ctx, "gpu.xid", code=code)
    assert fault.detail["expected"] == "restart_worker"
    assert (await health(fleet, "node-w0")).extra["restart_count"] > before


@pytest.mark.parametrize("code", QUARANTINE_XIDS)
async def test_a_hardware_xid_quarantines_the_gpu_until_an_operator_clears_it(fleet: TestFleet, ctx: FleetContext,
                                                                              code: int) -> None:
    fault = await gpu_cycle(ctx, "gpu.xid", "node-w1", code=code)
    assert fault.detail["expected"] == "drain_and_quarantine"
    assert fault.detail["unquarantine"] == {"node-w1": 200}
    gpu = fault.detail["gpus"]["node-w1"]
    assert await fleet.store.get(fleet.keys.quarantine_of("node", gpu)) is None, "cleared with the quarantine"


async def test_a_double_bit_ecc_error_quarantines_the_gpu(ctx: FleetContext) -> None:
    fault = await gpu_cycle(ctx, "gpu.ecc_dbe")
    assert fault.detail["expected"] == "drain_and_quarantine"


@pytest.mark.parametrize("off_bus", [False, True])
async def test_a_lost_gpu_quarantines_it(ctx: FleetContext, off_bus: bool) -> None:
    fault = await gpu_cycle(ctx, "gpu.lost", "node-w1", off_bus=off_bus)
    assert fault.detail["expected"] == "drain_and_quarantine"


async def test_thermal_throttling_makes_the_worker_suspect_and_slower_but_never_restarts_it(
        fleet: TestFleet, ctx: FleetContext) -> None:
    before = (await health(fleet, "node-w0")).extra.get("restart_count", 0)
    fault = await gpu_cycle(ctx, "gpu.thermal_throttle", slowdown=4)
    assert fault.detail["expected"] == "degraded" and fault.detail["slowed"] == ["node-w0"]
    assert (await health(fleet, "node-w0")).extra.get("restart_count", 0) == before
    assert float((await fleet.state("node-w0"))["faults"]["slowdown"]) == 1.0


async def test_silent_corruption_gives_wrong_tokens_with_200_until_recovered(ctx: FleetContext) -> None:
    fault = await gpu_cycle(ctx, "gpu.silent_corruption", "node-w1")
    probe = fault.detail["probe"]["node-w1"]
    assert probe["got"] == probe["expected"], "the last probe (after recovery) is right again"


async def test_dcgm_injection_without_dcgm_is_unavailable_with_the_reason(ctx: FleetContext) -> None:
    spec = CATALOGUE["gpu.xid"]
    fault = spec.factory(spec.params(code=13, source="dcgm"), Target(kind="worker", ids=("node-w0",)))
    with pytest.raises(FaultUnavailable, match=r"dcgmi|DCGM|NVIDIA"):
        await fault.inject(ctx)


@pytest.mark.asyncio(loop_scope="module")
async def test_an_xid_the_supervisor_ignores_is_refused_as_a_parameter() -> None:
    spec = CATALOGUE["gpu.xid"]
    with pytest.raises(ValueError, match="ignores Xid 154"):  # informational: it summarises another Xid
        spec.params(code=154)
