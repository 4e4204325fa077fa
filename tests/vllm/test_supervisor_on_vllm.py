"""The supervisor on real vLLM (CPU): a killed EngineCore is detected while a stream runs; the stream moves to
the other worker and stays exact; the worker is restarted and ready again. And no false positive under real
load.

The failure is the chaos library's fault (``process.kill_engine``), so one vLLM restart proves the supervisor,
the router's move and the fault's own inject/verify/recover on real vLLM: a restart costs 30-60 s here. The
other failures share restarts elsewhere: the API server alone SIGKILLed (as the OOM killer picks one process)
is test_text_on_vllm's kill, where chat text is checked too; the engine frozen while /health stays 200 (the
silent hang) is the library vLLM experiment's freeze (test_faults_vllm); the whole tree killed is its kill."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import orjson
import pytest
from testkit import BusRecorder, library_fault

from fleetward.chaos import faults
from fleetward.chaos.harness import TestFleet
from fleetward.chaos.workload import sse_lines
from fleetward.fleet.cgroups import CpuGroup, cgroups_available
from fleetward.fleet.registry import read_fleet
from fleetward.migration.policy import LeastLoadedAffinity, prefix_key
from fleetward.sim.tokenizer import encode

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def reference(fleet: TestFleet, prompt: list[int], n: int) -> list[int]:
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(fleet.url(fleet.worker_ids[0]) + "/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
    r.raise_for_status()
    return list(r.json()["choices"][0]["token_ids"])


async def answers_500_or_nothing(url: str) -> bool:
    """An API server without its engine cannot complete: it answers 5xx, or it noticed and went away."""
    async with httpx.AsyncClient(timeout=10) as client:
        try:
            r = await client.post(url + "/v1/completions", json={"model": "tiny", "prompt": [40], "max_tokens": 1})
        except httpx.HTTPError:
            return True
    return r.status_code >= 500


async def test_a_killed_engine_is_detected_and_its_stream_moves_exactly(vllm_fleet: TestFleet,
                                                                      wait_until: Any) -> None:
    if not cgroups_available():
        pytest.skip("needs the cgroup cpu controller to slow the serving worker down")
    router = await vllm_fleet.start_router("r-kill-engine")
    recorder = BusRecorder(vllm_fleet)
    await recorder.subscribed.wait()
    prompt = encode("kill EngineCore: the stream must go on ")
    expected = await reference(vllm_fleet, prompt, 1500)
    victim = LeastLoadedAffinity().choose(vllm_fleet.worker_ids, {}, prefix_key(prompt))
    before = vllm_fleet.handle(victim).process.pid
    assert before is not None
    api_server, *engine = vllm_fleet.processes(victim)
    assert api_server.pid == before
    assert any("EngineCore" in p.name() for p in engine), [p.name() for p in engine]
    ctx = vllm_fleet.fault_context()
    fault = library_fault("process.kill_engine", victim)
    assert isinstance(fault, faults.BaseFault)  # its detail: what it touched
    # The tiny model streams ~500 tokens/s on this CPU: a whole stream can sit in socket buffers before a test
    # reacts. The worker the router picks is throttled to a sliver of a CPU, so the fault lands while it is still
    # generating (a slow worker, exactly as a throttled GPU host would be).
    throttle = CpuGroup("vllm-kill-engine")
    throttle.limit(0.15)
    throttle.add_tree(before)
    seen: dict[str, bool] = {}  # what the fault's injector saw right after it: asserted below
    landed = asyncio.Event()

    async def fault_mid_stream(client: httpx.AsyncClient) -> None:
        while True:
            progress = (await client.get(router.url + "/fleetward/v1/progress")).json()
            if progress["workers"].get(victim, {}).get("tokens", 0) >= 50:
                await fault.inject(ctx)
                landed.set()
                seen["verified"] = await fault.verify(ctx)
                seen["only the engine"] = before not in fault.detail["engine_pids"][victim]
                seen["5xx without its engine"] = await answers_500_or_nothing(vllm_fleet.bind_url(victim))
                return
            await asyncio.sleep(0.01)

    got: list[int] = []
    try:
        async with httpx.AsyncClient(timeout=300) as client:
            injector = asyncio.create_task(fault_mid_stream(client))
            async with client.stream("POST", router.url + "/v1/completions", json={
                    "model": "tiny", "prompt": prompt, "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
                    "stream": True, "return_token_ids": True}) as r:
                assert r.status_code == 200, await r.aread()
                async for line in sse_lines(r.aiter_bytes()):
                    if line.startswith("data: {"):
                        data = orjson.loads(line[6:])
                        assert "error" not in data, data
                        got.extend(data["choices"][0]["token_ids"])
            # The stream can end (moved, at full speed) while the injector still verifies the fault it landed:
            # that is waited for (each of its checks is bounded). Only a fault that never landed is cancelled.
            if not landed.is_set():
                injector.cancel()  # seen is empty, and that fails below
            with contextlib.suppress(asyncio.CancelledError):
                await injector  # and what it raised is raised here
            metrics = (await client.get(router.url + "/metrics")).text
        assert seen and all(seen.values()), (seen, fault.describe())
        assert got == expected, "the stream moved to the other worker and stayed exact"
        # The trigger is whichever comes first: the broken stream, or the supervisor's verdict on the worker.
        assert "fleetward_router_migrations_total{reason=" in metrics
        await wait_until(lambda: recorder.detected(victim, "process"), timeout=30,
                         message="the engine's death detected by the process detector")
        await vllm_fleet.wait_healthy(timeout=240)
        assert vllm_fleet.handle(victim).process.pid != before, "restarted by its command"
    finally:
        throttle.remove()
        recorder.task.cancel()
        await fault.recover(ctx)
        await vllm_fleet.stop_router(router)
    assert await fault.verify_recovered(ctx), fault.describe()


async def test_long_prompts_and_bursts_are_not_mistaken_for_hangs(vllm_fleet: TestFleet) -> None:
    router = await vllm_fleet.start_router("r-no-false-positive")
    recorder = BusRecorder(vllm_fleet)
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
