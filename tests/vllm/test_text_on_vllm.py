"""Exact as text on real vLLM (issue 11): the tiny model with a byte-level BPE vocabulary, chat streams with
non-ASCII prompts through the router with the official openai client.

- Uninterrupted, the router's text equals vLLM's own text for the same ids (the detokenizers agree).
- A worker's API server SIGKILLed mid-stream: every stream's text equals the uninterrupted text (the resumed
  attempt detokenizes from the resumed prompt on the worker; the router's text does not depend on it), and
  the supervisor's side of that failure (detected, the engine it left stopped, restarted).
- The same through a ``Last-Event-ID`` resume on a second router after the first one died.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import orjson
import psutil
import pytest
from openai import AsyncOpenAI
from testkit import BusRecorder, checkpointed, library_fault

from fleetward.chaos.fault import Fault
from fleetward.chaos.harness import TestFleet
from fleetward.chaos.workload import sse_lines
from fleetward.fleet.cgroups import CpuGroup, cgroups_available

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPTS = ["日本語で答えて: 👩🏽‍🔬 の話", "Привет! Ελληνικά και 한국어 🏳️‍🌈", "héllo wörld — ऑपरेशन ✨🚀",
           "emoji 🥲🙈🔥 only"]
N = 400


def body(prompt: str, n: int = N) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}


async def sse_chat(client: httpx.AsyncClient, url: str, payload: dict[str, Any], headers: dict[str, str] | None = None,
                   *, stop_after: int | None = None) -> tuple[list[int], str, str]:
    """Token ids, text and where a resume starts (read until ``stop_after`` tokens, if given).

    The stream is vLLM's (no SSE ids): the resume point is the request's id (each chunk's ``id``, as the
    ``X-Request-Id`` header) and the tokens the client holds, counted from ``token_ids``
    (docs/operations.md, "Resuming a stream").
    """
    ids: list[int] = []
    text, rid = [], ""
    async with client.stream("POST", url + "/v1/chat/completions", json=payload, headers=headers or {}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in sse_lines(r.aiter_bytes()):
            assert not line.startswith(("id:", ":")), line
            if line.startswith("data: {"):
                data = orjson.loads(line[6:])
                assert "error" not in data, data
                rid = data["id"]
                choice = data["choices"][0]
                ids.extend(choice.get("token_ids") or [])
                text.append(choice["delta"].get("content") or "")
                if stop_after is not None and len(ids) >= stop_after:
                    break
    return ids, "".join(text), f"{rid}:{len(ids)}"


async def openai_chat(client: AsyncOpenAI, prompt: str) -> tuple[list[int], str]:
    ids: list[int] = []
    text = []
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=N, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    async for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            ids.extend(getattr(choice, "token_ids", None) or [])
    return ids, "".join(text)


async def references(fleet: TestFleet) -> dict[str, tuple[list[int], str]]:
    """vLLM's own ids and text, uninterrupted, straight from a worker."""
    out = {}
    async with httpx.AsyncClient(timeout=300) as client:
        for p in PROMPTS:
            ids, text, _ = await sse_chat(client, fleet.url(fleet.worker_ids[0]), body(p))
            out[p] = (ids, text)
    return out


async def test_the_routers_text_equals_vllms_own_text_for_the_same_ids(vllm_fleet: TestFleet) -> None:
    router = await vllm_fleet.start_router("vllm-text")
    try:
        expected = await references(vllm_fleet)
        assert any(any(ord(c) > 0xFFFF for c in t) for _, t in expected.values()), "4-byte characters occur"
        async with httpx.AsyncClient(timeout=30) as http:
            models = (await http.get(router.url + "/v1/models")).json()["data"]
        assert models[0]["fleetward"]["detokenizer"] == "router", models
        client = AsyncOpenAI(base_url=router.url + "/v1", api_key="none", timeout=300)
        for p in PROMPTS:
            assert await openai_chat(client, p) == expected[p], p
    finally:
        await vllm_fleet.stop_router(router)


