"""The router as a drop-in front door for vLLM: what a client reads equals what a worker would send, on every
endpoint vLLM serves, and a worker that fails before the client has a byte is passed over.

One fleet for the module: two simulated workers (they speak vLLM 0.32's API byte for byte, tests/data) behind a
router process, with the Responses API store on so that stored responses can be looked for.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import pytest_asyncio
from testkit import PATIENT_SUPERVISOR, routed_fleet

from fleetward.chaos.harness import TestFleet
from fleetward.chaos.workload import sse_lines
from fleetward.fleet.config import SimConfig
from fleetward.migration.journal import Kind, whole_reason

pytestmark = pytest.mark.asyncio(loop_scope="module")

SIM = SimConfig(decode_step_ms=4.0, decode_ms_per_seq=0.05, prefill_ms_per_token=0.01, seed=11, responses_store=True)
JSON = {"content-type": "application/json"}
EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "resume_stream.py"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(etcd_endpoint: str, broker_endpoint: str,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TestFleet]:
    async with routed_fleet(etcd_endpoint, broker_endpoint, tmp_path_factory.mktemp("dropin-fleet"), "dropin-tests",
                            SIM, workers=2, router="dropin-r0", supervisor=PATIENT_SUPERVISOR) as f:
        yield f


def router_url(fleet: TestFleet) -> str:
    return fleet.routers[0].url


async def exchange(client: httpx.AsyncClient, url: str, method: str, path: str, **kw: Any) -> tuple[int, bytes]:
    r = await client.request(method, url + path, **kw)
    return r.status_code, await r.aread()


STREAMS = [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 12, "stream": True}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 12, "stream": True, "return_token_ids": True,
                         "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ("/v1/completions", {"prompt": "stop strings", "max_tokens": 60, "stream": True, "stop": [" t", "qq"]}),
    ("/v1/completions", {"prompt": "stop strings", "max_tokens": 60, "stream": True, "stop": [" t", "qq"],
                         "include_stop_str_in_output": True, "return_token_ids": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 9, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 9, "stream": True,
                              "return_token_ids": True, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "I"}],
                              "add_generation_prompt": False, "max_tokens": 5, "stream": True,
                              "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 12}),
    ("/v1/completions", {"prompt": [75, 104, 111], "max_tokens": 12, "return_token_ids": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 9,
                              "return_token_ids": True}),
    # several choices, answered whole: one journaled request per choice (migration/fanout.py)
    ("/v1/completions", {"prompt": ["Hello", "World", "again"], "max_tokens": 8, "return_token_ids": True}),
    ("/v1/completions", {"prompt": ["Roll", "Out"], "max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "n": 2,
                              "temperature": 0.9, "seed": 8, "return_token_ids": True}),
    # logprobs and echo (the sim answers them as vLLM does: tests/sim/test_logprobs.py)
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 10, "logprobs": 3, "stream": True}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 10, "logprobs": 2}),
    ("/v1/completions", {"prompt": [[72, 105, 33], [72, 111]], "max_tokens": 1, "logprobs": 1, "echo": True,
                         "seed": 1234}),  # lm-eval-harness's loglikelihood request
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "prompt_logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "logprobs": True,
                              "top_logprobs": 2, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "logprobs": True,
                              "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "I"}],
                              "add_generation_prompt": False, "echo": True, "max_tokens": 5, "stream": True}),
]


@pytest.mark.parametrize(("path", "body"), STREAMS,
                         ids=[f"{'chat' if 'chat' in p else 'completion'}-{i}" for i, (p, _) in enumerate(STREAMS)])
async def test_the_router_answers_byte_for_byte_as_the_worker_does(healthy: TestFleet, path: str,
                                                                   body: dict[str, Any], same_answer: Any) -> None:
    """The same greedy request to a worker and through the router: the same bytes but for ids and times (no
    ``id:`` lines, no comments: a client that reads each line as ``data: <JSON>`` reads it)."""
    request = {"model": "sim-tiny", "temperature": 0, "ignore_eos": True, **body}
    async with httpx.AsyncClient(timeout=30) as client:
        direct = await exchange(client, healthy.url(healthy.worker_ids[0]), "POST", path, json=request)
        routed = await exchange(client, router_url(healthy), "POST", path, json=request)
    assert direct[0] == routed[0] == 200
    same_answer(routed[1], direct[1])
    if body.get("stream"):
        assert all(line.startswith(b"data: ") for line in routed[1].split(b"\n") if line), routed[1][:300]


async def test_sse_ids_come_when_a_client_asks_or_the_fleet_says_so(healthy: TestFleet, same_answer: Any) -> None:
    body = {"model": "sim-tiny", "prompt": "with ids", "max_tokens": 6, "stream": True, "ignore_eos": True,
            "return_token_ids": True}
    async with httpx.AsyncClient(timeout=30) as client:
        plain = await client.post(router_url(healthy) + "/v1/completions", json=body)
        asked = await client.post(router_url(healthy) + "/v1/completions", json=body,
                                  headers={"X-Fleetward-Event-Ids": "1"})
        always = await healthy.start_router("dropin-ids", event_ids=True)
        try:
            configured = await client.post(always.url + "/v1/completions", json=body)
        finally:
            await healthy.stop_router(always)
    assert b"\nid: " not in b"\n" + plain.content
    for r in (asked, configured):
        rid, held, events = r.headers["x-request-id"], 0, 0
        for block in filter(None, r.text.split("\n\n")):
            if block == "data: [DONE]":
                continue
            event_id, data = block.split("\n")
            held += len(json.loads(data.removeprefix("data: "))["choices"][0]["token_ids"])
            assert event_id == f"id: {rid}:{held}"  # the tokens the client holds once it has this event
            events += 1
        assert held == 6 and events >= 1
        same_answer(re.sub(rb"id: [^\n]*\n", b"", r.content), plain.content)


# -- every other endpoint ---------------------------------------------------------------------------------

ENDPOINTS: list[tuple[str, str, dict[str, Any]]] = [
    ("GET", "/version", {}),
    ("POST", "/tokenize", {"json": {"model": "sim-tiny", "prompt": "Hello world", "return_token_strs": True}}),
    ("POST", "/tokenize", {"json": {"messages": [{"role": "user", "content": "Hi"}]}}),
    ("POST", "/detokenize", {"json": {"tokens": [75, 104, 111, 111, 114]}}),
    ("POST", "/v1/embeddings", {"json": {"model": "sim-tiny", "input": ["Hello", "x y"]}}),
    ("POST", "/v1/embeddings", {"json": {"model": "sim-tiny", "input": "Hi", "encoding_format": "base64"}}),
    ("POST", "/pooling", {"json": {"model": "sim-tiny", "input": "Hello"}}),
    ("POST", "/v1/score", {"json": {"model": "sim-tiny", "text_1": "Hello", "text_2": ["Hi", "world"]}}),
    ("POST", "/score", {"json": {"model": "sim-tiny", "text_1": "Hello", "text_2": "Hi"}}),
    ("POST", "/v1/rerank", {"json": {"model": "sim-tiny", "query": "Hello", "documents": ["Hi", "world", "x"],
                                     "top_n": 2}}),
    ("POST", "/rerank", {"json": {"query": "Hello", "documents": ["Hi", "world"]}}),
    ("POST", "/v2/rerank", {"json": {"model": "sim-tiny", "query": "Hello", "documents": ["Hi"]}}),
    ("POST", "/v1/responses", {"json": {"model": "sim-tiny", "input": "Hello", "max_output_tokens": 8,
                                        "temperature": 0, "store": False}}),
    ("POST", "/v1/responses", {"json": {"model": "sim-tiny", "input": [{"role": "user", "content": "Hi"}],
                                        "instructions": "Be brief", "max_output_tokens": 6, "stream": True,
                                        "store": False}}),
    ("POST", "/v1/audio/transcriptions", {"data": {"model": "sim-tiny"},
                                          "files": {"file": ("a.wav", b"RIFF" + bytes(range(256)) * 300)}}),
    ("POST", "/v1/embeddings", {"json": {"model": "sim-tiny"}}),  # refused by the worker: its 400, unchanged
    ("POST", "/detokenize", {"content": b"not json", "headers": JSON}),
]


@pytest.mark.parametrize(("method", "path", "kw"), ENDPOINTS,
                         ids=[f"{p.strip('/').replace('/', '-')}-{i}" for i, (_, p, _) in enumerate(ENDPOINTS)])
async def test_every_other_vllm_endpoint_answers_through_the_router_as_the_worker_does(
        healthy: TestFleet, method: str, path: str, kw: dict[str, Any], same_answer: Any) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        direct = await exchange(client, healthy.url(healthy.worker_ids[0]), method, path, **kw)
        routed = await exchange(client, router_url(healthy), method, path, **kw)
    assert routed[0] == direct[0]
    same_answer(routed[1], direct[1])
    label = {"tokenize": "tokenize", "detokenize": "detokenize"}.get(path.strip("/"), None)
    if label is not None:
        assert await router_metric(healthy, f'fleetward_router_requests_total{{endpoint="{label}",outcome=') > 0


async def router_metric(fleet: TestFleet, prefix: str) -> float:
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(router_url(fleet) + "/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


async def test_models_are_the_workers_cards_with_the_routers_word_on_their_text(healthy: TestFleet) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        direct = (await client.get(healthy.url(healthy.worker_ids[0]) + "/v1/models")).json()["data"]
        routed = (await client.get(router_url(healthy) + "/v1/models")).json()["data"]
    assert [m["id"] for m in routed] == ["sim-tiny"]
    mine = dict(routed[0])
    assert mine.pop("fleetward")["detokenizer"] == "router"
    assert list(mine) == list(direct[0]) and mine["max_model_len"] == direct[0]["max_model_len"] == SIM.max_model_len


async def test_a_request_without_a_model_goes_to_the_one_model_and_an_unknown_one_is_refused(
        healthy: TestFleet) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        ok = await client.post(router_url(healthy) + "/v1/embeddings", json={"input": "no model named"})
        unknown = await client.post(router_url(healthy) + "/v1/embeddings", json={"model": "nope", "input": "x"})
    assert ok.status_code == 200 and ok.json()["model"] == "sim-tiny"
    assert unknown.status_code == 404
    assert unknown.json()["error"] == {"message": "The model `nope` does not exist. Valid aliases: sim-tiny.",
                                       "type": "NotFoundError", "param": "model", "code": 404}


async def test_a_worker_that_fails_before_the_client_has_a_byte_is_passed_over(healthy: TestFleet) -> None:
    """One worker answers every request with vLLM's dead-engine 500: each request is answered by the other."""
    sick = healthy.worker_ids[0]
    await healthy.fault(sick, error_rate=1.0)
    before = await router_metric(healthy, 'fleetward_router_passthrough_retries_total{endpoint="embeddings"')
    async with httpx.AsyncClient(timeout=30) as client:
        answers = await asyncio.gather(*(client.post(router_url(healthy) + "/v1/embeddings",
                                                     json={"model": "sim-tiny", "input": f"text {i}"})
                                         for i in range(8)))
    assert [a.status_code for a in answers] == [200] * 8
    assert await router_metric(healthy, 'fleetward_router_passthrough_retries_total{endpoint="embeddings"') > before


