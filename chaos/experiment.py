"""Experiment files: Chaos-Toolkit-shaped YAML plus a fleet, a workload, a timed fault schedule and checkers.

An experiment is validated in two passes, both reported with file, line and field
(``experiment.yaml:14: method[0].target.ids: node-w7 is not in the declared fleet ...``):

1. the shape, by the pydantic models below (``extra="forbid"``: a misspelt key is an error);
2. the meaning: fault names against the catalogue (the error lists it), each fault's ``params`` against its
   :class:`~fleetward.chaos.fault.FaultSpec` params model, targets against the declared fleet, the
   safety limit (``safety.max_fault_share`` of a component kind faulted at once), ``after:`` references,
   checker names and parameters, prompt + output lengths against the model's context, trace files.

The format (a commented example is in ``docs/chaos.md``)::

    title, description, tags, seed
    fleet:       backend, workers, routers, etcd members, proxies, sim/vllm/routing/supervisor settings
    workload:    duration_s, arrival (poisson | constant | trace), isl, osl, api, temperature, ...
    steady-state-hypothesis: {title, probes: [{name, probe, args, tolerance}]}
    method:      [{name, fault, at | after (+ delay), duration, every (+ until, times), target, params}]
    rollbacks:   [{action, args}]
    checkers:    [name | {name, params}]
    safety:      {max_fault_share, per_kind}
    blast_radius: {workers, nodes, routers, links, etcd, broker, supervisors, max_capacity_share}
    reference:   auto | model | run | none

The blast radius (:class:`BlastRadius`) is what the experiment may break: a fault whose target falls outside
it is refused here, before anything runs, and again by the runner on the targets it resolves; the runner
also aborts the method when more of the fleet's capacity is out of service than its ``max_capacity_share``.
An experiment that declares none may break the whole fleet it declares (:data:`DEFAULT_RADIUS`), which is
the fleet the runner brought up for it; a fleet the runner did not start needs a declared one.

One module (over 600 lines) because the file format and the rules of meaning that go with its fields
are read together: a field and what makes its value wrong stay side by side.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import os
import pkgutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from fleetward.chaos.fault import CATALOGUE, FaultSpec, Target
from fleetward.chaos.targets import match_ids
from fleetward.fleet.backends import BACKENDS, Backend, backend_capabilities, make_backend
from fleetward.fleet.config import (
    ID_PATTERN,
    Frozen,
    RouterConfig,
    SimConfig,
    SupervisorConfig,
    VllmConfig,
    parse_yaml,
    read_text,
    validation_error,
)
from fleetward.fleet.errors import ConfigError

__all__ = [
    "DEFAULT_RADIUS",
    "Activity",
    "Arrival",
    "BlastRadius",
    "CheckerSpec",
    "Experiment",
    "FleetSpec",
    "Hypothesis",
    "Lengths",
    "Probe",
    "ProxySpec",
    "Range",
    "Rollback",
    "Safety",
    "WorkloadSpec",
    "counts_toward_share",
    "declared_ids",
    "default_target",
    "fault_catalogue",
    "load_experiment",
    "radius_candidates",
    "radius_field",
    "resolve_trace",
    "target_kinds",
    "validate_experiment",
]

log = logging.getLogger(__name__)

Loc = tuple[str | int, ...]
TargetKind = Literal["worker", "router", "etcd", "broker", "link", "supervisor", "gpu", "kv", "fleet"]
_TARGET_KINDS = frozenset(get_args(Target.model_fields["kind"].annotation))

# -- the shape ----------------------------------------------------------------------------------------------


class Lengths(Frozen):
    """A token-length distribution: ``64`` (fixed), ``{dist: uniform, min, max}``, ``{dist: lognormal,
    median, sigma, min, max}``. Samples are drawn from the experiment's seed, so a run is repeatable."""

    dist: Literal["fixed", "uniform", "lognormal"] = "fixed"
    value: int | None = Field(None, ge=1, description="fixed: the length")
    min: int = Field(1, ge=1, description="uniform / lognormal: the least length")
    max: int | None = Field(None, ge=1, description="uniform / lognormal: the greatest length")
    median: float | None = Field(None, gt=0, description="lognormal: the median")
    sigma: float = Field(0.5, gt=0, le=4, description="lognormal: the spread (of the log)")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        if isinstance(data, int) and not isinstance(data, bool):
            return {"dist": "fixed", "value": data}
        return data

    @model_validator(mode="after")
    def _complete(self) -> Lengths:
        if self.dist == "fixed" and self.value is None:
            raise ValueError("a fixed length needs `value` (or write the number alone)")
        if self.dist == "uniform" and self.max is None:
            raise ValueError("a uniform length needs `min` and `max`")
        if self.dist == "lognormal" and (self.median is None or self.max is None):
            raise ValueError("a lognormal length needs `median` and `max` (and optionally `sigma`, `min`)")
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min})")
        return self

    @property
    def upper(self) -> int:
        """The greatest length this distribution yields."""
        return self.value if self.dist == "fixed" and self.value is not None else int(self.max or self.min)