async def test_an_api_server_sigkilled_mid_stream_leaves_every_chat_text_exact(vllm_fleet: TestFleet,
                                                                                wait_until: Any) -> None:
    """The API server alone SIGKILLed (the library's ``process.kill_worker`` of the root, as the kernel's OOM
    killer picks one process) mid-stream: every chat stream's ids and text equal vLLM's uninterrupted ones;
    the agent detects the death, stops the EngineCore and Worker it left running (reparented to init, 2.3 GB
    each here, a GPU's memory on a GPU host) and the server is restarted by its command."""
    if not cgroups_available():
        pytest.skip("needs root and the cgroup cpu controller to slow the workers down")
    router = await vllm_fleet.start_router("vllm-text-kill")
    recorder = BusRecorder(vllm_fleet.bus)
    await recorder.subscribed.wait()
    expected = await references(vllm_fleet)
    ctx = vllm_fleet.fault_context()
    # The tiny model streams ~500 tokens/s here: throttle both workers so the kill lands mid-stream; the
    # survivor gets its CPU back at the kill.
    groups = {w: CpuGroup(f"vllm-text-{w}") for w in vllm_fleet.worker_ids}
    for w, g in groups.items():
        g.limit(0.2)
        pid = vllm_fleet.handle(w).process.pid
        assert pid is not None
        g.add_tree(pid)
    killed: list[tuple[str, Fault, int, list[psutil.Process]]] = []  # victim, fault, its pid, its engine

    async def kill_mid_stream(client: httpx.AsyncClient) -> None:
        while True:
            progress = (await client.get(router.url + "/fleetward/v1/progress")).json()["workers"]
            busy = sorted((p["in_flight"], w) for w, p in progress.items() if p["in_flight"])
            if busy and sum(p["tokens"] for p in progress.values()) >= 40 * len(PROMPTS):
                victim = busy[-1][1]
                api_server, *engine = vllm_fleet.processes(victim)
                fault = library_fault("process.kill_worker", victim, scope="root")
                killed.append((victim, fault, api_server.pid, engine))
                await fault.inject(ctx)
                for w, g in groups.items():
                    if w != victim:
                        g.remove()
                return
            await asyncio.sleep(0.01)

    try:
        client = AsyncOpenAI(base_url=router.url + "/v1", api_key="none", timeout=300)
        async with httpx.AsyncClient(timeout=300) as http:
            killer = asyncio.create_task(kill_mid_stream(http))
            got = await asyncio.gather(*(openai_chat(client, p) for p in PROMPTS))
            killer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await killer
            metrics = (await http.get(router.url + "/metrics")).text
        assert killed, "the kill landed while streams were running"
        assert "fleetward_router_migrations_total{reason=" in metrics
        for p, result in zip(PROMPTS, got, strict=True):
            assert result[0] == expected[p][0], f"{p}: token ids"
            assert result[1] == expected[p][1], f"{p}: text"
        victim, fault, before, engine = killed[0]
        assert await fault.verify(ctx), fault.describe()
        assert any("EngineCore" in p.name() for p in engine), engine
        await wait_until(lambda: recorder.detected(victim, "process"), timeout=30,
                         message="the API server's death detected by the process detector")

        def engine_gone() -> bool:
            return not [p for p in engine if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

        # Before the fault's recovery, which would stop them itself.
        await wait_until(engine_gone, timeout=30, message="the EngineCore and Worker the API server left are stopped")
        await vllm_fleet.wait_healthy(timeout=240)
        assert vllm_fleet.handle(victim).process.pid != before, "restarted by its command"
    finally:
        for g in groups.values():
            g.remove()
        recorder.task.cancel()
        for _, fault, _, _ in killed:
            await fault.recover(ctx)
        await vllm_fleet.stop_router(router)
    for _, fault, _, _ in killed:
        assert await fault.verify_recovered(ctx), fault.describe()


async def test_a_last_event_id_resume_on_a_second_router_keeps_the_text_exact(vllm_fleet: TestFleet,
                                                                             wait_until: Any) -> None:
    first = await vllm_fleet.start_router("vllm-text-a")
    second = await vllm_fleet.start_router("vllm-text-b")
    prompt = PROMPTS[0]
    try:
        expected = (await references(vllm_fleet))[prompt]
        async with httpx.AsyncClient(timeout=300) as client:
            head_ids, head_text, last = await sse_chat(client, first.url, body(prompt), stop_after=37)
            assert head_ids and len(head_ids) < N
            # The first router dies; the checkpoint may hold fewer tokens than the client (they are then
            # regenerated and not sent again) or more (they are replayed).
            rid, _, count = last.rpartition(":")
            n = int(count)
            # A router that dies before its first flush leaves nothing to resume (the checkpoint lag,
            # docs/operations.md): the kill waits for the request's checkpoint, not for a guess of the lag.
            await wait_until(lambda: checkpointed(vllm_fleet, rid), timeout=30, message="the request checkpointed")
            vllm_fleet.kill_router(first)
            tail_ids, tail_text, _ = await sse_chat(client, second.url, body(prompt), {"Last-Event-ID": last})
        held = head_ids[:n]
        assert held + tail_ids == expected[0]
        assert head_text + tail_text == expected[1]
    finally:
        await vllm_fleet.stop_router(second)
        await vllm_fleet.stop_router(first)
