"""A local Prometheus (Debian's ``prometheus``) that scrapes a fleet found in etcd and runs the alert rules.

:class:`LocalPrometheus` writes its configuration (scrape interval, the rule files, one file-based service
discovery target file) and runs ``prometheus`` as a :class:`ManagedProcess`. :func:`fleet_targets` turns
what etcd says about a cluster (routers, supervisor controllers, autoscalers, node agents, workers) into
file-SD target groups with ``job`` (router, controller, autoscaler, agent, worker) and ``instance`` (the
service's id) labels;
:class:`TargetsWriter` keeps the targets file current as services come and go (Prometheus re-reads it by
itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import yaml

from fleetward.fleet.errors import ProcessError
from fleetward.fleet.etcd import StateStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.procs import ManagedProcess, ensure_port, reserve_port
from fleetward.fleet.registry import read_fleet

__all__ = ["LocalPrometheus", "TargetsWriter", "fleet_targets", "prometheus_binary"]

log = logging.getLogger(__name__)


def prometheus_binary() -> str:
    found = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)
    if found is None:
        raise ProcessError("no prometheus binary: install Debian's prometheus package (`apt-get install "
                           "prometheus`; `./dev setup` does it as root)", name="prometheus")
    return found


def _hostport(url: str) -> str | None:
    parts = urlparse(url)
    return parts.netloc or None


async def fleet_targets(store: StateStore, keys: Keys) -> list[dict[str, Any]]:
    """File-SD target groups for every service of the cluster that serves ``/metrics``."""
    fleet = await read_fleet(store, keys)
    groups: list[dict[str, Any]] = []

    def add(job: str, instance: str, url: str, **labels: str) -> None:
        target = _hostport(url)
        if target:
            groups.append({"targets": [target], "labels": {"job": job, "instance": instance, **labels}})

    for rid, body in sorted(fleet.routers.items()):
        add("router", rid, str(body.get("url") or ""))
    for election, job in (("supervisor", "controller"), ("autoscaler", "autoscaler")):
        for kv in (await store.get_prefix(keys.leader(election))).items:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                candidate = json.loads(json.loads(kv.value)["candidate"])
                add(job, str(candidate["id"]), str(candidate.get("url") or ""))
    for kv in (await store.get_prefix(keys.agents)).items:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            body = json.loads(kv.value)
            add("agent", str(body["node"]), str(body["url"]))
    for wid, rec in sorted(fleet.workers.items()):
        add("worker", wid, rec.url, node=rec.node, role=rec.role)
    return groups


@dataclass
class LocalPrometheus:
    """One Prometheus on loopback, its data and configuration under ``root``."""

    root: Path
    host: str = "127.0.0.1"
    port: int = 0
    scrape_interval_s: float = 5.0
    rule_files: tuple[Path, ...] = ()
    process: ManagedProcess | None = None
    targets_file: Path = field(init=False)
    # Port 0: the port chosen, held until start(). Its address is given out first (the controller's fleet page
    # lists its alerts) and Prometheus starts last; a port merely found free would be open to any bind or
    # outgoing connection of the fleet starting in between (it happened: "bind: address already in use").
    _reserved: socket.socket | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.port == 0:
            self._reserved = reserve_port(self.host)
            self.port = int(self._reserved.getsockname()[1])
        else:
            self.port = ensure_port(self.host, self.port, name="prometheus")
        self.targets_file = self.root / "targets.json"

    def release_port(self) -> None:
        """Let go of the chosen port (at start, or when it will never start)."""
        if self._reserved is not None:
            self._reserved.close()
            self._reserved = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def write_config(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.targets_file.exists():
            self.write_targets([])
        interval = f"{max(1, round(self.scrape_interval_s * 1000))}ms"
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval,
                       "scrape_timeout": f"{max(1, round(min(self.scrape_interval_s, 10) * 800))}ms"},
            "rule_files": [str(p.resolve()) for p in self.rule_files],
            "scrape_configs": [{
                "job_name": "fleetward",
                "file_sd_configs": [{"files": [str(self.targets_file.resolve())], "refresh_interval": "5s"}],
            }],
        }
        path = self.root / "prometheus.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def write_targets(self, groups: list[dict[str, Any]]) -> None:
        """Replace the targets file at once (Prometheus must never read half of it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups, indent=1))
        os.replace(tmp, self.targets_file)

    def start(self, log_dir: Path) -> ManagedProcess:
        config = self.write_config()
        argv = [prometheus_binary(), f"--config.file={config}", f"--storage.tsdb.path={self.root / 'data'}",
                f"--web.listen-address={self.host}:{self.port}", "--web.enable-lifecycle",
                "--storage.tsdb.retention.time=2d", "--log.level=warn"]
        self.release_port()
        self.process = ManagedProcess("prometheus", argv, log_path=log_dir / "prometheus.log").start()
        return self.process

    async def ready(self) -> bool:
        try:
            async with httpx.AsyncClient(timeout=1.0, trust_env=False) as client:
                return (await client.get(self.url + "/-/ready")).status_code == 200
        except httpx.HTTPError:
            return False

    async def wait_ready(self, timeout: float = 30.0) -> None:
        if self.process is None:
            raise ProcessError("prometheus was never started", name="prometheus")
        await self.process.wait_ready(self.ready, timeout=timeout, interval=0.1)

    async def stop(self) -> None:
        self.release_port()
        if self.process is not None:
            await self.process.stop()


class TargetsWriter:
    """Keeps a Prometheus targets file current with the cluster in etcd (re-read every ``every_s``)."""

    def __init__(self, prometheus: LocalPrometheus, store: StateStore, keys: Keys, *, every_s: float = 2.0) -> None:
        self.prometheus, self.store, self.keys, self.every_s = prometheus, store, keys, every_s
        self._last: list[dict[str, Any]] | None = None

    async def refresh(self) -> list[dict[str, Any]]:
        groups = await fleet_targets(self.store, self.keys)
        if groups != self._last:
            self.prometheus.write_targets(groups)
            self._last = groups
        return groups

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # a failed read keeps the last targets; the next one tries again
                log.warning("prometheus targets not refreshed: %s", exc)
            await asyncio.sleep(self.every_s)