async def test_an_answer_the_journal_cannot_make_is_relayed_whole_and_sent_again_when_its_worker_fails(
        healthy: TestFleet, same_answer: Any) -> None:
    """A non-streamed request whose state is not a function of its tokens (here chat with a parameter that
    has no completions equivalent) goes to one worker as it was sent; when that worker answers vLLM's
    dead-engine 500 before the answer, the request is sent again from its start to the other, and the client
    reads the answer a healthy worker gives (greedy: the same)."""
    body = {"model": "sim-tiny", "messages": [{"role": "user", "content": "whole"}], "max_tokens": 9,
            "temperature": 0, "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False},
            "top_logprobs": 0, "parallel_tool_calls": True}
    assert whole_reason(body, Kind.CHAT) is not None
    sick, well = healthy.worker_ids
    async with httpx.AsyncClient(timeout=30) as client:
        direct = await client.post(healthy.url(well) + "/v1/chat/completions", json=body)
        await healthy.fault(sick, error_rate=1.0)
        before = await router_metric(healthy, 'fleetward_router_passthrough_retries_total{endpoint="chat"')
        answers = await asyncio.gather(*(client.post(router_url(healthy) + "/v1/chat/completions", json=body)
                                         for _ in range(6)))
    assert direct.status_code == 200
    for a in answers:
        assert a.status_code == 200, a.text
        same_answer(a.content, direct.content)
    assert await router_metric(healthy, 'fleetward_router_passthrough_retries_total{endpoint="chat"') > before


