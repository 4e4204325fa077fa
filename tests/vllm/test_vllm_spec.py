"""The router answers as vLLM does on requests drawn from vLLM's own description of its API.

schemathesis draws request bodies for ``POST /v1/completions`` and ``POST /v1/chat/completions`` from the
``/openapi.json`` a real vLLM 0.32 CPU server publishes, not from a list of our own. Each body goes to that
server directly and through the router, and the two answers are compared:

- the status, always;
- what a client reads (``same_answer``: ids, times and where a stream's events broke aside) when the request is
  deterministic: greedy (``temperature: 0``) or seeded;
- otherwise the answer's shape (keys in order and value types, streams merged as a client reads them).

The spec is narrowed to what this fleet can answer in a test's time, and nothing else: the one model, a few
tokens (``max_tokens`` 1 to 6), ``n`` up to 3, no beam search (minutes on a CPU), no prompt embeddings or
KV/EC transfer parameters (a P/D deployment's, not a client's), no unknown keys (vLLM ignores them, the
router passes them on: nothing to compare), a ``request_id`` never (it names vLLM's response id, and two
requests with one id collide in one server).

At least 99 % of the requests must be answered alike. Where the answers differ, vLLM is asked again: the
router's answer is alike when vLLM gives it on another asking, or when vLLM's own answers differ among
themselves and the router's has their status and shape (vLLM varies where a request races with itself). The
ones that are not alike are printed with why, by kind;
``FLEETWARD_SPEC_EXAMPLES`` sets the examples per endpoint (default 25; e.g. 400 for a longer hunt, also
``FLEETWARD_FUZZ_RANDOM=1`` for new draws).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
from collections import Counter
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import Case, GenerationMode
from testkit import canonical

from fleetward.chaos.harness import TestFleet

pytestmark = pytest.mark.asyncio(loop_scope="session")

EXAMPLES = int(os.environ.get("FLEETWARD_SPEC_EXAMPLES", "25"))
DERANDOMIZE = not os.environ.get("FLEETWARD_FUZZ_RANDOM")
OPERATIONS = {"POST /v1/completions": "CompletionRequest", "POST /v1/chat/completions": "ChatCompletionRequest"}
LEFT_OUT = ("use_beam_search", "length_penalty", "prompt_embeds", "kv_transfer_params", "ec_transfer_params",
            "request_id", "mm_payload", "return_mm_kwargs", "vllm_xargs", "thinking_token_budget", "best_of",
            "routed_experts_prompt_start")


def narrowed(spec: dict[str, Any]) -> dict[str, Any]:
    """vLLM's spec, less what this test's fleet cannot answer in time (module docstring)."""
    spec = copy.deepcopy(spec)
    schemas = spec["components"]["schemas"]
    for name in OPERATIONS.values():
        body = schemas[name]
        props = body["properties"]
        for key in LEFT_OUT:
            props.pop(key, None)
        props["model"] = {"type": "string", "enum": ["tiny"]}
        props["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": 6}
        props.pop("max_completion_tokens", None)
        props["n"] = {"type": "integer", "minimum": 1, "maximum": 3}
        body["additionalProperties"] = False
        body["required"] = ["model", "max_tokens", "prompt" if name == "CompletionRequest" else "messages"]
    return spec


def shape(value: Any) -> Any:
    """Keys (in order) and value types, recursively; lists by their first item."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def deterministic(body: dict[str, Any]) -> bool:
    """The same request gives the same tokens on both servers: greedy, or seeded."""
    return body.get("temperature") == 0 or body.get("seed") is not None


def compare(body: dict[str, Any], direct: requests.Response, routed: requests.Response) -> str | None:
    """None when the router answered as vLLM did; else what differs."""
    if routed.status_code != direct.status_code:
        return f"status {routed.status_code} where vLLM answered {direct.status_code}: {routed.content[:160]!r}"
    if deterministic(body) or direct.status_code != 200:
        got, want = canonical(routed.content), canonical(direct.content)
    else:
        got, want = shape(canonical(routed.content)), shape(canonical(direct.content))
    if got == want:
        return None
    return f"content: {json.dumps(got, default=str)[:300]} where vLLM: {json.dumps(want, default=str)[:300]}"


def answered_as_vllm(url: str, path: str, body: dict[str, Any], direct: requests.Response,
                     routed: requests.Response) -> bool:
    """Whether the router's answer is one vLLM itself gives: vLLM varies on its own where a request races with
    itself (of a list of prompts with several ids out of the vocabulary, its error names whichever failed
    first). Asked again, vLLM gives the router's answer; or its own answers differ among themselves, and the
    router's has their status and shape."""
    answers = [direct]
    for _ in range(3):
        again = requests.post(url + path, json=body, timeout=120)
        if compare(body, again, routed) is None:
            return True
        answers.append(again)
    if all(compare(body, a, direct) is None for a in answers[1:]):
        return False  # vLLM answers it one way, and the router another
    return routed.status_code == direct.status_code and shape(canonical(routed.content)) == shape(
        canonical(direct.content))


Differ = list[tuple[str, dict[str, Any], str]]


def drive(direct_url: str, router_url: str) -> tuple[int, Differ, Differ]:
    """Every drawn request sent both ways: (how many, the ones answered otherwise, the ones vLLM itself
    answers in more than one way and the router answered in one of them)."""
    spec = narrowed(requests.get(f"{direct_url}/openapi.json", timeout=30).json())
    sent = 0
    differ: Differ = []
    varies: Differ = []
    for result in schemathesis.openapi.from_dict(spec).get_all_operations():
        operation: Any = result.ok()  # type: ignore[union-attr]
        if operation.label in OPERATIONS:
            sent += drive_one(operation, direct_url, router_url, differ, varies)
    return sent, differ, varies


def drive_one(operation: Any, direct_url: str, router_url: str, differ: Differ, varies: Differ) -> int:
    sent = 0

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=DERANDOMIZE, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    @given(case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
    def run(case: Case) -> None:
        nonlocal sent
        body: dict[str, Any] = case.body  # type: ignore[assignment]  # an object: the spec's request body
        direct = requests.post(direct_url + operation.path, json=body, timeout=120)
        routed = requests.post(router_url + operation.path, json=body, timeout=120)
        sent += 1
        why = compare(body, direct, routed)
        if why is not None:
            vllms = answered_as_vllm(direct_url, operation.path, body, direct, routed)
            (varies if vllms else differ).append((operation.label, body, why))

    run()
    return sent


async def test_the_router_answers_as_vllm_does_on_requests_drawn_from_vllms_own_spec(
        vllm_router: tuple[TestFleet, str]) -> None:
    fleet, router_url = vllm_router
    direct_url = fleet.url(fleet.worker_ids[0])
    sent, differ, varies = await asyncio.to_thread(drive, direct_url, router_url)
    kinds = Counter(why.split(":")[0] for _, _, why in differ)
    for label, body, why in differ:
        print(f"{label}: {why}\n    {json.dumps(body)[:600]}")
    for label, _, why in varies:
        print(f"{label} (vLLM itself answers this in more than one way; the router gave one): {why[:300]}")
    print(f"{sent - len(differ)} of {sent} alike ({len(varies)} where vLLM's own answer varies); the rest by "
          f"kind: {dict(kinds)}")
    assert sent >= EXAMPLES, "every endpoint was driven"
    assert sent - len(differ) >= 0.99 * sent, [why for _, _, why in differ]
