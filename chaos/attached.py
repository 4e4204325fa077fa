"""A fleet someone else runs, attached to through its etcd, broker and state file.

:class:`AttachedFleet` is the :class:`~fleetward.fleet.handle.Fleet` of ``fleetward chaos run --attach``:
the fleet ``fleetward up`` runs (``<run dir>/<cluster>/fleet.json``). What works through the fleet's own
interfaces works: its state, its events, simulated workers' fault switches, the supervisor's control
API. Its processes are not ours to kill or restart: those levers raise
:class:`~fleetward.fleet.handle.NotOurs`; they may still be looked at (:meth:`AttachedFleet.command_line`: how
a worker was started), and a worker may be asked for a completion (:meth:`AttachedFleet.complete`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil

from fleetward.fleet import handle as fleet_handle
from fleetward.fleet.backends import Backend
from fleetward.fleet.bus import MqttBus
from fleetward.fleet.config import Access, AccessConfig, resolve_access
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.handle import Fleet, FleetClient, NotOurs, RouterRef
from fleetward.fleet.keys import Keys
from fleetward.fleet.registry import read_fleet
from fleetward.fleet.worker import WorkerRecord, WorkerSpec

__all__ = ["AttachedFleet", "RouterRef"]


class _Router:
    """A router of the attached fleet, as etcd lists it."""

    def __init__(self, router_id: str, url: str) -> None:
        self.id = router_id
        self.url = url
        self.client_url = url

    @property
    def is_running(self) -> bool:
        return True


class AttachedFleet(FleetClient):
    """The levers of a fleet someone else runs (see the module docstring). ``backend`` says what its
    workers are (the experiment declares it)."""

    bus: MqttBus

    def __init__(self, state: Mapping[str, Any], admin_token: str, backend: Backend, *,
                 log_dir: Path = Path(".")) -> None:
        self.cluster = str(state["cluster"])
        self.etcd = str(state["etcd"])
        self.mqtt = str(state["mqtt"])
        self.backend = backend
        self.log_dir = Path(str(state.get("logs") or log_dir))
        self.workers_urls: dict[str, str] = dict(state.get("workers") or {})
        self.records: dict[str, WorkerRecord] = {}
        self.keys = Keys(self.cluster)
        # TLS and credentials as the fleet's state file names them (files, never a password): `up --tls`.
        self.etcd_access, self.mqtt_access = (
            resolve_access(AccessConfig.model_validate(state[f]), field=f) if state.get(f) else Access()
            for f in ("etcd_access", "mqtt_access"))
        self.store = EtcdStore(self.etcd, access=self.etcd_access)
        self.admin_token = admin_token
        self._routers: list[_Router] = []
        self._http = httpx.AsyncClient(timeout=10.0, trust_env=False)

    async def start(self) -> None:
        self.bus = await MqttBus(self.mqtt, self.cluster, access=self.mqtt_access).start()
        fleet = await read_fleet(self.store, self.keys)
        self._routers = [_Router(rid, str(r.get("url"))) for rid, r in sorted(fleet.routers.items())]
        self.records = dict(fleet.workers)
        for wid, rec in fleet.workers.items():
            self.workers_urls.setdefault(wid, rec.url)

    async def aclose(self) -> None:
        if "bus" in vars(self):
            await self.bus.aclose()
        await self.store.aclose()
        await self._http.aclose()

    @property
    def etcd_endpoints(self) -> list[str]:
        return [e for e in self.etcd.split(",") if e]

    @property
    def mqtt_endpoint(self) -> str:
        return self.mqtt

    # -- workers

    @property
    def worker_ids(self) -> list[str]:
        return sorted(self.workers_urls)

    def spec(self, worker: str) -> WorkerSpec:
        url = self.workers_urls[worker]
        parts = urlsplit(url)
        rec = self.records.get(worker)
        return WorkerSpec(id=worker, host=parts.hostname or "127.0.0.1", port=parts.port or 80,
                          model=rec.model if rec else self.backend.model_name, role=rec.role if rec else "aggregated",
                          node=rec.node if rec else "local", gpus=tuple(rec.gpus) if rec else ())

    def url(self, worker: str) -> str:
        return self.workers_urls[worker]

    def bind_url(self, worker: str) -> str:
        return self.workers_urls[worker]

    def admin_bearer(self) -> str:
        return self.admin_token

    def processes(self, worker: str) -> list[psutil.Process]:
        return []

    def command_line(self, worker: str) -> list[str] | None:
        """The command line of the worker's server process, by the pid its node agent registered; ``None``
        when there is none here (no pid, a worker on another host, a process gone)."""
        rec = self.records.get(worker)
        if rec is None or rec.pid is None:
            return None
        try:
            return psutil.Process(rec.pid).cmdline()
        except psutil.Error:
            return None

    async def complete(self, worker: str, prompt: Sequence[int], max_tokens: int) -> list[int] | None:
        """The token ids of a greedy completion of ``prompt`` straight from the worker; ``None`` when it
        does not answer with them."""
        body = {"model": self.spec(worker).model, "prompt": list(prompt), "max_tokens": max_tokens,
                "temperature": 0, "return_token_ids": True}
        try:
            r = await self._http.post(f"{self.url(worker)}/v1/completions", json=body)
            ids = r.json()["choices"][0]["token_ids"] if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, LookupError, TypeError):
            return None
        return [int(t) for t in ids] if isinstance(ids, list) else None

    def engine_processes(self, worker: str) -> list[psutil.Process]:
        return []

    async def refuses_admin_token(self, workers: Sequence[str]) -> str | None:
        """Who refuses the admin token, and how (None when nobody that answered did): the supervisor leader's
        control API (``GET /v1/workers``), then, when the workers have fault switches, each worker's admin
        endpoint. Side-effect free: what a fault would be refused before it is injected."""
        checks: list[tuple[str, str]] = []
        leader = await self.leader()
        if leader is not None and leader.url:
            checks.append(("the supervisor's control API", f"{leader.url}/v1/workers"))
        if self.backend.fault_switches:
            checks += [(f"worker {w}", f"{self.bind_url(w)}/admin/state") for w in workers]
        for who, url in checks:
            try:
                r = await self._http.get(url, headers=self._headers())
            except httpx.HTTPError:
                continue  # not answering: the steady-state hypothesis will say so
            if r.status_code in (401, 403):
                return f"{who} refuses the admin token (HTTP {r.status_code})"
        return None

    def kill(self, worker: str) -> None:
        raise NotOurs("killing a worker")

    def signal_engine(self, worker: str, sig: int) -> None:
        raise NotOurs("signalling a worker")

    async def restart(self, worker: str) -> None:
        raise NotOurs("restarting a worker")

    async def ensure_serving(self, worker: str, *, timeout: float = 60.0) -> None:
        if not await self.worker_serving(worker):
            raise NotOurs(f"restarting worker {worker}")

    async def worker_serving(self, worker: str, *, timeout: float = 10.0) -> bool:
        return await fleet_handle.serves(self.url(worker), self.spec(worker).model, timeout=timeout)

    # -- routers

    @property
    def routers(self) -> Sequence[RouterRef]:
        return self._routers

    async def start_router(self, router_id: str | None = None) -> RouterRef:
        raise NotOurs("starting a router")

    async def stop_router(self, router: RouterRef) -> None:
        raise NotOurs("stopping a router")

    def kill_router(self, router: RouterRef) -> None:
        raise NotOurs("killing a router")

    async def restart_router(self, router: RouterRef, *, timeout: float = 30.0) -> RouterRef:
        raise NotOurs("restarting a router")

    # -- the supervisor

    @property
    def supervised(self) -> bool:
        return False  # a fleet we did not start: whether its health is decided is not ours to promise

    async def restore(self, *, workers: Sequence[str] | None = None, timeout: float = 120.0) -> dict[str, Any]:
        return await fleet_handle.restore(self, workers=workers, timeout=timeout)


_: type[Fleet] = AttachedFleet  # mypy checks that an attached fleet is a Fleet
