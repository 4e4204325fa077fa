"""One typed handle on a running fleet, whoever runs it.

:class:`Fleet` is what chaos faults, the experiment runner, the benchmarks and tests act through. Three
implementations:

- :class:`fleetward.chaos.harness.TestFleet`: a fleet a test or an experiment starts (a real node agent
  in its process, router and controller processes, optional proxies, a private etcd or broker);
- :class:`fleetward.cli.compose.LocalFleet`: the fleet ``fleetward up`` runs;
- :class:`fleetward.chaos.attached.AttachedFleet`: a fleet someone else runs, reached through its etcd,
  broker and state file. Its processes are not ours: the process levers raise :class:`NotOurs`.

Worker ids are the ``workers/<id>`` keys. ``url`` is what routers use (a proxy in front of the worker,
when there is one), ``bind_url`` the worker process itself. Both are known while the worker restarts.
Process levers act on the worker's whole process tree: :meth:`Fleet.kill` is ``SIGKILL`` of the tree (a
crash), :meth:`Fleet.signal_engine` signals the processes that run the model (vLLM's ``EngineCore``, the
sim's only process). :meth:`Fleet.restore` brings the fleet back to healthy after a test or an
experiment broke it, and says what it did.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, Self, runtime_checkable

import httpx
import psutil

from fleetward.fleet.backends import Backend, worker_ready
from fleetward.fleet.bus import EventBus
from fleetward.fleet.errors import FleetwardError
from fleetward.fleet.etcd import StateStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.registry import Leader, read_fleet, read_leader
from fleetward.fleet.worker import HealthState, WorkerSpec

__all__ = [
    "AgentWorkers",
    "Fleet",
    "FleetClient",
    "NotOurs",
    "RouterRef",
    "StartedInContext",
    "WorkerHost",
    "ensure_serving",
    "restore",
    "serves",
    "wait_ready",
]


class NotOurs(FleetwardError):
    """A process lever on a fleet whose processes someone else runs."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what} is not available on an attached fleet (its processes are not ours)")


@runtime_checkable
class RouterRef(Protocol):
    """A router of the fleet: its id, its URL, where clients connect, whether it runs."""

    @property
    def id(self) -> str: ...

    @property
    def url(self) -> str: ...

    @property
    def client_url(self) -> str: ...

    @property
    def is_running(self) -> bool: ...


