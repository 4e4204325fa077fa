"""LiteLLM as an application uses it against a vLLM server (its ``hosted_vllm`` provider): streamed chat and
text completions at a set concurrency. Run by test_clients.py as its own process (LiteLLM sets up logging
and threads of its own); its model-price map is read from the package, not fetched.

    python run_litellm.py JOB_JSON   (JOB: base_url, model, max_tokens, concurrency, requests: [{kind, prompt}])

Prints one JSON list: per request, in order, {"text", "finish_reason", "error"}.
"""

import asyncio
import json
import os
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price map at import

import litellm


async def main(job: dict) -> list[dict]:
    gate = asyncio.Semaphore(job["concurrency"])
    common = {"model": f"hosted_vllm/{job['model']}", "api_base": job["base_url"] + "/v1", "api_key": "none",
              "max_tokens": job["max_tokens"], "temperature": 0, "stream": True, "num_retries": 0,
              "extra_body": {"ignore_eos": True}}

    async def one(request: dict) -> dict:
        text, finish = [], None
        async with gate:
            try:
                if request["kind"] == "chat":
                    stream = await litellm.acompletion(messages=[{"role": "user", "content": request["prompt"]}],
                                                       **common)
                    async for chunk in stream:
                        for choice in chunk.choices:
                            text.append(choice.delta.content or "")
                            finish = choice.finish_reason or finish
                else:
                    stream = await litellm.atext_completion(prompt=request["prompt"], **common)
                    async for chunk in stream:
                        for choice in chunk.choices:
                            text.append(choice.text or "")
                            finish = choice.finish_reason or finish
            except Exception as exc:  # the test counts it; it must not happen
                return {"text": "".join(text), "finish_reason": finish, "error": f"{type(exc).__name__}: {exc}"}
        return {"text": "".join(text), "finish_reason": finish, "error": None}

    return list(await asyncio.gather(*(one(r) for r in job["requests"])))


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))))