class Arrival(Frozen):
    """When requests arrive (open loop: an arrival never waits for an earlier request to finish)."""

    kind: Literal["poisson", "constant", "trace"] = "poisson"
    rate: float | None = Field(None, gt=0, le=10_000, description="poisson / constant: requests per second")
    file: str | None = Field(None, description="trace: a CSV of arrivals with input and output lengths")
    start_s: float = Field(0.0, ge=0, description="trace: where in the trace to start")
    time_scale: float = Field(1.0, gt=0, description="trace: factor on the gaps between arrivals (0.5 = twice "
                              "the rate)")
    token_scale: float = Field(1.0, gt=0, description="trace: factor on input and output lengths")
    max_input_tokens: int = Field(1024, ge=1, description="trace: longer prompts are cut to this")
    max_output_tokens: int = Field(256, ge=1, description="trace: longer outputs are cut to this")

    @model_validator(mode="after")
    def _complete(self) -> Arrival:
        if self.kind in ("poisson", "constant") and self.rate is None:
            raise ValueError(f"{self.kind} arrivals need `rate` (requests per second)")
        if self.kind == "trace" and not self.file:
            raise ValueError("trace arrivals need `file`")
        return self


class WorkloadSpec(Frozen):
    """The client load that runs during the method, and how clients behave."""

    duration_s: float = Field(10.0, gt=0, le=24 * 3600)
    arrival: Arrival = Arrival(rate=5.0)
    isl: Lengths = Lengths(value=32)
    osl: Lengths = Lengths(value=32)
    api: Literal["completion", "chat"] = "completion"
    temperature: float = Field(0.0, ge=0, le=2, description="0: greedy (a deterministic engine's streams are "
                               "then checkable token for token)")
    ignore_eos: bool = Field(True, description="generate exactly the output length asked for")
    timeout_s: float = Field(60.0, gt=0, description="a request's deadline on the client")
    max_in_flight: int = Field(512, ge=1, description="the client's cap; arrivals beyond it are shed and noted")
    drain_s: float = Field(30.0, ge=0, description="after duration_s, how long open requests may finish")
    resume: bool = Field(False, description="a client refused by a router tries the next one, and one whose stream "
                         "breaks resumes on the next router with Last-Event-ID (docs/architecture.md, request life, "
                         "step 7)")
    max_resumes: int = Field(3, ge=0)


class ProxySpec(Frozen):
    """Fault proxies the fleet is wired through (links for the ``network`` family and some ``control``
    faults). Link names: ``router->worker:<worker>``, ``client->router:<router>``, ``agent->etcd``,
    ``agent->broker``, ``<router>->etcd``, ``<router>->broker``."""

    workers: bool = Field(False, description="a proxy in front of each worker (router->worker:<id>)")
    clients: bool = Field(False, description="a proxy in front of each router (client->router:<id>); clients "
                          "connect through it")
    control: bool = Field(False, description="the node agent and the routers reach etcd and the broker through "
                          "proxies")


