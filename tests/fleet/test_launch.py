"""The launcher: one place for fleetward's service command lines, their readiness and who leads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fleetward.fleet.errors import ProcessError
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.launch import agent_argv, controller_argv, router_argv, service_env, start_service, wait_leader
from fleetward.fleet.registry import read_leader

COMMON = ["--etcd", "127.0.0.1:2379", "--mqtt", "127.0.0.1:1883", "--cluster", "c"]


def test_command_lines_run_this_interpreters_fleetward() -> None:
    assert router_argv(etcd="127.0.0.1:2379", mqtt="127.0.0.1:1883", cluster="c", port=8080, router_id="r0") == [
        sys.executable, "-m", "fleetward.cli", "router", *COMMON, "--port", "8080", "--id", "r0"]
    assert controller_argv(etcd="127.0.0.1:2379", mqtt="127.0.0.1:1883", cluster="c", config=Path("f.yaml"),
                           controller_id="k") == [
        sys.executable, "-m", "fleetward.cli", "supervisor", "--role", "controller", "--config", "f.yaml", *COMMON,
        "--id", "k"]
    assert agent_argv(etcd="127.0.0.1:2379", mqtt="127.0.0.1:1883", cluster="c", workers=0, lease_ttl_s=3)[3:] == [
        "supervisor", "--role", "agent", *COMMON, "--workers", "0", "--lease-ttl", "3"]


def test_the_admin_token_goes_in_the_environment_never_on_the_command_line() -> None:
    env = service_env(admin_token="s3cret")
    assert env["FLEETWARD_ADMIN_TOKEN"] == "s3cret" and env["PYTHONSAFEPATH"] == "1"
    assert "s3cret" not in " ".join(controller_argv(etcd="e:1", mqtt="m:1", cluster="c"))


async def test_a_service_that_never_serves_fails_with_its_log_and_is_stopped(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import time; print('not serving anything', flush=True); time.sleep(60)"]
    with pytest.raises(ProcessError, match="not serving anything"):
        await start_service("mute", argv, url="http://127.0.0.1:9", log_path=tmp_path / "mute.log", timeout=1.0)


async def test_wait_leader_finds_the_controller_that_leads(store: EtcdStore, keys: Keys) -> None:
    assert await read_leader(store, keys) is None
    from fleetward.fleet.election import Election
    from fleetward.fleet.lease import LeaseKeeper

    lease = await LeaseKeeper(store, 5).start()
    try:
        election = Election(store, keys.leader("supervisor"), candidate='{"id": "c1", "url": "http://x:1"}',
                            lease=lease)
        await election.campaign()
        leader = await wait_leader(store, keys, timeout=5)
        assert (leader.id, leader.url) == ("c1", "http://x:1")
    finally:
        await lease.aclose()


# A service run as a process whose on_ready hook (called once it has started, before uvicorn serves) connects to
# the address the service would advertise, then asks it to stop.
_CONNECT_AT_READY = """
import asyncio, os, signal, socket, sys
from fleetward.fleet.config import RouterConfig, SupervisorConfig
from fleetward.migration.server import serve_router
from fleetward.supervisor.controller import serve_controller

service, etcd, mqtt, cluster = sys.argv[1:]
signal.signal(signal.SIGTERM, lambda *_: None)  # uvicorn raises the SIGTERM it handled again once it has stopped

def connect(url):
    host, _, port = url.removeprefix("http://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        print("accepted", flush=True)
    except ConnectionRefusedError:
        print("refused", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

common = dict(etcd=etcd, mqtt=mqtt, cluster=cluster, on_ready=lambda s: connect(s.url))
if service == "router":
    asyncio.run(serve_router(RouterConfig(host="127.0.0.1", port=0), **common))
else:
    asyncio.run(serve_controller(SupervisorConfig(host="127.0.0.1", port=0), admin_token="t", **common))
"""


@pytest.mark.parametrize("service", ["router", "controller"])
def test_a_service_accepts_connections_on_its_address_before_it_can_advertise_it(
        service: str, etcd_endpoint: str, broker_endpoint: str, cluster: str) -> None:
    """A router registers its URL in etcd (``routers/<id>``) before it serves, and a controller campaigns with
    its URL as soon as it runs: a peer that reads the address must be answered, not refused. A router that
    was refused passed its new peer over for a lease's length and wrote its checkpoints to etcd meanwhile."""
    done = subprocess.run([sys.executable, "-c", _CONNECT_AT_READY, service, etcd_endpoint, broker_endpoint,
                           f"{cluster}-{service}"], capture_output=True, text=True, timeout=120, check=False)
    assert done.stdout.splitlines() == ["accepted"], done.stdout + done.stderr
    assert done.returncode == 0, done.stderr
