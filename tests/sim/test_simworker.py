"""The simulated worker: vLLM's wire format, the deterministic model, batching, faults, process life.

Three ways in, from cheapest to most real:

- the sans-IO :class:`SimScheduler` (batching, queueing, KV, preemption, stop rules) called directly;
- the app in-process: ``httpx.ASGITransport`` where a buffered response is enough, and uvicorn on a
  free port in the test's own event loop where a test must act mid-stream (hang, disconnect, the
  ``openai`` client); timing-dependent tests give the engine a :class:`ManualClock` and jump it;
- a real ``python -m fleetward.sim.server`` subprocess for the end-to-end and crash tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from fleetward.chaos.workload import sse_data
from fleetward.fleet.clock import SYSTEM_CLOCK, Clock, ManualClock
from fleetward.fleet.config import SimConfig
from fleetward.fleet.procs import ManagedProcess, free_port
from fleetward.fleet.vocab import builtin_json, load_vocabulary
from fleetward.sim.engine import (
    ENGINE_DEAD_MESSAGE,
    Faults,
    SamplingSpec,
    SimEngine,
    SimRequest,
    SimScheduler,
)
from fleetward.sim.model import SimModel, sim_model
from fleetward.sim.server import SimWorker, main
from fleetward.sim.tokenizer import EOS_ID, decode, encode, render_chat

DATA = Path(__file__).parents[1] / "data" / "vllm-0.32"
TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MODEL = "sim-test"
FAST = SimConfig(decode_step_ms=0.5, decode_ms_per_seq=0.0, prefill_ms_per_token=0.0, model_name=MODEL)
SIM = SimModel(FAST.seed, FAST.eos_probability)


# -- helpers -------------------------------------------------------------------------------------------


async def eventually(cond: Callable[[], object], *, within: float = 10.0) -> None:
    """Wait until ``cond()`` is true; fail after ``within`` seconds (a deadline, not a timing claim)."""
    async with asyncio.timeout(within):
        # Polling: the conditions are other tasks' state (engine, server, client) with no event to await.
        while not cond():  # noqa: ASYNC110
            await asyncio.sleep(0.001)


async def pump(clock: ManualClock, until: Callable[[], bool]) -> None:
    """Jump ``clock`` one engine step at a time until ``until()`` holds."""
    while not until():
        await eventually(lambda: until() or clock.sleepers > 0)
        if not until():
            clock.advance(1.0)


def _no_crash() -> None:
    raise AssertionError("an in-process test asked the worker to crash")


@contextlib.asynccontextmanager
async def asgi(config: SimConfig = FAST, *, clock: Clock = SYSTEM_CLOCK, faults: Faults | None = None
               ) -> AsyncIterator[tuple[httpx.AsyncClient, SimWorker]]:
    """The app in-process through httpx's ASGI transport (responses are buffered), engine running."""
    worker = SimWorker(config, admin_token=TOKEN, clock=clock, crash=_no_crash, faults=faults)
    async with worker.app.router.lifespan_context(worker.app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(worker.app), base_url="http://sim") as c:
            yield c, worker


class _InProcessServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # leave pytest's signal handlers alone
        yield


@contextlib.asynccontextmanager
async def serve(config: SimConfig = FAST, *, clock: Clock = SYSTEM_CLOCK) -> AsyncIterator[tuple[str, SimWorker]]:
    """The app on a real socket (uvicorn in this event loop), for tests that act mid-stream."""
    worker = SimWorker(config, admin_token=TOKEN, clock=clock, crash=_no_crash)
    port = free_port()
    server = _InProcessServer(uvicorn.Config(worker.app, host="127.0.0.1", port=port, log_config=None,
                                             lifespan="on", timeout_graceful_shutdown=2))
    async with asyncio.TaskGroup() as tg:
        tg.create_task(server.serve())
        try:
            await eventually(lambda: server.started)
            yield f"http://127.0.0.1:{port}", worker
        finally:
            server.should_exit = True


def sse(text: str) -> list[Any]:
    """The events of an SSE body: parsed JSON objects, and the string ``"[DONE]"``."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def sse_lines(response: httpx.Response) -> AsyncIterator[Any]:
    return sse_data(response.aiter_bytes())


def shape(value: Any) -> Any:
    """Keys (in order) and value types, recursively; a list of ints is one type."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return ["int"]
        return [shape(v) for v in value]
    return type(value).__name__


def assert_same_shape(ours: Any, sample: Any) -> None:
    # json.dumps keeps dict order, so this compares key order too.
    assert json.dumps(shape(ours)) == json.dumps(shape(sample))


def sample_events(name: str) -> list[Any]:
    return sse((DATA / name).read_text())


def metric(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"no sample {name} {labels}")


def tokens_of(events: list[Any]) -> list[int]:
    return [t for e in events if isinstance(e, dict) and e.get("choices") for t in e["choices"][0]["token_ids"]]


def ids_of(events: list[Any]) -> list[int]:
    """Token ids of completion or chat events (a chat stream's role chunk has none)."""
    return [t for e in events if isinstance(e, dict) and e.get("choices")
            for t in e["choices"][0].get("token_ids") or []]


async def until(check: Callable[[], Awaitable[bool]], *, within: float = 10.0) -> None:
    """Ask ``check()`` again until it is true (e.g. a worker process's state); fail after ``within`` s."""
    async with asyncio.timeout(within):
        while not await check():
            pass


# -- vLLM's wire format ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name, include_usage, tokens", [
    ("completion_stream.sse", False, 3),
    ("completion_stream_usage.sse", True, 4),
])
async def test_completion_stream_matches_vllm_field_by_field(name: str, include_usage: bool, tokens: int) -> None:
    sample = sample_events(name)
    body: dict[str, Any] = {"model": MODEL, "prompt": [40, 41, 42, 43], "max_tokens": tokens, "stream": True,
                            "return_token_ids": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    async with asgi() as (c, _):
        r = await c.post("/v1/completions", json=body)
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    ours = sse(r.text)
    assert len(ours) == len(sample)
    for mine, theirs in zip(ours, sample, strict=True):
        assert_same_shape(mine, theirs)
    assert ours[-1] == "[DONE]"
    assert re.fullmatch(r"cmpl-[0-9a-f]{16}", ours[0]["id"])
    assert len({e["id"] for e in ours[:-1]}) == 1 and len({e["created"] for e in ours[:-1]}) == 1
    assert ours[0]["choices"][0]["prompt_token_ids"] == [40, 41, 42, 43]
    assert tokens_of(ours) == SIM.continuation([40, 41, 42, 43], tokens)
    if include_usage:
        assert ours[-2]["usage"] == {"prompt_tokens": 4, "total_tokens": 4 + tokens, "completion_tokens": tokens}


async def test_chat_stream_matches_vllm_field_by_field() -> None:
    sample = sample_events("chat_stream_usage.sse")
    messages = [{"role": "user", "content": "hi"}]
    async with asgi() as (c, _):
        r = await c.post("/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "max_tokens": 3, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}})
    ours = sse(r.text)
    assert len(ours) == len(sample)
    for mine, theirs in zip(ours, sample, strict=True):
        assert_same_shape(mine, theirs)
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", ours[0]["id"])
    prompt = encode(render_chat(messages))
    assert ours[0]["prompt_token_ids"] == sample[0]["prompt_token_ids"] == prompt
    assert ours[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert tokens_of(ours[1:]) == SIM.continuation(prompt, 3)


async def test_final_chunk_carries_the_fingerprint_when_no_usage_chunk_follows() -> None:
    async with asgi() as (c, worker):
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                       "max_tokens": 2, "stream": True})
    events = sse(r.text)
    assert [list(e) for e in events[1:-1]] == [["id", "object", "created", "model", "choices"],
                                               ["id", "object", "created", "model", "choices",
                                                "system_fingerprint"]]
    assert events[-2]["system_fingerprint"] == worker.system_fingerprint
    assert events[0]["prompt_token_ids"] is None and events[1]["choices"][0]["token_ids"] is None


async def test_non_stream_responses_match_vllm_field_by_field() -> None:
    async with asgi() as (c, _):
        completion = (await c.post("/v1/completions", json={
            "model": MODEL, "prompt": "Hello", "max_tokens": 4, "return_token_ids": True})).json()
        chat = (await c.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "return_token_ids": True})).json()
    assert_same_shape(completion, json.loads((DATA / "completion.json").read_text()))
    assert_same_shape(chat, json.loads((DATA / "chat.json").read_text()))
    ids = SIM.continuation(encode("Hello"), 4)
    assert completion["choices"][0]["token_ids"] == ids
    assert completion["choices"][0]["text"] == decode(ids)
    assert completion["usage"] == {"prompt_tokens": 5, "total_tokens": 9, "completion_tokens": 4,
                                   "prompt_tokens_details": None, "completion_tokens_details": None}
    assert chat["choices"][0]["message"]["content"] == decode(chat["choices"][0]["token_ids"])


