"""Bad input, fuzzed: every parser of outside bytes and every file loader, under hypothesis.

- server-sent events as clients read them (``fleet/sse.py``): any bytes, cut anywhere, give the lines the
  SSE spec gives (CR, LF or CRLF only), whatever the cuts;
- the router's reader of a worker's stream (``migration/upstream.py``): any body, cut anywhere, gives chunks
  of the right types or an ``UpstreamError`` (which the router turns into a migration), the same whatever the
  cuts; never another exception;
- the fleet file (``load_fleet_config``) and experiment files (``load_experiment``): any bytes, any YAML tree,
  the shipped files with values replaced by junk: a config, or a ``ConfigError`` naming the file and line;
- request traces (``load_trace``): any bytes, CSV and JSONL shaped junk, any options: a trace, or a
  ``TraceError`` naming the file (and the line and column when the problem is in one).

Never a hang: nothing here may take long (the per-test timeout ends one that does). What the fuzzer found
stays as an ``@example`` of the property that found it. ``FLEETWARD_FUZZ_EXAMPLES`` sets the examples per
property (default 150; raise it for a longer hunt), ``FLEETWARD_FUZZ_RANDOM=1`` draws new inputs each run.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import math
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import fleetward.chaos
from fleetward.autoscale.traces import FORMATS, Trace, TraceError, load_trace
from fleetward.chaos.validation import load_experiment
from fleetward.fleet.config import FleetConfig, load_fleet_config
from fleetward.fleet.errors import ConfigError
from fleetward.fleet.sse import sse_data, sse_lines
from fleetward.migration.upstream import Chunk, SseReader, UpstreamError, _parse

DERANDOMIZE = not os.environ.get("FLEETWARD_FUZZ_RANDOM")  # FLEETWARD_FUZZ_RANDOM=1: new inputs each run
EXAMPLES = int(os.environ.get("FLEETWARD_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=DERANDOMIZE, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large, HealthCheck.filter_too_much])
ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted((Path(fleetward.chaos.__file__).parent / "experiments").glob("*.yaml"))
FLEET_EXAMPLE = ROOT / "deploy" / "fleet.example.yaml"


# -- helpers --------------------------------------------------------------------------------------------


def cut(body: bytes, at: list[int]) -> list[bytes]:
    """``body`` in pieces, cut at the offsets ``at`` (any order, any repeats)."""
    points = sorted({min(max(0, a), len(body)) for a in at} | {0, len(body)})
    return [body[a:b] for a, b in itertools.pairwise(points)] or [b""]


async def _aiter(pieces: list[bytes]) -> AsyncIterator[bytes]:
    for piece in pieces:
        yield piece


def _write(tmp_path: Path, name: str, content: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    return path


def assert_names_the_place(err: ConfigError, path: Path) -> None:
    """A refusal of a file's content says which file and which line, and what is wrong."""
    assert err.file == str(path), err
    assert err.line is not None and err.line >= 1, err
    assert err.problem, err


# Scalars and small trees of them: the values a YAML file or a JSON line can hold, the awkward ones included.
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(), st.text(max_size=20),
                    st.sampled_from(["", "0", "-1", "1e999", "nan", "inf", "2001-02-30", "0b_", "~", "yes", ":",
                                     "127.0.0.1:0", "a" * 70, "http://", "é", "\x00"]))
JUNK = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                    max_leaves=12)

# -- server-sent events -----------------------------------------------------------------------------------

_EOL = re.compile(rb"\r\n|\r|\n")
SSE_BYTES = st.one_of(
    st.binary(max_size=200),
    st.lists(st.sampled_from([b"\r", b"\n", b"\r\n", b"data: ", b"id: 1", b"x", b":", b"\xe2\x80\xa8", b"\xc2\x85",
                              b"\xff", b"\xe2\x82", b"[DONE]", b"{}"]), max_size=40).map(b"".join))


