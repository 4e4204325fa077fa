"""An RL rollout job's sampler, as such jobs drive vLLM: the official ``openai`` client asking for ``n``
samples of each prompt (temperature 1, a seed per prompt so a run can be replayed), not streamed, a few
prompts at a time. Run by test_clients.py as its own process.

    python run_rollouts.py JOB_JSON   (JOB: base_url, model, max_tokens, n, concurrency, requests: [{prompt}])

Prints one JSON list: per prompt, in order, {"samples": [text of each choice, by index], "finish_reasons",
"error"}.
"""

import asyncio
import json
import sys

from openai import AsyncOpenAI


async def main(job: dict) -> list[dict]:
    client = AsyncOpenAI(base_url=job["base_url"] + "/v1", api_key="none", max_retries=0, timeout=120)
    gate = asyncio.Semaphore(job["concurrency"])

    async def one(seed: int, request: dict) -> dict:
        async with gate:
            try:
                answer = await client.completions.create(
                    model=job["model"], prompt=request["prompt"], max_tokens=job["max_tokens"], n=job["n"],
                    temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
            except Exception as exc:  # the test counts it; it must not happen
                return {"samples": [], "finish_reasons": [], "error": f"{type(exc).__name__}: {exc}"}
        choices = sorted(answer.choices, key=lambda c: c.index)
        return {"samples": [c.text for c in choices], "finish_reasons": [c.finish_reason for c in choices],
                "error": None}

    try:
        return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(job["requests"]))))
    finally:
        await client.close()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))))
