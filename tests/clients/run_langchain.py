"""LangChain's ``ChatOpenAI`` pointed at a vLLM-compatible base URL, as applications use it: streamed chat at
a set concurrency (``astream``). Run by test_clients.py as its own process.

    python run_langchain.py JOB_JSON   (JOB: base_url, model, max_tokens, concurrency, requests: [{prompt}])

Prints one JSON list: per request, in order, {"text", "finish_reason", "error"}.
"""

import asyncio
import json
import sys

from langchain_openai import ChatOpenAI


async def main(job: dict) -> list[dict]:
    llm = ChatOpenAI(model=job["model"], base_url=job["base_url"] + "/v1", api_key="none", temperature=0,
                     max_tokens=job["max_tokens"], max_retries=0, timeout=120, extra_body={"ignore_eos": True})
    gate = asyncio.Semaphore(job["concurrency"])

    async def one(request: dict) -> dict:
        text, finish = [], None
        async with gate:
            try:
                async for chunk in llm.astream(request["prompt"]):
                    text.append(chunk.content if isinstance(chunk.content, str) else "")
                    finish = chunk.response_metadata.get("finish_reason") or finish
            except Exception as exc:  # the test counts it; it must not happen
                return {"text": "".join(text), "finish_reason": finish, "error": f"{type(exc).__name__}: {exc}"}
        return {"text": "".join(text), "finish_reason": finish, "error": None}

    return list(await asyncio.gather(*(one(r) for r in job["requests"])))


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))))
