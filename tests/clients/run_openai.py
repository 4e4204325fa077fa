"""The official ``openai`` Python client, as an application uses it: streamed completions and chat at a set
concurrency through a base URL. Run by test_clients.py as its own process.

    python run_openai.py JOB_JSON   (JOB: base_url, model, max_tokens, concurrency, requests: [{kind, prompt}])

Prints one JSON list: per request, in order, {"text", "finish_reason", "error"}.
"""

import asyncio
import json
import sys

from openai import AsyncOpenAI


async def main(job: dict) -> list[dict]:
    client = AsyncOpenAI(base_url=job["base_url"] + "/v1", api_key="none", max_retries=0, timeout=120)
    gate = asyncio.Semaphore(job["concurrency"])
    extra = {"ignore_eos": True}

    async def one(request: dict) -> dict:
        text, finish = [], None
        async with gate:
            try:
                if request["kind"] == "chat":
                    stream = await client.chat.completions.create(
                        model=job["model"], messages=[{"role": "user", "content": request["prompt"]}],
                        max_tokens=job["max_tokens"], temperature=0, stream=True, extra_body=extra)
                    async for chunk in stream:
                        for choice in chunk.choices:
                            text.append(choice.delta.content or "")
                            finish = choice.finish_reason or finish
                else:
                    completions = await client.completions.create(
                        model=job["model"], prompt=request["prompt"], max_tokens=job["max_tokens"], temperature=0,
                        stream=True, extra_body=extra)
                    async for piece in completions:
                        for part in piece.choices:
                            text.append(part.text)
                            finish = part.finish_reason or finish
            except Exception as exc:  # the test counts it; it must not happen
                return {"text": "".join(text), "finish_reason": finish, "error": f"{type(exc).__name__}: {exc}"}
        return {"text": "".join(text), "finish_reason": finish, "error": None}

    try:
        return list(await asyncio.gather(*(one(r) for r in job["requests"])))
    finally:
        await client.close()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))))