class FleetSpec(Frozen):
    """The fleet the experiment brings up (or expects, with ``--attach``)."""

    backend: Literal["sim", "vllm"] = "sim"
    workers: int = Field(3, ge=1, le=64)
    prefill_workers: int = Field(0, ge=0, le=63, description="of the workers, how many form the prefill pool (the "
                                 "rest decode); the kv fault family acts on their KV transfers")
    routers: int = Field(1, ge=1, le=8)
    node: str = Field("node", pattern=ID_PATTERN, description="worker ids are "
                      "<node>-w<i>")
    cluster: str | None = Field(None, pattern=ID_PATTERN,
                                description="default: chaos-<random> (or the attached fleet's)")
    etcd_members: Literal[1, 3] = Field(1, description="3: a local 3-member etcd cluster (control faults)")
    controllers: int = Field(1, ge=1, le=3, description="supervisor controllers: 1 runs inside the runner; 2 or 3 "
                             "run as `fleetward supervisor --role controller` processes, one leader and standbys "
                             "(control.supervisor_leader_kill needs 2)")
    gpus_per_worker: int = Field(0, ge=0, le=8, description="> 0: the node agent watches a fake GPU health source "
                                 "(chaos.fakegpu.FakeGpuSource) and worker i owns GPUs [i*k, (i+1)*k) of it; the gpu "
                                 "fault family acts through it")
    lease_ttl_s: int = Field(10, ge=2, le=3600)
    proxies: ProxySpec = ProxySpec()
    model: str | None = Field(None, description="vllm: model folder (default: the tiny local model)")
    sim: SimConfig = SimConfig()
    vllm: VllmConfig = VllmConfig()
    routing: RouterConfig = RouterConfig()
    supervisor: SupervisorConfig = SupervisorConfig()

    @model_validator(mode="after")
    def _pools(self) -> FleetSpec:
        if self.prefill_workers and self.prefill_workers >= self.workers:
            raise ValueError(f"prefill_workers={self.prefill_workers} leaves no decode worker among "
                             f"workers={self.workers}")
        return self

    @property
    def max_model_len(self) -> int:
        return self.worker_backend().max_model_len

    def worker_backend(self, *, model_path: Path | None = None, run_dir: Path = Path(".fleetward")) -> Backend:
        """The backend of the fleet's workers, from its config section."""
        return make_backend(self.backend, sim=self.sim, vllm=self.vllm, model_path=model_path, run_dir=run_dir)


class Range(Frozen):
    min: float | None = None
    max: float | None = None

    def holds(self, value: float) -> bool:
        return (self.min is None or value >= self.min) and (self.max is None or value <= self.max)


Tolerance = bool | float | Range


class Probe(Frozen):
    """A steady-state probe: a built-in measurement and the tolerance its value must meet.

    Probes are registered in :mod:`fleetward.chaos.probes` (``workers_routable``, ``routers_healthy``,
    ``requests``, ...). A tolerance is a value (``true``, ``3``) or ``{min, max}``. With ``within_s`` the
    probe is repeated until its tolerance holds (a restarted worker takes a while).
    """

    name: str
    probe: str
    args: dict[str, Any] = Field(default_factory=dict)
    tolerance: Tolerance
    within_s: float = Field(0.0, ge=0, le=3600, description="probe again until the tolerance holds, for up to "
                            "this long (0: once)")

    def accepts(self, value: Any) -> bool:
        t = self.tolerance
        if isinstance(t, Range):
            return isinstance(value, (int, float)) and not isinstance(value, bool) and t.holds(float(value))
        if isinstance(t, bool):
            return value is t
        return isinstance(value, (int, float)) and not isinstance(value, bool) and float(value) == t


