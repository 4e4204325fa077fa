"""The journal and its rules: what the next attempt asks for, stop strings, what cannot resume."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetward.migration.journal import Journal, Kind, RequestRefused, StopChecker, validate_body, whole_reason
from fleetward.migration.policy import LeastLoadedAffinity, prefix_key


def journal(body: dict, kind: Kind = Kind.COMPLETION) -> Journal:
    return Journal(id="cmpl-test", kind=kind, body=body)


def test_a_resumed_attempt_asks_for_prompt_plus_emitted_and_the_remaining_budget() -> None:
    j = journal({"model": "m", "prompt": [5, 6, 7], "max_tokens": 10, "min_tokens": 4, "temperature": 0,
                 "stop": ["xyz"], "stream": True})
    path, body = j.upstream_request()
    assert path == "/v1/completions" and body["prompt"] == [5, 6, 7] and body["max_tokens"] == 10
    assert "stop" not in body, "stop strings are matched by the router"
    j.record([40, 41, 42], "abc", None, None)
    path, body = j.upstream_request()
    assert body["prompt"] == [5, 6, 7, 40, 41, 42]
    assert body["max_tokens"] == 7
    assert body["min_tokens"] == 1
    assert body["temperature"] == 0 and body["return_token_ids"] is True and body["stream"] is True


def test_a_chat_request_resumes_through_completions_with_the_reported_prompt_ids() -> None:
    j = journal({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5},
                Kind.CHAT)
    path, body = j.upstream_request()
    assert path == "/v1/chat/completions" and body["messages"][0]["content"] == "hi"
    j.prompt_ids = [1, 2, 3]
    j.record([9], "x", None, None)
    path, body = j.upstream_request()
    assert path == "/v1/completions"
    assert body["prompt"] == [1, 2, 3, 9] and body["max_tokens"] == 4 and "messages" not in body


def test_the_budget_is_enforced_even_if_a_worker_overshoots() -> None:
    j = journal({"model": "m", "prompt": [1], "max_tokens": 3})
    j.record([10, 11], "ab", None, None)
    tokens, _, finish = j.record([12, 13, 14], "cde", None, None)
    assert tokens == [12] and finish == "length" and j.emitted == [10, 11, 12]


@pytest.mark.parametrize("extra, blocker", [
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"echo": True}, "echo"),
])
def test_constrained_requests_are_not_migrated_after_their_first_token(extra: dict, blocker: str) -> None:
    j = journal({"model": "m", "prompt": [1], **extra})
    assert j.resumable() is None, "before any token, starting over elsewhere is exact"
    j.record([5], "a", None, None)
    reason = j.resumable()
    assert reason is not None and blocker in reason


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "prompt": [1], "n": 0}, "n"),
    ({"model": "m", "prompt": ["a", [1]]}, "prompt"),
    ({"model": "m", "prompt": ""}, "prompt"),
    ({"model": "m", "prompt": [["a"], ["b"]]}, "prompt"),
    ({"model": "m", "prompt": ["a", ""]}, "prompt"),
    ({"model": "m", "prompt": [[1], []]}, "prompt"),
    ({"prompt": "x"}, "model"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": "3"}, "max_tokens"),
    ({"model": "m", "prompt": "x", "stop": 5}, "stop"),
])
def test_invalid_bodies_are_refused_with_the_parameter_named(body: dict, param: str) -> None:
    with pytest.raises(RequestRefused) as info:
        validate_body(body, Kind.COMPLETION)
    assert info.value.param == param


@pytest.mark.parametrize("body, kind, why", [
    ({"n": 2}, Kind.COMPLETION, "n=2"),
    ({"best_of": 3}, Kind.COMPLETION, "best_of=3"),
    ({"prompt": ["a", "b"]}, Kind.COMPLETION, "a list of prompts"),
    ({"prompt": [[1, 2], [3]]}, Kind.COMPLETION, "a list of prompts"),
    ({"prompt_logprobs": 1}, Kind.COMPLETION, "prompt_logprobs"),
    ({"echo": True, "logprobs": 1, "max_tokens": 1}, Kind.COMPLETION, "echo"),
    ({"response_format": {"type": "json_object"}}, Kind.COMPLETION, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, Kind.CHAT, "logprobs"),
    ({"n": 1, "logprobs": 2}, Kind.COMPLETION, None),
    ({"prompt": [1, 2]}, Kind.COMPLETION, None),
    ({"n": 2, "stream": True}, Kind.COMPLETION, None),
    ({"messages": [{"role": "user", "content": "x"}], "echo": True, "stream": True}, Kind.CHAT, "echo"),
    ({"echo": True, "stream": True}, Kind.COMPLETION, None),  # its echo the router writes (relay.py)
])
def test_answers_the_journal_cannot_make_are_relayed_whole(body: dict, kind: Kind, why: str | None) -> None:
    """Several choices, the prompt's logprobs, or a state not made of tokens: a non-streamed request is relayed
    whole (a streamed one with a fan-out is refused by validate_body instead); plain ones and completions'
    logprobs are made from the journal. A chat stream with echo is relayed as sent (its echo chunk has no
    tokens)."""
    full = {"model": "m", "prompt": "x", **body} if kind is Kind.COMPLETION else {"model": "m", **body}
    if not full.get("stream"):
        validate_body(full, kind)  # served, not refused
    reason = whole_reason(full, kind)
    assert (reason is None) if why is None else (reason is not None and why in reason)


def test_stop_strings_are_cut_and_held_back_across_chunks() -> None:
    s = StopChecker(["END"])
    assert s.feed("abcE") == ("ab", None)  # the last len("END") - 1 characters wait
    assert s.feed("N") == ("c", None)
    assert s.feed("Dxyz") == ("", "END")
    included = StopChecker(["END"], include=True)
    assert included.feed("xxENDyy") == ("xxEND", "END")


def test_with_the_stop_string_in_the_output_nothing_is_held_back_and_a_match_may_begin_in_sent_text() -> None:
    """vLLM holds text back only when the stop string is cut from the output (stop_buffer_length)."""
    s = StopChecker(["END"], include=True)
    assert s.feed("abcE") == ("abcE", None)
    assert s.feed("N") == ("N", None)
    assert s.feed("Dxyz") == ("D", "END")
    restored = StopChecker(["END"], include=True)
    restored.restore("", "abcEN")  # from a checkpoint: the text sent so far
    assert restored.feed("Dxyz") == ("D", "END")


@given(st.text(alphabet="abEND", max_size=40), st.lists(st.integers(1, 5), max_size=20), st.booleans())
def test_stop_checking_in_chunks_equals_checking_the_whole_text(text: str, cuts: list[int], include: bool) -> None:
    stops = ["END", "bb"]
    whole = StopChecker(stops, include=include)
    expected, matched = whole.feed(text)
    if matched is None:
        expected += whole.flush()
    chunked = StopChecker(stops, include=include)
    out, got, i = "", None, 0
    for c in [*cuts, len(text)]:
        piece, i = text[i:i + c], i + c
        emitted, got = chunked.feed(piece)
        out += emitted
        if got is not None or i >= len(text):
            break
    if got is None:
        out += chunked.flush()
    assert (out, got) == (expected, matched)


def test_a_checkpoint_round_trips() -> None:
    j = journal({"model": "m", "prompt": [1, 2], "max_tokens": 9, "stop": ["zz"]})
    j.record([40, 41], "ab", None, None)
    j.worker, j.attempts, j.owner = "w1", 2, "team-a"
    back = Journal.from_checkpoint(j.checkpoint("router-a"))
    assert (back.id, back.emitted, back.prompt_ids, back.attempts) == (j.id, [40, 41], [1, 2], 2)
    assert back.owner == "team-a" == Journal.from_checkpoint(orjson.loads(j.checkpoint_bytes("r"))).owner
    assert (back.text, back.stop.held) == ("a", "b"), "text that might start a stop string is held back"
    assert back.text_after(0) == "a" and back.text_after(2) == ""
    assert back.upstream_request() == j.upstream_request()


def test_affinity_keeps_a_prefix_on_one_worker_until_it_is_overloaded() -> None:
    policy = LeastLoadedAffinity(slack=2)
    workers = ["w0", "w1", "w2", "w3"]
    key = prefix_key([1, 2, 3, 4])
    preferred = policy.choose(workers, {}, key)
    assert all(policy.choose(workers, {}, key) == preferred for _ in range(5))
    busy = {w: 0 for w in workers}
    busy[preferred] = 3
    assert policy.choose(workers, busy, key) != preferred
    assert policy.choose(workers, {"w0": 5, "w1": 1, "w2": 5, "w3": 5}, None) == "w1"


def test_checkpoint_bytes_encode_the_same_record_and_follow_changes() -> None:
    j = journal({"model": "m", "prompt": [1, 2, 3], "max_tokens": 9})
    j.record([40, 41], "ab", None, None)
    assert orjson.loads(j.checkpoint_bytes("r")) == orjson.loads(orjson.dumps(j.checkpoint("r")))
    j.record([42], "c", None, None)
    j.prompt_ids = [7, 8]  # a chat request learns its prompt ids from the first chunk
    assert orjson.loads(j.checkpoint_bytes("r")) == orjson.loads(orjson.dumps(j.checkpoint("r")))
    assert orjson.loads(j.checkpoint_bytes("other"))["router"] == "other"
