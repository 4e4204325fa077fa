"""A fleet spread over the hosts of a :class:`~fleetward.chaos.hostnet.HostNetwork`: every part a process on
its host's network, as on a fleet of machines.

=============== ==================================================================================================
etcd            a 3-member cluster, one member on each of the first three hosts (one member with fewer hosts),
                ``<host address>:2379``; every process is given every member
broker          Mosquitto on ``h0``, port 1883
agents          one per host (``node`` = the host's name), each starting its simulated workers on its address
controllers     ``controllers`` of them, on hosts ``h1``, ``h2``, ... (port 9300): a leader and standbys
routers         ``routers`` of them, on ``h0``, ``h1``, ... (port 8000)
autoscaler      with ``autoscale``: one, on the last host (port 9400)
=============== ==================================================================================================

Nothing in the product knows it runs in a namespace: each process is ``ip netns exec <host> fleetward ...``
with the same flags and fleet file as on a machine of its own. :attr:`HostsFleet.placement` says which host
runs which service (the distributed checkers attribute writes by it); :meth:`HostsFleet.state` is what
``fleetward up`` writes to ``fleet.json``, so that :class:`~fleetward.chaos.attached.AttachedFleet` and the
operator commands (run in the clients' namespace) work on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from fleetward.chaos.attached import AttachedFleet
from fleetward.chaos.faults.control import etcd_status
from fleetward.chaos.hostnet import HostNetwork
from fleetward.fleet.backends import Backend, SimBackend
from fleetward.fleet.config import AutoscaleConfig, RouterConfig, SupervisorConfig
from fleetward.fleet.errors import ConfigError
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.handle import StartedInContext
from fleetward.fleet.infra import LocalBroker, LocalEtcd
from fleetward.fleet.keys import Keys
from fleetward.fleet.launch import (
    ServiceProcess,
    agent_argv,
    autoscaler_argv,
    controller_argv,
    router_argv,
    service_env,
    start_service,
    write_service_config,
)
from fleetward.fleet.procs import ManagedProcess, is_the_process, tree_of
from fleetward.fleet.registry import read_fleet, read_leader

__all__ = ["PORTS", "HostsFleet", "HostsView"]

PORTS = {"etcd": 2379, "etcd-peer": 2380, "broker": 1883, "router": 8000, "controller": 9300, "autoscaler": 9400}


class HostsFleet(StartedInContext):
    """The multi-host fleet (see the module docstring); an async context manager that stops it all."""

    def __init__(self, net: HostNetwork, *, cluster: str, run_dir: Path, backend: Backend, workers_per_host: int = 1,
                 routers: int = 2, controllers: int = 2, autoscale: AutoscaleConfig | None = None,
                 routing: RouterConfig | None = None, supervisor: SupervisorConfig | None = None,
                 lease_ttl_s: int = 3, say: Callable[[str], None] = lambda _: None) -> None:
        if not isinstance(backend, SimBackend):
            raise ConfigError(f"a fleet of several hosts runs simulated workers, not {backend.name}",
                              field="fleet.backend")
        self.net = net
        self.cluster = cluster
        self.keys = Keys(cluster)
        self.root = run_dir
        self.log_dir = run_dir / "logs"
        self.backend = backend
        self.workers_per_host = workers_per_host
        self.n_routers = routers
        self.n_controllers = controllers
        self.autoscale = autoscale
        self.routing = routing or RouterConfig()
        self.supervisor = supervisor or SupervisorConfig()
        self.lease_ttl_s = lease_ttl_s
        self.say = say
        self.admin_token = secrets.token_urlsafe(24)
        self.etcd_cluster: list[LocalEtcd] = []
        self.broker_impl: LocalBroker | None = None
        self.agents: dict[str, ManagedProcess] = {}
        self.services: dict[str, ServiceProcess] = {}
        self.placement: dict[str, str] = {}  # service id (agent:<node> for agents) -> host
        self._config: Path | None = None
        self._store_client: EtcdStore | None = None  # made on first use: the members are known once started

    # -- where things are

    @property
    def hosts(self) -> list[str]:
        return [h.name for h in self.net.hosts]

    @property
    def etcd_endpoint(self) -> str:
        return ",".join(m.endpoint for m in self.etcd_cluster)

    @property
    def mqtt_endpoint(self) -> str:
        assert self.broker_impl is not None
        return self.broker_impl.endpoint

    def etcd_member(self, name: str) -> LocalEtcd:
        for m in self.etcd_cluster:
            if m.name == name:
                return m
        raise KeyError(f"no etcd member {name!r} (members: {', '.join(m.name for m in self.etcd_cluster)})")

    def host_of(self, service: str) -> str:
        return self.placement[service]

    async def service_ports(self, service: str) -> dict[str, list[int]]:
        """Which hosts serve ``service`` (etcd, broker, router, controller, autoscaler, workers) on which ports."""
        if service == "workers":
            fleet = await read_fleet(self._store(), self.keys)
            out: dict[str, list[int]] = {}
            for rec in fleet.workers.values():
                host = self.net.host(rec.url.split("//")[-1].rsplit(":", 1)[0]).name
                out.setdefault(host, []).append(int(rec.url.rsplit(":", 1)[1].split("/")[0]))
            return out
        port = PORTS[service]
        hosts = {h for s, h in self.placement.items() if s.startswith(f"{service}-") or s == service}
        return {h: [port] for h in sorted(hosts)}

    async def etcd_leader_host(self) -> str | None:
        """The host whose member leads the etcd cluster, as the members that answer say."""
        statuses = {m.name: await etcd_status(m.endpoint) for m in self.etcd_cluster}
        for m in self.etcd_cluster:
            s = statuses.get(m.name)
            if s is not None and s["leader"] not in ("", "0") and s["leader"] == s["member_id"]:
                return self.placement[m.name]
        return None

    async def supervisor_leader_host(self) -> str | None:
        """The host of the supervisor controller that leads, as etcd's election says."""
        leader = await read_leader(self._store(), self.keys)
        return None if leader is None else self.placement.get(leader.id)

    def state(self) -> dict[str, Any]:
        """What ``fleetward up`` writes to ``fleet.json`` (for :class:`AttachedFleet` and operator commands)."""
        router = self.services.get("router-0")
        controller = next((s for k, s in self.services.items() if k.startswith("controller-")), None)
        return {"cluster": self.cluster, "etcd": self.etcd_endpoint, "mqtt": self.mqtt_endpoint,
                "logs": str(self.log_dir), "node": self.hosts[0], "backend": self.backend.name,
                "router": router.url if router else None, "controller": controller.url if controller else None,
                "hosts": {h.name: h.address for h in self.net.nodes}, "placement": dict(self.placement),
                "namespaces": {h.name: h.ns for h in self.net.nodes}}

    # -- life

    def _store(self) -> EtcdStore:
        if self._store_client is None:
            self._store_client = EtcdStore(self.etcd_endpoint, attempts=5, retry_budget_s=10.0)
        return self._store_client

    def _env(self) -> dict[str, str]:
        return service_env(admin_token=self.admin_token)

    async def start(self) -> None:
        net, hosts = self.net, self.net.hosts
        self.log_dir.mkdir(parents=True, exist_ok=True)
        members = hosts[:3] if len(hosts) >= 3 else hosts[:1]
        initial = ",".join(f"etcd-{i}=http://{h.address}:{PORTS['etcd-peer']}" for i, h in enumerate(members))
        self.say(f"starting etcd on {', '.join(h.name for h in members)} and the broker on {hosts[0].name}")
        for i, h in enumerate(members):
            m = LocalEtcd(self.root / f"etcd-{i}", host=h.address, client_port=PORTS["etcd"],
                          peer_port=PORTS["etcd-peer"], name=f"etcd-{i}", initial_cluster=initial,
                          cluster_token=f"fw-{self.cluster}", launcher=tuple(net.exec_argv(h.name, [])))
            self.etcd_cluster.append(m)
            self.placement[m.name] = h.name
            m.start(self.log_dir)
        self.broker_impl = LocalBroker(self.root / "broker", host=hosts[0].address, port=PORTS["broker"],
                                       launcher=tuple(net.exec_argv(hosts[0].name, [])))
        self.placement["broker"] = hosts[0].name
        self.broker_impl.start(self.log_dir)
        await asyncio.gather(*(m.wait_ready(timeout=30) for m in self.etcd_cluster), self.broker_impl.wait_ready())
        self._config = write_service_config(
            self.root / "fleet.yaml", cluster=self.cluster, backend=self.backend.name,
            sim=getattr(self.backend, "config", None), routing=self.routing, supervisor=self.supervisor,
            autoscale=self.autoscale)
        common: dict[str, Any] = {"etcd": self.etcd_endpoint, "mqtt": self.mqtt_endpoint, "cluster": self.cluster,
                  "config": self._config}
        self.say(f"starting an agent with {self.workers_per_host} worker(s) on each of {len(hosts)} hosts")
        for h in hosts:
            argv = agent_argv(**common, workers=self.workers_per_host, node=h.name, run_dir=self.root / h.name,
                              lease_ttl_s=self.lease_ttl_s)
            proc = ManagedProcess(f"agent[{h.name}]", net.exec_argv(h.name, [*argv, "--host", h.address]),
                                  log_path=self.log_dir / f"agent-{h.name}.log", env=self._env())
            self.agents[h.name] = proc.start()
            self.placement[f"agent:{h.name}"] = h.name
        starts = []
        for i in range(self.n_controllers):
            h = hosts[(i + 1) % len(hosts)]
            cid = f"controller-{i}"
            argv = controller_argv(**common, host=h.address, port=PORTS["controller"], controller_id=cid)
            starts.append(self._service(cid, h.name, argv, f"http://{h.address}:{PORTS['controller']}"))
        for i in range(self.n_routers):
            h = hosts[i % len(hosts)]
            rid = f"router-{i}"
            argv = router_argv(**common, host=h.address, port=PORTS["router"], router_id=rid)
            starts.append(self._service(rid, h.name, argv, f"http://{h.address}:{PORTS['router']}"))
        self.say(f"starting {self.n_controllers} controller(s) and {self.n_routers} router(s)")
        await asyncio.gather(*starts)
        if self.autoscale is not None and self.autoscale.enabled:
            h = hosts[-1]
            argv = autoscaler_argv(**common, host=h.address, port=PORTS["autoscaler"], autoscaler_id="autoscaler-0")
            await self._service("autoscaler-0", h.name, argv, f"http://{h.address}:{PORTS['autoscaler']}",
                                timeout=120)

    async def _service(self, sid: str, host: str, argv: list[str], url: str, *, timeout: float = 60) -> None:
        self.placement[sid] = host
        self.services[sid] = await start_service(sid, self.net.exec_argv(host, argv), url=url,
                                                 log_path=self.log_dir / f"{sid}.log", env=self._env(),
                                                 timeout=timeout)

    async def wait_routable(self, timeout: float = 120.0) -> None:
        """Until every host's workers are routable (registered and ready)."""
        want = len(self.net.hosts) * self.workers_per_host
        async with asyncio.timeout(timeout):
            # Polling etcd: the workers' readiness is other processes' state.
            while len((await read_fleet(self._store(), self.keys)).routable()) < want:  # noqa: ASYNC110
                await asyncio.sleep(0.2)

    async def restart_broker(self) -> None:
        assert self.broker_impl is not None
        await self.broker_impl.stop()
        self.broker_impl.start(self.log_dir)
        await self.broker_impl.wait_ready()

    async def aclose(self) -> None:
        """Stop everything: the services, the agents (they stop their workers), then the broker and etcd."""
        for s in reversed(list(self.services.values())):
            with contextlib.suppress(Exception):
                await s.process.stop(grace=3)
        await asyncio.gather(*(p.stop(grace=5) for p in self.agents.values()), return_exceptions=True)
        if self._store_client is not None:
            await self._store_client.aclose()
        if self.broker_impl is not None:
            with contextlib.suppress(Exception):
                await self.broker_impl.stop()
        for m in self.etcd_cluster:
            with contextlib.suppress(Exception):
                await m.stop()


class HostsView(AttachedFleet):
    """The multi-host fleet as the runner and its faults act on it: through its etcd, broker and admin token, as
    an attached fleet, except that its workers' processes are this run's (the hosts share one pid space), so
    the faults that look at them (``process.hang``'s silent switch) apply. Killing and restarting stay the
    agents' business."""

    def processes(self, worker: str) -> list[psutil.Process]:
        rec = self.records.get(worker)
        tree = tree_of(rec.pid) if rec is not None and rec.pid else []
        # A pid read from etcd is acted on only if it is the process the record was written for.
        return tree if rec is not None and tree and is_the_process(tree[0], started_by=rec.started_at) else []