class Hypothesis(Frozen):
    title: str = "the fleet serves"
    probes: tuple[Probe, ...] = ()


class Activity(Frozen):
    """One scheduled fault: inject at ``at`` seconds into the method (or ``delay`` seconds after the
    activity named by ``after`` has stopped), hold ``duration`` seconds, then recover.

    With ``every``, the fault is injected again every ``every`` seconds after its first start, while the start
    is before ``until`` (default: the end of the workload) and, with ``times``, at most that many times. Each
    occurrence is its own activity in the history (``<name>:<k>``, k from 0), its target resolved again; an
    occurrence never overlaps the one before (when a recovery runs late, the next starts once it is done).
    ``after:`` an activity that repeats follows its last occurrence."""

    name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.#:-]{0,62}$")
    fault: str
    at: float | None = Field(None, ge=0)
    after: str | None = None
    delay: float = Field(0.0, ge=0)
    duration: float = Field(0.0, ge=0)
    target: Target | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    verify_timeout_s: float | None = Field(None, gt=0, description="how long verify() and verify_recovered() may "
                                           "take; default: the fault's own timeouts plus 5 s, else 30 s")
    every: float | None = Field(None, gt=0, description="inject again every this many seconds after the first "
                                "start (each occurrence held `duration`, then recovered)")
    until: float | None = Field(None, gt=0, description="with every: no occurrence starts at or after this many "
                                "seconds into the method (default: workload.duration_s)")
    times: int | None = Field(None, ge=1, description="with every: at most this many occurrences")

    @model_validator(mode="after")
    def _when(self) -> Activity:
        if (self.at is None) == (self.after is None):
            raise ValueError("give exactly one of `at` (seconds into the method) and `after` (an activity name)")
        if self.at is not None and self.delay:
            raise ValueError("`delay` goes with `after`; with `at`, put the time in `at`")
        if self.every is None and (self.until is not None or self.times is not None):
            raise ValueError("`until` and `times` go with `every` (a repeated fault)")
        return self

    def occurrences(self, first: float, horizon: float) -> list[float]:
        """The planned starts (seconds into the method) of this activity when its first start is ``first``:
        one, or with ``every`` each ``every`` seconds while before ``until`` (default ``horizon``), ``times`` at
        most."""
        if self.every is None:
            return [first]
        end = self.until if self.until is not None else horizon
        out = [first]
        while (self.times is None or len(out) < self.times) and first + len(out) * self.every < end - 1e-9:
            out.append(first + len(out) * self.every)
        return out


class Rollback(Frozen):
    """Run after the method whatever happened: a rollback of :mod:`fleetward.chaos.rollbacks`
    (``restore_fleet``: back to healthy; or one of its parts)."""

    name: str | None = None
    action: str
    args: dict[str, float] = Field(default_factory=dict)

    @field_validator("args")
    @classmethod
    def _only_timeout(cls, value: dict[str, float]) -> dict[str, float]:
        unknown = set(value) - {"timeout_s"}
        if unknown:
            raise ValueError(f"unknown argument(s) {sorted(unknown)}; rollbacks take only timeout_s")
        return value


class CheckerSpec(Frozen):
    name: str
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data


class Safety(Frozen):
    """Refuse to start when the schedule would, at any moment, fault more than ``max_fault_share`` of the
    declared components of one kind (``per_kind`` overrides it for a kind, e.g. ``etcd: 1.0``)."""

    max_fault_share: float = Field(0.5, gt=0, le=1)
    per_kind: dict[TargetKind, float] = Field(default_factory=dict)

    @field_validator("per_kind")
    @classmethod
    def _shares(cls, value: dict[str, float]) -> dict[str, float]:
        for kind, share in value.items():
            if not 0 < share <= 1:
                raise ValueError(f"{kind}: a share is within (0, 1], got {share}")
        return value

    def limit(self, kind: str) -> float:
        return float(self.per_kind.get(kind, self.max_fault_share))  # type: ignore[call-overload]


