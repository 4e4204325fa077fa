"""A sick fleet is not made sicker: retries of requests that workers answered with an error draw on a budget.

Three simulated workers behind routers, their fault switch set to fail requests with vLLM's engine error
(``error_rate``). When every worker fails every request, a router with the budget sends about one attempt per
client request (here 110 for 100), and answers each with the worker's own failure; the same fleet behind a
router without it is sent every request again (200 for 100: the poison rule stops each at two workers; 4 a
request before it, issue 63). One failing worker among healthy ones is still retried around: those
retries are served and give their tokens back, so no client sees its failures.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio
from testkit import fleet_sim, metric, routed_fleet

from fleetward.chaos.harness import TestFleet
from fleetward.fleet.config import RouterConfig, SupervisorConfig
from fleetward.migration.budget import RetryBudget, throttled_kind
from fleetward.sim.tokenizer import encode

SIM = fleet_sim(seed=21)
# No routine canary: its engine errors would make the supervisor restart the workers whose failures are the test.
SUPERVISOR = SupervisorConfig(canary_interval_s=600, restart_budget=1000, backoff_initial_s=0.05, backoff_max_s=0.2)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(etcd_endpoint: str, broker_endpoint: str, tmp_path_factory: pytest.TempPathFactory
                ) -> AsyncIterator[TestFleet]:
    async with routed_fleet(etcd_endpoint, broker_endpoint, tmp_path_factory.mktemp("budget"), "budget-tests", SIM,
                            routing=RouterConfig(stall_floor_s=0.5), supervisor=SUPERVISOR) as f:
        yield f


async def send(url: str, n: int, concurrency: int = 10) -> list[httpx.Response]:
    """``n`` completions, ``concurrency`` at a time, as the issue's trial sent them."""
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=60) as client:
        async def one(i: int) -> httpx.Response:
            async with limit:
                return await client.post(url + "/v1/completions", json={
                    "model": SIM.model_name, "prompt": encode(f"request {i}: "), "max_tokens": 4, "temperature": 0})

        return list(await asyncio.gather(*(one(i) for i in range(n))))


async def counted(url: str) -> tuple[float, float]:
    """The router's upstream attempts and the retries its budget refused, so far."""
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(url + "/metrics")).text
    return (sum(metric(text, "fleetward_router_upstream_attempts_total", attempt=a) for a in ("first", "retry")),
            metric(text, "fleetward_router_retry_budget_refused_total"))


async def failing(fleet: TestFleet, workers: list[str], rate: float) -> None:
    for w in workers:
        await fleet.fault(w, error_rate=rate)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_fleet_that_fails_every_request_is_sent_each_about_once(fleet: TestFleet) -> None:
    await fleet.wait_workers_routable(3, timeout=30)
    with_budget = await fleet.start_router("r-budget")
    without = await fleet.start_router("r-no-budget", retry_budget_tokens=0)
    await failing(fleet, fleet.worker_ids, 1.0)
    try:
        answers = await send(with_budget.url, 100)
        attempts, refused = await counted(with_budget.url)
        answers_without = await send(without.url, 100)
        attempts_without, _ = await counted(without.url)
    finally:
        await failing(fleet, fleet.worker_ids, 0.0)
        await fleet.stop_router(with_budget)
        await fleet.stop_router(without)
    assert {r.status_code for r in answers} == {500}, "the workers' own engine error, as vLLM answers it"
    assert all(r.json()["error"]["message"] for r in answers)
    assert attempts <= 1.2 * 100, attempts  # before: up to 4 attempts a request (migration_limit 3)
    assert refused >= 80, refused
    assert all(r.status_code >= 500 for r in answers_without)
    assert attempts_without >= 2 * 100, attempts_without  # the poison rule stops it at two workers


@pytest.mark.asyncio(loop_scope="module")
async def test_one_failing_worker_among_healthy_ones_is_retried_around(fleet: TestFleet) -> None:
    await fleet.wait_workers_routable(3, timeout=30)
    router = await fleet.start_router("r-one-failing")
    await failing(fleet, fleet.worker_ids[:1], 1.0)
    try:
        answers = await send(router.url, 60)
        attempts, refused = await counted(router.url)
    finally:
        await failing(fleet, fleet.worker_ids[:1], 0.0)
        await fleet.stop_router(router)
    assert [r.status_code for r in answers] == [200] * 60, [r.text for r in answers if r.status_code != 200][:3]
    assert attempts > 60 and refused == 0, (attempts, refused)


def test_the_budget_admits_retries_while_over_half_full_and_takes_back_those_served() -> None:
    b = RetryBudget(20, 0.1)
    assert throttled_kind("status", 0) and throttled_kind("error_event", 0)
    assert not throttled_kind("status", 3), "a mid-stream resume is never throttled"
    assert not any(throttled_kind(k, 0) for k in ("connect", "reset", "eof", "stall", "aborted"))
    assert all(b.admit() for _ in range(10)) and b.tokens == 10
    assert not b.admit() and b.tokens == 10, "at half the bucket: no more, and nothing taken"
    b.served(refund=1)
    assert b.tokens == pytest.approx(11.1), "a retry that was served gives its token back"
    assert b.admit()
    for _ in range(200):
        b.served()
    assert b.tokens == 20
    off = RetryBudget(0)
    assert all(off.admit() for _ in range(100)) and not off.enabled, "0 tokens: off"
