"""The router's SSE encoding: the per-response encoder writes exactly what the plain functions write, and
the plain functions write vLLM's chunks (tests/data/vllm-0.32) key for key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from fleetward.migration import wire
from fleetward.migration.journal import Journal, Kind

DATA = Path(__file__).parents[1] / "data" / "vllm-0.32"


def journal(kind: Kind, **body: Any) -> Journal:
    base: dict[str, Any] = {"model": "tiny", "stream": True}
    if kind is Kind.COMPLETION:
        base["prompt"] = [1, 2, 3]
    else:
        base["messages"] = [{"role": "user", "content": "hi"}]
    j = Journal(id="cmpl-fwtest", kind=kind, body={**base, **body}, created=1700000000.5)
    j.prompt_ids = [1, 2, 3]
    return j


@given(kind=st.sampled_from(list(Kind)), wants_ids=st.booleans(), first=st.booleans(),
       tokens=st.lists(st.integers(0, 300), max_size=4), text=st.text(max_size=8),
       finish=st.sampled_from([None, "stop", "length"]), stop=st.sampled_from([None, "\n", 7]),
       trace=st.booleans(), n=st.integers(0, 10_000), ids=st.booleans(), include_usage=st.booleans(),
       continuous=st.booleans(), fingerprint=st.sampled_from([None, "vllm-0.32.0-6185b5a7"]))
def test_the_stream_encoder_writes_the_same_bytes_as_event_of_stream_chunk(
        kind: Kind, wants_ids: bool, first: bool, tokens: list[int], text: str, finish: str | None,
        stop: str | int | None, trace: bool, n: int, ids: bool, include_usage: bool, continuous: bool,
        fingerprint: str | None) -> None:
    j = journal(kind, return_token_ids=wants_ids,
                stream_options={"include_usage": include_usage, "continuous_usage_stats": continuous})
    j.fingerprint = fingerprint
    chunk = wire.stream_chunk(j, n, tokens=tokens, text=text, finish_reason=finish, stop_reason=stop, first=first)
    extra = {"fleetward": {"worker": "w0", "attempt": 2}} if trace else None
    if extra:
        chunk.update(extra)
    expected = wire.event(chunk, f"{j.id}:{n}" if ids else None)
    got = wire.StreamEncoder(j, ids=ids).event(n, tokens=tokens, text=text, finish_reason=finish, stop_reason=stop,
                                               first=first, extra=extra)
    assert got == expected
    assert got.startswith(b"id: ") == ids
    assert orjson.loads(got.split(b"data: ", 1)[1]) == chunk
    # As vLLM: usage in every chunk with continuous usage (and include_usage); the fingerprint on the last chunk
    # when no usage chunk follows.
    assert chunk.get("usage") == (wire.chunk_usage(j, n) if include_usage and continuous else None)
    assert chunk.get("system_fingerprint") == (fingerprint if finish and not include_usage else None)


def _events(name: str) -> list[Any]:
    return [json.loads(block[len("data: "):]) for block in (DATA / name).read_text().split("\n\n")
            if block and block != "data: [DONE]"]


def _keys(value: Any) -> Any:
    """Keys in order, recursively (the values differ: ids, times, tokens)."""
    if isinstance(value, dict):
        return [(k, _keys(v)) for k, v in value.items()]
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return [_keys(v) for v in value]
    return None


def test_chunks_have_vllms_keys_in_vllms_order() -> None:
    """Against recorded vLLM 0.32 streams (return_token_ids, usage): every chunk kind, key for key."""
    completion = _events("completion_stream_usage.sse")
    j = journal(Kind.COMPLETION, return_token_ids=True, stream_options={"include_usage": True})
    j.fingerprint = "vllm-0.32.0-6185b5a7"
    mine = [wire.stream_chunk(j, 1, tokens=[5], text="a", finish_reason=None, stop_reason=None, first=True),
            wire.stream_chunk(j, 2, tokens=[6], text="b", finish_reason=None, stop_reason=None),
            wire.stream_chunk(j, 3, tokens=[7], text="c", finish_reason="length", stop_reason=None),
            wire.usage_chunk(j)]
    assert [_keys(c) for c in mine] == [_keys(c) for c in completion[:3] + completion[-1:]]
    chat = _events("chat_stream_usage.sse")
    c = journal(Kind.CHAT, return_token_ids=True, stream_options={"include_usage": True})
    c.fingerprint = "vllm-0.32.0-6185b5a7"
    mine = [wire.role_chunk(c), wire.stream_chunk(c, 1, tokens=[5], text="a", finish_reason=None, stop_reason=None),
            wire.stream_chunk(c, 2, tokens=[7], text="c", finish_reason="length", stop_reason=None),
            wire.usage_chunk(c)]
    assert [_keys(x) for x in mine] == [_keys(x) for x in chat[:2] + chat[-2:]]


def test_non_streamed_responses_have_vllms_keys_in_vllms_order() -> None:
    for kind, name in ((Kind.COMPLETION, "completion.json"), (Kind.CHAT, "chat.json")):
        j = journal(kind, stream=False, return_token_ids=True)
        j.finish_reason, j.fingerprint = "length", "vllm-0.32.0-6185b5a7"
        assert _keys(wire.final_response(j)) == _keys(json.loads((DATA / name).read_text()))


def test_the_in_band_error_is_written_as_vllm_writes_it() -> None:
    """vLLM writes its stream error with json.dumps' default separators; non-ASCII stays as it is."""
    assert wire.error_event(502, "worker w1 failed: é") == (
        b'data: {"error": {"message": "worker w1 failed: \xc3\xa9", "type": "BadGatewayError", "param": null, '
        b'"code": 502}}\n\n')


def test_a_chat_without_a_generation_prompt_answers_in_the_last_messages_role() -> None:
    j = journal(Kind.CHAT, messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "I"}],
                add_generation_prompt=False)
    assert wire.role_chunk(j)["choices"][0]["delta"]["role"] == "assistant"
    j = journal(Kind.CHAT, messages=[{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert wire.role_chunk(j)["choices"][0]["delta"]["role"] == "user"
    assert wire.role_chunk(journal(Kind.CHAT))["choices"][0]["delta"]["role"] == "assistant"