Selector = tuple[str, ...]


class BlastRadius(Frozen):
    """What an experiment may break, and how much of the fleet's capacity may be out of service at once.

    Each list names components by id or glob (``node-w*``, ``router->worker:*``, ``*->etcd``). A kind left out
    of a declared radius may not be faulted at all: the radius is an allow-list, as a selector is in Chaos
    Mesh. Workers are inside when listed under ``workers`` or when they run on a host listed under ``nodes``;
    gpu and kv faults act on the workers that own the GPUs or send the KV, so they follow ``workers`` and
    ``nodes`` too. Load faults (``fleet``) take nothing out of service and are not scoped by the radius.

    Picks (``random``, ``serving``, ``first``, ``all``) choose among the components inside the radius only.
    ``max_capacity_share`` bounds the share of the fleet's workers out of service (not routable: dead,
    unhealthy, restarting, draining, quarantined) at any moment of the method, whatever the cause: the
    schedule is refused when its own worker faults would exceed it, and the run aborts, recovering every
    fault in effect and running the rollbacks, when the fleet is seen beyond it.
    """

    workers: Selector = Field((), description="worker ids or globs that may be faulted")
    nodes: Selector = Field((), description="hosts whose workers may be faulted")
    routers: Selector = Field((), description="router ids or globs")
    links: Selector = Field((), description="links (fault proxies): router->worker:<id>, client->router:<id>, "
                            "agent->etcd, ... or globs")
    etcd: Selector = Field((), description="etcd members (etcd-<i>)")
    broker: Selector = Field((), description="the MQTT broker (broker)")
    supervisors: Selector = Field((), description="supervisor controllers (controller-<i>)")
    max_capacity_share: float = Field(0.5, gt=0, le=1, description="the largest share of the fleet's workers that "
                                      "may be out of service at once")

    def selector(self, kind: str) -> Selector | None:
        """The ids or globs of ``kind`` inside the radius; None: the kind is not scoped (load faults)."""
        field = radius_field(kind)
        return None if field is None else tuple(getattr(self, field))

    def admits(self, kind: str, ident: str, *, node: str | None = None) -> bool:
        """Whether the component ``ident`` of ``kind`` (a worker on ``node``) is inside the radius."""
        sel = self.selector(kind)
        if sel is None:
            return True
        if match_ids(sel, [ident])[0]:
            return True
        return radius_field(kind) == "workers" and node is not None and bool(match_ids(self.nodes, [node])[0])

    def describe(self) -> str:
        parts = [f"{name} {', '.join(getattr(self, name))}" for name in
                 ("workers", "nodes", "routers", "links", "etcd", "broker", "supervisors") if getattr(self, name)]
        return "; ".join(parts or ["nothing"]) + f"; max capacity share {self.max_capacity_share:g}"


# Every kind of component, whole: what an experiment that declares no radius may break (of the fleet it declares);
# its max_capacity_share follows the experiment's safety rule for workers (:meth:`Experiment.radius`).
DEFAULT_RADIUS = BlastRadius(workers=("*",), routers=("*",), links=("*",), etcd=("*",), broker=("*",),
                             supervisors=("*",), max_capacity_share=0.5)

_RADIUS_FIELDS: Mapping[str, str] = {"worker": "workers", "gpu": "workers", "kv": "workers", "router": "routers",
                                     "link": "links", "etcd": "etcd", "broker": "broker",
                                     "supervisor": "supervisors"}


def radius_field(kind: str) -> str | None:
    """The :class:`BlastRadius` list that scopes targets of ``kind`` (None for ``fleet``: load faults)."""
    return _RADIUS_FIELDS.get(kind)


def radius_candidates(radius: BlastRadius, kind: str, universe: Iterable[str],
                      node_of: Callable[[str], str | None]) -> list[str]:
    """The ids of ``universe`` inside ``radius`` (``node_of``: a worker's host)."""
    return [i for i in universe if radius.admits(kind, i, node=node_of(i))]