async def test_models_lists_the_served_model_with_max_model_len() -> None:
    async with asgi() as (c, _):
        r = await c.get("/v1/models")
        health = await c.get("/health")
    assert_same_shape(r.json(), json.loads((DATA / "models.json").read_text()))
    card = r.json()["data"][0]
    assert card["id"] == MODEL and card["max_model_len"] == FAST.max_model_len
    assert health.status_code == 200 and health.content == b""


# -- the deterministic model -------------------------------------------------------------------------------


async def test_same_request_twice_gives_the_same_tokens_and_any_prefix_continues_exactly() -> None:
    prompt = encode("The quick brown fox")
    async with asgi() as (c, _):
        async def generate(p: list[int], n: int) -> list[int]:
            r = await c.post("/v1/completions", json={"prompt": p, "max_tokens": n, "return_token_ids": True})
            return list(r.json()["choices"][0]["token_ids"])

        first = await generate(prompt, 12)
        assert await generate(prompt, 12) == first
        assert await generate(prompt + first[:5], 7) == first[5:]
    assert first == SIM.continuation(prompt, 12)


async def test_eos_ends_with_stop_unless_ignored() -> None:
    config = SimConfig(**{**FAST.model_dump(), "eos_probability": 0.2, "seed": 7})
    model = SimModel(7, 0.2)
    prompt = encode("eos")
    expected = model.continuation(prompt, 60)
    assert expected[-1] == EOS_ID  # the seed is chosen so that EOS comes early
    async with asgi(config) as (c, _):
        r = (await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 60,
                                                   "return_token_ids": True})).json()["choices"][0]
        ignored = (await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 60, "ignore_eos": True,
                                                         "return_token_ids": True})).json()["choices"][0]
    assert (r["token_ids"], r["finish_reason"], r["stop_reason"]) == (expected, "stop", None)
    assert r["text"] == decode(expected)
    assert ignored["token_ids"] == model.continuation(prompt, 60, ignore_eos=True)
    assert (len(ignored["token_ids"]), ignored["finish_reason"]) == (60, "length")


async def test_min_tokens_masks_eos_and_a_resumed_request_continues_exactly() -> None:
    config = SimConfig(**{**FAST.model_dump(), "eos_probability": 0.2, "seed": 7})
    model = SimModel(7, 0.2)
    prompt = encode("eos")
    min_tokens = len(model.continuation(prompt, 60)) + 3  # past where EOS would come
    expected, state = [], model.state(prompt)
    while len(expected) < 60 and (not expected or expected[-1] != EOS_ID):
        t = model.token_for(state, ignore_eos=len(expected) < min_tokens)
        expected.append(t)
        state = SimModel.advance(state, t)
    async with asgi(config) as (c, _):
        async def generate(p: list[int], m: int, n: int = 60) -> list[int]:
            r = await c.post("/v1/completions", json={"prompt": p, "max_tokens": n, "min_tokens": m,
                                                      "return_token_ids": True})
            return list(r.json()["choices"][0]["token_ids"])

        got = await generate(prompt, min_tokens)
        assert await generate(prompt + got[:5], min_tokens - 5, 60 - 5) == got[5:]
        bad = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "min_tokens": 3})
    assert got == expected and EOS_ID not in got[:min_tokens]
    # vLLM names no parameter for this one (sampling_params.py _verify_args).
    assert (bad.status_code, bad.json()["error"]["param"], bad.json()["error"]["message"]) == (
        400, None, "min_tokens must be less than or equal to max_tokens=2, got 3.")


def _stop_oracle(prompt: list[int], stop: str, n: int) -> tuple[list[int], str]:
    """Tokens and text vLLM returns with ``stop``: up to the token completing it; text before it."""
    ids, text = [], ""
    for t in SIM.continuation(prompt, n):
        ids.append(t)
        text += decode([t])
        if stop in text:
            return ids, text[:text.index(stop)]
    raise AssertionError("the stop string never completes")


async def test_stop_strings_and_stop_token_ids_end_like_vllm() -> None:
    prompt = encode("stop here")
    full = SIM.continuation(prompt, 40)
    stop = decode(full[20:22])
    ids, text = _stop_oracle(prompt, stop, 40)
    async with asgi() as (c, _):
        plain = (await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 40, "stop": [stop, "\x00"],
                                                       "return_token_ids": True})).json()
        streamed = sse((await c.post("/v1/completions", json={
            "prompt": prompt, "max_tokens": 40, "stop": stop, "stream": True, "return_token_ids": True})).text)
        by_id = (await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 40,
                                                       "stop_token_ids": [full[10]],
                                                       "return_token_ids": True})).json()["choices"][0]
    choice = plain["choices"][0]
    assert (choice["token_ids"], choice["text"]) == (ids, text)
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert plain["usage"]["completion_tokens"] == len(ids)
    # Streamed, the stop string never shows, even partly: text is held back until it is ruled out.
    assert "".join(e["choices"][0]["text"] for e in streamed[:-1]) == text
    assert tokens_of(streamed) == ids
    assert streamed[-2]["choices"][0]["stop_reason"] == stop
    first = full.index(full[10])
    assert (by_id["token_ids"], by_id["text"]) == (full[:first + 1], decode(full[:first]))
    assert (by_id["finish_reason"], by_id["stop_reason"]) == ("stop", full[10])


# -- a trained vocabulary -----------------------------------------------------------------------------------

BPE = FAST.model_copy(update={"tokenizer": "bpe"})


