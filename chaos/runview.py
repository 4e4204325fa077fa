"""A run's history read back for its checkers and its report: each request with its chunks and its end, each
fault with the window it was in effect, the method's span.

A fault is *in effect* from its ``start`` record until its ``recover`` record (the moment the runner began
undoing it). Time is the run clock of the history (``t``).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fleetward.chaos.history import Record

__all__ = ["FaultWindow", "RequestView", "RunView", "token_times"]


@dataclass
class RequestView:
    req: str
    invoke: Record
    chunks: list[Record] = field(default_factory=list)
    end: Record | None = None
    resumes: list[Record] = field(default_factory=list)
    _starts: list[int] = field(default_factory=list)  # index of each chunk's first token

    @property
    def source(self) -> str:
        return str(self.invoke.get("client", "workload"))

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.invoke.get("params") or {})

    @property
    def prompt(self) -> list[int] | None:
        prompt = self.invoke.get("prompt")
        return list(prompt) if isinstance(prompt, list) else None

    @property
    def tokens(self) -> list[int]:
        return [t for c in self.chunks for t in c.get("tokens") or ()]

    @property
    def outcome(self) -> str:
        """``ok``, a fail stage, or ``open`` (the history ended first)."""
        if self.end is None:
            return "open"
        return "ok" if self.end.type == "ok" else str(self.end.get("stage", "fail"))

    @property
    def t_start(self) -> float:
        return self.invoke.t

    @property
    def t_end(self) -> float:
        if self.end is not None:
            return self.end.t
        return self.chunks[-1].t if self.chunks else self.invoke.t

    @property
    def ttft(self) -> float | None:
        first = next((c for c in self.chunks if c.get("tokens")), None)
        return None if first is None else first.t - self.invoke.t

    def itls(self) -> list[float]:
        out: list[float] = []
        prev: float | None = None
        for c in self.chunks:
            n = len(c.get("tokens") or ())
            if not n:
                continue
            if prev is not None:
                out.extend([(c.t - prev) / n] * n)
            prev = c.t
        return out

    def chunk_for(self, index: int) -> Record | None:
        """The chunk that delivered token ``index`` (the last chunk for an index past the end)."""
        if not self._starts or len(self._starts) != len(self.chunks):
            self._starts, n = [], 0
            for c in self.chunks:
                self._starts.append(n)
                n += len(c.get("tokens") or ())
        if not self.chunks:
            return None
        i = bisect.bisect_right(self._starts, index) - 1
        return self.chunks[max(0, i)]

    def attempts(self) -> list[int]:
        return [int(c["attempt"]) for c in self.chunks if c.get("attempt") is not None]


@dataclass
class FaultWindow:
    activity: str
    fault: str
    family: str
    targets: list[str]
    target_kind: str | None
    start: float
    recover: float | None = None
    stop: float | None = None
    verified: bool | None = None
    recovered: bool | None = None
    error: str | None = None
    refused: str | None = None

    @property
    def end(self) -> float:
        """When the fault stopped being in effect (the runner began to recover it)."""
        for t in (self.recover, self.stop):
            if t is not None:
                return t
        return self.start

    def contains(self, t: float, settle: float = 0.0) -> bool:
        return self.start <= t <= self.end + settle


@dataclass
class RunView:
    """The history grouped for checking: requests, fault windows, events, the method's span."""

    records: list[Record]
    requests: dict[str, RequestView]
    faults: list[FaultWindow]
    events: list[tuple[float, Record]]  # (time published, on the run clock; the record)
    method: tuple[float, float] | None

    @classmethod
    def of(cls, records: Iterable[Record]) -> RunView:
        recs = list(records)
        requests: dict[str, RequestView] = {}
        faults: dict[str, FaultWindow] = {}
        events: list[tuple[float, Record]] = []
        method_start = method_end = None
        for r in recs:
            if r.type == "invoke":
                requests[r["req"]] = RequestView(r["req"], r)
            elif r.type in ("chunk", "ok", "fail", "resume"):
                view = requests.get(r.get("req"))
                if view is None:
                    continue
                if r.type == "chunk":
                    view.chunks.append(r)
                elif r.type == "resume":
                    view.resumes.append(r)
                else:
                    view.end = r
            elif r.type == "fault":
                _fold_fault(faults, r)
            elif r.type == "event":
                ts = r.get("ts")
                t = r.t - (r.wall - float(ts)) if isinstance(ts, (int, float)) else r.t
                events.append((min(t, r.t), r))
            elif r.type == "phase" and r.get("name") == "method":
                if r.get("state") == "start":
                    method_start = r.t
                elif r.get("state") == "end":
                    method_end = r.t
        if method_start is not None and method_end is None:
            method_end = max((r.t for r in recs), default=method_start)
        method = (method_start, method_end) if method_start is not None and method_end is not None else None
        events.sort(key=lambda e: e[0])
        return cls(recs, requests, sorted(faults.values(), key=lambda w: w.start), events, method)

    def workload_requests(self) -> list[RequestView]:
        return [r for r in self.requests.values() if r.source != "probe"]

    def faults_of(self, r: RequestView, settle: float) -> list[FaultWindow]:
        """The faults in effect (or within ``settle`` seconds after) at any time ``r`` was open."""
        return [w for w in self.faults if not w.refused and r.t_start <= w.end + settle and r.t_end >= w.start]

    def fault_free(self, settle: float) -> list[tuple[float, float]]:
        """Spans of the method with no fault in effect (nor within ``settle`` seconds after one)."""
        if self.method is None:
            return []
        spans = [(self.method[0], self.method[1])]
        for w in self.faults:
            if w.refused:
                continue
            cut_a, cut_b = w.start, w.end + settle
            nxt = []
            for a, b in spans:
                if cut_b <= a or cut_a >= b:
                    nxt.append((a, b))
                    continue
                if a < cut_a:
                    nxt.append((a, cut_a))
                if cut_b < b:
                    nxt.append((cut_b, b))
            spans = nxt
        return spans


def _fold_fault(faults: dict[str, FaultWindow], r: Record) -> None:
    name = str(r.get("activity") or r.get("fault"))
    phase = r.get("phase")
    w = faults.get(name)
    if w is None:
        target = r.get("target") or {}
        w = FaultWindow(name, str(r.get("fault")), str(r.get("family")), list(r.get("targets") or []),
                        target.get("kind") if isinstance(target, dict) else None, r.t)
        faults[name] = w
    if r.get("targets"):
        w.targets = list(r["targets"])
    if phase == "start":
        w.start = r.t
    elif phase == "verified":
        w.verified = bool(r.get("ok"))
    elif phase == "recover":
        w.recover = r.t
    elif phase == "recovered":
        w.recovered = bool(r.get("ok"))
    elif phase == "stop":
        w.stop = r.t
    elif phase == "failed":
        w.error = str(r.get("detail") or r.get("error") or "failed")
    elif phase == "refused":
        w.refused = str(r.get("detail") or "refused")


def token_times(view: RunView) -> tuple[list[float], list[int]]:
    """(time, tokens) of every workload chunk, in time order (prefix sums make windows cheap)."""
    pts = sorted((c.t, len(c.get("tokens") or ())) for r in view.workload_requests() for c in r.chunks)
    return [t for t, _ in pts], [n for _, n in pts]
