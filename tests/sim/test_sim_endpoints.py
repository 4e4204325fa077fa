"""The simulated worker's other vLLM endpoints (sim/endpoints.py) against what vLLM 0.32 answered.

The recordings in tests/data/vllm-0.32 come from real vLLM on the tiny model: a generative server (tokenize,
detokenize, version, responses) and a pooling one (``--runner pooling --convert embed``: embeddings, pooling,
score, rerank). The sim must answer with the same keys in the same order and the same types; its numbers are
its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from fleetward.fleet.config import SimConfig
from fleetward.sim.server import SimWorker

DATA = Path(__file__).parents[1] / "data" / "vllm-0.32"
FAST = SimConfig(decode_step_ms=0.5, decode_ms_per_seq=0.0, prefill_ms_per_token=0.0, model_name="tiny",
                 responses_store=True)


def _no_crash() -> None:
    raise AssertionError("an in-process test asked the worker to crash")


@contextlib.asynccontextmanager
async def sim(config: SimConfig = FAST) -> AsyncIterator[tuple[httpx.AsyncClient, SimWorker]]:
    worker = SimWorker(config, admin_token="t", crash=_no_crash)
    async with worker.app.router.lifespan_context(worker.app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(worker.app), base_url="http://sim") as c:
            yield c, worker


def shape(value: Any) -> Any:
    """Keys (in order) and value types, recursively; a list of numbers is one type."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        if value and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            return ["number"]
        return [shape(v) for v in value[:1]]
    return type(value).__name__


def recorded(name: str) -> Any:
    return json.loads((DATA / name).read_text())


CASES = [
    ("GET", "/version", None, "version.json"),
    ("POST", "/tokenize", {"model": "tiny", "prompt": "Hello world", "return_token_strs": True}, "tokenize.json"),
    ("POST", "/detokenize", {"model": "tiny", "tokens": [40, 41, 42]}, "detokenize.json"),
    ("POST", "/v1/embeddings", {"model": "tiny", "input": ["Hello", "x y"]}, "embeddings.json"),
    ("POST", "/pooling", {"model": "tiny", "input": "Hello"}, "pooling.json"),
    ("POST", "/v1/score", {"model": "tiny", "text_1": "Hello", "text_2": ["Hi", "world"]}, "score.json"),
    ("POST", "/v1/rerank", {"model": "tiny", "query": "Hello", "documents": ["Hi", "world"]}, "rerank.json"),
    ("POST", "/v1/responses", {"model": "tiny", "input": "Hello", "max_output_tokens": 3, "temperature": 0},
     "responses.json"),
]


@pytest.mark.parametrize(("method", "path", "body", "name"), CASES, ids=[c[3].split(".")[0] for c in CASES])
async def test_each_endpoint_answers_in_vllms_shape(method: str, path: str, body: Any, name: str) -> None:
    async with sim() as (client, _):
        r = await client.request(method, path, json=body)
    assert r.status_code == 200, r.text
    assert json.dumps(shape(r.json())) == json.dumps(shape(recorded(name)))


def _events(text: str) -> list[tuple[str, Any]]:
    out = []
    for block in text.split("\n\n"):
        if block:
            kind, data = block.split("\n", 1)
            out.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


async def test_a_responses_stream_is_vllms_event_sequence() -> None:
    """created, in_progress, the message and its part opened, a delta per step with text, then all closed
    and completed; every event numbered in order and shaped as vLLM's (its deltas collapsed: text per step)."""
    theirs = _events((DATA / "responses_stream.sse").read_text())
    async with sim() as (client, _):
        r = await client.post("/v1/responses", json={"model": "tiny", "input": "Hello", "max_output_tokens": 3,
                                                     "temperature": 0, "stream": True})
    mine = _events(r.text)

    def collapsed(events: list[tuple[str, Any]]) -> list[str]:
        kinds = [k for k, _ in events]
        return [k for i, k in enumerate(kinds) if not (k == "response.output_text.delta" and i and kinds[i - 1] == k)]

    assert collapsed(mine) == collapsed(theirs)
    assert [e["sequence_number"] for _, e in mine] == list(range(len(mine)))
    by_kind = {k: e for k, e in theirs}
    for kind, event in mine:
        assert json.dumps(shape(event)) == json.dumps(shape(by_kind[kind])), kind
    text = "".join(e["delta"] for k, e in mine if k == "response.output_text.delta")
    assert mine[-1][1]["response"]["output"][0]["content"][0]["text"] == text


