"""A fleet for tests and experiments: real workers, real routers, real etcd and broker, all disposable.

:class:`TestFleet` attaches to an existing etcd and MQTT broker (the pytest fixtures start one of each per
session) and starts, under its own cluster name, a node agent with N workers and any number of router
processes. It offers the levers tests and faults need: kill a worker or a router (``SIGKILL`` of the
real process tree), set a simulated worker's fault switches, restart what was killed, kill the supervisor's
leader, reach the leader's control API. Leaving it stops everything it started.

The supervisor runs as one controller in this process (``controller=True``, the default), or as
``controller_processes`` real ``fleetward supervisor --role controller`` processes that campaign for the
lead (one leads, the others stand by: what ``control.supervisor_leader_kill`` needs).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fnmatch
import os
import random
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from fleetward.chaos.faults.kv import FaultyKvTransfer
from fleetward.chaos.proxy import Link, ProxyRegistry
from fleetward.fleet.backends import WorkerBackend, WorkerHandle, make_backend, worker_ready
from fleetward.fleet.bus import MqttBus
from fleetward.fleet.config import RouterConfig, SimConfig, SupervisorConfig, VllmConfig
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.infra import LocalBroker, LocalEtcd
from fleetward.fleet.keys import Keys
from fleetward.fleet.procs import ManagedProcess, free_port
from fleetward.fleet.registry import read_fleet
from fleetward.fleet.worker import WorkerSpec
from fleetward.supervisor.agent import NodeAgent

__all__ = ["ControllerProcess", "FleetContext", "HarnessSupervisor", "RouterProcess", "TestFleet"]


@dataclass
class RouterProcess:
    id: str
    url: str
    process: ManagedProcess
    client_url: str = ""  # where clients connect: a ``client->router:<id>`` proxy, or ``url``

    def __post_init__(self) -> None:
        self.client_url = self.client_url or self.url

    @property
    def is_running(self) -> bool:
        return self.process.is_running


@dataclass
class ControllerProcess:
    """A supervisor controller running as its own process (``fleetward supervisor --role controller``)."""

    id: str
    url: str  # its control API
    process: ManagedProcess

    @property
    def is_running(self) -> bool:
        return self.process.is_running


@dataclass
class TestFleet:
    """Workers (through a real node agent) and routers (real processes) under one cluster."""

    __test__ = False  # not a pytest test class

    etcd: str
    mqtt: str
    cluster: str
    run_dir: Path
    workers: int = 3
    backend: str = "sim"
    sim: SimConfig = field(default_factory=SimConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    model_path: Path | None = None
    routing: RouterConfig = field(default_factory=RouterConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    gpu: Any = None  # a GpuHealthSource for the node agent (e.g. supervisor.gpu.FakeGpuSource)
    gpus_per_worker: int = 0  # worker i owns GPUs [i*k, (i+1)*k) of that source
    controller: bool = True  # run a supervisor controller in this process (health becomes ready after canaries)
    controller_processes: int = 0  # > 0: run this many controllers as processes instead (a leader and standbys)
    admin_token: str = "test-admin-token"
    node: str = "node"
    lease_ttl: int = 10
    # Chaos wiring (see "chaos levers" below). Links are named ``<from>-><to>`` in ``self.proxies``.
    proxy_workers: bool = False  # a proxy in front of each worker (``router->worker:<id>``); workers advertise it
    proxy_clients: bool = False  # a proxy in front of each router (``client->router:<id>``): RouterProcess.client_url
    proxy_control: bool = False  # the agent and each router reach etcd and the broker through their own proxies
    etcd_members: int = 0  # > 0: start a private etcd cluster of this many members (``etcd`` is then ignored)
    own_broker: bool = False  # start a private broker (``mqtt`` is then ignored): needed to restart it
    store: EtcdStore = field(init=False)
    bus: MqttBus = field(init=False)
    agent: NodeAgent = field(init=False)
    backend_impl: WorkerBackend = field(init=False)
    routers: list[RouterProcess] = field(default_factory=list)
    controllers: list[tuple[Any, asyncio.Task[None]]] = field(default_factory=list)
    controller_procs: list[ControllerProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.keys = Keys(self.cluster)
        self.log_dir = self.run_dir / "logs"
        self._http = httpx.AsyncClient(timeout=10.0)
        self.proxies = ProxyRegistry()
        self.etcd_cluster: list[LocalEtcd] = []
        self.broker_impl: LocalBroker | None = None
        self._launch_prefix: dict[str, list[str]] = {}
        self._own_clients: list[Any] = []  # the agent's store and bus when they go through proxies
        # The fleet's KV-transfer hook (kv faults act on it). No prefill/decode path calls it yet.
        self.kv = FaultyKvTransfer()

    # -- life -------------------------------------------------------------------------------------------

    async def __aenter__(self) -> TestFleet:
        try:
            await self.start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        await self._start_infra()
        self.store = EtcdStore(self.etcd_endpoints)
        self.bus = await MqttBus(self.mqtt, self.cluster).start()
        self.backend_impl = make_backend(self.backend, sim=self.sim, vllm=self.vllm, model_path=self.model_path)
        agent_store, agent_bus = await self._agent_clients()
        self.agent = NodeAgent(store=agent_store, bus=agent_bus, keys=self.keys,
                               backend=_HarnessBackend(self, self.backend_impl),  # type: ignore[arg-type]
                               node=self.node, log_dir=self.log_dir, lease_ttl=self.lease_ttl,
                               worker_env={"FLEETWARD_ADMIN_TOKEN": self.admin_token}, supervisor=self.supervisor,
                               gpu=self.gpu)
        await self.agent.start()
        if self.controller_processes:
            for _ in range(self.controller_processes):
                await self.start_controller_process()
            await self.wait_leader()
        elif self.controller:
            await self.start_controller()
        model = self.sim.model_name if self.backend == "sim" else "tiny"
        k = self.gpus_per_worker
        specs = [WorkerSpec(id=f"{self.node}-w{i}", host="127.0.0.1", port=free_port(), model=model, node=self.node,
                            gpus=tuple(range(i * k, (i + 1) * k)))
                 for i in range(self.workers)]
        specs = [await self._proxied_spec(s) for s in specs]
        await self.agent.start_workers(specs)
        if self.supervised:
            await self.wait_workers_routable(len(self.agent.handles))

    async def start_controller(self, *, wait: bool = True, controller_id: str | None = None) -> Any:
        """A supervisor controller in this process; it campaigns, and ``wait`` waits until it leads."""
        from fleetward.supervisor.controller import Controller

        cid = controller_id or f"controller-{len(self.controllers) + len(self.controller_procs)}"
        ctl = Controller(self.supervisor, store=self.store, bus=self.bus, keys=self.keys, controller_id=cid,
                         admin_token=self.admin_token)
        task = asyncio.create_task(ctl.run(), name=ctl.id)
        self.controllers.append((ctl, task))
        if wait:
            async with asyncio.timeout(30):
                await ctl.leading.wait()
        return ctl

    async def stop_controllers(self) -> None:
        for _, task in self.controllers:
            task.cancel()
        for _, task in self.controllers:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.controllers.clear()
        for c in self.controller_procs:
            await c.process.stop(grace=5)
        self.controller_procs.clear()

    @property
    def supervised(self) -> bool:
        """Whether a supervisor controller runs (in this process or as processes), so health is decided."""
        return bool(self.controllers or self.controller_procs)

    async def start_controller_process(self, controller_id: str | None = None) -> ControllerProcess:
        """A controller as its own process (same settings, its own control API port); it campaigns."""
        cid = controller_id or f"controller-{len(self.controllers) + len(self.controller_procs)}"
        port = free_port()
        conf = self.run_dir / f"{cid}.yaml"
        supervisor = self.supervisor.model_copy(update={"port": port})
        conf.write_text(yaml.safe_dump({"cluster": self.cluster, "supervisor": supervisor.model_dump(mode="json")}))
        argv = [sys.executable, "-m", "fleetward.fleet.cli", "supervisor", "--role", "controller", "--config",
                str(conf), "--etcd", self.etcd_endpoints[0], "--mqtt", self.mqtt, "--cluster", self.cluster,
                "--id", cid]
        proc = ManagedProcess(cid, argv, log_path=self.log_dir / f"{cid}.log",
                              env={"PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1",
                                   "FLEETWARD_ADMIN_TOKEN": self.admin_token,
                                   "FLEETWARD_LOG_LEVEL": os.environ.get("FLEETWARD_LOG_LEVEL", "INFO")}).start()
        ctl = ControllerProcess(cid, f"http://{supervisor.host}:{port}", proc)
        await self._controller_ready(ctl)
        self.controller_procs.append(ctl)
        return ctl

    async def _controller_ready(self, ctl: ControllerProcess) -> None:
        async def healthy() -> bool:
            return (await self._http.get(f"{ctl.url}/health")).status_code == 200

        await ctl.process.wait_ready(healthy, timeout=30, interval=0.05)

    async def leader(self) -> dict[str, Any] | None:
        """The supervisor's leader as the election says (``{"id", "url"}``), or None while nobody leads."""
        snap = await self.store.get_prefix(self.keys.leader("supervisor"))
        if not snap.items:
            return None
        first = min(snap.items, key=lambda kv: kv.create_revision)
        return dict(orjson.loads(orjson.loads(first.value)["candidate"]))

    async def wait_leader(self, timeout: float = 30.0) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            while True:
                leader = await self.leader()
                if leader is not None:
                    return leader
                await asyncio.sleep(0.05)

    async def supervisor_command(self, worker: str, what: str, body: dict[str, Any] | None = None) -> httpx.Response:
        """``POST /v1/workers/<worker>/<what>`` on the leader's control API (``drain``, ``undrain``,
        ``restart``, ``quarantine/clear``), as an operator would; an in-process leader is called in process."""
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        path = f"/v1/workers/{worker}/{what}"
        for ctl, _ in self.controllers:
            if ctl.leading.is_set():
                transport = httpx.ASGITransport(app=ctl.app())
                async with httpx.AsyncClient(transport=transport, base_url="http://controller") as client:
                    return await client.post(path, json=body or {}, headers=headers)
        leader = await self.leader()
        if leader is None or not leader.get("url"):
            raise RuntimeError(f"no supervisor leader with a control API to {what} {worker}")
        return await self._http.post(f"{leader['url']}{path}", json=body or {}, headers=headers)

    def supervisor_control(self) -> HarnessSupervisor:
        """The ``supervisor`` service of :class:`~fleetward.chaos.faults.control.SupervisorControl`."""
        return HarnessSupervisor(self)

    async def aclose(self) -> None:
        await self.stop_controllers()
        for r in self.routers:
            await r.process.stop(grace=5)
        self.routers.clear()
        if hasattr(self, "agent"):
            await self.agent.aclose(grace=5)
        if hasattr(self, "bus"):
            await self.bus.aclose()
        if hasattr(self, "store"):
            with contextlib.suppress(Exception):
                await self.store.delete(self.keys.root, prefix=True)
            await self.store.aclose()
        await self._stop_infra()
        await self._http.aclose()

    # -- workers ----------------------------------------------------------------------------------------

    @property
    def worker_ids(self) -> list[str]:
        return sorted(self.agent.handles)

    def handle(self, worker: str) -> WorkerHandle:
        return self.agent.handles[worker]

    def url(self, worker: str) -> str:
        """The registered (advertised) URL: what routers use. Known while the worker restarts, too."""
        return self._spec(worker).url

    def bind_url(self, worker: str) -> str:
        """The worker process itself, bypassing any proxy in front of it. Known while it restarts, too (the
        agent holds no handle for a worker between its old process and its new one)."""
        return self._spec(worker).bind_url

    def _spec(self, worker: str) -> WorkerSpec:
        spec = self.agent.specs.get(worker)
        if spec is None:
            raise KeyError(f"no worker {worker!r} in this fleet (workers: {', '.join(self.worker_ids)})")
        return spec

    async def fault(self, worker: str, **switches: Any) -> dict[str, Any]:
        """Set a simulated worker's fault switches (``POST /admin/faults``)."""
        r = await self._http.post(f"{self.bind_url(worker)}/admin/faults", json=switches,
                                  headers={"Authorization": f"Bearer {self.admin_token}"})
        r.raise_for_status()
        return dict(r.json())

    async def state(self, worker: str) -> dict[str, Any]:
        r = await self._http.get(f"{self.bind_url(worker)}/admin/state",
                                 headers={"Authorization": f"Bearer {self.admin_token}"})
        r.raise_for_status()
        return dict(r.json())

    def kill(self, worker: str) -> None:
        """SIGKILL the worker's whole process tree (a crash)."""
        self.handle(worker).process.kill()

    def signal_engine(self, worker: str, sig: int) -> None:
        for p in self.handle(worker).engine_processes():
            with contextlib.suppress(Exception):
                p.send_signal(sig)

    async def restart(self, worker: str) -> None:
        await self.agent.restart(worker)

    async def fleet_status(self) -> dict[str, Any]:
        return (await read_fleet(self.store, self.keys)).to_status()

    # -- routers ----------------------------------------------------------------------------------------

    async def start_router(self, router_id: str | None = None, **overrides: Any) -> RouterProcess:
        """Start a router process (``fleetward router``) and wait until it serves."""
        rid = router_id or f"router-{len(self.routers)}"
        port = free_port()
        conf = self.run_dir / f"{rid}.yaml"
        routing = self.routing.model_copy(update=overrides)
        conf.write_text(yaml.safe_dump({"cluster": self.cluster, "routing": routing.model_dump(mode="json")}))
        etcd, mqtt = await self._router_endpoints(rid)
        argv = [sys.executable, "-m", "fleetward.fleet.cli", "router", "--config", str(conf), "--etcd", etcd,
                "--mqtt", mqtt, "--cluster", self.cluster, "--port", str(port), "--id", rid]
        proc = ManagedProcess(rid, argv, log_path=self.log_dir / f"{rid}.log",
                              env={"PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1",
                                   "FLEETWARD_LOG_LEVEL": os.environ.get("FLEETWARD_LOG_LEVEL", "INFO")}).start()
        client_url = ""
        if self.proxy_clients:
            name = f"client->router:{rid}"
            link = self.proxies.get(name) if name in self.proxies else await self.proxies.add(
                name, ("127.0.0.1", port), http=True)
            link.probe = "http"
            client_url = link.proxies[0].url
        router = RouterProcess(rid, f"http://127.0.0.1:{port}", proc, client_url)

        async def healthy() -> bool:
            return (await self._http.get(f"{router.url}/health")).status_code == 200

        await proc.wait_ready(healthy, timeout=30, interval=0.05)
        self.routers.append(router)
        return router

    def kill_router(self, router: RouterProcess) -> None:
        router.process.signal(signal.SIGKILL)

    async def stop_router(self, router: RouterProcess) -> None:
        await router.process.stop(grace=10)
        with contextlib.suppress(ValueError):
            self.routers.remove(router)

    async def wait_healthy(self, timeout: float = 60.0) -> None:
        """Until every worker of this fleet runs, is registered and is ready (after supervisor restarts)."""
        async with asyncio.timeout(timeout):
            while True:
                fleet = await read_fleet(self.store, self.keys)
                ready = all(
                    wid in self.agent.handles and self.agent.handles[wid].process.is_running
                    and wid in fleet.workers and (h := fleet.health.get(wid)) is not None
                    and h.state.value == "ready"
                    for wid in self.agent.specs)
                if ready:
                    return
                await asyncio.sleep(0.05)

    async def wait_workers_routable(self, n: int, timeout: float = 30.0) -> None:
        async with asyncio.timeout(timeout):
            while True:
                fleet = await read_fleet(self.store, self.keys)
                if len(fleet.routable()) >= n:
                    return
                await asyncio.sleep(0.05)

    # -- chaos levers -----------------------------------------------------------------------------------
    #
    # Wiring: with ``proxy_workers`` every worker is registered behind its own HTTP-aware proxy
    # (``router->worker:<id>``); with ``proxy_clients`` every router gets one in front
    # (``client->router:<id>``, clients use ``RouterProcess.client_url``); with ``proxy_control`` the node
    # agent reaches etcd through ``agent->etcd`` (one proxy per member, the agent's store gets them all) and
    # the broker through ``agent->broker``, and each router through ``<id>->etcd`` and ``<id>->broker``.
    # The router's command line takes one etcd endpoint, so on a multi-member cluster a router always
    # reaches etcd through a failover proxy ``<id>->etcd`` over every member. The harness's own store
    # (``self.store``, what tests and faults read) and the supervisor controller always go direct.

    @property
    def etcd_endpoints(self) -> list[str]:
        """Every etcd member's client endpoint (the private cluster's, or the ``etcd`` given)."""
        if self.etcd_cluster:
            return [m.endpoint for m in self.etcd_cluster]
        return [e for e in self.etcd.split(",") if e]

    def etcd_member(self, name: str) -> LocalEtcd:
        for m in self.etcd_cluster:
            if m.name == name:
                return m
        raise KeyError(f"no etcd member {name!r} in this fleet (members: {[m.name for m in self.etcd_cluster]})")

    async def _start_infra(self) -> None:
        if self.etcd_members > 0:
            members = [LocalEtcd(self.run_dir / f"etcd-{i}", name=f"etcd-{i}", cluster_token=self.cluster)
                       for i in range(self.etcd_members)]
            initial = ",".join(f"{m.name}={m.peer_url}" for m in members)
            for m in members:
                m.initial_cluster = initial
                m.start(self.log_dir)
                self.etcd_cluster.append(m)
            await asyncio.gather(*(m.wait_ready() for m in members))
            self.etcd = ",".join(m.endpoint for m in members)
        if self.own_broker:
            self.broker_impl = LocalBroker(self.run_dir / "broker")
            self.broker_impl.start(self.log_dir)
            await self.broker_impl.wait_ready()
            self.mqtt = self.broker_impl.endpoint

    async def _stop_infra(self) -> None:
        for client in self._own_clients:
            with contextlib.suppress(Exception):
                await client.aclose()
        self._own_clients.clear()
        await self.proxies.aclose()
        if self.broker_impl is not None:
            await self.broker_impl.stop()
        for m in self.etcd_cluster:
            await m.stop()

    @staticmethod
    def _hostport(endpoint: str) -> tuple[str, int]:
        host, _, port = endpoint.rpartition(":")
        return host, int(port)

    async def _link(self, name: str, endpoints: list[str], *, probe: str, per_upstream: bool = False,
                    http: bool = False) -> Link:
        if name in self.proxies:
            return self.proxies.get(name)
        link = await self.proxies.add(name, [self._hostport(e) for e in endpoints], http=http,
                                      per_upstream=per_upstream)
        link.probe = probe
        return link

    async def _agent_clients(self) -> tuple[Any, Any]:
        if not self.proxy_control:
            return self.store, self.bus
        etcd = await self._link("agent->etcd", self.etcd_endpoints, probe="etcd", per_upstream=True)
        broker = await self._link("agent->broker", [self.mqtt], probe="mqtt")
        store = EtcdStore([p.address for p in etcd.proxies])
        bus = await MqttBus(broker.proxies[0].address, self.cluster).start()
        self._own_clients += [bus, store]
        return store, bus

    async def _router_endpoints(self, rid: str) -> tuple[str, str]:
        etcd, mqtt = self.etcd_endpoints[0], self.mqtt
        if self.proxy_control or len(self.etcd_endpoints) > 1:
            etcd = (await self._link(f"{rid}->etcd", self.etcd_endpoints, probe="etcd")).proxies[0].address
        if self.proxy_control:
            mqtt = (await self._link(f"{rid}->broker", [self.mqtt], probe="mqtt")).proxies[0].address
        return etcd, mqtt

    async def _proxied_spec(self, spec: WorkerSpec) -> WorkerSpec:
        if not self.proxy_workers:
            return spec
        link = await self._link(f"router->worker:{spec.id}", [f"{spec.host}:{spec.port}"], probe="http", http=True)
        return dataclasses.replace(spec, advertise_url=link.proxies[0].url)

    def _repoint(self, spec: WorkerSpec) -> None:
        """A worker (re)started, perhaps on another port: its proxy follows."""
        name = f"router->worker:{spec.id}"
        if name in self.proxies:
            for p in self.proxies.get(name).proxies:
                p.set_upstreams((spec.host, spec.port))

    def wrap_launch(self, worker: str, prefix: list[str] | None) -> None:
        """Start ``worker`` as ``prefix + its usual argv`` from its next (re)start on (None: as usual again).

        The prefix is a launcher that ends by exec-ing the argv (same pid): e.g. the process.crash_loop and
        process.slow_start launcher of ``fleetward.chaos.faults.launcher``.
        """
        if prefix:
            self._launch_prefix[worker] = list(prefix)
        else:
            self._launch_prefix.pop(worker, None)

    async def worker_serving(self, worker: str, *, timeout: float = 10.0) -> bool:
        """Whether the worker process answers ``/health`` and a one-token completion (bypassing proxies)."""
        handle = self.agent.handles.get(worker)
        if handle is None or not handle.process.is_running:
            return False
        try:
            async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
                if not await worker_ready(handle.bind_url, client=client):
                    return False
                r = await client.post(f"{handle.bind_url}/v1/completions",
                                      json={"model": handle.spec.model, "prompt": [40], "max_tokens": 1})
                return r.status_code == 200
        except (httpx.HTTPError, OSError):
            return False

    async def ensure_serving(self, worker: str, *, timeout: float = 60.0, grace: float | None = None) -> None:
        """Bring ``worker`` back unless it serves. While a supervisor controller runs, it is given ``grace``
        seconds (default 10) to do so first, and a restart in progress is waited for: the agent does not
        serialize restarts of one worker, and two at once leave a process behind."""
        grace = (10.0 if self.supervised else 0.0) if grace is None else grace
        loop = asyncio.get_running_loop()
        since = loop.time()
        async with asyncio.timeout(timeout):
            while not await self.worker_serving(worker, timeout=5):
                if worker in getattr(self.agent, "_restarting", ()) or loop.time() - since < grace:
                    await asyncio.sleep(0.1)
                    continue
                await self.restart(worker)

    def router(self, router_id: str) -> RouterProcess:
        for r in self.routers:
            if r.id == router_id:
                return r
        raise KeyError(f"no router {router_id!r} (routers: {[r.id for r in self.routers]})")

    async def restart_router(self, router: RouterProcess, *, timeout: float = 30.0) -> RouterProcess:
        """Start a killed (or running: it is killed first) router again: same id, port, links and config."""
        if router.process.is_running:
            router.process.kill()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(router.process.wait_exit(), 5)
        router.process.start()

        async def healthy() -> bool:
            return (await self._http.get(f"{router.url}/health")).status_code == 200

        await router.process.wait_ready(healthy, timeout=timeout, interval=0.05)
        if router not in self.routers:
            self.routers.append(router)
        return router

    async def restart_broker(self) -> None:
        """Start the private broker again (same port and persistence) and wait until it accepts."""
        if self.broker_impl is None:
            raise RuntimeError("the fleet has no broker of its own (own_broker=True)")
        if self.broker_impl.process is not None and self.broker_impl.process.is_running:
            await self.broker_impl.stop()
        self.broker_impl.start(self.log_dir)
        await self.broker_impl.wait_ready()

    def fault_context(self, *, history: Any = None, seed: int = 0,
                      services: dict[str, Any] | None = None) -> FleetContext:
        """A :class:`~fleetward.chaos.fault.FaultContext` over this fleet (see :class:`FleetContext`)."""
        return FleetContext(self, history=history, seed=seed, services=services)


