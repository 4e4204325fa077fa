"""LoRA adapters loaded through the router are the fleet's: a worker that lost one (the supervisor restarted it,
and a restarted vLLM server has nothing of what was loaded at runtime) is given it again, and one unloaded
through the router stays unloaded. On simulated workers serving vLLM's runtime LoRA endpoints
(``SimConfig.runtime_lora``); the same endpoints on real vLLM are tests/vllm/test_lora_on_vllm.py's."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from testkit import PATIENT_SUPERVISOR, routed_fleet

from fleetward.chaos.harness import TestFleet
from fleetward.fleet.config import RouterConfig, SimConfig
from fleetward.migration.adapters import fleet_answer

pytestmark = pytest.mark.asyncio(loop_scope="module")

SIM = SimConfig(decode_step_ms=4.0, decode_ms_per_seq=0.05, prefill_ms_per_token=0.01, seed=11, runtime_lora=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(etcd_endpoint: str, broker_endpoint: str,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TestFleet]:
    async with routed_fleet(etcd_endpoint, broker_endpoint, tmp_path_factory.mktemp("lora-fleet"), "lora-tests",
                            SIM, workers=2, router="lora-r0", supervisor=PATIENT_SUPERVISOR,
                            routing=RouterConfig(stall_floor_s=0.5, adapters_interval_s=0.2)) as f:
        yield f


async def _served(client: httpx.AsyncClient, url: str) -> set[str]:
    return {c["id"] for c in (await client.get(url + "/v1/models")).json()["data"] if c.get("parent")}


async def test_an_adapter_loaded_through_the_router_is_loaded_again_on_a_restarted_worker(
        healthy: TestFleet, tmp_path: Path, wait_until: Any) -> None:
    adapter = tmp_path / "sql-lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    router = healthy.routers[0].url
    first, second = healthy.worker_ids
    ask = {"prompt": "Adapted: ", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=30) as client:
        loaded = await client.post(router + "/v1/load_lora_adapter",
                                   json={"lora_name": "sql", "lora_path": str(adapter)})
        assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'sql' added successfully."
        assert [await _served(client, healthy.url(w)) for w in (first, second)] == [{"sql"}, {"sql"}]
        base = (await client.post(router + "/v1/completions", json={"model": SIM.model_name, **ask})).json()
        adapted = (await client.post(router + "/v1/completions", json={"model": "sql", **ask})).json()
        direct = (await client.post(healthy.url(second) + "/v1/completions", json={"model": "sql", **ask})).json()
        assert adapted["model"] == "sql" and adapted["choices"][0]["text"] == direct["choices"][0]["text"]
        assert adapted["choices"][0]["text"] != base["choices"][0]["text"], "the adapter changes the answer"

        pid = healthy.handle(first).process.pid
        healthy.kill(first)  # the supervisor restarts it, without what was loaded at runtime
        await healthy.restore(timeout=60)
        assert healthy.handle(first).process.pid != pid

        async def given_again() -> bool:
            return await _served(client, healthy.url(first)) == {"sql"}

        await wait_until(given_again, timeout=30, message="the router loads the adapter on the restarted worker")
        again = (await client.post(healthy.url(first) + "/v1/completions", json={"model": "sql", **ask})).json()
        assert again["choices"][0]["text"] == direct["choices"][0]["text"]

        unloaded = await client.post(router + "/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert unloaded.status_code == 200, unloaded.text
        pid = healthy.handle(second).process.pid
        healthy.kill(second)
        await healthy.restore(timeout=60)
        assert healthy.handle(second).process.pid != pid
        # A load passed on asks every worker what it serves before it answers, and gives each what it lacks
        # of the fleet's adapters: "sql" is no longer one of them.
        other = await client.post(router + "/v1/load_lora_adapter", json={"lora_name": "other",
                                                                          "lora_path": str(adapter)})
        assert other.status_code == 200, other.text
        assert [await _served(client, healthy.url(w)) for w in (first, second)] == [{"other"}, {"other"}]
        gone = await client.post(router + "/v1/completions", json={"model": "sql", **ask})
        assert gone.status_code == 404 and "Valid aliases" in gone.json()["error"]["message"], gone.text
        refused = await client.post(router + "/v1/load_lora_adapter", json={"lora_name": "bad",
                                                                            "lora_path": str(tmp_path / "none")})
        assert refused.status_code == 404 and "No adapter found" in refused.text, refused.text


async def test_a_load_answers_with_a_workers_success_else_its_refusal_never_with_a_worker_it_could_not_reach() -> None:
    """Found by the router's fuzz test: a registered worker that could not be reached came first, and its 502
    was the answer to a body every other worker refused with a 400."""
    unreachable = (502, b'{"error": "worker w0: cannot connect"}', "application/json")
    refused = (400, b'{"error": "bad body"}', "application/json")
    ok = (200, b"Success", "text/plain")
    assert fleet_answer([unreachable, refused]) == refused
    assert fleet_answer([unreachable, refused, ok]) == ok
    assert fleet_answer([unreachable, (503, b"busy", None)]) == unreachable
