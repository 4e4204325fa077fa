"""Worker backends: how one worker process is started, signalled and stopped, and what its workers can do.

:class:`Backend` is the boundary (a handful of methods and capabilities). Code that needs to know what
kind of worker it deals with asks the backend, never compares its name:

- :attr:`~Backend.model_name`, :attr:`~Backend.max_model_len`: what its workers serve;
- :attr:`~Backend.fault_switches`: its workers take ``POST /admin/faults`` (hang, slowdown, wrong tokens,
  ...); only the simulated worker does;
- :meth:`~Backend.reference`: how fault-free output is known without a run (the simulated worker's model
  is a pure function of the prefix), or ``None`` when it must be recorded from a fault-free run;
- :meth:`~Backend.warm_up`: what a fresh worker needs before it serves at full speed (vLLM on a CPU
  compiles kernels on first use of a shape);
- :meth:`~Backend.tiny_model`: the tiny local model its workers serve when the config names none, which the
  caller writes before the first launch (``fleetward model tiny``; the fleet layer does not import the sim);
- of a kind of backend (a class in :data:`BACKENDS`), for the autoscaler: ``default_startup_s``, a worker's
  start-up time when no capacity model says, and ``simulated``, whether its workers are the simulated worker
  the fleet simulator models (a capacity model then needs no measurement).

Two real backends, registered in :data:`BACKENDS` under their names. :data:`BACKENDS` is the one list of
names: the fleet file's and an experiment's ``backend`` (:data:`BackendName`), the ``--backend`` choices of
the commands and the autoscaler read it. To add a backend, write its class and add it there.

- ``sim``: the simulated worker (``python -m fleetward.sim.server``), one process;
- ``vllm``: real vLLM (``python -m vllm.entrypoints.openai.api_server``), a tree of three processes:
  the API server, ``VLLM::EngineCore`` and ``VLLM::Worker``. :meth:`WorkerHandle.engine_processes`
  finds the engine so faults and detectors can target it (SIGSTOP on it is vLLM's silent hang).
  Without a model folder it serves the tiny local model at :meth:`VllmBackend.default_model_path`
  (written by ``fleetward model tiny``).

Workers started by someone else are not launched here; they are registered by URL only.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple, Protocol

import httpx
import psutil

from fleetward.fleet.errors import ConfigError
from fleetward.fleet.procs import ManagedProcess, WorkerProcess
from fleetward.fleet.vocab import BUILTIN, load_vocabulary
from fleetward.fleet.worker import WorkerSpec

if TYPE_CHECKING:  # the config reads BACKENDS for its backend names, so it is imported here only when used
    from fleetward.fleet.config import SimConfig, VllmConfig

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendName",
    "SimBackend",
    "TinyModel",
    "VllmBackend",
    "WorkerHandle",
    "backend_capabilities",
    "backend_class",
    "make_backend",
    "wait_serving",
    "worker_ready",
]


class TinyModel(NamedTuple):
    """Where the tiny local model a backend serves goes, and its vocabulary (``fleetward model tiny``)."""

    path: Path
    tokenizer: str


@dataclass
class WorkerHandle:
    """A started (or adopted) worker: its spec, its process and when it started."""

    spec: WorkerSpec
    backend: str
    process: WorkerProcess
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


class Backend(Protocol):
    """A kind of worker: how one is started and stopped, and what its workers can do.

    ``launch`` returns at once with a started process (``prefix`` is a launcher put before the worker's
    own command line, which it must end by exec-ing: same pid); ``wait_ready`` blocks until the worker
    answers ``/health`` with 200 and lists its model, or raises
    :class:`~fleetward.fleet.errors.ProcessError` (with the log tail) when it exits or times out first.
    """

    @property
    def name(self) -> str:
        """The backend's name (``sim``, ``vllm``): what ``workers/<id>`` records and configs say."""
        ...

    @property
    def capabilities(self) -> frozenset[str]:
        """What its workers can do: ``fault_switches``, ``model_reference``."""
        ...

    @property
    def simulated(self) -> bool:
        """Whether its workers are the simulated worker (they need no GPU, whatever the host has)."""
        ...

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def fault_switches(self) -> bool: ...

    @property
    def tokenizer(self) -> str | None:
        """Its workers' vocabulary (a built-in name of :mod:`fleetward.fleet.vocab`, or a model folder),
        advertised in ``workers/<id>`` so routers turn token ids into text; None when not known."""
        ...

    @property
    def owns_processes(self) -> bool:
        """Whether its workers are fleetward's to stop (False: servers someone else runs, left running)."""
        ...

    @property
    def can_restart(self) -> bool:
        """Whether a failed worker can be brought back (False: drained and left for an operator)."""
        ...

    def reference(self) -> dict[str, Any] | None: ...

    def tiny_model(self) -> TinyModel | None:
        """The tiny local model its workers serve because the config names no model, for the caller to write
        before the first launch; None when they serve a named model, or a model of their own (the sim)."""
        ...

    def check(self) -> None:
        """Raise :class:`~fleetward.fleet.errors.ConfigError` when workers cannot be launched as configured
        (e.g. the model folder holds no model)."""
        ...

    def launch(self, spec: WorkerSpec, log_dir: Path, env: Mapping[str, str] | None = None, *,
               prefix: Sequence[str] = ()) -> WorkerHandle: ...

    async def wait_ready(self, handle: WorkerHandle, *, timeout: float | None = None) -> None: ...

    async def warm_up(self, url: str) -> None: ...

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