class HarnessSupervisor:
    """:class:`~fleetward.chaos.faults.control.SupervisorControl` over a :class:`TestFleet`'s controllers.

    ``kill`` of a controller process is a ``SIGKILL``: it neither resigns nor revokes its lease, so a
    standby takes over only once the lease expires (``supervisor.lease_ttl_s``), as after a real crash. An
    in-process controller can only be cancelled, and a cancelled one resigns on its way out (an orderly
    hand-over, not a crash): use controller processes to test a crash.
    """

    def __init__(self, fleet: TestFleet) -> None:
        self.fleet = fleet

    @property
    def ids(self) -> list[str]:
        return [c.id for c in self.fleet.controller_procs] + [c.id for c, _ in self.fleet.controllers]

    async def leader(self) -> str | None:
        leader = await self.fleet.leader()
        return None if leader is None else str(leader["id"])

    async def kill(self, controller: str) -> None:
        for c in self.fleet.controller_procs:
            if c.id == controller:
                c.process.kill()
                return
        for i, (ctl, task) in enumerate(self.fleet.controllers):
            if ctl.id == controller:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                del self.fleet.controllers[i]
                return
        raise KeyError(f"no controller {controller!r} (controllers: {', '.join(self.ids)})")

    async def restart(self, controller: str) -> None:
        for c in self.fleet.controller_procs:
            if c.id == controller:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(c.process.wait_exit(), 5)
                c.process.start()
                await self.fleet._controller_ready(c)
                return
        if controller not in self.ids:  # a cancelled in-process controller: a new one under the same id
            await self.fleet.start_controller(wait=False, controller_id=controller)


