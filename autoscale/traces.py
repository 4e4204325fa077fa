"""Request traces, recognised by their columns, as arrivals with prompt and output lengths.

Formats (:data:`FORMATS`; matched by header name, so column order and extra columns do not matter):

- ``azure``: Azure LLM inference traces, ``TIMESTAMP,ContextTokens,GeneratedTokens`` (wall-clock times,
  often with 7 fractional digits, which are cut to the microseconds ``datetime`` holds);
- ``servegen``: ServeGen-style requests, ``arrival_s,input_tokens,output_tokens``;
- ``mooncake``: Mooncake JSONL, one object per line with ``timestamp`` (ms), ``input_length``,
  ``output_length`` (other keys ignored). A file is JSONL if it ends in ``.jsonl`` or starts with ``{``;
- ``servegen-rate``: request rates per window, ``window_start_s,aggregate_rate_rps``; each window becomes
  Poisson arrivals at its rate (the last window lasts as long as the one before it), with lengths drawn from
  lognormals of mean :data:`RATE_INPUT_MEAN` / :data:`RATE_OUTPUT_MEAN`.

Arrivals are seconds from the trace's start: the first request for request traces, the first window for
rate traces. ``speed`` divides every arrival (the rate grows by as much). ``rate_scale`` changes the rate,
not the timeline: below 1 each request is kept with that probability; above 1 each request is emitted
``floor(rate_scale)`` times plus once more with the fractional part's probability, the copies at the same
arrival. A rate trace applies ``rate_scale`` to its rates instead, which for Poisson arrivals is the same
in distribution and has no same-instant copies. Everything random comes from ``random.Random(seed)``.

Every problem is a :class:`TraceError` (a :class:`ConfigError`) whose message reads ``file:line: column X:
problem``; nothing is skipped silently.
"""

from __future__ import annotations

import csv
import json
import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from operator import itemgetter
from pathlib import Path
from typing import IO

from fleetward.fleet.errors import ConfigError

__all__ = ["FORMATS", "RATE_INPUT_MEAN", "RATE_OUTPUT_MEAN", "RATE_TOKEN_SIGMA", "Trace", "TraceError",
           "TraceRequest", "load_trace"]

FORMATS: dict[str, tuple[str, ...]] = {
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "servegen": ("arrival_s", "input_tokens", "output_tokens"),
    "mooncake": ("timestamp", "input_length", "output_length"),
    "servegen-rate": ("window_start_s", "aggregate_rate_rps"),
}
# Rate traces carry no lengths: these are ServeGen's orders of magnitude for a large chat model. The means
# are the lognormals' means (not medians); the shape gives a long tail (p99 about 5x the mean at 0.8).
RATE_INPUT_MEAN = 2000.0
RATE_OUTPUT_MEAN = 250.0
RATE_TOKEN_SIGMA = 0.8

# A week of a production rate trace is ~10^8 requests, gigabytes as objects: refuse before making them.
_MAX_GENERATED = 5_000_000
_EPOCH = datetime(1970, 1, 1)
_BEYOND_MICROSECONDS = re.compile(r"(\.\d{6})\d+")
_Raw = tuple[float, int, int]  # arrival in the file's time, input tokens, output tokens


