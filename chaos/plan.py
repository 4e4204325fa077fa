"""What a run would do, without doing it: ``fleetward chaos run --dry-run``.

:func:`plan` turns a validated experiment into the steps a run would take (the fleet it would bring up or
attach to, the workload, the blast radius, each fault with its targets and schedule, the rollbacks), and
:func:`render` into lines to print. Both are pure: nothing is started, no fleet is reached.

Times are as the experiment file's check takes them: a fault starts at ``at``, or ``delay`` seconds after the
activity named by ``after`` has stopped, taking recovery to be instant; at run time ``after`` waits for the
real recovery. Targets are the components a fault may hit: named ids, or the candidates a pick chooses
among (the declared fleet inside the blast radius). Which ones a pick takes is known only at injection
(``serving``: the busiest; ``random``: from the seed, skipping components already faulted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fleetward.chaos.catalogue import default_target, fault_catalogue
from fleetward.chaos.experiment import Experiment, declared_ids, radius_candidates
from fleetward.chaos.fault import Target
from fleetward.chaos.targets import match_ids

__all__ = ["Plan", "Step", "plan", "render"]


@dataclass(frozen=True)
class Step:
    """One scheduled fault as a run would drive it."""

    name: str
    fault: str
    start_s: float
    end_s: float
    when: str  # as written: "at 5 s", "2 s after kill"
    target: str  # the selector in words
    candidates: tuple[str, ...]  # what it may hit
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    title: str
    fleet: str
    workload: str
    radius: str
    steps: tuple[Step, ...]
    rollbacks: tuple[str, ...]


def plan(exp: Experiment, *, attach: str | None = None, etcd: str | None = None, mqtt: str | None = None) -> Plan:
    """The run of ``exp`` as it would go; ``attach``: the fleet it would attach to, in words; ``etcd``, ``mqtt``:
    the existing ones its own fleet would use."""
    f = exp.fleet
    workers = declared_ids(f, "worker") or []
    if attach is not None:
        fleet = (f"would attach to {attach} (not started by the run), as {f.workers} {f.backend} worker(s) "
                 f"{_ids(workers)} and {f.routers} router(s)")
    else:
        if f.hosts > 1:
            fleet = (f"would make {f.hosts} hosts (network namespaces, root) and start {f.workers} {f.backend} "
                     f"worker(s) on each {_ids(workers)}, a 3-member etcd across the first three, a broker on h0, "
                     f"{f.controllers} supervisor controller(s) and {f.routers} router(s) spread over them, in "
                     f"cluster {f.cluster or 'chaos-<random>'}")
        else:
            fleet = (f"would start {f.workers} {f.backend} worker(s) {_ids(workers)}"
                     + (f" ({f.prefill_workers} prefill)" if f.prefill_workers else "")
                     + f", {f.routers} router(s), {f.controllers} supervisor controller(s), "
                     + (f"on etcd {etcd}" if etcd else f"a private etcd ({f.etcd_members} member(s))")
                     + (f" and MQTT broker {mqtt}" if mqtt else " and a private MQTT broker")
                     + f", in cluster {f.cluster or 'chaos-<random>'}")
    w = exp.workload
    arrival = w.arrival
    rate = (f"{arrival.kind} {arrival.rate:g}/s" if arrival.rate is not None else
            f"trace {arrival.file} from {arrival.start_s:g} s")
    workload = (f"{w.duration_s:g} s of {w.api} requests, {rate}, temperature {w.temperature:g}, "
                f"then up to {w.drain_s:g} s of drain")
    radius = ("declared: " if exp.blast_radius is not None else "default (the whole declared fleet): ") + \
        exp.radius().describe()
    return Plan(exp.title, fleet, workload, radius, _steps(exp),
                tuple(rb.name or rb.action for rb in exp.rollbacks))


def _steps(exp: Experiment) -> tuple[Step, ...]:
    catalogue, _ = fault_catalogue()
    radius = exp.radius()
    names = exp.activity_names()
    node = exp.fleet.node  # the runner's own fleet: every declared worker is on its one node

    def node_of(_i: str) -> str:
        return node

    stops: dict[str, float] = {}
    out = []
    for i, act in enumerate(exp.method):
        spec = catalogue[act.fault]
        target = act.target or default_target(spec) or Target(kind="fleet", pick="all")
        if act.at is not None:
            start, when = act.at, f"at {act.at:g} s"
        else:
            assert act.after is not None
            start = stops[act.after] + act.delay
            when = f"{act.delay:g} s after {act.after}" if act.delay else f"after {act.after}"
            when += " has recovered"
        starts = act.occurrences(start, exp.workload.duration_s)
        if act.every is not None:
            when += f", then every {act.every:g} s: {len(starts)} time(s), the last at {starts[-1]:g} s"
        stops[names[i]] = starts[-1] + act.duration
        declared = declared_ids(exp.fleet, target.kind)
        if target.ids:
            hits = tuple(match_ids(target.ids, declared)[0] if declared is not None else target.ids)
            selector: str = target.kind
        else:
            pool = radius_candidates(radius, target.kind, declared or [], node_of)
            hits = tuple(pool)
            how = "all" if target.pick == "all" else f"{target.count} by pick {target.pick}"
            selector = f"{target.kind}: {how} of"
        out.append(Step(names[i], act.fault, start, start + act.duration, when, selector, hits, dict(act.params)))
    return tuple(out)


def _ids(ids: list[str]) -> str:
    return f"({', '.join(ids)})" if ids else ""


def render(p: Plan) -> list[str]:
    """The plan as lines for a terminal."""
    lines = [f"dry run: {p.title}", f"  fleet:        {p.fleet}", f"  workload:     {p.workload} (not started)",
             f"  blast radius: {p.radius}", "  schedule (seconds into the method; recovery taken as instant):"]
    if not p.steps:
        lines.append("    no faults: the workload alone")
    for s in p.steps:
        span = f"t={s.start_s:g}..{s.end_s:g} s" if s.end_s > s.start_s else f"t={s.start_s:g} s"
        params = f"  params {s.params}" if s.params else ""
        lines.append(f"    {span:<16} {s.name}: {s.fault} on {s.target} {', '.join(s.candidates) or '-'} "
                     f"({s.when}){params}")
    lines.append(f"  rollbacks:    {', '.join(p.rollbacks) or 'none'}")
    lines.append("nothing was started or injected")
    return lines