class _HarnessBackend:
    """The real backend, plus what chaos needs at launch: a launcher prefix per worker, proxies that follow."""

    def __init__(self, fleet: TestFleet, inner: WorkerBackend) -> None:
        self.fleet = fleet
        self.inner = inner
        self.name = inner.name

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def launch(self, spec: WorkerSpec, log_dir: Path, env: Mapping[str, str] | None = None) -> WorkerHandle:
        self.fleet._repoint(spec)
        prefix = self.fleet._launch_prefix.get(spec.id)
        if not prefix:
            return self.inner.launch(spec, log_dir, env)
        inner: Any = self.inner  # a process backend: argv(), env(), nice
        proc = ManagedProcess(f"worker {spec.id}", [*prefix, *inner.argv(spec)],
                              log_path=log_dir / f"worker-{spec.id}.log", env={**inner.env(spec), **(env or {})},
                              cwd=log_dir, nice=inner.nice).start()
        return WorkerHandle(spec, inner.name, proc)

    async def wait_ready(self, handle: WorkerHandle, *, timeout: float | None = None) -> None:
        await self.inner.wait_ready(handle, timeout=timeout)

    async def stop(self, handle: WorkerHandle, *, grace: float = 10.0) -> None:
        await self.inner.stop(handle, grace=grace)