class TraceError(ConfigError):
    """A trace file, or an option to load one, that cannot be used: ``file:line: column X: problem``."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float  # seconds from the trace's start
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Trace:
    name: str  # the file's stem
    format: str  # a key of FORMATS
    requests: tuple[TraceRequest, ...]  # by arrival

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    def rate_per_interval(self, interval_s: float) -> list[float]:
        """Requests per second in windows ``[k*interval_s, (k+1)*interval_s)``, up to the last arrival's."""
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        counts = [0] * (int(self.duration_s // interval_s) + 1)
        for r in self.requests:
            counts[int(r.arrival_s // interval_s)] += 1
        return [c / interval_s for c in counts]


def load_trace(path: str | Path, *, speed: float = 1.0, rate_scale: float = 1.0, seed: int = 0,
               limit_s: float | None = None) -> Trace:
    """The trace at ``path``; ``limit_s`` keeps the requests arriving before it (after ``speed``)."""
    path = Path(path)
    for name, value in (("speed", speed), ("rate_scale", rate_scale)):
        if not (math.isfinite(value) and value > 0):
            raise TraceError(f"must be a finite number > 0, got {value!r}", field=name)
    if limit_s is not None and not limit_s > 0:
        raise TraceError(f"must be > 0 (or None for the whole trace), got {limit_s!r}", field="limit_s")
    if not path.exists():
        raise TraceError("no such trace file", file=str(path))
    if not path.is_file():
        raise TraceError("not a file", file=str(path))
    rng = random.Random(seed)
    try:
        with path.open(encoding="utf-8-sig", newline="") as f:
            if _is_jsonl(path, f):
                fmt, raw = "mooncake", _mooncake(path, f)
            else:
                fmt, raw = _csv(path, f, rng, rate_scale=rate_scale, speed=speed, limit_s=limit_s)
    except UnicodeDecodeError as exc:
        raise TraceError(f"not UTF-8 text ({exc.reason})", file=str(path)) from None
    except OSError as exc:
        raise TraceError(f"cannot read: {exc.strerror or exc}", file=str(path)) from exc
    if not raw and fmt != "servegen-rate":
        raise TraceError("the trace has no requests", file=str(path))
    if fmt != "servegen-rate":  # rate traces are made in order, already thinned, from their first window
        if len(raw) * rate_scale > _MAX_GENERATED:
            raise TraceError(f"{len(raw):,} requests times {rate_scale:g} is more than the {_MAX_GENERATED:,} this "
                             "makes; scale the rate down or cut the time (limit_s)", file=str(path), field="rate_scale")
        raw.sort(key=itemgetter(0))  # stable: ties keep the file's order
        origin = raw[0][0]  # before thinning, which must not move the timeline
        raw = [((t - origin) / speed, i, o) for t, i, o in _rescale(raw, rng, rate_scale)]
    requests = tuple(TraceRequest(t, i, o) for t, i, o in raw if limit_s is None or t < limit_s)
    if not requests:
        if limit_s is None and rate_scale == 1:
            raise TraceError("the trace has no requests", file=str(path))
        raise TraceError(f"no request left with limit_s={limit_s}, rate_scale={rate_scale}", file=str(path))
    return Trace(path.stem, fmt, requests)


def _rescale(raw: list[_Raw], rng: random.Random, rate_scale: float) -> list[_Raw]:
    whole = math.floor(rate_scale)
    frac = rate_scale - whole
    if frac == 0:
        return raw if whole == 1 else [r for r in raw for _ in range(whole)]
    return [r for r in raw for _ in range(whole + (rng.random() < frac))]


def _is_jsonl(path: Path, f: IO[str]) -> bool:
    if path.suffix.lower() == ".jsonl":
        return True
    first = ""
    while not first.strip():
        first = f.readline()
        if not first:
            break
    f.seek(0)  # the utf-8-sig decoder is reset and skips the BOM again
    return first.lstrip().startswith("{")


def _error(path: Path, line: int | None, problem: str, field: str | None = None) -> TraceError:
    """``field`` is ``column X`` in a CSV file, ``key X`` in JSONL."""
    return TraceError(problem, file=str(path), line=line, field=field)


def _int(path: Path, line: int, field: str, value: object) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    try:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError
        number = int(value)
    except ValueError:
        raise _error(path, line, f"{value!r} is not an integer", field) from None
    if number < 0:
        raise _error(path, line, f"{value!r} is negative", field)
    return number


def _float(path: Path, line: int, field: str, value: object) -> float:
    try:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ValueError
        number = float(value)
    except ValueError:
        raise _error(path, line, f"{value!r} is not a number", field) from None
    if not math.isfinite(number) or number < 0:
        raise _error(path, line, f"{value!r} is not a finite number >= 0", field)
    return number


def _timestamp(path: Path, line: int, field: str, value: str) -> float:
    try:  # Python < 3.11 takes at most 6 fractional digits; Azure writes 7
        stamp = datetime.fromisoformat(_BEYOND_MICROSECONDS.sub(r"\1", value.strip(), count=1))
        if stamp.tzinfo is not None:
            stamp = stamp.astimezone(UTC).replace(tzinfo=None)
    except ValueError:
        raise _error(path, line, f"{value!r} is not a date and time", field) from None
    except OverflowError:  # within a day of year 1 or 9999, in UTC it is not one datetime can hold
        raise _error(path, line, f"{value!r} is out of range in UTC", field) from None
    return (stamp - _EPOCH).total_seconds()  # naive times as written: no local time zone, no DST jumps


def _mooncake(path: Path, f: IO[str]) -> list[_Raw]:
    keys = FORMATS["mooncake"]
    raw: list[_Raw] = []
    for n, text in enumerate(f, 1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than Python's stack
            raise _error(path, n, f"not JSON ({exc}); a Mooncake JSONL line is one object") from None
        if not isinstance(obj, dict):
            raise _error(path, n, f"a {type(obj).__name__}, not a JSON object")
        missing = [k for k in keys if k not in obj]
        if missing:
            raise _error(path, n, f"no key {missing[0]!r}: Mooncake JSONL lines have {', '.join(keys)} "
                                  f"(this one has {', '.join(obj) or 'none'})")
        raw.append((_float(path, n, "key timestamp", obj["timestamp"]) / 1000.0,
                    _int(path, n, "key input_length", obj["input_length"]),
                    _int(path, n, "key output_length", obj["output_length"])))
    return raw


def _csv(path: Path, f: IO[str], rng: random.Random, *, rate_scale: float, speed: float,
         limit_s: float | None) -> tuple[str, list[_Raw]]:
    reader = csv.reader(f)
    rows = ((reader.line_num, row) for row in reader if row)
    try:
        header_line, header = next(rows, (1, []))
        columns = {name.strip(): i for i, name in enumerate(header)}
        fmt = next((name for name, cols in FORMATS.items() if name != "mooncake" and set(cols) <= columns.keys()),
                   None)
        if fmt is None:
            known = "; ".join(f"{name}{' (JSONL)' if name == 'mooncake' else ''}: {', '.join(cols)}"
                              for name, cols in FORMATS.items())
            found = ", ".join(c.strip() for c in header) or "none (empty file)"
            raise _error(path, header_line, f"columns {found} match no trace format; recognised: {known}")
        for name in FORMATS[fmt]:
            if sum(1 for c in header if c.strip() == name) > 1:
                raise _error(path, header_line, "appears twice in the header", f"column {name}")
        if fmt == "servegen-rate":
            return fmt, _from_rates(path, rows, columns, len(header), rng, rate_scale=rate_scale, speed=speed,
                                    limit_s=limit_s)
        return fmt, _requests(path, fmt, rows, columns, len(header))
    except csv.Error as exc:
        raise _error(path, reader.line_num, f"not readable as CSV ({exc})") from None


def _fields(path: Path, n: int, row: list[str], width: int, index: tuple[int, ...]) -> list[str]:
    if len(row) <= max(index):
        raise _error(path, n, f"{len(row)} fields where the header has {width}")
    return [row[i] for i in index]


def _requests(path: Path, fmt: str, rows: Iterator[tuple[int, list[str]]], columns: dict[str, int],
              width: int) -> list[_Raw]:
    index = tuple(columns[c] for c in FORMATS[fmt])
    at, inp, out = (f"column {c}" for c in FORMATS[fmt])
    raw: list[_Raw] = []
    for n, row in rows:
        t, i, o = _fields(path, n, row, width, index)
        arrival = _timestamp(path, n, at, t) if fmt == "azure" else _float(path, n, at, t)
        raw.append((arrival, _int(path, n, inp, i), _int(path, n, out, o)))
    return raw


def _from_rates(path: Path, rows: Iterator[tuple[int, list[str]]], columns: dict[str, int], width: int,
                rng: random.Random, *, rate_scale: float, speed: float, limit_s: float | None) -> list[_Raw]:
    """Poisson arrivals at each window's rate times ``rate_scale``, already shifted, compressed and cut."""
    index = tuple(columns[c] for c in FORMATS["servegen-rate"])
    start_col, rate_col = (f"column {c}" for c in FORMATS["servegen-rate"])
    windows: dict[float, tuple[int, float]] = {}  # start -> (line, rate)
    for n, row in rows:
        s, r = _fields(path, n, row, width, index)
        start = _float(path, n, start_col, s)
        if start in windows:
            raise _error(path, n, f"window {s!r} already starts on line {windows[start][0]}", start_col)
        windows[start] = (n, rate_scale * _float(path, n, rate_col, r))
    if len(windows) == 1:
        raise _error(path, None, "one window only: a rate trace needs two, as the last lasts as long as the one "
                                 "before it")
    if not windows:
        return []
    starts = sorted(windows)
    origin = starts[0]
    until = math.inf if limit_s is None else origin + limit_s * speed
    spans = [(a, min(b, until), windows[a][1]) for a, b in zip(starts, [*starts[1:], 2 * starts[-1] - starts[-2]],
                                                               strict=True) if a < until]
    expected = sum(rate * (end - start) for start, end, rate in spans)
    if expected > _MAX_GENERATED:
        raise _error(path, None, f"about {expected:,.0f} requests at these rates, more than {_MAX_GENERATED:,} this "
                                 "makes; scale the rate down (rate_scale) or cut the time (limit_s)")
    mu_in = math.log(RATE_INPUT_MEAN) - RATE_TOKEN_SIGMA**2 / 2
    mu_out = math.log(RATE_OUTPUT_MEAN) - RATE_TOKEN_SIGMA**2 / 2
    raw: list[_Raw] = []
    for start, end, rate in spans:
        t = start
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= end:
                break
            raw.append(((t - origin) / speed, max(1, round(rng.lognormvariate(mu_in, RATE_TOKEN_SIGMA))),
                        max(1, round(rng.lognormvariate(mu_out, RATE_TOKEN_SIGMA)))))
    return raw
