"""The fleet an experiment runs on: brought up for the run, given by the caller, or attached to.

Each of :func:`own_fleet`, :func:`given_fleet` and :func:`attached_fleet` is an async context manager that
yields a :class:`Provisioned`: the :class:`~fleetward.fleet.handle.Fleet`, the ids the experiment declared
(what its faults may target: the safety rule), whether a supervisor decides health, and the harness's
fault context when the testbed started the fleet (proxies, etcd members, the fake GPUs).

- :func:`own_fleet`: a :class:`~fleetward.chaos.harness.TestFleet` as the experiment's ``fleet`` section
  says: its own etcd (1 or 3 members) and broker unless given, proxies, controllers, fake GPUs;
- :func:`given_fleet`: a running ``TestFleet`` (e.g. a test session's vLLM workers, which take a minute to
  start), used as it is; the routers it lacks are started for the run and stopped after it;
- :func:`attached_fleet`: the fleet ``fleetward up`` runs (``<run dir>/<cluster>/fleet.json``). The
  experiment's workers ``<fleet.node>-w<i>`` stand for the fleet's ``<its node>-w<i>`` when the fleet has no
  workers of the experiment's node (:func:`on_node`: the experiment is renamed, targets included). A
  simulated fleet is checked against the model its workers really run (:func:`attached_sim_config`), which
  is then the run's reference.

A fleet that is not the declared one (other workers, fewer routers, another backend, another simulated
model, no fleet at all) is a :class:`~fleetward.fleet.errors.ConfigError` before anything runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fleetward.chaos.attached import AttachedFleet
from fleetward.chaos.experiment import Experiment, declared_ids
from fleetward.chaos.harness import FleetContext, TestFleet
from fleetward.chaos.hostnet import HostNetwork
from fleetward.chaos.hosts import HostsFleet, HostsView
from fleetward.fleet.backends import Backend, SimBackend
from fleetward.fleet.config import SimConfig
from fleetward.fleet.errors import ConfigError
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.handle import Fleet
from fleetward.fleet.keys import Keys
from fleetward.fleet.registry import read_fleet
from fleetward.fleet.state import read_admin_token, read_state, state_path
from fleetward.sim.model import sim_model

__all__ = [
    "HostsContext",
    "Provisioned",
    "attached_fleet",
    "attached_sim_config",
    "given_fleet",
    "hosts_fleet",
    "on_node",
    "own_fleet",
    "worker_backend",
]

T = TypeVar("T")
Say = Callable[[str], None]
Guard = Callable[[Awaitable[T], str], Awaitable[T]]  # run unless the operator stops the run first


class HostsContext:
    """What faults reach on a fleet of several hosts: ``hosts`` (the :class:`HostsFleet`: its network, where each
    service runs), and the same fleet as ``etcd-cluster`` and ``broker`` (its etcd members and broker, on their
    hosts). Ids are the declared ones (:attr:`Provisioned.declared`)."""

    def __init__(self, fleet: HostsFleet) -> None:
        self._fleet = fleet

    def universe(self, kind: str) -> list[str]:
        return []

    def service(self, name: str) -> Any:
        if name in ("hosts", "etcd-cluster", "broker"):
            return self._fleet
        raise KeyError(f"no service {name!r} in this context")


@dataclass
class Provisioned:
    fleet: Fleet
    declared: dict[str, list[str]]  # kind -> the ids the experiment may target
    supervised: bool | None  # None: not known (an attached fleet); the checkers infer it from the history
    context: FleetContext | HostsContext | None = None  # the fault context of a fleet the testbed started
    started_routers: list[Any] = field(default_factory=list)
    experiment: Experiment | None = None  # the experiment as it applies to this fleet, when renamed for it


def worker_backend(exp: Experiment, *, base: Path | None, run_dir: Path, say: Say) -> Backend:
    """The backend of the experiment's workers; the tiny local model is written first when vLLM serves it."""
    spec = exp.fleet
    model_path = None
    if spec.model:
        beside = base / spec.model if base is not None else None
        model_path = beside if beside is not None and beside.exists() else Path(spec.model)
    backend = spec.worker_backend(model_path=model_path, run_dir=run_dir)
    if (tiny := backend.tiny_model()) is not None:
        from fleetward.sim.tinymodel import ensure_tiny_model

        ensure_tiny_model(tiny.path, tokenizer=tiny.tokenizer, say=say)
    return backend


