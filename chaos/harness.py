"""A fleet for tests and experiments: real workers, real routers, real etcd and broker, all disposable.

:class:`TestFleet` attaches to an existing etcd and MQTT broker (the pytest fixtures start one of each per
session) and starts, under its own cluster name, a node agent with N workers and any number of router
processes. It offers the levers tests and faults need: kill a worker or a router (``SIGKILL`` of the
real process tree), set a simulated worker's fault switches, restart what was killed, kill the supervisor's
leader, reach the leader's control API. Leaving it stops everything it started.

The supervisor runs as one controller in this process (``controller=True``, the default), or as
``controller_processes`` real ``fleetward supervisor --role controller`` processes that campaign for the
lead (one leads, the others stand by: what ``control.supervisor_leader_kill`` needs).

:class:`TestFleet` implements :class:`~fleetward.fleet.handle.Fleet`; routers and controller processes
are started through :mod:`fleetward.fleet.launch`, as ``fleetward up`` starts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from fleetward.chaos.context import FleetContext, HarnessSupervisor
from fleetward.chaos.net import Link, ProxyRegistry
from fleetward.fleet import handle as fleet_handle
from fleetward.fleet.backends import Backend, SimBackend, TinyModel, WorkerHandle
from fleetward.fleet.bus import MqttBus
from fleetward.fleet.config import AttachConfig, RouterConfig, SupervisorConfig
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.handle import AgentWorkers, Fleet, FleetClient, RouterRef, StartedInContext
from fleetward.fleet.infra import LocalBroker, LocalEtcd
from fleetward.fleet.keys import Keys
from fleetward.fleet.launch import (
    ServiceProcess,
    controller_argv,
    restart_service,
    router_argv,
    service_env,
    start_service,
    wait_leader,
    write_service_config,
)
from fleetward.fleet.procs import free_port, spread_cores
from fleetward.fleet.registry import Leader, publish_attachments, wait_registered
from fleetward.fleet.signing import AttachSigner
from fleetward.fleet.worker import WorkerSpec
from fleetward.supervisor.agent import NodeAgent

__all__ = ["ControllerProcess", "FleetContext", "HarnessSupervisor", "RouterProcess", "TestFleet"]

RouterProcess = ServiceProcess  # a router process; ``client_url`` is a ``client->router:<id>`` proxy, or ``url``
ControllerProcess = ServiceProcess  # a controller process; ``url`` is its control API


@dataclass
class TestFleet(AgentWorkers, FleetClient, StartedInContext):
    """Workers (through a real node agent) and routers (real processes) under one cluster."""

    __test__ = False  # not a pytest test class

    etcd: str
    mqtt: str
    cluster: str
    run_dir: Path
    workers: int = 3
    prefill_workers: int = 0  # of ``workers``, the first this many are prefill workers and the rest decode ones
    backend: Backend = field(default_factory=SimBackend)  # what kind of workers (``SimBackend(SimConfig(...))``)
    routing: RouterConfig = field(default_factory=RouterConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    gpu: Any = None  # a GpuHealthSource for the node agent (e.g. fleetward.chaos.fakegpu.FakeGpuSource)
    gpus_per_worker: int = 0  # worker i owns GPUs [i*k, (i+1)*k) of that source
    attach: Sequence[AttachConfig] = ()  # servers the test started itself, adopted like fleetward up's attach:
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
    routers: list[ServiceProcess] = field(default_factory=list)
    controllers: list[tuple[Any, asyncio.Task[None]]] = field(default_factory=list)
    controller_procs: list[ServiceProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.keys = Keys(self.cluster)
        self.log_dir = self.run_dir / "logs"
        self._http = httpx.AsyncClient(timeout=10.0)
        self.proxies = ProxyRegistry()
        self.etcd_cluster: list[LocalEtcd] = []
        self.broker_impl: LocalBroker | None = None
        self._launch_prefix: dict[str, list[str]] = {}
        self._own_clients: list[Any] = []  # the agent's store and bus when they go through proxies
        self._started = False
        self.warm: dict[str, int] = {}  # worker -> pid of its process that restore() warmed up (vLLM)

    # -- life -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        await self._start_infra()
        self._started = True
        self.store = EtcdStore(self.etcd_endpoints)
        self.bus = await MqttBus(self.mqtt, self.cluster).start()
        agent_store, agent_bus = await self._agent_clients()
        self.agent = NodeAgent(store=agent_store, bus=agent_bus, keys=self.keys, backend=_HarnessBackend(self),
                               node=self.node, log_dir=self.log_dir, lease_ttl=self.lease_ttl,
                               worker_env={"FLEETWARD_ADMIN_TOKEN": self.admin_token}, supervisor=self.supervisor,
                               gpu=self.gpu, admin_token=self.admin_token)
        await self.agent.start()
        if self.controller_processes:
            for _ in range(self.controller_processes):
                await self.start_controller_process()
            await self.wait_leader()
        elif self.controller:
            await self.start_controller()
        k = self.gpus_per_worker
        p = self.prefill_workers
        cores = spread_cores(self.workers)
        specs = [WorkerSpec(id=f"{self.node}-w{i}", host="127.0.0.1", port=free_port(), model=self.backend.model_name,
                            node=self.node, gpus=tuple(range(i * k, (i + 1) * k)), cpus=cores[i],
                            role=("prefill" if i < p else "decode") if p else "aggregated")
                 for i in range(self.workers)]
        specs = [await self._proxied_spec(s) for s in specs]
        await self.agent.start_workers(specs)
        adopted = await publish_attachments(self.store, self.keys, self.attach, self.node,
                                            signer=AttachSigner(self.admin_token) if self.admin_token else None)
        await wait_registered(self.store, self.keys, adopted, timeout=300.0)
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

    async def start_controller_process(self, controller_id: str | None = None) -> ServiceProcess:
        """A controller as its own process (same settings, its own control API port); it campaigns."""
        cid = controller_id or f"controller-{len(self.controllers) + len(self.controller_procs)}"
        port = free_port()
        supervisor = self.supervisor.model_copy(update={"port": port})
        conf = write_service_config(self.run_dir / f"{cid}.yaml", cluster=self.cluster, supervisor=supervisor)
        argv = controller_argv(etcd=self.etcd_endpoints[0], mqtt=self.mqtt, cluster=self.cluster, config=conf,
                               controller_id=cid)
        ctl = await start_service(cid, argv, url=f"http://{supervisor.host}:{port}",
                                  log_path=self.log_dir / f"{cid}.log", env=service_env(admin_token=self.admin_token))
        self.controller_procs.append(ctl)
        return ctl

    async def wait_leader(self, timeout: float = 30.0) -> Leader:
        return await wait_leader(self.store, self.keys, timeout=timeout)

    async def supervisor_post(self, path: str, body: Mapping[str, Any] | None = None) -> httpx.Response:
        """``POST <path>`` on the leader's control API (``/v1/workers/<id>/drain``, ``/v1/moves``, ...), as an
        operator would; an in-process leader is called in process."""
        for ctl, _ in self.controllers:
            if ctl.leading.is_set():
                transport = httpx.ASGITransport(app=ctl.app())
                async with httpx.AsyncClient(transport=transport, base_url="http://controller") as client:
                    return await client.post(path, json=dict(body or {}), headers=self._headers())
        return await super().supervisor_post(path, body)

    def supervisor_control(self) -> HarnessSupervisor:
        """The ``supervisor`` service of :class:`~fleetward.chaos.faults.control.SupervisorControl`."""
        return HarnessSupervisor(self)

    async def aclose(self) -> None:
        await self.stop_controllers()
        for r in self.routers:
            await r.process.stop(grace=5)
        self.routers.clear()
        if self._started:
            if "agent" in vars(self):
                await self.agent.aclose(grace=5)
            if "bus" in vars(self):
                await self.bus.aclose()
            if "store" in vars(self):
                with contextlib.suppress(Exception):
                    await self.store.delete(self.keys.root, prefix=True)
                await self.store.aclose()
        await self._stop_infra()
        await self._http.aclose()

    # -- workers ----------------------------------------------------------------------------------------

    @property
    def etcd_endpoints(self) -> list[str]:
        """Every etcd member's client endpoint (the private cluster's, or the ``etcd`` given)."""
        if self.etcd_cluster:
            return [m.endpoint for m in self.etcd_cluster]
        return [e for e in self.etcd.split(",") if e]

    @property
    def mqtt_endpoint(self) -> str:
        return self.mqtt

    def admin_bearer(self) -> str:
        return self.admin_token

    def handle(self, worker: str) -> WorkerHandle:
        """The node agent's handle of the worker's running process (tests; chaos uses the Fleet levers)."""
        return self.agent.handles[worker]


    async def restore(self, *, workers: Sequence[str] | None = None, timeout: float = 120.0) -> dict[str, Any]:
        """Back to healthy (:meth:`~fleetward.fleet.handle.Fleet.restore`), the fake GPUs and launchers too."""
        wanted = list(workers if workers is not None else self.worker_ids)
        if self.gpu is not None:
            for info in self.gpu.gpus():
                self.gpu.clear(info.index)
        for w in wanted:
            self.wrap_launch(w, None)
        return await fleet_handle.restore(self, workers=wanted, timeout=timeout, restarting=self.agent.is_restarting,
                                          warm=self.warm)

    # -- routers ----------------------------------------------------------------------------------------

    async def start_router(self, router_id: str | None = None, **overrides: Any) -> ServiceProcess:
        """Start a router process (``fleetward router``) and wait until it serves."""
        rid = router_id or f"router-{len(self.routers)}"
        port = free_port()
        conf = write_service_config(self.run_dir / f"{rid}.yaml", cluster=self.cluster,
                                    routing=self.routing.model_copy(update=overrides))
        etcd, mqtt = await self._router_endpoints(rid)
        client_url = ""
        if self.proxy_clients:
            name = f"client->router:{rid}"
            link = self.proxies.get(name) if name in self.proxies else await self.proxies.add(
                name, ("127.0.0.1", port), http=True)
            link.probe = "http"
            client_url = link.proxies[0].url
        router = await start_service(rid, router_argv(etcd=etcd, mqtt=mqtt, cluster=self.cluster, config=conf,
                                                      port=port, router_id=rid),
                                     url=f"http://127.0.0.1:{port}", log_path=self.log_dir / f"{rid}.log",
                                     client_url=client_url, env=service_env(admin_token=self.admin_token))
        self.routers.append(router)
        return router

    def kill_router(self, router: RouterRef) -> None:
        self._router_process(router).process.signal(signal.SIGKILL)

    async def stop_router(self, router: RouterRef) -> None:
        await self._router_process(router).process.stop(grace=10)
        with contextlib.suppress(ValueError):
            self.routers.remove(self._router_process(router))

    def _router_process(self, router: RouterRef) -> ServiceProcess:
        for r in self.routers:
            if r is router or r.id == router.id:
                return r
        if isinstance(router, ServiceProcess):
            return router
        raise KeyError(f"no router {router.id!r} (routers: {[r.id for r in self.routers]})")

    async def wait_healthy(self, timeout: float = 60.0) -> None:
        """Until every worker of this fleet is registered and ready (after supervisor restarts)."""
        await fleet_handle.wait_ready(self, self.worker_ids, timeout=timeout)


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

    async def ensure_serving(self, worker: str, *, timeout: float = 60.0, grace: float | None = None) -> None:
        """Bring ``worker`` back unless it serves (see :func:`fleetward.fleet.handle.ensure_serving`)."""
        await fleet_handle.ensure_serving(self, worker, restarting=self.agent.is_restarting, timeout=timeout,
                                          grace=grace)

    def router(self, router_id: str) -> ServiceProcess:
        for r in self.routers:
            if r.id == router_id:
                return r
        raise KeyError(f"no router {router_id!r} (routers: {[r.id for r in self.routers]})")

    async def restart_router(self, router: RouterRef, *, timeout: float = 30.0) -> ServiceProcess:
        """Start a killed (or running: it is killed first) router again: same id, port, links and config."""
        proc = await restart_service(self._router_process(router), timeout=timeout)
        if proc not in self.routers:
            self.routers.append(proc)
        return proc

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


class _HarnessBackend:
    """The fleet's backend, plus what chaos needs at launch: a launcher prefix per worker
    (:meth:`TestFleet.wrap_launch`), proxies that follow a worker to its new port."""

    def __init__(self, fleet: TestFleet) -> None:
        self.fleet = fleet
        self.inner = fleet.backend
        self.name = self.inner.name
        self.capabilities = self.inner.capabilities

    @property
    def model_name(self) -> str:
        return self.inner.model_name

    @property
    def max_model_len(self) -> int:
        return self.inner.max_model_len

    @property
    def tokenizer(self) -> str | None:
        return self.inner.tokenizer

    @property
    def fault_switches(self) -> bool:
        return self.inner.fault_switches

    @property
    def owns_processes(self) -> bool:
        return self.inner.owns_processes

    @property
    def simulated(self) -> bool:
        return self.inner.simulated

    @property
    def can_restart(self) -> bool:
        return self.inner.can_restart

    def reference(self) -> dict[str, Any] | None:
        return self.inner.reference()

    def tiny_model(self) -> TinyModel | None:
        return self.inner.tiny_model()

    def check(self) -> None:
        self.inner.check()

    def launch(self, spec: WorkerSpec, log_dir: Path, env: Mapping[str, str] | None = None, *,
               prefix: Sequence[str] = ()) -> WorkerHandle:
        self.fleet._repoint(spec)
        return self.inner.launch(spec, log_dir, env, prefix=[*self.fleet._launch_prefix.get(spec.id, ()), *prefix])

    async def wait_ready(self, handle: WorkerHandle, *, timeout: float | None = None) -> None:
        await self.inner.wait_ready(handle, timeout=timeout)

    async def warm_up(self, url: str) -> None:
        await self.inner.warm_up(url)

    async def stop(self, handle: WorkerHandle, *, grace: float = 10.0) -> None:
        await self.inner.stop(handle, grace=grace)


_: type[Fleet] = TestFleet  # mypy checks that the harness is a Fleet
