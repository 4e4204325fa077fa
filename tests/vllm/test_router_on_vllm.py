"""The router on real vLLM (CPU, tiny model, greedy): a killed worker's stream completes, exactly; and what a
client reads through the router is what the vLLM server sends, on every endpoint."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
import pytest_asyncio

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
    pid = vllm_fleet.handle(victim).process.pid
    assert pid is not None
    throttle.add_tree(pid)
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


@pytest_asyncio.fixture(loop_scope="session")
async def dropin(vllm_fleet: TestFleet) -> AsyncIterator[tuple[TestFleet, str]]:
    router = await vllm_fleet.start_router("vllm-dropin")
    try:
        yield vllm_fleet, router.url
    finally:
        await vllm_fleet.stop_router(router)


DROPIN = [
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "Byte for byte", "max_tokens": 24, "temperature": 0,
                                 "ignore_eos": True, "stream": True}),
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Byte for byte"}],
                                      "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True,
                                      "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "Byte for byte", "max_tokens": 24, "temperature": 0,
                                 "ignore_eos": True, "return_token_ids": True}),
    ("POST", "/tokenize", {"model": "tiny", "prompt": "Hello world", "return_token_strs": True}),
    ("POST", "/detokenize", {"model": "tiny", "tokens": [42, 71, 401, 81, 650]}),
    ("GET", "/version", None),
    ("POST", "/v1/responses", {"model": "tiny", "input": "Hello", "max_output_tokens": 6, "temperature": 0}),
    ("POST", "/v1/responses", {"model": "tiny", "input": "Hello", "max_output_tokens": 6, "temperature": 0,
                               "stream": True}),
    ("POST", "/v1/embeddings", {"model": "tiny", "input": "a generative server has none"}),
]


@pytest.mark.parametrize(("method", "path", "body"), DROPIN,
                         ids=[f"{p.strip('/').replace('/', '-')}-{i}" for i, (_, p, _) in enumerate(DROPIN)])
async def test_the_router_answers_as_vllm_does_on_every_endpoint(dropin: tuple[TestFleet, str], method: str,
                                                                  path: str, body: Any, same_answer: Any) -> None:
    """The same request to a vLLM server and through the router: what the client reads is the same (ids,
    times and where vLLM broke a stream's events aside: tests/conftest.py, ``same_answer``). A generation is
    the router's own rendering of the tokens; the rest is passed through."""
    fleet, url = dropin
    async with httpx.AsyncClient(timeout=120) as client:
        direct = await client.request(method, fleet.url(fleet.worker_ids[0]) + path, json=body)
        routed = await client.request(method, url + path, json=body)
    assert routed.status_code == direct.status_code
    same_answer(routed.content, direct.content)


async def test_models_are_vllms_cards(dropin: tuple[TestFleet, str]) -> None:
    _, url = dropin
    async with httpx.AsyncClient(timeout=30) as client:
        card = (await client.get(url + "/v1/models")).json()["data"][0]
    assert card["id"] == "tiny" and card["owned_by"] == "vllm" and card["max_model_len"] == 2048
    assert card["fleetward"]["detokenizer"] == "router"
