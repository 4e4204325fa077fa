"""The router on real vLLM (CPU, tiny model, greedy): what a client reads through the router is what the vLLM
server sends, on every endpoint. A killed worker's streams completing exactly through the router are
test_faults_vllm's (the library's vLLM experiment, every checker) and test_text_on_vllm's (chat text)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from fleetward.chaos.harness import TestFleet

pytestmark = pytest.mark.asyncio(loop_scope="session")


DROPIN = [
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "Byte for byte", "max_tokens": 24, "temperature": 0,
                                 "ignore_eos": True, "stream": True}),
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Byte for byte"}],
                                      "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True,
                                      "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "Byte for byte", "max_tokens": 24, "temperature": 0,
                                 "ignore_eos": True, "return_token_ids": True}),
    # Issue 47: what vLLM's clients send beyond the benchmark (lm-eval-harness, LangChain, RL rollouts)
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "Log probs", "max_tokens": 8, "temperature": 0,
                                 "ignore_eos": True, "logprobs": 2}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "Log probs", "max_tokens": 8, "temperature": 0,
                                 "ignore_eos": True, "logprobs": 2, "stream": True}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "Log probs", "max_tokens": 40, "temperature": 0,
                                 "logprobs": 1, "stop": ["e"]}),
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Log probs"}],
                                      "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": True,
                                      "top_logprobs": 2}),
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Log probs"}],
                                      "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": True,
                                      "top_logprobs": 2, "stream": True}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "The loglikelihood of this", "max_tokens": 1,
                                 "temperature": 0, "echo": True, "logprobs": 1}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "Echoed", "max_tokens": 4, "temperature": 0,
                                 "ignore_eos": True, "echo": True, "logprobs": 1, "stream": True}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": [4094, 42, 75], "max_tokens": 4, "temperature": 0,
                                 "ignore_eos": True, "echo": True, "stream": True}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "Prompt logprobs", "max_tokens": 3, "temperature": 0,
                                 "ignore_eos": True, "prompt_logprobs": 1}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": ["First of two", "Second"], "max_tokens": 6,
                                 "temperature": 0, "ignore_eos": True}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "Two samples", "max_tokens": 6, "n": 2,
                                 "temperature": 1.0, "seed": 7, "ignore_eos": True}),
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Two samples"}],
                                      "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 7, "ignore_eos": True}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": ["Alpha", "Beta gamma"], "max_tokens": 5, "n": 2,
                                 "temperature": 0.8, "seed": 3, "ignore_eos": True, "logprobs": 1,
                                 "return_token_ids": True}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": ["Streamed", "fan-out"], "max_tokens": 5,
                                 "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": True,
                                 "stream_options": {"include_usage": True}}),
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Streamed"}],
                                      "max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 11, "ignore_eos": True,
                                      "stream": True, "stream_options": {"include_usage": True,
                                                                         "continuous_usage_stats": True}}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "Greedy fan-out", "max_tokens": 3, "n": 2,
                                 "temperature": 0}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": [1, 2, 7205], "max_tokens": 3}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": [1, 2, 7205], "max_tokens": 3, "stream": True}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": [5] * 2100, "max_tokens": 3, "stream": True}),
    ("POST", "/tokenize", {"model": "tiny", "prompt": "Hello world", "return_token_strs": True}),
    ("POST", "/detokenize", {"model": "tiny", "tokens": [42, 71, 401, 81, 650]}),
    ("GET", "/version", None),
    ("POST", "/v1/responses", {"model": "tiny", "input": "Hello", "max_output_tokens": 6, "temperature": 0}),
    ("POST", "/v1/responses", {"model": "tiny", "input": "Hello", "max_output_tokens": 6, "temperature": 0,
                               "stream": True}),
    ("POST", "/v1/embeddings", {"model": "tiny", "input": "a generative server has none"}),
]


@pytest.mark.parametrize(("method", "path", "body"), DROPIN,
                         ids=[f"{p.strip('/').replace('/', '-')}-{i}" for i, (_, p, _) in enumerate(DROPIN)])
async def test_the_router_answers_as_vllm_does_on_every_endpoint(vllm_router: tuple[TestFleet, str], method: str,
                                                                  path: str, body: Any, same_answer: Any) -> None:
    """The same request to a vLLM server and through the router: what the client reads is the same (ids,
    times and where vLLM broke a stream's events aside: tests/conftest.py, ``same_answer``). A generation is
    the router's own rendering of the tokens; the rest is passed through."""
    fleet, url = vllm_router
    async with httpx.AsyncClient(timeout=120) as client:
        direct = await client.request(method, fleet.url(fleet.worker_ids[0]) + path, json=body)
        if body and body.get("stop"):
            # A stop string is the router's to match, so it ends the answer before the worker's last chunk,
            # which carries the worker's system_fingerprint: the router gives the one that worker sent last.
            # The same prompt goes to the same worker (prefix affinity): one answer teaches it to the router.
            await client.request(method, url + path, json={**body, "stop": None, "max_tokens": 1})
        routed = await client.request(method, url + path, json=body)
    assert routed.status_code == direct.status_code
    same_answer(routed.content, direct.content)


async def test_models_are_vllms_cards(vllm_router: tuple[TestFleet, str]) -> None:
    _, url = vllm_router
    async with httpx.AsyncClient(timeout=30) as client:
        card = (await client.get(url + "/v1/models")).json()["data"][0]
    assert card["id"] == "tiny" and card["owned_by"] == "vllm" and card["max_model_len"] == 2048
    assert card["fleetward"]["detokenizer"] == "router"