def _declared(fleet: TestFleet) -> dict[str, list[str]]:
    return {"worker": fleet.worker_ids, "router": [r.id for r in fleet.routers],
            "supervisor": fleet.supervisor_control().ids if fleet.supervised else [],
            "kv": sorted(w for w, h in fleet.agent.handles.items() if h.spec.role == "prefill"),
            "fleet": ["fleet"]}


@contextlib.asynccontextmanager
async def own_fleet(exp: Experiment, *, run_dir: Path, backend: Backend, etcd: str | None, mqtt: str | None,
                    say: Say, guard: Guard[Any], history: Any, services: Mapping[str, Any]
                    ) -> AsyncIterator[Provisioned]:
    spec = exp.fleet
    gpu = None
    if spec.gpus_per_worker:
        from fleetward.chaos.fakegpu import FakeGpuSource

        gpu = FakeGpuSource(spec.workers * spec.gpus_per_worker)
    fleet = TestFleet(
        etcd=etcd or "", mqtt=mqtt or "", run_dir=run_dir / "fleet",
        cluster=spec.cluster or f"chaos-{uuid.uuid4().hex[:6]}", workers=spec.workers, backend=backend,
        prefill_workers=spec.prefill_workers,
        routing=spec.routing, supervisor=spec.supervisor, node=spec.node, lease_ttl=spec.lease_ttl_s,
        # One controller runs in this process; more run as processes (a leader and standbys).
        controller=spec.controllers == 1, controller_processes=spec.controllers if spec.controllers > 1 else 0,
        gpu=gpu, gpus_per_worker=spec.gpus_per_worker,
        # The fleet owns what was not given: a private etcd (cluster) and broker, so faults may stop them.
        etcd_members=0 if etcd else spec.etcd_members, own_broker=not mqtt,
        proxy_workers=spec.proxies.workers, proxy_clients=spec.proxies.clients, proxy_control=spec.proxies.control)
    if etcd and spec.cluster:
        await _refuse_a_live_cluster(etcd, spec.cluster)
    say(f"starting {spec.workers} {backend.name} worker(s) and {spec.routers} router(s)")
    async with contextlib.AsyncExitStack() as stack:
        await guard(stack.enter_async_context(fleet), "starting the fleet")
        for i in range(spec.routers):
            await guard(fleet.start_router(f"router-{i}"), "starting the routers")
        await guard(fleet.wait_workers_routable(spec.workers, timeout=max(60.0, spec.vllm.start_timeout_s)),
                    "waiting for the workers")
        yield Provisioned(fleet, _declared(fleet), True,
                          fleet.fault_context(history=history, seed=exp.seed, services=dict(services)))


