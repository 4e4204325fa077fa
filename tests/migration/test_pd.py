"""Prefill/decode through the router, on simulated workers adopted into ``prefill`` and ``decode`` pools: a
stream's prompt goes to a prefill worker first (one token, vLLM's disaggregated-serving request), the stream
itself to a decode worker; a prefill worker that hangs costs the prompt's time, never a token (the decode
worker computes the prompt itself). The KV itself is not simulated yet (docs/pd.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from testkit import fleet_sim

from fleetward.chaos.harness import TestFleet
from fleetward.chaos.workload import sse_lines
from fleetward.fleet.config import RouterConfig, SimConfig, SupervisorConfig
from fleetward.sim.model import SimModel
from fleetward.sim.tokenizer import encode

SIM = fleet_sim(seed=5)
MODEL = SimModel(seed=SIM.seed)


async def metric(url: str, name: str) -> dict[str, float]:
    """``name``'s samples on ``url``/metrics by their label values (joined with ``,``)."""
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(url + "/metrics")).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels = line[len(name):].split(" ")[0].strip("{}")
            out[",".join(v.split("=")[1].strip('"') for v in labels.split(",") if v)] = float(line.rsplit(" ", 1)[1])
    return out


async def stream(router: str, prompt: list[int], n: int, *, model: str = SIM.model_name
                 ) -> tuple[list[int], set[str]]:
    tokens: list[int] = []
    workers: set[str] = set()
    body = {"model": model, "prompt": prompt, "max_tokens": n, "stream": True, "return_token_ids": True}
    async with httpx.AsyncClient(timeout=60) as client, client.stream(
            "POST", router + "/v1/completions", json=body, headers={"X-Fleetward-Trace": "1"}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in sse_lines(r.aiter_bytes()):
            if line.startswith("data: {"):
                data = orjson.loads(line[6:])
                tokens += [t for c in data.get("choices") or [] for t in c.get("token_ids") or []]
                workers.add(data["fleetward"]["worker"])
    return tokens, workers


async def test_a_stream_is_prefilled_on_the_prefill_pool_and_decoded_on_the_decode_pool(
        etcd_endpoint: str, broker_endpoint: str, tmp_path: Path, outside_servers: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETWARD_ADMIN_TOKEN", "test-admin-token")  # the servers' fault switches, for the test
    p, d1, d2 = outside_servers(3, SIM)
    attach = [p.entry(restart=True, id="pd-p", role="prefill"), d1.entry(restart=True, id="pd-d1", role="decode"),
              d2.entry(restart=True, id="pd-d2", role="decode")]
    async with TestFleet(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster="pd-sim", run_dir=tmp_path, workers=0,
                         attach=attach, admin_token="test-admin-token",
                         routing=RouterConfig(stall_floor_s=0.5, prefill_timeout_s=1.0),
                         supervisor=SupervisorConfig(canary_interval_s=600.0)) as fleet:
        await fleet.restore(timeout=60)
        router = (await fleet.start_router("r0")).url
        prompt = encode("prefill here, decode there: ")

        before = await metric(p.url, "vllm:prompt_tokens_total")
        tokens, workers = await stream(router, prompt, 50)
        assert tokens == MODEL.continuation(prompt, 50)
        assert workers <= {"pd-d1", "pd-d2"} and workers, "only decode workers stream"
        after = await metric(p.url, "vllm:prompt_tokens_total")
        assert sum(after.values()) - sum(before.values()) == len(prompt), "the prefill worker took the prompt"
        assert (await metric(router, "fleetward_router_prefills_total"))["ok"] == 1

        # The prefill worker hangs (alive, /health 200): after prefill_timeout_s the decode worker computes
        # the prompt itself. Later, not wrong.
        await fleet.fault("pd-p", hang=True)
        try:
            prompt = encode("the prefill pool is stuck: ")
            tokens, workers = await stream(router, prompt, 50)
            assert tokens == MODEL.continuation(prompt, 50)
            assert workers <= {"pd-d1", "pd-d2"}
            assert (await metric(router, "fleetward_router_prefills_total"))["failed"] == 1
        finally:
            await fleet.fault("pd-p", hang=False)


async def test_up_with_a_prefill_pool_prefills_on_it_and_streams_from_the_decode_pool(
        tmp_path: Path, wait_until: Any, fleetward_up: Any, fleetward_cli: Any) -> None:
    bad = fleetward_cli("up", "--workers", "2", "--prefill-workers", "2", "--run-dir", str(tmp_path / "bad"))
    assert bad.returncode != 0 and "prefill_workers=2 leaves no decode worker" in bad.stderr, bad.stderr
    async with fleetward_up("--workers", "3", "--prefill-workers", "1", run_dir=tmp_path, cluster="pdup") as up:
        def ready() -> dict[str, Any] | None:
            data = up.status()
            ok = data and [w["health"] for w in data["workers"]] == ["ready"] * 3 and data["routers"]
            return data if ok else None

        data = await wait_until(ready, timeout=60, interval=0.5, message="3 ready workers and a router")
        roles = {w["id"]: w["role"] for w in data["workers"]}
        assert sorted(roles.values()) == ["decode", "decode", "prefill"]
        router = data["routers"][0]["url"]
        prompt = encode("a local prefill/decode fleet: ")
        model = SimModel(seed=SimConfig().seed)
        tokens, workers = await stream(router, prompt, 30, model="sim-tiny")
        assert tokens == model.continuation(prompt, 30)
        assert {roles[w] for w in workers} == {"decode"}
        assert (await metric(router, "fleetward_router_prefills_total"))["ok"] == 1
