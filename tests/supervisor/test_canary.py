"""A canary measures the worker only while the controller's own loop keeps time.

A worker that accepts a canary and never answers fails it. The same silence while the controller's loop is
blocked (a starved or paused controller, whose timeout fires seconds late and whose answer may sit unread in
the socket) is inconclusive: the controller asks again instead of calling a loaded worker hung.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from fleetward.fleet.bus import MqttBus
from fleetward.fleet.config import SupervisorConfig
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.worker import WorkerRecord
from fleetward.supervisor.controller import Controller
from fleetward.supervisor.health import CanaryDone

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def silent_worker() -> AsyncIterator[str]:
    """A server that accepts connections, reads the request and never answers: a hung engine's API server."""
    held: list[asyncio.StreamWriter] = []

    async def accept(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for w in held:
            w.close()
        server.close()
        with contextlib.suppress(Exception):
            await server.wait_closed()


async def canary(store: EtcdStore, bus: MqttBus, keys: Keys, url: str, *, block_s: float) -> CanaryDone:
    controller = Controller(SupervisorConfig(canary_timeout_s=0.5), store=store, bus=bus, keys=keys)
    controller.workers["w"] = WorkerRecord(id="w", url=url, role="aggregated", model="tiny", node="n", backend="sim")
    got: list[CanaryDone] = []
    controller.submit = lambda event: got.append(event) if isinstance(event, CanaryDone) else None  # type: ignore[method-assign]
    if block_s:  # the loop is held once the request is on its way
        asyncio.get_running_loop().call_later(0.1, time.sleep, block_s)
    try:
        await controller._canary_once("w", urgent=False)
    finally:
        for session in (controller._http, controller._fresh_http):
            if session is not None:
                await session.close()
    assert len(got) == 1
    return got[0]


async def test_a_worker_that_does_not_answer_fails_its_canary(store: EtcdStore, bus: MqttBus, keys: Keys,
                                                               silent_worker: str) -> None:
    done = await canary(store, bus, keys, silent_worker, block_s=0)
    assert not done.ok and not done.inconclusive and not done.unreachable, done
    assert "no answer within 0.50s" in done.reason


async def test_a_canary_timed_out_by_the_controllers_own_blocked_loop_is_inconclusive(
        store: EtcdStore, bus: MqttBus, keys: Keys, silent_worker: str) -> None:
    done = await canary(store, bus, keys, silent_worker, block_s=1.5)
    assert not done.ok and done.inconclusive and not done.unreachable, done
    assert "the controller's own loop ran" in done.reason and "late" in done.reason
