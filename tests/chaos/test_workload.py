"""The workload's plan: repeatable from the seed, shaped as asked, traces replayed with their lengths."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fleetward.chaos.experiment import Arrival, Lengths, WorkloadSpec
from fleetward.chaos.workload import make_prompt, plan_arrivals, read_trace, sample_length
from fleetward.fleet.errors import ConfigError
from fleetward.sim.tokenizer import decode


def spec(**kw: object) -> WorkloadSpec:
    return WorkloadSpec.model_validate({"duration_s": 10, "arrival": {"kind": "poisson", "rate": 5}, **kw})


def test_the_plan_is_a_pure_function_of_the_seed() -> None:
    a, b = plan_arrivals(spec(), seed=1), plan_arrivals(spec(), seed=1)
    assert a == b
    other = plan_arrivals(spec(), seed=2)
    assert [p.t for p in a] != [p.t for p in other] and [p.prompt for p in a] != [p.prompt for p in other]
    assert all(0 <= p.t < 10 for p in a) and [p.t for p in a] == sorted(p.t for p in a)


def test_constant_arrivals_are_evenly_spaced() -> None:
    plan = plan_arrivals(spec(arrival={"kind": "constant", "rate": 4}), seed=0)
    assert len(plan) == 40
    assert [round(p.t, 6) for p in plan[:3]] == [0.0, 0.25, 0.5]


def test_lengths_follow_their_distribution_within_bounds() -> None:
    rng = random.Random(0)
    assert sample_length(Lengths.model_validate(64), rng) == 64
    uni = [sample_length(Lengths(dist="uniform", min=10, max=20), rng) for _ in range(500)]
    assert min(uni) == 10 and max(uni) == 20
    logn = Lengths(dist="lognormal", median=100, sigma=1.0, min=5, max=400)
    drawn = sorted(sample_length(logn, rng) for _ in range(2000))
    assert drawn[0] >= 5 and drawn[-1] <= 400
    assert 80 <= drawn[len(drawn) // 2] <= 125  # the median, loosely
    plan = plan_arrivals(spec(isl={"dist": "uniform", "min": 3, "max": 9}, osl=7), seed=4)
    assert {len(p.prompt) for p in plan} <= set(range(3, 10)) and {p.max_tokens for p in plan} == {7}


def test_prompts_are_printable_token_ids_from_the_seed() -> None:
    p = make_prompt(9, "workload", 3, 50)
    assert p == make_prompt(9, "workload", 3, 50) != make_prompt(9, "workload", 4, 50)
    assert len(p) == 50 and decode(p).isprintable()


@pytest.mark.parametrize("fmt", ["servegen", "azure"])
def test_a_trace_is_replayed_with_its_times_and_lengths_scaled(tmp_path: Path, fmt: str) -> None:
    rows = [(0.0, 100, 10), (1.0, 2000, 400), (2.5, 40, 20), (4.0, 10, 10), (9.0, 1, 1)]
    path = tmp_path / "trace.csv"
    if fmt == "servegen":
        path.write_text("arrival_s,input_tokens,output_tokens\n" + "".join(f"{t},{i},{o}\n" for t, i, o in rows))
    else:
        path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
            f"2023-11-16 18:15:{int(t):02d}.{int((t % 1) * 10)}000000,{i},{o}\n" for t, i, o in rows))
    assert [r[0] for r in read_trace(path, start_s=1.0, span_s=3.0)] == [0.0, 1.5]
    wl = spec(duration_s=4, arrival=Arrival(kind="trace", file=str(path), start_s=1.0, time_scale=2.0,
                                             token_scale=0.5, max_input_tokens=500, max_output_tokens=100))
    plan = plan_arrivals(wl, seed=0)
    # Trace seconds 1.0 and 2.5 fall in the 2 s of trace that 4 s of run cover at twice the gaps.
    assert [(p.t, len(p.prompt), p.max_tokens) for p in plan] == [(0.0, 500, 100), (3.0, 20, 10)]


def test_a_trace_with_unknown_columns_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("when,in,out\n1,2,3\n")
    with pytest.raises(ConfigError, match="unknown trace columns"):
        read_trace(path, start_s=0, span_s=10)


def test_a_trace_shipped_with_fleetward_replays_by_its_name() -> None:
    wl = spec(duration_s=5, arrival={"kind": "trace", "file": "azure2023_conv.csv", "time_scale": 0.5})
    plan = plan_arrivals(wl, seed=0)  # found among the traces fleetward ships (chaos/traces)
    assert plan and all(1 <= len(p.prompt) <= 1024 and 1 <= p.max_tokens <= 256 for p in plan)


async def test_sse_lines_end_only_at_cr_lf_or_crlf() -> None:
    from fleetward.chaos.workload import sse_lines

    # Token text JSON leaves unescaped (U+0085, U+2028, U+001C) must not end a line; CRLF split across
    # chunks is one line end; an unterminated last line is dropped.
    body = 'id: r:1\r\ndata: {"text": "a\u0085b\u2028c\u001cd"}\r\n\r\ndata: [DONE]\n\ndata: {"cut'.encode()
    for size in (1, 2, 3, 7, len(body)):
        async def chunks(size: int = size) -> AsyncIterator[bytes]:
            for i in range(0, len(body), size):
                yield body[i:i + size]

        lines = [line async for line in sse_lines(chunks())]
        assert lines == ["id: r:1", 'data: {"text": "a\u0085b\u2028c\u001cd"}', "", "data: [DONE]", ""], size
