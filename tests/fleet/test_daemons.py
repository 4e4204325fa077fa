"""A production install: the three daemons from one YAML file and a token file, beside servers someone else
runs, and `fleetward worker add|remove` at run time. Processes, flags and files as docs/deploy.md says."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest_asyncio
import yaml

from fleetward.fleet.config import SimConfig, load_fleet_config
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.launch import fleetward_argv, start_service
from fleetward.fleet.procs import ManagedProcess, free_port, is_gone
from fleetward.fleet.registry import read_fleet
from fleetward.fleet.signing import AttachSigner

ROOT = Path(__file__).resolve().parents[2]
SIM = SimConfig(decode_step_ms=3.0, seed=3)


def test_the_example_fleet_file_is_valid() -> None:
    config = load_fleet_config(ROOT / "deploy" / "fleet.example.yaml")
    assert config.workers == 0 and len(config.attach) == 2
    assert config.attach[0].restart_command == ("systemctl", "restart", "vllm@0.service")
    for unit in ("agent", "controller", "router", "autoscaler"):
        text = (ROOT / "deploy" / "systemd" / f"fleetward-{unit}.service").read_text()
        assert f"fleetward {unit} --config /etc/fleetward/fleet.yaml" in text


class Install:
    def __init__(self, root: Path, etcd: str, mqtt: str, cluster: str, servers: list[Any], **more: Any) -> None:
        self.root = root
        self.cluster = cluster
        self.etcd = etcd
        self.token_file = root / "admin-token"
        self.token_file.write_text("daemon-test-token\n")
        self.token_file.chmod(0o600)
        self.router_port, self.control_port = free_port(), free_port()
        self.config = root / "fleet.yaml"
        self.config.write_text(yaml.safe_dump({
            "cluster": cluster, "etcd": etcd, "mqtt": mqtt, "admin_token_file": str(self.token_file),
            "run_dir": str(root / "state"), "workers": 0, "node": "host-a",
            "attach": [{"url": servers[0].url, "id": "gpu0", "process": {"pidfile": str(servers[0].pidfile)},
                        "restart_command": servers[0].command}],
            "routing": {"port": self.router_port}, "supervisor": {"port": self.control_port}, **more}))
        self.daemons: list[ManagedProcess] = []

    @property
    def router(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    async def start(self) -> None:
        env = {"PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1"}
        for name, url in (("controller", f"http://127.0.0.1:{self.control_port}"), ("router", self.router)):
            svc = await start_service(name, fleetward_argv(name, "--config", str(self.config)), url=url,
                                      log_path=self.root / f"{name}.log", env=env)
            self.daemons.append(svc.process)
        agent = ManagedProcess("agent", fleetward_argv("agent", "--config", str(self.config)),
                               log_path=self.root / "agent.log", env=env).start()
        self.daemons.append(agent)

    async def stop(self) -> None:
        for d in reversed(self.daemons):
            await d.stop(grace=30)

    def cli_with_fleet_file(self, *args: str) -> subprocess.CompletedProcess[str]:
        """A command that finds the cluster (etcd, cluster, admin token) through FLEETWARD_CONFIG alone."""
        return subprocess.run(fleetward_argv(*args), capture_output=True, text=True, timeout=120, cwd=self.root,
                              env={**os.environ, "PYTHONSAFEPATH": "1", "FLEETWARD_CONFIG": str(self.config)})

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(fleetward_argv(*args, "--etcd", self.etcd, "--cluster", self.cluster),
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONSAFEPATH": "1"})


@pytest_asyncio.fixture
async def install(tmp_path: Path, etcd_endpoint: str, broker_endpoint: str, cluster: str,
                  outside_servers: Any) -> AsyncIterator[tuple[Install, list[Any]]]:
    servers = outside_servers(2, SIM)
    inst = Install(tmp_path, etcd_endpoint, broker_endpoint, cluster, servers)
    await inst.start()
    try:
        yield inst, servers
    finally:
        await inst.stop()


async def test_three_daemons_from_one_file_protect_servers_they_did_not_start(
        install: tuple[Install, list[Any]], wait_until: Any) -> None:
    inst, servers = install
    keys = Keys(inst.cluster)
    async with EtcdStore(inst.etcd) as store:
        async def ready(worker: str) -> bool:
            h = (await read_fleet(store, keys)).health.get(worker)
            return h is not None and h.state.value == "ready"

        await wait_until(lambda: ready("gpu0"), timeout=60, message="gpu0 adopted and canaried")
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.post(f"{inst.router}/v1/completions",
                                  json={"model": SIM.model_name, "prompt": [40, 41], "max_tokens": 5})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5

        # A second server at run time, on the agent's node; then given up again.
        added = inst.cli("worker", "add", servers[1].url, "--node", "host-a", "--id", "gpu1")
        assert added.returncode == 0, added.stderr
        assert "gpu1: adopted" in added.stdout and "drained and left for an operator" in added.stdout
        await wait_until(lambda: ready("gpu1"), timeout=60, message="gpu1 adopted at run time")
        removed = inst.cli("worker", "remove", "gpu1")
        assert removed.returncode == 0 and "keeps running" in removed.stdout, removed.stderr
        assert "gpu1" not in (await read_fleet(store, keys)).workers
        unknown = inst.cli("worker", "remove", "nobody")
        assert unknown.returncode == 2 and "not a server fleetward adopted" in unknown.stderr
        # A restart command is signed with the admin token (agents run no other), so it needs the token.
        command = ["--restart-command", "systemctl restart vllm@1", "--wait", "0"]
        unsigned = inst.cli("worker", "add", servers[1].url, "--node", "host-a", "--id", "gpu1", *command)
        assert unsigned.returncode == 2 and "signed" in unsigned.stderr, unsigned.stderr
        assert await store.get(keys.attached("gpu1")) is None, "nothing written"
        signed = inst.cli("worker", "add", servers[1].url, "--node", "host-a", "--id", "gpu1", *command,
                          "--admin-token-file", str(inst.token_file))
        assert signed.returncode == 0, signed.stderr
        record = orjson.loads((await store.get(keys.attached("gpu1"))).value)  # type: ignore[union-attr]
        assert AttachSigner(inst.token_file.read_text().strip()).signed("gpu1", record)
        assert inst.cli("worker", "remove", "gpu1").returncode == 0

        # The operator's commands take the token from a file.
        drained = inst.cli("drain", "gpu0", "--admin-token-file", str(inst.token_file))
        assert drained.returncode == 0, drained.stderr
        # Or everything from the cluster's fleet file, named once in the environment.
        status = inst.cli_with_fleet_file("status", "--json")
        assert status.returncode == 0 and "gpu0" in status.stdout, status.stderr
        undrained = inst.cli_with_fleet_file("undrain", "gpu0")
        assert undrained.returncode == 0, undrained.stderr
    await inst.stop()
    assert all(not is_gone(s.process) for s in servers), "stopping the daemons leaves the servers running"


def test_an_agent_whose_workers_would_listen_on_loopback_in_a_fleet_of_several_hosts_is_refused(
        tmp_path: Path) -> None:
    """etcd on another host means routers on other hosts: workers on 127.0.0.1 would be unreachable."""
    r = subprocess.run(fleetward_argv("agent", "--etcd", "10.255.0.1:2379", "--mqtt", "10.255.0.1:1883",
                                      "--workers", "1", "--run-dir", str(tmp_path)),
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert r.returncode == 2 and "which only this host reaches" in r.stderr and "0.0.0.0" in r.stderr, r.stderr


def test_config_check_validates_a_fleet_file_as_the_daemons_read_it(tmp_path: Path) -> None:
    token = tmp_path / "admin-token"
    token.write_text("t0ken\n")
    token.chmod(0o600)
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"cluster: prod\netcd: 10.0.0.1:2379\nmqtt: 10.0.0.1:1883\nadmin_token_file: {token}\n"
                     "workers: 0\nattach:\n  - url: http://127.0.0.1:8000\n")
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    ok = subprocess.run(fleetward_argv("config", "check", str(fleet)), capture_output=True, text=True, timeout=60,
                        env=env)
    assert ok.returncode == 0 and "valid" in ok.stdout and "advertise_host" in ok.stdout, ok.stdout + ok.stderr
    token.chmod(0o644)
    bad = subprocess.run(fleetward_argv("config", "check", str(fleet)), capture_output=True, text=True, timeout=60,
                         env=env)
    assert bad.returncode == 2 and "readable by others" in bad.stderr, bad.stderr
    fleet.write_text("cluster: prod\nworkers: -1\n")
    bad = subprocess.run(fleetward_argv("config", "check", str(fleet)), capture_output=True, text=True, timeout=60,
                         env=env)
    assert bad.returncode == 2 and f"{fleet}:2: workers" in bad.stderr, bad.stderr


def test_a_token_file_readable_by_others_is_refused(tmp_path: Path, etcd_endpoint: str,
                                                    broker_endpoint: str) -> None:
    token = tmp_path / "admin-token"
    token.write_text("t\n")
    token.chmod(0o644)
    r = subprocess.run(fleetward_argv("controller", "--etcd", etcd_endpoint, "--mqtt", broker_endpoint,
                                      "--admin-token-file", str(token)),
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert r.returncode == 2 and "readable by others (chmod 600 it)" in r.stderr, r.stderr



async def test_up_with_no_workers_of_its_own_adopts_the_servers_of_its_file(
        tmp_path: Path, outside_servers: Any, wait_until: Any) -> None:
    """The README's path beside servers one started oneself: `fleetward up --config f.yaml` with `workers: 0`
    and `attach:`; a request through its router reaches them; Ctrl-C leaves them running, and nothing of
    fleetward's."""
    servers = outside_servers(2, SIM)
    config = tmp_path / "beside.yaml"
    config.write_text(yaml.safe_dump({"workers": 0, "attach": [
        {"url": s.url, "process": {"pidfile": str(s.pidfile)}} for s in servers]}))
    env = {"PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1"}
    up = ManagedProcess("fleetward up", fleetward_argv("up", "--config", str(config), "--run-dir", str(tmp_path),
                                                       "--cluster", "beside"),
                        log_path=tmp_path / "up.log", env=env).start()
    try:
        def router() -> str | None:
            for line in up.log_tail(60).splitlines():
                if line.strip().startswith("router "):
                    return line.split()[1]
            return None

        url = await wait_until(router, timeout=90, interval=0.2, message="up prints its router")
        assert "adopted" in up.log_tail(60)

        async def answered() -> bool:
            async with httpx.AsyncClient(timeout=10) as client:
                r = await client.post(f"{url}/v1/completions", json={"model": SIM.model_name, "prompt": [40],
                                                                     "max_tokens": 3})
            return r.status_code == 200

        await wait_until(answered, timeout=60, interval=0.5, message="a request through up's router")
        up.signal(15)
        assert await up.wait_exit() == 0
        assert "no process left behind" in up.log_tail()
        assert all(not is_gone(s.process) for s in servers), "the adopted servers keep running"
    finally:
        await up.stop()