def sse_reference(body: bytes) -> list[str]:
    """The lines the SSE spec reads from a whole body: ended by CR, LF or CRLF; an unterminated last one (or
    one whose CR may be half a CRLF, the body having ended there) is dropped."""
    if body.endswith(b"\r"):
        body = body[:-1] + b"x"  # as if more came: the line is not known to be ended
    lines = _EOL.split(body)[:-1]
    return [line.decode("utf-8", errors="replace") for line in lines]


@FUZZ
@given(body=SSE_BYTES, at=st.lists(st.integers(0, 200), max_size=8))
@example(body=b"data: \xe2\x80\xa8x\r\n\r\n", at=[7, 10])  # U+2028 inside a line is not a line end
@example(body=b"a\r\nb\r", at=[2])  # a CRLF cut between its CR and LF is one line end
def test_sse_lines_are_the_specs_lines_wherever_the_body_is_cut(body: bytes, at: list[int]) -> None:
    async def lines() -> list[str]:
        return [line async for line in sse_lines(_aiter(cut(body, at)))]

    assert asyncio.run(lines()) == sse_reference(body)


# -- the router's reader of a worker's stream ---------------------------------------------------------------

CHUNK_KEYS = ["choices", "error", "usage", "prompt_token_ids", "id", "object"]
CHOICE_KEYS = ["text", "delta", "token_ids", "finish_reason", "stop_reason", "prompt_token_ids", "logprobs", "index"]


@st.composite
def chunk_shaped(draw: st.DrawFn) -> Any:
    """Mostly what vLLM sends, with any key's value sometimes junk: reaches every branch of the parser."""

    def maybe(good: st.SearchStrategy[Any]) -> Any:
        return draw(st.one_of(good, JUNK) if draw(st.booleans()) else good)

    choice: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(CHOICE_KEYS), unique=True, max_size=len(CHOICE_KEYS))):
        good = {"text": st.text(max_size=5), "delta": st.fixed_dictionaries({}, optional={
                    "content": st.text(max_size=5), "role": st.just("assistant")}),
                "token_ids": st.lists(st.integers(0, 300), max_size=3),
                "finish_reason": st.sampled_from([None, "stop", "length"]),
                "stop_reason": st.one_of(st.none(), st.integers(0, 300), st.text(max_size=3)),
                "prompt_token_ids": st.lists(st.integers(0, 300), max_size=3),
                "logprobs": st.none(), "index": st.just(0)}[key]
        choice[key] = maybe(good)
    chunk: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(CHUNK_KEYS), unique=True, max_size=3)):
        chunk[key] = maybe(st.just([choice]) if key == "choices" else JUNK)
    return chunk if draw(st.integers(0, 9)) else draw(JUNK)


def check_chunk(chunk: Chunk | None) -> None:
    if chunk is None:
        return
    assert isinstance(chunk.text, str)
    assert isinstance(chunk.token_ids, list) and all(type(t) is int for t in chunk.token_ids)
    assert chunk.prompt_token_ids is None or all(type(t) is int for t in chunk.prompt_token_ids)
    assert chunk.finish_reason is None or isinstance(chunk.finish_reason, str)
    assert chunk.stop_reason is None or type(chunk.stop_reason) in (str, int)


@FUZZ
@given(payload=st.one_of(chunk_shaped().map(lambda v: json.dumps(v).encode()), st.binary(max_size=60)))
@example(payload=b"[]")  # found: a JSON array was an AttributeError, not a bad chunk
@example(payload=b"3")  # found: a number was a TypeError ("in" on an int)
@example(payload=b'{"choices": {"a": 1}}')  # found: choices an object was a KeyError
@example(payload=b'{"choices": ["x"]}')  # found: a choice that is not an object was an AttributeError
@example(payload=b'{"choices": [{"delta": [], "token_ids": [1]}]}')  # found: AttributeError
@example(payload=b'{"choices": [{"text": "a", "token_ids": ["x"]}]}')  # found: passed on, broke the journal
def test_a_worker_chunk_is_a_chunk_of_the_right_types_or_an_upstream_error(payload: bytes) -> None:
    try:
        chunk = _parse(payload)
    except UpstreamError as exc:
        assert exc.kind in ("bad_chunk", "error_event") and exc.message
        return
    check_chunk(chunk)