async def wait_serving(handle: WorkerHandle, *, timeout: float, interval: float,
                       progress_cap: float | None = None) -> None:
    """Until the worker answers ``/health`` and lists its model (:func:`worker_ready`), or its process's
    ``wait_ready`` gives up (it exited, or ``timeout`` passed: without progress, with ``progress_cap``)."""
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
        async def ready() -> bool:
            return await worker_ready(handle.bind_url, client=client)

        await handle.process.wait_ready(ready, timeout=timeout, interval=interval, progress_cap=progress_cap)


class _ProcessBackend:
    """What the process-based backends share: argv and environment make the worker, the rest is common."""

    name: ClassVar[str] = ""
    capabilities: ClassVar[frozenset[str]] = frozenset()
    owns_processes: ClassVar[bool] = True
    can_restart: ClassVar[bool] = True
    default_startup_s: ClassVar[float] = 60.0  # a worker's start-up, for the autoscaler when nothing measured it
    simulated: ClassVar[bool] = False  # the simulated worker: the fleet simulator models its capacity
    start_timeout = 60.0
    nice = 0

    def argv(self, spec: WorkerSpec) -> list[str]:
        raise NotImplementedError

    def env(self, spec: WorkerSpec) -> dict[str, str]:
        """The worker's environment: with GPUs, exactly those visible to CUDA, numbered as NVML numbers them."""
        gpus = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(map(str, spec.gpus))}
        return {"PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1", **(gpus if spec.gpus else {})}

    @property
    def fault_switches(self) -> bool:
        return "fault_switches" in self.capabilities

    def reference(self) -> dict[str, Any] | None:
        return None

    def tiny_model(self) -> TinyModel | None:
        return None

    def check(self) -> None:
        return None

    def launch(self, spec: WorkerSpec, log_dir: Path, env: Mapping[str, str] | None = None, *,
               prefix: Sequence[str] = ()) -> WorkerHandle:
        proc = ManagedProcess(f"worker {spec.id}", [*prefix, *self.argv(spec)],
                              log_path=log_dir / f"worker-{spec.id}.log", env={**self.env(spec), **(env or {})},
                              cwd=log_dir, nice=self.nice)
        proc.start()
        return WorkerHandle(spec, self.name, proc)

    progress_cap: float | None = None  # with it, start_timeout counts from the last progress (vLLM)

    async def wait_ready(self, handle: WorkerHandle, *, timeout: float | None = None) -> None:
        await wait_serving(handle, timeout=timeout or self.start_timeout, interval=0.1,
                           progress_cap=self.progress_cap)

    async def warm_up(self, url: str) -> None:
        return None

    async def stop(self, handle: WorkerHandle, *, grace: float = 10.0) -> None:
        await handle.process.stop(grace)