async def test_a_trained_vocabulary_is_served_as_vllm_serves_the_tiny_model_with_it() -> None:
    """Text prompts encode with the vocabulary (chat roles as single special ids), ids span all of it, and
    the text is the incremental detokenizer's, primed with the prompt, as vLLM's is."""
    vocab, model = load_vocabulary("bpe"), sim_model(BPE)
    text = "Grüße aus Köln — 日本語 😀"
    messages = [{"role": "user", "content": text}]
    chat_ids = vocab.encode(render_chat(messages), add_special_tokens=False)
    async with asgi(BPE) as (c, worker):
        plain = (await c.post("/v1/completions", json={"prompt": text, "max_tokens": 64,
                                                       "return_token_ids": True})).json()
        chat = (await c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 64,
                                                           "return_token_ids": True})).json()
        refused = await c.post("/v1/completions", json={"prompt": [5, vocab.size]})
        models = (await c.get("/v1/models")).json()
    ids = plain["choices"][0]["token_ids"]
    assert ids == model.continuation(vocab.encode(text), 64) and max(ids) >= 259
    assert plain["choices"][0]["text"] == vocab.detokenizer(vocab.encode(text)).feed(ids)
    assert plain["usage"]["prompt_tokens"] == len(vocab.encode(text)) < len(text.encode())
    assert vocab.id_of("<|user|>") in chat_ids and chat["usage"]["prompt_tokens"] == len(chat_ids)
    answer = model.continuation(chat_ids, 64)
    assert chat["choices"][0]["token_ids"] == answer
    assert chat["choices"][0]["message"]["content"] == vocab.detokenizer(chat_ids).feed(answer)
    assert refused.status_code == 400
    assert f"Token id {vocab.size} is out of vocabulary" in vllm_error(refused)["message"]
    assert models["data"][0]["root"] == MODEL  # a built-in vocabulary: no folder to point routers at
    assert worker.vocab_size == vocab.size == 4096