@runtime_checkable
class Fleet(Protocol):
    """A running fleet: its state and events, its workers, routers and supervisor, and the levers to break
    and mend them (see the module docstring)."""

    @property
    def cluster(self) -> str: ...

    @property
    def keys(self) -> Keys: ...

    @property
    def store(self) -> StateStore:
        """A direct client of the fleet's etcd (never through a fault proxy)."""
        ...

    @property
    def bus(self) -> EventBus:
        """Publishes on the fleet's broker."""
        ...

    @property
    def backend(self) -> Backend: ...

    @property
    def log_dir(self) -> Path: ...

    @property
    def etcd_endpoints(self) -> list[str]: ...

    @property
    def mqtt_endpoint(self) -> str: ...

    # -- workers

    @property
    def worker_ids(self) -> list[str]: ...

    def spec(self, worker: str) -> WorkerSpec:
        """How the worker is started (id, model, node, GPUs, ports); ``KeyError`` for an unknown worker."""
        ...

    def url(self, worker: str) -> str: ...

    def bind_url(self, worker: str) -> str: ...

    def processes(self, worker: str) -> list[psutil.Process]:
        """The worker's process tree, root first; empty while it does not run."""
        ...

    def engine_processes(self, worker: str) -> list[psutil.Process]:
        """The processes that run the model (vLLM's EngineCore and its workers; the sim's one process)."""
        ...

    def kill(self, worker: str) -> None:
        """SIGKILL the worker's whole process tree (a crash)."""
        ...

    def signal_engine(self, worker: str, sig: int) -> None:
        """Send ``sig`` to the processes that run the model."""
        ...

    async def restart(self, worker: str) -> None:
        """Stop what is left of the worker and start it again; returns once it serves."""
        ...

    async def ensure_serving(self, worker: str, *, timeout: float = 60.0) -> None:
        """Bring the worker back unless it serves (a running supervisor gets a grace period to do it)."""
        ...

    async def fault(self, worker: str, **switches: Any) -> dict[str, Any]:
        """Set a worker's fault switches (``POST /admin/faults``; only where ``backend.fault_switches``)."""
        ...

    async def state(self, worker: str) -> dict[str, Any]:
        """A worker's ``GET /admin/state`` (only where ``backend.fault_switches``)."""
        ...

    async def worker_serving(self, worker: str, *, timeout: float = 10.0) -> bool:
        """Whether the worker process answers ``/health`` and a one-token completion (no proxy between)."""
        ...

    # -- routers

    @property
    def routers(self) -> Sequence[RouterRef]: ...

    async def start_router(self, router_id: str | None = None) -> RouterRef: ...

    async def stop_router(self, router: RouterRef) -> None: ...

    def kill_router(self, router: RouterRef) -> None: ...

    async def restart_router(self, router: RouterRef, *, timeout: float = 30.0) -> RouterRef: ...

    # -- the supervisor

    @property
    def supervised(self) -> bool:
        """Whether a supervisor controller runs, so workers' health is decided (and ready means canaried)."""
        ...

    async def leader(self) -> Leader | None: ...

    async def supervisor_command(self, worker: str, what: str,
                                 body: Mapping[str, Any] | None = None) -> httpx.Response:
        """``POST /v1/workers/<worker>/<what>`` on the leader's control API, as an operator would."""
        ...

    async def supervisor_post(self, path: str, body: Mapping[str, Any] | None = None) -> httpx.Response:
        """``POST <path>`` on the leader's control API (``/v1/moves``, ...), as an operator would."""
        ...

    # -- the whole

    async def fleet_status(self) -> dict[str, Any]:
        """What ``fleetward status --json`` prints."""
        ...

    async def wait_workers_routable(self, n: int, timeout: float = 30.0) -> None: ...

    async def restore(self, *, workers: Sequence[str] | None = None, timeout: float = 120.0) -> dict[str, Any]:
        """Back to healthy: GPUs cleared, quarantines lifted, fault switches off, dead workers and routers
        started again, every worker (of ``workers``, default all) routable (ready, when supervised) and
        warmed up. Returns what it did (``unquarantined``, ``cleared``, ``restarted``)."""
        ...


class StartedInContext:
    """``async with fleet:`` starts it and closes it on the way out; a start that fails half-way closes what
    it had started before the error goes on. The class provides :meth:`start` and :meth:`aclose`."""

    async def start(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


# -- what every implementation shares -------------------------------------------------------------------------


class FleetClient:
    """The part of a :class:`Fleet` that acts through the fleet's own interfaces: etcd, the supervisor's
    control API and the workers' admin endpoints. The test, local and attached fleets share it; a class
    using it provides ``store``, ``keys``, ``_http``, ``bind_url`` and :meth:`admin_bearer`."""

    store: StateStore
    keys: Keys
    _http: httpx.AsyncClient

    def admin_bearer(self) -> str:
        """The admin token (it protects the control API and the workers' admin endpoints)."""
        raise NotImplementedError

    def bind_url(self, worker: str) -> str:
        raise NotImplementedError

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_bearer()}"}

    async def fault(self, worker: str, **switches: Any) -> dict[str, Any]:
        """``POST /admin/faults`` on the worker itself (the simulated worker's fault switches)."""
        r = await self._http.post(f"{self.bind_url(worker)}/admin/faults", json=switches, headers=self._headers())
        r.raise_for_status()
        return dict(r.json())

    async def state(self, worker: str) -> dict[str, Any]:
        """``GET /admin/state`` of the worker itself (the simulated worker's engine state)."""
        r = await self._http.get(f"{self.bind_url(worker)}/admin/state", headers=self._headers())
        r.raise_for_status()
        return dict(r.json())

    async def leader(self) -> Leader | None:
        """The supervisor's leader as the election says, or None while nobody leads."""
        return await read_leader(self.store, self.keys)

    async def supervisor_command(self, worker: str, what: str,
                                 body: Mapping[str, Any] | None = None) -> httpx.Response:
        """``POST /v1/workers/<worker>/<what>`` on the leader's control API, as an operator would."""
        return await self.supervisor_post(f"/v1/workers/{worker}/{what}", body)

    async def supervisor_post(self, path: str, body: Mapping[str, Any] | None = None) -> httpx.Response:
        """``POST <path>`` on the leader's control API, as an operator would."""
        leader = await self.leader()
        if leader is None or not leader.url:
            raise RuntimeError(f"no supervisor leader with a control API for {path}")
        return await self._http.post(f"{leader.url}{path}", json=dict(body or {}), headers=self._headers())

    async def fleet_status(self) -> dict[str, Any]:
        return (await read_fleet(self.store, self.keys, leader=True, phases=True)).to_status()

    async def wait_workers_routable(self, n: int, timeout: float = 30.0) -> None:
        async with asyncio.timeout(timeout):
            while True:
                if len((await read_fleet(self.store, self.keys)).routable()) >= n:
                    return
                await asyncio.sleep(0.05)