class Experiment(Frozen):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, populate_by_name=True)

    version: Literal[1] = 1
    title: str = Field(min_length=1)
    description: str = ""
    tags: tuple[str, ...] = ()
    seed: int = 0
    fleet: FleetSpec = FleetSpec()
    workload: WorkloadSpec = WorkloadSpec()
    steady_state_hypothesis: Hypothesis | None = Field(None, alias="steady-state-hypothesis")
    method: tuple[Activity, ...] = ()
    rollbacks: tuple[Rollback, ...] = (Rollback(action="restore_fleet"),)
    checkers: tuple[CheckerSpec, ...] | None = Field(None, description="default: every checker, with defaults")
    safety: Safety = Safety()
    blast_radius: BlastRadius | None = Field(None, description="what the experiment may break (default: the whole "
                                             "fleet it declares, as much of its capacity at once as the safety "
                                             "rule allows for workers)")
    reference: Literal["auto", "model", "run", "none"] = Field(
        "auto", description="the fault-free reference of each stream: the sim's model, a fault-free run of the "
        "same requests after the method (greedy vLLM), or none")

    def hypothesis(self) -> Hypothesis:
        """The steady-state hypothesis, or the default one: every worker routable, probe requests exact."""
        if self.steady_state_hypothesis is not None:
            return self.steady_state_hypothesis
        return Hypothesis(probes=(
            Probe(name="every worker is routable", probe="workers_routable",
                  tolerance=Range(min=self.fleet.workers), within_s=60.0),
            Probe(name="probe requests complete exactly", probe="requests", tolerance=1.0),
        ))

    def radius(self) -> BlastRadius:
        """The declared blast radius, or :data:`DEFAULT_RADIUS` with as much capacity as the safety rule lets
        the schedule's worker faults take (``safety.per_kind.worker``, else ``safety.max_fault_share``)."""
        if self.blast_radius is not None:
            return self.blast_radius
        return DEFAULT_RADIUS.model_copy(update={"max_capacity_share": self.safety.limit("worker")})

    def activity_names(self) -> list[str]:
        return [a.name or f"{a.fault}#{i}" for i, a in enumerate(self.method)]

    @staticmethod
    def occurrence_name(name: str, act: Activity, k: int) -> str:
        """The history's name of occurrence ``k`` of an activity (``<name>:<k>`` when it repeats)."""
        return f"{name}:{k}" if act.every is not None else name

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


# -- the catalogue ------------------------------------------------------------------------------------------

_CATALOGUE_PROBLEMS: dict[str, str] = {}
_LOADED = False


def fault_catalogue() -> tuple[dict[str, FaultSpec], dict[str, str]]:
    """The fault catalogue with every fault module imported, and the modules that failed to import.

    Faults register themselves when their module is imported: every family from the modules of
    :mod:`fleetward.chaos.faults`, and your own from the modules named in ``FLEETWARD_FAULT_MODULES``
    (comma-separated import names).
    A module that fails to import is reported (``chaos faults`` shows it) rather than hiding the others.
    """
    global _LOADED
    if not _LOADED:
        _LOADED = True
        try:
            pkg = importlib.import_module("fleetward.chaos.faults")
        except ModuleNotFoundError as exc:
            if exc.name not in ("fleetward.chaos.faults",):
                _CATALOGUE_PROBLEMS["fleetward.chaos.faults"] = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # a broken fault module must not hide the rest of the catalogue
            _CATALOGUE_PROBLEMS["fleetward.chaos.faults"] = f"{type(exc).__name__}: {exc}"
        else:
            for info in pkgutil.iter_modules(getattr(pkg, "__path__", []), prefix=pkg.__name__ + "."):
                try:
                    importlib.import_module(info.name)
                except Exception as exc:
                    _CATALOGUE_PROBLEMS[info.name] = f"{type(exc).__name__}: {exc}"
        for name in filter(None, (m.strip() for m in os.environ.get("FLEETWARD_FAULT_MODULES", "").split(","))):
            try:
                importlib.import_module(name)
            except Exception as exc:
                _CATALOGUE_PROBLEMS[name] = f"{type(exc).__name__}: {exc}"
        for name, problem in _CATALOGUE_PROBLEMS.items():
            log.warning("fault module %s could not be imported: %s", name, problem)
    return CATALOGUE, dict(_CATALOGUE_PROBLEMS)