class FleetContext:
    """A :class:`~fleetward.chaos.fault.FaultContext` over a :class:`TestFleet`.

    ``resolve``: ``worker`` ids are the agent's workers, ``router`` the running routers, ``etcd`` the
    private cluster's members (``etcd-0`` ...), ``broker`` is ``broker`` (own broker only), ``link`` the
    proxies' link names (ids may be globs: ``*->etcd``). An id outside the fleet raises ``ValueError``
    (the safety rule). ``pick="serving"`` needs routers' live progress, which a synchronous resolve cannot
    read: it falls back to ``first``.
    ``service``: ``proxy:<link>`` (a :class:`~fleetward.chaos.proxy.Link`), ``proxies`` (the registry),
    ``etcd-cluster`` (the fleet), ``gpu`` (the fleet's GPU health source, when it has one), ``kv`` (the
    fleet's KV-transfer hook), ``supervisor`` (:class:`HarnessSupervisor`, when controllers run as
    processes: an in-process one can be cancelled, not crashed), and
    whatever was passed in ``services`` (which win).
    ``record`` appends to ``history`` (a :class:`~fleetward.chaos.history.History`) or to :attr:`records`.
    """

    def __init__(self, fleet: TestFleet, *, history: Any = None, seed: int = 0,
                 services: dict[str, Any] | None = None) -> None:
        self._fleet = fleet
        self.history = history
        self.records: list[tuple[str, dict[str, Any]]] = []
        self._rng = random.Random(seed)
        self._services = dict(services or {})

    @property
    def fleet(self) -> TestFleet:
        return self._fleet

    def universe(self, kind: str) -> list[str]:
        f = self._fleet
        if kind == "worker":
            return sorted(f.agent.specs)
        if kind == "router":
            return [r.id for r in f.routers]
        if kind == "etcd":
            return [m.name for m in f.etcd_cluster]
        if kind == "broker":
            return ["broker"] if f.broker_impl is not None else []
        if kind == "link":
            return f.proxies.names
        if kind == "fleet":
            return [f.cluster]
        if kind == "kv":
            return ["kv"]
        if kind == "supervisor":
            return f.supervisor_control().ids
        known = self._services.get(kind)
        return list(getattr(known, "ids", []) or [])

    def resolve(self, target: Any) -> list[str]:
        universe = self.universe(target.kind)
        if target.ids:
            out: list[str] = []
            for i in target.ids:
                hits = fnmatch.filter(universe, i) if any(c in i for c in "*?[") else [i] if i in universe else []
                if not hits:
                    known = ", ".join(universe) or "none"
                    raise ValueError(f"target {target.kind} {i!r} is outside the fleet ({known})")
                out += [h for h in hits if h not in out]
            return out
        if not universe:
            raise ValueError(f"the fleet has no {target.kind} to target")
        if target.pick == "all":
            return list(universe)
        if target.pick == "random":
            return sorted(self._rng.sample(universe, min(target.count, len(universe))))
        return universe[:target.count]

    def record(self, kind: str, **data: Any) -> None:
        if self.history is not None:
            self.history.add(kind, **data)
        else:
            self.records.append((kind, data))

    def service(self, name: str) -> Any:
        if name.startswith("proxy:"):
            return self._fleet.proxies.get(name.removeprefix("proxy:"))
        if name == "proxies":
            return self._fleet.proxies
        if name in self._services:
            return self._services[name]
        if name == "etcd-cluster":
            return self._fleet
        if name == "gpu" and self._fleet.gpu is not None:
            return self._fleet.gpu
        if name == "kv":
            return self._fleet.kv
        if name == "supervisor" and self._fleet.controller_procs:  # an in-process controller cannot crash
            return self._fleet.supervisor_control()
        raise KeyError(f"no service {name!r} in this context")
