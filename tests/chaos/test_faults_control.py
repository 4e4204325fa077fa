"""Control-plane faults on a fleet with its own 3-member etcd cluster and broker (KV faults:
tests/migration/test_pd_kv.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from testkit import fleet_serves, fleet_sim

from fleetward.chaos.fault import CATALOGUE, Target
from fleetward.chaos.faults import FaultUnavailable, cycle
from fleetward.chaos.faults.control import etcd_leader
from fleetward.chaos.harness import FleetContext, TestFleet
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.config import RouterConfig
from fleetward.sim.model import SimModel

pytestmark = pytest.mark.asyncio(loop_scope="module")

SIM = fleet_sim(seed=9)
MODEL = SimModel(seed=SIM.seed)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TestFleet]:
    async with TestFleet(etcd="", mqtt="", etcd_members=3, own_broker=True, proxy_control=True,
                         cluster="control-faults", workers=2, backend=SimBackend(SIM), lease_ttl=2,
                         run_dir=tmp_path_factory.mktemp("control-faults"),
                         routing=RouterConfig(stall_floor_s=0.5, lease_ttl_s=2)) as f:
        await f.start_router("r0")
        yield f


@pytest_asyncio.fixture(loop_scope="module")
async def ctx(fleet: TestFleet) -> AsyncIterator[FleetContext]:
    yield fleet.fault_context()
    for link in fleet.proxies:
        link.clear()


async def test_the_fleet_runs_on_three_members_and_every_component_gets_them_all(fleet: TestFleet) -> None:
    assert len(fleet.etcd_endpoints) == 3
    assert len(fleet.proxies.get("agent->etcd").proxies) == 3
    assert fleet.proxies.get("r0->etcd").proxies[0].upstreams == [
        fleet._hostport(e) for e in fleet.etcd_endpoints]
    assert await etcd_leader(fleet.etcd_cluster) is not None
    await fleet_serves(fleet, SIM, "baseline", tokens=16)


@pytest.mark.parametrize("name", ["control.etcd_member_kill", "control.etcd_member_pause",
                                  "control.etcd_member_restart"])
async def test_an_etcd_member_fault_and_the_fleet_keeps_serving(fleet: TestFleet, ctx: FleetContext,
                                                               name: str) -> None:
    await cycle(ctx, name, Target(kind="etcd", ids=("etcd-1",)))
    await fleet_serves(fleet, SIM, name, tokens=16)


async def test_losing_the_etcd_leader_elects_another(fleet: TestFleet, ctx: FleetContext) -> None:
    fault = await cycle(ctx, "control.etcd_leader_loss", Target(kind="etcd", pick="all"))
    assert fault.detail["new_leader"] != fault.targets[0]
    await fleet_serves(fleet, SIM, "leader loss", tokens=16)


async def test_partitioning_the_agent_from_etcd_expires_its_lease_and_it_registers_again(
        fleet: TestFleet, ctx: FleetContext) -> None:
    fault = await cycle(ctx, "control.lease_expiry", Target(kind="link", ids=("agent->etcd",)))
    assert fault.detail["keys"] == [fleet.keys.worker(w) for w in fleet.worker_ids]
    await fleet.wait_workers_routable(2)
    await fleet_serves(fleet, SIM, "agent lease", tokens=16)


async def test_partitioning_a_router_from_etcd_expires_its_lease_and_it_registers_again(
        ctx: FleetContext) -> None:
    await cycle(ctx, "control.lease_expiry", Target(kind="router", ids=("r0",)), recover_timeout_s=5)


async def test_a_broker_restart(fleet: TestFleet, ctx: FleetContext) -> None:
    await cycle(ctx, "control.broker_restart", Target(kind="broker", pick="all"))
    await fleet_serves(fleet, SIM, "broker restart", tokens=16)


async def test_a_router_restart_comes_back_on_the_same_address(fleet: TestFleet, ctx: FleetContext) -> None:
    url = fleet.routers[0].url
    await cycle(ctx, "control.router_restart", Target(kind="router", ids=("r0",)))
    assert fleet.routers[0].url == url
    await fleet_serves(fleet, SIM, "router restart", tokens=16)


async def test_the_supervisor_leader_kill_needs_the_supervisor_service(ctx: FleetContext) -> None:
    spec = CATALOGUE["control.supervisor_leader_kill"]
    with pytest.raises(FaultUnavailable, match="supervisor"):
        await spec.factory(spec.params(), Target(kind="supervisor")).inject(ctx)
