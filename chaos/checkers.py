"""Checkers: pure functions of a run's history (and a fault-free reference), run after the run.

Each checker returns a :class:`Verdict`: ``pass``, ``fail`` or ``unknown`` (the history cannot tell, e.g.
the engine samples, or no supervisor ran), a one-line summary, details (which requests, where) and
metrics. A run's verdict combines them: fail > unknown > pass.

=================== =====================================================================================
checker             what it checks
=================== =====================================================================================
stream_exactness    every request's delivered tokens against its fault-free reference: exact, an exact
                    prefix (the request failed honestly: an error, or the client disconnected), or one of
                    lost / duplicated / reordered / truncated / corrupted, each located in time, on a
                    worker and attempt, relative to the faults in effect and to migrations. ``unknown``
                    for requests without a reference (sampling engines).
sse_ids             every SSE id ``<rid>:<n>`` counts exactly the tokens the client holds after that
                    event, the point a ``Last-Event-ID`` resume starts from (works without a reference)
availability        success share and TTFT/ITL percentiles per fault window against the fault-free
                    baseline, with limits
recovery            per fault: time from its recovery until token throughput is back to a share of the
                    baseline
detection           per worker fault of the process/gpu/kv families: time from injection to the first
                    detection event about the target; ``unknown`` when no supervisor ran
migration_limit     no request used more attempts than the router's migration limit allows
quiet_baseline      no detections (or migrations) while no fault was in effect
fault_verification  every fault verified that it took effect and that it was recovered
failure_reasons     every workload request ended, and every one that failed says how (a stage) and why
resources           the RSS and open file descriptors of the run's processes (``resources`` records, see
                    :mod:`fleetward.chaos.resources`) grew within bounds from after a warm-up to the end, the
                    run ended with no more processes than it had then, and none of its processes outlived it
=================== =====================================================================================

Time is the run clock of the history (``t``). A fault is *in effect* from its ``start`` record until its
``recover`` record (the moment the runner began undoing it).

Each checker is a function registered with ``@_checker`` over a run's history read back as requests and
fault windows (:mod:`fleetward.chaos.runview`); stream exactness aligns each delivered stream with its
reference (:mod:`fleetward.chaos.alignment`).
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

from fleetward.chaos.alignment import Anomaly, align
from fleetward.chaos.history import Record
from fleetward.chaos.reference import Reference
from fleetward.chaos.runview import RequestView, RunView, token_times
from fleetward.fleet.config import Frozen

__all__ = [
    "CHECKERS",
    "CheckContext",
    "Checker",
    "Verdict",
    "combine",
    "run_checkers",
]

log = logging.getLogger(__name__)

Status = Literal["pass", "unknown", "fail"]
_RANK = {"pass": 0, "unknown": 1, "fail": 2}
ANOMALIES = ("lost", "duplicated", "reordered", "truncated", "corrupted")


def combine(statuses: Iterable[Status]) -> Status:
    """fail > unknown > pass (pass when there is nothing to combine)."""
    return max(statuses, key=_RANK.__getitem__, default="pass")


@dataclass(frozen=True)
class Verdict:
    checker: str
    status: Status
    summary: str
    details: tuple[dict[str, Any], ...] = ()
    metrics: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"checker": self.checker, "status": self.status, "summary": self.summary,
                "details": list(self.details), "metrics": self.metrics}


@dataclass(frozen=True)
class CheckContext:
    reference: Reference
    migration_limit: int | None = None
    supervisor: bool | None = None  # None: infer from the history (detection events seen)


# -- checker plumbing ---------------------------------------------------------------------------------------

CheckFn = Callable[[RunView, CheckContext, Any], Verdict]


@dataclass(frozen=True)
class Checker:
    name: str
    summary: str
    params: type[BaseModel]
    fn: CheckFn


CHECKERS: dict[str, Checker] = {}


def _checker(name: str, summary: str, params: type[BaseModel]) -> Callable[[CheckFn], CheckFn]:
    def deco(fn: CheckFn) -> CheckFn:
        CHECKERS[name] = Checker(name, summary, params, fn)
        return fn

    return deco


def run_checkers(view: RunView, ctx: CheckContext,
                 specs: Sequence[tuple[str, Mapping[str, Any]]] | None = None) -> list[Verdict]:
    """Run ``specs`` (name, params) — every checker with defaults when ``None``."""
    chosen = specs if specs is not None else [(name, {}) for name in CHECKERS]
    out = []
    for name, params in chosen:
        checker = CHECKERS[name]
        try:
            out.append(checker.fn(view, ctx, checker.params.model_validate(dict(params))))
        except Exception as exc:  # a broken checker cannot vouch for the run, nor hide the other verdicts
            log.exception("checker %s failed", name)
            out.append(Verdict(name, "unknown", f"the checker itself failed: {type(exc).__name__}: {exc}"))
    return out


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


# -- stream exactness ---------------------------------------------------------------------------------------


class ExactnessParams(Frozen):
    settle_s: float = Field(1.0, ge=0, description="an anomaly this long after a fault is still put down to it")
    max_details: int = Field(200, ge=1)


def _migrations_by_rid(view: RunView) -> dict[str, list[Record]]:
    out: dict[str, list[Record]] = {}
    for _, ev in view.events:
        if ev.get("kind") == "migration" and ev.get("request"):
            out.setdefault(str(ev["request"]), []).append(ev)
    return out


def _locate(view: RunView, r: RequestView, index: int, migrations: Mapping[str, list[Record]],
            settle: float) -> dict[str, Any]:
    chunk = r.chunk_for(index)
    t = chunk.t if chunk is not None else r.t_end
    where: dict[str, Any] = {"t": round(t, 3), "worker": chunk.get("worker") if chunk else None,
                             "attempt": chunk.get("attempt") if chunk else None}
    where["faults"] = [w.activity for w in view.faults if not w.refused and w.contains(t, settle)]
    # A migration boundary within a chunk of the anomaly: the worker or attempt changed.
    boundary = None
    n = 0
    prev: Record | None = None
    for c in r.chunks:
        k = len(c.get("tokens") or ())
        if prev is not None and (c.get("attempt"), c.get("worker")) != (prev.get("attempt"), prev.get("worker")):
            if abs(n - index) <= max(1, k):
                boundary = {"from": prev.get("worker"), "to": c.get("worker"), "at_token": n,
                            "attempt": c.get("attempt")}
        n += k
        prev = c
    rid = next((c.get("rid") for c in r.chunks if c.get("rid")), None)
    for ev in migrations.get(str(rid), []) if rid else []:
        if abs(int(ev.get("tokens", -10)) - index) <= 1:
            boundary = {"from": ev.get("from_worker"), "to": ev.get("worker"), "at_token": ev.get("tokens"),
                        "attempt": ev.get("attempt"), "reason": ev.get("reason")}
    where["migration"] = boundary
    return where


def _describe(req: str, a: Anomaly, where: Mapping[str, Any]) -> str:
    what = f"{a.kind} {a.count} token{'s' if a.count != 1 else ''}" if a.kind != "truncated" else \
        f"truncated: {a.count} token{'s' if a.count != 1 else ''} missing at the end"
    s = f"{req}: {what} at token {a.index} (t={where['t']} s"
    if where.get("worker"):
        s += f", worker {where['worker']}, attempt {where.get('attempt')}"
    s += ")"
    if where.get("faults"):
        s += f" during {', '.join(where['faults'])}"
    m = where.get("migration")
    if m:
        s += f", at the migration {m.get('from')} -> {m.get('to')} (token {m.get('at_token')})"
    if a.note:
        s += f"; {a.note}"
    return s


@_checker("stream_exactness", "every stream equals its fault-free reference (or is an exact prefix of it when "
          "the request failed honestly)", ExactnessParams)
def check_stream_exactness(view: RunView, ctx: CheckContext, params: ExactnessParams) -> Verdict:
    migrations = _migrations_by_rid(view)
    classes: dict[str, int] = {}
    details: list[dict[str, Any]] = []
    unknown_why: dict[str, str] = {}
    for r in view.requests.values():
        anomalies: list[Anomaly] = []
        expected = ctx.reference.expected(r)
        outcome = r.outcome
        cls = "exact"
        if expected is None:
            cls = "unknown"
            unknown_why.setdefault(ctx.reference.why(r), r.req)
        else:
            delivered = r.tokens
            found, _, used = align(delivered, expected)
            if used < len(expected) and not any(a.note == "diverged for good" for a in found):
                if outcome in ("ok", "eof"):
                    found.append(Anomaly("truncated", len(delivered), used, len(expected) - used,
                                         "the stream ended as if complete" if outcome == "ok" else
                                         "the stream ended without [DONE] and without an error"))
                else:
                    cls = "exact_prefix"
            for a in found:
                if a.kind == "corrupted" and a.note == "diverged for good" and ctx.reference.follows(
                        (r.prompt or []) + delivered[:a.index + 1], delivered[a.index + 1:]):
                    anomalies.append(Anomaly("corrupted", a.index, a.ref_index, 1,
                                             f"what follows is the model's continuation of the wrong token "
                                             f"({a.count - 1} more)"))
                else:
                    anomalies.append(a)
        if anomalies:
            cls = anomalies[0].kind
            for a in anomalies:
                classes[a.kind] = classes.get(a.kind, 0) + 1
                if len(details) < params.max_details:
                    where = _locate(view, r, a.index, migrations, params.settle_s)
                    details.append({"request": r.req, "kind": a.kind, "index": a.index, "count": a.count,
                                    **where, "outcome": outcome, "text": _describe(r.req, a, where)})
        classes[f"requests_{cls}"] = classes.get(f"requests_{cls}", 0) + 1
    n = len(view.requests)
    bad = sum(v for k, v in classes.items() if k in ANOMALIES)
    metrics = {"requests": n, **classes, "reference": ctx.reference.kind}
    if bad:
        kinds = ", ".join(f"{classes[k]} {k}" for k in ANOMALIES if classes.get(k))
        return Verdict("stream_exactness", "fail", f"{kinds} in {n} requests", tuple(details), metrics)
    if unknown_why:
        reasons = "; ".join(f"{why} (e.g. {req})" for why, req in unknown_why.items())
        return Verdict("stream_exactness", "unknown", f"{classes.get('requests_unknown', 0)} of {n} requests "
                       f"cannot be checked: {reasons}", tuple(details), metrics)
    prefix = classes.get("requests_exact_prefix", 0)
    return Verdict("stream_exactness", "pass", f"{n} requests exact" + (
        f" ({prefix} failed or were cancelled, with an exact prefix delivered)" if prefix else ""), (), metrics)


# -- resume points -----------------------------------------------------------------------------------------


class SseIdParams(Frozen):
    max_details: int = Field(100, ge=1)


@_checker("sse_ids", "every SSE id <rid>:<n> counts exactly the tokens the client holds after that event (what "
          "a Last-Event-ID resume starts from)", SseIdParams)
def check_sse_ids(view: RunView, ctx: CheckContext, params: SseIdParams) -> Verdict:
    details: list[dict[str, Any]] = []
    events = ahead = behind = 0
    for r in view.requests.values():
        have = 0
        wrong: list[tuple[int, int, Record]] = []
        for c in r.chunks:
            have += len(c.get("tokens") or ())
            n = c.get("n")
            if isinstance(n, int):
                events += 1
                if n != have:
                    wrong.append((n, have, c))
        if not wrong:
            continue
        n, have, c = wrong[0]
        ahead += sum(1 for n_, h, _ in wrong if n_ > h)
        behind += sum(1 for n_, h, _ in wrong if n_ < h)
        if len(details) < params.max_details:
            risk = "skips" if n > have else "repeats"
            details.append({"request": r.req, "events": len(wrong), "t": round(c.t, 3), "worker": c.get("worker"),
                            "text": f"{r.req}: event {c.get('event_id')} counts {n} tokens, the client had {have} "
                                    f"(a resume from it {risk} {abs(n - have)}); {len(wrong)} such event(s)"})
    metrics = {"events": events, "ahead": ahead, "behind": behind, "requests": len(details)}
    if details:
        return Verdict("sse_ids", "fail", f"{ahead + behind} of {events} events carry a wrong count ({ahead} ahead: a "
                       f"resume would lose tokens; {behind} behind: it would repeat them) in {len(details)} "
                       "request(s)", tuple(details), metrics)
    if not events:
        return Verdict("sse_ids", "unknown", "no SSE ids in the history", (), metrics)
    return Verdict("sse_ids", "pass", f"{events} events, every count right", (), metrics)


# -- availability and latency -------------------------------------------------------------------------------


class AvailabilityParams(Frozen):
    baseline_min_success: float = Field(1.0, ge=0, le=1)
    fault_min_success: float = Field(1.0, ge=0, le=1, description="least success share of requests that "
                                     "overlap a fault window")
    max_ttft_p99_s: float | None = Field(None, gt=0)
    max_itl_p99_s: float | None = Field(None, gt=0)
    settle_s: float = Field(1.0, ge=0, description="requests this long after a fault still count towards it")


def _window_stats(reqs: Sequence[RequestView]) -> dict[str, Any]:
    counted = [r for r in reqs if r.outcome != "cancelled"]
    ok = sum(1 for r in counted if r.outcome == "ok")
    ttfts = [x for x in (r.ttft for r in counted) if x is not None]
    itls = [x for r in counted for x in r.itls()]
    return {"requests": len(counted), "ok": ok, "success": _r(ok / len(counted), 4) if counted else None,
            "cancelled": len(reqs) - len(counted),
            "ttft_p50_s": _r(_quantile(ttfts, 0.5)), "ttft_p99_s": _r(_quantile(ttfts, 0.99)),
            "itl_p50_s": _r(_quantile(itls, 0.5), 4), "itl_p99_s": _r(_quantile(itls, 0.99), 4),
            "failed": [r.req for r in counted if r.outcome != "ok"][:20]}


@_checker("availability", "success share and latency per fault window against the fault-free baseline",
          AvailabilityParams)
def check_availability(view: RunView, ctx: CheckContext, params: AvailabilityParams) -> Verdict:
    per: dict[str, list[RequestView]] = {}
    baseline = []
    for r in view.workload_requests():
        hits = view.faults_of(r, params.settle_s)
        for w in hits:
            per.setdefault(w.activity, []).append(r)
        if not hits:
            baseline.append(r)
    stats = {"baseline": _window_stats(baseline)}
    for w in (w for w in view.faults if not w.refused):
        stats[w.activity] = _window_stats(per.get(w.activity, []))
    problems, unknowns = [], []
    for name, s in stats.items():
        limit = params.baseline_min_success if name == "baseline" else params.fault_min_success
        if not s["requests"]:
            unknowns.append(f"no requests in {'the baseline' if name == 'baseline' else name}")
            continue
        if s["success"] < limit:
            problems.append({"window": name, "problem": f"success {s['success']:.2%} < {limit:.2%}",
                             "failed": s["failed"]})
        for key, lim in (("ttft_p99_s", params.max_ttft_p99_s), ("itl_p99_s", params.max_itl_p99_s)):
            if lim is not None and s[key] is not None and s[key] > lim:
                problems.append({"window": name, "problem": f"{key} {s[key]} > {lim}"})
    if problems:
        text = "; ".join(f"{p['window']}: {p['problem']}" for p in problems)
        return Verdict("availability", "fail", text, tuple(problems), stats)
    if unknowns:
        return Verdict("availability", "unknown", "; ".join(unknowns), (), stats)
    return Verdict("availability", "pass", f"every window within limits: baseline success "
                   f"{stats['baseline']['success']:.2%} over {stats['baseline']['requests']} requests, "
                   f"{len(stats) - 1} fault window(s)", (), stats)


# -- recovery -----------------------------------------------------------------------------------------------


class RecoveryParams(Frozen):
    window_s: float = Field(1.0, gt=0, description="throughput is measured over windows this long")
    steady_share: float = Field(0.5, gt=0, le=2, description="throughput counts as back at this share of the "
                                "baseline")
    max_recovery_s: float | None = Field(None, gt=0)
    step_s: float = Field(0.05, gt=0)


class _Tokens:
    def __init__(self, view: RunView) -> None:
        self.t, counts = token_times(view)
        self.acc = [0]
        for n in counts:
            self.acc.append(self.acc[-1] + n)

    def between(self, a: float, b: float) -> int:
        return self.acc[bisect.bisect_left(self.t, b)] - self.acc[bisect.bisect_left(self.t, a)]


@_checker("recovery", "after each fault, token throughput comes back to a share of the baseline", RecoveryParams)
def check_recovery(view: RunView, ctx: CheckContext, params: RecoveryParams) -> Verdict:
    windows = [w for w in view.faults if not w.refused and w.error is None]
    if not windows:
        return Verdict("recovery", "pass", "no faults to recover from")
    if view.method is None:
        return Verdict("recovery", "unknown", "the history has no method span")
    tok = _Tokens(view)
    m0, m1 = view.method
    first = min(w.start for w in windows)
    spans = [(m0 + params.window_s, first)] if first - m0 >= 3 * params.window_s else []
    spans = spans or [(a, b) for a, b in view.fault_free(params.window_s) if b - a >= 2 * params.window_s]
    if not spans:
        return Verdict("recovery", "unknown", "no fault-free span long enough to measure the baseline throughput")
    base = sum(tok.between(a, b) for a, b in spans) / sum(b - a for a, b in spans)
    if base <= 0:
        return Verdict("recovery", "unknown", "no tokens flowed in the baseline")
    need = params.steady_share * base * params.window_s
    times: dict[str, float | None] = {}
    problems, unknowns = [], []
    for w in windows:
        t = w.end
        found = None
        while t + params.window_s <= m1 + 1e-9:
            if tok.between(t, t + params.window_s) >= need:
                found = t - w.end
                break
            t += params.step_s
        times[w.activity] = _r(found)
        if found is None:
            if m1 - w.end < 2 * params.window_s:
                unknowns.append(f"{w.activity}: the workload ended {m1 - w.end:.2f} s after the fault, too soon to "
                                "see recovery")
            else:
                problems.append({"fault": w.activity, "problem": f"throughput never came back to "
                                 f"{params.steady_share:.0%} of the baseline ({base:.1f} tokens/s)"})
        elif params.max_recovery_s is not None and found > params.max_recovery_s:
            problems.append({"fault": w.activity, "problem": f"recovered after {found:.2f} s > "
                             f"{params.max_recovery_s} s"})
    metrics = {"baseline_tokens_per_s": round(base, 2), "recovery_s": times}
    if problems:
        return Verdict("recovery", "fail", "; ".join(f"{p['fault']}: {p['problem']}" for p in problems),
                       tuple(problems), metrics)
    if unknowns:
        return Verdict("recovery", "unknown", "; ".join(unknowns), (), metrics)
    text = ", ".join(f"{k} {v:.2f} s" for k, v in times.items() if v is not None)
    return Verdict("recovery", "pass", f"recovered: {text}", (), metrics)


# -- detection ----------------------------------------------------------------------------------------------

DETECTIONS = ("hang.detected", "health.changed", "worker.down", "quarantine")


class DetectionParams(Frozen):
    kinds: tuple[str, ...] = DETECTIONS
    families: tuple[str, ...] = ("process", "gpu", "kv")
    max_latency_s: float | None = Field(None, gt=0)


def _is_detection(ev: Record, kinds: Sequence[str]) -> bool:
    kind = ev.get("kind")
    if kind not in kinds:
        return False
    return not (kind == "health.changed" and ev.get("state") in ("ready", "starting"))


def _supervised(view: RunView, ctx: CheckContext) -> bool:
    if ctx.supervisor is not None:
        return ctx.supervisor
    return any(ev.get("kind") in ("hang.detected", "health.changed") for _, ev in view.events)


@_checker("detection", "each worker fault is detected (fault start -> the supervisor's first event about the "
          "target)", DetectionParams)
def check_detection(view: RunView, ctx: CheckContext, params: DetectionParams) -> Verdict:
    windows = [w for w in view.faults if not w.refused and w.error is None and w.family in params.families
               and w.target_kind in (None, "worker") and w.targets]
    if not windows:
        return Verdict("detection", "pass", "no worker fault to detect")
    supervised = _supervised(view, ctx)
    latencies: dict[str, float | None] = {}
    problems, missing = [], []
    for w in windows:
        hits = [(t, ev) for t, ev in view.events if t >= w.start - 0.05 and ev.get("worker") in w.targets
                and _is_detection(ev, params.kinds)]
        if not hits:
            latencies[w.activity] = None
            missing.append(w)
            continue
        t, ev = hits[0]
        latencies[w.activity] = round(max(0.0, t - w.start), 3)
        if params.max_latency_s is not None and t - w.start > params.max_latency_s:
            problems.append({"fault": w.activity, "problem": f"detected after {t - w.start:.2f} s > "
                             f"{params.max_latency_s} s", "event": ev.get("kind")})
    metrics = {"latency_s": latencies, "supervisor": supervised}
    if missing and supervised:
        problems += [{"fault": w.activity, "problem": f"no detection event about {', '.join(w.targets)}"}
                     for w in missing]
    if problems:
        return Verdict("detection", "fail", "; ".join(f"{p['fault']}: {p['problem']}" for p in problems),
                       tuple(problems), metrics)
    if missing:
        return Verdict("detection", "unknown", f"no supervisor ran, so {', '.join(w.activity for w in missing)} "
                       "could not be detected", (), metrics)
    return Verdict("detection", "pass", ", ".join(f"{k} in {v:.2f} s" for k, v in latencies.items()
                                                   if v is not None), (), metrics)


# -- migration limit ----------------------------------------------------------------------------------------


class MigrationLimitParams(Frozen):
    limit: int | None = Field(None, ge=0, description="default: the fleet's routing.migration_limit")


@_checker("migration_limit", "no request used more attempts than the migration limit allows", MigrationLimitParams)
def check_migration_limit(view: RunView, ctx: CheckContext, params: MigrationLimitParams) -> Verdict:
    limit = params.limit if params.limit is not None else ctx.migration_limit
    if limit is None:
        return Verdict("migration_limit", "unknown", "the migration limit is not known")
    by_rid: dict[str, int] = {}
    for _, ev in view.events:
        if ev.get("kind") == "migration" and ev.get("request"):
            by_rid[str(ev["request"])] = max(by_rid.get(str(ev["request"]), 0), int(ev.get("attempt") or 0))
    worst: list[dict[str, Any]] = []
    most = 0
    for r in view.requests.values():
        attempts = r.attempts()
        rid = next((c.get("rid") for c in r.chunks if c.get("rid")), None)
        n = max([*attempts, by_rid.get(str(rid), 0) if rid else 0, 1 if attempts else 0])
        most = max(most, n)
        if n > limit + 1:
            worst.append({"request": r.req, "attempts": n, "allowed": limit + 1})
    metrics = {"limit": limit, "max_attempts": most,
               "migrated_requests": sum(1 for r in view.requests.values() if len(set(r.attempts())) > 1)}
    if worst:
        return Verdict("migration_limit", "fail", f"{len(worst)} request(s) used more than {limit + 1} attempts",
                       tuple(worst), metrics)
    return Verdict("migration_limit", "pass", f"at most {most} attempt(s) per request (limit {limit + 1})", (),
                   metrics)


# -- no detections in a fault-free baseline -----------------------------------------------------------------


class QuietParams(Frozen):
    kinds: tuple[str, ...] = (*DETECTIONS, "restart", "migration")
    settle_s: float = Field(2.0, ge=0, description="after a fault, the fleet may still be settling this long")


@_checker("quiet_baseline", "no detections or migrations while no fault is in effect", QuietParams)
def check_quiet_baseline(view: RunView, ctx: CheckContext, params: QuietParams) -> Verdict:
    if view.method is None:
        return Verdict("quiet_baseline", "unknown", "the history has no method span")
    spans = view.fault_free(params.settle_s)
    noisy = []
    for t, ev in view.events:
        if _is_detection(ev, params.kinds) and any(a <= t <= b for a, b in spans):
            noisy.append({"t": round(t, 3), "kind": ev.get("kind"), "worker": ev.get("worker"),
                          "request": ev.get("request"), "reason": ev.get("reason")})
    total = round(sum(b - a for a, b in spans), 3)
    metrics = {"fault_free_s": total, "events": len(noisy)}
    if noisy:
        kinds = sorted({str(n["kind"]) for n in noisy})
        return Verdict("quiet_baseline", "fail", f"{len(noisy)} detection(s) with no fault in effect "
                       f"({', '.join(kinds)})", tuple(noisy[:100]), metrics)
    return Verdict("quiet_baseline", "pass", f"no detection in {total:.1f} s without faults", (), metrics)


# -- fault verification -------------------------------------------------------------------------------------


class NoParams(Frozen):
    pass


@_checker("fault_verification", "every fault took effect and was recovered", NoParams)
def check_fault_verification(view: RunView, ctx: CheckContext, params: NoParams) -> Verdict:
    if not view.faults:
        return Verdict("fault_verification", "pass", "no faults in this run")
    problems = []
    for w in view.faults:
        if w.refused:
            problems.append({"fault": w.activity, "problem": f"refused: {w.refused}"})
        elif w.error:
            problems.append({"fault": w.activity, "problem": f"failed: {w.error}"})
        elif not w.verified:
            problems.append({"fault": w.activity, "problem": "did not take effect (verify failed)" if w.verified
                             is False else "was never verified"})
        elif not w.recovered:
            problems.append({"fault": w.activity, "problem": "was not recovered (verify_recovered failed)"
                             if w.recovered is False else "never finished recovering"})
    if problems:
        return Verdict("fault_verification", "fail", "; ".join(f"{p['fault']} {p['problem']}" for p in problems),
                       tuple(problems), {"faults": len(view.faults)})
    return Verdict("fault_verification", "pass", f"{len(view.faults)} fault(s) took effect and were recovered", (),
                   {"faults": len(view.faults)})


# -- failure reasons ----------------------------------------------------------------------------------------


@_checker("failure_reasons", "every workload request ended, and every failed one says how and why", NoParams)
def check_failure_reasons(view: RunView, ctx: CheckContext, params: NoParams) -> Verdict:
    by_stage: dict[str, int] = {}
    problems = []
    reqs = view.workload_requests()
    for r in reqs:
        if r.end is None:
            problems.append({"req": r.req, "problem": "never ended (no ok or fail record)"})
            continue
        if r.end.type == "ok":
            continue
        stage = r.end.get("stage")
        by_stage[str(stage)] = by_stage.get(str(stage), 0) + 1
        if not stage or not r.end.get("error"):
            problems.append({"req": r.req, "problem": f"failed without a reason (stage {stage!r}, error "
                             f"{r.end.get('error')!r})"})
    metrics = {"requests": len(reqs), "failed": sum(by_stage.values()), "by_stage": by_stage}
    if problems:
        return Verdict("failure_reasons", "fail", f"{len(problems)} request(s) ended without a reason: "
                       + ", ".join(p["req"] for p in problems[:5]), tuple(problems[:50]), metrics)
    stages = ", ".join(f"{k} {v}" for k, v in sorted(by_stage.items())) or "none"
    return Verdict("failure_reasons", "pass", f"{len(reqs)} request(s) ended; failures by stage: {stages}", (),
                   metrics)


# -- resources ----------------------------------------------------------------------------------------------


class ResourceParams(Frozen):
    warmup_s: float = Field(60.0, ge=0, description="growth counts from this many seconds into the method (or into "
                            "a process's life, for one started later: a restarted router)")
    max_rss_growth_mb: float | None = Field(None, gt=0, description="the most a process's RSS may grow from after "
                                            "the warm-up to the end (null: reported, not judged)")
    max_fd_growth: int | None = Field(None, ge=0, description="the most a process's open file descriptors may grow "
                                      "from after the warm-up to the end (null: reported, not judged)")
    max_process_growth: int = Field(0, ge=0, description="how many more processes the run may have at its end "
                                    "than after the warm-up")
    roles: tuple[str, ...] = Field(("router", "controller", "agent", "runner"), description="the processes whose "
                                   "RSS and fds are judged (every process is reported)")


@dataclass
class _Series:
    role: str
    ident: str
    pid: int
    points: list[tuple[float, float, int]] = field(default_factory=list)  # (t, rss MB, fds)


@_checker("resources", "RSS and fds grow within bounds after the warm-up; no process leaks or outlives the run",
          ResourceParams)
def check_resources(view: RunView, ctx: CheckContext, params: ResourceParams) -> Verdict:
    samples = [r for r in view.records if r.type == "resources" and r.get("phase") in ("sample", "end")]
    after = next((r for r in reversed(view.records) if r.type == "resources" and r.get("phase") == "after"), None)
    if not samples:
        return Verdict("resources", "unknown", "no resource samples in the history")
    t_warm = (view.method[0] if view.method else samples[0].t) + params.warmup_s
    series: dict[tuple[str, str, int], _Series] = {}
    for r in samples:
        for p in r.get("procs") or ():
            key = (str(p["role"]), str(p["id"]), int(p["pid"]))
            s = series.setdefault(key, _Series(*key))
            s.points.append((r.t, float(p["rss_mb"]), int(p["fds"])))
    problems: list[dict[str, Any]] = []
    per: dict[str, dict[str, Any]] = {}
    for s in series.values():
        pts = s.points
        base = next((pt for pt in pts if pt[0] >= max(t_warm, pts[0][0] + params.warmup_s)), None)
        end = pts[-1]
        name = f"{s.role} {s.ident} (pid {s.pid})" if s.role != "runner" else f"runner (pid {s.pid})"
        row: dict[str, Any] = {"role": s.role, "id": s.ident, "pid": s.pid, "from_s": _r(pts[0][0], 1),
                               "to_s": _r(end[0], 1), "rss_start_mb": pts[0][1], "rss_end_mb": end[1],
                               "rss_peak_mb": max(pt[1] for pt in pts), "fds_start": pts[0][2], "fds_end": end[2],
                               "fds_peak": max(pt[2] for pt in pts)}
        if base is not None and base is not end:
            row.update(rss_after_warmup_mb=base[1], rss_growth_mb=_r(end[1] - base[1], 2), fds_after_warmup=base[2],
                       fd_growth=end[2] - base[2])
            if s.role in params.roles:
                if params.max_rss_growth_mb is not None and end[1] - base[1] > params.max_rss_growth_mb:
                    problems.append({"process": name, "text": f"{name}: RSS grew {end[1] - base[1]:.1f} MB after the "
                                     f"warm-up ({base[1]:.1f} -> {end[1]:.1f} MB), over {params.max_rss_growth_mb:g}"})
                if params.max_fd_growth is not None and end[2] - base[2] > params.max_fd_growth:
                    problems.append({"process": name, "text": f"{name}: open fds grew {end[2] - base[2]} after the "
                                     f"warm-up ({base[2]} -> {end[2]}), over {params.max_fd_growth}"})
        per[name] = row
    counts = [(r.t, sum(1 for p in r.get("procs") or () if p.get("role") != "runner")) for r in samples]
    warm_count = next((n for t, n in counts if t >= t_warm), None)
    end_count = counts[-1][1]
    if warm_count is not None and end_count > warm_count + params.max_process_growth:
        problems.append({"text": f"the run had {end_count} processes at its end, {warm_count} after the warm-up "
                         f"(allowed: {params.max_process_growth} more)"})
    left = list(after.get("left") or ()) if after is not None else None
    if left:
        problems.append({"text": f"{len(left)} process(es) of the run outlived it: " + ", ".join(
            f"{p.get('role')} {p.get('id')} (pid {p.get('pid')}: {p.get('cmdline')})" for p in left)})
    metrics = {"processes": per, "process_count": {"after_warmup": warm_count, "end": end_count},
               "left_after_run": left, "warmup_s": params.warmup_s, "samples": len(samples),
               "bounds": {"max_rss_growth_mb": params.max_rss_growth_mb, "max_fd_growth": params.max_fd_growth}}
    if problems:
        return Verdict("resources", "fail", "; ".join(p["text"] for p in problems[:4]), tuple(problems), metrics)
    judged = [r for r in per.values() if r["role"] in params.roles and "rss_growth_mb" in r]
    worst = max(judged, key=lambda r: r["rss_growth_mb"], default=None)
    who = "" if worst is None else worst["role"] if worst["role"] == worst["id"] else f"{worst['role']} {worst['id']}"
    growth = (f"largest RSS growth after the warm-up {worst['rss_growth_mb']:+.1f} MB ({who})" if worst
              else "no process lived past the warm-up")
    if after is None:
        return Verdict("resources", "unknown", f"{growth}; whether a process outlived the run is not recorded", (),
                       metrics)
    return Verdict("resources", "pass", f"{growth}; {end_count} process(es) at the end ({warm_count} after the "
                   "warm-up); none outlived the run", (), metrics)


# The distributed checkers (two leaders, actions twice, the minority acting) register in CHECKERS too.
from fleetward.chaos import distributed as _distributed  # noqa: E402, F401