@contextlib.asynccontextmanager
async def hosts_fleet(exp: Experiment, *, net: HostNetwork, run_dir: Path, backend: Backend, say: Say,
                      guard: Guard[Any], history: Any) -> AsyncIterator[Provisioned]:
    """A fleet over ``net``'s hosts (:class:`HostsFleet`), acted on as an attached fleet through its etcd, broker
    and admin token; its ``hosts`` record (which host runs what) opens the history."""
    spec = exp.fleet
    hosts = HostsFleet(net, cluster=spec.cluster or f"chaos-{uuid.uuid4().hex[:6]}", run_dir=run_dir / "fleet",
                       backend=backend, workers_per_host=spec.workers, routers=spec.routers,
                       controllers=spec.controllers, autoscale=spec.autoscale, routing=spec.routing,
                       supervisor=spec.supervisor, lease_ttl_s=spec.lease_ttl_s, say=say)
    declared = {kind: declared_ids(spec, kind) or [] for kind in ("worker", "router", "host", "etcd")}
    async with contextlib.AsyncExitStack() as stack:
        await guard(stack.enter_async_context(hosts), "starting the hosts")
        fleet = HostsView(hosts.state(), hosts.admin_token, backend, log_dir=hosts.log_dir)
        stack.push_async_callback(fleet.aclose)
        await guard(fleet.wait_workers_routable(len(declared["worker"]), timeout=120), "waiting for the workers")
        await fleet.start()
        history.add("hosts", hosts={h.name: h.address for h in net.nodes}, placement=dict(hosts.placement))
        say(f"{len(net.hosts)} hosts up: " + "; ".join(
            f"{h}: {', '.join(s for s, where in hosts.placement.items() if where == h)}" for h in hosts.hosts))
        declared.update(broker=["broker"], supervisor=[s for s in hosts.services if s.startswith("controller-")],
                        fleet=["fleet"], kv=[])
        yield Provisioned(fleet, declared, True, HostsContext(hosts))


async def _refuse_a_live_cluster(etcd: str, cluster: str) -> None:
    """A :class:`ConfigError` when ``cluster`` on ``etcd`` already has workers or routers: a fleet this run did
    not start, which its own workers, supervisor and faults must not join."""
    async with EtcdStore(etcd, attempts=3, retry_budget_s=5.0) as store:
        found = await read_fleet(store, Keys(cluster))
    if found.workers or found.routers:
        workers = ", ".join(sorted(found.workers)) or "none"
        routers = ", ".join(sorted(found.routers)) or "none"
        raise ConfigError(f"cluster {cluster} on etcd {etcd} already runs workers ({workers}) and routers ({routers}) "
                          "this run did not start: to run against that fleet, attach to it (--attach --live-fleet, "
                          "with a declared blast_radius and its admin token); to bring up a fleet of the run's own, "
                          "leave fleet.cluster unset", field="fleet.cluster")


@contextlib.asynccontextmanager
async def given_fleet(exp: Experiment, fleet: TestFleet, *, say: Say, history: Any,
                      services: Mapping[str, Any]) -> AsyncIterator[Provisioned]:
    """A running harness fleet: check it is the declared one, add the routers it lacks for this run."""
    spec = exp.fleet
    declared = declared_ids(spec, "worker") or []
    missing = [w for w in declared if w not in fleet.worker_ids]
    if missing or fleet.backend.name != spec.backend:
        raise ConfigError(f"the given fleet has {fleet.backend.name} workers {', '.join(fleet.worker_ids) or 'none'}; "
                          f"the experiment declares {spec.backend} workers {', '.join(declared)} (set "
                          "fleet.backend, fleet.node and fleet.workers to match)", field="fleet.workers")
    started = []
    try:
        for i in range(len(fleet.routers), spec.routers):
            started.append(await fleet.start_router(f"router-{i}"))
        await fleet.wait_workers_routable(spec.workers, timeout=max(60.0, spec.vllm.start_timeout_s))
        say(f"using the given fleet {fleet.cluster} ({len(fleet.worker_ids)} workers)")
        ids = _declared(fleet)
        ids["worker"] = declared
        ids["router"] = [r.id for r in fleet.routers][:spec.routers]
        yield Provisioned(fleet, ids, fleet.supervised,
                          fleet.fault_context(history=history, seed=exp.seed, services=dict(services)))
    finally:
        for r in started:
            await fleet.stop_router(r)


