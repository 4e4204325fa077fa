"""The callback relay (migration/upstream.py → relay.py → downstream.py) against the plain pull-based relay it
replaced: a worker's response cut anywhere (an SSE event, an HTTP chunk header or a CRLF split across reads,
several events in one read) gives the client the same bytes, on a byte-level BPE vocabulary.

The reference below reads the whole response at once and builds each client event with the plain functions of
:mod:`fleetward.migration.wire` (``event(stream_chunk(...))``), as the router's stream did before issue 32; the
relay under test gets the bytes piece by piece through the connection's ``data_received``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetward.fleet.clock import SYSTEM_CLOCK, ManualClock
from fleetward.fleet.vocab import load_vocabulary
from fleetward.migration import wire
from fleetward.migration.downstream import SseOutput
from fleetward.migration.journal import Journal, Kind
from fleetward.migration.metrics import RouterMetrics
from fleetward.migration.progress import ProgressModel
from fleetward.migration.relay import Relay
from fleetward.migration.router import Active, _Tries
from fleetward.migration.upstream import UpstreamStream, _Conn

VOCAB = load_vocabulary("bpe")
PROMPT = VOCAB.encode("The quick brown fox", add_special_tokens=False)


class _Transport:
    """The socket side of the upstream connection: the test writes nothing back and reads what it is given."""

    def __init__(self) -> None:
        self.closed = False
        self.reading = True

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


def journal(kind: Kind, body: dict[str, Any]) -> Journal:
    base: dict[str, Any] = {"model": "tiny", "stream": True, "max_tokens": 64}
    base.update({"prompt": PROMPT} if kind is Kind.COMPLETION else {"messages": [{"role": "user", "content": "hi"}]})
    j = Journal(id="cmpl-fwrelay", kind=kind, body={**base, **body}, created=1700000000.5)
    j.vocab = VOCAB
    return j


def worker_events(kind: Kind, pieces: list[list[int]], *, usage: bool) -> list[bytes]:
    """The SSE events a vLLM worker sends for these token groups (the last one finishes the stream)."""
    head = {"id": "cmpl-worker", "object": "text_completion" if kind is Kind.COMPLETION else "chat.completion.chunk",
            "created": 1, "model": "tiny"}
    events: list[dict[str, Any]] = []
    if kind is Kind.CHAT:
        events.append({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}], "prompt_token_ids": PROMPT})
    for k, ids in enumerate(pieces):
        finish = "length" if k == len(pieces) - 1 else None
        text = VOCAB.decode(ids)
        if kind is Kind.COMPLETION:
            choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                                      "stop_reason": None, "prompt_token_ids": PROMPT if k == 0 else None,
                                      "token_ids": ids}
        else:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish,
                      "token_ids": ids}
        event: dict[str, Any] = {**head, "choices": [choice]}
        if finish is not None and not usage:
            event["system_fingerprint"] = "vllm-0.32.0-fp"
        events.append(event)
    if usage:
        events.append({**head, "choices": [], "usage": {"prompt_tokens": len(PROMPT)}, "system_fingerprint": "fp"})
    return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


def http_response(events: list[bytes]) -> bytes:
    """As uvicorn (and so vLLM) sends it: chunked, one HTTP chunk per event."""
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
            + body + b"0\r\n\r\n")


def reference(j: Journal, events: list[bytes], *, trace: bool) -> bytes:
    """The client's bytes as the pull-based relay made them: each event parsed, journaled, encoded whole."""
    out: list[bytes] = []
    first = True
    for raw in events:
        payload = raw[len(b"data: "):].strip()
        if payload == b"[DONE]":
            break
        data = orjson.loads(payload)
        if j.prompt_ids is None:
            j.prompt_ids = data.get("prompt_token_ids") or (data["choices"][0].get("prompt_token_ids")
                                                            if data["choices"] else None)
        if data.get("system_fingerprint") and data["choices"]:
            j.fingerprint = data["system_fingerprint"]
        if not data["choices"] or (not data["choices"][0].get("token_ids") and
                                   data["choices"][0]["finish_reason"] is None):
            continue
        c = data["choices"][0]
        text = c["text"] if j.kind is Kind.COMPLETION else c["delta"]["content"]
        tokens, text, finish = j.record(c["token_ids"], text, c["finish_reason"], c.get("stop_reason"))
        if first and j.kind is Kind.CHAT:
            out.append(wire.event(wire.role_chunk(j)))
        chunk = wire.stream_chunk(j, len(j.emitted), tokens=tokens, text=text, finish_reason=finish,
                                  stop_reason=j.stop_reason, first=first)
        if trace:
            chunk["fleetward"] = {"worker": "w0", "attempt": 1}
        out.append(wire.event(chunk))
        first = False
        if finish is not None:
            break
    if j.wants_usage:
        out.append(wire.event(wire.usage_chunk(j)))
    return b"".join(out) + wire.DONE