class WorkerHost(Protocol):
    """What :class:`AgentWorkers` needs of the node agent that runs the fleet's workers in this process."""

    specs: dict[str, WorkerSpec]

    def processes(self, worker_id: str) -> list[psutil.Process]: ...

    def engine_processes(self, worker_id: str) -> list[psutil.Process]: ...

    def kill(self, worker_id: str) -> None: ...

    def signal_engine(self, worker_id: str, sig: int) -> None: ...

    async def restart(self, worker_id: str) -> object: ...

    def is_restarting(self, worker_id: str) -> bool: ...


class AgentWorkers:
    """The worker levers of a fleet whose node agent runs in this process (the test and local fleets)."""

    agent: WorkerHost

    @property
    def worker_ids(self) -> list[str]:
        """Every worker of the fleet, running or not."""
        return sorted(self.agent.specs)

    def spec(self, worker: str) -> WorkerSpec:
        spec = self.agent.specs.get(worker)
        if spec is None:
            raise KeyError(f"no worker {worker!r} in this fleet (workers: {', '.join(self.worker_ids)})")
        return spec

    def url(self, worker: str) -> str:
        """The registered (advertised) URL: what routers use. Known while the worker restarts, too."""
        return self.spec(worker).url

    def bind_url(self, worker: str) -> str:
        """The worker process itself, bypassing any proxy in front of it. Known while it restarts, too."""
        return self.spec(worker).bind_url

    def processes(self, worker: str) -> list[psutil.Process]:
        return self.agent.processes(worker)

    def engine_processes(self, worker: str) -> list[psutil.Process]:
        return self.agent.engine_processes(worker)

    def kill(self, worker: str) -> None:
        """SIGKILL the worker's whole process tree (a crash)."""
        self.agent.kill(worker)

    def signal_engine(self, worker: str, sig: int) -> None:
        self.agent.signal_engine(worker, sig)

    async def restart(self, worker: str) -> None:
        await self.agent.restart(worker)

    async def worker_serving(self, worker: str, *, timeout: float = 10.0) -> bool:
        """Whether the worker process answers ``/health`` and a one-token completion (bypassing proxies)."""
        if not self.agent.processes(worker):
            return False
        spec = self.spec(worker)
        return await serves(spec.bind_url, spec.model, timeout=timeout)


async def serves(url: str, model: str, *, timeout: float = 10.0) -> bool:
    """Whether the worker at ``url`` answers ``/health``, lists a model and completes one token."""
    try:
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            if not await worker_ready(url, client=client):
                return False
            r = await client.post(f"{url}/v1/completions", json={"model": model, "prompt": [40], "max_tokens": 1})
            return r.status_code == 200
    except (httpx.HTTPError, OSError):
        return False