def read_stream(pieces: list[bytes]) -> tuple[list[Chunk], str | None]:
    """The chunks a worker's stream gives, and the kind of the error that ended it (None: it finished): what
    the router's reader (:class:`SseReader`) makes of the body as the socket gave it."""
    got: list[Chunk] = []
    reader = SseReader()
    try:
        for piece in pieces:
            reader.feed(piece, got.append)
        reader.end(got.append)
    except UpstreamError as exc:
        return got, exc.kind
    return got, None


STREAM_EVENT = st.one_of(
    chunk_shaped().map(lambda v: b"data: " + json.dumps(v).encode()),
    st.sampled_from([b"data: [DONE]", b": keepalive", b"data:", b"event: x", b"data: {", b""]),
    st.binary(max_size=20))


@FUZZ
@given(events=st.lists(STREAM_EVENT, max_size=6), sep=st.sampled_from([b"\n\n", b"\r\n\r\n", b"\n", b"\r\r"]),
       at=st.lists(st.integers(0, 400), max_size=6))
def test_a_worker_stream_gives_the_same_chunks_or_error_wherever_it_is_cut(events: list[bytes], sep: bytes,
                                                                            at: list[int]) -> None:
    body = sep.join(events) + sep
    whole = read_stream([body])
    pieces = read_stream(cut(body, at))
    for chunk in whole[0]:
        check_chunk(chunk)
    assert pieces == whole


# -- the fleet file and experiment files ---------------------------------------------------------------------