async def test_a_tokenizer_folder_is_advertised_as_the_models_root(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text(json.dumps(builtin_json("sp"), ensure_ascii=False))
    config = FAST.model_copy(update={"tokenizer": str(tmp_path / "tokenizer.json")})
    folder = str(tmp_path.resolve())  # noqa: ASYNC240 - before the worker runs
    async with asgi(config) as (c, _):
        card = (await c.get("/v1/models")).json()["data"][0]
        ids = (await c.post("/v1/completions", json={"prompt": "▁x y", "max_tokens": 8,
                                                     "return_token_ids": True})).json()["choices"][0]["token_ids"]
    assert card["root"] == folder
    assert ids == sim_model(config).continuation(load_vocabulary("sp").encode("▁x y"), 8)


# -- batching and queueing (sans IO) ------------------------------------------------------------------------


def _config(**kw: Any) -> SimConfig:
    base = {"decode_step_ms": 10.0, "decode_ms_per_seq": 1.0, "prefill_ms_per_token": 0.5}
    return SimConfig(**{**base, **kw})


def _run_to_end(s: SimScheduler) -> int:
    now, steps = 0.0, 0
    while (step := s.schedule(now)) is not None:
        now += step.duration
        s.complete(step, now)
        steps += 1
    return steps


def test_max_num_seqs_makes_the_rest_wait() -> None:
    s = SimScheduler(_config(max_num_seqs=2))
    reqs = [s.new_request(f"r{i}", encode("ab"), SamplingSpec(max_tokens=1 + i), now=0.0) for i in range(3)]
    for r in reqs:
        s.add(r)
    step = s.schedule(0.0)
    assert step is not None and step.batch == reqs[:2] and list(s.waiting) == [reqs[2]]
    s.complete(step, step.duration)  # r0 is done after one token: its slot frees
    step = s.schedule(step.duration)
    assert step is not None and step.batch == [reqs[1], reqs[2]] and step.admitted == [reqs[2]]
    assert reqs[2].admitted_at == pytest.approx(0.0 + (10 + 2 * 1 + 0.5 * 4) / 1000)


def test_kv_capacity_makes_requests_wait_until_blocks_free() -> None:
    s = SimScheduler(_config(kv_capacity_tokens=64, max_model_len=48, kv_block_size=16))
    a = s.new_request("a", [10] * 40, SamplingSpec(max_tokens=2), now=0.0)
    b = s.new_request("b", [11] * 40, SamplingSpec(max_tokens=2), now=0.0)
    s.add(a)
    s.add(b)
    step = s.schedule(0.0)
    assert step is not None and step.batch == [a] and list(s.waiting) == [b]
    assert s.kv_usage == 0.75
    _run_to_end(s)
    assert a.output_ids == SIM.continuation([10] * 40, 2) and b.output_ids == SIM.continuation([11] * 40, 2)
    assert s.kv_usage == 0.0 and b.admitted_at is not None and b.admitted_at > 0


def test_step_time_grows_with_the_batch_and_with_prefill() -> None:
    s = SimScheduler(_config())
    for i in range(4):
        s.add(s.new_request(f"r{i}", [5] * 10, SamplingSpec(max_tokens=5), now=0.0))
    prefill = s.schedule(0.0)
    assert prefill is not None and prefill.prefill_tokens == 40
    assert prefill.duration == pytest.approx((10 + 4 * 1 + 0.5 * 40) / 1000)
    s.complete(prefill, prefill.duration)
    decode_step = s.schedule(prefill.duration)
    assert decode_step is not None and decode_step.duration == pytest.approx((10 + 4) / 1000)
    single = SimScheduler(_config())
    single.add(single.new_request("x", [5] * 10, SamplingSpec(max_tokens=5), now=0.0))
    first = single.schedule(0.0)
    assert first is not None
    single.complete(first, first.duration)
    lone = single.schedule(first.duration)
    assert lone is not None and lone.duration < decode_step.duration


def test_chunked_prefill_keeps_the_batch_decoding_while_a_long_prompt_is_computed() -> None:
    """A 1,000-token prompt arrives while a short sequence decodes: without chunking its prefill is one step
    that holds the batch (one token for the short one in 520 ms); with chunks of 100 the short sequence gets a
    token every step meanwhile, and the long one its first token after ten chunks; tokens stay exact."""
    for chunk, short_tokens_during, long_first_step in ((0, 1, 2), (100, 10, 11)):
        s = SimScheduler(_config(chunked_prefill_tokens=chunk, max_model_len=2048))
        short = s.new_request("short", [5] * 4, SamplingSpec(max_tokens=40), now=0.0)
        long = s.new_request("long", [6] * 1000, SamplingSpec(max_tokens=3), now=0.0)
        s.add(short)
        first = s.schedule(0.0)
        assert first is not None
        now = first.duration
        s.complete(first, now)
        s.add(long)
        durations = []
        while long.first_token_at is None:
            step = s.schedule(now)
            assert step is not None
            now += step.duration
            durations.append(step.duration)
            s.complete(step, now)
        assert len(durations) == long_first_step - 1
        assert len(short.output_ids) - 1 == short_tokens_during
        if chunk:
            assert max(durations) == pytest.approx((10 + 2 * 1 + 0.5 * 100) / 1000), "a chunk's cost per step"
        else:
            assert durations == [pytest.approx((10 + 2 * 1 + 0.5 * 1000) / 1000)], "the whole prompt at once"
        _run_to_end(s)
        assert short.output_ids == SIM.continuation([5] * 4, 40) and long.output_ids == SIM.continuation([6] * 1000, 3)


def test_preempted_sequences_resume_exactly_where_they_were() -> None:
    s = SimScheduler(_config(kv_capacity_tokens=64, max_model_len=64, kv_block_size=16))
    prompts = [[20] * 24, [21] * 24]
    reqs = [s.new_request(f"r{i}", p, SamplingSpec(max_tokens=30), now=0.0) for i, p in enumerate(prompts)]
    for r in reqs:
        s.add(r)
    _run_to_end(s)
    assert s.stats.preemptions >= 1
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output_ids == SIM.continuation(p, 30) and r.finish_reason == "length"


def test_min_tokens_masks_stop_token_ids_too() -> None:
    prompt = encode("mask")
    masked = frozenset(SIM.continuation(prompt, 3))
    s = SimScheduler(_config())
    req = s.new_request("r", prompt, SamplingSpec(max_tokens=20, stop_token_ids=masked, min_tokens=6), now=0.0)
    s.add(req)
    _run_to_end(s)
    assert len(req.output_ids) >= 6 and not masked & set(req.output_ids[:6])
    assert req.finish_reason == "length" or req.output_ids[-1] in masked


def test_slowdown_multiplies_step_time() -> None:
    normal = SimScheduler(_config())
    slow = SimScheduler(_config(), faults=Faults(slowdown=3.0))
    for s in (normal, slow):
        s.add(s.new_request("r", [5] * 8, SamplingSpec(max_tokens=3), now=0.0))
    a, b = normal.schedule(0.0), slow.schedule(0.0)
    assert a is not None and b is not None and b.duration == pytest.approx(3 * a.duration)


def test_reset_after_tokens_cuts_a_sequence_at_its_kth_token_and_frees_it() -> None:
    faults = Faults(reset_after_tokens=3)
    s = SimScheduler(_config(), faults=faults)
    long = s.new_request("long", encode("a"), SamplingSpec(max_tokens=10), now=0.0)
    short = s.new_request("short", encode("b"), SamplingSpec(max_tokens=2), now=0.0)
    for r in (long, short):
        s.add(r)
    _run_to_end(s)
    assert long.output_ids == SIM.continuation(encode("a"), 3)
    assert (long.finish_reason, long.cut_at) == ("abort", 3)
    assert (short.finish_reason, short.cut_at) == ("length", None)  # ended on its own before k
    assert s.free_blocks == s.total_blocks and s.stats.finished["abort"] == 1

    # Switched on when a sequence is already past k: cut at its next step, without a further token.
    faults.reset_after_tokens = None
    late = s.new_request("late", encode("c"), SamplingSpec(max_tokens=10), now=0.0)
    s.add(late)
    for _ in range(5):
        step = s.schedule(0.0)
        assert step is not None
        s.complete(step, 0.0)
    faults.reset_after_tokens = 3
    _run_to_end(s)
    assert (late.output_ids, late.cut_at) == (SIM.continuation(encode("c"), 5), 5)


def test_scheduler_refuses_a_kv_cache_smaller_than_one_sequence() -> None:
    from fleetward.fleet.errors import ConfigError

    with pytest.raises(ConfigError, match="kv_capacity_tokens"):
        SimScheduler(SimConfig(kv_capacity_tokens=64, max_model_len=128))


# -- the engine in (manual) time ------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def running(engine: SimEngine) -> AsyncIterator[SimEngine]:
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(engine.run())
        try:
            yield engine
        finally:
            task.cancel()


async def test_ttft_includes_the_prefill_step_and_then_tokens_come_every_decode_step() -> None:
    clock = ManualClock()
    async with running(SimEngine(_config(), clock=clock)) as engine:
        req = engine.submit([7] * 100, SamplingSpec(max_tokens=3))
        await eventually(lambda: clock.sleepers == 1)
        clock.advance(0.0605)  # the prefill step takes (10 + 1 + 0.5 * 100) ms = 61 ms
        assert req.output_ids == [] and clock.sleepers == 1
        clock.advance(0.001)
        await eventually(lambda: len(req.output_ids) == 1)
        assert req.first_token_at is not None and 0.0605 < req.first_token_at - req.arrival <= 0.0615
        await eventually(lambda: clock.sleepers == 1)
        # A decode step takes (10 + 1) ms, counted from where the prefill step was due to end (61 ms).
        clock.advance(0.0715 - clock.monotonic())
        assert len(req.output_ids) == 1 and clock.sleepers == 1
        clock.advance(0.001)
        await eventually(lambda: len(req.output_ids) == 2)
    assert req.output_ids == SIM.continuation([7] * 100, 2)


async def test_a_request_queued_behind_max_num_seqs_waits_for_the_slot_then_prefills() -> None:
    clock = ManualClock()
    config = _config(decode_ms_per_seq=0.0, prefill_ms_per_token=0.0, max_num_seqs=1)
    async with running(SimEngine(config, clock=clock)) as engine:
        a = engine.submit([7] * 4, SamplingSpec(max_tokens=2))
        b = engine.submit([8] * 4, SamplingSpec(max_tokens=1))
        for _ in range(3):  # every step takes 10 ms: a's prefill, a's decode, then b's prefill
            await eventually(lambda: clock.sleepers == 1)
            assert engine.state()["running"] == 1
            assert engine.state()["waiting"] == (0 if a.is_finished else 1)
            clock.advance(0.0101)
        await b.wait_finished()
    assert a.first_token_at is not None and b.first_token_at is not None
    assert 0.010 <= a.first_token_at - a.arrival < 0.011
    assert 0.030 <= b.first_token_at - b.arrival < 0.031


async def test_slowdown_switch_stretches_steps_in_time() -> None:
    clock = ManualClock()
    async with running(SimEngine(_config(prefill_ms_per_token=0.0), clock=clock)) as engine:
        engine.update_faults(Faults(slowdown=3.0))
        req = engine.submit([7] * 4, SamplingSpec(max_tokens=1))
        await eventually(lambda: clock.sleepers == 1)
        clock.advance(0.011 * 3 - 0.001)  # one step is 11 ms, three times slower
        assert req.output_ids == []
        clock.advance(0.002)
        await req.wait_finished()


async def test_crash_budget_emits_exactly_k_tokens_and_crashes_once_consumers_passed_them_on() -> None:
    clock = ManualClock()
    delivered: list[int] = []
    crashes: list[int] = []
    engine = SimEngine(_config(decode_ms_per_seq=0.0, prefill_ms_per_token=0.0), clock=clock,
                       faults=Faults(crash_after_tokens=5), crash=lambda: crashes.append(len(delivered)))
    gate = asyncio.Event()

    async def consume(req: SimRequest, *, holds_first_chunk: bool) -> None:
        try:
            while True:
                delta = await req.next_output()
                delivered.extend(delta.token_ids)
                if holds_first_chunk:  # still "sending" its first chunk: it has not passed the rest on
                    holds_first_chunk = False
                    await gate.wait()
        finally:
            engine.release(req)

    async with running(engine), asyncio.TaskGroup() as tg:
        a = engine.submit(encode("a"), SamplingSpec(max_tokens=100))
        b = engine.submit(encode("b"), SamplingSpec(max_tokens=100))
        consumers = [tg.create_task(consume(a, holds_first_chunk=False)),
                     tg.create_task(consume(b, holds_first_chunk=True))]
        await pump(clock, lambda: engine.faults.crash_after_tokens != 5)
        assert engine.faults.to_json()["crash_after_tokens"] == 3  # one step, two tokens: it counts down
        await pump(clock, lambda: engine.faults.crash_after_tokens == 0)
        # The step that spent the budget had one token left: the first sequence of the batch got it.
        assert (len(a.output_ids), len(b.output_ids)) == (3, 2)
        await eventually(lambda: a.is_parked)
        assert crashes == [] and clock.sleepers == 0  # b's consumer still holds tokens; no step is planned
        gate.set()
        await eventually(lambda: crashes != [])
        assert crashes == [5] and engine.stats.generation_tokens == 5

        engine.update_faults(Faults())  # cleared (only an in-process crash returns): the engine goes on
        await pump(clock, lambda: len(a.output_ids) > 3)
        assert crashes == [5]
        for task in consumers:
            task.cancel()
    assert a.output_ids == SIM.continuation(encode("a"), len(a.output_ids))


# -- faults ---------------------------------------------------------------------------------------------------


async def test_admin_endpoints_need_the_bearer_token() -> None:
    async with asgi() as (c, _):
        assert (await c.get("/admin/faults")).status_code == 401
        assert (await c.post("/admin/faults", json={"hang": True})).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert (await c.get("/admin/faults", headers=wrong)).status_code == 403
        assert (await c.post("/admin/faults", json={"hang": True}, headers=wrong)).status_code == 403
        assert (await c.get("/admin/state", headers={"Authorization": f"Basic {TOKEN}"})).status_code == 403
        r = await c.get("/admin/faults", headers=AUTH)
        assert r.json() == {"hang": False, "slowdown": 1.0, "error_rate": 0.0, "wrong_tokens": {"probability": 0.0},
                            "wrong_tokens_after": None, "crash_after_tokens": None, "reset_after_tokens": None,
                            "kv": []}
        r = await c.post("/admin/faults", json={"slowdown": 3.0, "wrong_tokens_after": 4}, headers=AUTH)
        assert r.json()["slowdown"] == 3.0 and r.json()["wrong_tokens_after"] == 4
        assert (await c.post("/admin/faults", json={"slowdown": 0}, headers=AUTH)).status_code == 400
        # KV fault switches (fleetward.sim.kvfaults): a bad rule is refused naming its field, and changes nothing.
        for bad, field in [({"add": {"id": "a", "kind": "melt"}}, "kv.add.kind"),
                           ({"add": {"id": "a", "kind": "delay", "delay_ms": -1}}, "kv.add.delay_ms"),
                           ({"add": {"kind": "drop"}}, "kv.add.id"), ({"remove": 3}, "kv.remove"), ("x", "kv:")]:
            r = await c.post("/admin/faults", json={"kv": bad, "slowdown": 2.0}, headers=AUTH)
            assert r.status_code == 400 and field in r.json()["error"], (bad, r.text)
        assert (await c.get("/admin/faults", headers=AUTH)).json()["slowdown"] == 3.0
        r = await c.post("/admin/faults", json={"kv": {"add": {"id": "a", "kind": "truncate", "keep": 0.25}}},
                         headers=AUTH)
        assert r.json()["kv"] == [{"id": "a", "kind": "truncate", "keep": 0.25, "hits": 0}]
        assert (await c.post("/admin/faults", json={"clear": True}, headers=AUTH)).json()["kv"] == []
        assert (await c.post("/admin/faults", json={"explode": True}, headers=AUTH)).status_code == 400
        r = await c.post("/admin/faults", json={"clear": True}, headers=AUTH)
        assert r.json()["slowdown"] == 1.0 and r.json()["wrong_tokens_after"] is None
        state = (await c.get("/admin/state", headers=AUTH)).json()
        assert state["running"] == 0 and state["model"] == MODEL


async def test_error_rate_fails_new_requests_like_a_dead_engine_core() -> None:
    dead = {"error": {"message": ENGINE_DEAD_MESSAGE, "type": "InternalServerError", "param": None, "code": 500}}
    async with asgi() as (c, _):
        await c.post("/admin/faults", json={"error_rate": 1.0}, headers=AUTH)
        for body in ({"prompt": "x", "max_tokens": 2}, {"prompt": "x", "max_tokens": 2, "stream": True}):
            r = await c.post("/v1/completions", json=body)
            assert (r.status_code, r.json()) == (500, dead)
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert (r.status_code, r.json()) == (500, dead)
        assert (await c.get("/health")).status_code == 200
        await c.post("/admin/faults", json={"error_rate": 0.0}, headers=AUTH)
        assert (await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})).status_code == 200


