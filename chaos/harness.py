"""A fleet for tests and experiments: real workers, real routers, real etcd and broker, all disposable.

:class:`TestFleet` attaches to an existing etcd and MQTT broker (the pytest fixtures start one of each per
session) and starts, under its own cluster name, a node agent with N workers and any number of router
processes. It offers the levers tests and faults need: kill a worker or a router (``SIGKILL`` of the
real process tree), set a simulated worker's fault switches, restart what was killed. Leaving it stops
everything it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from fleetward.fleet.backends import WorkerBackend, WorkerHandle, make_backend
from fleetward.fleet.bus import MqttBus
from fleetward.fleet.config import RouterConfig, SimConfig, VllmConfig
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.procs import ManagedProcess, free_port
from fleetward.fleet.registry import read_fleet
from fleetward.fleet.worker import WorkerSpec
from fleetward.supervisor.agent import NodeAgent

__all__ = ["RouterProcess", "TestFleet"]


@dataclass
class RouterProcess:
    id: str
    url: str
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
    admin_token: str = "test-admin-token"
    node: str = "node"
    lease_ttl: int = 10
    store: EtcdStore = field(init=False)
    bus: MqttBus = field(init=False)
    agent: NodeAgent = field(init=False)
    backend_impl: WorkerBackend = field(init=False)
    routers: list[RouterProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.keys = Keys(self.cluster)
        self.log_dir = self.run_dir / "logs"
        self._http = httpx.AsyncClient(timeout=10.0)

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
        self.store = EtcdStore(self.etcd)
        self.bus = await MqttBus(self.mqtt, self.cluster).start()
        self.backend_impl = make_backend(self.backend, sim=self.sim, vllm=self.vllm, model_path=self.model_path)
        self.agent = NodeAgent(store=self.store, bus=self.bus, keys=self.keys, backend=self.backend_impl,
                               node=self.node, log_dir=self.log_dir, lease_ttl=self.lease_ttl,
                               worker_env={"FLEETWARD_ADMIN_TOKEN": self.admin_token})
        await self.agent.start()
        model = self.sim.model_name if self.backend == "sim" else "tiny"
        specs = [WorkerSpec(id=f"{self.node}-w{i}", host="127.0.0.1", port=free_port(), model=model, node=self.node)
                 for i in range(self.workers)]
        await self.agent.start_workers(specs)

    async def aclose(self) -> None:
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
        await self._http.aclose()

    # -- workers ----------------------------------------------------------------------------------------

    @property
    def worker_ids(self) -> list[str]:
        return sorted(self.agent.handles)

    def handle(self, worker: str) -> WorkerHandle:
        return self.agent.handles[worker]

    def url(self, worker: str) -> str:
        """The registered (advertised) URL: what routers use."""
        return self.handle(worker).url

    def bind_url(self, worker: str) -> str:
        """The worker process itself, bypassing any proxy in front of it."""
        return self.handle(worker).bind_url

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
        argv = [sys.executable, "-m", "fleetward.fleet.cli", "router", "--config", str(conf), "--etcd", self.etcd,
                "--mqtt", self.mqtt, "--cluster", self.cluster, "--port", str(port), "--id", rid]
        proc = ManagedProcess(rid, argv, log_path=self.log_dir / f"{rid}.log",
                              env={"PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1",
                                   "FLEETWARD_LOG_LEVEL": os.environ.get("FLEETWARD_LOG_LEVEL", "INFO")}).start()
        router = RouterProcess(rid, f"http://127.0.0.1:{port}", proc)

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

    async def wait_workers_routable(self, n: int, timeout: float = 30.0) -> None:
        async with asyncio.timeout(timeout):
            while True:
                fleet = await read_fleet(self.store, self.keys)
                if len(fleet.routable()) >= n:
                    return
                await asyncio.sleep(0.05)
