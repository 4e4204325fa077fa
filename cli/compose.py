"""The local fleet that ``fleetward up`` runs, wired from every subpackage.

:class:`LocalFleet` starts etcd and an MQTT broker (unless existing ones are given), a node agent with N
workers, a supervisor controller, a router and, with ``autoscale.enabled``, the autoscaler (as processes,
through :mod:`fleetward.fleet.launch`). It
is an async context manager; leaving it stops everything in order (router, controller, workers, then bus
and store clients, then broker and etcd) and leaves no process behind. The embedded etcd and broker bind
``etcd_host`` and ``mqtt_host`` (loopback by default), never ``host``. With ``tls`` they speak only TLS, want a
client certificate and a password: a CA, certificates and random passwords are made in ``<run dir>/<cluster>/tls``,
and every process of the fleet reaches them through the ``etcd_access`` / ``mqtt_access`` of its fleet file
(files, never a password on a command line). It implements
:class:`~fleetward.fleet.handle.Fleet`, so the testbed can act on it like on any other fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib.resources
import logging
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil
from pydantic import SecretStr

from fleetward.fleet import handle as fleet_handle
from fleetward.fleet.backends import Backend, make_backend
from fleetward.fleet.bus import MqttBus
from fleetward.fleet.config import (
    AccessConfig,
    AutoscaleConfig,
    FleetConfig,
    PrometheusConfig,
    RouterConfig,
    SupervisorConfig,
    admin_token_for,
    resolve_access,
)
from fleetward.fleet.errors import ConfigError, FleetwardError, StoreError
from fleetward.fleet.etcd import EtcdStore, enable_auth
from fleetward.fleet.handle import AgentWorkers, Fleet, FleetClient, RouterRef, StartedInContext
from fleetward.fleet.infra import LocalBroker, LocalEtcd, LocalPki, make_local_pki, write_mosquitto_passwords
from fleetward.fleet.keys import Keys
from fleetward.fleet.launch import (
    ServiceProcess,
    autoscaler_argv,
    controller_argv,
    restart_service,
    router_argv,
    service_env,
    start_service,
    write_service_config,
)
from fleetward.fleet.procs import (
    RUN_MARK,
    WILDCARD,
    advertised_host,
    ensure_port,
    is_local_only,
    kill_tree,
    marked_processes,
    spread_cores,
)
from fleetward.fleet.prometheus import LocalPrometheus, TargetsWriter
from fleetward.fleet.registry import publish_attachments
from fleetward.fleet.signing import AttachSigner
from fleetward.fleet.state import StateFile, state_path, write_admin_token
from fleetward.fleet.worker import Role, WorkerSpec
from fleetward.supervisor.agent import NodeAgent
from fleetward.supervisor.gpu import GpuHealthSource
from fleetward.supervisor.gpuhost import GpuChoice, assign, open_source, policy_of

__all__ = ["LocalFleet"]

log = logging.getLogger(__name__)

Progress = Callable[[str, str], None]  # (step, what happened)


class LocalFleet(AgentWorkers, FleetClient, StartedInContext):
    store: EtcdStore
    bus: MqttBus
    agent: NodeAgent

    def __init__(self, config: FleetConfig, *, progress: Progress | None = None,
                 admin_token: SecretStr | None = None) -> None:
        self.config = config
        self.cluster = config.cluster
        self.root = config.run_dir / config.cluster
        self.log_dir = self.root / "logs"
        self.keys = Keys(config.cluster)
        self.admin_secret = admin_token or admin_token_for(config)
        self.backend: Backend = make_backend(config.backend, sim=config.sim, vllm=config.vllm, run_dir=config.run_dir)
        self._progress = progress or (lambda _s, _w: None)
        self.etcd: LocalEtcd | None = None
        self.broker: LocalBroker | None = None
        self.etcd_endpoint = config.etcd or ""
        self.mqtt_endpoint = config.mqtt or ""
        # How this fleet's processes reach etcd and the broker (``tls``: what _secure made).
        self.etcd_access: AccessConfig = config.etcd_access
        self.mqtt_access: AccessConfig = config.mqtt_access
        self.state_file = StateFile(state_path(config.run_dir, config.cluster))
        self.routers: list[ServiceProcess] = []
        self.controller: ServiceProcess | None = None
        self.autoscaler: ServiceProcess | None = None
        self.prometheus: LocalPrometheus | None = None
        self._prometheus_plan: LocalPrometheus | None = None  # chosen before the controller starts, started last
        self._targets: asyncio.Task[None] | None = None
        self._http = httpx.AsyncClient(timeout=10.0, trust_env=False)
        # The mark every process this run starts inherits (the command sets it in its own environment, before
        # anything starts): what outlives its parent is still found when the fleet stops.
        self._mark = os.environ.get(RUN_MARK)
        self.left_behind: list[str] = []  # what aclose() found still running, and killed
        self.adopted: list[str] = []  # the servers of ``attach:`` (registered once they answer)
        self._lock: int | None = None  # the run folder's lock while this fleet holds it (see _claim)
        self._started_at = time.time()
        self.gpu: GpuHealthSource | None = None  # this host's GPU health source (gpu:), once opened
        self.gpu_choice = GpuChoice("off", "not opened yet")

    @property
    def router_url(self) -> str:
        return self.routers[0].url if self.routers else ""

    @property
    def controller_url(self) -> str:
        return self.controller.url if self.controller is not None else ""

    @property
    def etcd_endpoints(self) -> list[str]:
        return [e for e in self.etcd_endpoint.split(",") if e]

    @property
    def advertise_host(self) -> str:
        """The address other hosts reach this node's workers and adopted servers at (``advertise_host``)."""
        return advertised_host(self.config.host, [e for e in (self.config.etcd or "").split(",") if e],
                               self.config.advertise_host)

    def _specs(self) -> list[WorkerSpec]:
        c = self.config
        advertise = self.advertise_host
        if c.workers and c.host not in WILDCARD and is_local_only(c.host) and not is_local_only(advertise):
            raise ConfigError(f"this node's workers would listen on {c.host}, which only this host reaches, while "
                              f"etcd is on another host (a fleet of several hosts): set host to {advertise} (this "
                              "host's address) or 0.0.0.0", field="host")
        specs = []
        cores = spread_cores(c.workers)
        gpus = self._gpus_of_workers()
        for i in range(c.workers):
            port = ensure_port(c.host, c.worker_base_port + i if c.worker_base_port else 0, name=f"worker {i}")
            role: Role = ("prefill" if i < c.prefill_workers else "decode") if c.prefill_workers else "aggregated"
            specs.append(WorkerSpec(id=f"{c.node}-w{i}", host=c.host, port=port, model=self.backend.model_name,
                                    node=c.node, role=role, cpus=cores[i], gpus=gpus[i],
                                    advertise_host=advertise if advertise != c.host else None))
        return specs

    def _gpus_of_workers(self) -> list[tuple[int, ...]]:
        """Each worker's GPUs (``gpu.per_worker``, in NVML's order). Workers that need a GPU (not simulated) and
        find none left are refused; simulated ones past the host's GPUs run without."""
        c = self.config
        have = len(self.gpu_choice.gpus)
        gpus = assign(c.workers, c.gpu.per_worker if self.gpu is not None else 0, gpus=have)
        short = [i for i, g in enumerate(gpus) if not g]
        if self.gpu is not None and c.gpu.per_worker and short:
            if not self.backend.simulated:
                raise ConfigError(f"{c.workers} {self.backend.name} worker(s) with {c.gpu.per_worker} GPU(s) each "
                                  f"need {c.workers * c.gpu.per_worker} GPUs and this host has {have}: lower "
                                  "workers or gpu.per_worker", field="gpu.per_worker")
            self._progress("gpu", f"{len(short)} simulated worker(s) past this host's {have} GPU(s) run without one")
        return gpus

    def _ensure_model(self) -> None:
        """The vllm backend's default model, the tiny local one, is written on first use."""
        if (tiny := self.backend.tiny_model()) is not None:
            from fleetward.sim.tinymodel import ensure_tiny_model

            ensure_tiny_model(tiny.path, tokenizer=tiny.tokenizer, say=lambda text: self._progress("model", text))
        self.backend.check()

    @property
    def claimed(self) -> bool:
        """Whether this fleet holds its run folder (it started, or is starting, there)."""
        return self._lock is not None

    def _claim(self) -> None:
        """Hold ``<run dir>/<cluster>/fleet.lock`` for the fleet's life, or refuse to start: a live fleet's
        etcd data, state file and admin token are not ours to delete (a failed start's clean-up would). The
        kernel releases the lock when its holder dies, however it dies: nothing stale to clean up."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / "fleet.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").split()
            os.close(fd)
            pid = holder[0] if holder else "?"
            since = (f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(float(holder[1])))}"
                     if len(holder) > 1 else "")
            raise FleetwardError(
                f"a fleet already runs in {self.root} (pid {pid}{since}): stop it first (Ctrl-C in its terminal, "
                f"or kill -TERM {pid}), or start this one with another --cluster or --run-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {self._started_at}\n".encode())
        self._lock = fd

    async def start(self) -> None:
        c = self.config
        self._claim()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.gpu, self.gpu_choice = await asyncio.to_thread(open_source, c.gpu)  # dcgm-exporter: a few tries
        self._progress("gpu", self.gpu_choice.line)
        specs = self._specs()  # fail early on busy worker ports
        if c.tls and c.etcd and c.mqtt:
            raise ConfigError("tls secures the embedded etcd and broker, and both are given (etcd, mqtt): set "
                              "etcd_access and mqtt_access for them instead", field="tls")
        pki = self._pki() if c.tls else None
        if not c.etcd:
            # The embedded etcd holds only this run's state: a previous run's leftovers are stale.
            shutil.rmtree(self.root / "etcd-data", ignore_errors=True)
            self.etcd = LocalEtcd(self.root / "etcd-data", host=c.etcd_host, client_port=c.etcd_port,
                                  tls=pki.server_tls() if pki else None)
            self._progress("etcd", f"starting etcd on {self.etcd.endpoint}" + (" (TLS, auth)" if pki else ""))
            self.etcd.start(self.log_dir)
            await self.etcd.wait_ready()
            self.etcd_endpoint = self.etcd.endpoint
            if pki is not None:
                self.etcd_access = await self._etcd_auth(pki)
        if not c.mqtt:
            password_file = self._broker_passwords(pki) if pki else None
            self.broker = LocalBroker(self.root / "broker", host=c.mqtt_host, port=c.mqtt_port,
                                      tls=pki.server_tls() if pki else None,
                                      password_file=password_file)
            self._progress("broker", f"starting {self.broker.kind} on {self.broker.endpoint}"
                           + (" (TLS, passwords)" if pki else ""))
            self.broker.start(self.log_dir)
            await self.broker.wait_ready()
            self.mqtt_endpoint = self.broker.endpoint
        self.store = EtcdStore(self.etcd_endpoint, access=resolve_access(self.etcd_access, field="etcd_access"))
        await self.store.get(self.keys.root)  # fails with a clear StoreUnavailable if etcd is not there
        self.bus = await MqttBus(self.mqtt_endpoint, c.cluster,
                                 access=resolve_access(self.mqtt_access, field="mqtt_access")).start()
        self._ensure_model()
        self.agent = NodeAgent(store=self.store, bus=self.bus, keys=self.keys, backend=self.backend, node=c.node,
                               log_dir=self.log_dir, lease_ttl=c.lease_ttl_s, supervisor=c.supervisor,
                               worker_env={"FLEETWARD_ADMIN_TOKEN": self.admin_secret.get_secret_value()},
                               worker_host=c.host, admin_token=self.admin_secret.get_secret_value(),
                               advertise_host=self.advertise_host, gpu=self.gpu, gpu_choice=self.gpu_choice,
                               gpu_policy=policy_of(c.gpu), gpus_per_worker=c.gpu.per_worker)
        await self.agent.start()
        self._write_state()
        if c.prometheus.enabled:  # its address first: the controller's fleet page lists its alerts
            rules = Path(str(importlib.resources.files("fleetward.runbooks") / "alerts" / "fleetward.rules.yml"))
            self._prometheus_plan = LocalPrometheus(
                self.root / "prometheus", host=self._host_of(c.prometheus), port=c.prometheus.port,
                scrape_interval_s=c.prometheus.scrape_interval_s, rule_files=(rules,))
        if c.controller:
            await self._start_controller()
        await self.agent.start_workers(specs, progress=lambda w, what: self._progress(w, what))
        if c.attach:
            self.adopted = await publish_attachments(self.store, self.keys, c.attach, c.node,
                                                      signer=AttachSigner(self.admin_secret.get_secret_value()))
            self._progress("attach", f"adopting {len(self.adopted)} server(s) fleetward did not start: "
                           f"{', '.join(self.adopted)}")
        if c.router:
            self._progress("router", "starting the router")
            router = await self.start_router(f"{c.node}-router", port=c.routing.port)
            self._progress("router", f"the router is up on {router.url}")
        if c.autoscale.enabled:
            await self._start_autoscaler()
        if c.prometheus.enabled:
            await self._start_prometheus()
        self._write_state()

    # -- tls: the run's CA, certificates and passwords ------------------------------------------------------

    def _pki(self) -> LocalPki:
        c = self.config
        hosts = dict.fromkeys(("127.0.0.1", "localhost", c.etcd_host, c.mqtt_host, socket.gethostname()))
        self._progress("tls", f"making a CA and certificates in {self.root / 'tls'}")
        return make_local_pki(self.root / "tls", hosts=tuple(hosts))

    def _secret(self, name: str) -> Path:
        """A fresh random password in ``tls/<name>`` (mode 0600)."""
        path = self.root / "tls" / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24))
        return path

    def _client_access(self, pki: LocalPki, password_file: Path) -> AccessConfig:
        return AccessConfig(ca_file=pki.ca_file, cert_file=pki.client_cert_file, key_file=pki.client_key_file,
                            username="fleetward", password_file=password_file)

    async def _etcd_auth(self, pki: LocalPki) -> AccessConfig:
        """etcd's auth on: ``root`` (its password in tls/etcd-root-password, for an operator) and ``fleetward``,
        who may read and write this cluster's keys."""
        assert self.etcd is not None
        access = self._client_access(pki, self._secret("etcd-password"))
        resolved = resolve_access(access, field="etcd_access")
        root = resolve_access(AccessConfig(username="root", password_file=self._secret("etcd-root-password")),
                              field="etcd_access")
        assert resolved.password is not None and root.password is not None
        await enable_auth(self.etcd.endpoint, access=resolved, root_password=root.password, user="fleetward",
                          password=resolved.password, prefix=self.keys.root)
        return access

    def _broker_passwords(self, pki: LocalPki) -> Path:
        password_file = self._secret("mqtt-password")
        self.mqtt_access = self._client_access(pki, password_file)
        password = resolve_access(self.mqtt_access, field="mqtt_access").password
        assert password is not None
        return write_mosquitto_passwords(self.root / "tls" / "mosquitto-passwords",
                                         {"fleetward": password.get_secret_value()})

    def _fleet_yaml(self) -> Path:
        """This fleet's settings as a file, for the router and controller processes (``--config``)."""
        c = self.config
        supervisor = c.supervisor
        if self._prometheus_plan is not None and not supervisor.prometheus_url:
            supervisor = supervisor.model_copy(update={"prometheus_url": self._prometheus_plan.url})
        return write_service_config(self.root / "fleet.yaml", cluster=c.cluster, routing=c.routing,
                                    supervisor=supervisor, autoscale=c.autoscale, backend=c.backend, sim=c.sim,
                                    etcd_access=self.etcd_access, mqtt_access=self.mqtt_access)

    async def _start_autoscaler(self) -> None:
        c = self.config
        host = self._host_of(c.autoscale)
        port = ensure_port(host, c.autoscale.port, name="autoscaler")
        a = c.autoscale
        self._progress("autoscaler", f"starting the autoscaler ({a.policy}, {a.min_workers}-{a.max_workers} workers "
                       f"per pool, TTFT {a.ttft_s:g} s, ITL {a.itl_s * 1000:g} ms, every {a.interval_s:g} s)")
        argv = autoscaler_argv(etcd=self.etcd_endpoint, mqtt=self.mqtt_endpoint, cluster=c.cluster,
                               config=self._fleet_yaml(), host=host, port=port, autoscaler_id=f"{c.node}-autoscaler")
        # Its capacity model may be profiled in the simulator first: a few seconds.
        self.autoscaler = await start_service(
            "autoscaler", argv, url=f"http://{host}:{port}", log_path=self.log_dir / "autoscaler.log",
            env=service_env(admin_token=self.admin_secret.get_secret_value()), timeout=120)

    async def _start_prometheus(self) -> None:
        c = self.config
        prom = self._prometheus_plan
        assert prom is not None
        self._progress("prometheus", f"starting Prometheus on {prom.url} (scraping every "
                       f"{c.prometheus.scrape_interval_s:g} s, the alert rules loaded)")
        writer = TargetsWriter(prom, self.store, self.keys)
        await writer.refresh()
        prom.start(self.log_dir)
        self.prometheus = prom
        await prom.wait_ready()
        self._targets = asyncio.create_task(writer.run(), name="prometheus-targets")

    def _host_of(self, section: RouterConfig | SupervisorConfig | AutoscaleConfig | PrometheusConfig) -> str:
        """A section's own ``host`` when the file sets it, else the fleet's (``host``, ``--host``)."""
        return section.host if "host" in section.model_fields_set else self.config.host

    async def _start_controller(self) -> None:
        c = self.config
        host = self._host_of(c.supervisor)
        port = ensure_port(host, c.supervisor.port, name="supervisor controller")
        url = f"http://{host}:{port}"
        self._progress("controller", f"starting the supervisor controller on {url}")
        argv = controller_argv(etcd=self.etcd_endpoint, mqtt=self.mqtt_endpoint, cluster=c.cluster,
                               config=self._fleet_yaml(), host=host, port=port, controller_id=f"{c.node}-controller")
        self.controller = await start_service(
            "controller", argv, url=url, log_path=self.log_dir / "controller.log",
            env=service_env(admin_token=self.admin_secret.get_secret_value()))

    async def start_router(self, router_id: str | None = None, *, port: int = 0) -> ServiceProcess:
        """A router process (another replica after the first); returns once it serves."""
        c = self.config
        rid = router_id or f"{c.node}-router-{len(self.routers)}"
        host = self._host_of(c.routing)
        port = ensure_port(host, port, name="router")
        argv = router_argv(etcd=self.etcd_endpoint, mqtt=self.mqtt_endpoint, cluster=c.cluster,
                           config=self._fleet_yaml(), host=host, port=port, router_id=rid)
        log_name = "router.log" if not self.routers else f"{rid}.log"
        router = await start_service(rid, argv, url=f"http://{host}:{port}", log_path=self.log_dir / log_name,
                                     env=service_env(admin_token=self.admin_secret.get_secret_value()))
        self.routers.append(router)
        self._write_state()
        return router

    def _router(self, router: RouterRef) -> ServiceProcess:
        for r in self.routers:
            if r.id == router.id:
                return r
        raise KeyError(f"no router {router.id!r} (routers: {[r.id for r in self.routers]})")

    async def stop_router(self, router: RouterRef) -> None:
        r = self._router(router)
        await r.process.stop(grace=self.config.routing.drain_timeout_s + 5)
        self.routers.remove(r)

    def kill_router(self, router: RouterRef) -> None:
        self._router(router).process.kill()

    async def restart_router(self, router: RouterRef, *, timeout: float = 30.0) -> ServiceProcess:
        return await restart_service(self._router(router), timeout=timeout)

    def _reap_marked(self) -> None:
        """Verify that nothing this run started still runs; kill and name whatever does."""
        if not self._mark:
            return
        left = marked_processes(self._mark)
        if not left:
            return
        for p in left:
            try:
                self.left_behind.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
            except psutil.Error:
                self.left_behind.append(str(p.pid))
        log.error("%d process(es) outlived their parents; killing them: %s", len(left), "; ".join(self.left_behind))
        kill_tree(left)

    def _write_state(self) -> None:
        token_file = self.config.admin_token_file or self.root / "admin-token"
        if not token_file.exists():
            write_admin_token(token_file, self.admin_secret.get_secret_value())
        self.state_file.data = {
            "cluster": self.config.cluster,
            "etcd": self.etcd_endpoint,
            "mqtt": self.mqtt_endpoint,
            "etcd_access": self.etcd_access.model_dump(mode="json", exclude_defaults=True),
            "mqtt_access": self.mqtt_access.model_dump(mode="json", exclude_defaults=True),
            "pid": os.getpid(),
            "started_at": self._started_at,
            "logs": str(self.log_dir),
            "admin_token_file": str(token_file),
            "node": self.config.node,
            "backend": self.backend.name,
            "router": self.router_url,
            "controller": self.controller_url,
            "dashboard": f"{self.controller_url}/" if self.controller_url else None,
            "prometheus": self.prometheus.url if self.prometheus is not None else None,
            "workers": {wid: h.url for wid, h in (self.agent.handles.items() if "agent" in vars(self) else [])},
        }
        self.state_file.write()

    # -- the Fleet handle (the rest comes from AgentWorkers and FleetClient) ------------------------------

    def admin_bearer(self) -> str:
        return self.admin_secret.get_secret_value()

    async def ensure_serving(self, worker: str, *, timeout: float = 60.0) -> None:
        await fleet_handle.ensure_serving(self, worker, restarting=self.agent.is_restarting, timeout=timeout)

    @property
    def supervised(self) -> bool:
        return self.controller is not None and self.controller.is_running

    async def restore(self, *, workers: Sequence[str] | None = None, timeout: float = 120.0) -> dict[str, Any]:
        return await fleet_handle.restore(self, workers=workers, timeout=timeout, restarting=self.agent.is_restarting)

    # -- stopping ---------------------------------------------------------------------------------------

    async def _give_up_attached(self) -> None:
        """``attach_lifetime: agent``: the servers this agent published are given up (their workers' records
        go) and their ``attach/`` entries deleted, so a pod that is gone leaves no dead worker behind."""
        adopter = self.agent.adopter
        for wid in self.adopted:
            with contextlib.suppress(StoreError):
                await self.store.delete(self.keys.attached(wid))  # first: the leader then forgets, not buries, it
            # The agent's own watch gives it up too, but the agent stops next and would cut that short.
            await adopter.give_up(wid)
        self.adopted = []

    async def aclose(self) -> None:
        if self._targets is not None:
            self._targets.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._targets
            self._targets = None
        if self.prometheus is not None:
            await self.prometheus.stop()
            self.prometheus = None
        if self._prometheus_plan is not None:  # chosen but never started (a start-up that failed before it)
            self._prometheus_plan.release_port()
        if self.autoscaler is not None:  # first: it must not start or retire workers while the fleet stops
            await self.autoscaler.process.stop(grace=5)
            self.autoscaler = None
        for router in reversed(self.routers):
            await router.process.stop(grace=self.config.routing.drain_timeout_s + 5)
        self.routers.clear()
        if self.controller is not None:
            await self.controller.process.stop(grace=5)
            self.controller = None
        if "agent" in vars(self):
            try:
                if self.config.attach_lifetime == "agent":
                    await self._give_up_attached()
                await self.agent.aclose()
            except Exception:
                log.exception("stopping the node agent failed; stopping the rest")
            del self.agent
        if self.gpu is not None:
            self.gpu.close()
            self.gpu = None
        if "bus" in vars(self):
            await self.bus.aclose()
            del self.bus
        if "store" in vars(self):
            await self.store.aclose()
            del self.store
        await self._http.aclose()
        if self.broker is not None:
            await self.broker.stop()
            self.broker = None
        if self.etcd is not None:
            await self.etcd.stop()
            self.etcd = None
        self._reap_marked()
        if self._lock is None:
            return  # another fleet runs here: its files are not ours
        self.state_file.remove()
        if self.config.admin_token_file is None:
            with contextlib.suppress(FileNotFoundError):
                (self.root / "admin-token").unlink()
        os.close(self._lock)  # releases the lock
        self._lock = None


_: type[Fleet] = LocalFleet  # mypy checks that the local fleet is a Fleet
