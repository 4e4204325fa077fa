"""The agent as a Kubernetes sidecar, as processes: what a shared process namespace shows it, and the kubelet.

In a vLLM pod with ``shareProcessNamespace: true`` the agent container sees the server's processes as
children of something it did not start, and the server's container is restarted by the kubelet when its
process exits. Here the kubelet is a process that starts the simulated server again whenever it exits
(``restartPolicy: Always``); the agent finds the server by a match over command lines (``process.match``,
what `fleetward deploy kubernetes` writes) and restarts it by ending its tree (``restart_by_exit``). The
kubelet stand-in is never touched: only the server's own processes end.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest_asyncio

from fleetward.chaos.harness import TestFleet
from fleetward.fleet.config import AttachConfig, RouterConfig, SimConfig, SupervisorConfig
from fleetward.fleet.procs import ManagedProcess, free_port, is_gone, pid_matching
from fleetward.fleet.registry import read_fleet

SIM = SimConfig(decode_step_ms=5.0, decode_ms_per_seq=0.05, prefill_ms_per_token=0.01, seed=11)
SUPERVISOR = SupervisorConfig(restart_budget=1000, backoff_initial_s=0.05, backoff_max_s=0.2)

# The kubelet of one container: start the server, and start it again each time it exits.
KUBELET = """
import subprocess, sys
port, config = sys.argv[1:]
while True:
    subprocess.run([sys.executable, "-m", "fleetward.sim.server", "--port", port, "--config-json", config],
                   stdin=subprocess.DEVNULL)
