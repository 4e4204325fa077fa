"""The supervisor on real vLLM (CPU): a killed API server, a killed EngineCore, a SIGSTOPped EngineCore
(the silent hang: /health stays 200) are each detected while streams run; the streams move to the other
worker and stay exact; the worker is restarted and ready again. And no false positive under real load."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import httpx
import orjson
import pytest

from fleetward.chaos.harness import TestFleet
from fleetward.chaos.workload import sse_lines
from fleetward.fleet.bus import Event
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


class Recorder:
    def __init__(self, fleet: TestFleet) -> None:
        self.events: list[Event] = []
        self.subscribed = asyncio.Event()
        self.task = asyncio.create_task(self._run(fleet))

    async def _run(self, fleet: TestFleet) -> None:
        async for e in fleet.bus.subscribe(subscribed=self.subscribed):
            self.events.append(e)

    def of(self, kind: str, worker: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind and e.worker == worker]


def fault_engine(fleet: TestFleet, worker: str, how: str) -> None:
    handle = fleet.handle(worker)
    if how == "kill API server":
        handle.process.kill()  # SIGKILL of the whole tree, as a crash of the server takes its children
    elif how == "kill EngineCore":
        for p in handle.engine_processes():
            if "EngineCore" in p.name():
                p.send_signal(signal.SIGKILL)
    else:
        fleet.signal_engine(worker, signal.SIGSTOP)


@pytest.mark.parametrize("how, detector", [("kill API server", "process"), ("kill EngineCore", "process"),
                                           ("SIGSTOP EngineCore", "engine-frozen")])
async def test_each_engine_failure_is_detected_and_streams_stay_exact(vllm_fleet: TestFleet, how: str, detector: str,
                                                                      wait_until: Any) -> None:
    if not cgroups_available():
        pytest.skip("needs the cgroup cpu controller to slow the serving worker down")
    router = await vllm_fleet.start_router(f"r-{how.split()[0].lower()}-{detector}")
    recorder = Recorder(vllm_fleet)
    await recorder.subscribed.wait()
    prompt = encode(f"{how}: the stream must go on ")
    expected = await reference(vllm_fleet, prompt, 1500)
    victim = LeastLoadedAffinity().choose(vllm_fleet.worker_ids, {}, prefix_key(prompt))
    before = vllm_fleet.handle(victim).process.pid
    assert before is not None
    throttle = CpuGroup(f"vllm-{detector}")
    throttle.limit(0.15)  # long enough a stream that the fault lands in its middle (see test_router_on_vllm)
    throttle.add_tree(before)
    faulted: list[str] = []

    async def fault_mid_stream(client: httpx.AsyncClient) -> None:
        while True:
            progress = (await client.get(router.url + "/fleetward/v1/progress")).json()
            if progress["workers"].get(victim, {}).get("tokens", 0) >= 50:
                fault_engine(vllm_fleet, victim, how)
                faulted.append(victim)
                return
            await asyncio.sleep(0.01)

    got: list[int] = []
    try:
        async with httpx.AsyncClient(timeout=300) as client:
            injector = asyncio.create_task(fault_mid_stream(client))
            async with client.stream("POST", router.url + "/v1/completions", json={
                    "model": "tiny", "prompt": prompt, "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
                    "stream": True, "return_token_ids": True}) as r:
                async for line in sse_lines(r.aiter_bytes()):
                    if line.startswith("data: {"):
                        data = orjson.loads(line[6:])
                        assert "error" not in data, data
                        got.extend(data["choices"][0]["token_ids"])
            injector.cancel()
        assert faulted == [victim]
        assert got == expected, "the stream moved to the other worker and stayed exact"

        def detected() -> bool:
            return any(e.data["state"] == "unhealthy" and e.data["detector"] == detector
                       for e in recorder.of("health.changed", victim))

        await wait_until(detected, timeout=30, message=f"{how} detected by {detector}")
        await vllm_fleet.wait_healthy(timeout=240)
        assert vllm_fleet.handle(victim).process.pid != before, "restarted"
        if how == "SIGSTOP EngineCore":
            assert recorder.of("hang.detected", victim), "the silent hang is named as such"
    finally:
        throttle.remove()
        recorder.task.cancel()
        await vllm_fleet.stop_router(router)


async def test_long_prompts_and_bursts_are_not_mistaken_for_hangs(vllm_fleet: TestFleet) -> None:
    router = await vllm_fleet.start_router("r-no-false-positive")
    recorder = Recorder(vllm_fleet)
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


async def test_a_killed_api_server_leaves_no_engine_behind(vllm_fleet: TestFleet, wait_until: Any) -> None:
    """SIGKILL of the API server alone leaves vLLM's EngineCore and Worker running, reparented to init (2.3 GB
    each here, a GPU's memory on a GPU host). The agent stops them as soon as it sees the API server exit,
    and the supervisor brings the server back through its restart command."""
    victim = vllm_fleet.worker_ids[0]
    api_server, *engine = vllm_fleet.processes(victim)
    assert any("EngineCore" in p.name() for p in engine), [p.name() for p in engine]
    api_server.send_signal(signal.SIGKILL)

    def engine_gone() -> bool:
        return not [p for p in engine if p.is_running() and p.status() != "zombie"]

    await wait_until(engine_gone, timeout=30, message="the EngineCore and Worker the API server left are stopped")
    await vllm_fleet.wait_healthy(timeout=240)
    assert vllm_fleet.processes(victim)[0].pid != api_server.pid, "restarted by its command"
