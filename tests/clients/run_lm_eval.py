"""lm-eval-harness (EleutherAI) scoring a model behind a vLLM-compatible server, as its users run it: the
``local-completions`` model (loglikelihood requests: echo, logprobs 1, max_tokens 1, one list of token-id
prompts per batch; generation: lists of prompts) on both tasks, and ``local-chat-completions`` (generation,
with the chat template) on the generation task, on this folder's small tasks of our own (lmeval/: sixteen
questions, offline). Run by test_clients.py as its own process: first against a worker (the fault-free
reference), then against the router, in one process (lm-eval takes seconds to import).

    python run_lm_eval.py JOB_JSON   (JOB: model, tokenizer, reference_url, router_url)

Prints, as its last line, one JSON object: {"reference": RUNS, "router": RUNS}, RUNS being {model type: {task:
[each document's responses, in document order]} or {"error": why}}.
"""

import json
import os
import sys
from pathlib import Path
from typing import Any

from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

HERE = Path(__file__).parent / "lmeval"
RUNS = {"local-completions": ("/v1/completions", ["fleetward_choice", "fleetward_answer"]),
        "local-chat-completions": ("/v1/chat/completions", ["fleetward_answer"])}


def evaluate(job: dict[str, Any], tasks: TaskManager, base_url: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model_type, (endpoint, names) in RUNS.items():
        args = {"model": job["model"], "base_url": base_url + endpoint, "num_concurrent": 4,
                "max_retries": 1}  # one attempt: a failed request fails the run, it is not tried again
        chat = model_type == "local-chat-completions"
        if not chat:
            args.update(tokenizer=job["tokenizer"], tokenized_requests=True)
        try:
            results = simple_evaluate(model=model_type, model_args=args, tasks=names, batch_size=4,
                                      log_samples=True, apply_chat_template=chat, task_manager=tasks)
        except Exception as exc:  # the test counts it; it must not happen
            out[model_type] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        assert results is not None
        out[model_type] = {task: [s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]
                           for task, samples in results["samples"].items()}
    return out


def main(job: dict[str, Any]) -> dict[str, Any]:
    os.chdir(HERE)  # the tasks name their data file relative to here
    tasks = TaskManager(include_path=str(HERE), include_defaults=False)  # ours only: the built-in index takes seconds
    reference = evaluate(job, tasks, job["reference_url"])
    return {"reference": reference, "router": evaluate(job, tasks, job["router_url"])}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
