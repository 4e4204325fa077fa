"""Checkers for what only a distributed run can get wrong: two leaders acting, an action carried out twice,
the minority side of a partition acting, a request answered twice.

They read the ``write`` records (:mod:`fleetward.chaos.writes`: what etcd committed, in revision order), the
``hosts`` record (which host runs which service) and the ``partition`` records of the partition faults
(which hosts were cut off, from when until the heal).

================== =====================================================================================
checker            what it checks
================== =====================================================================================
single_leader      in the order etcd committed them, every supervisor action and every scale decision comes
                   from the newest term so far, and each term from one issuer: no two leaders' fences
                   overlap (a deposed leader that still wrote after its successor would show as an older
                   term after a newer one)
actions_once       every action was claimed by an agent at most once and ended at most once
minority_quiet     while a partition cuts hosts off, nothing on them wrote: no action issued, no scale
                   decision, no worker record (a grace for writes already in flight when it began)
single_answer      no client request was answered twice (one ``ok`` at most, no SSE event id twice)
================== =====================================================================================
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fleetward.chaos.checkers import CheckContext, NoParams, Verdict, _checker
from fleetward.chaos.history import Record
from fleetward.chaos.runview import RunView

__all__ = ["leader_writes", "partitions"]


def _writes(view: RunView) -> list[Record]:
    return sorted((r for r in view.records if r.type == "write"), key=lambda r: int(r.get("revision") or 0))


def leader_writes(records: Iterable[Record]) -> dict[str, list[dict[str, Any]]]:
    """The writes each kind of leader made (supervisor: actions as issued; autoscaler: scale decisions), in
    revision order: revision, term, issuer, key."""
    out: dict[str, list[dict[str, Any]]] = {"supervisor": [], "autoscaler": []}
    for r in records:
        value = r.get("value")
        if r.type != "write" or r.get("op") != "put" or not isinstance(value, dict):
            continue
        key = str(r.get("key"))
        if key.startswith("actions/") and value.get("status") == "pending":
            out["supervisor"].append({"revision": r["revision"], "term": int(value.get("term") or 0),
                                      "issuer": value.get("issued_by"), "key": key, "t": r.t})
        elif key.startswith("scale/"):
            out["autoscaler"].append({"revision": r["revision"], "term": int(value.get("term") or 0),
                                      "issuer": value.get("leader"), "key": key, "t": r.t})
    for ws in out.values():
        ws.sort(key=lambda w: w["revision"])
    return out


@_checker("single_leader", "no two leaders' fences overlap: in etcd's commit order every action and scale decision "
          "comes from the newest term so far, each term from one issuer", NoParams)
def check_single_leader(view: RunView, ctx: CheckContext, params: NoParams) -> Verdict:
    details: list[dict[str, Any]] = []
    metrics: dict[str, Any] = {}
    seen_any = False
    for kind, writes in leader_writes(view.records).items():
        termed = [w for w in writes if w["term"]]
        seen_any = seen_any or bool(termed)
        newest: dict[str, Any] | None = None
        issuers: dict[int, set[str]] = defaultdict(set)
        for w in termed:
            issuers[w["term"]].add(str(w["issuer"]))
            if newest is not None and w["term"] < newest["term"]:
                details.append({"leader": kind, "problem": "an older term wrote after a newer one", "write": w,
                                "after": newest})
            if newest is None or w["term"] > newest["term"]:
                newest = w
        details += [{"leader": kind, "problem": "one term, several issuers", "term": term, "issuers": sorted(who)}
                    for term, who in issuers.items() if len(who) > 1]
        metrics[kind] = {"writes": len(termed), "terms": len(issuers),
                         "issuers": sorted({w["issuer"] for w in termed if w["issuer"]})}
    if details:
        return Verdict("single_leader", "fail", f"{len(details)} write(s) from overlapping leaders", tuple(details),
                       metrics)
    if not seen_any:  # nothing to overlap
        return Verdict("single_leader", "pass", "no leader wrote an action or a scale decision in this run",
                       metrics=metrics)
    counts = ", ".join(f"{k}: {m['writes']} writes, {m['terms']} term(s)" for k, m in metrics.items())
    return Verdict("single_leader", "pass", f"every leader write came from the newest term, one issuer per term "
                   f"({counts})", metrics=metrics)


@_checker("actions_once", "every supervisor action was claimed at most once and ended at most once", NoParams)
def check_actions_once(view: RunView, ctx: CheckContext, params: NoParams) -> Verdict:
    claims: Counter[str] = Counter()
    ends: Counter[str] = Counter()
    for r in _writes(view):
        value = r.get("value")
        key = str(r.get("key"))
        if r.get("op") != "put" or not key.startswith("actions/") or not isinstance(value, dict):
            continue
        status = value.get("status")
        if status == "running":
            claims[key] += 1
        elif status in ("done", "failed", "refused"):
            ends[key] += 1
    details = [{"action": k, "claims": claims[k], "ends": ends[k]} for k in sorted(set(claims) | set(ends))
               if claims[k] > 1 or ends[k] > 1]
    if details:
        return Verdict("actions_once", "fail", f"{len(details)} action(s) carried out more than once", tuple(details))
    return Verdict("actions_once", "pass", f"{len(claims)} action(s) claimed, each once",
                   metrics={"claimed": len(claims), "ended": len(ends)})


def partitions(records: Iterable[Record]) -> list[dict[str, Any]]:
    """Each partition fault's window: activity, the hosts cut off (``minority``), start and heal (run clock)."""
    open_: dict[str, dict[str, Any]] = {}
    done = []
    for r in records:
        if r.type != "partition":
            continue
        name = str(r.get("activity"))
        if r.get("phase") == "start":
            open_[name] = {"activity": name, "minority": list(r.get("minority") or []), "start": r.t, "heal": None}
        elif r.get("phase") == "heal" and name in open_:
            window = open_.pop(name)
            window["heal"] = r.t
            done.append(window)
    return done + list(open_.values())


