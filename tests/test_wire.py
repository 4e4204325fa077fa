"""The router's SSE encoding: the per-response encoder writes exactly what the plain functions write."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from fleetward.migration import wire
from fleetward.migration.journal import Journal, Kind


@given(kind=st.sampled_from(list(Kind)), wants_ids=st.booleans(), first=st.booleans(),
       tokens=st.lists(st.integers(0, 300), max_size=4), text=st.text(max_size=8),
       finish=st.sampled_from([None, "stop", "length"]), stop=st.sampled_from([None, "\n", 7]),
       trace=st.booleans(), n=st.integers(0, 10_000))
def test_the_stream_encoder_writes_the_same_bytes_as_event_of_stream_chunk(
        kind: Kind, wants_ids: bool, first: bool, tokens: list[int], text: str, finish: str | None,
        stop: str | int | None, trace: bool, n: int) -> None:
    body: dict[str, Any] = {"model": "sim-tiny", "stream": True, "return_token_ids": wants_ids}
    if kind is Kind.COMPLETION:
        body["prompt"] = [1, 2, 3]
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    j = Journal(id="cmpl-fwtest", kind=kind, body=body, created=1700000000.5)
    j.prompt_ids = [1, 2, 3]
    chunk = wire.stream_chunk(j, tokens=tokens, text=text, finish_reason=finish, stop_reason=stop, first=first)
    extra = {"fleetward": {"worker": "w0", "attempt": 2}} if trace else None
    if extra:
        chunk.update(extra)
    expected = wire.event(chunk, f"{j.id}:{n}")
    got = wire.StreamEncoder(j).event(n, tokens=tokens, text=text, finish_reason=finish, stop_reason=stop,
                                      first=first, extra=extra)
    assert got == expected
    assert orjson.loads(got.split(b"data: ", 1)[1]) == chunk