@contextlib.asynccontextmanager
async def attached_fleet(exp: Experiment, *, run_dir: Path, cluster: str | None, backend: Backend,
                         say: Say) -> AsyncIterator[Provisioned]:
    """The fleet ``fleetward up`` runs under ``run_dir``; its workers must be the declared ones."""
    name = cluster or exp.fleet.cluster or "local"
    path = state_path(run_dir, name)
    state = read_state(path, hint=" (or run without --attach)", field="attach")
    fleet = AttachedFleet(state, read_admin_token(state, path), backend)
    try:
        await fleet.start()
        declared = declared_ids(exp.fleet, "worker") or []
        node = str(state.get("node") or exp.fleet.node)
        if node != exp.fleet.node and not set(declared) & set(fleet.worker_ids):
            say(f"the experiment's workers {exp.fleet.node}-w<i> are this fleet's {node}-w<i>")
            exp = on_node(exp, node)
            declared = declared_ids(exp.fleet, "worker") or []
        missing = [w for w in declared if w not in fleet.worker_ids]
        if missing:
            raise ConfigError(f"the attached fleet's workers are {', '.join(fleet.worker_ids) or 'none'}; the "
                              f"experiment declares {', '.join(declared)} (set fleet.workers to match; worker ids "
                              "are <node>-w<i>)", field="fleet.workers")
        if len(fleet.routers) < exp.fleet.routers:
            raise ConfigError(f"the attached fleet has {len(fleet.routers)} router(s); the experiment declares "
                              f"{exp.fleet.routers}", field="fleet.routers")
        kinds = sorted({fleet.records[w].backend for w in declared if w in fleet.records} - {exp.fleet.backend})
        if kinds:
            raise ConfigError(f"the attached fleet's workers are {'/'.join(kinds)} workers; the experiment declares "
                              f"{exp.fleet.backend} workers", field="fleet.backend")
        if "model_reference" in backend.capabilities:  # the reference is the workers' model: read and confirm it
            fleet.backend = SimBackend(await attached_sim_config(fleet, declared, exp.fleet.sim, say=say))
        refused = await fleet.refuses_admin_token(declared) if exp.method else None
        if refused is not None:
            raise ConfigError(f"{refused}: it is not this fleet's (FLEETWARD_ADMIN_TOKEN, or the admin-token file "
                              "beside its fleet.json); nothing was injected", field="FLEETWARD_ADMIN_TOKEN")
        ids = {"worker": declared, "router": [r.id for r in fleet.routers][:exp.fleet.routers],
               "kv": sorted(w for w in declared if w in fleet.records and fleet.records[w].role == "prefill"),
               "fleet": ["fleet"]}
        say(f"attached to fleet {fleet.cluster} ({len(fleet.worker_ids)} workers)")
        yield Provisioned(fleet, ids, None, experiment=exp)
    finally:
        await fleet.aclose()


def on_node(exp: Experiment, node: str) -> Experiment:
    """``exp`` with its workers ``<fleet.node>-w<i>`` named ``<node>-w<i>``, in its fleet, in every target
    (``node-w1`` and ``router->worker:node-w1`` alike) and in its blast radius (globs such as ``node-w*`` too,
    and the node itself under ``nodes``)."""
    own = re.compile(rf"(^|:){re.escape(exp.fleet.node)}(-w\d+)$")
    loose = re.compile(rf"(^|:){re.escape(exp.fleet.node)}(-w)")

    def rename(i: str) -> str:
        return own.sub(lambda m: f"{m[1]}{node}{m[2]}", i)

    def rename_selector(i: str) -> str:
        return loose.sub(lambda m: f"{m[1]}{node}{m[2]}", i)

    method = tuple(a if a.target is None else a.model_copy(update={"target": a.target.model_copy(
        update={"ids": tuple(map(rename, a.target.ids))})}) for a in exp.method)
    update: dict[str, Any] = {"fleet": exp.fleet.model_copy(update={"node": node}), "method": method}
    if exp.blast_radius is not None:
        r = exp.blast_radius
        update["blast_radius"] = r.model_copy(update={
            "workers": tuple(map(rename_selector, r.workers)), "links": tuple(map(rename_selector, r.links)),
            "nodes": tuple(node if n == exp.fleet.node else n for n in r.nodes)})
    return exp.model_copy(update=update)