async def ensure_serving(fleet: Fleet, worker: str, *, restarting: Callable[[str], bool], timeout: float = 60.0,
                         grace: float | None = None) -> bool:
    """Bring ``worker`` back unless it serves; True when this call restarted it.

    While a supervisor runs, it is given ``grace`` seconds (default 10) to do so first, and a restart
    under way (``restarting(worker)``) is waited for rather than raced.
    """
    grace = (10.0 if fleet.supervised else 0.0) if grace is None else grace
    loop = asyncio.get_running_loop()
    since = loop.time()
    restarted = False
    async with asyncio.timeout(timeout):
        while not await fleet.worker_serving(worker, timeout=5):
            if restarting(worker) or loop.time() - since < grace:
                await asyncio.sleep(0.1)
                continue
            await fleet.restart(worker)
            restarted = True
    return restarted


async def wait_ready(fleet: Fleet, workers: Sequence[str], *, timeout: float = 60.0) -> None:
    """Until every one of ``workers`` is registered and its health is ``ready`` (a supervisor decided)."""
    async with asyncio.timeout(timeout):
        while True:
            snap = await read_fleet(fleet.store, fleet.keys)
            if all(w in snap.workers and (h := snap.health.get(w)) is not None and h.state is HealthState.READY
                   for w in workers):
                return
            await asyncio.sleep(0.05)


async def restore(fleet: Fleet, *, workers: Sequence[str] | None = None, timeout: float = 120.0,
                  restarting: Callable[[str], bool] = lambda _w: False,
                  warm: dict[str, int] | None = None) -> dict[str, Any]:
    """:meth:`Fleet.restore` over the protocol (the implementations add what only they have, e.g. fakes).

    In order: stopped processes resumed (a hang left behind), quarantines lifted through the supervisor
    (it self-tests and restarts them), fault switches cleared, dead workers restarted
    (:func:`ensure_serving`), dead routers restarted, then every worker routable (ready, when supervised).
    ``warm`` maps workers to the pid last warmed up; a new process is warmed up (:meth:`Backend.warm_up`).
    Restarts a fleet cannot do (:class:`NotOurs`) are skipped: what it cannot mend, it waits for.
    """
    wanted = list(workers if workers is not None else fleet.worker_ids)
    done: dict[str, Any] = {"unquarantined": [], "cleared": [], "restarted": []}
    async with asyncio.timeout(timeout):
        for w in wanted:
            for p in fleet.processes(w):
                with contextlib.suppress(psutil.Error):
                    if p.status() == psutil.STATUS_STOPPED:
                        p.resume()
        if fleet.supervised:
            health = (await read_fleet(fleet.store, fleet.keys)).health
            for w in wanted:
                if (h := health.get(w)) is not None and h.state is HealthState.QUARANTINED:
                    (await fleet.supervisor_command(w, "quarantine/clear")).raise_for_status()
                    done["unquarantined"].append(w)
        if fleet.backend.fault_switches:
            for w in wanted:
                with contextlib.suppress(httpx.HTTPError, OSError, KeyError):
                    await fleet.fault(w, clear=True)
                    done["cleared"].append(w)
        for w in wanted:
            if w in done["unquarantined"]:
                continue  # the supervisor restarts it after the self-test
            with contextlib.suppress(NotOurs):
                if await ensure_serving(fleet, w, restarting=restarting, timeout=timeout):
                    done["restarted"].append(w)
        for r in list(fleet.routers):
            if not r.is_running:
                with contextlib.suppress(NotOurs):
                    await fleet.restart_router(r)
                    done["restarted"].append(r.id)
        if fleet.supervised:
            await wait_ready(fleet, wanted, timeout=timeout)
        else:
            await fleet.wait_workers_routable(len(wanted), timeout=timeout)
        if warm is not None:
            for w in wanted:
                tree = fleet.processes(w)
                if tree and warm.get(w) != tree[0].pid:
                    await fleet.backend.warm_up(fleet.url(w))
                    warm[w] = tree[0].pid
    return done
