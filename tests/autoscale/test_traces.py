"""Request traces: the real files fleetward ships (chaos/traces), each format by its columns, the load options,
and bad input named by file and line."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from fleetward.autoscale.traces import FORMATS, Trace, TraceError, TraceRequest, load_trace
from fleetward.fleet.errors import ConfigError

SHARED = Path(__file__).resolve().parents[2] / "chaos" / "traces"
REQUESTS = "arrival_s,input_tokens,output_tokens\n"


def write(tmp: Path, name: str, text: str) -> Path:
    p = tmp / name
    p.write_text(text, encoding="utf-8")
    return p


def arrivals(t: Trace) -> list[float]:
    return [r.arrival_s for r in t.requests]


def is_sorted(t: Trace) -> bool:
    return all(a.arrival_s <= b.arrival_s for a, b in zip(t.requests, t.requests[1:], strict=False))


@pytest.fixture(scope="module")
def azure() -> Trace:
    return load_trace(SHARED / "azure2023_conv.csv")


@pytest.fixture(scope="module")
def servegen_day() -> Trace:
    return load_trace(SHARED / "servegen_m-large_day0_peak10rps.csv")


def test_the_azure_trace_is_19366_requests_over_58_minutes(azure: Trace) -> None:
    assert (azure.name, azure.format, len(azure.requests)) == ("azure2023_conv", "azure", 19366)
    assert azure.requests[0] == TraceRequest(0.0, 374, 44)
    assert azure.requests[1].arrival_s == pytest.approx(50.9951690 - 46.6805900)  # 7 fractional digits read
    assert is_sorted(azure) and 57.5 * 60 < azure.duration_s < 58.5 * 60


def test_the_servegen_day_is_242856_requests_from_zero(servegen_day: Trace) -> None:
    assert (servegen_day.format, len(servegen_day.requests)) == ("servegen", 242856)
    assert servegen_day.requests[0] == TraceRequest(0.0, 2480, 353)  # the first arrival (0.018 s) becomes 0
    assert is_sorted(servegen_day) and 86_000 < servegen_day.duration_s < 86_400


def test_the_rate_trace_makes_as_many_requests_as_its_windows_hold() -> None:
    path = SHARED / "servegen_m-large_rate_10min_days0-6.csv"
    rates = [float(line.split(",")[1]) for line in path.read_text().splitlines()[1:]]
    scale = 0.002  # the whole week is ~1.3e8 requests: a 1/500 sample keeps the test quick
    t = load_trace(path, rate_scale=scale)
    expected = scale * sum(rate * 600 for rate in rates)
    assert t.format == "servegen-rate" and abs(len(t.requests) - expected) < 0.02 * expected
    assert is_sorted(t) and 0 <= t.requests[0].arrival_s and len(rates) * 600 - 60 < t.duration_s < len(rates) * 600
    with pytest.raises(TraceError, match=re.escape(f"{path}: about 126,735,053 requests")):
        load_trace(path)  # refused before making them


def test_columns_match_by_name_in_any_order_with_extra_columns(tmp_path: Path) -> None:
    p = write(tmp_path, "shuffled.csv", "output_tokens,extra,arrival_s,input_tokens\n5,x,10.0,7\n6,y,4.0,8\n9,z,30,1\n")
    t = load_trace(p)
    assert (t.name, t.format) == ("shuffled", "servegen")
    assert t.requests == (TraceRequest(0.0, 8, 6), TraceRequest(6.0, 7, 5), TraceRequest(26.0, 1, 9))


def test_a_bom_does_not_hide_the_first_column(tmp_path: Path) -> None:
    p = write(tmp_path, "bom.csv", "\ufeffTIMESTAMP,ContextTokens,GeneratedTokens\n"
                                   "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:16:46.6805900,10,20\n")
    t = load_trace(p)
    assert t.format == "azure" and t.requests == (TraceRequest(0.0, 374, 44), TraceRequest(60.0, 10, 20))


def test_mooncake_jsonl_timestamps_are_milliseconds(tmp_path: Path) -> None:
    lines = ('{"timestamp": 1000, "input_length": 3, "output_length": 4, "hash_ids": [1, 2]}\n\n'
             '{"timestamp": 3500, "input_length": 5, "output_length": 6}\n')
    for name in ("m.jsonl", "m.txt"):  # by the suffix, or by the first character
        t = load_trace(write(tmp_path, name, lines))
        assert t.format == "mooncake" and t.requests == (TraceRequest(0.0, 3, 4), TraceRequest(2.5, 5, 6))


def test_speed_divides_every_arrival(tmp_path: Path) -> None:
    p = write(tmp_path, "s.csv", REQUESTS + "10,1,1\n14,1,1\n40,1,1\n")
    assert arrivals(load_trace(p, speed=2)) == [0.0, 2.0, 15.0]
    assert load_trace(p, speed=0.5).duration_s == 60.0


def test_rate_scale_below_one_thins_reproducibly_without_moving_the_timeline(tmp_path: Path) -> None:
    p = write(tmp_path, "many.csv", REQUESTS + "".join(f"{i / 10},10,10\n" for i in range(2000)))
    half = load_trace(p, rate_scale=0.5, seed=3)
    assert abs(len(half.requests) - 1000) < 100
    assert half == load_trace(p, rate_scale=0.5, seed=3) != load_trace(p, rate_scale=0.5, seed=4)
    whole = set(arrivals(load_trace(p)))
    assert set(arrivals(half)) <= whole  # kept requests keep their times


def test_rate_scale_above_one_repeats_each_request_at_its_arrival(tmp_path: Path) -> None:
    p = write(tmp_path, "few.csv", REQUESTS + "0,1,2\n1.5,3,4\n7,5,6\n")
    base = load_trace(p).requests
    assert load_trace(p, rate_scale=2.0).requests == tuple(r for r in base for _ in range(2))
    n = len(load_trace(p, rate_scale=2.5).requests)
    assert 6 <= n <= 9 and load_trace(p, rate_scale=2.5).requests == load_trace(p, rate_scale=2.5).requests


def test_limit_keeps_the_requests_before_it_after_speed(tmp_path: Path) -> None:
    p = write(tmp_path, "s.csv", REQUESTS + "0,1,1\n10,1,1\n20,1,1\n30,1,1\n")
    assert arrivals(load_trace(p, limit_s=20)) == [0.0, 10.0]
    assert arrivals(load_trace(p, speed=2, limit_s=10)) == [0.0, 5.0]


def test_a_rate_trace_is_seeded_and_its_last_window_lasts_as_the_one_before(tmp_path: Path) -> None:
    p = write(tmp_path, "rates.csv", "active_clients,aggregate_rate_rps,window_start_s\n3,0,100\n3,2.0,200\n")
    t = load_trace(p, seed=7)
    assert t == load_trace(p, seed=7) != load_trace(p, seed=8)
    assert t.format == "servegen-rate" and 100 < len(t.requests) < 300  # rate 2 over 100 s
    assert 100 <= t.requests[0].arrival_s and t.duration_s < 200  # from the first window's start, which was 0
    assert all(r.input_tokens >= 1 and r.output_tokens >= 1 for r in t.requests)
    assert len(load_trace(p, rate_scale=0.5, seed=7).requests) < len(t.requests)
    assert load_trace(p, speed=2, seed=7).duration_s == pytest.approx(t.duration_s / 2)


def test_rate_per_interval_counts_requests_per_second_in_each_window(tmp_path: Path) -> None:
    t = load_trace(write(tmp_path, "s.csv", REQUESTS + "10,1,1\n12,1,1\n36,1,1\n"))
    assert t.rate_per_interval(10) == [0.2, 0.0, 0.1]
    assert Trace("empty", "servegen", ()).rate_per_interval(10) == [0.0]
    with pytest.raises(ValueError, match="interval_s"):
        t.rate_per_interval(0)


@pytest.mark.parametrize(("name", "text", "message"), [
    ("header.csv", "when,prompt,answer\n1,2,3\n",
     "header.csv:1: columns when, prompt, answer match no trace format; recognised: azure: TIMESTAMP, ContextTokens, "
     "GeneratedTokens; servegen: arrival_s, input_tokens, output_tokens; mooncake (JSONL): timestamp"),
    ("value.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,abc\n",
     "value.csv:2: column GeneratedTokens: 'abc' is not an integer"),
    ("negative.csv", REQUESTS + "0,1,1\n1.0,-4,3\n", "negative.csv:3: column input_tokens: '-4' is negative"),
    ("when.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n",
     "when.csv:2: column TIMESTAMP: 'yesterday' is not a date and time"),
    ("nan.csv", REQUESTS + "nan,1,1\n", "nan.csv:2: column arrival_s: 'nan' is not a finite number >= 0"),
    ("short.csv", REQUESTS + "0,1,1\n\n2,3\n", "short.csv:4: 2 fields where the header has 3"),
    ("lines.jsonl", '{"timestamp": 1, "input_length": 2, "output_length": 3}\nnot json\n', "lines.jsonl:2: not JSON"),
    ("keys.jsonl", '{"timestamp": 1, "input_length": 2}\n', "keys.jsonl:1: no key 'output_length'"),
    ("list.jsonl", "[1, 2]\n", "list.jsonl:1: a list, not a JSON object"),
    ("float.jsonl", '{"timestamp": 1, "input_length": 2.5, "output_length": 3}\n',
     "float.jsonl:1: key input_length: 2.5 is not an integer"),
    ("header-only.csv", REQUESTS, "header-only.csv: the trace has no requests"),
    ("empty.csv", "", "empty.csv:1: columns none (empty file) match no trace format"),
    ("twice.csv", "arrival_s,input_tokens,arrival_s,output_tokens\n1,2,3,4\n",
     "twice.csv:1: column arrival_s: appears twice in the header"),
    ("window.csv", "window_start_s,aggregate_rate_rps\n0,1\n600,1\n0,2\n",
     "window.csv:4: column window_start_s: window '0' already starts on line 2"),
    ("one.csv", "window_start_s,aggregate_rate_rps\n0,1\n", "one.csv: one window only"),
])
def test_a_bad_file_is_named_with_its_line_and_reason(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(TraceError, match=re.escape(f"{path}{message.removeprefix(name)}")):
        load_trace(path)


def test_a_file_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "latin.csv"
    p.write_bytes(REQUESTS.encode() + b"0,1,1 \xe9\n")
    with pytest.raises(TraceError, match=re.escape(f"{p}: not UTF-8 text")):
        load_trace(p)


def test_a_missing_file_and_bad_options_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=re.escape(f"{tmp_path / 'missing.csv'}: no such trace file")):
        load_trace(tmp_path / "missing.csv")
    p = write(tmp_path, "ok.csv", REQUESTS + "1,2,3\n5,6,7\n")
    bad: list[tuple[str, Callable[[], Trace]]] = [
        ("speed", lambda: load_trace(p, speed=0.0)), ("speed", lambda: load_trace(p, speed=float("nan"))),
        ("rate_scale", lambda: load_trace(p, rate_scale=-1.0)), ("rate_scale", lambda: load_trace(p, rate_scale=0.0)),
    ]
    for option, load in bad:
        with pytest.raises(TraceError, match=rf"^{option}: must be a finite number > 0"):
            load()
    with pytest.raises(TraceError, match=r"^limit_s: must be > 0"):
        load_trace(p, limit_s=0)
    with pytest.raises(TraceError, match=re.escape(f"{p}: no request left with limit_s=None, rate_scale=1e-09")):
        load_trace(p, rate_scale=1e-9)
    rates = write(tmp_path, "rates.csv", "window_start_s,aggregate_rate_rps\n0,0\n100,1\n")
    with pytest.raises(TraceError, match=re.escape(f"{rates}: no request left with limit_s=50")):
        load_trace(rates, limit_s=50)
    zero = write(tmp_path, "zero.csv", "window_start_s,aggregate_rate_rps\n0,0\n100,0\n")
    with pytest.raises(TraceError, match=re.escape(f"{zero}: the trace has no requests")):
        load_trace(zero)


def test_trace_errors_are_config_errors_with_structured_fields(tmp_path: Path) -> None:
    p = write(tmp_path, "v.csv", REQUESTS + "0,1,x\n")
    with pytest.raises(ConfigError) as caught:
        load_trace(p)
    assert isinstance(caught.value, TraceError)
    assert (caught.value.file, caught.value.line, caught.value.field) == (str(p), 2, "column output_tokens")
    assert set(FORMATS) == {"azure", "servegen", "mooncake", "servegen-rate"}
