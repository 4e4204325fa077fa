"""Network faults on a real fleet (sim workers, a router, etcd, broker) wired through fault proxies."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from testkit import fleet_sim, routed_fleet, stream_completion

from fleetward.chaos.fault import CATALOGUE, Target
from fleetward.chaos.faults import FaultUnavailable, cycle, probe_link
from fleetward.chaos.faults.network import LinkFault, LinkParams, _catalogue, _ToxicFault
from fleetward.chaos.harness import FleetContext, TestFleet
from fleetward.chaos.net import IptablesFilter, Latency, ProxyRegistry, SseCut
from fleetward.migration.policy import LeastLoadedAffinity, prefix_key
from fleetward.sim.model import SimModel
from fleetward.sim.tokenizer import encode

pytestmark = pytest.mark.asyncio(loop_scope="module")

SIM = fleet_sim(seed=11)
MODEL = SimModel(seed=SIM.seed)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(etcd_endpoint: str, broker_endpoint: str,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TestFleet]:
    async with routed_fleet(etcd_endpoint, broker_endpoint, tmp_path_factory.mktemp("net-faults"), "net-faults",
                            SIM, proxy_workers=True, proxy_clients=True) as f:
        yield f


@pytest_asyncio.fixture(loop_scope="module")
async def ctx(fleet: TestFleet) -> AsyncIterator[FleetContext]:
    yield fleet.fault_context()
    for link in fleet.proxies:  # a failed test must not leave a toxic for the next one
        link.clear()


async def stream(url: str, prompt: list[int], n: int) -> tuple[list[int], list[dict[str, Any]]]:
    got = await stream_completion(url, prompt, n, model=SIM.model_name)
    return got.tokens, got.events


async def steady(fleet: TestFleet, tag: str) -> None:
    prompt = encode(f"steady after {tag}: ")
    tokens, _ = await stream(fleet.routers[0].client_url, prompt, 24)
    assert tokens == MODEL.continuation(prompt, 24)


BYTE_FAULTS = [
    ("network.latency", {"latency_ms": 100, "jitter_ms": 20}),
    ("network.bandwidth", {"rate_bps": 4096}),
    ("network.slicer", {"average_size": 16, "size_variation": 8, "delay_ms": 1}),
    ("network.reset", {}),
    ("network.blackhole", {"timeout_ms": 200}),
    ("network.limit_data", {"bytes": 512}),
    ("network.slow_close", {"delay_ms": 50, "direction": "both"}),
    ("network.partition", {"direction": "both"}),
    ("network.partition", {"direction": "upstream"}),
    ("network.partition", {"direction": "downstream"}),
    ("network.down", {}),
]


@pytest.mark.parametrize(("name", "params"), BYTE_FAULTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BYTE_FAULTS)])
async def test_a_link_fault_takes_effect_and_the_fleet_serves_after_recovery(
        fleet: TestFleet, ctx: FleetContext, name: str, params: dict[str, Any]) -> None:
    await cycle(ctx, name, Target(kind="link", ids=("router->worker:node-w1",)), **params)
    await steady(fleet, name)


@pytest.mark.parametrize("name", ["network.sse_cut", "network.sse_stall", "network.sse_corrupt",
                                  "network.sse_drop_done"])
async def test_an_sse_fault_takes_effect_on_a_worker_link(fleet: TestFleet, ctx: FleetContext, name: str) -> None:
    fault = await cycle(ctx, name, Target(kind="worker", ids=("node-w2",)), streams=1,
                            **({"after_events": 2} if name != "network.sse_drop_done" else {}))
    assert fault.targets == ["router->worker:node-w2"]
    await steady(fleet, name)


async def test_a_router_through_a_cut_worker_link_migrates_and_the_stream_stays_exact(fleet: TestFleet) -> None:
    prompt = encode("cut me mid-stream: ")
    victim = LeastLoadedAffinity().choose(fleet.worker_ids, {}, prefix_key(prompt))
    link = fleet.proxies.get(f"router->worker:{victim}")
    toxic = link.add(SseCut(after_events=20, streams=1))
    try:
        tokens, events = await stream(fleet.routers[0].client_url, prompt, 80)
    finally:
        link.remove(toxic)
    assert toxic.hits == 1, "the cut happened on the stream's first worker"
    assert tokens == MODEL.continuation(prompt, 80), "no token lost, duplicated or changed"
    assert [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")] == ["length"]
    async with httpx.AsyncClient(timeout=10) as c:
        metrics = (await c.get(fleet.routers[0].url + "/metrics")).text
    assert "fleetward_router_migrations_total{reason=" in metrics


async def test_a_corrupted_event_between_client_and_router_shows_as_one_wrong_token(
        fleet: TestFleet, ctx: FleetContext) -> None:
    spec = CATALOGUE["network.sse_corrupt"]
    fault = spec.factory(spec.params(after_events=5, streams=1, probe=False), Target(kind="router", ids=("r0",)))
    await fault.inject(ctx)
    try:
        prompt = encode("corrupt one: ")
        tokens, _ = await stream(fleet.routers[0].client_url, prompt, 30)
        assert await fault.verify(ctx)
    finally:
        await fault.recover(ctx)
    expected = MODEL.continuation(prompt, 30)
    wrong = [i for i, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b]
    assert len(wrong) == 1 and len(tokens) == 30
    assert await fault.verify_recovered(ctx)


async def test_a_link_probe_fails_while_it_is_partitioned(fleet: TestFleet, ctx: FleetContext) -> None:
    spec = CATALOGUE["network.partition"]
    fault = spec.factory(spec.params(), Target(kind="link", ids=("client->router:r0",)))
    await fault.inject(ctx)
    try:
        assert await fault.verify(ctx)
        assert not await probe_link(fleet.proxies.get("client->router:r0"), timeout=0.3)
    finally:
        await fault.recover(ctx)
    assert await fault.verify_recovered(ctx)


async def test_the_kernel_partition_cuts_a_worker_off_and_heals(fleet: TestFleet, ctx: FleetContext) -> None:
    reason = IptablesFilter.unavailable_reason()
    if reason:
        pytest.skip(reason)
    await cycle(ctx, "network.partition_kernel", Target(kind="link", ids=("router->worker:node-w0",)))
    await steady(fleet, "kernel partition")


async def test_an_unknown_link_is_refused(ctx: FleetContext) -> None:
    spec = CATALOGUE["network.reset"]
    fault = spec.factory(spec.params(), Target(kind="link", ids=("router->worker:nobody",)))
    with pytest.raises(ValueError, match="not in the fleet"):
        await fault.inject(ctx)


# -- the table of toxic faults (no fleet needed) ----------------------------------------------------------------

TOXIC_PARAMS: dict[str, dict[str, Any]] = {
    "network.latency": {"latency_ms": 7, "jitter_ms": 3, "direction": "both", "toxicity": 0.5},
    "network.bandwidth": {"rate_bps": 99, "direction": "upstream", "toxicity": 0.25},
    "network.slicer": {"average_size": 5, "size_variation": 2, "delay_ms": 0.5, "direction": "both"},
    "network.reset": {"timeout_ms": 12, "toxicity": 0.3},
    "network.blackhole": {"timeout_ms": 3, "direction": "downstream", "toxicity": 0.9},
    "network.limit_data": {"bytes": 5, "direction": "upstream", "toxicity": 0.1},
    "network.slow_close": {"delay_ms": 4, "direction": "both"},
    "network.partition": {"direction": "upstream", "toxicity": 0.2},
    "network.sse_cut": {"after_events": 3, "reset": True, "streams": 2, "toxicity": 0.7},
    "network.sse_stall": {"after_events": 1, "streams": 1},
    "network.sse_corrupt": {"after_events": 2, "count": 3, "streams": 4, "toxicity": 0.6},
    "network.sse_drop_done": {"streams": 5, "toxicity": 0.4},
}


@pytest.mark.parametrize("name", sorted(TOXIC_PARAMS))
async def test_a_toxic_fault_builds_its_toxic_from_its_parameters_by_name(name: str) -> None:
    spec = CATALOGUE[name]
    fault = spec.factory(spec.params(**TOXIC_PARAMS[name]), Target(kind="link", ids=("x",)))
    assert isinstance(fault, LinkFault)
    [toxic] = fault.toxics()
    assert {k: getattr(toxic, k) for k in TOXIC_PARAMS[name]} == TOXIC_PARAMS[name]
    assert fault.sse_probe == (toxic.sse or name == "network.limit_data")


async def test_a_reset_fault_keeps_its_toxic_on_both_directions_whatever_the_parameter_says() -> None:
    spec = CATALOGUE["network.reset"]
    fault = spec.factory(spec.params(direction="upstream"), Target(kind="link", ids=("x",)))
    assert isinstance(fault, LinkFault)
    [toxic] = fault.toxics()
    assert toxic.direction == "both"


async def test_a_toxic_fault_whose_parameter_the_toxic_does_not_take_is_refused() -> None:
    class TypoParams(LinkParams):
        latency: float = 1.0  # Latency takes latency_ms

    with pytest.raises(TypeError, match=r"network\.typo: Latency takes no latency$"):
        _catalogue(_ToxicFault("network.typo", "never registered", TypoParams, Latency))
    assert "network.typo" not in CATALOGUE


class LinksOnly:
    """A fault context with links and nothing else: ``link`` targets resolve to their ids."""

    fleet = None

    def __init__(self, proxies: ProxyRegistry) -> None:
        self.proxies = proxies

    def resolve(self, target: Target) -> list[str]:
        return list(target.ids)

    def record(self, kind: str, **data: Any) -> None:
        pass

    def service(self, name: str) -> Any:
        return self.proxies.get(name.removeprefix("proxy:")) if name.startswith("proxy:") else self.proxies


async def test_an_sse_fault_on_a_plain_tcp_link_is_unavailable() -> None:
    proxies = ProxyRegistry()
    try:
        await proxies.add("a->b", ("127.0.0.1", 9))
        spec = CATALOGUE["network.sse_cut"]
        fault = spec.factory(spec.params(), Target(kind="link", ids=("a->b",)))
        with pytest.raises(FaultUnavailable, match="needs an HTTP link; a->b is plain TCP"):
            await fault.inject(LinksOnly(proxies))
        assert proxies.get("a->b").toxics == []
    finally:
        await proxies.aclose()
