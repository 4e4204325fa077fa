"""LoRA adapters through the router, on real vLLM (CPU, the tiny model, LoRA on: tests/vllm/conftest.py).

An adapter loaded through the router is loaded on every worker and listed in the router's ``/v1/models`` as
vLLM lists it; a request naming it is generated with it (greedy: what a worker answers directly, streamed or
not, and not the base model's answer); an adapter one worker serves takes requests on that worker only; an
adapter nobody serves, or one unloaded through the router, gets vLLM's own 404.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from testkit import until, write_lora_adapter

from fleetward.chaos.harness import TestFleet

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture(scope="session")
def lora_adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lora")
    return write_lora_adapter(root / "ada", seed=1), write_lora_adapter(root / "adb", seed=2)


@pytest_asyncio.fixture(loop_scope="session")
async def lora(vllm_router: tuple[TestFleet, str]) -> AsyncIterator[tuple[TestFleet, str]]:
    fleet, _ = vllm_router
    try:
        yield vllm_router
    finally:
        async with httpx.AsyncClient(timeout=60) as client:  # the session's servers outlive the test
            for w in fleet.worker_ids:
                for name in ("ada", "adb"):
                    await client.post(fleet.url(w) + "/v1/unload_lora_adapter", json={"lora_name": name})


async def model_ids(client: httpx.AsyncClient, url: str) -> list[str]:
    return [c["id"] for c in (await client.get(url + "/v1/models")).json()["data"]]


async def test_lora_adapters_load_on_the_fleet_and_requests_go_where_they_are_served(
        lora: tuple[TestFleet, str], lora_adapters: tuple[Path, Path], same_answer: Any) -> None:
    fleet, url = lora
    w0, w1 = fleet.worker_ids
    ada, adb = lora_adapters
    body = {"model": "ada", "prompt": "Adapted text", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120) as client:
        direct = await client.post(fleet.url(w0) + "/v1/completions", json=body)
        routed = await client.post(url + "/v1/completions", json=body)
        assert routed.status_code == direct.status_code == 404, "nobody serves it yet"
        same_answer(routed.content, direct.content)

        loaded = await client.post(url + "/v1/load_lora_adapter", json={"lora_name": "ada", "lora_path": str(ada)})
        assert loaded.status_code == 200 and "ada" in loaded.text, loaded.text
        for w in (w0, w1):
            assert "ada" in await model_ids(client, fleet.url(w)), "loaded on every worker"
        cards = {c["id"]: c for c in (await client.get(url + "/v1/models")).json()["data"]}
        assert cards["ada"]["parent"] == "tiny" and cards["ada"]["root"] == str(ada)

        direct = await client.post(fleet.url(w0) + "/v1/completions", json=body)
        base = await client.post(fleet.url(w0) + "/v1/completions", json={**body, "model": "tiny"})
        assert direct.json()["choices"][0]["text"] != base.json()["choices"][0]["text"], "the adapter counts"
        for stream in (False, True):
            routed = await client.post(url + "/v1/completions", json={**body, "stream": stream})
            reference = direct if not stream else await client.post(fleet.url(w1) + "/v1/completions",
                                                                     json={**body, "stream": True})
            assert routed.status_code == 200, routed.text
            same_answer(routed.content, reference.content)

        # An adapter one worker serves: every request naming it goes there (the other would answer 404).
        await client.post(fleet.url(w1) + "/v1/load_lora_adapter", json={"lora_name": "adb", "lora_path": str(adb)})

        async def listed() -> bool:
            return "adb" in await model_ids(client, url)

        await until(listed, within=30)
        only = {**body, "model": "adb"}
        want = await client.post(fleet.url(w1) + "/v1/completions", json=only)
        for _ in range(4):
            got = await client.post(url + "/v1/completions", json=only)
            assert got.status_code == 200, got.text
            same_answer(got.content, want.content)

        unloaded = await client.post(url + "/v1/unload_lora_adapter", json={"lora_name": "ada"})
        assert unloaded.status_code == 200, unloaded.text
        assert "ada" not in await model_ids(client, url)
        gone = await client.post(url + "/v1/completions", json=body)
        direct = await client.post(fleet.url(w0) + "/v1/completions", json=body)
        assert gone.status_code == direct.status_code == 404
        same_answer(gone.content, direct.content)