async def test_fault_switches_can_be_preset_at_start() -> None:
    async with asgi(faults=Faults(error_rate=1.0, slowdown=2.0)) as (c, worker):
        assert (await c.post("/v1/completions", json={"prompt": "x"})).status_code == 500
        assert (await c.get("/admin/faults", headers=AUTH)).json()["slowdown"] == 2.0
    assert worker.engine.faults.error_rate == 1.0


async def test_crash_after_tokens_counts_down_in_admin_faults_and_clear_disarms_it() -> None:
    async with asgi(faults=Faults(crash_after_tokens=10)) as (c, worker):
        assert (await c.get("/admin/faults", headers=AUTH)).json()["crash_after_tokens"] == 10
        await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
        assert (await c.get("/admin/faults", headers=AUTH)).json()["crash_after_tokens"] == 6
        r = await c.post("/admin/faults", json={"crash_after_tokens": 20, "reset_after_tokens": 30}, headers=AUTH)
        assert (r.json()["crash_after_tokens"], r.json()["reset_after_tokens"]) == (20, 30)
        for bad in ({"crash_after_tokens": -1}, {"reset_after_tokens": True}, {"reset_inflight": 1}):
            assert (await c.post("/admin/faults", json=bad, headers=AUTH)).status_code == 400
        r = await c.post("/admin/faults", json={"clear": True}, headers=AUTH)
        assert (r.json()["crash_after_tokens"], r.json()["reset_after_tokens"]) == (None, None)
        await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 30})
    assert worker.engine.faults.crash_after_tokens is None


async def test_wrong_tokens_differ_from_the_model() -> None:
    prompt = encode("corrupt me")
    async with asgi() as (c, _):
        async def generate() -> list[int]:
            r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "return_token_ids": True})
            return list(r.json()["choices"][0]["token_ids"])

        await c.post("/admin/faults", json={"wrong_tokens_after": 4}, headers=AUTH)
        after = await generate()
        await c.post("/admin/faults", json={"clear": True, "wrong_tokens": {"probability": 1.0}}, headers=AUTH)
        always = await generate()
        await c.post("/admin/faults", json={"clear": True}, headers=AUTH)
        assert await generate() == SIM.continuation(prompt, 12)

    def wrong_positions(ids: list[int]) -> list[int]:
        # What the model says after each emitted prefix (the corrupted token is what it conditions on).
        return [i for i in range(len(ids)) if SIM.continuation(prompt + ids[:i], 1) != [ids[i]]]

    assert after[:4] == SIM.continuation(prompt, 4)
    assert wrong_positions(after) == list(range(4, 12))
    assert wrong_positions(always) == list(range(12))


async def test_fail_inflight_sends_the_error_in_band_then_done() -> None:
    slow = SimConfig(**{**FAST.model_dump(), "decode_step_ms": 5.0})
    async with serve(slow) as (url, worker), httpx.AsyncClient(base_url=url) as c:
        events: list[Any] = []
        async with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2000, "stream": True,
                                                              "return_token_ids": True}) as r:
            async for event in sse_lines(r):
                events.append(event)
                if len(events) == 1:
                    resp = await c.post("/admin/faults", json={"fail_inflight": True}, headers=AUTH)
                    assert resp.json()["failed_inflight"] == 1
        assert events[-2] == {"error": {"message": ENGINE_DEAD_MESSAGE, "type": "InternalServerError",
                                        "param": None, "code": 500}}
        assert events[-1] == "[DONE]"
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])
        metrics = (await c.get("/metrics")).text
    assert metric(metrics, "vllm:request_success_total", finished_reason="error") == 1
    assert worker.engine.state()["running"] == 0