def wired(j: Journal, out: SseOutput, progress: ProgressModel) -> tuple[_Conn, _Transport, UpstreamStream, Relay]:
    """One attempt of ``j`` on worker w0, its relay feeding ``out``, on a connection the test feeds by hand."""
    relay = Relay(j, "w0", out, _Tries(), Active(j), progress=progress, metrics=RouterMetrics(), clock=progress.clock,
                  on_moved=lambda _: None)
    stream = UpstreamStream("w0", relay)
    conn, transport = _Conn(), _Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    conn.request(b"", stream)
    return conn, transport, stream, relay


async def relayed(j: Journal, response: bytes, cuts: list[int], *, trace: bool) -> tuple[bytes, list[int]]:
    """The client's bytes through the callback relay, the response given to the connection in pieces; and the
    size of each write to the client."""
    out = SseOutput(j, 0, metrics=RouterMetrics(), progress=ProgressModel(), clock=SYSTEM_CLOCK, trace=trace)
    writes: list[bytes] = []
    out.write = writes.append
    j.attempts = 1
    conn, _, stream, relay = wired(j, out, ProgressModel())
    at = 0
    for cut in [*sorted(set(cuts)), len(response)]:
        if cut > at:
            conn.data_received(response[at:cut])
            at = cut
    assert stream.ended is not None and stream.ended.done()
    stream.ended.result()  # it finished
    relay.close()
    assert out.signalled and relay.active.stream is None
    out.finish()
    return b"".join(writes), [len(w) for w in writes]


TEXT = st.text(st.sampled_from("abc xyz éü 日本 🙂\n.,"), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(list(Kind)), text=TEXT, group=st.integers(1, 3), data=st.data(),
       usage=st.booleans(), continuous=st.booleans(), token_ids=st.booleans(), trace=st.booleans(),
       stop=st.sampled_from([None, [" x"], ["é", "🙂"], ["\n"]]))
def test_the_client_reads_the_same_bytes_wherever_the_workers_response_is_cut(
        kind: Kind, text: str, group: int, data: st.DataObject, usage: bool, continuous: bool, token_ids: bool,
        trace: bool, stop: list[str] | None) -> None:
    ids = VOCAB.encode(text, add_special_tokens=False)
    pieces = [ids[k:k + group] for k in range(0, len(ids), group)]
    events = worker_events(kind, pieces, usage=usage)
    response = http_response(events)
    cuts = data.draw(st.lists(st.integers(0, len(response)), max_size=12), label="cuts")
    body = {"stream_options": {"include_usage": usage, "continuous_usage_stats": continuous},
            "return_token_ids": token_ids, **({"stop": stop} if stop else {})}
    want = reference(journal(kind, body), events, trace=trace)
    got, _ = asyncio.run(relayed(journal(kind, body), response, cuts, trace=trace))
    assert got == want
    whole, one_write = asyncio.run(relayed(journal(kind, body), response, [], trace=trace))
    assert whole == want
    assert len(one_write) <= 2, "the events of one read go out as one write (and the end as another)"


