"""A router's view of the fleet through a store outage (fleet/registry.py, FleetView's hold; issue 65), on the
session's etcd: a worker's records that vanish while the router could not reach the store are kept until they
are written again, the worker fails where it serves, or the hold runs out; any other time they go at once."""

from __future__ import annotations

import asyncio

from testkit import eventually

from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.registry import FleetView
from fleetward.fleet.worker import HealthRecord, HealthState, WorkerRecord


async def _register(store: EtcdStore, keys: Keys, wid: str) -> int:
    lease = await store.grant(30)
    record = WorkerRecord(id=wid, url="http://127.0.0.1:9", role="aggregated", model="m", node="n", backend="sim")
    await store.put(keys.worker(wid), record.to_json(), lease=lease)
    await store.put(keys.health_of(wid), HealthRecord(HealthState.READY).to_json(), lease=lease)
    return lease


def _routable(view: FleetView) -> set[str]:
    return {r.id for r in view.fleet.routable()}


async def test_records_lost_with_the_store_are_held_until_written_again_or_failed(store: EtcdStore,
                                                                                 keys: Keys) -> None:
    away = {"now": False}
    changes: list[tuple[str, str]] = []
    view = FleetView(store, keys, on_change=lambda s, w: changes.append((s, w)), hold=lambda: away["now"],
                     hold_s=60.0)
    leases = {w: await _register(store, keys, w) for w in ("w0", "w1", "w2")}
    task = asyncio.create_task(view.run())
    try:
        await eventually(lambda: _routable(view) == {"w0", "w1", "w2"})

        # The router could reach the store: a lapsed lease is a worker gone.
        await store.revoke(leases["w0"])
        await eventually(lambda: "w0" not in view.fleet.workers and "w0" not in view.fleet.health)
        assert not view.held and _routable(view) == {"w1", "w2"}

        # It could not: every lease lapsed at once, the workers serve on.
        away["now"] = True
        await store.revoke(leases["w1"])
        await store.revoke(leases["w2"])
        await eventually(lambda: set(view.held) == {("workers", "w1"), ("health", "w1"), ("workers", "w2"),
                                                    ("health", "w2")})
        assert _routable(view) == {"w1", "w2"}, "still routed to"

        await _register(store, keys, "w1")  # its agent writes it again
        await eventually(lambda: not {k for k in view.held if k[1] == "w1"})
        view.forget("w2")  # refused where it serves
        assert _routable(view) == {"w1"} and not view.held
        assert ("workers", "w2") in changes
    finally:
        task.cancel()


async def test_a_held_record_goes_when_the_hold_runs_out(store: EtcdStore, keys: Keys) -> None:
    view = FleetView(store, keys, hold=lambda: True, hold_s=0.5)
    lease = await _register(store, keys, "w0")
    task = asyncio.create_task(view.run())
    try:
        await eventually(lambda: _routable(view) == {"w0"})
        await store.revoke(lease)
        await eventually(lambda: ("workers", "w0") in view.held)
        await eventually(lambda: not _routable(view) and not view.held, within=10.0)
    finally:
        task.cancel()
