"""The node agent: one per host. It starts this node's workers, registers them, watches them, and carries out
the supervisor leader's remediations. :class:`NodeAgent` holds the node's workers and their registration;
each other job is a part of it in a module of its own:

- **Registration** (here): each ready worker is registered under ``workers/<id>``, bound to the agent's
  lease. If the agent dies, the keys vanish within the lease TTL. A clean stop revokes the lease, so they
  vanish at once. If etcd says the lease expired (a partition longer than the TTL), the agent takes a
  new lease and registers its live workers again.
- **Local detectors** (:mod:`~fleetward.supervisor.watchers`; their verdicts go to
  ``signals/<worker>/<detector>`` for the leader):
  - *process*: a pidfd per worker, so an exit is seen the moment it happens;
  - *engine-frozen*: an engine process in the stopped state, or no CPU progress while requests run;
  - *gpu*: a :class:`~fleetward.supervisor.gpu.GpuHealthSource`, classified by the Xid/ECC policy.
- **Actions** (:mod:`~fleetward.supervisor.actions`): the agent watches ``actions/<node>/``. It claims each
  pending action with a compare-and-swap, so an action is carried out once even if two leaders wrote it.
  It then restarts the worker, or stops it, or runs a self-test. It records ``done`` or ``failed``.
- **Starts and restarts** (:mod:`~fleetward.supervisor.lifecycle`): tenacity's exponential backoff across
  start attempts and a GPU self-test first when the worker owns GPUs; what a starting worker is at.
- **Adoption** (:mod:`~fleetward.supervisor.adoption`): servers this node protects but did not start.
- **Events**: ``worker.up`` and ``worker.down`` go on the bus.

The agent never decides a worker's health. It writes only the initial ``starting`` record of a worker
it launches, and the leader owns the record from then on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from fleetward.fleet.backends import Backend, WorkerHandle
from fleetward.fleet.bus import EventBus
from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.config import SupervisorConfig
from fleetward.fleet.errors import StoreError, UnavailableError
from fleetward.fleet.etcd import Compare, Put, StateStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.lease import LeaseKeeper
from fleetward.fleet.loops import LoopMetrics, Loops
from fleetward.fleet.procs import ensure_port
from fleetward.fleet.signing import ActionSigner, AttachSigner
from fleetward.fleet.telemetry import link_gauges
from fleetward.fleet.worker import HealthRecord, HealthState, WorkerRecord, WorkerSpec
from fleetward.supervisor.actions import KINDS, ActionFollower
from fleetward.supervisor.adoption import Adopter
from fleetward.supervisor.gpu import GpuHealthSource, GpuPolicy
from fleetward.supervisor.gpuhost import GpuChoice
from fleetward.supervisor.lifecycle import Lifecycle, Progress
from fleetward.supervisor.signals import Severity, Signal
from fleetward.supervisor.watchers import EngineWatch, ExitWatch, GpuWatch

__all__ = ["NodeAgent", "launched_health", "running_signal"]

log = logging.getLogger(__name__)


def launched_health(node: str, now: float) -> HealthRecord:
    """The ``health/<id>`` record an agent writes (create-only) for a worker it has just launched."""
    return HealthRecord(HealthState.STARTING, reason="launched", detector="agent", since=now, extra={"node": node})


def running_signal(worker: str, pid: int | None, now: float) -> Signal:
    """The process detector's ``ok`` for a worker that registers (``signals/<id>/process``)."""
    what = f"running (pid {pid})" if pid is not None else "serving (known by URL only: no process watched)"
    return Signal(worker, "process", Severity.OK, what, now)