@pytest.mark.parametrize("kind", list(Kind))
def test_a_paused_stream_is_not_silence_and_resumes_its_reading(kind: Kind) -> None:
    """The client's transport is full: the relay stops reading the worker, and the worker does not count as
    silent while it waits; once the client drains, reading and the silence clock start again."""

    async def run() -> None:
        # Its own clock, jumped: on the system clock a busy host's pause between two events of one read
        # counted as a token gap, and the allowance grew past the wait (seen under load).
        clock = ManualClock()
        progress = ProgressModel(clock=clock, floor_s=0.0)
        j = journal(kind, {})
        out = SseOutput(j, 0, metrics=RouterMetrics(), progress=progress, clock=clock)
        progress.dispatched("w0", j.id, 4)
        conn, transport, stream, _ = wired(j, out, progress)
        events = worker_events(kind, [[1], [2], [3]], usage=False)
        response = http_response(events)
        half = response.index(events[-2])
        conn.data_received(response[:half])
        out.pause()  # what the client's connection says once its buffer is past the high-water mark
        assert not transport.reading
        clock.advance(0.01)
        assert progress.stalled() == [], "a stream paused for its client is not the worker's silence"
        out.resume()
        assert transport.reading
        clock.advance(0.01)
        assert [w for w, *_ in progress.stalled()] == ["w0"], "resumed, its silence counts again"
        conn.data_received(response[half:])
        assert stream.ended is not None and stream.ended.done() and stream.finished

    asyncio.run(run())


def _logprobs(ids: list[int], start: int) -> dict[str, Any]:
    """A worker's completions logprobs for ``ids``, offsets counted from ``start`` (as vLLM writes them)."""
    tokens = [VOCAB.decode([t]) for t in ids]
    offsets = [start + sum(len(x) for x in tokens[:k]) for k in range(len(tokens))]
    return {"text_offset": offsets, "token_logprobs": [-0.5 - t / 1e4 for t in ids], "tokens": tokens,
            "top_logprobs": [{tok: -0.5 - t / 1e4} for tok, t in zip(tokens, ids, strict=True)]}


def test_a_whole_answer_joins_its_chunks_logprobs_cut_where_its_text_is_and_keeps_the_workers_fingerprint() -> None:
    """Completions logprobs answered whole: each chunk's lists end to end, as vLLM's whole answer holds them;
    a stop string that ends the answer inside a chunk of several tokens cuts that chunk's logprobs after the
    token that completed it. The router ends that answer before the worker's last chunk (which carries the
    fingerprint), so it gives the fingerprint the worker sent last time."""
    from fleetward.migration.relay import Whole

    ids = VOCAB.encode(" alpha beta gamma delta", add_special_tokens=False)
    assert len(ids) >= 4
    fingerprints: dict[str, str] = {}
    for stop, finish in ((None, "length"), ([" gamma"], "stop")):
        body: dict[str, Any] = {"stream": False, "logprobs": 1, "max_tokens": len(ids)}
        if stop:
            body["stop"] = stop
        j = journal(Kind.COMPLETION, body)
        whole = Whole()
        relay = Relay(j, "w0", whole, _Tries(), Active(j), progress=ProgressModel(), metrics=RouterMetrics(),
                      clock=SYSTEM_CLOCK, on_moved=lambda _: None, fingerprints=fingerprints)
        events = []
        for k, part in enumerate((ids[:2], ids[2:])):
            last = k == 1
            choice = {"index": 0, "text": VOCAB.decode(part), "logprobs": _logprobs(part, 0 if k == 0 else len(
                VOCAB.decode(ids[:2]))), "finish_reason": "length" if last else None, "stop_reason": None,
                "prompt_token_ids": PROMPT if k == 0 else None, "token_ids": part}
            events.append({"id": "x", "choices": [choice], **({"system_fingerprint": "vllm-fp"} if last else {})})
        relay.opened(UpstreamStream("w0", relay))
        for e in events:
            if relay.chunk(_chunk(e)):
                break
        assert j.finish_reason == finish
        kept = len(j.emitted)
        want = _logprobs(ids, 0)
        assert whole.logprobs == {k: v[:kept] for k, v in want.items()}
        assert wire.final_response(j, whole.logprobs)["choices"][0]["logprobs"] == whole.logprobs
        if stop:
            assert kept < len(ids) and j.text == VOCAB.decode(ids)[:VOCAB.decode(ids).index(" gamma")]
        assert j.fingerprint == "vllm-fp", "the first answer read the worker's last chunk; the second used it"


def _chunk(event: dict[str, Any]) -> Any:
    from fleetward.migration.upstream import _parse

    return _parse(orjson.dumps(event))
