"""Experiment validation: an experiment file read and checked, every problem named by file, line and field
(``experiment.yaml:14: method[0].target.ids: node-w7 is not in the declared fleet ...``).

Two passes:

1. the shape, by the pydantic models of :mod:`fleetward.chaos.experiment` (``extra="forbid"``: a misspelt key
   is an error);
2. the meaning: fault names against the catalogue (the error lists it), each fault's ``params`` against its
   :class:`~fleetward.chaos.fault.FaultSpec` params model, the fault against the fleet's backend, targets
   against the declared fleet and its blast radius, the safety limit (``safety.max_fault_share`` of a
   component kind faulted at once), ``after:`` references, probe, rollback and checker names and
   parameters, prompt + output lengths against the model's context, trace files.

Both passes raise one :class:`~fleetward.fleet.errors.ConfigError` listing every problem found.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from fleetward.chaos.catalogue import (
    backends_for,
    counts_toward_share,
    default_target,
    fault_catalogue,
    target_kinds,
    unknown_fault,
)
from fleetward.chaos.experiment import Experiment, FleetSpec, declared_ids, radius_candidates, resolve_trace
from fleetward.chaos.fault import FaultSpec, Target
from fleetward.chaos.targets import match_ids
from fleetward.fleet.backends import backend_capabilities
from fleetward.fleet.config import parse_yaml, read_text, validation_error
from fleetward.fleet.errors import ConfigError

__all__ = ["REQUIREMENTS", "load_experiment", "validate_experiment"]

Loc = tuple[str | int, ...]
_TARGET_KINDS = frozenset(get_args(Target.model_fields["kind"].annotation))


def _target_size(target: Target, declared: list[str] | None, candidates: list[str] | None = None) -> int:
    if target.ids:
        return len(match_ids(target.ids, declared)[0]) if declared is not None else len(target.ids)
    if target.pick == "all":
        pool = candidates if candidates is not None else declared
        return len(pool) if pool is not None else target.count
    return target.count


def _problem(loc: Loc, message: str, value: Any = None) -> InitErrorDetails:
    return {"type": PydanticCustomError("fleetward", "{msg}", {"msg": message}), "loc": loc, "input": value}


def _nested(exc: ValidationError, prefix: Loc) -> list[InitErrorDetails]:
    out: list[InitErrorDetails] = []
    for err in exc.errors():
        loc = (*prefix, *err["loc"])
        if err["type"] == "extra_forbidden":
            out.append({"type": "extra_forbidden", "loc": loc, "input": err.get("input")})
        else:
            out.append(_problem(loc, err["msg"], err.get("input")))
    return out


@dataclass(frozen=True)
class _Window:
    index: int
    kind: str
    size: int
    start: float
    end: float


def _near(name: str, known: Iterable[str]) -> str:
    near = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {near[0]}?)" if near else ""


def _meaning(exp: Experiment, *, base: Path | None) -> list[InitErrorDetails]:
    """Every problem of meaning in ``exp`` (empty when it is runnable)."""
    from fleetward.chaos.checkers import CHECKERS
    from fleetward.chaos.probes import PROBES
    from fleetward.chaos.rollbacks import ROLLBACKS

    catalogue, broken = fault_catalogue()
    problems: list[InitErrorDetails] = []
    names = exp.activity_names()
    seen: dict[str, int] = {}
    starts: dict[str, float] = {}
    windows: list[_Window] = []
    fleet = exp.fleet
    for i, act in enumerate(exp.method):
        here: Loc = ("method", i)
        name = names[i]
        if name in seen:
            problems.append(_problem((*here, "name"), f"{name!r} is already the name of method[{seen[name]}]"))
        seen[name] = i
        spec = catalogue.get(act.fault)
        if spec is None:
            problems.append(_problem((*here, "fault"), unknown_fault(act.fault, catalogue, broken), act.fault))
            continue
        try:
            spec.params.model_validate(act.params)
        except ValidationError as exc:
            problems.extend(_nested(exc, (*here, "params")))
        if not spec.works_on(backend_capabilities(fleet.backend)):
            problems.append(_problem((*here, "fault"), f"{act.fault} does not work on {fleet.backend} workers "
                                     f"(it needs {', '.join(spec.needs)}: {', '.join(backends_for(spec))} only)"))
        problems.extend(_requirements(spec, fleet, here))
        kinds = tuple(k for k in target_kinds(spec) if k in _TARGET_KINDS)
        target = act.target or default_target(spec)
        if target is None:
            problems.append(_problem((*here, "target"), f"{act.fault} needs a target (e.g. "
                                     "{kind: worker, pick: serving, count: 1})"))
            continue
        if kinds and target.kind not in kinds:
            problems.append(_problem((*here, "target", "kind"), f"{act.fault} targets {' or '.join(kinds)}, "
                                     f"not {target.kind}", target.kind))
        declared = declared_ids(fleet, target.kind)
        if target.count < 1:
            problems.append(_problem((*here, "target", "count"), "count is at least 1", target.count))
        if declared is not None:
            _, outside = match_ids(target.ids, declared)
            if outside:
                problems.append(_problem((*here, "target", "ids"), f"{', '.join(outside)} "
                                         f"{'is' if len(outside) == 1 else 'are'} not in the declared fleet "
                                         f"({target.kind}s: {', '.join(declared) or 'none'})", list(target.ids)))
            elif not target.ids and target.pick != "all" and target.count > len(declared):
                problems.append(_problem((*here, "target", "count"), f"the declared fleet has only "
                                         f"{len(declared)} {target.kind}(s), not {target.count}", target.count))
        radius_problem, candidates = _radius(exp, act.fault, target, declared, here)
        if radius_problem is not None:
            problems.append(radius_problem)
        # When the activity is in effect (statically: recovery takes no time).
        if act.at is not None:
            start = act.at
            if start >= exp.workload.duration_s:
                problems.append(_problem((*here, "at"), f"starts at {start:g} s, after the workload ends "
                                         f"(workload.duration_s {exp.workload.duration_s:g})", start))
        else:
            assert act.after is not None
            if act.after not in starts:
                where = "a later activity" if act.after in names else "no activity"
                problems.append(_problem((*here, "after"), f"{act.after!r} names {where}; `after` refers to an "
                                         f"earlier activity ({', '.join(names[:i]) or 'none yet'})", act.after))
                continue
            start = starts[act.after] + act.delay
        occurrences = act.occurrences(start, exp.workload.duration_s)
        if act.every is not None:
            if act.every < act.duration:
                problems.append(_problem((*here, "every"), f"every {act.every:g} s is shorter than duration "
                                         f"{act.duration:g} s: an occurrence would start while the one before "
                                         "holds", act.every))
            if act.until is not None and act.until <= start:
                problems.append(_problem((*here, "until"), f"until {act.until:g} s is not after the first start "
                                         f"({start:g} s): nothing would repeat", act.until))
            if act.until is not None and act.until > exp.workload.duration_s:
                problems.append(_problem((*here, "until"), f"until {act.until:g} s is after the workload ends "
                                         f"(workload.duration_s {exp.workload.duration_s:g})", act.until))
        starts[name] = occurrences[-1] + act.duration
        if counts_toward_share(spec, target):
            size = _target_size(target, declared, candidates)
            windows.extend(_Window(i, target.kind, size, t, t + act.duration) for t in occurrences)
    problems.extend(_safety(exp, windows))
    problems.extend(_workload_meaning(exp, base=base))
    for i, probe in enumerate(exp.hypothesis().probes if exp.steady_state_hypothesis else ()):
        found = PROBES.get(probe.probe)
        if found is None:
            problems.append(_problem(("steady-state-hypothesis", "probes", i, "probe"),
                                     f"unknown probe {probe.probe!r}{_near(probe.probe, PROBES)}; probes: "
                                     f"{', '.join(PROBES)}", probe.probe))
            continue
        try:
            found.args.model_validate(probe.args)
        except ValidationError as exc:
            problems.extend(_nested(exc, ("steady-state-hypothesis", "probes", i, "args")))
    for i, rb in enumerate(exp.rollbacks):
        if rb.action not in ROLLBACKS:
            problems.append(_problem(("rollbacks", i, "action"), f"unknown rollback {rb.action!r}"
                                     f"{_near(rb.action, ROLLBACKS)}; rollbacks: {', '.join(ROLLBACKS)}", rb.action))
    for i, chk in enumerate(exp.checkers or ()):
        checker = CHECKERS.get(chk.name)
        if checker is None:
            problems.append(_problem(("checkers", i, "name"), f"unknown checker {chk.name!r}"
                                     f"{_near(chk.name, CHECKERS)}; checkers: {', '.join(CHECKERS)}", chk.name))
            continue
        try:
            checker.params.model_validate(chk.params)
        except ValidationError as exc:
            problems.extend(_nested(exc, ("checkers", i, "params")))
    return problems


REQUIREMENTS: Mapping[str, tuple[str, Any, str]] = {
    # what a fault's spec.extra["requires"] may name: (fleet field, test, what to write in the file)
    "gpus": ("gpus_per_worker", lambda v: v > 0, "fleet.gpus_per_worker: 1 (a fake GPU source for the node agent)"),
    "standby": ("controllers", lambda v: v >= 2, "fleet.controllers: 2 (a leader and a standby)"),
    "hosts": ("hosts", lambda v: v >= 3, "fleet.hosts: 3 or more (hosts in network namespaces to partition; root)"),
}


def _requirements(spec: FaultSpec, fleet: FleetSpec, here: Loc) -> list[InitErrorDetails]:
    out = []
    for need in spec.extra.get("requires", ()):
        field, holds, fix = REQUIREMENTS[need]
        if not holds(getattr(fleet, field)):
            out.append(_problem((*here, "fault"), f"{spec.name} needs {fix}"))
    return out


def _radius(exp: Experiment, fault: str, target: Target, declared: list[str] | None,
            here: Loc) -> tuple[InitErrorDetails | None, list[str] | None]:
    """A target outside the blast radius, as a problem; and the declared ids a pick may choose from."""
    radius = exp.radius()
    if radius.selector(target.kind) is None:
        return None, None
    node = exp.fleet.node  # the runner's own fleet has one node agent: every declared worker is on it

    def node_of(_i: str) -> str:
        return node

    if target.ids:
        named = match_ids(target.ids, declared)[0] if declared is not None else list(target.ids)
        outside = [i for i in named if not radius.admits(target.kind, i, node=node_of(i))]
        if outside:
            return _problem((*here, "target", "ids"), f"{fault} would hit {', '.join(outside)}, outside the blast "
                            f"radius ({radius.describe()})", list(target.ids)), None
        return None, None
    if declared is None:
        return None, None
    candidates = radius_candidates(radius, target.kind, declared, node_of)
    if not candidates:
        return _problem((*here, "target"), f"{fault} picks a {target.kind}, and no {target.kind} of the declared "
                        f"fleet ({', '.join(declared) or 'none'}) is inside the blast radius "
                        f"({radius.describe()})"), candidates
    if target.pick != "all" and target.count > len(candidates):
        return _problem((*here, "target", "count"), f"{fault} picks {target.count} {target.kind}(s); only "
                        f"{len(candidates)} ({', '.join(candidates)}) are inside the blast radius "
                        f"({radius.describe()})", target.count), candidates
    return None, candidates


def _safety(exp: Experiment, windows: Iterable[_Window]) -> list[InitErrorDetails]:
    by_kind: dict[str, list[_Window]] = {}
    for w in windows:
        by_kind.setdefault(w.kind, []).append(w)
    problems: list[InitErrorDetails] = []
    for kind, ws in by_kind.items():
        declared = declared_ids(exp.fleet, kind)
        if not declared:
            continue
        limit = exp.safety.limit(kind)
        capacity = kind == "worker" and exp.radius().max_capacity_share < limit
        if capacity:
            limit = exp.radius().max_capacity_share
        for w in sorted(ws, key=lambda w: (w.start, w.index)):
            # Everything of this kind in effect when w starts (an instant fault still counts at its instant).
            overlapping = [o for o in ws if o.start <= w.start and (o.end > w.start or o is w or
                                                                     (o.start == w.start == o.end))]
            size = sum(o.size for o in overlapping)
            share = size / len(declared)
            if share > limit + 1e-9:
                others = [f"method[{o.index}]" for o in overlapping if o is not w]
                withs = f" together with {', '.join(others)}" if others else ""
                problems.append(_problem(("method", w.index, "target"),
                                         f"would fault {size} of {len(declared)} {kind}(s) at once from "
                                         f"t={w.start:g} s{withs}: share {share:.2f} is over "
                                         + (f"the blast radius's max_capacity_share {limit:g}" if capacity else
                                            f"the safety limit {limit:g} (safety.max_fault_share / "
                                            f"safety.per_kind.{kind})")))
                break
    return problems


def _workload_meaning(exp: Experiment, *, base: Path | None) -> list[InitErrorDetails]:
    w = exp.workload
    problems: list[InitErrorDetails] = []
    limit = exp.fleet.max_model_len
    if w.arrival.kind == "trace":
        assert w.arrival.file is not None
        if resolve_trace(w.arrival.file, base=base) is None:
            problems.append(_problem(("workload", "arrival", "file"), f"trace file {w.arrival.file!r} not found "
                                     "(beside the experiment, in the current folder, under $FLEETWARD_TRACES, "
                                     "in fleetward's chaos/traces or ../shared/traces)", w.arrival.file))
        longest = w.arrival.max_input_tokens + w.arrival.max_output_tokens
        if longest > limit:
            problems.append(_problem(("workload", "arrival", "max_output_tokens"), f"max_input_tokens + "
                                     f"max_output_tokens = {longest} exceeds the model's context ({limit})"))
    elif w.isl.upper + w.osl.upper > limit:
        problems.append(_problem(("workload", "osl"), f"the longest prompt ({w.isl.upper}) plus the longest output "
                                 f"({w.osl.upper}) exceeds the model's context ({limit} tokens)"))
    return problems


def validate_experiment(data: Any, *, file: str = "<experiment>", lines: Mapping[Loc, int] | None = None,
                        base: Path | None = None) -> Experiment:
    """Validate parsed experiment data (shape, then meaning); :class:`ConfigError` names file, line, field."""
    lines = lines or {}
    if isinstance(data, Experiment):
        exp = data
    else:
        if not isinstance(data, dict):
            raise ConfigError("the top level must be a mapping of keys to values", file=file, line=1)
        try:
            exp = Experiment.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc, file=file, lines=lines) from None
    problems = _meaning(exp, base=base)
    if problems:
        meaning = ValidationError.from_exception_data("Experiment", problems)
        raise validation_error(meaning, file=file, lines=lines) from None
    return exp


def load_experiment(path: str | Path) -> Experiment:
    """Read and validate an experiment file."""
    file = str(path)
    data, lines = parse_yaml(read_text(path), file=file)
    return validate_experiment(data, file=file, lines=lines, base=Path(path).resolve().parent)
