"""Experiment files: Chaos-Toolkit-shaped YAML plus a fleet, a workload, a timed fault schedule and checkers.

This module is the file's shape: the pydantic models below (``extra="forbid"``: a misspelt key is an error),
with the rules of one field beside it. What makes a whole experiment runnable (fault names and parameters,
targets against the declared fleet, the safety limit, ...) is checked by :mod:`fleetward.chaos.validation`,
which also reads the files (:func:`~fleetward.chaos.validation.load_experiment`); the fault catalogue as
experiments see it is :mod:`fleetward.chaos.catalogue`.

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
it is refused before anything runs, and again by the runner on the targets it resolves; the runner
also aborts the method when more of the fleet's capacity is out of service than its ``max_capacity_share``.
An experiment that declares none may break the whole fleet it declares (:data:`DEFAULT_RADIUS`), which is
the fleet the runner brought up for it; a fleet the runner did not start needs a declared one.
:func:`declared_ids` names the components of the fleet an experiment declares.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from fleetward.chaos.fault import Target
from fleetward.chaos.targets import match_ids
from fleetward.fleet.backends import Backend, BackendName, make_backend
from fleetward.fleet.config import (
    ID_PATTERN,
    AutoscaleConfig,
    Frozen,
    RouterConfig,
    SimConfig,
    SupervisorConfig,
    VllmConfig,
)

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
    "declared_ids",
    "radius_candidates",
    "radius_field",
    "resolve_trace",
]

TargetKind = Literal["worker", "router", "etcd", "broker", "link", "supervisor", "gpu", "kv", "fleet", "host"]

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

    backend: BackendName = "sim"
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
    hosts: int = Field(1, ge=1, le=8, description="> 1: that many hosts, each a network namespace of its own on one "
                       "bridge (root): an agent with `workers` simulated workers on each (ids h<i>-w<j>), a 3-member "
                       "etcd over the first three, the broker on h0, the controllers and routers spread over them, "
                       "the clients in a namespace of their own; the partition faults act between them")
    autoscale: AutoscaleConfig = Field(AutoscaleConfig(), description="a fleet of several hosts: with enabled, the "
                                       "autoscaler runs on the last host")
    proxies: ProxySpec = ProxySpec()
    model: str | None = Field(None, description="vllm: model folder (default: the tiny local model)")
    sim: SimConfig = SimConfig()
    vllm: VllmConfig = VllmConfig()
    routing: RouterConfig = RouterConfig()
    supervisor: SupervisorConfig = SupervisorConfig()

    @model_validator(mode="after")
    def _pools(self) -> FleetSpec:
        if self.hosts > 1:
            other = [f for f, v in (("backend", self.backend != "sim"), ("prefill_workers", self.prefill_workers),
                                    ("gpus_per_worker", self.gpus_per_worker),
                                    ("proxies", self.proxies != ProxySpec())) if v]
            if other:
                raise ValueError(f"a fleet of several hosts runs simulated aggregated workers, no fake GPUs and no "
                                 f"proxies (the partitions are real): unset {', '.join(other)}")
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
    nodes: Selector = Field((), description="hosts whose workers may be faulted, and which partition faults may "
                            "cut off (a fleet of several hosts: h0, h1, ...)")
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
DEFAULT_RADIUS = BlastRadius(workers=("*",), nodes=("*",), routers=("*",), links=("*",), etcd=("*",), broker=("*",),
                             supervisors=("*",), max_capacity_share=0.5)

_RADIUS_FIELDS: Mapping[str, str] = {"worker": "workers", "gpu": "workers", "kv": "workers", "router": "routers",
                                     "link": "links", "etcd": "etcd", "broker": "broker",
                                     "supervisor": "supervisors", "host": "nodes"}


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


# -- the fleet as declared ----------------------------------------------------------------------------------


def declared_ids(fleet: FleetSpec, kind: str) -> list[str] | None:
    """Ids of the components of ``kind`` the experiment declares; ``None`` when they are not enumerable
    here (GPUs: the gpu family targets the workers that own them)."""
    if kind == "host":
        return [f"h{i}" for i in range(fleet.hosts)] if fleet.hosts > 1 else []
    if fleet.hosts > 1 and kind == "worker":  # each host's agent names its workers
        return [f"h{h}-w{i}" for h in range(fleet.hosts) for i in range(fleet.workers)]
    if fleet.hosts > 1 and kind == "etcd":
        return [f"etcd-{i}" for i in range(3 if fleet.hosts >= 3 else 1)]
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
