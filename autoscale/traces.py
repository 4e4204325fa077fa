"""Request traces, recognised by their columns, as arrivals with prompt and output lengths.

Formats (:data:`FORMATS`; column order and extra columns do not matter):

- ``azure``: Azure LLM inference traces, ``TIMESTAMP,ContextTokens,GeneratedTokens`` (wall-clock times);
- ``servegen``: ServeGen-style requests, ``arrival_s,input_tokens,output_tokens``;
- ``mooncake``: Mooncake JSONL, one object per line with ``timestamp`` (ms), ``input_length``,
  ``output_length``;
- ``servegen-rate``: request rates per window, ``window_start_s,aggregate_rate_rps``: Poisson arrivals at
  each window's rate, lengths drawn from seeded lognormals (:data:`RATE_INPUT_MEAN`, :data:`RATE_OUTPUT_MEAN`).

Arrivals start at 0. ``speed`` compresses time (the rate grows with it); ``rate_scale`` thins (< 1, each
request kept with that probability) or repeats (> 1: each request ``floor(rate_scale)`` times, plus once
more with the fractional part's probability, copies at the same arrival) without changing the timeline.
Everything random is seeded. A bad file gets a :class:`TraceError` naming the file and line.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from fleetward.fleet.errors import ConfigError

__all__ = ["FORMATS", "RATE_INPUT_MEAN", "RATE_OUTPUT_MEAN", "Trace", "TraceError", "TraceRequest", "load_trace"]

FORMATS: dict[str, tuple[str, ...]] = {
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "servegen": ("arrival_s", "input_tokens", "output_tokens"),
    "mooncake": ("timestamp", "input_length", "output_length"),
    "servegen-rate": ("window_start_s", "aggregate_rate_rps"),
}
RATE_INPUT_MEAN, RATE_OUTPUT_MEAN, _RATE_SIGMA = 2000.0, 250.0, 0.8


class TraceError(ConfigError):
    """A trace file that cannot be read: the message starts with ``file:line:``."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Trace:
    name: str
    format: str
    requests: tuple[TraceRequest, ...]  # by arrival

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    def rate_per_interval(self, interval_s: float) -> list[float]:
        """Requests per second in consecutive windows of ``interval_s`` from 0 to the last arrival."""
        counts = [0] * (int(self.duration_s // interval_s) + 1)
        for r in self.requests:
            counts[int(r.arrival_s // interval_s)] += 1
        return [c / interval_s for c in counts]


def _number(path: Path, line: int, column: str, value: str | None, kind: type[int] | type[float]) -> float:
    try:
        number: float = float(str(value)) if kind is float else int(str(value).strip())
    except (TypeError, ValueError):
        what = "an integer" if kind is int else "a number"
        raise TraceError(f"{path}:{line}: column {column}: {value!r} is not {what}") from None
    if not math.isfinite(number) or number < 0:
        raise TraceError(f"{path}:{line}: column {column}: {value!r} must be a finite number >= 0")
    return number


def _timestamp(path: Path, line: int, value: str | None) -> float:
    text = (value or "").strip()
    head, dot, frac = text.partition(".")
    try:  # Azure writes 7 fractional digits; datetime takes at most 6
        stamp = datetime.fromisoformat(head + (dot + frac[:6] if dot else ""))
    except ValueError:
        raise TraceError(f"{path}:{line}: column TIMESTAMP: {value!r} is not a date and time") from None
    return stamp.timestamp()


def _rows(path: Path) -> tuple[str, Iterator[tuple[int, dict[str, str]]]]:
    """The format and (line, row) pairs of a CSV or JSONL file."""
    is_jsonl = path.suffix == ".jsonl"
    with path.open(encoding="utf-8-sig") as f:
        for first in f:
            if first.strip():
                is_jsonl = is_jsonl or first.lstrip().startswith("{")
                break
    if is_jsonl:
        return "mooncake", _jsonl(path)
    with path.open(encoding="utf-8-sig", newline="") as f:
        header = next(csv.reader(f), [])
    columns = {c.strip() for c in header}
    for name, needed in FORMATS.items():
        if name != "mooncake" and set(needed) <= columns:
            return name, _csv(path)
    known = "; ".join(f"{n}: {', '.join(c)}" for n, c in FORMATS.items())
    raise TraceError(f"{path}:1: columns {', '.join(header) or '(none)'} are not a trace format this reads ({known})")


def _csv(path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    with path.open(encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f)
        reader.fieldnames = [c.strip() for c in reader.fieldnames or []]
        for row in reader:
            yield reader.line_num, row


def _jsonl(path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    with path.open(encoding="utf-8-sig") as f:
        for n, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except ValueError as exc:
                raise TraceError(f"{path}:{n}: not a JSON object ({exc})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{path}:{n}: not a JSON object")
            for key in FORMATS["mooncake"]:
                if key not in obj:
                    raise TraceError(f"{path}:{n}: no {key!r} (Mooncake JSONL has {', '.join(FORMATS['mooncake'])})")
            yield n, {k: str(v) for k, v in obj.items()}


_MAX_REQUESTS = 5_000_000


def _requests(path: Path, fmt: str, rows: Iterator[tuple[int, dict[str, str]]], rng: random.Random, *,
              rate_scale: float, until: float) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    if fmt == "servegen-rate":  # arrivals made at the scaled rate, up to the limit (days of 200 req/s are too many)
        windows = [(_number(path, n, "window_start_s", r.get("window_start_s"), float),
                    rate_scale * _number(path, n, "aggregate_rate_rps", r.get("aggregate_rate_rps"), float))
                   for n, r in rows]
        windows.sort()
        if not windows:
            return out
        starts = [w[0] for w in windows]
        last = starts[-1] - starts[-2] if len(starts) > 1 else 600.0  # the last window lasts as the one before
        ends = [*starts[1:], starts[-1] + last]
        expected = sum(rate * max(0.0, min(end, until) - start)
                       for (start, rate), end in zip(windows, ends, strict=True))
        if expected > _MAX_REQUESTS:
            raise TraceError(f"{path}: about {expected:,.0f} requests at these rates; scale the rate down "
                             "(rate_scale, --rate-scale) or limit the time (limit_s, --limit)")
        mu_in = math.log(RATE_INPUT_MEAN) - _RATE_SIGMA**2 / 2
        mu_out = math.log(RATE_OUTPUT_MEAN) - _RATE_SIGMA**2 / 2
        for (start, rate), end in zip(windows, ends, strict=True):
            t = start
            while rate > 0:
                t += rng.expovariate(rate)
                if t >= end or t >= until:
                    break
                out.append(TraceRequest(t, max(1, round(rng.lognormvariate(mu_in, _RATE_SIGMA))),
                                        max(1, round(rng.lognormvariate(mu_out, _RATE_SIGMA)))))
        return out
    arrival_col, in_col, out_col = FORMATS[fmt]
    for n, r in rows:
        if fmt == "azure":
            t = _timestamp(path, n, r.get(arrival_col))
        else:
            t = _number(path, n, arrival_col, r.get(arrival_col), float)
            t = t / 1000.0 if fmt == "mooncake" else t
        out.append(TraceRequest(t, int(_number(path, n, in_col, r.get(in_col), int)),
                                int(_number(path, n, out_col, r.get(out_col), int))))
    return out


def load_trace(path: str | Path, *, speed: float = 1.0, rate_scale: float = 1.0, seed: int = 0,
               limit_s: float | None = None) -> Trace:
    """The trace at ``path`` (module docstring for formats and options)."""
    path = Path(path)
    for name, value in (("speed", speed), ("rate_scale", rate_scale)):
        if not value > 0:
            raise TraceError(f"{path}: {name} must be > 0, got {value}")
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    rng = random.Random(seed)
    fmt, rows = _rows(path)
    until = math.inf if limit_s is None else limit_s * speed
    raw = _requests(path, fmt, rows, rng, rate_scale=rate_scale, until=until)
    if not raw:
        raise TraceError(f"{path}: the trace has no requests")
    raw.sort(key=lambda r: r.arrival_s)
    origin = raw[0].arrival_s if fmt != "servegen-rate" else 0.0
    whole, frac = (1, 0.0) if fmt == "servegen-rate" else (int(rate_scale), rate_scale - int(rate_scale))
    out: list[TraceRequest] = []
    for r in raw:
        t = (r.arrival_s - origin) / speed
        if limit_s is not None and t >= limit_s:
            break
        copies = whole + (1 if frac > 0 and rng.random() < frac else 0)
        out.extend([TraceRequest(t, r.input_tokens, r.output_tokens)] * copies)
    if not out:
        raise TraceError(f"{path}: no request left (limit_s={limit_s}, rate_scale={rate_scale})")
    return Trace(path.stem, fmt, tuple(out))