class _Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.workers = Gauge("fleetward_agent_workers", "Worker processes this agent runs now.", registry=r)
        self.exits = Counter("fleetward_agent_worker_exits", "Worker processes that exited without the agent "
                             "stopping them (crashes, kills).", registry=r)
        self.signals = Counter("fleetward_agent_signals", "Signals this agent's detectors wrote (process, "
                               "engine-frozen, engine-busy, gpu, start), by detector and severity.",
                               ["detector", "severity"], registry=r)
        self.actions = Counter("fleetward_agent_actions", "Actions this agent carried out, by kind and result.",
                               ["kind", "result"], registry=r)
        for kind in KINDS:
            for result in ("done", "failed"):
                self.actions.labels(kind, result)
        self.refused = Counter("fleetward_agent_actions_refused", "Actions in etcd this agent refused to carry "
                               "out: not signed by the leader, addressed elsewhere, stale, or replayed.", registry=r)
        self.gpus = Gauge("fleetward_agent_gpus", "GPUs this agent watches, by the health source it reads them "
                          "from (nvml, dcgm; off: none, with 0).", ["source"], registry=r)
        # Labelled, so that an agent without a GPU source exports no sample at all (not a 0 that reads as blind).
        self.gpu_source_up = Gauge("fleetward_agent_gpu_source_up", "1 while the GPU health source answers, 0 "
                                   "while it cannot be read (dcgm-exporter down): GPU faults go unseen meanwhile. "
                                   "No sample without a source.", ["source"], registry=r)
        self.attach_refused = Counter("fleetward_agent_attach_commands_refused", "Restart commands of adopted "
                                      "servers this agent refused to run: their attach/ record was not signed "
                                      "with the admin token (unsigned or forged).", registry=r)