async def test_each_choice_of_a_request_is_migrated_on_its_own_when_its_worker_cuts_it(
        healthy: TestFleet, same_answer: Any) -> None:
    """A list of eight greedy prompts, answered whole: each prompt is a journaled request of its own, so the
    choices a worker cuts mid-way (every request there that reaches 4 tokens) continue on the other worker
    from their tokens (migrations, not the request sent again whole), and the answer is the one a worker
    gives when nothing fails. A choice the worker refuses is the client's error for the whole request, as
    vLLM's."""
    body = {"model": "sim-tiny", "prompt": [f"choice {i}: " for i in range(8)], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    bad = {**body, "prompt": ["fine", [75, 10**6]]}
    sick, well = healthy.worker_ids
    async with httpx.AsyncClient(timeout=30) as client:
        direct = await client.post(healthy.url(well) + "/v1/completions", json=body)
        refused = await client.post(healthy.url(well) + "/v1/completions", json=bad)
        migrated = await router_metric(healthy, "fleetward_router_migrations_total")
        resent = await router_metric(healthy, 'fleetward_router_passthrough_retries_total{endpoint="completion"')
        await healthy.fault(sick, reset_after_tokens=4)
        try:
            routed = await client.post(router_url(healthy) + "/v1/completions", json=body)
            routed_refusal = await client.post(router_url(healthy) + "/v1/completions", json=bad)
        finally:
            await healthy.fault(sick, clear=True)
    assert direct.status_code == routed.status_code == 200, routed.text
    same_answer(routed.content, direct.content)
    assert await router_metric(healthy, "fleetward_router_migrations_total") > migrated
    assert await router_metric(
        healthy, 'fleetward_router_passthrough_retries_total{endpoint="completion"') == resent
    assert refused.status_code == routed_refusal.status_code == 400
    assert routed_refusal.json() == refused.json()


def by_choice(raw: bytes) -> tuple[list[dict[str, Any]], list[Any]]:
    """A stream of several choices as a client reads it: per index, in order, its text, token ids and finish;
    and every chunk with no choice (the usage chunk)."""
    got: dict[int, dict[str, Any]] = {}
    rest = []
    for line in raw.decode().split("\n\n"):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line.removeprefix("data: "))
        if not chunk["choices"]:
            rest.append({k: v for k, v in chunk.items() if k not in ("id", "created")})
            continue
        (c,) = chunk["choices"]
        mine = got.setdefault(c["index"], {"text": "", "token_ids": [], "finish_reason": None})
        mine["text"] += (c["delta"].get("content") or "") if "delta" in c else c["text"]
        mine["token_ids"] += c.get("token_ids") or []
        mine["finish_reason"] = c["finish_reason"] or mine["finish_reason"]
    return [got[i] for i in sorted(got)], rest


