"""The simulated worker as a real ``python -m fleetward.sim.server`` process: end to end, crash switches,
resets, and ``main``'s refusals."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from testkit import (
    AUTH,
    TOKEN,
    ids_of,
    instant_sim,
    metric,
    sse_events,
    until,
)

from fleetward.fleet.config import SimConfig
from fleetward.fleet.procs import ManagedProcess, free_port
from fleetward.sim.model import SimModel
from fleetward.sim.server import main
from fleetward.sim.tokenizer import encode, render_chat

DATA = Path(__file__).parents[1] / "data" / "vllm-0.32"
MODEL = "sim-test"
FAST = instant_sim(model_name=MODEL)
SIM = SimModel(FAST.seed, FAST.eos_probability)


# -- the real process -----------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def worker_process(tmp_path: Path, config: SimConfig) -> AsyncIterator[tuple[str, ManagedProcess]]:
    port = free_port()
    proc = ManagedProcess("simworker", [sys.executable, "-m", "fleetward.sim.server", "--host", "127.0.0.1",
                                        "--port", str(port), "--model-name", "sim-e2e",
                                        "--config-json", config.model_dump_json()],
                          log_path=tmp_path / "simworker.log",
                          env={"FLEETWARD_ADMIN_TOKEN": TOKEN, "PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    proc.start()
    try:
        async with httpx.AsyncClient(base_url=url, timeout=2.0) as probe:
            async def ready() -> bool:
                return (await probe.get("/health")).status_code == 200

            await proc.wait_ready(ready, timeout=30.0, interval=0.05)
        yield url, proc
    finally:
        await proc.stop(grace=5.0)


async def test_worker_process_serves_end_to_end_and_logs_without_the_token(tmp_path: Path) -> None:
    async with worker_process(tmp_path, FAST) as (url, proc):
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        try:
            stream = await client.completions.create(model="sim-e2e", prompt=[40, 41, 42], max_tokens=8,
                                                     stream=True, extra_body={"return_token_ids": True})
            ids: list[int] = []
            async for chunk in stream:
                ids += chunk.choices[0].model_extra["token_ids"]  # type: ignore[index]
        finally:
            await client.close()
        assert ids == SIM.continuation([40, 41, 42], 8)
        async with httpx.AsyncClient(base_url=url) as c:
            metrics = (await c.get("/metrics")).text
        assert metric(metrics, "vllm:generation_tokens_total", model_name="sim-e2e") == 8
        rc = await proc.stop(grace=5.0)
    assert rc == 0  # SIGTERM is a graceful shutdown
    log = (tmp_path / "simworker.log").read_text()
    assert "fleetward sim worker starting: model 'sim-e2e'" in log
    assert TOKEN not in log


async def test_crash_switch_kills_the_process_and_resets_open_streams(tmp_path: Path) -> None:
    slow = SimConfig(**{**FAST.model_dump(), "decode_step_ms": 5.0})
    async with worker_process(tmp_path, slow) as (url, proc), httpx.AsyncClient(base_url=url) as c:
        got = 0
        with pytest.raises(httpx.TransportError):  # the connection dies mid-body, as with a kill
            async with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 4000,
                                                                  "stream": True}) as r:
                async for _ in sse_events(r):
                    got += 1
                    if got == 1:
                        resp = await c.post("/admin/faults", json={"crash": True}, headers=AUTH)
                        assert resp.status_code == 202
        assert await proc.wait_exit() == 137
        assert 1 <= got < 4000


async def read_until_cut(c: httpx.AsyncClient, path: str, body: dict[str, Any], events: list[Any]) -> bool:
    """Stream ``body`` into ``events``; whether the connection broke (rather than the body ending)."""
    try:
        async with c.stream("POST", path, json={**body, "stream": True, "return_token_ids": True}) as r:
            async for event in sse_events(r):
                events.append(event)
    except httpx.TransportError:
        return True
    return False


async def test_crash_after_tokens_ends_the_process_after_exactly_k_more_tokens(tmp_path: Path) -> None:
    slow = SimConfig(**{**FAST.model_dump(), "decode_step_ms": 5.0})
    async with worker_process(tmp_path, slow) as (url, proc), httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.post("/admin/faults", json={"crash_after_tokens": 25}, headers=AUTH)
        assert r.json()["crash_after_tokens"] == 25
        assert (await c.get("/admin/faults", headers=AUTH)).json()["crash_after_tokens"] == 25
        prompts = [[40, 41], [50, 51, 52]]
        events: list[list[Any]] = [[], []]
        async with asyncio.TaskGroup() as tg:
            cuts = [tg.create_task(read_until_cut(c, "/v1/completions", {"prompt": p, "max_tokens": 4000}, e))
                    for p, e in zip(prompts, events, strict=True)]
        assert await proc.wait_exit() == 137
    assert [t.result() for t in cuts] == [True, True]
    got = [ids_of(e) for e in events]
    assert sum(map(len, got)) == 25  # exactly k tokens reached the clients, none after
    for p, ids, e in zip(prompts, got, events, strict=True):
        assert ids == SIM.continuation(p, len(ids)) and "[DONE]" not in e
    assert "crash_after_tokens: the token budget is spent" in (tmp_path / "simworker.log").read_text()


async def test_crash_after_zero_tokens_answers_the_switch_then_exits(tmp_path: Path) -> None:
    async with worker_process(tmp_path, FAST) as (url, proc), httpx.AsyncClient(base_url=url) as c:
        r = await c.post("/admin/faults", json={"crash_after_tokens": 0}, headers=AUTH)
        assert (r.status_code, r.json()["crash_after_tokens"]) == (200, 0)
        assert await proc.wait_exit() == 137


async def test_reset_inflight_cuts_open_connections_and_the_worker_keeps_serving(tmp_path: Path) -> None:
    slow = SimConfig(**{**FAST.model_dump(), "decode_step_ms": 5.0})
    async with worker_process(tmp_path, slow) as (url, _), httpx.AsyncClient(base_url=url, timeout=30) as c:
        async def state() -> dict[str, Any]:
            return dict((await c.get("/admin/state", headers=AUTH)).json())

        events: list[Any] = []

        async def both_running_and_streaming() -> bool:
            return (await state())["running"] == 2 and bool(events)

        async def plain() -> None:
            with pytest.raises(httpx.RemoteProtocolError):  # the response ends before its body began
                await c.post("/v1/completions", json={"prompt": "y", "max_tokens": 4000})

        async with asyncio.TaskGroup() as tg:
            cut = tg.create_task(read_until_cut(c, "/v1/completions", {"prompt": "x", "max_tokens": 4000}, events))
            tg.create_task(plain())
            await until(both_running_and_streaming)
            r = await c.post("/admin/faults", json={"reset_inflight": True}, headers=AUTH)
            assert r.json()["reset_inflight"] == 2
        assert cut.result() is True
        assert events and "[DONE]" not in events  # no [DONE] and no error event: the stream just stops
        assert all(e["choices"][0]["finish_reason"] is None for e in events)
        assert ids_of(events) == SIM.continuation(encode("x"), len(ids_of(events)))
        after = await state()
        assert (after["running"], after["waiting"], after["kv_blocks_used"]) == (0, 0, 0)
        assert (await c.get("/admin/faults", headers=AUTH)).json()["crash_after_tokens"] is None
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        metrics = (await c.get("/metrics")).text
    assert metric(metrics, "vllm:request_success_total", finished_reason="abort") == 2


async def test_reset_after_tokens_cuts_each_stream_after_exactly_k_tokens(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "hi"}]
    chat_prompt = encode(render_chat(messages))
    async with worker_process(tmp_path, FAST) as (url, _), httpx.AsyncClient(base_url=url, timeout=30) as c:
        await c.post("/admin/faults", json={"reset_after_tokens": 7}, headers=AUTH)
        streams = [("/v1/completions", {"prompt": [40, 41], "max_tokens": 50}),
                   ("/v1/chat/completions", {"messages": messages, "max_tokens": 50}),
                   ("/v1/completions", {"prompt": [60], "max_tokens": 5})]  # ends on its own before k
        events: list[list[Any]] = [[], [], []]
        async with asyncio.TaskGroup() as tg:
            cuts = [tg.create_task(read_until_cut(c, path, body, e))
                    for (path, body), e in zip(streams, events, strict=True)]
            with pytest.raises(httpx.RemoteProtocolError):
                await c.post("/v1/completions", json={"prompt": [70], "max_tokens": 50})
        assert [t.result() for t in cuts] == [True, True, False]
        assert ids_of(events[0]) == SIM.continuation([40, 41], 7) and "[DONE]" not in events[0]
        assert ids_of(events[1]) == SIM.continuation(chat_prompt, 7) and "[DONE]" not in events[1]
        assert ids_of(events[2]) == SIM.continuation([60], 5) and events[2][-1] == "[DONE]"

        await c.post("/admin/faults", json={"reset_after_tokens": None}, headers=AUTH)
        again: list[Any] = []
        assert await read_until_cut(c, "/v1/completions", {"prompt": [40, 41], "max_tokens": 50}, again) is False
        assert ids_of(again) == SIM.continuation([40, 41], 50) and again[-1] == "[DONE]"
        state = (await c.get("/admin/state", headers=AUTH)).json()
        assert (state["running"], state["kv_blocks_used"]) == (0, 0)


def test_main_refuses_a_bad_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config-json", '{"decode_step_ms": -1}']) == 2
    assert "decode_step_ms" in capsys.readouterr().err
    assert main(["--config-json", '{"no_such_field": 1}', "--port", "1"]) == 2
    assert "no_such_field" in capsys.readouterr().err


def test_main_refuses_bad_starting_fault_switches(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--faults-json", '{"hang": "yes"}']) == 2
    assert "bad --faults-json: hang" in capsys.readouterr().err
    assert main(["--faults-json", "{not json"]) == 2
    assert "bad --faults-json" in capsys.readouterr().err
