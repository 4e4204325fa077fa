"""Request traces: the real files in the shared traces folder, the formats by their columns, bad input."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fleetward.autoscale.traces import Trace, TraceError, load_trace

SHARED = Path(__file__).resolve().parents[3] / "shared" / "traces"
real = pytest.mark.skipif(not SHARED.is_dir(), reason="the shared traces folder is not on this machine")


@real
def test_the_azure_trace_loads_with_wall_clock_times_as_seconds() -> None:
    t = load_trace(SHARED / "azure2023_conv.csv")
    assert (t.format, len(t.requests)) == ("azure", 19366)
    assert t.requests[0].arrival_s == 0.0 and 57 * 60 < t.duration_s < 59 * 60
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(t.requests, t.requests[1:], strict=False))


@real
def test_the_servegen_rate_trace_becomes_poisson_arrivals_at_its_rates() -> None:
    path = SHARED / "servegen_m-large_rate_10min_days0-6.csv"
    t = load_trace(path, limit_s=6 * 3600, rate_scale=0.05)
    lines = path.read_text().splitlines()[1:]
    expected = sum(0.05 * float(line.split(",")[1]) * 600 for line in lines if float(line.split(",")[0]) < 6 * 3600)
    assert t.format == "servegen-rate" and abs(len(t.requests) - expected) < 0.02 * expected
    assert load_trace(path, limit_s=600) == load_trace(path, limit_s=600)  # seeded
    with pytest.raises(TraceError, match="scale the rate down"):
        load_trace(path)  # seven days at ~200 req/s


def write(tmp: Path, name: str, text: str) -> Path:
    p = tmp / name
    p.write_text(text, encoding="utf-8")
    return p


def test_columns_in_any_order_with_extras_a_bom_and_options(tmp_path: Path) -> None:
    p = write(tmp_path, "s.csv", "\ufeffoutput_tokens,extra,arrival_s,input_tokens\n5,x,10.0,7\n6,y,4.0,8\n9,z,30,1\n")
    t = load_trace(p)
    assert t == Trace("s", "servegen", t.requests)
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in t.requests] == [(0, 8, 6), (6, 7, 5), (26, 1, 9)]
    assert load_trace(p, speed=2).duration_s == 13
    assert len(load_trace(p, rate_scale=2).requests) == 6
    assert len(load_trace(p, limit_s=10).requests) == 2
    assert t.rate_per_interval(10) == [0.2, 0.0, 0.1]
    mooncake = write(tmp_path, "m.jsonl",
                     '{"timestamp": 1000, "input_length": 3, "output_length": 4, "hash_ids": [1]}\n'
                     '{"timestamp": 3500, "input_length": 5, "output_length": 6}\n')
    m = load_trace(mooncake)
    assert m.format == "mooncake" and [r.arrival_s for r in m.requests] == [0.0, 2.5]


def test_thinning_is_seeded_and_keeps_about_the_share_asked(tmp_path: Path) -> None:
    rows = "".join(f"{i * 0.1:.1f},10,10\n" for i in range(2000))
    p = write(tmp_path, "big.csv", "arrival_s,input_tokens,output_tokens\n" + rows)
    half = load_trace(p, rate_scale=0.5, seed=3)
    assert abs(len(half.requests) - 1000) < 100 and half == load_trace(p, rate_scale=0.5, seed=3)


@pytest.mark.parametrize("name, text, message", [
    ("a.csv", "when,prompt,answer\n1,2,3\n", "a.csv:1: columns when, prompt, answer are not a trace format"),
    ("b.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,abc\n",
     "b.csv:2: column GeneratedTokens: 'abc' is not an integer"),
    ("c.csv", "arrival_s,input_tokens,output_tokens\n1.0,-4,3\n", "c.csv:2: column input_tokens: '-4' must be"),
    ("d.jsonl", '{"timestamp": 1, "input_length": 2, "output_length": 3}\nnot json\n', "d.jsonl:2: not a JSON object"),
    ("e.csv", "arrival_s,input_tokens,output_tokens\n", "e.csv: the trace has no requests"),
    ("f.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n", "f.csv:2: column TIMESTAMP"),
])
def test_bad_files_name_the_file_line_and_reason(tmp_path: Path, name: str, text: str, message: str) -> None:
    with pytest.raises(TraceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_trace(write(tmp_path, name, text))


def test_bad_options_and_missing_files_are_clear(tmp_path: Path) -> None:
    p = write(tmp_path, "ok.csv", "arrival_s,input_tokens,output_tokens\n1,2,3\n")
    with pytest.raises(TraceError, match="speed must be > 0"):
        load_trace(p, speed=0)
    with pytest.raises(TraceError, match="no such trace file"):
        load_trace(tmp_path / "missing.csv")
    assert not math.isnan(load_trace(p).duration_s)