def _whole_choices(answer: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"text": c["message"]["content"] if "message" in c else c["text"], "token_ids": c["token_ids"],
             "finish_reason": c["finish_reason"]} for c in answer["choices"]]


async def test_a_stream_of_several_choices_reads_choice_by_choice_as_the_whole_answer_and_rides_a_cut(
        healthy: TestFleet) -> None:
    """Streamed, a request of several choices is one journaled stream per choice: each chunk carries its
    choice's index and the response's one id, chat opens with every choice's role chunk, and one usage chunk
    and ``[DONE]`` end it. Choice by choice it reads as a worker's whole answer to the same request: seeded
    samples (n = 3, chat) with nothing failing, and a list of greedy prompts whose choices a worker cuts
    mid-way (they continue on the other worker from their tokens)."""
    chat = {"model": "sim-tiny", "messages": [{"role": "user", "content": "fan out"}], "max_tokens": 7, "n": 3,
            "temperature": 0.9, "seed": 21, "ignore_eos": True, "return_token_ids": True}
    prompts = {"model": "sim-tiny", "prompt": [f"stream {i}: " for i in range(6)], "max_tokens": 12,
               "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    usage = {"stream_options": {"include_usage": True}, "stream": True}
    sick, well = healthy.worker_ids
    async with httpx.AsyncClient(timeout=30) as client:
        chat_whole = (await client.post(healthy.url(well) + "/v1/chat/completions", json=chat)).json()
        prompts_whole = (await client.post(healthy.url(well) + "/v1/completions", json=prompts)).json()
        chat_stream = await client.post(router_url(healthy) + "/v1/chat/completions", json={**chat, **usage})
        migrated = await router_metric(healthy, "fleetward_router_migrations_total")
        await healthy.fault(sick, reset_after_tokens=4)
        prompts_stream = await client.post(router_url(healthy) + "/v1/completions", json={**prompts, **usage})
    assert await router_metric(healthy, "fleetward_router_migrations_total") > migrated
    for whole, stream in ((chat_whole, chat_stream), (prompts_whole, prompts_stream)):
        assert stream.status_code == 200 and stream.text.endswith("data: [DONE]\n\n")
        chunks = [json.loads(e.removeprefix("data: ")) for e in stream.text.split("\n\n")[:-2] if e]
        assert {c["id"] for c in chunks} == {stream.headers["x-request-id"]}
        got, rest = by_choice(stream.content)
        assert got == _whole_choices(whole)
        assert [r["usage"] for r in rest] == [{k: whole["usage"][k] for k in ("prompt_tokens", "total_tokens",
                                                                               "completion_tokens")}]
    roles = [json.loads(e.removeprefix("data: "))["choices"][0] for e in chat_stream.text.split("\n\n")[:3]]
    assert [(c["index"], c["delta"]) for c in roles] == [(i, {"role": "assistant", "content": ""}) for i in range(3)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_request_a_worker_refuses_is_the_clients_error_and_is_not_retried(healthy: TestFleet, stream: bool,
                                                                                  same_answer: Any) -> None:
    """A prompt with a token id out of the vocabulary: the worker's refusal (a 400, or for a stream vLLM's
    in-band error after its 200) reaches the client as the worker wrote it, and no other worker is tried."""
    body = {"model": "sim-tiny", "prompt": [1, 2, 999999], "max_tokens": 3, "stream": stream}
    async with httpx.AsyncClient(timeout=30) as client:
        direct = await client.post(healthy.url(healthy.worker_ids[0]) + "/v1/completions", json=body)
        before = await router_metric(healthy, "fleetward_router_upstream_errors_total")
        migrations = await router_metric(healthy, "fleetward_router_migrations_total")
        routed = await client.post(router_url(healthy) + "/v1/completions", json=body)
    assert b"out of vocabulary" in direct.content
    assert routed.status_code == direct.status_code
    same_answer(routed.content, direct.content)
    assert await router_metric(healthy, "fleetward_router_upstream_errors_total") == before
    assert await router_metric(healthy, "fleetward_router_migrations_total") == migrations


async def test_a_killed_worker_is_passed_over_by_requests_racing_its_death(healthy: TestFleet) -> None:
    """SIGKILL one worker and at once send requests of every kind: whether the router knows yet or finds the
    connection refused, none fails."""
    healthy.kill(healthy.worker_ids[0])
    async with httpx.AsyncClient(timeout=30) as client:
        answers = await asyncio.gather(*(
            client.post(router_url(healthy) + path, json=body) for _ in range(3) for path, body in (
                ("/v1/embeddings", {"input": "racing"}), ("/tokenize", {"prompt": "racing"}),
                ("/v1/responses", {"input": "racing", "max_output_tokens": 4}))))
    assert [a.status_code for a in answers] == [200] * 9, [a.text for a in answers if a.status_code != 200]


async def test_a_responses_stream_whose_worker_breaks_mid_way_ends_with_an_error_event(healthy: TestFleet) -> None:
    """vLLM's Responses API streams no token ids, so the stream cannot move: it ends cleanly, with the Responses
    API's ``error`` event after its last whole event, numbered next."""
    body = {"model": "sim-tiny", "input": "a long answer", "max_output_tokens": 3000, "ignore_eos": True,
            "stream": True}
    events: list[tuple[str, dict[str, Any]]] = []
    kind = ""
    async with httpx.AsyncClient(timeout=60) as client, client.stream(
            "POST", router_url(healthy) + "/v1/responses", json=body) as r:
        assert r.status_code == 200
        async for line in sse_lines(r.aiter_bytes()):
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append((kind, orjson.loads(line[6:])))
                if kind == "response.output_text.delta" and len(events) == 6:
                    for w in healthy.worker_ids:  # the one serving it drops the connection mid-body
                        await healthy.fault(w, reset_inflight=True)
    kinds = [k for k, _ in events]
    assert kinds[-1] == "error" and "response.completed" not in kinds, kinds[-5:]
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    assert events[-1][1]["code"] == "worker_failed"
    assert await router_metric(healthy, 'fleetward_router_passthrough_cut_total{endpoint="responses"}') >= 1


async def test_a_stored_response_is_found_on_the_worker_that_holds_it(healthy: TestFleet) -> None:
    """With the store on (VLLM_ENABLE_RESPONSES_API_STORE), a response lives on one worker: reading it, and a
    response that continues it, go there (any other worker would answer 404)."""
    url = router_url(healthy)
    async with httpx.AsyncClient(timeout=30) as client:
        made = [(await client.post(url + "/v1/responses", json={"input": f"remember {i}", "max_output_tokens": 4,
                                                                 "ignore_eos": True})).json() for i in range(4)]
        for first in made:
            read = await client.get(f"{url}/v1/responses/{first['id']}")
            assert read.status_code == 200 and read.json() == first
            follow = await client.post(url + "/v1/responses", json={"input": "and then?", "max_output_tokens": 3,
                                                                     "previous_response_id": first["id"]})
            assert follow.status_code == 200, follow.text
            assert follow.json()["previous_response_id"] == first["id"]
        missing = await client.get(url + "/v1/responses/resp_nope")
    assert missing.status_code == 404 and "resp_nope" in missing.json()["error"]["message"]


@pytest.mark.parametrize("event_ids", [False, True], ids=["vllm-stream", "event-ids"])
async def test_the_resume_example_in_the_docs_runs_as_written(healthy: TestFleet, event_ids: bool) -> None:
    """docs/examples/resume_stream.py (docs/operations.md, "Resuming a stream"): the two parts make the whole."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(EXAMPLE), router_url(healthy), *(["--event-ids"] if event_ids else []),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    got = json.loads(out)
    body = {"model": "sim-tiny", "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0}
    async with httpx.AsyncClient(timeout=30) as client:
        whole = (await client.post(router_url(healthy) + "/v1/completions", json=body)).json()["choices"][0]["text"]
    assert got["head"] and got["tail"] and got["text"] == whole
    assert got["resumed_from"].endswith(":8")


async def test_a_clients_transfer_params_never_reach_a_worker(healthy: TestFleet) -> None:
    """``kv_transfer_params`` tell a worker where to pull a prompt's KV from: a client's own, pointed at a
    listener of its choosing, are taken out of the request, journaled or passed through, and the answer is the
    one the same request without them gets; the listener hears nothing (zero trust, issue 49)."""
    heard: list[bytes] = []

    async def listener(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heard.append(await reader.read(1024))
        writer.close()

    server = await asyncio.start_server(listener, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    forged = {"do_remote_prefill": True, "remote_url": f"http://127.0.0.1:{port}", "transfer_id": "x",
              "num_tokens": 16, "num_blocks": 1, "digest": "0" * 16}
    journaled = {"model": "sim-tiny", "prompt": "Hello there", "max_tokens": 8, "temperature": 0,
                 "ignore_eos": True}
    relayed = {"model": "sim-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
               "temperature": 0, "logprobs": True}  # chat logprobs: passed through whole
    assert whole_reason(relayed, Kind.CHAT) is not None
    before = await router_metric(healthy, "fleetward_router_client_transfer_params_stripped_total")
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            for path, body in (("/v1/completions", journaled), ("/v1/chat/completions", relayed)):
                plain = await client.post(router_url(healthy) + path, json=body)
                sneaky = await client.post(router_url(healthy) + path, json={
                    **body, "kv_transfer_params": forged, "ec_transfer_params": {"remote_url": forged["remote_url"]}})
                assert plain.status_code == sneaky.status_code == 200, sneaky.text
                assert sneaky.json()["choices"] == plain.json()["choices"]
    finally:
        server.close()
        await server.wait_closed()
    assert heard == []
    assert await router_metric(healthy, "fleetward_router_client_transfer_params_stripped_total") == before + 4


async def test_a_body_over_the_routers_limit_is_refused_before_it_is_held(healthy: TestFleet) -> None:
    """A client that says it will send more than routing.max_request_bytes (64 MiB) is answered 413 at once, in
    the OpenAI error shape, and the router reads none of it."""
    host, port = router_url(healthy).removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 70000000\r\n\r\n{\"prompt\": \"")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))  # type: ignore[union-attr]
        body = orjson.loads(await reader.readexactly(length))
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 413")
    assert body["error"]["code"] == 413 and "routing.max_request_bytes" in body["error"]["message"]
    assert await router_metric(healthy, "fleetward_router_requests_too_large_total") >= 1