async def test_hang_stalls_streams_and_queues_requests_while_health_stays_200() -> None:
    clock = ManualClock()
    config = SimConfig(decode_step_ms=10.0, decode_ms_per_seq=0.0, prefill_ms_per_token=0.0, model_name=MODEL)
    prompt_a, prompt_b = encode("hang a"), encode("hang b")
    async with serve(config, clock=clock) as (url, worker), httpx.AsyncClient(base_url=url) as c:
        engine = worker.engine
        got: dict[str, list[int]] = {"a": [], "b": []}
        done: set[str] = set()

        async def read(name: str, prompt: list[int]) -> None:
            async with c.stream("POST", "/v1/completions", json={
                    "prompt": prompt, "max_tokens": 8, "stream": True, "return_token_ids": True}) as r:
                async for event in sse_lines(r):
                    if isinstance(event, dict):
                        got[name] += event["choices"][0]["token_ids"]
            done.add(name)

        async def scrape() -> float:
            return metric((await c.get("/metrics")).text, "vllm:generation_tokens_total")

        async with asyncio.TaskGroup() as tg:
            tg.create_task(read("a", prompt_a))
            await pump(clock, lambda: engine.stats.generation_tokens >= 2)
            r = await c.post("/admin/faults", json={"hang": True}, headers=AUTH)
            assert r.json()["hang"] is True
            clock.advance(1.0)  # the step in progress would end now: a stopped engine does not end it
            await eventually(lambda: engine.is_stalled)
            emitted, steps = engine.stats.generation_tokens, engine.state()["steps"]
            await eventually(lambda: len(got["a"]) == emitted)
            frozen = await scrape()

            tg.create_task(read("b", prompt_b))  # a new request queues
            await eventually(lambda: engine.state()["waiting"] == 1)
            clock.advance(60.0)
            health = await c.get("/health")
            assert (health.status_code, health.content) == (200, b"")
            assert (engine.state()["steps"], len(got["a"]), got["b"]) == (steps, emitted, [])
            assert await scrape() == frozen

            await c.post("/admin/faults", json={"hang": False}, headers=AUTH)
            await pump(clock, lambda: done == {"a", "b"})
    assert got == {"a": SIM.continuation(prompt_a, 8), "b": SIM.continuation(prompt_b, 8)}


# -- bad input ---------------------------------------------------------------------------------------------------
#
# What vLLM 0.32 refuses, and how, is read off its source (vllm/entrypoints/openai/*/protocol.py, the exception
# handlers in vllm/entrypoints/serve/exception_handling/, renderers/params.py, sampling_params.py,
# v1/engine/input_processor.py); the expected messages below are the ones it answers, verbatim.


SMALL = SimConfig(**{**FAST.model_dump(), "max_model_len": 64})


def vllm_error(r: httpx.Response) -> dict[str, Any]:
    """The ``error`` of a vLLM-shaped error body, after checking the shape (keys in vLLM's order, code = status)."""
    body = r.json()
    assert list(body) == ["error"], body
    error = body["error"]
    assert list(error) == ["message", "type", "param", "code"]
    assert error["code"] == r.status_code
    return error


async def post(path: str, body: Any, config: SimConfig = SMALL) -> tuple[httpx.Response, SimWorker]:
    """``body`` posted to a fresh in-process worker (bytes as they are, anything else as JSON)."""
    async with asgi(config) as (c, worker):
        if isinstance(body, bytes):
            r = await c.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = await c.post(path, json=body)
    return r, worker


@pytest.mark.parametrize("path, body, status, err_type, param, message", [
    ("/v1/completions", b'{"prompt": ', 400, "Bad Request", "body.11", "JSON decode error"),
    ("/v1/completions", b"", 400, "Bad Request", "body", "'type': 'missing', 'loc': 'body'"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "NotFoundError", "model",
     f"The model `nope` does not exist. Valid aliases: {MODEL}."),
    ("/v1/chat/completions", {"model": "nope", "messages": []}, 404, "NotFoundError", "model",
     f"The model `nope` does not exist. Valid aliases: {MODEL}."),
    ("/v1/completions", {"prompt": [5, 400]}, 400, "BadRequestError", None, "Token id 400 is out of vocabulary"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "BadRequestError", "max_tokens",
     "max_tokens must be at least 1, got -1."),
    ("/v1/completions", {"max_tokens": 3}, 400, "BadRequestError", "prompt",
     "Either prompt or prompt_embeds must be provided and non-empty."),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "BadRequestError", "n", "n=2 is not supported"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "BadRequestError", "prompt", "one prompt per request"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "Bad Request", "body.messages", "Field required"),
])
async def test_bad_requests_get_vllm_like_errors(path: str, body: Any, status: int, err_type: str,
                                                 param: str | None, message: str) -> None:
    r, worker = await post(path, body)
    error = vllm_error(r)
    assert (r.status_code, error["type"], error["param"]) == (status, err_type, param)
    assert message in error["message"]
    assert worker.engine.stats.generation_tokens == 0


def _schema(*errors: str) -> str:
    """The message of vLLM's validation handler for these errors (each as ``str`` of the error dict)."""
    return f"{len(errors)} validation error{'s' if len(errors) > 1 else ''}:\n" + "\n".join(f"  {e}" for e in errors)


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"prompt": "x", "max_tokens": "five"}, "body.max_tokens", _schema(
        "{'type': 'int_parsing', 'loc': 'body.max_tokens', 'msg': 'Input should be a valid integer, unable to "
        "parse string as an integer', 'input': 'five'}")),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5.5}, "body.max_tokens", _schema(
        "{'type': 'int_from_float', 'loc': 'body.max_tokens', 'msg': 'Input should be a valid integer, got a "
        "number with a fractional part', 'input': '5.5'}")),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "body.temperature", _schema(
        "{'type': 'float_parsing', 'loc': 'body.temperature', 'msg': 'Input should be a valid number, unable to "
        "parse string as a number', 'input': 'hot'}")),
    ("/v1/completions", {"prompt": "x", "stream": "maybe"}, "body.stream", _schema(
        "{'type': 'bool_parsing', 'loc': 'body.stream', 'msg': 'Input should be a valid boolean, unable to "
        "interpret input', 'input': 'maybe'}")),
    ("/v1/completions", {"prompt": 5}, "body.prompt", _schema(
        "{'type': 'list_type', 'loc': 'body.prompt', 'msg': 'Input should be a valid list', 'input': '5'}",
        "{'type': 'list_type', 'loc': 'body.prompt', 'msg': 'Input should be a valid list', 'input': '5'}",
        "{'type': 'string_type', 'loc': 'body.prompt', 'msg': 'Input should be a valid string', 'input': '5'}",
        "{'type': 'list_type', 'loc': 'body.prompt', 'msg': 'Input should be a valid list', 'input': '5'}")),
    ("/v1/completions", {"prompt": "x", "user": 5, "min_tokens": None}, "body.user", _schema(
        "{'type': 'string_type', 'loc': 'body.user', 'msg': 'Input should be a valid string', 'input': '5'}",
        "{'type': 'int_type', 'loc': 'body.min_tokens', 'msg': 'Input should be a valid integer', 'input': 'None'}")),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "body.stop", _schema(
        "{'type': 'string_type', 'loc': 'body.stop', 'msg': 'Input should be a valid string', 'input': '<list of "
        "5 items>'}",
        "{'type': 'too_long', 'loc': 'body.stop', 'msg': 'List should have at most 4 items after validation, not "
        "5', 'input': '<list of 5 items>', 'ctx': {'field_type': 'List', 'max_length': 4, 'actual_length': 5}}")),
    ("/v1/chat/completions", {"messages": "hi"}, "body.messages", _schema(
        "{'type': 'list_type', 'loc': 'body.messages', 'msg': 'Input should be a valid list', 'input': 'hi'}")),
    ("/v1/completions", [1, 2], "body", _schema(
        "{'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be a valid dictionary or object "
        "to extract fields from', 'input': '<list of 2 items>'}")),
])
async def test_a_wrong_type_is_refused_with_the_validation_errors_vllm_lists(path: str, body: Any, param: str,
                                                                            message: str) -> None:
    r, worker = await post(path, body)
    error = vllm_error(r)
    assert (r.status_code, error["type"], error["param"], error["message"]) == (400, "Bad Request", param, message)
    assert worker.engine.stats.generation_tokens == 0


