"""The node agent: one per host. It starts this node's workers, registers them, watches them, and carries out
the supervisor leader's remediations.

- **Registration**: each ready worker is registered under ``workers/<id>``, bound to the agent's lease.
  If the agent dies, the keys vanish within the lease TTL. A clean stop revokes the lease, so they
  vanish at once. If etcd says the lease expired (a partition longer than the TTL), the agent takes a
  new lease and registers its live workers again.
- **Local detectors** (their verdicts go to ``signals/<worker>/<detector>`` for the leader):
  - *process*: a pidfd per worker, so an exit is seen the moment it happens;
  - *engine-frozen*: an engine process in the stopped state, or no CPU progress while requests run;
  - *gpu*: a :class:`~fleetward.supervisor.gpu.GpuHealthSource`, classified by the Xid/ECC policy.
- **Actions**: the agent watches ``actions/<node>/``. It claims each pending action with a
  compare-and-swap, so an action is carried out once even if two leaders wrote it. It then restarts
  the worker, with tenacity's exponential backoff across start attempts and a GPU self-test first
  when the worker owns GPUs, or stops it, or runs a self-test. It records ``done`` or ``failed``.
- **Events**: ``worker.up`` and ``worker.down`` go on the bus.

The agent never decides a worker's health. It writes only the initial ``starting`` record of a worker
it launches, and the leader owns the record from then on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from tenacity import AsyncRetrying, RetryError, stop_after_attempt, wait_exponential

from fleetward.fleet.backends import Backend, WorkerHandle
from fleetward.fleet.bus import EventBus
from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.config import SupervisorConfig
from fleetward.fleet.errors import FleetwardError, StoreError, UnavailableError
from fleetward.fleet.etcd import Compare, Put, StateStore
from fleetward.fleet.external import LeftForOperator
from fleetward.fleet.keys import Keys
from fleetward.fleet.lease import LeaseKeeper
from fleetward.fleet.procs import ensure_port, free_port, last_log_line, port_is_free, spread_cores
from fleetward.fleet.signing import ActionSigner, AttachSigner
from fleetward.fleet.telemetry import link_gauges
from fleetward.fleet.worker import ROLES, HealthRecord, HealthState, WorkerRecord, WorkerSpec
from fleetward.supervisor.adoption import Adopter
from fleetward.supervisor.detectors import RUNNING, EngineFrozenDetector, EngineSample, parse_prometheus
from fleetward.supervisor.gpu import GpuHealthSource
from fleetward.supervisor.signals import Severity, Signal

__all__ = ["NodeAgent", "launched_health", "running_signal"]

log = logging.getLogger(__name__)

START_REPORT_S = 2.0  # how often a starting worker's phase (its last log line) is looked at, and said if it changed

Progress = Callable[[str, str], None]  # (worker id, what happened)


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
                               "engine-frozen, gpu, start), by detector and severity.", ["detector", "severity"],
                               registry=r)
        self.actions = Counter("fleetward_agent_actions", "Actions this agent carried out, by kind and result.",
                               ["kind", "result"], registry=r)
        for kind in ("restart", "start", "stop", "selftest"):
            for result in ("done", "failed"):
                self.actions.labels(kind, result)
        self.refused = Counter("fleetward_agent_actions_refused", "Actions in etcd this agent refused to carry "
                               "out: not signed by the leader, addressed elsewhere, stale, or replayed.", registry=r)
        self.attach_refused = Counter("fleetward_agent_attach_commands_refused", "Restart commands of adopted "
                                      "servers this agent refused to run: their attach/ record was not signed "
                                      "with the admin token (unsigned or forged).", registry=r)


class NodeAgent:
    def __init__(self, *, store: StateStore, bus: EventBus, keys: Keys, backend: Backend, node: str,
                 log_dir: Path, lease_ttl: int = 10, clock: Clock = SYSTEM_CLOCK,
                 worker_env: Mapping[str, str] | None = None, supervisor: SupervisorConfig | None = None,
                 gpu: GpuHealthSource | None = None, worker_host: str = "127.0.0.1", admin_token: str = "",
                 advertise_host: str | None = None) -> None:
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
        self.engine = EngineFrozenDetector(clock=clock, no_progress_s=self.config.engine_no_progress_s,
                                           stall_s=self.config.engine_stall_s,
                                           probe_interval_s=self.config.engine_probe_interval_s)
        self._lease: LeaseKeeper | None = None
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._identity: dict[str, tuple[str | None, str | None]] = {}  # worker -> (engine, device) it registered with
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._running: dict[str, tuple[int, float]] = {}  # worker -> requests running per its metrics, read at
        self._reads: dict[str, asyncio.Task[None]] = {}  # a worker's /metrics read under way
        self._probes: dict[str, tuple[list[float], asyncio.Task[None]]] = {}  # a probe: [sent at] once written, task
        self._restarting: set[str] = set()  # workers an action is restarting: their exits are expected
        self._tree_fds: dict[str, dict[int, int]] = {}  # worker -> pid -> pidfd of its engine processes
        self._dying: dict[str, WorkerHandle] = {}  # workers named dying before their exit completed
        self._locks: dict[str, asyncio.Lock] = {}  # one restart/stop of a worker at a time
        self._http = httpx.AsyncClient(timeout=2.0)
        self._raised: dict[str, set[str]] = {}  # worker -> detectors whose last signal here was not ok
        # One write at a time per signal key, in the order they were decided: two concurrent puts may reach
        # etcd in either order, and an older finding (an exit seen beginning) must not overwrite a newer one
        # (its exit code).
        self._signal_locks: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self._degraded_gpus: set[int] = set()  # GPUs throttled right now
        self.adopter = Adopter(self)  # servers this node protects but did not start (``attach/``)
        self.metrics = _Metrics()
        self.metrics.workers.set_function(lambda: float(len(self.handles)))
        link_gauges(self.metrics.registry, store=store, bus=bus)
        self.metrics_url = ""  # where /metrics is served (``agents/<node>`` in etcd), once started
        self._metrics_site: web.AppRunner | None = None

    # -- life -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._lease = await LeaseKeeper(self.store, self.lease_ttl, clock=self.clock).start()
        if self.config.agent_metrics_port is not None:
            await self._serve_metrics(self.config.agent_metrics_port)
        self._tasks = [
            asyncio.create_task(self._renew_lost_lease(), name="agent-lease"),
            asyncio.create_task(self._follow_actions(), name="agent-actions"),
            asyncio.create_task(self._monitor_engines(), name="agent-engines"),
            asyncio.create_task(self._watch_dying(), name="agent-exits"),
            asyncio.create_task(self.adopter.follow(), name="agent-attach"),
        ]
        if self.gpu is not None:
            self._tasks.append(asyncio.create_task(self._monitor_gpus(), name="agent-gpus"))

    async def start_workers(self, specs: Sequence[WorkerSpec], *, progress: Progress | None = None) -> None:
        """Launch every worker, then register each as soon as it is ready. A worker that fails to start is
        started again like a restart (backoff, another port if its own was taken meanwhile: a port picked
        free can be bound by someone else before the worker binds it); one that never starts is recorded,
        not raised."""
        if self._lease is None:
            await self.start()
        note = progress or (lambda _w, _what: None)
        launched: list[tuple[WorkerSpec, WorkerHandle | None, str]] = []
        for spec in specs:
            self.specs[spec.id] = spec
            await self.initial_health(spec.id)
            try:
                handle = self.backend.launch(spec, self.log_dir, self.worker_env)
            except FleetwardError as exc:
                launched.append((spec, None, str(exc)))
                continue
            self.handles[spec.id] = handle
            launched.append((spec, handle, ""))
            note(spec.id, "launched")

        async def one(spec: WorkerSpec, handle: WorkerHandle | None, failure: str) -> None:
            if handle is not None:
                try:
                    async with self._reporting_start(spec.id, handle):
                        await self.backend.wait_ready(handle)
                    await self.register(handle)
                    note(spec.id, "ready")
                    return
                except FleetwardError as exc:
                    await self.backend.stop(handle)
                    self.handles.pop(spec.id, None)
                    failure = str(exc)
            log.warning("worker %s did not start (%s); starting it again with backoff", spec.id, failure)
            note(spec.id, "retrying")
            try:
                await self.restart(spec.id, spec=spec, delay=self.config.backoff_initial_s)
            except FleetwardError as exc:
                await self._start_failed(spec.id, str(exc))
                note(spec.id, "failed")
                return
            note(spec.id, "ready")

        async with asyncio.TaskGroup() as tg:
            for spec, launch, failure in launched:
                tg.create_task(one(spec, launch, failure))

    async def _serve_metrics(self, port: int) -> None:
        """``GET /metrics`` (and ``/health``) on the workers' address, announced as ``agents/<node>``."""

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=generate_latest(self.metrics.registry),
                                headers={"Content-Type": CONTENT_TYPE_LATEST})

        async def health(_: web.Request) -> web.Response:
            return web.Response(status=200)

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/health", health)
        port = ensure_port(self.worker_host, port, name=f"agent {self.node} metrics")
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, self.worker_host, port).start()
        self._metrics_site = runner
        self.metrics_url = f"http://{self.worker_host}:{port}"
        await self._announce()

    async def _announce(self) -> None:
        if self.metrics_url and self._lease is not None:
            with contextlib.suppress(UnavailableError):
                await self.store.put(self.keys.agent(self.node), orjson.dumps({"node": self.node,
                                                                               "url": self.metrics_url}),
                                     lease=self._lease.id)

    async def aclose(self, *, grace: float = 10.0) -> None:
        """Stop every worker (ordered), revoke the lease (keys vanish now), publish ``worker.down``."""
        self._closing = True
        await self.adopter.aclose()
        tasks = [*self._watchers.values(), *self._tasks, *self._reads.values(),
                 *(t for _, t in self._probes.values())]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        self._watchers.clear()
        self._reads.clear()
        self._probes.clear()
        for wid in list(self._tree_fds):
            self._forget_tree(wid)
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
        watcher = self._watchers.pop(worker_id, None)
        if watcher is not None:
            watcher.cancel()
        self._forget_tree(worker_id)
        self.handles.pop(worker_id, None)
        self.specs.pop(worker_id, None)
        self._backends.pop(worker_id, None)
        with contextlib.suppress(UnavailableError, StoreError):
            await self.store.delete(self.keys.worker(worker_id))
            await self.store.delete(self.keys.health_of(worker_id))
            await self.store.delete(self.keys.signals + worker_id + "/", prefix=True)
        await self.bus.publish("worker.down", worker=worker_id, node=self.node, reason="given up")

    async def _leave_for_operator(self, worker_id: str) -> None:
        """A server that cannot be restarted from here: deregistered (no new work goes to it), left
        running for an operator, and taken back once it serves again."""
        watcher = self._watchers.pop(worker_id, None)
        if watcher is not None:
            watcher.cancel()
        self._forget_tree(worker_id)
        handle = self.handles.pop(worker_id, None)
        with contextlib.suppress(UnavailableError):
            await self.store.delete(self.keys.worker(worker_id))
        await self.bus.publish("worker.down", worker=worker_id, node=self.node, reason="left for an operator")
        self.adopter.watch_for_return(worker_id, handle.process.pid if handle is not None else None)

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

    def is_restarting(self, worker_id: str) -> bool:
        """Whether a restart of the worker is under way here (its process may be gone meanwhile)."""
        return worker_id in self._restarting

    # -- registration and facts -------------------------------------------------------------------------

    async def initial_health(self, worker_id: str) -> None:
        """``starting`` for a worker we launch, unless the leader already keeps a record of it."""
        rec = launched_health(self.node, self.clock.wall())
        key = self.keys.health_of(worker_id)
        await self.store.txn([Compare(key, "create", "==", 0)], [Put(key, rec.to_json())])

    async def _start_failed(self, worker_id: str, reason: str) -> None:
        log.error("worker %s failed to start: %s", worker_id, reason)
        self.failed[worker_id] = reason
        first_line = reason.splitlines()[0] if reason else "failed to start"
        await self.signal(worker_id, "start", Severity.FATAL, f"failed to start: {first_line}", action="dead")
        await self.bus.publish("worker.down", worker=worker_id, node=self.node, reason=first_line)

    @contextlib.asynccontextmanager
    async def _reporting_start(self, worker_id: str, handle: WorkerHandle) -> AsyncIterator[None]:
        """While the worker starts, what it is at (the last line it logged) as an ``ok`` ``start`` signal every
        ``START_REPORT_S`` it changes: ``fleetward status`` shows it beside ``starting``. The leader's health
        record is not touched."""
        async def report() -> None:
            said = ""
            while True:
                await self.clock.sleep(START_REPORT_S)
                line = last_log_line(handle.process.log_tail(5))[:160]
                if line and line != said:
                    said = line
                    with contextlib.suppress(FleetwardError):  # a status line: not worth a failed start
                        await self.signal(worker_id, "start", Severity.OK, line)

        task = asyncio.create_task(report(), name=f"agent-start-{worker_id}")
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

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
        old = self._watchers.pop(spec.id, None)
        if old is not None:
            old.cancel()
        self.failed.pop(spec.id, None)
        ok = running_signal(spec.id, handle.process.pid, self.clock.wall())
        await self.signal(spec.id, ok.detector, ok.severity, ok.reason)
        # A fresh process: what was said about the old one (its engine froze, its GPU raised an Xid or was
        # quarantined and has passed the self-test since, it failed to start) was acted on by this restart.
        # Left standing in etcd, a leader that takes over would read it again and act twice. A GPU that is
        # still throttled stays degraded.
        for detector in sorted(self._raised.get(spec.id, set())):
            if detector != "gpu" or not self._degraded_gpus & set(spec.gpus):
                await self.signal(spec.id, detector, Severity.OK, f"a fresh process (pid {handle.process.pid})")
        self._identity[spec.id] = (await self._engine_of(handle), self._device_of(spec))
        await self._put_record(handle)
        await self.bus.publish("worker.up", worker=spec.id, url=spec.url, node=self.node, role=spec.role)
        self._watchers[spec.id] = asyncio.create_task(self._watch_exit(handle), name=f"watch-{spec.id}")

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

    async def _watch_exit(self, handle: WorkerHandle) -> None:
        code = await handle.process.wait_exit()
        if self.handles.get(handle.spec.id) is handle:
            self._forget_tree(handle.spec.id)
        if self._closing or self.handles.get(handle.spec.id) is not handle:
            return  # we stopped it on purpose
        worker_id = handle.spec.id
        if self._dying.get(worker_id) is not handle:  # else counted when its exit was seen beginning
            self.metrics.exits.inc()
        reason = f"process exited with code {code}" if code is not None else "process exited"
        log.warning("worker %s: %s", worker_id, reason)
        self.handles.pop(worker_id, None)
        # The signal first, then the deregistration: the leader learns why before it sees it go.
        await self.signal(worker_id, "process", Severity.FATAL, reason, exit_code=code)
        with contextlib.suppress(UnavailableError):
            await self.store.delete(self.keys.worker(worker_id))
        await self.bus.publish("worker.down", worker=worker_id, node=self.node, reason=reason, exit_code=code)
        # What the process left behind (vLLM's EngineCore and Worker outlive a killed API server, holding
        # memory, and on a GPU its memory): stopped now, not at the next restart, which may never come.
        leftovers = handle.process.leftovers()
        if leftovers:
            log.warning("worker %s: %d process(es) of its tree outlived it (pids %s); stopping them", worker_id,
                        len(leftovers), ", ".join(str(p.pid) for p in leftovers))
            await self.backend_for(worker_id).stop(handle, grace=5)
            if not handle.process.survivors:
                log.info("worker %s: its tree is gone", worker_id)

    async def _renew_lost_lease(self) -> None:
        while True:
            assert self._lease is not None
            await self._lease.lost.wait()
            # Only workers that registered (they have an exit watcher): one still starting (a launch or a
            # restart under way) registers itself once it is ready, under the new lease. Registering it now
            # would announce a process that does not serve yet.
            registered = [h for w, h in list(self.handles.items()) if w in self._watchers]
            log.warning("agent lease expired; registering %d worker(s) again under a new lease", len(registered))
            self._lease = await LeaseKeeper(self.store, self.lease_ttl, clock=self.clock).start()
            await self._announce()
            for handle in registered:
                await self._put_record(handle)

    # -- local detectors --------------------------------------------------------------------------------

    def _engine_sample(self, handle: WorkerHandle) -> EngineSample:
        procs = []
        switches = 0
        tree = handle.process.tree()
        engines = [p for p in tree[1:] if _is_engine(p)] or tree[:1]
        server = demand = None
        if tree and engines[0] is not tree[0]:  # a server process in front of the engine
            with contextlib.suppress(psutil.Error), tree[0].oneshot():
                t = tree[0].cpu_times()
                server = (t.user + t.system, sum(tree[0].num_ctx_switches()))
            demand = _cpu_demand_ns(tree[0].pid)
        for p in engines:
            try:
                with p.oneshot():
                    cpu = p.cpu_times()
                    procs.append((p.pid, p.name(), p.status(), cpu.user + cpu.system))
                    switches += _switches(p)
            except psutil.Error:
                continue
        wid = handle.spec.id
        running, read_at = self._running.get(wid, (None, None))
        probe = self._probes.get(wid)
        return EngineSample(tuple(procs), running, switches=switches, running_read_at=read_at,
                            probe_sent_at=probe[0][0] if probe is not None and probe[0] and not probe[1].done()
                            else None,
                            server=server, server_demand_ns=demand)

    def _watch_tree_member(self, wid: str, handle: WorkerHandle, pid: int, name: str) -> None:
        """A pidfd on a process of a worker's tree (e.g. vLLM's EngineCore): its exit is seen at once."""
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return
        watched = self._tree_fds.setdefault(wid, {})

        def exited() -> None:
            loop.remove_reader(fd)
            os.close(fd)
            watched.pop(pid, None)
            if self._closing or wid in self._restarting or self.handles.get(wid) is not handle:
                return
            if not handle.process.is_running:
                return  # the whole worker went: the process watcher reports that
            reason = f"{name} (pid {pid}) exited while the API server (pid {handle.process.pid}) stays up"
            log.warning("worker %s: %s", wid, reason)
            task = asyncio.create_task(self.signal(wid, "process", Severity.FATAL, reason, pid=pid))
            self._tasks.append(task)

        watched[pid] = fd
        loop.add_reader(fd, exited)

    def _forget_tree(self, wid: str) -> None:
        loop = asyncio.get_running_loop()
        for fd in self._tree_fds.pop(wid, {}).values():
            loop.remove_reader(fd)
            os.close(fd)

    async def _watch_dying(self) -> None:
        """A process exit seen as it starts, not as it ends.

        A SIGKILLed process is marked exiting at once (``PF_EXITING`` in ``/proc/<pid>/stat``; its threads
        then exit one by one, and it turns zombie), but its exit completes, and a pidfd wakes, only when every
        thread has gone and its memory is freed: for a large multi-threaded process on a busy host, seconds
        later. So the worker's own process and the engine processes of its tree are read every
        ``exit_check_interval_s``, and the first sign of an exit is a fatal ``process`` signal at once. The
        exit watchers still do the rest (deregistration, ``worker.down``, leftovers) when the exit completes.
        """
        while True:
            await self.clock.sleep(self.config.exit_check_interval_s)
            for wid, handle in list(self.handles.items()):
                pid = handle.process.pid
                # Checked here, after the awaits of the workers before it: stopped on purpose, or replaced?
                if pid is None or self._closing or wid in self._restarting or self.handles.get(wid) is not handle \
                        or self._dying.get(wid) is handle:
                    continue
                for p in (pid, *self._tree_fds.get(wid, {})):
                    seen = exiting(p)
                    if seen is None:
                        continue
                    self._dying[wid] = handle
                    # Counted here, once: a restart ordered on this signal may replace the handle before the
                    # exit completes, and the exit watcher then counts nothing.
                    self.metrics.exits.inc()
                    state, code = seen
                    what = "process" if p == pid else f"engine process {p}"
                    reason = f"{what} exited" + (f" with code {code}" if code is not None else "") + \
                        ("" if state == "zombie" else f" ({state}: seen as its exit began)")
                    log.warning("worker %s: %s", wid, reason)
                    await self.signal(wid, "process", Severity.FATAL, reason, pid=p, exit_code=code)
                    break

    async def _monitor_engines(self) -> None:
        """Each worker's engine processes every ``engine_check_interval_s`` (state, CPU time, context switches).
        An engine that shows no progress has its /metrics read (requests running?) and, at most every
        ``engine_probe_interval_s``, gets a one-token probe, so that work is known to wait on it (see
        :class:`~fleetward.supervisor.detectors.EngineFrozenDetector`). Reads and probes run beside the
        sampling, which a frozen worker that answers nothing must not hold up.

        Only workers that registered (ready, with an exit watcher) are looked at. One still starting has
        nothing to judge: vLLM listens before its engine is handed work (its socket is bound first, the
        app served last), so a probe sent then waits in the socket's backlog while the idle engine is, rightly,
        not scheduled; that is not a freeze. A start that hangs is the start timeout's to catch."""
        ticks = 0
        while True:
            await self.clock.sleep(self.config.engine_check_interval_s)
            ticks += 1
            for wid, handle in list(self.handles.items()):
                if (handle.process.pid is None or not handle.process.is_running or wid in self._restarting
                        or wid not in self._watchers):
                    continue  # no process to look at (a server known by URL only), being replaced, or starting
                sample = await asyncio.to_thread(self._engine_sample, handle)
                if self.handles.get(wid) is not handle or wid in self._restarting:
                    continue
                watched = self._tree_fds.get(wid, {})
                for pid, name, _, _ in sample.processes:
                    if pid != handle.process.pid and pid not in watched:
                        self._watch_tree_member(wid, handle, pid, name)
                for sig in self.engine.observe(wid, sample):
                    if sig.severity is not Severity.OK:
                        log.warning("worker %s: %s", wid, sig.reason)
                    await self.signal(wid, sig.detector, sig.severity, sig.reason, **sig.extra)
                stalled = self.engine.probe_due(wid)
                if ticks % 8 == 0 or stalled or not self.engine.ran_last(wid):
                    self._start_read(wid, handle)
                if stalled:
                    self._start_probe(wid, handle)

    def _start_read(self, wid: str, handle: WorkerHandle) -> None:
        """Read the worker's requests running from its /metrics, unless a read is under way."""
        if wid in self._reads and not self._reads[wid].done():
            return

        async def read() -> None:
            try:
                r = await self._http.get(f"{handle.bind_url}/metrics", timeout=1.0)
                self._running[wid] = (int(parse_prometheus(r.text, (RUNNING,)).get(RUNNING, 0)),
                                      self.clock.monotonic())
            except (httpx.HTTPError, ValueError):
                self._running.pop(wid, None)

        self._reads[wid] = asyncio.create_task(read(), name=f"agent-metrics-{wid}")

    def _start_probe(self, wid: str, handle: WorkerHandle) -> None:
        """A one-token request to the worker, unless one is under way: while it is unanswered, work waits."""
        if wid in self._probes and not self._probes[wid][1].done():
            return
        body = {"model": handle.spec.model, "prompt": self.config.canary_prompt, "max_tokens": 1,
                "temperature": 0}

        sent: list[float] = []

        async def trace(event: str, _info: dict[str, Any]) -> None:
            if event == "http11.send_request_body.complete":
                sent.append(self.clock.monotonic())

        async def probe() -> None:
            try:
                await self._http.post(f"{handle.bind_url}/v1/completions", json=body,
                                      timeout=self.config.canary_timeout_s + self.config.engine_stall_s,
                                      extensions={"trace": trace})
            except httpx.HTTPError:
                pass  # the answer does not matter: only how long the engine leaves it waiting
            finally:
                if self.handles.get(wid) is handle:
                    self.engine.probe_done(wid)

        # Sent when its bytes are written, not when it is asked for: a held-up event loop may write it late.
        self._probes[wid] = (sent, asyncio.create_task(probe(), name=f"agent-probe-{wid}"))

    async def _monitor_gpus(self) -> None:
        from fleetward.supervisor.gpu import Action, GpuEventKind, GpuPolicy

        policy = GpuPolicy()
        source = self.gpu
        assert source is not None
        while True:
            await self.clock.sleep(self.config.gpu_poll_interval_s)
            for event in await asyncio.to_thread(source.poll):  # NVML calls block briefly
                action: Action | None
                action, reason = policy.classify(event)
                if event.kind is GpuEventKind.THROTTLE_STOPPED:
                    action = None  # clears the degraded mark below
                    self._degraded_gpus.discard(event.gpu)
                elif action is Action.IGNORE:
                    continue
                elif action is Action.DEGRADED:
                    self._degraded_gpus.add(event.gpu)
                for wid, spec in self.specs.items():
                    if event.gpu not in spec.gpus:
                        continue
                    if action is Action.DRAIN_AND_QUARANTINE:
                        await self.signal(wid, "gpu", Severity.FATAL, reason, action="quarantine", gpu=event.gpu)
                    elif action is Action.RESTART_WORKER:
                        await self.signal(wid, "gpu", Severity.FATAL, reason, action="restart", gpu=event.gpu)
                    elif action is Action.DEGRADED:
                        await self.signal(wid, "gpu", Severity.DEGRADED, reason, gpu=event.gpu)
                    else:
                        await self.signal(wid, "gpu", Severity.OK, reason, gpu=event.gpu)

    # -- actions from the leader ------------------------------------------------------------------------

    async def _follow_actions(self) -> None:
        prefix = self.keys.actions_of(self.node)
        while True:
            snap = await self.store.get_prefix(prefix)
            for kv in snap.items:
                self._maybe_run(kv.key, kv.value, kv.mod_revision)
            try:
                async for ev in self.store.watch_prefix(prefix, start_revision=snap.revision + 1):
                    if ev.kind == "put":
                        self._maybe_run(ev.key, ev.value, ev.revision)
            except StoreError as exc:
                log.warning("action watch lost (%s); re-reading", exc)

    def _maybe_run(self, key: str, value: bytes, mod_revision: int) -> None:
        try:
            body = orjson.loads(value)
        except orjson.JSONDecodeError:
            return
        if body.get("status") != "pending":
            return
        if self.signer is not None:
            why = self.signer.refusal(body, node=self.node, now=self.clock.wall())
            if why is not None:
                self._refuse(key, body, mod_revision, why)
                return
        task = asyncio.create_task(self._run_action(key, body, mod_revision), name=f"action-{body.get('id')}")
        self._tasks.append(task)
        self._tasks = [t for t in self._tasks if not t.done()]

    def _refuse(self, key: str, body: dict[str, Any], mod_revision: int, why: str) -> None:
        """An action the leader did not issue: not carried out, and marked refused with why (a replay of one
        carried out before is left as it is: it may be the same action seen twice)."""
        log.warning("refusing action %s at %s (%s of %s): %s", body.get("id"), key, body.get("kind"),
                    body.get("worker"), why)
        self.metrics.refused.inc()
        if why.startswith("carried out before"):
            return

        async def mark() -> None:
            refused = {**body, "status": "refused", "reason_done": why, "done_at": self.clock.wall()}
            await self.store.txn([Compare(key, "mod", "==", mod_revision)], [Put(key, orjson.dumps(refused))])
            await self.bus.publish("action", worker=str(body.get("worker")), node=self.node,
                                   action=str(body.get("id")), action_kind=str(body.get("kind")), status="refused",
                                   reason=why)

        self._tasks.append(asyncio.create_task(mark(), name="action-refused"))

    async def _run_action(self, key: str, body: dict[str, Any], mod_revision: int) -> None:
        claimed = {**body, "status": "running", "claimed_at": self.clock.wall()}
        result = await self.store.txn([Compare(key, "mod", "==", mod_revision)], [Put(key, orjson.dumps(claimed))])
        if not result.succeeded:
            return  # someone (an earlier run of us) already took it
        worker, kind = body["worker"], body["kind"]
        log.info("carrying out %s of %s: %s", kind, worker, body.get("reason", ""))
        ok, reason = True, ""
        try:
            if kind == "restart":
                await self.restart(worker, delay=float(body.get("delay_s", 0.0)))
            elif kind == "start":
                ok, reason = await self.start_new(worker, role=body.get("role", "aggregated"))
            elif kind == "stop":
                await self.stop(worker)
            elif kind == "selftest":
                ok, reason = await self.selftest(worker)
            else:
                ok, reason = False, f"unknown action kind {kind!r}"
        except FleetwardError as exc:
            ok, reason = False, str(exc).splitlines()[0]
        except Exception as exc:  # an action must always end with a status
            log.exception("action %s failed", body.get("id"))
            ok, reason = False, f"{type(exc).__name__}: {exc}"
        done = {**claimed, "status": "done" if ok else "failed", "reason_done": reason, "done_at": self.clock.wall()}
        if kind in ("restart", "start", "stop", "selftest"):  # a bounded label set, whatever the key space holds
            self.metrics.actions.labels(kind, done["status"]).inc()
        await self.store.put(key, orjson.dumps(done))
        await self.bus.publish("action", worker=worker, node=self.node, action=body["id"], action_kind=kind,
                               status=done["status"], reason=reason)

    def _lock(self, worker_id: str) -> asyncio.Lock:
        return self._locks.setdefault(worker_id, asyncio.Lock())

    async def stop(self, worker_id: str) -> None:
        async with self._lock(worker_id):
            await self._stop(worker_id)

    async def _stop(self, worker_id: str) -> None:
        self._forget_tree(worker_id)
        handle = self.handles.pop(worker_id, None)
        backend = self.backend_for(worker_id)
        if handle is not None and backend.owns_processes:
            await backend.stop(handle, grace=5)
        with contextlib.suppress(UnavailableError):
            await self.store.delete(self.keys.worker(worker_id))

    async def start_new(self, worker_id: str, *, role: str = "aggregated") -> tuple[bool, str]:
        """A worker the leader asked for (scale-up): this node's backend and model, a free port."""
        if worker_id in self.handles:
            return True, "running already"
        own = [s for s in self.specs.values() if s.cpus]  # its cores: as if this host had started one more
        spec = WorkerSpec(id=worker_id, host=self.worker_host, port=free_port(self.worker_host),
                          model=self.backend.model_name, role=role if role in ROLES else "aggregated",
                          node=self.node, advertise_host=self.advertise_host, cpus=spread_cores(len(own) + 1)[-1])
        await self.start_workers([spec])
        failed = self.failed.get(worker_id)
        return (False, failed.splitlines()[0]) if failed else (True, f"started on port {spec.port}")

    async def selftest(self, worker_id: str) -> tuple[bool, str]:
        spec = self.specs.get(worker_id)
        if spec is None or not spec.gpus:
            return True, "no GPU to test"
        from fleetward.supervisor.gpu import run_selftest

        source = self.gpu
        if source is None:
            return False, f"GPU(s) {list(spec.gpus)} have no health source to self-test them"
        for gpu in spec.gpus:
            result = await asyncio.to_thread(run_selftest, source, gpu)
            if not result.passed:
                return False, f"GPU {gpu}: {result.reason}"
        return True, f"GPU(s) {list(spec.gpus)} passed the self-test"

    async def restart(self, worker_id: str, *, spec: WorkerSpec | None = None, delay: float = 0.0) -> WorkerHandle:
        """Stop what is left of the worker, wait ``delay``, start it again (with retries), register it.

        Start attempts follow exponential backoff (``restart_attempts`` tries). A worker with GPUs must
        pass the self-test first. Raises :class:`ProcessError` when it never becomes ready. Restarts and stops
        of one worker are serialised: a second one waits for the first and then acts on its result.
        """
        async with self._lock(worker_id):
            return await self._restart(worker_id, spec=spec, delay=delay)

    async def _restart(self, worker_id: str, *, spec: WorkerSpec | None, delay: float) -> WorkerHandle:
        backend = self.backend_for(worker_id)
        if not backend.can_restart:
            await self._leave_for_operator(worker_id)
            raise LeftForOperator(f"{worker_id} is a server fleetward did not start, with no restart_command: "
                                  "drained and left for an operator (it is taken back once it serves again)")
        self._restarting.add(worker_id)
        try:
            self._forget_tree(worker_id)
            old = self.handles.pop(worker_id, None)
            watcher = self._watchers.pop(worker_id, None)
            if watcher is not None:
                watcher.cancel()
            if old is not None:
                await backend.stop(old, grace=5)
            spec = spec or self.specs.get(worker_id)
            if spec is None:
                raise FleetwardError(f"unknown worker {worker_id} on node {self.node}")
            if delay > 0:
                await self.clock.sleep(delay)
            if spec.gpus:
                ok, reason = await self.selftest(worker_id)
                if not ok:
                    raise FleetwardError(f"self-test failed before restart: {reason}")
            self.engine.forget(worker_id)
            try:
                async for attempt in AsyncRetrying(stop=stop_after_attempt(self.config.restart_attempts),
                                                   wait=wait_exponential(multiplier=self.config.backoff_initial_s,
                                                                         max=self.config.backoff_max_s),
                                                   sleep=self.clock.sleep, reraise=True):
                    with attempt:
                        # Our own worker moves to a free port; a server someone else runs keeps its address.
                        if backend.owns_processes and not port_is_free(spec.host, spec.port):
                            spec = dataclasses.replace(spec, port=free_port(spec.host))
                        self.specs[worker_id] = spec
                        handle = backend.launch(spec, self.log_dir, self.worker_env)
                        self.handles[worker_id] = handle
                        try:
                            async with self._reporting_start(worker_id, handle):
                                await backend.wait_ready(handle)
                        except FleetwardError:
                            self.handles.pop(worker_id, None)
                            await backend.stop(handle, grace=2)
                            raise
            except RetryError as exc:  # pragma: no cover - reraise=True gives the last error instead
                raise FleetwardError(str(exc)) from exc
            await self.register(handle)
            return handle
        finally:
            self._restarting.discard(worker_id)


