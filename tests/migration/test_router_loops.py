"""The router's background tasks have one owner (:class:`~fleetward.fleet.loops.Loops`): a loop that crashes is
restarted and counted on the router's /metrics, and ``aclose`` leaves none of them behind."""

from __future__ import annotations

import asyncio
from typing import Any

from fleetward.fleet.bus import MqttBus
from fleetward.fleet.config import RouterConfig
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.keys import Keys
from fleetward.migration.router import Router


async def test_a_crashing_router_loop_is_restarted_and_counted_and_aclose_reaps_every_task(
        store: EtcdStore, bus: MqttBus, keys: Keys, wait_until: Any) -> None:
    router = Router(RouterConfig(drain_timeout_s=0), store=store, bus=bus, keys=keys, router_id="loops")
    monitor, crashes = router._monitor, 0

    async def flaky() -> None:  # the stall monitor, crashing twice before it runs
        nonlocal crashes
        if crashes < 2:
            crashes += 1
            raise RuntimeError("injected")
        await monitor()

    router._monitor = flaky  # type: ignore[method-assign]
    before = set(asyncio.all_tasks())
    await router.start()
    try:
        assert router.loops.names == {"fleet-view", "checkpoints", "monitor", "registration", "moves", "move-orders",
                                      "adapters"}

        def restarts(loop: str) -> float | None:
            return router.metrics.registry.get_sample_value("fleetward_loop_restarts_total",
                                                            {"service": "router", "loop": loop})

        assert restarts("registration") == 0  # every loop is exported at 0 from the start
        await wait_until(lambda: restarts("monitor") == 2, timeout=10, message="two crashes counted")
        await wait_until(lambda: crashes == 2 and "monitor" in router.loops.names, timeout=10,
                         message="the monitor running again")
    finally:
        await router.aclose()
    assert len(router.loops) == 0
    left = {t for t in asyncio.all_tasks() - before if t.get_name().startswith("router-")}
    assert not left, left


async def test_the_workers_held_through_a_store_outage_are_what_the_gauge_says(store: EtcdStore, bus: MqttBus,
                                                                              keys: Keys) -> None:
    """fleetward_router_workers_held is read from the fleet view when scraped: a record held (its deletion not
    applied) calls no change callback, so a gauge set there read 0 while workers were held."""
    router = Router(RouterConfig(), store=store, bus=bus, keys=keys, router_id="held")

    def held() -> float | None:
        return router.metrics.registry.get_sample_value("fleetward_router_workers_held")

    assert held() == 0
    router.view.held.update({("workers", "w1"): 1e18, ("health", "w1"): 1e18, ("workers", "w2"): 1e18})
    assert held() == 2