async def test_what_vllm_coerces_or_accepts_is_served_too() -> None:
    """vLLM's request models are lax: "5" is a max_tokens and "yes" a stream. Chat messages may have any role
    and no content (the tiny model's template renders them), and an assistant's content may be null."""
    async with asgi() as (c, _):
        r = await c.post("/v1/completions", json={"prompt": [40, 41], "max_tokens": "5", "ignore_eos": "yes"})
        assert (r.status_code, r.json()["usage"]["completion_tokens"]) == (200, 5)
        streamed = await c.post("/v1/completions", json={"prompt": [40, 41], "max_tokens": 2, "stream": "yes"})
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = sse(streamed.text)
        assert (events[-2]["choices"][0]["finish_reason"], events[-1]) == ("length", "[DONE]")
        chat = await c.post("/v1/chat/completions", json={"max_tokens": 3, "messages": [
            {"role": "wizard", "content": "hi"}, {"role": "user"}, {"role": "assistant", "content": None}]})
        assert chat.status_code == 200, chat.text


@pytest.mark.parametrize("messages, param, first", [
    ([{"role": "user", "content": None}], "body.messages.0.ChatCompletionDeveloperMessageParam.content",
     "{'type': 'string_type', 'loc': 'body.messages.0.ChatCompletionDeveloperMessageParam.content', 'msg': "
     "'Input should be a valid string', 'input': 'None'}"),
    ([{"role": "wizard", "content": 5}], "body.messages.0.ChatCompletionDeveloperMessageParam.content",
     "{'type': 'string_type', 'loc': 'body.messages.0.ChatCompletionDeveloperMessageParam.content', 'msg': "
     "'Input should be a valid string', 'input': '5'}"),
    ([{"content": "hi"}], "body.messages.0.ChatCompletionDeveloperMessageParam.role",
     "{'type': 'missing', 'loc': 'body.messages.0.ChatCompletionDeveloperMessageParam.role', 'msg': "
     "'Field required', 'input': '<dict of 1 items>'}"),
    ([{"role": 5, "content": "hi"}], "body.messages.0.ChatCompletionDeveloperMessageParam.role",
     "{'type': 'literal_error', 'loc': 'body.messages.0.ChatCompletionDeveloperMessageParam.role', 'msg': "
     "\"Input should be 'developer'\", 'input': '5', 'ctx': {'expected': \"'developer'\"}}"),
    ([{"role": "user", "content": "hi"}, "hi"], "body.messages.1.ChatCompletionDeveloperMessageParam",
     "{'type': 'dict_type', 'loc': 'body.messages.1.ChatCompletionDeveloperMessageParam', 'msg': "
     "'Input should be a valid dictionary', 'input': 'hi'}"),
])
async def test_a_malformed_chat_message_is_refused_naming_the_field_vllm_names(messages: list[Any], param: str,
                                                                              first: str) -> None:
    r, _ = await post("/v1/chat/completions", {"messages": messages})
    error = vllm_error(r)
    assert (r.status_code, error["type"], error["param"]) == (400, "Bad Request", param)
    assert error["message"].split("\n")[1] == f"  {first}"


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 65}, "max_tokens",
     "max_tokens=65 cannot be greater than max_model_len=64. Please request fewer output tokens. "
     "(parameter=max_tokens, value=65)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 65},
     "max_completion_tokens", "max_completion_tokens=65 cannot be greater than max_model_len=64. Please request "
     "fewer output tokens. (parameter=max_completion_tokens, value=65)"),
    ("/v1/completions", {"prompt": [5] * 66}, "input_tokens",
     "This model's maximum context length is 64 tokens. However, your prompt contains 66 input tokens, which "
     "exceeds this limit even without any output tokens. Please reduce the length of the input prompt. "
     "(parameter=input_tokens, value=66)"),
    # A text prompt is tokenized only up to one token past the context, so vLLM says "at least".
    ("/v1/completions", {"prompt": "x" * 100}, "input_tokens",
     "This model's maximum context length is 64 tokens. However, your prompt contains at least 65 input tokens, "
     "which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. "
     "(parameter=input_tokens, value=65)"),
    # ... and one over 5 characters a token (the tiny model's longest vocabulary entry, "<unk>") is not tokenized.
    ("/v1/completions", {"prompt": "x" * 321}, "input_text",
     "This model's maximum context length is 64 tokens. However, your prompt contains 321 characters (more than "
     "320 characters, which is the upper bound for 64 input tokens). Please reduce the length of the input "
     "prompt. (parameter=input_text, value=321)"),
    ("/v1/completions", {"prompt": [5] * 64}, "max_tokens",
     "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"),
])
async def test_a_request_over_the_context_is_refused_naming_the_numbers(path: str, body: dict[str, Any],
                                                                        param: str, message: str) -> None:
    r, _ = await post(path, body)
    error = vllm_error(r)
    assert (r.status_code, error["type"], error["param"], error["message"]) == (400, "BadRequestError", param,
                                                                                message)


async def test_max_tokens_is_clamped_to_the_context_left() -> None:
    # vLLM 0.32 refuses only a max_tokens over max_model_len itself; prompt + max_tokens over the context is
    # clamped (vllm/entrypoints/serve/utils/api_utils.py get_max_tokens).
    async with asgi(SMALL) as (c, _):
        r = await c.post("/v1/completions", json={"prompt": [5] * 60, "max_tokens": 10})
    assert (r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["finish_reason"]) == (4, "length")


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"prompt": ""}, "prompt",
     "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)"),
    # vLLM checks the raw body before its schema, so this is what it says about a bad max_tokens too.
    ("/v1/completions", {"prompt": "", "max_tokens": "five"}, "prompt",
     "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options",
     "Stream options can only be defined when `stream=True`. (parameter=stream_options)"),
    ("/v1/chat/completions", {"messages": [], "continue_final_message": True, "add_generation_prompt": True}, None,
     "Cannot set both `continue_final_message` and `add_generation_prompt` to True."),
    ("/v1/completions", {"prompt": "x", "cache_salt": ""}, "cache_salt",
     "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)"),
    ("/v1/completions", {"prompt": "x", "logprobs": "many"}, "logprobs",
     "`logprobs` must be an integer. (parameter=logprobs, value=many)"),
])
async def test_what_vllm_checks_before_its_schema_is_a_bad_request_error_naming_the_parameter(
        path: str, body: dict[str, Any], param: str | None, message: str) -> None:
    r, _ = await post(path, body)
    error = vllm_error(r)
    assert (r.status_code, error["type"], error["param"], error["message"]) == (400, "BadRequestError", param,
                                                                                message)