class NodeAgent:
    def __init__(self, *, store: StateStore, bus: EventBus, keys: Keys, backend: Backend, node: str,
                 log_dir: Path, lease_ttl: int = 10, clock: Clock = SYSTEM_CLOCK,
                 worker_env: Mapping[str, str] | None = None, supervisor: SupervisorConfig | None = None,
                 gpu: GpuHealthSource | None = None, worker_host: str = "127.0.0.1", admin_token: str = "",
                 advertise_host: str | None = None, gpu_policy: GpuPolicy | None = None,
                 gpu_choice: GpuChoice | None = None, gpus_per_worker: int = 1) -> None:
        self.store = store
        self.bus = bus
        self.keys = keys
        self.backend = backend  # how this node's own workers are started
        self._backends: dict[str, Backend] = {}  # a worker's own backend, where it is not ``backend`` (adopted)
        self.node = node
        self.log_dir = log_dir
        self.lease_ttl = lease_ttl
        self.clock = clock
        self.worker_env = dict(worker_env or {})
        self.config = supervisor or SupervisorConfig()
        self.gpu = gpu  # a GpuHealthSource, when this node has GPUs (or a fake one)
        # What it is and why (gpu: auto may choose none): logged once, in agents/<node> for `fleetward status`.
        self.gpu_choice = gpu_choice or (GpuChoice(type(gpu).__name__, "a source given to the agent",
                                                   tuple(gpu.gpus()))
                                         if gpu is not None else GpuChoice("off", "no GPU health source"))
        self.gpus_per_worker = gpus_per_worker  # GPUs of each worker this agent starts (a start action)
        self.worker_host = worker_host  # where workers started by a ``start`` action bind
        # Where other hosts reach what listens here on loopback or every address (fleet.procs.advertised_host);
        # None: as it listens.
        self.advertise_host = advertise_host if advertise_host != worker_host else None
        # Actions are carried out only when the leader signed them (fleet/signing.py); without the token, as
        # in a test that builds an agent alone, they are not checked.
        self.signer = ActionSigner(admin_token, max_age_s=self.config.action_max_age_s) if admin_token else None
        # Likewise the restart commands of adopted servers (attach/ records): run only when signed.
        self.attach_signer = AttachSigner(admin_token) if admin_token else None
        self.handles: dict[str, WorkerHandle] = {}
        self.specs: dict[str, WorkerSpec] = {}
        self.failed: dict[str, str] = {}
        self.closing = False
        self._lease: LeaseKeeper | None = None
        self._identity: dict[str, tuple[str | None, str | None]] = {}  # worker -> (engine, device) it registered with
        self._http = httpx.AsyncClient(timeout=2.0)
        self._raised: dict[str, set[str]] = {}  # worker -> detectors whose last signal here was not ok
        # One write at a time per signal key, in the order they were decided: two concurrent puts may reach
        # etcd in either order, and an older finding (an exit seen beginning) must not overwrite a newer one
        # (its exit code).
        self._signal_locks: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self.metrics = _Metrics()
        self.metrics.workers.set_function(lambda: float(len(self.handles)))
        # Every task of the agent's and of its parts: the loops (restarted when they crash), and one-off tasks.
        self.loops = Loops(service="agent", metrics=LoopMetrics(self.metrics.registry), clock=clock)
        link_gauges(self.metrics.registry, store=store, bus=bus)
        self.metrics_url = ""  # where /metrics is served (``agents/<node>`` in etcd), once started
        self._metrics_site: web.AppRunner | None = None
        self._retired: list[str] = []  # what /ready last found (``retired``)
        # Its parts, each a job of its own.
        self.exits = ExitWatch(self)  # the process detector
        self.engines = EngineWatch(self, self.exits)  # the engine-frozen detector
        self.gpus = GpuWatch(self, gpu, gpu_policy or GpuPolicy()) if gpu is not None else None  # the gpu detector
        self.metrics.gpus.labels(self.gpu_choice.source).set(len(self.gpu_choice.gpus) if gpu is not None else 0)
        if gpu is not None:
            self.metrics.gpu_source_up.labels(self.gpu_choice.source).set(1)
        self.lifecycle = Lifecycle(self)  # starts, restarts, stops
        self.actions = ActionFollower(self)  # the leader's actions, carried out
        self.adopter = Adopter(self)  # servers this node protects but did not start (``attach/``)

    # -- life -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        log.info("node %s: %s", self.node, self.gpu_choice.line)
        self._lease = await LeaseKeeper(self.store, self.lease_ttl, clock=self.clock).start()
        if self.config.agent_metrics_port is not None:
            await self._serve_metrics(self.config.agent_metrics_port)
        else:
            await self._announce()
        loops = self.loops.start()
        loops.run("lease", self._renew_lost_lease)
        loops.run("actions", self.actions.follow)
        loops.run("engines", self.engines.monitor)
        loops.run("exits", self.exits.watch_dying)
        loops.run("attach", self.adopter.follow)
        if self.gpus is not None:
            loops.run("gpus", self.gpus.monitor)

    def spawn(self, coro: Coroutine[Any, Any, None], *, name: str) -> asyncio.Task[None]:
        """A one-off task of the agent's (an action carried out, a signal written, a read or probe of a worker,
        the wait for a worker's exit): dropped once done, cancelled when the agent closes."""
        return self.loops.spawn(name, coro)

    async def start_workers(self, specs: Sequence[WorkerSpec], *, progress: Progress | None = None) -> None:
        """Launch every worker, then register each as soon as it is ready. A worker that fails to start is
        started again like a restart (backoff, another port if its own was taken meanwhile: a port picked
        free can be bound by someone else before the worker binds it); one that never starts is recorded,
        not raised."""
        if self._lease is None:
            await self.start()
        await self.lifecycle.start_workers(specs, progress=progress)

    async def retired(self) -> list[str]:
        """Its workers the autoscaler retired whose drain is over (:attr:`HealthRecord.retired`). Read from
        ``health/``; on an etcd error, the last answer."""
        try:
            found = []
            for wid in list(self.handles):
                kv = await self.store.get(self.keys.health_of(wid))
                if kv is not None and HealthRecord.from_json(kv.value).retired:
                    found.append(wid)
            self._retired = found
        except StoreError as exc:
            log.warning("readiness: health/ not read (%s); answering as before", exc)
        return self._retired

    async def _serve_metrics(self, port: int) -> None:
        """``GET /metrics``, ``/health`` and ``/ready`` on the workers' address, announced as ``agents/<node>``.

        ``/ready`` is 503 once the autoscaler retired one of its workers and the drain is over: as a Kubernetes
        sidecar's readiness probe it makes the pod NotReady, and a ReplicaSet scaled down deletes NotReady pods
        first, so the drained worker is the one that goes; the Kubernetes actuator lowers the replicas on the
        same test (docs/deploy.md, Kubernetes)."""

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=generate_latest(self.metrics.registry),
                                headers={"Content-Type": CONTENT_TYPE_LATEST})

        async def health(_: web.Request) -> web.Response:
            return web.Response(status=200)

        async def ready(_: web.Request) -> web.Response:
            retired = await self.retired()
            if retired:
                return web.Response(status=503, text=f"retired by the autoscaler, drained: {', '.join(retired)}")
            return web.Response(status=200, text="ready")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/health", health)
        app.router.add_get("/ready", ready)
        port = ensure_port(self.worker_host, port, name=f"agent {self.node} metrics")
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, self.worker_host, port).start()
        self._metrics_site = runner
        self.metrics_url = f"http://{self.worker_host}:{port}"
        await self._announce()

    async def _announce(self) -> None:
        """``agents/<node>``: where its /metrics is (none: ""), and what watches this host's GPUs."""
        if self._lease is not None:
            body = {"node": self.node, "url": self.metrics_url, "gpu": self.gpu_choice.to_json()}
            with contextlib.suppress(UnavailableError):
                await self.store.put(self.keys.agent(self.node), orjson.dumps(body), lease=self._lease.id)

    async def aclose(self, *, grace: float = 10.0) -> None:
        """Stop every worker (ordered), revoke the lease (keys vanish now), publish ``worker.down``."""
        self.closing = True
        await self.adopter.aclose()
        await self.loops.aclose()
        await self.exits.aclose()
        await self.engines.aclose()
        handles = list(self.handles.values())
        # Servers someone else runs are left running: the agent only gives them up.
        owned = [h for h in handles if self.backend_for(h.spec.id).owns_processes]
        await asyncio.gather(*(self.backend_for(h.spec.id).stop(h, grace=grace) for h in owned),
                             return_exceptions=True)
        if self._lease is not None:
            await self._lease.aclose()
            self._lease = None
        with contextlib.suppress(UnavailableError, StoreError):
            for worker_id in self.specs:
                await self.store.delete(self.keys.health_of(worker_id))
                await self.store.delete(self.keys.signals + worker_id + "/", prefix=True)
        for h in handles:
            await self.bus.publish("worker.down", worker=h.spec.id, node=self.node, reason="stopped")
        self.handles.clear()
        await self._http.aclose()
        if self._metrics_site is not None:
            await self._metrics_site.cleanup()
            self._metrics_site = None

    def backend_for(self, worker_id: str) -> Backend:
        return self._backends.get(worker_id, self.backend)

    def adopted_backend(self, worker_id: str, backend: Backend, spec: WorkerSpec) -> None:
        """A worker this agent protects but did not start (see :mod:`fleetward.supervisor.adoption`)."""
        self._backends[worker_id] = backend
        self.specs[worker_id] = spec

    async def forget(self, worker_id: str) -> None:
        """Stop protecting a worker without touching its process: its registration and records go."""
        self.exits.unwatch(worker_id)
        self.exits.forget_tree(worker_id)
        self.handles.pop(worker_id, None)
        self.specs.pop(worker_id, None)
        self._backends.pop(worker_id, None)
        with contextlib.suppress(UnavailableError, StoreError):
            await self.store.delete(self.keys.worker(worker_id))
            await self.store.delete(self.keys.health_of(worker_id))
            await self.store.delete(self.keys.signals + worker_id + "/", prefix=True)
        await self.bus.publish("worker.down", worker=worker_id, node=self.node, reason="given up")

    async def leave_for_operator(self, worker_id: str) -> None:
        """A server that cannot be restarted from here: deregistered (no new work goes to it), left
        running for an operator, and taken back once it serves again."""
        self.exits.unwatch(worker_id)
        self.exits.forget_tree(worker_id)
        handle = self.handles.pop(worker_id, None)
        with contextlib.suppress(UnavailableError):
            await self.store.delete(self.keys.worker(worker_id))
        await self.bus.publish("worker.down", worker=worker_id, node=self.node, reason="left for an operator")
        self.adopter.watch_for_return(worker_id, handle.process.pid if handle is not None else None)

    # -- starting, restarting and stopping (supervisor/lifecycle.py) -------------------------------------

    async def restart(self, worker_id: str, *, spec: WorkerSpec | None = None, delay: float = 0.0) -> WorkerHandle:
        """Stop what is left of the worker, wait ``delay``, start it again (with retries), register it.

        Start attempts follow exponential backoff (``restart_attempts`` tries). A worker with GPUs must
        pass the self-test first. Raises :class:`ProcessError` when it never becomes ready. Restarts and stops
        of one worker are serialised: a second one waits for the first and then acts on its result.
        """
        return await self.lifecycle.restart(worker_id, spec=spec, delay=delay)

    async def stop(self, worker_id: str) -> None:
        await self.lifecycle.stop(worker_id)

    def is_restarting(self, worker_id: str) -> bool:
        """Whether a restart of the worker is under way here (its process may be gone meanwhile)."""
        return self.lifecycle.is_restarting(worker_id)

    # -- this node's processes --------------------------------------------------------------------------

    def processes(self, worker_id: str) -> list[psutil.Process]:
        """The worker's process tree, root first; empty while it does not run."""
        handle = self.handles.get(worker_id)
        return handle.process.tree() if handle is not None and handle.process.is_running else []

    def kill(self, worker_id: str) -> None:
        """SIGKILL the worker's whole process tree (what a crash does; the process detector reports it)."""
        handle = self.handles.get(worker_id)
        if handle is not None:
            handle.process.kill()

    def engine_processes(self, worker_id: str) -> list[psutil.Process]:
        """The processes that run the worker's model (vLLM's EngineCore and its workers; the sim itself)."""
        handle = self.handles.get(worker_id)
        return handle.engine_processes() if handle is not None and handle.process.is_running else []

    def signal_engine(self, worker_id: str, sig: int) -> None:
        """Send ``sig`` to the processes that run the worker's model (vLLM's EngineCore, the sim itself)."""
        for p in self.engine_processes(worker_id):
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)

    # -- registration and facts -------------------------------------------------------------------------

    async def initial_health(self, worker_id: str) -> None:
        """``starting`` for a worker we launch, unless the leader already keeps a record of it."""
        rec = launched_health(self.node, self.clock.wall())
        key = self.keys.health_of(worker_id)
        await self.store.txn([Compare(key, "create", "==", 0)], [Put(key, rec.to_json())])

    async def signal(self, worker_id: str, detector: str, severity: Severity, reason: str, **extra: Any) -> None:
        sig = Signal(worker_id, detector, severity, reason, self.clock.wall(), dict(extra))
        self.metrics.signals.labels(detector, severity.value).inc()
        key = self.keys.signal(worker_id, detector)
        async with self._signal_locks[key]:
            with contextlib.suppress(UnavailableError):
                await self.store.put(key, sig.to_json())
        raised = self._raised.setdefault(worker_id, set())
        if severity is Severity.OK:
            raised.discard(detector)
        else:
            raised.add(detector)

    async def register(self, handle: WorkerHandle) -> None:
        """Register a ready worker under the lease (``workers/<id>``), then watch its process's exit."""
        spec = handle.spec
        self.exits.unwatch(spec.id)
        self.failed.pop(spec.id, None)
        ok = running_signal(spec.id, handle.process.pid, self.clock.wall())
        await self.signal(spec.id, ok.detector, ok.severity, ok.reason)
        # A fresh process: what was said about the old one (its engine froze, its GPU raised an Xid or was
        # quarantined and has passed the self-test since, it failed to start) was acted on by this restart.
        # Left standing in etcd, a leader that takes over would read it again and act twice. A GPU that is
        # still throttled stays degraded.
        degraded = self.gpus.degraded & set(spec.gpus) if self.gpus is not None else set()
        if self.gpus is not None:
            self.gpus.said.pop(spec.id, None)  # written below: what the detector said before is gone
        for detector in sorted(self._raised.get(spec.id, set()) - {"gpu"}):
            await self.signal(spec.id, detector, Severity.OK, f"a fresh process (pid {handle.process.pid})")
        for sig in self.engines.activity.forget(spec.id):  # nor does the old process compute
            await self.signal(spec.id, sig.detector, sig.severity, sig.reason, **sig.extra)
        if self.gpus is not None and spec.gpus and not degraded:
            await self.signal(spec.id, "gpu", Severity.OK, f"GPU(s) {list(spec.gpus)} watched by "
                              f"{self.gpu_choice.source}: nothing against them by the policy", gpus=list(spec.gpus))
        elif "gpu" in self._raised.get(spec.id, set()) and not degraded:
            await self.signal(spec.id, "gpu", Severity.OK, f"a fresh process (pid {handle.process.pid})")
        self._identity[spec.id] = (await self._engine_of(handle), self._device_of(spec))
        await self._put_record(handle)
        await self.bus.publish("worker.up", worker=spec.id, url=spec.url, node=self.node, role=spec.role)
        self.exits.watch(handle)

    async def _engine_of(self, handle: WorkerHandle) -> str | None:
        """The server's engine and version (``vllm 0.32.0``, from vLLM's ``GET /version``); None if unknown."""
        try:
            r = await self._http.get(f"{handle.bind_url}/version", timeout=2.0)
            version = r.json().get("version") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return f"vllm {version}" if isinstance(version, str) and version else None

    def _device_of(self, spec: WorkerSpec) -> str | None:
        """The name of the worker's (first) GPU, from this host's GPU source; None without one."""
        if self.gpu is None or not spec.gpus:
            return None
        names = {g.index: g.name for g in self.gpu.gpus()}
        return names.get(spec.gpus[0])

    async def _put_record(self, handle: WorkerHandle) -> None:
        assert self._lease is not None
        spec = handle.spec
        engine, device = self._identity.get(spec.id, (None, None))
        record = WorkerRecord(id=spec.id, url=spec.url, role=spec.role, model=spec.model, node=spec.node,
                              backend=handle.backend, gpus=spec.gpus, started_at=handle.started_at,
                              pid=handle.process.pid, pids=tuple(p.pid for p in handle.process.tree()),
                              tokenizer=self.backend_for(spec.id).tokenizer, engine=engine, device=device)
        await self.store.put(self.keys.worker(spec.id), record.to_json(), lease=self._lease.id)

    async def _renew_lost_lease(self) -> None:
        while True:
            assert self._lease is not None
            await self._lease.lost.wait()
            # Only workers that registered (they have an exit watcher): one still starting (a launch or a
            # restart under way) registers itself once it is ready, under the new lease. Registering it now
            # would announce a process that does not serve yet.
            registered = [h for w, h in list(self.handles.items()) if self.exits.is_registered(w)]
            log.warning("agent lease expired; registering %d worker(s) again under a new lease", len(registered))
            self._lease = await LeaseKeeper(self.store, self.lease_ttl, clock=self.clock).start()
            await self._announce()
            for handle in registered:
                await self._put_record(handle)