"""


class Pod:
    """One vLLM pod's server under its kubelet stand-in, and the attach entry its sidecar's fleet file has."""

    def __init__(self, root: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.match = rf"fleetward\.sim\.server --port {self.port}\b"
        self.kubelet = ManagedProcess("kubelet stand-in", [sys.executable, "-c", KUBELET, str(self.port),
                                                           SIM.model_dump_json()], log_path=root / "pod.log")

    @property
    def entry(self) -> AttachConfig:
        return AttachConfig(url=self.url, process={"match": self.match}, restart_by_exit=True)

    @property
    def server(self) -> psutil.Process | None:
        pid = pid_matching(self.match)
        return psutil.Process(pid) if pid else None


@pytest_asyncio.fixture
async def pod(tmp_path: Path) -> AsyncIterator[Pod]:
    pod = Pod(tmp_path)
    pod.kubelet.start()
    try:
        yield pod
    finally:
        await pod.kubelet.stop(grace=5)  # the stand-in and the server it runs


@pytest_asyncio.fixture
async def sidecar(tmp_path: Path, etcd_endpoint: str, broker_endpoint: str, cluster: str, pod: Pod,
                  wait_until: Any) -> AsyncIterator[TestFleet]:
    async def serving() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            async with httpx.AsyncClient(timeout=2) as client:
                return (await client.get(pod.url + "/health")).status_code == 200
        return False

    await wait_until(serving, timeout=60, message="the pod's server serves")
    fleet = TestFleet(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster=cluster, run_dir=tmp_path / "fleet",
                      workers=0, attach=[pod.entry], supervisor=SUPERVISOR, routing=RouterConfig(stall_floor_s=0.5),
                      node="vllm-7d4b9-x2kq")
    try:
        await fleet.start()
        await fleet.wait_healthy(timeout=60)
        yield fleet
    finally:
        await fleet.aclose()


async def health(fleet: TestFleet, worker: str) -> tuple[str, str]:
    h = (await read_fleet(fleet.store, fleet.keys)).health.get(worker)
    return (h.state.value, h.reason) if h is not None else ("none", "")


async def comes_back(fleet: TestFleet, pod: Pod, old: psutil.Process, kubelet_pid: int, wait_until: Any) -> None:
    """The server runs again as a new process the kubelet started, adopted and ready; the kubelet untouched."""
    await wait_until(lambda: (p := pod.server) is not None and p.pid != old.pid, timeout=60,
                     message="the kubelet stand-in started the server again")
    await fleet.wait_healthy(timeout=60)
    worker = fleet.worker_ids[0]
    assert fleet.processes(worker)[0].pid == pod.server.pid, "the new process is the one watched"  # type: ignore[union-attr]
    assert is_gone(old)
    assert pod.kubelet.pid == kubelet_pid and pod.kubelet.is_running, "only the server's own tree ended"


async def test_the_sidecar_finds_the_server_by_its_command_line_and_restarts_a_frozen_one_by_ending_it(
        sidecar: TestFleet, pod: Pod, wait_until: Any) -> None:
    fleet = sidecar
    worker = fleet.worker_ids[0]
    assert worker == f"vllm-7d4b9-x2kq-127-0-0-1-{pod.port}", "named after its pod"
    server, kubelet_pid = pod.server, pod.kubelet.pid
    assert server is not None and kubelet_pid is not None
    assert server.pid != kubelet_pid and server.ppid() == kubelet_pid, "the server, not what runs it"
    assert fleet.processes(worker)[0].pid == server.pid, "its process is watched"
    server.send_signal(signal.SIGSTOP)
    try:
        async def frozen() -> bool:
            state, reason = await health(fleet, worker)
            return state in ("unhealthy", "restarting") and "stopped" in reason

        await wait_until(frozen, timeout=30, message="the engine-frozen detector saw the stopped process")
        await comes_back(fleet, pod, server, kubelet_pid, wait_until)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            server.send_signal(signal.SIGCONT)


async def test_a_killed_server_is_restarted_by_its_kubelet_and_adopted_again(
        sidecar: TestFleet, pod: Pod, wait_until: Any) -> None:
    fleet = sidecar
    server, kubelet_pid = pod.server, pod.kubelet.pid
    assert server is not None and kubelet_pid is not None
    server.kill()
    await comes_back(fleet, pod, server, kubelet_pid, wait_until)


async def test_the_sidecar_is_not_ready_once_the_autoscaler_retired_its_worker(sidecar: TestFleet,
                                                                               wait_until: Any) -> None:
    """``/ready`` (the sidecar's readiness probe): 503 once the autoscaler's drain of the worker is over, so a
    Deployment scaled down deletes this pod first; ready again once undrained. An operator's drain leaves the
    pod Ready: the Kubernetes actuator does not count it, so a scale-down must not take it instead."""
    fleet = sidecar
    worker = fleet.worker_ids[0]
    ready = fleet.agent.metrics_url + "/ready"
    async with httpx.AsyncClient(timeout=5) as client:
        async def answers(code: int) -> bool:
            r = await client.get(ready)
            return r.status_code == code and (code == 200 or worker in r.text)

        async def drained() -> bool:
            h = (await read_fleet(fleet.store, fleet.keys)).health.get(worker)
            return (h is not None and h.state.value == "draining" and bool(h.extra.get("cordoned"))
                    and (h.extra.get("drain") or {}).get("deadline") is None)

        assert await answers(200)
        (await fleet.supervisor_command(worker, "drain", {"deadline_s": 1, "then": "cordon"})).raise_for_status()
        await wait_until(drained, timeout=20, message="the operator's drain is over")
        assert await answers(200), "an operator's cordon keeps the pod Ready"
        (await fleet.supervisor_command(worker, "undrain")).raise_for_status()
        await fleet.wait_healthy(timeout=30)

        retire = {"deadline_s": 1, "then": "cordon", "by": "autoscaler"}
        (await fleet.supervisor_command(worker, "drain", retire)).raise_for_status()
        await wait_until(lambda: answers(503), timeout=20, message="the retired worker's pod reads NotReady")
        (await fleet.supervisor_command(worker, "undrain")).raise_for_status()
        await wait_until(lambda: answers(200), timeout=20, message="undrained, it is ready again")