# Names before the catalogue took one convention (``<family>.<snake_case>``): an old file gets the new name.
RENAMED: Mapping[str, str] = {
    "kill-worker": "process.kill_worker", "kill-engine": "process.kill_engine", "hang-worker": "process.hang",
    "crash-loop": "process.crash_loop", "slow-start": "process.slow_start", "oom-kill": "process.oom_kill",
    "net-latency": "network.latency", "net-bandwidth": "network.bandwidth", "net-slicer": "network.slicer",
    "net-reset": "network.reset", "net-blackhole": "network.blackhole", "net-limit-data": "network.limit_data",
    "net-slow-close": "network.slow_close", "net-partition": "network.partition", "net-down": "network.down",
    "net-partition-kernel": "network.partition_kernel", "sse-cut": "network.sse_cut",
    "sse-stall": "network.sse_stall", "sse-corrupt": "network.sse_corrupt", "sse-drop-done": "network.sse_drop_done",
    "etcd-member-kill": "control.etcd_member_kill", "etcd-member-pause": "control.etcd_member_pause",
    "etcd-member-restart": "control.etcd_member_restart", "etcd-leader-loss": "control.etcd_leader_loss",
    "lease-expiry": "control.lease_expiry", "broker-restart": "control.broker_restart",
    "router-restart": "control.router_restart", "supervisor-leader-kill": "control.supervisor_leader_kill",
    "kv-drop": "kv.drop", "kv-delay": "kv.delay", "kv-corrupt": "kv.corrupt", "kv-truncate": "kv.truncate",
    "kv-stall": "kv.stall", "kv-prefill-dies": "kv.prefill_dies",
}


def _unknown_fault(name: str, catalogue: Mapping[str, FaultSpec], problems: Mapping[str, str]) -> str:
    if name in RENAMED and RENAMED[name] in catalogue:
        return f"unknown fault {name!r}: it is called {RENAMED[name]} now (faults are named <family>.<name>)"
    near = difflib.get_close_matches(name, list(catalogue), n=1)
    hint = f" (did you mean {near[0]}?)" if near else ""
    listed = ", ".join(sorted(catalogue)) or "(empty)"
    broken = f"; could not load: {', '.join(sorted(problems))}" if problems else ""
    return f"unknown fault {name!r}{hint}; the catalogue has: {listed}{broken}"


# -- the fleet as declared ----------------------------------------------------------------------------------


def backends_for(spec: FaultSpec) -> list[str]:
    """The backends whose workers a fault works on."""
    return [name for name, cls in BACKENDS.items() if spec.works_on(cls.capabilities)]


def declared_ids(fleet: FleetSpec, kind: str) -> list[str] | None:
    """Ids of the components of ``kind`` the experiment declares; ``None`` when they are not enumerable
    here (GPUs: the gpu family targets the workers that own them)."""
    if kind == "worker":
        return [f"{fleet.node}-w{i}" for i in range(fleet.workers)]
    if kind == "router":
        return [f"router-{i}" for i in range(fleet.routers)]
    if kind == "etcd":
        return [f"etcd-{i}" for i in range(fleet.etcd_members)]
    if kind == "broker":
        return ["broker"]
    if kind == "supervisor":
        return [f"controller-{i}" for i in range(fleet.controllers)]
    if kind == "kv":  # KV links, named by the prefill worker that sends on them
        return [f"{fleet.node}-w{i}" for i in range(fleet.prefill_workers)]
    if kind == "fleet":
        return ["fleet"]
    if kind == "link":
        routers = declared_ids(fleet, "router") or []
        links = []
        if fleet.proxies.workers:
            links += [f"router->worker:{w}" for w in declared_ids(fleet, "worker") or []]
        if fleet.proxies.clients:
            links += [f"client->router:{r}" for r in routers]
        if fleet.proxies.control:
            links += ["agent->etcd", "agent->broker", *(f"{r}->{x}" for r in routers for x in ("etcd", "broker"))]
        elif fleet.etcd_members > 1:
            links += [f"{r}->etcd" for r in routers]  # a router reaches a multi-member cluster through one
        return links
    return None