@pytest.mark.parametrize("body, param, message", [
    ({"n": 0}, None, "n must be at least 1, got 0."),
    ({"presence_penalty": 3}, None, "presence_penalty must be in [-2, 2], got 3.0."),
    ({"repetition_penalty": 0}, None, "repetition_penalty must be greater than zero, got 0.0."),
    ({"temperature": -1}, "temperature", "temperature must be non-negative, got -1.0. (parameter=temperature, "
     "value=-1.0)"),
    ({"temperature": 2.5}, "temperature", "temperature must be in [0, 2], got 2.5. (parameter=temperature, "
     "value=2.5)"),
    ({"top_p": 0}, "top_p", "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)"),
    ({"top_k": -2}, None, "top_k must be 0 (disable), or at least 1, got -2."),
    ({"min_p": 1.5}, None, "min_p must be in [0, 1], got 1.5."),
    ({"min_tokens": -1}, None, "min_tokens must be greater than or equal to 0, got -1."),
    ({"min_tokens": 9, "max_tokens": 8}, None, "min_tokens must be less than or equal to max_tokens=8, got 9."),
    ({"stop": ["a", ""]}, None, "stop cannot contain an empty string."),
    ({"bad_words": [""]}, None, "bad_words cannot contain an empty string. Got bad_words=['']"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "logit_bias contains key(s) that cannot be converted to integer "
     "token IDs: ['x'] (parameter=logit_bias, value=['x'])"),
])
async def test_sampling_parameters_out_of_range_are_refused_as_vllm_refuses_them(
        body: dict[str, Any], param: str | None, message: str) -> None:
    r, _ = await post("/v1/completions", {"prompt": "x", **body})
    error = vllm_error(r)
    assert (r.status_code, error["type"], error["param"], error["message"]) == (400, "BadRequestError", param,
                                                                                message)


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": "x", "suffix": "y"}, "suffix", "suffix is only supported for models with FIM completion rendering"),
    ({"prompt": [40], "suffix": "y"}, "suffix", "suffix requires text prompt input for FIM completion rendering"),
    ({"prompt": "x", "stop_token_ids": [2, 300]}, "stop_token_ids", "token_id(s) [300] in stop_token_ids contain "
     "out-of-vocab token ids. Vocabulary size: 259 (parameter=stop_token_ids, value=[300])"),
    ({"prompt": "x", "logit_bias": {"-1": 5}}, "logit_bias", "token_id(s) [-1] in logit_bias contain out-of-vocab "
     "token ids. Vocabulary size: 259 (parameter=logit_bias, value=[-1])"),
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids",
     "allowed_token_ids is not None and empty! (parameter=allowed_token_ids, value=[])"),
    ({"prompt": [""]}, None, "The decoder prompt cannot be empty"),
    ({"prompt": [[]]}, None, "The decoder prompt cannot be empty"),
])
async def test_what_the_model_cannot_take_is_refused_as_vllm_refuses_it_for_the_tiny_model(
        body: dict[str, Any], param: str | None, message: str) -> None:
    r, _ = await post("/v1/completions", body)
    error = vllm_error(r)
    assert (r.status_code, error["type"], error["param"], error["message"]) == (400, "BadRequestError", param,
                                                                                message)


async def test_unknown_routes_and_methods_answer_as_vllm_does_with_fastapis_detail() -> None:
    # vLLM registers its HTTPException handler for FastAPI's subclass, so the 404 and 405 of Starlette's routing
    # (Starlette's class) keep FastAPI's default body. The sim matches that, not the OpenAI error shape.
    async with asgi() as (c, _):
        missing = await c.post("/v1/nope", json={})
        wrong = await c.get("/v1/completions")
    assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
    assert (wrong.status_code, wrong.json(), wrong.headers["allow"]) == (405, {"detail": "Method Not Allowed"},
                                                                          "POST")


# -- metrics ---------------------------------------------------------------------------------------------------


async def test_metrics_use_vllm_names_and_labels_and_count_tokens() -> None:
    async with asgi() as (c, _):
        await c.post("/v1/completions", json={"prompt": [40, 41, 42], "max_tokens": 5})
        r = await c.get("/metrics")
    text = r.text
    labels = {"engine": "0", "model_name": MODEL}
    assert metric(text, "vllm:generation_tokens_total", **labels) == 5
    assert metric(text, "vllm:prompt_tokens_total", **labels) == 3
    assert metric(text, "vllm:request_success_total", finished_reason="length", **labels) == 1
    assert metric(text, "vllm:request_success_total", finished_reason="abort", **labels) == 0
    assert metric(text, "vllm:num_requests_running", **labels) == 0
    assert metric(text, "vllm:num_requests_waiting", **labels) == 0
    assert metric(text, "vllm:kv_cache_usage_perc", **labels) == 0
    assert metric(text, "vllm:time_to_first_token_seconds_count", **labels) == 1
    assert metric(text, "vllm:inter_token_latency_seconds_count", **labels) == 4
    assert metric(text, "vllm:e2e_request_latency_seconds_count", **labels) == 1
    assert metric(text, "vllm:request_queue_time_seconds_count", **labels) == 1


# -- disconnects -------------------------------------------------------------------------------------------------


async def test_client_disconnect_mid_stream_aborts_the_engine_request() -> None:
    slow = SimConfig(**{**FAST.model_dump(), "decode_step_ms": 5.0})
    async with serve(slow) as (url, worker), httpx.AsyncClient(base_url=url) as c:
        engine = worker.engine
        async with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 4000,
                                                              "stream": True}) as r:
            async for _ in sse_lines(r):
                break
            assert engine.state()["running"] == 1
        await eventually(lambda: engine.state()["running"] == 0)
        assert engine.state()["waiting"] == 0 and engine.state()["kv_blocks_used"] == 0
        assert engine.stats.finished["abort"] == 1


async def test_client_disconnect_aborts_a_non_stream_request() -> None:
    slow = SimConfig(**{**FAST.model_dump(), "decode_step_ms": 5.0})
    async with serve(slow) as (url, worker), httpx.AsyncClient(base_url=url) as c:
        engine = worker.engine
        async with asyncio.TaskGroup() as tg:
            call = tg.create_task(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 4000}))
            await eventually(lambda: engine.stats.generation_tokens > 0)
            call.cancel()
        await eventually(lambda: engine.state()["running"] == 0)
        assert engine.stats.finished["abort"] == 1


# -- the official client -------------------------------------------------------------------------------------------


async def test_the_openai_client_streams_completions_and_chat() -> None:
    async with serve() as (url, _):
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        try:
            text, finish = "", None
            stream = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, stream=True)
            async for chunk in stream:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            assert (text, finish) == (decode(SIM.continuation(encode("Hello"), 6)), "length")

            messages = [{"role": "user", "content": "hi"}]
            content, usage = "", None
            chat = await client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                        max_tokens=5, stream=True,
                                                        stream_options={"include_usage": True})
            async for chunk in chat:
                if chunk.choices:
                    content += chunk.choices[0].delta.content or ""
                usage = chunk.usage or usage
            prompt = encode(render_chat(messages))
            assert content == decode(SIM.continuation(prompt, 5))
            assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), 5)

            plain = await client.completions.create(model=MODEL, prompt=[40, 41], max_tokens=3)
            assert plain.choices[0].text == decode(SIM.continuation([40, 41], 3))
            models = await client.models.list()
            assert [m.id for m in models.data] == [MODEL]
        finally:
            await client.close()


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
                async for _ in sse_lines(r):
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
            async for event in sse_lines(r):
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
