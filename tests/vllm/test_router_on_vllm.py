"""The router on real vLLM (CPU, tiny model, greedy): a killed worker's stream completes, exactly."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from fleetward.chaos.harness import TestFleet
from fleetward.chaos.workload import sse_lines
from fleetward.fleet.cgroups import CpuGroup, cgroups_available
from fleetward.migration.policy import LeastLoadedAffinity, prefix_key
from fleetward.sim.tokenizer import encode

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def uninterrupted(fleet: TestFleet, prompt: list[int], n: int) -> list[int]:
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(fleet.url(fleet.worker_ids[0]) + "/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
    r.raise_for_status()
    return list(r.json()["choices"][0]["token_ids"])


async def test_killing_the_vllm_worker_mid_stream_leaves_the_stream_exact(vllm_fleet: TestFleet) -> None:
    if not cgroups_available():
        pytest.skip("needs root and the cgroup cpu controller to slow the worker down (see below)")
    router = await vllm_fleet.start_router("vllm-router")
    prompt = encode("Real vLLM keeps this stream going: ")
    expected = await uninterrupted(vllm_fleet, prompt, 1800)
    # The tiny model streams ~500 tokens/s on this CPU: a whole stream can sit in socket buffers before a
    # test reacts. Throttle the worker the router will pick to a sliver of a CPU, so the kill lands while
    # it is still generating (a slow worker, exactly as a throttled GPU host would be).
    victim = LeastLoadedAffinity().choose(vllm_fleet.worker_ids, {}, prefix_key(prompt))
    throttle = CpuGroup("vllm-kill-test")
    throttle.limit(0.15)
    throttle.add_tree(vllm_fleet.handle(victim).process.pid)
    killed: list[str] = []

    async def kill_mid_stream(client: httpx.AsyncClient) -> None:
        """SIGKILL the worker serving the stream once the router has relayed 50 of its tokens."""
        while True:
            progress = (await client.get(router.url + "/fleetward/v1/progress")).json()
            busy = [w for w, p in progress["workers"].items() if p["in_flight"]]
            if busy and sum(p["tokens"] for p in progress["workers"].values()) >= 50:
                vllm_fleet.kill(busy[0])  # the API server's whole tree
                killed.append(busy[0])
                return
            await asyncio.sleep(0.01)

    got: list[int] = []
    try:
        async with httpx.AsyncClient(timeout=300) as client:
            killer = asyncio.create_task(kill_mid_stream(client))
            async with client.stream("POST", router.url + "/v1/completions",
                                     json={"model": "tiny", "prompt": prompt, "max_tokens": 1800, "temperature": 0,
                                           "ignore_eos": True, "stream": True, "return_token_ids": True}) as r:
                assert r.status_code == 200, await r.aread()
                async for line in sse_lines(r.aiter_bytes()):
                    if line.startswith("data: {"):
                        data = orjson.loads(line[6:])
                        assert "error" not in data, data
                        got.extend(data["choices"][0]["token_ids"])
            killer.cancel()
            metrics = (await client.get(router.url + "/metrics")).text
        assert killed == [victim], "the kill landed on the worker serving the stream"
        assert got == expected, "migrated stream == uninterrupted stream, token for token"
        # The trigger is whichever comes first: the broken stream, or the supervisor's verdict on the worker
        # (the node agent sees the EngineCore die at once and the router evacuates the worker).
        assert "fleetward_router_migrations_total{reason=" in metrics
    finally:
        throttle.remove()
        await vllm_fleet.stop_router(router)