def target_kinds(spec: FaultSpec) -> tuple[str, ...]:
    """The component kinds a fault may target (``extra["target_kinds"]``, or ``extra["target"]``)."""
    kinds = spec.extra.get("target_kinds") or ((spec.extra["target"],) if spec.extra.get("target") else ())
    return tuple(str(k) for k in kinds)


def _target_size(target: Target, declared: list[str] | None, candidates: list[str] | None = None) -> int:
    if target.ids:
        return len(match_ids(target.ids, declared)[0]) if declared is not None else len(target.ids)
    if target.pick == "all":
        pool = candidates if candidates is not None else declared
        return len(pool) if pool is not None else target.count
    return target.count


def default_target(spec: FaultSpec) -> Target | None:
    """The target of a fault that names none: the whole fleet (load), the fleet's KV hook (kv); else None."""
    kinds = set(target_kinds(spec))
    if kinds and kinds <= {"fleet"}:
        return Target(kind="fleet", pick="all")
    if kinds == {"kv"}:
        return Target(kind="kv", pick="all")
    return None


def counts_toward_share(spec: FaultSpec, target: Target) -> bool:
    """Whether faulting ``target`` takes a component out of service (load faults and ``fleet`` do not)."""
    return target.kind != "fleet" and bool(spec.extra.get("counts_toward_share", spec.family != "load"))


# -- trace files --------------------------------------------------------------------------------------------


def resolve_trace(name: str, *, base: Path | None) -> Path | None:
    """Find a trace file: as given, beside the experiment file, under ``$FLEETWARD_TRACES``, among the
    traces shipped with fleetward (``chaos/traces``), or in a ``shared/traces`` folder beside the repository."""
    p = Path(name).expanduser()
    candidates = [p] if p.is_absolute() else [Path.cwd() / p]
    if not p.is_absolute():
        if base is not None:
            candidates.insert(0, base / p)
        if os.environ.get("FLEETWARD_TRACES"):
            candidates.append(Path(os.environ["FLEETWARD_TRACES"]) / p)
        candidates.append(Path(__file__).resolve().parent / "traces" / p)
        root = Path(__file__).resolve().parents[1]
        candidates += [root.parent / "shared" / "traces" / p, root / "shared" / "traces" / p]
    return next((c for c in candidates if c.is_file()), None)


# -- validation ---------------------------------------------------------------------------------------------


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
            problems.append(_problem((*here, "fault"), _unknown_fault(act.fault, catalogue, broken), act.fault))
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


_REQUIREMENTS: Mapping[str, tuple[str, Any, str]] = {
    # what a fault's spec.extra["requires"] may name: (fleet field, test, what to write in the file)
    "gpus": ("gpus_per_worker", lambda v: v > 0, "fleet.gpus_per_worker: 1 (a fake GPU source for the node agent)"),
    "standby": ("controllers", lambda v: v >= 2, "fleet.controllers: 2 (a leader and a standby)"),
}


def _requirements(spec: FaultSpec, fleet: FleetSpec, here: Loc) -> list[InitErrorDetails]:
    out = []
    for need in spec.extra.get("requires", ()):
        field, holds, fix = _REQUIREMENTS[need]
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