class SimBackend(_ProcessBackend):
    """The simulated worker, one process per worker. Its fault switches and its model are known: a
    fault-free reference needs no run."""

    name = "sim"
    capabilities = frozenset({"fault_switches", "model_reference"})
    default_startup_s = 5.0
    simulated = True
    start_timeout = 30.0

    def __init__(self, config: SimConfig | None = None) -> None:
        from fleetward.fleet.config import SimConfig

        self.config = config or SimConfig()

    @classmethod
    def from_config(cls, *, sim: SimConfig | None = None, vllm: VllmConfig | None = None,
                    model_path: Path | None = None, run_dir: Path = Path(".fleetward")) -> SimBackend:
        return cls(sim)

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def tokenizer(self) -> str:
        source = self.config.tokenizer
        return source if source in BUILTIN else str(Path(source).expanduser().resolve())

    def reference(self) -> dict[str, Any] | None:
        """The simulated model (``fleetward.sim.model.SimModel``) by its parameters."""
        ref: dict[str, Any] = {"kind": "model", "seed": self.config.seed,
                               "eos_probability": self.config.eos_probability}
        if self.config.tokenizer != "byte":
            ref["vocab_size"] = load_vocabulary(self.tokenizer).size
        return ref

    def argv(self, spec: WorkerSpec) -> list[str]:
        return [sys.executable, "-m", "fleetward.sim.server", "--host", spec.host, "--port", str(spec.port),
                "--model-name", spec.model, "--config-json",
                # the tokenizer path resolved: the worker runs in its log folder
                self.config.model_copy(update={"tokenizer": self.tokenizer}).model_dump_json()]


