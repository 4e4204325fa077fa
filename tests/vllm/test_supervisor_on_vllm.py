"""The supervisor on real vLLM (CPU) under real load and no fault: long prompts and bursts are not mistaken
for hangs (no verdict, no restart, no stream moved).

Each kind of failure is proven once, on one vLLM restart (30-60 s here), where the fault's inject, verify and
recover, the supervisor's verdict, the router's move and the streams' exactness are checked together: the
engine alone killed (the API server lives on and answers 5xx) and the engine frozen while /health stays 200
(the silent hang) are the library vLLM experiment's (test_faults_vllm); the API server alone SIGKILLed, as the
OOM killer picks one process, is test_text_on_vllm's kill, where chat text is checked too."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from testkit import BusRecorder

from fleetward.chaos.harness import TestFleet
from fleetward.fleet.registry import read_fleet
from fleetward.sim.tokenizer import encode

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_long_prompts_and_bursts_are_not_mistaken_for_hangs(vllm_fleet: TestFleet) -> None:
    router = await vllm_fleet.start_router("r-no-false-positive")
    recorder = BusRecorder(vllm_fleet.bus)
    await recorder.subscribed.wait()
    pids = {w: vllm_fleet.handle(w).process.pid for w in vllm_fleet.worker_ids}
    long_prompt = encode("x" * 40 + "a long document. " * 115)[:1990]  # near the 2048-token context
    try:
        async with httpx.AsyncClient(timeout=300) as client:
            async def one(prompt: list[int], n: int) -> int:
                r = await client.post(router.url + "/v1/completions", json={
                    "model": "tiny", "prompt": prompt, "max_tokens": n, "ignore_eos": True, "temperature": 0})
                assert r.status_code == 200, r.text
                return int(r.json()["usage"]["completion_tokens"])

            burst = [one(encode(f"burst {i}: ") * (1 + i % 7), 200) for i in range(16)]
            done = await asyncio.gather(one(long_prompt, 50), one(long_prompt[:1500], 400), *burst)
        assert done[0] == 50 and done[1] == 400 and all(n == 200 for n in done[2:])
        metrics = (await httpx.AsyncClient().get(router.url + "/metrics")).text
        status = await read_fleet(vllm_fleet.store, vllm_fleet.keys)
    finally:
        recorder.task.cancel()
        await vllm_fleet.stop_router(router)
    assert not [e for e in recorder.events if e.kind in ("hang.detected", "restart")], "no hang verdict"
    assert all(h.state.value == "ready" for w, h in status.health.items() if w in pids)
    assert {w: vllm_fleet.handle(w).process.pid for w in pids} == pids, "nobody restarted"
    assert "fleetward_router_migrations_total{" not in metrics, "no stream was moved"