async def test_an_agent_whose_servers_live_and_die_with_it_leaves_no_record_behind(
        tmp_path: Path, etcd_endpoint: str, broker_endpoint: str, cluster: str, outside_servers: Any,
        wait_until: Any) -> None:
    """``attach_lifetime: agent`` (a Kubernetes pod's sidecar, whose pod never comes back): the agent stopped
    gives its server up, and the leader forgets it instead of keeping it as a dead worker. The server runs on."""
    servers = outside_servers(1, SIM)
    inst = Install(tmp_path, etcd_endpoint, broker_endpoint, cluster, servers, attach_lifetime="agent")
    await inst.start()
    keys = Keys(inst.cluster)
    try:
        async with EtcdStore(inst.etcd) as store, httpx.AsyncClient(timeout=10) as client:
            async def known_to_leader() -> bool | None:
                """Whether the leading controller holds gpu0 (None: no answer from a leader)."""
                r = await client.get(f"http://127.0.0.1:{inst.control_port}/v1/workers",
                                     headers={"Authorization": "Bearer daemon-test-token"})
                return "gpu0" in r.json()["workers"] if r.status_code == 200 and r.json()["leader"] else None

            async def ready() -> bool:
                h = (await read_fleet(store, keys)).health.get("gpu0")
                return h is not None and h.state.value == "ready"

            await wait_until(ready, timeout=60, message="gpu0 adopted and canaried")
            await wait_until(known_to_leader, timeout=30, message="the leader holds gpu0")
            agent = inst.daemons.pop()
            agent.signal(signal.SIGTERM)  # once, as the kubelet does when the pod goes
            assert await asyncio.wait_for(agent.wait_exit(), 60) == 0, agent.log_tail()

            async def forgotten() -> bool:
                return await known_to_leader() is False

            await wait_until(forgotten, timeout=30, message="the leader forgot gpu0 (not: keeps it as dead)")
            for key in (keys.attached("gpu0"), keys.worker("gpu0"), keys.health_of("gpu0")):
                assert await store.get(key) is None, key
            assert not (await store.get_prefix(keys.signals + "gpu0/")).items
    finally:
        await inst.stop()
    assert not is_gone(servers[0].process), "given up, not stopped"