# What a simulated worker is asked to confirm its model: a few prompts, greedy, EOS allowed.
_PROBES = tuple([40 + k, 41, 42, 43, 44 + k] for k in range(4))
_PROBE_TOKENS = 48
_SIM_ARGV = argparse.ArgumentParser(add_help=False)
_SIM_ARGV.add_argument("--config-json")
_SIM_ARGV.add_argument("--model-name")


def _sim_config_of(argv: Sequence[str]) -> SimConfig | None:
    """The config of a simulated worker started as :meth:`~fleetward.fleet.backends.SimBackend.argv` starts
    one; ``None`` for any other command line."""
    if "fleetward.sim.server" not in argv:
        return None
    args, _ = _SIM_ARGV.parse_known_args(list(argv[list(argv).index("fleetward.sim.server") + 1:]))
    try:
        config = SimConfig.model_validate_json(args.config_json) if args.config_json else SimConfig()
    except ValueError:
        return None
    return config.model_copy(update={"model_name": args.model_name}) if args.model_name else config


def _model(c: SimConfig) -> str:
    return f"seed {c.seed}, eos_probability {c.eos_probability:g}, tokenizer {c.tokenizer}"


async def attached_sim_config(fleet: AttachedFleet, workers: Sequence[str], declared: SimConfig, *,
                              say: Say) -> SimConfig:
    """The config of the attached fleet's simulated workers, whose model is the run's reference.

    Read from the workers' command lines where they run here, else the experiment's ``fleet.sim``; either
    way every worker that answers a greedy probe must answer what that model generates. A
    :class:`ConfigError` (``fleet.sim``) when the workers disagree, when one answers otherwise, or when
    the model could neither be read nor confirmed: no reference at all rather than a wrong one.
    """
    read = {w: c for w in workers if (c := _sim_config_of(fleet.command_line(w) or ())) is not None}
    if len({(c.seed, c.eos_probability, c.tokenizer) for c in read.values()}) > 1:
        raise ConfigError("the attached fleet's simulated workers run different models ("
                          + "; ".join(f"{w}: {_model(c)}" for w, c in read.items())
                          + "): no one reference fits them", field="fleet.sim")
    config, source = next(((c, "read from the workers' command lines") for c in read.values()),
                          (declared, "the experiment's fleet.sim"))
    model = sim_model(config)
    async with asyncio.TaskGroup() as tg:  # at once: a worker batches them, as it would a workload
        probes = [(w, prompt, tg.create_task(fleet.complete(w, prompt, _PROBE_TOKENS)))
                  for w in workers for prompt in _PROBES]
    answered = [(w, prompt, got) for w, prompt, task in probes if (got := task.result()) is not None]
    for w, prompt, got in answered:  # a worker that does not answer: the steady-state hypothesis will say so
        want = model.continuation(prompt, _PROBE_TOKENS)
        if got != want:
            raise ConfigError(f"worker {w} does not generate what the simulated model with {_model(config)} "
                              f"({source}) does: a greedy probe of {prompt} gave {got[:8]}... where that model "
                              f"gives {want[:8]}...; set fleet.sim.seed, eos_probability and tokenizer to "
                              "the fleet's, or clear the worker's fault switches", field="fleet.sim")
    if not read and not answered:
        raise ConfigError("cannot tell which model the attached fleet's simulated workers run: their command lines "
                          "are not readable here and none answered a probe", field="fleet.sim")
    if (config.seed, config.eos_probability) != (declared.seed, declared.eos_probability):
        say(f"the reference is the fleet's simulated model ({_model(config)}), not the experiment's fleet.sim "
            f"({_model(declared)})")
    return config