def _nodes(tree: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += _nodes(v, (*path, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out += _nodes(v, (*path, i))
    return out


@st.composite
def mutated(draw: st.DrawFn, base: Any) -> Any:
    """``base`` with one to three of its values replaced by junk, or deleted."""
    tree = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_nodes(tree)))
        if not path:
            tree = draw(JUNK)
            continue
        parent = tree
        for part in path[:-1]:
            parent = parent[part]
        if draw(st.integers(0, 4)) == 0:
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(JUNK)
    return tree


def yaml_of(tree: Any) -> bytes:
    return yaml.safe_dump(tree, allow_unicode=True).encode()


def _fleet_fields() -> list[str]:
    names = list(FleetConfig.model_fields)
    for field in FleetConfig.model_fields.values():
        inner = getattr(field.annotation, "model_fields", None)
        names += list(inner or ())
    return names


FLEET_TREES = st.dictionaries(st.sampled_from(_fleet_fields()), JUNK, max_size=4)
YAML_TEXT = st.lists(st.sampled_from(["a: 1", "- x", "  ", ": ", "&a", "*a", "!!python/object:os.system", "[", "]",
                                      "{", "}", "'", '"', "#", "---", "\t", "\n", "2001-02-30", "<<: *a", "? "]),
                     max_size=20).map(lambda parts: "".join(parts).encode())
_BILLION_LAUGHS = b"a: &a [1,1,1,1,1,1,1,1,1]\n" + b"".join(
    b"%c: &%c [%s]\n" % (c, c, b",".join([b"*%c" % (c - 1)] * 9)) for c in range(ord("b"), ord("i")))
# Found by reading (the fuzzer then confirmed each): an uncaught exception of another type, or a hang.
YAML_FINDINGS = [
    b"\xff\xfecluster: x\n",  # not UTF-8: UnicodeDecodeError
    b"cluster: 2001-02-30\n",  # a date that does not exist: ValueError from PyYAML's constructor
    b"cluster: 0b_\n",  # a binary number without digits: ValueError
    b"? [a, b]\n: 1\n",  # a key that cannot be a key: ConstructorError (a YAMLError, but not caught there)
    b"cluster: !!python/object:os.system {}\n",  # an unsafe tag: ConstructorError, likewise
    b"attach: &a [*a]\n",  # an alias within itself: RecursionError
    b"cluster: " + b"[" * 3000 + b"]" * 3000 + b"\n",  # deep nesting: RecursionError
    _BILLION_LAUGHS,  # aliases expanding to 9^8 values: a hang
    b"cluster: a\nx: \x00\n",  # found: a character YAML refuses was an error without a line
]


def check_fleet_file(tmp_path: Path, content: bytes) -> None:
    path = _write(tmp_path, "fleet.yaml", content)
    try:
        config = load_fleet_config(path)
    except ConfigError as err:
        assert_names_the_place(err, path)
        return
    assert isinstance(config, FleetConfig)


@FUZZ
@given(content=st.one_of(st.binary(max_size=300), YAML_TEXT, FLEET_TREES.map(yaml_of), JUNK.map(yaml_of)))
@example(content=YAML_FINDINGS[0])
@example(content=YAML_FINDINGS[1])
@example(content=YAML_FINDINGS[2])
@example(content=YAML_FINDINGS[3])
@example(content=YAML_FINDINGS[4])
@example(content=YAML_FINDINGS[5])
@example(content=YAML_FINDINGS[6])
@example(content=YAML_FINDINGS[7])
@example(content=YAML_FINDINGS[8])
def test_a_fleet_file_is_a_config_or_an_error_naming_file_and_line(tmp_path: Path, content: bytes) -> None:
    check_fleet_file(tmp_path, content)


@FUZZ
@given(data=st.data())
def test_the_example_fleet_file_with_junk_in_it_is_a_config_or_an_error_naming_file_and_line(
        tmp_path: Path, data: st.DataObject) -> None:
    base = yaml.safe_load(FLEET_EXAMPLE.read_text())
    check_fleet_file(tmp_path, yaml_of(data.draw(mutated(base))))


def check_experiment_file(tmp_path: Path, content: bytes) -> None:
    path = _write(tmp_path, "experiment.yaml", content)
    try:
        load_experiment(path)
    except ConfigError as err:
        assert_names_the_place(err, path)


@FUZZ
@given(content=st.one_of(st.binary(max_size=300), YAML_TEXT, JUNK.map(yaml_of)))
@example(content=YAML_FINDINGS[0])
@example(content=YAML_FINDINGS[5])
@example(content=YAML_FINDINGS[7])
@example(content=b"# nothing but a comment\n")  # found: what an empty file lacks was reported without a line
def test_an_experiment_file_is_an_experiment_or_an_error_naming_file_and_line(tmp_path: Path,
                                                                            content: bytes) -> None:
    check_experiment_file(tmp_path, content)


@pytest.mark.parametrize("shipped", EXPERIMENTS, ids=lambda p: p.stem)
def test_the_shipped_experiments_with_junk_in_them_are_experiments_or_errors_naming_file_and_line(
        tmp_path: Path, shipped: Path) -> None:
    base = yaml.safe_load(shipped.read_text())

    @settings(FUZZ, max_examples=max(10, EXAMPLES // len(EXPERIMENTS)))
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        check_experiment_file(tmp_path, yaml_of(data.draw(mutated(base))))

    run()


# -- request traces ------------------------------------------------------------------------------------------

CELL = st.one_of(st.integers(-5, 10**6).map(str), st.floats().map(repr), st.text(max_size=8),
                 st.datetimes().map(str), st.datetimes(timezones=st.timezones()).map(lambda d: d.isoformat()),
                 st.sampled_from(["", "1e999", "-0", "0x10", "1_000", "nan", "2023-11-16 18:15:46.6805900"]))


@st.composite
def csv_shaped(draw: st.DrawFn) -> bytes:
    columns = list(draw(st.sampled_from([cols for name, cols in FORMATS.items() if name != "mooncake"])))
    columns += draw(st.lists(st.sampled_from(["extra", *columns]), max_size=2))
    columns = draw(st.permutations(columns))
    rows = draw(st.lists(st.lists(CELL, min_size=len(columns) - 1, max_size=len(columns) + 1), max_size=6))
    lines = [",".join(columns), *(",".join(c.replace(",", "") for c in row) for row in rows)]
    return ("\n".join(lines) + "\n").encode()


@st.composite
def jsonl_shaped(draw: st.DrawFn) -> bytes:
    keys = FORMATS["mooncake"]
    good = st.fixed_dictionaries({k: st.one_of(st.integers(0, 10**6), st.floats(), JUNK) for k in keys})
    lines = draw(st.lists(st.one_of(good, JUNK).map(json.dumps), max_size=6))
    return ("\n".join(lines) + "\n").encode()


OPTION = st.one_of(st.just(1.0), st.floats(), st.floats(min_value=0.1, max_value=10))


@FUZZ
@given(content=st.one_of(st.binary(max_size=300), csv_shaped(), jsonl_shaped()),
       suffix=st.sampled_from([".csv", ".jsonl", ".txt"]), speed=OPTION, rate_scale=OPTION,
       limit_s=st.one_of(st.none(), st.floats()))
@example(content=b"TIMESTAMP,ContextTokens,GeneratedTokens\n0001-01-01 00:00:00+01:00,1,1\n", suffix=".csv",
         speed=1.0, rate_scale=1.0, limit_s=None)  # found: a time before year 1 in UTC was an OverflowError
@example(content=b'{"timestamp": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", suffix=".jsonl", speed=1.0,
         rate_scale=1.0, limit_s=None)  # found by reading: deep nesting was a RecursionError
@example(content=b"arrival_s,input_tokens,output_tokens\n0,1,1\n", suffix=".csv", speed=1.0, rate_scale=1e300,
         limit_s=None)  # found: one request times 1e300 copies was a hang
def test_a_trace_is_a_trace_or_an_error_naming_the_file(tmp_path: Path, content: bytes, suffix: str, speed: float,
                                                        rate_scale: float, limit_s: float | None) -> None:
    path = _write(tmp_path, f"trace{suffix}", content)
    try:
        trace = load_trace(path, speed=speed, rate_scale=rate_scale, limit_s=limit_s)
    except TraceError as err:
        assert err.problem
        assert err.file == str(path) or err.field in ("speed", "rate_scale", "limit_s"), err
        return
    assert isinstance(trace, Trace) and trace.requests
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0 and all(math.isfinite(a) for a in arrivals)


@pytest.fixture(scope="module")
def vocabularies() -> list[Any]:
    from fleetward.fleet.vocab import load_vocabulary

    return [load_vocabulary(name) for name in ("byte", "bpe", "sp")]


IDS = st.lists(st.one_of(st.integers(0, 300), st.integers(-2**40, 2**40)), max_size=6)


@FUZZ
@given(prompt=IDS, generated=IDS, which=st.integers(0, 2))
@example(prompt=[-1], generated=[1], which=0)  # found: a negative prompt id was an OverflowError in the router
@example(prompt=[2**40], generated=[2], which=1)  # found: so was one beyond 2^32
def test_any_ids_a_worker_reports_are_turned_into_text_without_an_error(vocabularies: list[Any], prompt: list[int],
                                                                       generated: list[int], which: int) -> None:
    """What a worker's chunks carry (prompt ids, generated ids) reaches the router's detokenizer as is."""
    text = vocabularies[which].detokenizer(prompt).feed(generated)
    assert isinstance(text, str)


def test_a_payload_nested_too_deep_is_a_json_error_not_a_recursion_error() -> None:
    """A worker (or anything in the path) that sends a deeply nested JSON payload: the workload's reader says
    it is not JSON it can read, as for any malformed payload (json's own parser raised RecursionError)."""
    async def body() -> AsyncIterator[bytes]:
        yield b"data: " + b"[" * 100_000 + b"]" * 100_000 + b"\n\ndata: [DONE]\n\n"

    async def read() -> list[Any]:
        return [x async for x in sse_data(body())]

    with pytest.raises(json.JSONDecodeError):
        asyncio.run(read())
