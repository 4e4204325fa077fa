"""Worker backends: how one worker process is started, signalled and stopped.

:class:`WorkerBackend` is the boundary (a handful of methods). Two real backends:

- ``sim``: the simulated worker (``python -m fleetward.fleet.simworker``), one process;
- ``vllm``: real vLLM (``python -m vllm.entrypoints.openai.api_server``), a tree of three processes:
  the API server, ``VLLM::EngineCore`` and ``VLLM::Worker``. :meth:`WorkerHandle.engine_processes`
  finds the engine so faults and detectors can target it (SIGSTOP on it is vLLM's silent hang).

Workers started by someone else are not launched here; they are registered by URL only.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx
import psutil

from fleetward.fleet.config import SimConfig, VllmConfig
from fleetward.fleet.errors import ConfigError
from fleetward.fleet.procs import ManagedProcess
from fleetward.fleet.worker import WorkerSpec

__all__ = ["SimBackend", "VllmBackend", "WorkerBackend", "WorkerHandle", "make_backend", "worker_ready"]


@dataclass
class WorkerHandle:
    """A started worker: its spec, its process and when it started."""

    spec: WorkerSpec
    backend: str
    process: ManagedProcess
    started_at: float = field(default_factory=time.time)

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def bind_url(self) -> str:
        return self.spec.bind_url

    def engine_processes(self) -> list[psutil.Process]:
        """The processes that run the model (vLLM's EngineCore and its workers; the sim's only process)."""
        tree = self.process.tree()
        engines = []
        for p in tree[1:]:
            try:
                name = p.name() + " " + " ".join(p.cmdline()[:1])
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if "EngineCore" in name:
                engines.append(p)
        return engines or tree[:1]


class WorkerBackend(Protocol):
    """Starts and stops worker processes of one kind.

    ``launch`` returns at once with a started process; ``wait_ready`` blocks until the worker answers
    ``/health`` with 200 and lists its model, or raises :class:`~fleetward.fleet.errors.ProcessError`
    (with the log tail) when it exits or times out first.
    """

    name: str

    def launch(self, spec: WorkerSpec, log_dir: Path, env: Mapping[str, str] | None = None) -> WorkerHandle: ...

    async def wait_ready(self, handle: WorkerHandle, *, timeout: float | None = None) -> None: ...

    async def stop(self, handle: WorkerHandle, *, grace: float = 10.0) -> None: ...


async def worker_ready(url: str, *, client: httpx.AsyncClient | None = None) -> bool:
    """True when ``/health`` answers 200 and ``/v1/models`` lists a model."""
    own = client is None
    c = client or httpx.AsyncClient(timeout=2.0)
    try:
        r = await c.get(f"{url}/health")
        if r.status_code != 200:
            return False
        m = await c.get(f"{url}/v1/models")
        return m.status_code == 200 and bool(m.json().get("data"))
    except httpx.HTTPError:
        return False
    finally:
        if own:
            await c.aclose()


class _ProcessBackend:
    name = ""
    start_timeout = 60.0

    def argv(self, spec: WorkerSpec) -> list[str]:
        raise NotImplementedError

    def env(self, spec: WorkerSpec) -> dict[str, str]:
        return {"PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1"}

    nice = 0

    def launch(self, spec: WorkerSpec, log_dir: Path, env: Mapping[str, str] | None = None) -> WorkerHandle:
        proc = ManagedProcess(f"worker {spec.id}", self.argv(spec), log_path=log_dir / f"worker-{spec.id}.log",
                              env={**self.env(spec), **(env or {})}, cwd=log_dir, nice=self.nice)
        proc.start()
        return WorkerHandle(spec, self.name, proc)

    async def wait_ready(self, handle: WorkerHandle, *, timeout: float | None = None) -> None:
        async with httpx.AsyncClient(timeout=2.0) as client:
            async def ready() -> bool:
                return await worker_ready(handle.bind_url, client=client)

            await handle.process.wait_ready(ready, timeout=timeout or self.start_timeout, interval=0.1)

    async def stop(self, handle: WorkerHandle, *, grace: float = 10.0) -> None:
        await handle.process.stop(grace)


class SimBackend(_ProcessBackend):
    """The simulated worker, one process per worker."""

    name = "sim"
    start_timeout = 30.0

    def __init__(self, config: SimConfig) -> None:
        self.config = config

    def argv(self, spec: WorkerSpec) -> list[str]:
        return [sys.executable, "-m", "fleetward.fleet.simworker", "--host", spec.host, "--port", str(spec.port),
                "--model-name", spec.model, "--config-json", self.config.model_dump_json()]


class VllmBackend(_ProcessBackend):
    """Real vLLM through its OpenAI-compatible API server."""

    name = "vllm"

    def __init__(self, config: VllmConfig, model_path: Path) -> None:
        self.config = config
        self.model_path = model_path
        self.start_timeout = config.start_timeout_s
        self.nice = config.nice

    def argv(self, spec: WorkerSpec) -> list[str]:
        c = self.config
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model_path), "--served-model-name", spec.model,
                "--host", spec.host, "--port", str(spec.port),
                "--max-model-len", str(c.max_model_len), "--dtype", c.dtype,
                "--seed", "0"]
        if c.enforce_eager:
            argv.append("--enforce-eager")
        return [*argv, *c.extra_args]

    def env(self, spec: WorkerSpec) -> dict[str, str]:
        return {
            **super().env(spec),
            "VLLM_CPU_KVCACHE_SPACE": str(self.config.kv_cache_space_gib),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }


def make_backend(kind: str, *, sim: SimConfig, vllm: VllmConfig, model_path: Path | None = None) -> WorkerBackend:
    if kind == "sim":
        return SimBackend(sim)
    if kind == "vllm":
        if model_path is None:
            raise ConfigError("the vllm backend needs a model folder", field="vllm.model")
        if not (model_path / "config.json").exists():
            raise ConfigError(f"{model_path} is not a model folder (no config.json); make one with "
                              "`fleetward model tiny --out DIR`", field="vllm.model")
        return VllmBackend(vllm, model_path)
    raise ConfigError(f"unknown backend {kind!r} (sim or vllm)", field="backend")


def describe(handle: WorkerHandle) -> str:
    return json.dumps({"id": handle.spec.id, "url": handle.url, "pid": handle.process.pid})
