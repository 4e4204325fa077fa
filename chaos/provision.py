"""The fleet an experiment runs on: brought up for the run, given by the caller, or attached to.

Each of :func:`own_fleet`, :func:`given_fleet` and :func:`attached_fleet` is an async context manager that
yields a :class:`Provisioned`: the :class:`~fleetward.fleet.handle.Fleet`, the ids the experiment declared
(what its faults may target: the safety rule), whether a supervisor decides health, and the harness's
fault context when the testbed started the fleet (proxies, etcd members, the fake GPUs).

- :func:`own_fleet`: a :class:`~fleetward.chaos.harness.TestFleet` as the experiment's ``fleet`` section
  says: its own etcd (1 or 3 members) and broker unless given, proxies, controllers, fake GPUs;
- :func:`given_fleet`: a running ``TestFleet`` (e.g. a test session's vLLM workers, which take a minute to
  start), used as it is; the routers it lacks are started for the run and stopped after it;
- :func:`attached_fleet`: the fleet ``fleetward up`` runs (``<run dir>/<cluster>/fleet.json``).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fleetward.chaos.attached import AttachedFleet
from fleetward.chaos.experiment import Experiment, declared_ids
from fleetward.chaos.harness import FleetContext, TestFleet
from fleetward.fleet.backends import Backend, VllmBackend
from fleetward.fleet.errors import ConfigError
from fleetward.fleet.handle import Fleet
from fleetward.fleet.state import read_admin_token, read_state, state_path

__all__ = ["Provisioned", "attached_fleet", "given_fleet", "own_fleet", "worker_backend"]

T = TypeVar("T")
Say = Callable[[str], None]
Guard = Callable[[Awaitable[T], str], Awaitable[T]]  # run unless the operator stops the run first


@dataclass
class Provisioned:
    fleet: Fleet
    declared: dict[str, list[str]]  # kind -> the ids the experiment may target
    supervised: bool | None  # None: not known (an attached fleet); the checkers infer it from the history
    context: FleetContext | None = None  # the harness's fault context (the testbed started the fleet)
    started_routers: list[Any] = field(default_factory=list)


def worker_backend(exp: Experiment, *, base: Path | None, run_dir: Path, say: Say) -> Backend:
    """The backend of the experiment's workers; the tiny local model is written first when vLLM serves it."""
    spec = exp.fleet
    model_path = None
    if spec.model:
        beside = base / spec.model if base is not None else None
        model_path = beside if beside is not None and beside.exists() else Path(spec.model)
    backend = spec.worker_backend(model_path=model_path, run_dir=run_dir)
    if isinstance(backend, VllmBackend) and model_path is None:
        from fleetward.sim.tinymodel import ensure_tiny_model

        ensure_tiny_model(backend.model_path, say=say)
    return backend


def _declared(fleet: TestFleet) -> dict[str, list[str]]:
    return {"worker": fleet.worker_ids, "router": [r.id for r in fleet.routers],
            "supervisor": fleet.supervisor_control().ids if fleet.supervised else [], "kv": ["kv"],
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
        routing=spec.routing, supervisor=spec.supervisor, node=spec.node, lease_ttl=spec.lease_ttl_s,
        # One controller runs in this process; more run as processes (a leader and standbys).
        controller=spec.controllers == 1, controller_processes=spec.controllers if spec.controllers > 1 else 0,
        gpu=gpu, gpus_per_worker=spec.gpus_per_worker,
        # The fleet owns what was not given: a private etcd (cluster) and broker, so faults may stop them.
        etcd_members=0 if etcd else spec.etcd_members, own_broker=not mqtt,
        proxy_workers=spec.proxies.workers, proxy_clients=spec.proxies.clients, proxy_control=spec.proxies.control)
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
        missing = [w for w in declared if w not in fleet.worker_ids]
        if missing:
            raise ConfigError(f"the attached fleet's workers are {', '.join(fleet.worker_ids) or 'none'}; the "
                              f"experiment declares {', '.join(declared)} (set fleet.node and fleet.workers to "
                              "match)", field="fleet.workers")
        if len(fleet.routers) < exp.fleet.routers:
            raise ConfigError(f"the attached fleet has {len(fleet.routers)} router(s); the experiment declares "
                              f"{exp.fleet.routers}", field="fleet.routers")
        ids = {"worker": declared, "router": [r.id for r in fleet.routers][:exp.fleet.routers], "kv": ["kv"],
               "fleet": ["fleet"]}
        say(f"attached to fleet {fleet.cluster} ({len(fleet.worker_ids)} workers)")
        yield Provisioned(fleet, ids, None)
    finally:
        await fleet.aclose()