def _placement(records: Iterable[Record]) -> dict[str, str]:
    for r in records:
        if r.type == "hosts":
            return {str(k): str(v) for k, v in (r.get("placement") or {}).items()}
    return {}


def _writer_host(r: Record, placement: Mapping[str, str]) -> str | None:
    """The host whose process made the write ``r``, where the history tells."""
    value = r.get("value")
    key = str(r.get("key"))
    if not isinstance(value, dict):
        return None
    if key.startswith("actions/") and value.get("status") == "pending":
        return placement.get(str(value.get("issued_by")))
    if key.startswith("actions/"):  # an agent's claim or result: the node it is addressed to
        return placement.get(f"agent:{key.split('/')[1]}")
    if key.startswith("scale/"):
        return placement.get(str(value.get("leader")))
    if key.startswith("workers/"):
        return placement.get(f"agent:{value.get('node')}")
    return None


class QuietParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grace_s: float = Field(1.0, ge=0, description="writes this soon after a partition began may have been in "
                           "flight before it")


@_checker("minority_quiet", "while a partition cuts hosts off, nothing on them wrote (actions, scale decisions, "
          "worker records)", QuietParams)
def check_minority_quiet(view: RunView, ctx: CheckContext, params: QuietParams) -> Verdict:
    windows = [w for w in partitions(view.records) if w["minority"]]
    if not windows:
        return Verdict("minority_quiet", "pass", "no partition cut hosts off in this run")
    placement = _placement(view.records)
    if not placement:
        return Verdict("minority_quiet", "unknown", "the history does not say which host runs what (no hosts record)")
    details = []
    for r in _writes(view):
        if r.get("op") != "put":
            continue
        host = _writer_host(r, placement)
        for w in windows:
            heal = w["heal"] if w["heal"] is not None else float("inf")
            if host in w["minority"] and w["start"] + params.grace_s <= r.t <= heal:
                details.append({"partition": w["activity"], "host": host, "key": r.get("key"),
                                "revision": r.get("revision"), "t": round(r.t, 3)})
    if details:
        return Verdict("minority_quiet", "fail", f"{len(details)} write(s) from hosts cut off by a partition",
                       tuple(details))
    return Verdict("minority_quiet", "pass", f"nothing on the cut-off side wrote during {len(windows)} partition(s)",
                   metrics={"partitions": len(windows)})


@_checker("single_answer", "no client request was answered twice (one ok at most, no SSE event id twice)", NoParams)
def check_single_answer(view: RunView, ctx: CheckContext, params: NoParams) -> Verdict:
    oks: Counter[str] = Counter(str(r.get("req")) for r in view.records if r.type == "ok")
    details: list[dict[str, Any]] = [{"req": req, "ok": n} for req, n in oks.items() if n > 1]
    for req, rv in view.requests.items():
        ids = Counter(c.get("event_id") for c in rv.chunks if c.get("event_id"))
        twice = sorted(str(i) for i, n in ids.items() if n > 1)
        if twice:
            details.append({"req": req, "event_ids_twice": twice[:5]})
    if details:
        return Verdict("single_answer", "fail", f"{len(details)} request(s) answered twice", tuple(details))
    return Verdict("single_answer", "pass", f"{len(oks)} request(s) answered once each")
