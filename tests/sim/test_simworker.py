"""The simulated worker over HTTP: vLLM's wire format, the deterministic model, faults, metrics, disconnects,
the official client.

The app runs in-process: ``httpx.ASGITransport`` where a buffered response is enough, and uvicorn on a free
port in the test's own event loop where a test must act mid-stream (hang, disconnect, the ``openai``
client); timing-dependent tests give the engine a :class:`ManualClock` and jump it. The scheduler alone is
tests/sim/test_scheduler.py, bad input test_bad_input.py, the real process test_worker_process.py.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam
from testkit import (
    AUTH,
    TOKEN,
    asgi,
    eventually,
    instant_sim,
    metric,
    pump,
    serve,
    sse,
    sse_events,
    tokens_of,
    vllm_error,
)

from fleetward.fleet.clock import ManualClock
from fleetward.fleet.config import SimConfig
from fleetward.fleet.vocab import builtin_json, load_vocabulary
from fleetward.sim.engine import (
    ENGINE_DEAD_MESSAGE,
    Faults,
)
from fleetward.sim.model import SimModel, sim_model
from fleetward.sim.tokenizer import EOS_ID, decode, encode, render_chat

DATA = Path(__file__).parents[1] / "data" / "vllm-0.32"
MODEL = "sim-test"
FAST = instant_sim(model_name=MODEL)
SIM = SimModel(FAST.seed, FAST.eos_probability)



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
    async with asgi(FAST) as (c, _):
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
    async with asgi(FAST) as (c, _):
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
    async with asgi(FAST) as (c, worker):
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                       "max_tokens": 2, "stream": True})
    events = sse(r.text)
    assert [list(e) for e in events[1:-1]] == [["id", "object", "created", "model", "choices"],
                                               ["id", "object", "created", "model", "choices",
                                                "system_fingerprint"]]
    assert events[-2]["system_fingerprint"] == worker.system_fingerprint
    assert events[0]["prompt_token_ids"] is None and events[1]["choices"][0]["token_ids"] is None


async def test_non_stream_responses_match_vllm_field_by_field() -> None:
    async with asgi(FAST) as (c, _):
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


async def test_a_list_of_prompts_is_answered_whole_with_a_choice_per_prompt_as_vllm_answers_it() -> None:
    """LangChain's completions LLM and lm-eval-harness send several prompts in one request: one choice each,
    in order, each what that prompt alone gets, and the usage of them all (tests/data: real vLLM's answer).
    Streamed, the same choices (tests/sim/test_logprobs.py compares the stream with vLLM's)."""
    prompts = ["Hello", "A second one", "A third"]
    async with asgi(FAST) as (c, _):
        batch = (await c.post("/v1/completions", json={
            "model": MODEL, "prompt": prompts, "max_tokens": 4, "return_token_ids": True})).json()
        alone = [(await c.post("/v1/completions", json={
            "model": MODEL, "prompt": p, "max_tokens": 4, "return_token_ids": True})).json() for p in prompts]
        of_ids = (await c.post("/v1/completions", json={"model": MODEL, "prompt": [[72, 105], [1, 2, 3]],
                                                          "max_tokens": 2})).json()
        mixed = await c.post("/v1/completions", json={"model": MODEL, "prompt": ["Hello", [72, 105]]})
        streamed = await c.post("/v1/completions", json={"model": MODEL, "prompt": prompts, "max_tokens": 4,
                                                           "stream": True})
    assert [ch["text"] for ch in of_ids["choices"]] == [decode(SIM.continuation(p, 2)) for p in ([72, 105], [1, 2, 3])]
    assert mixed.status_code == 400, "vLLM's schema takes strings or lists of ids, not both"
    recorded = json.loads((DATA / "completion_batch.json").read_text())
    assert_same_shape(batch, {**recorded, "choices": recorded["choices"][:1] * 3})
    assert [ch["index"] for ch in batch["choices"]] == [0, 1, 2]
    for choice, one in zip(batch["choices"], alone, strict=True):
        assert {**choice, "index": 0} == one["choices"][0]
    used = [a["usage"] for a in alone]
    assert batch["usage"]["prompt_tokens"] == sum(u["prompt_tokens"] for u in used)
    assert batch["usage"]["completion_tokens"] == sum(u["completion_tokens"] for u in used)
    assert batch["usage"]["total_tokens"] == sum(u["total_tokens"] for u in used)
    assert streamed.status_code == 200
    got: dict[int, str] = {}
    for event in sse(streamed.text)[:-1]:
        for choice in event["choices"]:
            got[choice["index"]] = got.get(choice["index"], "") + choice["text"]
    assert [got[k] for k in range(3)] == [ch["text"] for ch in batch["choices"]]


async def test_n_sampled_choices_are_answered_whole_each_its_own_and_the_same_on_every_asking() -> None:
    """``n`` > 1 (sampling; greedy is refused, as vLLM refuses it): one choice per sample, prompt by prompt
    (vLLM's order), different from each other, and the same again for the same request (a worker restarted
    or another one gives the same). Choice ``k`` of a seeded request is the request with seed ``seed + k``
    (vLLM's child requests); unseeded, choice 0 is the model's own continuation. Each prompt's tokens count
    once in the usage, every choice's output does."""
    body = {"model": MODEL, "prompt": ["Roll", "Out"], "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 9,
            "ignore_eos": True}
    async with asgi(FAST) as (c, _):
        first = (await c.post("/v1/completions", json=body)).json()
        again = (await c.post("/v1/completions", json=body)).json()
        singles = [(await c.post("/v1/completions", json={**body, "prompt": p, "n": 1, "seed": 9 + k})).json()
                   for p in ("Roll", "Out") for k in range(3)]
        unseeded = (await c.post("/v1/completions", json={**body, "seed": None})).json()
        chat = (await c.post("/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "user", "content": "rollout"}], "max_tokens": 5, "n": 4, "temperature": 0.7})).json()
    texts = [ch["text"] for ch in first["choices"]]
    assert [ch["index"] for ch in first["choices"]] == list(range(6))
    assert texts == [one["choices"][0]["text"] for one in singles]
    assert len(set(texts[:3])) == 3 and len(set(texts[3:])) == 3
    assert [ch["text"] for ch in again["choices"]] == texts
    plain = [ch["text"] for ch in unseeded["choices"]]
    assert plain[0] == decode(SIM.continuation(encode("Roll"), 8, ignore_eos=True))
    assert plain[3] == decode(SIM.continuation(encode("Out"), 8, ignore_eos=True))
    assert len(set(plain[:3])) == 3 and not set(plain) & set(texts)
    assert first["usage"]["prompt_tokens"] == len(encode("Roll")) + len(encode("Out"))
    assert first["usage"]["completion_tokens"] == 48
    assert len({ch["message"]["content"] for ch in chat["choices"]}) == 4


async def test_models_lists_the_served_model_with_max_model_len() -> None:
    async with asgi(FAST) as (c, _):
        r = await c.get("/v1/models")
        health = await c.get("/health")
    assert_same_shape(r.json(), json.loads((DATA / "models.json").read_text()))
    card = r.json()["data"][0]
    assert card["id"] == MODEL and card["max_model_len"] == FAST.max_model_len
    assert health.status_code == 200 and health.content == b""


# -- the deterministic model -------------------------------------------------------------------------------


async def test_same_request_twice_gives_the_same_tokens_and_any_prefix_continues_exactly() -> None:
    prompt = encode("The quick brown fox")
    async with asgi(FAST) as (c, _):
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
    expected: list[int] = []
    state = model.state(prompt)
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
    async with asgi(FAST) as (c, _):
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


# -- faults ---------------------------------------------------------------------------------------------------


async def test_admin_endpoints_need_the_bearer_token() -> None:
    async with asgi(FAST) as (c, _):
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
    async with asgi(FAST) as (c, _):
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
    async with asgi(FAST, faults=Faults(error_rate=1.0, slowdown=2.0)) as (c, worker):
        assert (await c.post("/v1/completions", json={"prompt": "x"})).status_code == 500
        assert (await c.get("/admin/faults", headers=AUTH)).json()["slowdown"] == 2.0
    assert worker.engine.faults.error_rate == 1.0


async def test_crash_after_tokens_counts_down_in_admin_faults_and_clear_disarms_it() -> None:
    async with asgi(FAST, faults=Faults(crash_after_tokens=10)) as (c, worker):
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
    async with asgi(FAST) as (c, _):
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
            async for event in sse_events(r):
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
                async for event in sse_events(r):
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


# -- metrics ---------------------------------------------------------------------------------------------------


async def test_metrics_use_vllm_names_and_labels_and_count_tokens() -> None:
    async with asgi(FAST) as (c, _):
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
            async for _ in sse_events(r):
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
    async with serve(FAST) as (url, _):
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        try:
            text, finish = "", None
            stream = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, stream=True)
            async for chunk in stream:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            assert (text, finish) == (decode(SIM.continuation(encode("Hello"), 6)), "length")

            messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
            content, usage = "", None
            chat = await client.chat.completions.create(model=MODEL, messages=messages,
                                                        max_tokens=5, stream=True,
                                                        stream_options={"include_usage": True})
            async for delta in chat:
                if delta.choices:
                    content += delta.choices[0].delta.content or ""
                usage = delta.usage or usage
            prompt = encode(render_chat(messages))
            assert content == decode(SIM.continuation(prompt, 5))
            assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), 5)

            plain = await client.completions.create(model=MODEL, prompt=[40, 41], max_tokens=3)
            assert plain.choices[0].text == decode(SIM.continuation([40, 41], 3))
            models = await client.models.list()
            assert [m.id for m in models.data] == [MODEL]
        finally:
            await client.close()
