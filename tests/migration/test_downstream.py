"""The client's side of a stream (migration/downstream.py): the router's own HTTP protocol writes the events
straight to the client's socket, and another ASGI server (uvicorn's plain httptools protocol, httpx's in-process
transport) gets the same events as ASGI messages. All give a client the same bytes, and a client that leaves
mid-stream detaches its request (resumable) on either path.

One router in this test's process, in front of one simulated worker on a real socket, both registered in the
session's etcd.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn
from testkit import _InProcessServer, eventually, instant_sim, serve

from fleetward.fleet.bus import MqttBus
from fleetward.fleet.config import RouterConfig
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.procs import free_port
from fleetward.fleet.worker import HealthRecord, HealthState, WorkerRecord
from fleetward.migration.downstream import ClientConnection
from fleetward.migration.http import router_app
from fleetward.migration.router import Router


def normalized(raw: bytes) -> bytes:
    """The stream without what differs between two requests: the response's id and time."""
    return re.sub(rb'"id":"cmpl-[^"]*"|"created":\d+', b"_", raw)


BODY = {"model": "sim-tiny", "prompt": "The relay", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}}


@pytest.fixture
async def routed(store: EtcdStore, bus: MqttBus, keys: Keys) -> AsyncIterator[tuple[Router, dict[str, str], Any]]:
    """The router; its app on real sockets, served by uvicorn with the router's protocol ("router-protocol")
    and with uvicorn's own ("asgi-messages"); and the app."""
    async with serve(instant_sim(decode_step_ms=5.0)) as (url, _worker):
        record = WorkerRecord(id="w0", url=url, role="aggregated", model="sim-tiny", node="n0", backend="sim")
        await store.put(keys.worker("w0"), record.to_json())
        await store.put(keys.health_of("w0"), HealthRecord(HealthState.READY).to_json())
        router = Router(RouterConfig(drain_timeout_s=0, detached_grace_s=60), store=store, bus=bus, keys=keys,
                        router_id="downstream")
        await router.start()
        app = router_app(router)
        servers: dict[str, tuple[str, _InProcessServer]] = {}
        for name, http in (("router-protocol", ClientConnection), ("asgi-messages", "httptools")):
            port = free_port()
            servers[name] = (f"http://127.0.0.1:{port}", _InProcessServer(uvicorn.Config(
                app, host="127.0.0.1", port=port, log_config=None, http=http, lifespan="off")))
        tasks = [asyncio.create_task(server.serve()) for _, server in servers.values()]
        try:
            await eventually(lambda: all(s.started for _, s in servers.values()) and router.view.fleet.routable())
            yield router, {name: u for name, (u, _) in servers.items()}, app
        finally:
            for _, server in servers.values():
                server.should_exit = True
            await asyncio.gather(*tasks)
            await router.aclose()


async def test_the_routers_protocol_and_plain_asgi_give_the_client_the_same_stream(
        routed: tuple[Router, dict[str, str], Any]) -> None:
    router, urls, app = routed
    async with httpx.AsyncClient(timeout=30) as client:
        direct = await client.post(urls["router-protocol"] + "/v1/completions", json=BODY)
        messages = await client.post(urls["asgi-messages"] + "/v1/completions", json=BODY)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://router", timeout=30) as client:
        in_process = await client.post("/v1/completions", json=BODY)
    assert direct.status_code == messages.status_code == in_process.status_code == 200
    for r in (direct, messages, in_process):
        assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert r.headers["cache-control"] == "no-cache" and r.headers["x-request-id"].startswith("cmpl-")
    assert direct.headers["transfer-encoding"] == "chunked"
    assert normalized(direct.content) == normalized(messages.content) == normalized(in_process.content)
    assert direct.content.endswith(b"data: [DONE]\n\n") and direct.content.count(b"data: ") == 42  # 40 + usage
    assert not router.active, "both requests released"


@pytest.mark.parametrize("path", ["router-protocol", "asgi-messages"])
async def test_a_client_that_leaves_mid_stream_detaches_its_request(
        routed: tuple[Router, dict[str, str], Any], path: str) -> None:
    router, urls, _ = routed
    body = {**BODY, "max_tokens": 4000}
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream("POST", urls[path] + "/v1/completions", json=body) as r:
            async for _ in r.aiter_lines():
                if router.active and next(iter(router.active.values())).journal.emitted:
                    break
    await eventually(lambda: all(a.detached_at is not None and a.stream is None for a in router.active.values())
                     and len(router.active) == 1)
    j = next(iter(router.active.values())).journal
    held = len(j.emitted)
    await asyncio.sleep(0.1)
    assert len(j.emitted) == held < 4000, "the worker's stream was cancelled, not run to its end for nobody"