_PF_EXITING = 0x4  # include/linux/sched.h: getting shut down


def exiting(pid: int) -> tuple[str, int | None] | None:
    """Whether ``pid``'s exit has begun, from ``/proc/<pid>/stat``: ``(state, exit code)`` (state ``exiting``,
    ``zombie`` or ``gone``; the code as ``subprocess`` gives it, -N for signal N, when the kernel shows it),
    or None while it lives."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return "gone", None
    except OSError:
        return None
    rest = stat[stat.rindex(b")") + 2:].split()
    state, flags = rest[0], int(rest[6])
    if state not in (b"Z", b"X", b"x") and not flags & _PF_EXITING:
        return None
    code: int | None = None
    if len(rest) > 49:  # field 52, exit_code (Linux 3.5+), as waitpid reports it
        raw = int(rest[49])
        code = -(raw & 0x7F) if raw & 0x7F else raw >> 8
    return ("zombie" if state == b"Z" else "exiting"), code


def _switches(p: psutil.Process) -> int:
    """Context switches of every thread of ``p``. psutil counts the main thread's only, and an engine can wait
    there (vLLM's EngineCore on its Worker, a Worker on its KV files) while other threads do the work: one
    that runs at all must show."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{p.pid}/task")
    except OSError:
        return sum(p.num_ctx_switches())
    for tid in tasks:
        try:
            with open(f"/proc/{p.pid}/task/{tid}/status", "rb") as f:
                for line in f:
                    if line.startswith((b"voluntary_ctxt_switches", b"nonvoluntary_ctxt_switches")):
                        total += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return total


def _cpu_demand_ns(pid: int) -> int | None:
    """The CPU a process asked for: its threads' time on a CPU plus their time waiting in a run queue (ns,
    ``/proc/<pid>/task/<tid>/schedstat``); None where the kernel does not keep it."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                on_cpu, waiting, _ = f.read().split()
        except FileNotFoundError:
            continue  # a thread that ended since the listing
        except (OSError, ValueError):
            return None
        total += int(on_cpu) + int(waiting)
    return total


def _is_engine(p: psutil.Process) -> bool:
    """vLLM's model-running processes (EngineCore, Worker) in a worker's tree."""
    try:
        return p.name().startswith("VLLM::") or "EngineCore" in " ".join(p.cmdline()[:1])
    except psutil.Error:
        return False