async def test_vectors_are_unit_length_a_function_of_the_input_and_scores_are_their_cosines() -> None:
    async with sim() as (client, _):
        a = (await client.post("/v1/embeddings", json={"input": ["Hello", "Hi"]})).json()["data"]
        again = (await client.post("/v1/embeddings", json={"input": "Hello"})).json()["data"]
        score = (await client.post("/score", json={"text_1": "Hello", "text_2": "Hi"})).json()["data"][0]["score"]
        ranked = (await client.post("/rerank", json={"query": "Hello", "documents": ["Hi", "Hello", "zz"],
                                                     "top_n": 2})).json()["results"]
    hello, hi = (np.array(d["embedding"], dtype=np.float32) for d in a)
    assert again[0]["embedding"] == a[0]["embedding"]
    assert abs(float(np.linalg.norm(hello)) - 1) < 1e-5
    assert abs(score - float(np.dot(hello, hi))) < 1e-5
    assert ranked[0]["index"] == 1 and len(ranked) == 2  # the query itself ranks first


async def test_pooling_runs_on_the_engine_and_tokenize_on_the_api_server() -> None:
    """As in vLLM: a hung engine holds pooling requests; tokenize still answers; a dead engine fails them."""
    async with sim() as (client, worker):
        worker.engine.faults.hang = True
        pending = asyncio.ensure_future(client.post("/v1/embeddings", json={"input": "waits"}))
        tokenized = await client.post("/tokenize", json={"prompt": "answers"})
        assert tokenized.status_code == 200 and not pending.done()
        worker.engine.faults.hang = False
        assert (await asyncio.wait_for(pending, 10)).status_code == 200
        worker.engine.faults.error_rate = 1.0
        dead = await client.post("/v1/embeddings", json={"input": "fails"})
    assert dead.status_code == 500 and dead.json()["error"]["type"] == "InternalServerError"


async def test_bad_requests_get_vllms_answers() -> None:
    async with sim() as (client, _):
        missing = await client.post("/v1/embeddings", json={"model": "tiny"})
        empty = await client.post("/v1/embeddings", json={"model": "tiny", "input": []})
        unknown = await client.post("/v1/responses", json={"model": "nope", "input": "x"})
        negative = await client.post("/v1/responses", json={"input": "x", "max_output_tokens": -1})
        not_stored = await client.get("/v1/responses/resp_nope")
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "body.input"
    assert empty.json()["error"]["message"] == "You must pass at least one prompt"
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "NotFoundError"
    assert negative.json()["error"]["message"] == ("max_tokens must be at least 1, got -1. (parameter=max_tokens, "
                                                   "value=-1)")
    assert not_stored.status_code == 404 and not_stored.json()["error"]["param"] == "response_id"


async def test_a_stored_response_is_read_back_and_continued() -> None:
    async with sim() as (client, _):
        first = (await client.post("/v1/responses", json={"input": "Hello", "max_output_tokens": 3})).json()
        read = await client.get(f"/v1/responses/{first['id']}")
        follow = await client.post("/v1/responses", json={"input": "more", "max_output_tokens": 3,
                                                          "previous_response_id": first["id"]})
        unstored = SimConfig(**{**FAST.model_dump(), "responses_store": False})
    assert read.json() == first
    assert follow.status_code == 200 and follow.json()["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    async with sim(unstored) as (client, _):
        first = (await client.post("/v1/responses", json={"input": "Hello", "max_output_tokens": 3})).json()
        assert (await client.get(f"/v1/responses/{first['id']}")).status_code == 404  # vLLM's default
