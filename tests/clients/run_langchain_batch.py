"""LangChain's completions ``OpenAI`` LLM pointed at a vLLM-compatible base URL, batching as it does: one
``generate`` over every prompt, sent as requests of ``batch_size`` prompts each (a list of prompts per request,
not streamed). Run by test_clients.py as its own process.

    python run_langchain_batch.py JOB_JSON   (JOB: base_url, model, max_tokens, batch_size, requests: [{prompt}])

Prints one JSON list: per prompt, in order, {"text", "finish_reason", "error"}.
"""

import json
import sys

from langchain_openai import OpenAI


def main(job: dict) -> list[dict]:
    llm = OpenAI(model=job["model"], base_url=job["base_url"] + "/v1", api_key="none", temperature=0,
                 max_tokens=job["max_tokens"], batch_size=job["batch_size"], max_retries=0, timeout=120,
                 extra_body={"ignore_eos": True})
    prompts = [r["prompt"] for r in job["requests"]]
    try:
        result = llm.generate(prompts)
    except Exception as exc:  # the test counts it; it must not happen
        return [{"text": "", "finish_reason": None, "error": f"{type(exc).__name__}: {exc}"} for _ in prompts]
    return [{"text": g[0].text, "finish_reason": (g[0].generation_info or {}).get("finish_reason"), "error": None}
            for g in result.generations]


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
