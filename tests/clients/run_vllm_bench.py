"""vLLM's own benchmark client (``vllm bench serve``), run as a vLLM user runs it against a new front door.

The ``vllm`` console script of the CPU build looks for a distribution named ``vllm`` and fails, so this runs
its module (``vllm.benchmarks.serve``). It runs twice in one process (vLLM takes seconds to import): first
straight at a worker (the fault-free reference: what a vLLM server sends), then through the router (where the
test kills a worker mid-run). The random dataset is seeded, so both runs send the same prompts in the same
order.

    python run_vllm_bench.py OUT_JSON WORKER_URL ROUTER_URL BENCH_ARGS...

Writes one JSON object to OUT_JSON (the bench prints its report on stdout): {"reference": RESULT,
"routed": RESULT}, each RESULT with completed, failed, output_lens, generated_texts and errors, in request
order.
"""

import json
import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

KEEP = ("completed", "failed", "output_lens", "generated_texts", "errors")


def run(base_url: str, argv: list[str]) -> dict:
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    result = main(parser.parse_args(["--base-url", base_url, "--save-detailed", *argv]))
    return {k: result.get(k) for k in KEEP}


if __name__ == "__main__":
    out, worker, router, *argv = sys.argv[1:]
    reference = run(worker, argv)
    routed = run(router, argv)
    with open(out, "w") as f:
        json.dump({"reference": reference, "routed": routed}, f)
