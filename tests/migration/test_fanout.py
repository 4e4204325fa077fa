"""Which requests of several choices are split into one journaled request per choice, and the answer assembled
from them (migration/fanout.py). The answers themselves are compared with a worker's in test_router_dropin and
with real vLLM's in tests/vllm/test_router_on_vllm.py."""

from __future__ import annotations

from typing import Any

import pytest

from fleetward.migration.fanout import answer, choices
from fleetward.migration.journal import Journal, Kind

BASE = {"model": "m", "max_tokens": 4}


def test_a_list_of_prompts_becomes_one_request_per_prompt_and_n_samples_each_in_vllms_order() -> None:
    split = choices({**BASE, "prompt": [[4], [5, 6], [7]], "n": 2, "temperature": 0.7, "seed": 10}, Kind.COMPLETION)
    assert split is not None and split.n == 2
    assert [(b["prompt"], b["seed"]) for b in split.bodies] == [
        ([4], 10), ([4], 11), ([5, 6], 10), ([5, 6], 11), ([7], 10), ([7], 11)]  # vLLM's child seeds: seed + k
    assert all("n" not in b and b["temperature"] == 0.7 and b["max_tokens"] == 4 for b in split.bodies)


def test_greedy_prompts_and_unseeded_samples_keep_their_sampling() -> None:
    greedy = choices({**BASE, "prompt": ["a", "b"], "temperature": 0, "seed": 3}, Kind.COMPLETION)
    assert greedy is not None and [b["seed"] for b in greedy.bodies] == [3, 3]  # one choice per prompt: as sent
    chat = choices({**BASE, "messages": [{"role": "user", "content": "hi"}], "n": 3, "temperature": 1.0}, Kind.CHAT)
    assert chat is not None and len(chat.bodies) == 3 and all("seed" not in b for b in chat.bodies)
    streamed = choices({**BASE, "prompt": ["a", "b"], "stream": True, "echo": True}, Kind.COMPLETION)
    assert streamed is not None and all(b["stream"] and b["echo"] for b in streamed.bodies)  # a stream echoes


@pytest.mark.parametrize("body", [
    {"prompt": "one"},  # one choice
    {"prompt": "a", "n": 2},  # no temperature: the model's default decides (greedy n > 1 is refused)
    {"prompt": "a", "n": 2, "temperature": 0},  # greedy n > 1: vLLM's refusal, in its words
    {"prompt": "a", "n": 2, "temperature": 1, "best_of": 3},
    {"prompt": ["a", "b"], "echo": True, "logprobs": 1},  # the prompt's logprobs: relayed whole
    {"prompt": ["a", "b"], "prompt_logprobs": 1},
    {"prompt": ["a", "b"], "max_tokens": "many"},  # vLLM refuses it, in its words
    {"prompt": ["a", [5, 6]]},  # text and ids in one list: vLLM's schema refuses it
], ids=["one", "no-temperature", "greedy-n", "best_of", "echo", "prompt_logprobs", "refused", "mixed"])
def test_what_is_not_split(body: dict[str, Any]) -> None:
    assert choices({**BASE, **body}, Kind.COMPLETION) is None


def _done(rid: str, prompt: list[int], out: list[int], text: str) -> Journal:
    j = Journal(id=rid, kind=Kind.COMPLETION, body={**BASE, "prompt": prompt}, created=1.0, deadline=9.0)
    j.record(out, text, "length", None)
    return j


def test_the_answer_counts_each_prompt_once_and_every_choice_in_order() -> None:
    parts = [(_done("x-0", [1, 2, 3], [7], "a"), None), (_done("x-1", [1, 2, 3], [8, 9], "bc"), None),
             (_done("x-2", [4], [5], "d"), {"tokens": ["d"]})]
    whole = answer("cmpl-parent", 5.0, parts, per_prompt=2)
    assert (whole["id"], whole["created"]) == ("cmpl-parent", 5)
    assert [(c["index"], c["text"], c["logprobs"]) for c in whole["choices"]] == [
        (0, "a", None), (1, "bc", None), (2, "d", {"tokens": ["d"]})]
    assert whole["usage"] == {"prompt_tokens": 3 + 1, "total_tokens": 4 + 4, "completion_tokens": 4,
                              "prompt_tokens_details": None, "completion_tokens_details": None}
