"""The composition root: a local fleet wired from every subpackage.

:class:`LocalFleet` is what ``fleetward up`` runs and what tests and chaos experiments start: etcd and an
MQTT broker (unless existing ones are given), a node agent with N workers, and the supervisor and router
parts as they exist. It is an async context manager; leaving it stops everything in order (workers, then
bus and store clients, then broker and etcd) and leaves no process behind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from pydantic import SecretStr

from fleetward.fleet.backends import WorkerBackend, make_backend
from fleetward.fleet.bus import MqttBus
from fleetward.fleet.config import FleetConfig, admin_token_from_env
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.infra import LocalBroker, LocalEtcd
from fleetward.fleet.keys import Keys
from fleetward.fleet.procs import ManagedProcess, ensure_port
from fleetward.fleet.worker import WorkerSpec
from fleetward.supervisor.agent import NodeAgent

__all__ = ["LocalFleet", "StateFile", "default_model_path"]

log = logging.getLogger(__name__)

Progress = Callable[[str, str], None]  # (step, what happened)


def default_model_path(run_root: Path) -> Path:
    return run_root / "models" / "tiny-seed0"


@dataclass
class StateFile:
    """``<run dir>/<cluster>/fleet.json``: where a running local fleet can be reached."""

    path: Path
    data: dict[str, Any] = field(default_factory=dict)

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2) + "\n")
        tmp.replace(self.path)

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class LocalFleet:
    def __init__(self, config: FleetConfig, *, progress: Progress | None = None,
                 admin_token: SecretStr | None = None) -> None:
        self.config = config
        self.root = config.run_dir / config.cluster
        self.log_dir = self.root / "logs"
        self.keys = Keys(config.cluster)
        self.admin_token = admin_token or admin_token_from_env()
        self._progress = progress or (lambda _s, _w: None)
        self.etcd: LocalEtcd | None = None
        self.broker: LocalBroker | None = None
        self.store: EtcdStore | None = None
        self.bus: MqttBus | None = None
        self.agent: NodeAgent | None = None
        self.backend: WorkerBackend | None = None
        self.etcd_endpoint = config.etcd or ""
        self.mqtt_endpoint = config.mqtt or ""
        self.state = StateFile(self.root / "fleet.json")
        self.router_url = ""
        self.router_process: ManagedProcess | None = None
        self.controller_url = ""
        self.controller_process: ManagedProcess | None = None

    async def __aenter__(self) -> LocalFleet:
        try:
            await self.start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _specs(self) -> list[WorkerSpec]:
        c = self.config
        model = c.sim.model_name if c.backend == "sim" else "tiny"
        if c.backend == "vllm" and c.vllm.model:
            model = Path(c.vllm.model).name
        specs = []
        for i in range(c.workers):
            port = ensure_port(c.host, c.worker_base_port + i if c.worker_base_port else 0, name=f"worker {i}")
            specs.append(WorkerSpec(id=f"{c.node}-w{i}", host=c.host, port=port, model=model, node=c.node))
        return specs

    def _model_path(self) -> Path | None:
        c = self.config
        if c.backend != "vllm":
            return None
        if c.vllm.model:
            return Path(c.vllm.model)
        path = default_model_path(c.run_dir)
        if not (path / "model.safetensors").exists():
            from fleetward.fleet.tinymodel import write_tiny_model

            self._progress("model", f"writing the tiny local model to {path}")
            write_tiny_model(path)
        return path

    async def start(self) -> None:
        c = self.config
        self.log_dir.mkdir(parents=True, exist_ok=True)
        specs = self._specs()  # fail early on busy worker ports
        if not c.etcd:
            # The embedded etcd holds only this run's state: a previous run's leftovers are stale.
            shutil.rmtree(self.root / "etcd-data", ignore_errors=True)
            self.etcd = LocalEtcd(self.root / "etcd-data", host=c.host, client_port=c.etcd_port)
            self._progress("etcd", f"starting etcd on {self.etcd.endpoint}")
            self.etcd.start(self.log_dir)
            await self.etcd.wait_ready()
            self.etcd_endpoint = self.etcd.endpoint
        if not c.mqtt:
            self.broker = LocalBroker(self.root / "broker", host=c.host, port=c.mqtt_port)
            self._progress("broker", f"starting {self.broker.kind} on {self.broker.endpoint}")
            self.broker.start(self.log_dir)
            await self.broker.wait_ready()
            self.mqtt_endpoint = self.broker.endpoint
        self.store = EtcdStore(self.etcd_endpoint)
        await self.store.get(self.keys.root)  # fails with a clear StoreUnavailable if etcd is not there
        self.bus = await MqttBus(self.mqtt_endpoint, c.cluster).start()
        self.backend = make_backend(c.backend, sim=c.sim, vllm=c.vllm, model_path=self._model_path())
        self.agent = NodeAgent(store=self.store, bus=self.bus, keys=self.keys, backend=self.backend, node=c.node,
                               log_dir=self.log_dir, lease_ttl=c.lease_ttl_s, supervisor=c.supervisor,
                               worker_env={"FLEETWARD_ADMIN_TOKEN": self.admin_token.get_secret_value()})
        await self.agent.start()
        self._write_state()
        if c.controller:
            await self._start_controller()
        await self.agent.start_workers(specs, progress=lambda w, what: self._progress(w, what))
        if c.router:
            await self._start_router()
        self._write_state()

    def _fleet_yaml(self) -> Path:
        """This fleet's settings as a file, for the router and controller processes (``--config``)."""
        c = self.config
        conf = self.root / "fleet.yaml"
        conf.write_text(yaml.safe_dump({"cluster": c.cluster, "routing": c.routing.model_dump(mode="json"),
                                        "supervisor": c.supervisor.model_dump(mode="json")}))
        return conf

    async def _start_controller(self) -> None:
        c = self.config
        port = ensure_port(c.host, c.supervisor.port, name="supervisor controller")
        argv = [sys.executable, "-m", "fleetward.fleet.cli", "supervisor", "--role", "controller",
                "--config", str(self._fleet_yaml()), "--etcd", self.etcd_endpoint, "--mqtt", self.mqtt_endpoint,
                "--cluster", c.cluster, "--host", c.host, "--port", str(port), "--id", f"{c.node}-controller"]
        self.controller_url = f"http://{c.host}:{port}"
        self._progress("controller", f"starting the supervisor controller on {self.controller_url}")
        self.controller_process = ManagedProcess(
            "controller", argv, log_path=self.log_dir / "controller.log",
            env={"PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1",
                 "FLEETWARD_ADMIN_TOKEN": self.admin_token.get_secret_value()}).start()

        async def healthy() -> bool:
            async with httpx.AsyncClient(timeout=1.0) as client:
                return (await client.get(f"{self.controller_url}/health")).status_code == 200

        await self.controller_process.wait_ready(healthy, timeout=30)

    async def _start_router(self) -> None:
        c = self.config
        port = ensure_port(c.host, c.router_port, name="router")
        argv = [sys.executable, "-m", "fleetward.fleet.cli", "router", "--config", str(self._fleet_yaml()),
                "--etcd", self.etcd_endpoint, "--mqtt", self.mqtt_endpoint, "--cluster", c.cluster,
                "--host", c.host, "--port", str(port), "--id", f"{c.node}-router"]
        self.router_url = f"http://{c.host}:{port}"
        self._progress("router", f"starting the router on {self.router_url}")
        self.router_process = ManagedProcess("router", argv, log_path=self.log_dir / "router.log",
                                             env={"PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1"}).start()

        async def healthy() -> bool:
            async with httpx.AsyncClient(timeout=1.0) as client:
                return (await client.get(f"{self.router_url}/health")).status_code == 200

        await self.router_process.wait_ready(healthy, timeout=30)

    def _write_state(self) -> None:
        token_file = self.root / "admin-token"
        if not token_file.exists():
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.admin_token.get_secret_value())
        self.state.data = {
            "cluster": self.config.cluster,
            "etcd": self.etcd_endpoint,
            "mqtt": self.mqtt_endpoint,
            "pid": os.getpid(),
            "started_at": time.time(),
            "logs": str(self.log_dir),
            "admin_token_file": str(token_file),
            "router": self.router_url,
            "controller": self.controller_url,
            "workers": {wid: h.url for wid, h in (self.agent.handles.items() if self.agent else [])},
        }
        self.state.write()

    async def aclose(self) -> None:
        if self.router_process is not None:
            await self.router_process.stop(grace=self.config.routing.drain_timeout_s + 5)
            self.router_process = None
        if self.controller_process is not None:
            await self.controller_process.stop(grace=5)
            self.controller_process = None
        if self.agent is not None:
            try:
                await self.agent.aclose()
            except Exception:
                log.exception("stopping the node agent failed; stopping the rest")
            self.agent = None
        if self.bus is not None:
            await self.bus.aclose()
            self.bus = None
        if self.store is not None:
            await self.store.aclose()
            self.store = None
        if self.broker is not None:
            await self.broker.stop()
            self.broker = None
        if self.etcd is not None:
            await self.etcd.stop()
            self.etcd = None
        self.state.remove()
        with contextlib.suppress(FileNotFoundError):
            (self.root / "admin-token").unlink()