class VllmBackend(_ProcessBackend):
    """Real vLLM through its OpenAI-compatible API server.

    ``model_path`` is the model folder (default: :meth:`default_model_path` under ``run_dir``, the tiny
    local model). It is checked when a worker is launched, so a backend can answer its capabilities
    before the model exists.
    """

    name = "vllm"
    capabilities = frozenset()

    def __init__(self, config: VllmConfig | None = None, model_path: Path | None = None, *,
                 run_dir: Path = Path(".fleetward")) -> None:
        from fleetward.fleet.config import VllmConfig

        self.config = config or VllmConfig()
        self._named_model = model_path is not None or bool(self.config.model)
        # Absolute: workers run in their own folders, where a relative path is taken for a hub model id.
        self.model_path = Path(model_path or self.config.model
                               or self.default_model_path(run_dir, self.config.tokenizer)).resolve()
        self.start_timeout = self.config.start_timeout_s  # without progress
        self.progress_cap = self.config.start_max_s
        self.nice = self.config.nice

    @classmethod
    def from_config(cls, *, sim: SimConfig | None = None, vllm: VllmConfig | None = None,
                    model_path: Path | None = None, run_dir: Path = Path(".fleetward")) -> VllmBackend:
        return cls(vllm, model_path, run_dir=run_dir)

    @staticmethod
    def default_model_path(run_dir: Path, tokenizer: str = "bpe") -> Path:
        """Where the tiny local model with this vocabulary lives under a run folder (``fleetward model tiny
        --tokenizer T --out`` that)."""
        return run_dir / "models" / ("tiny-seed0" if tokenizer == "byte" else f"tiny-{tokenizer}-seed0")

    @property
    def model_name(self) -> str:
        """The model folder's name when the config names one (``vllm.model``), else ``tiny``."""
        return Path(self.config.model).name if self.config.model else "tiny"

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def tokenizer(self) -> str:
        return str(self.model_path)

    def tiny_model(self) -> TinyModel | None:
        """The tiny local model at :meth:`default_model_path` when neither ``model_path`` nor ``vllm.model``
        names one."""
        return None if self._named_model else TinyModel(self.model_path, self.config.tokenizer)

    def check(self) -> None:
        """Raise :class:`ConfigError` unless the model folder holds a model."""
        if not (self.model_path / "config.json").exists():
            raise ConfigError(f"{self.model_path} is not a model folder (no config.json); make one with "
                              "`fleetward model tiny --out DIR`", field="vllm.model")

    def launch(self, spec: WorkerSpec, log_dir: Path, env: Mapping[str, str] | None = None, *,
               prefix: Sequence[str] = ()) -> WorkerHandle:
        self.check()
        return super().launch(spec, log_dir, env, prefix=prefix)

    def argv(self, spec: WorkerSpec) -> list[str]:
        c = self.config
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model_path), "--served-model-name", spec.model,
                "--host", spec.host, "--port", str(spec.port),
                "--max-model-len", str(c.max_model_len), "--dtype", c.dtype,
                "--seed", "0"]
        if c.enforce_eager:
            argv.append("--enforce-eager")
        if len(spec.gpus) > 1 and not any(a.startswith(("--tensor-parallel-size", "-tp")) for a in c.extra_args):
            argv += ["--tensor-parallel-size", str(len(spec.gpus))]  # one model over the GPUs it was given
        return [*argv, *c.extra_args]

    def env(self, spec: WorkerSpec) -> dict[str, str]:
        return {
            **super().env(spec),
            **self.binding(spec),
            "VLLM_CPU_KVCACHE_SPACE": str(self.config.kv_cache_space_gib),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }

    def binding(self, spec: WorkerSpec) -> dict[str, str]:
        """``VLLM_CPU_OMP_THREADS_BIND`` for the worker (``vllm.cpu_binding``): with ``spread``, its own cores
        (``spec.cpus``), or vLLM's default when the spec names none."""
        bind = self.config.cpu_binding
        if bind == "spread":
            return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, spec.cpus))} if spec.cpus else {}
        return {"VLLM_CPU_OMP_THREADS_BIND": bind}

    async def warm_up(self, url: str) -> None:
        """One long generation and a small batch of prompt lengths: vLLM on a CPU compiles kernels lazily
        on first use of a shape and stalls a small machine meanwhile; better before traffic than during."""
        async with httpx.AsyncClient(timeout=180, trust_env=False) as client:
            async def one(prompt: list[int], n: int) -> None:
                await client.post(f"{url}/v1/completions", json={
                    "model": self.model_name, "prompt": prompt, "max_tokens": n, "ignore_eos": True,
                    "temperature": 0})

            await one([40, 41, 42], 1500)
            await asyncio.gather(*(one([50 + i] * (10 + 50 * i), 64) for i in range(8)))


# The backends by name: the one list of them (configs, experiments, the commands' --backend and the autoscaler
# read it).
BACKENDS: dict[str, type[SimBackend] | type[VllmBackend]] = {cls.name: cls for cls in (SimBackend, VllmBackend)}

if TYPE_CHECKING:
    BackendName = str
else:
    # A backend's name as a config field's type: pydantic refuses any other, listing the names (and the config
    # reference lists them), as for a literal written out.
    BackendName = Literal[tuple(BACKENDS)]


def backend_class(kind: str) -> type[SimBackend] | type[VllmBackend]:
    """The backend named ``kind``; :class:`ConfigError` (field ``backend``) naming the known ones otherwise."""
    try:
        return BACKENDS[kind]
    except KeyError:
        raise ConfigError(f"unknown backend {kind!r} ({' or '.join(BACKENDS)})", field="backend") from None


def backend_capabilities(kind: str) -> frozenset[str]:
    """What workers of the backend named ``kind`` can do (see :class:`Backend`)."""
    return backend_class(kind).capabilities


def make_backend(kind: str, *, sim: SimConfig | None = None, vllm: VllmConfig | None = None,
                 model_path: Path | None = None, run_dir: Path = Path(".fleetward")) -> Backend:
    """The backend named ``kind``, from its config section (``sim`` or ``vllm``)."""
    return backend_class(kind).from_config(sim=sim, vllm=vllm, model_path=model_path, run_dir=run_dir)
