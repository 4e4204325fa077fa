"""Real vLLM on the CPU serves the tiny model deterministically: the ground truth migration relies on."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from fleetward.fleet.vocab import load_vocabulary
from fleetward.sim.tokenizer import render_chat

pytestmark = pytest.mark.asyncio(loop_scope="session")

VOCAB = load_vocabulary("bpe")  # the tiny model's vocabulary (tests/vllm/conftest.py)
PROMPT = VOCAB.encode("The fleet keeps serving: ")


async def complete(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(f"{url}/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        r.raise_for_status()
        ids: list[int] = r.json()["choices"][0]["token_ids"]
        return ids


async def test_greedy_output_is_identical_across_workers_and_resumes_exactly(vllm_fleet) -> None:
    a, b = (vllm_fleet.url(w) for w in vllm_fleet.worker_ids)
    full_a, full_b = await asyncio.gather(complete(a, PROMPT, 120), complete(b, PROMPT, 120))
    assert full_a == full_b
    assert len(set(full_a)) > 40, "the tiny model's output must be high-entropy for exactness checks"
    rest = await complete(b, PROMPT + full_a[:50], 70)
    assert rest == full_a[50:]


async def test_batched_requests_give_the_same_tokens_as_sequential_ones(vllm_fleet) -> None:
    a, b = (vllm_fleet.url(w) for w in vllm_fleet.worker_ids)
    prompts = [VOCAB.encode(f"request number {i}: ") for i in range(8)]
    batched = await asyncio.gather(*(complete(a, p, 40) for p in prompts))
    sequential = [await complete(b, p, 40) for p in prompts]
    assert batched == sequential


async def test_vllm_applies_the_same_chat_template_as_fleetward(vllm_fleet) -> None:
    url = vllm_fleet.url(vllm_fleet.worker_ids[0])
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(f"{url}/v1/chat/completions", json={
            "model": "tiny", "messages": messages, "max_tokens": 2, "return_token_ids": True})
    r.raise_for_status()
    assert r.json()["prompt_token_ids"] == VOCAB.encode(render_chat(messages), add_special_tokens=False)
