"""The node agent's local detectors: what it sees of its own workers on this host, written as signals
(``signals/<worker>/<detector>``) for the leader. The verdicts are the sans-IO detectors'
(:mod:`fleetward.supervisor.detectors`); these classes are the I/O around them.

- :class:`ExitWatch` (*process*): a pidfd per registered worker, so an exit is seen the moment it completes;
  a pidfd per engine process of its tree (vLLM's EngineCore and Workers); and ``/proc`` read every
  ``exit_check_interval_s`` so that an exit is seen as it begins (:func:`exiting`). On an exit it signals,
  deregisters the worker, publishes ``worker.down`` and stops what its tree left behind.
- :class:`EngineWatch` (*engine-frozen*): the engine processes' state, CPU time and context switches, the
  worker's requests running (its ``/metrics``) and the agent's one-token probe, fed to
  :class:`~fleetward.supervisor.detectors.EngineFrozenDetector`.
- :class:`GpuWatch` (*gpu*): a :class:`~fleetward.supervisor.gpu.GpuHealthSource` polled, its events
  classified by :class:`~fleetward.supervisor.gpu.GpuPolicy`.

Each is a part of one :class:`~fleetward.supervisor.agent.NodeAgent` and reads the agent's workers
(``handles``); none of them decides a worker's health or acts on it beyond the exit's bookkeeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any

import httpx
import psutil

from fleetward.fleet.backends import WorkerHandle
from fleetward.fleet.errors import UnavailableError
from fleetward.supervisor.detectors import (
    RUNNING,
    EngineActivity,
    EngineFrozenDetector,
    EngineSample,
    parse_prometheus,
)
from fleetward.supervisor.gpu import Action, GpuEvent, GpuEventKind, GpuHealthSource, GpuPolicy, GpuSourceError
from fleetward.supervisor.signals import Severity

if TYPE_CHECKING:
    from fleetward.supervisor.agent import NodeAgent

__all__ = ["EngineWatch", "ExitWatch", "GpuWatch", "exiting"]

log = logging.getLogger(__name__)


class ExitWatch:
    """The *process* detector: exits of the agent's workers and of their engine processes."""

    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent
        self._watchers: dict[str, asyncio.Task[None]] = {}  # worker -> the wait for its exit, once registered
        self._tree_fds: dict[str, dict[int, int]] = {}  # worker -> pid -> pidfd of its engine processes
        self._dying: dict[str, WorkerHandle] = {}  # workers named dying before their exit completed
        self._clearing: dict[str, asyncio.Task[None]] = {}  # worker -> the stop of what its exit left behind

    def is_registered(self, worker_id: str) -> bool:
        """Whether the worker registered (it has an exit watcher): one still starting has not."""
        return worker_id in self._watchers

    def watch(self, handle: WorkerHandle) -> None:
        """Wait for the exit of a worker that has just registered (an earlier wait for it ends)."""
        self.unwatch(handle.spec.id)
        self._watchers[handle.spec.id] = self.agent.spawn(self._watch_exit(handle), name=f"watch-{handle.spec.id}")

    def unwatch(self, worker_id: str) -> None:
        """No longer wait for the worker's exit (it is stopped, replaced or given up on purpose)."""
        watcher = self._watchers.pop(worker_id, None)
        if watcher is not None:
            watcher.cancel()

    def tree(self, worker_id: str) -> dict[int, int]:
        """The engine processes of the worker's tree watched by a pidfd: pid -> pidfd."""
        return self._tree_fds.get(worker_id, {})

    def forget_tree(self, wid: str) -> None:
        loop = asyncio.get_running_loop()
        for fd in self._tree_fds.pop(wid, {}).values():
            loop.remove_reader(fd)
            os.close(fd)

    async def aclose(self) -> None:
        """Stop waiting for exits (the agent is closing) and close every pidfd."""
        watchers = list(self._watchers.values())
        self._watchers.clear()
        for task in watchers:
            task.cancel()
        for task in watchers:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for wid in list(self._tree_fds):
            self.forget_tree(wid)

    async def _watch_exit(self, handle: WorkerHandle) -> None:
        agent = self.agent
        code = await handle.process.wait_exit()
        if agent.handles.get(handle.spec.id) is handle:
            self.forget_tree(handle.spec.id)
        if agent.closing or agent.handles.get(handle.spec.id) is not handle:
            return  # we stopped it on purpose
        worker_id = handle.spec.id
        if self._dying.get(worker_id) is not handle:  # else counted when its exit was seen beginning
            agent.metrics.exits.inc()
        reason = f"process exited with code {code}" if code is not None else "process exited"
        log.warning("worker %s: %s", worker_id, reason)
        agent.handles.pop(worker_id, None)
        # Before any await: a restart ordered on the exit (seen as it began) may cancel this watcher at the
        # next one, and it no longer finds the handle to stop.
        self._clear_leftovers(handle)
        # The signal first, then the deregistration: the leader learns why before it sees it go.
        await agent.signal(worker_id, "process", Severity.FATAL, reason, exit_code=code)
        with contextlib.suppress(UnavailableError):
            await agent.store.delete(agent.keys.worker(worker_id))
        await agent.bus.publish("worker.down", worker=worker_id, node=agent.node, reason=reason, exit_code=code)

    def _clear_leftovers(self, handle: WorkerHandle) -> None:
        """Stop what the exited process left behind (vLLM's EngineCore and Worker outlive a killed API server,
        holding memory, and on a GPU its memory): now, not at the next restart, which may never come. In a
        task of the agent's that no unwatch cancels; a restart waits for it (:meth:`cleared`)."""
        agent = self.agent
        worker_id = handle.spec.id
        leftovers = handle.process.leftovers()
        if not leftovers:
            return
        log.warning("worker %s: %d process(es) of its tree outlived it (pids %s); stopping them", worker_id,
                    len(leftovers), ", ".join(str(p.pid) for p in leftovers))

        async def clear() -> None:
            try:
                await agent.backend_for(worker_id).stop(handle, grace=5)
                if not handle.process.survivors:
                    log.info("worker %s: its tree is gone", worker_id)
            finally:
                if self._clearing.get(worker_id) is task:
                    del self._clearing[worker_id]

        task = self._clearing[worker_id] = agent.spawn(clear(), name=f"leftovers-{worker_id}")

    async def cleared(self, worker_id: str) -> None:
        """Wait until what the worker's last exit left behind is stopped (a restart starts after that)."""
        task = self._clearing.get(worker_id)
        if task is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(task)

    def watch_tree_member(self, wid: str, handle: WorkerHandle, pid: int, name: str) -> None:
        """A pidfd on a process of a worker's tree (e.g. vLLM's EngineCore): its exit is seen at once."""
        agent = self.agent
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
            if agent.closing or agent.is_restarting(wid) or agent.handles.get(wid) is not handle:
                return
            if not handle.process.is_running:
                return  # the whole worker went: the process watcher reports that
            reason = f"{name} (pid {pid}) exited while the API server (pid {handle.process.pid}) stays up"
            log.warning("worker %s: %s", wid, reason)
            agent.spawn(agent.signal(wid, "process", Severity.FATAL, reason, pid=pid), name=f"exited-{wid}")

        watched[pid] = fd
        loop.add_reader(fd, exited)

    async def watch_dying(self) -> None:
        """A process exit seen as it starts, not as it ends.

        A SIGKILLed process is marked exiting at once (``PF_EXITING`` in ``/proc/<pid>/stat``; its threads
        then exit one by one, and it turns zombie), but its exit completes, and a pidfd wakes, only when every
        thread has gone and its memory is freed: for a large multi-threaded process on a busy host, seconds
        later. So the worker's own process and the engine processes of its tree are read every
        ``exit_check_interval_s``, and the first sign of an exit is a fatal ``process`` signal at once. The
        exit watchers still do the rest (deregistration, ``worker.down``, leftovers) when the exit completes.
        """
        agent = self.agent
        while True:
            await agent.clock.sleep(agent.config.exit_check_interval_s)
            for wid, handle in list(agent.handles.items()):
                pid = handle.process.pid
                # Checked here, after the awaits of the workers before it: stopped on purpose, or replaced?
                if pid is None or agent.closing or agent.is_restarting(wid) or agent.handles.get(wid) is not handle \
                        or self._dying.get(wid) is handle:
                    continue
                for p in (pid, *self._tree_fds.get(wid, {})):
                    seen = exiting(p)
                    if seen is None:
                        continue
                    self._dying[wid] = handle
                    # Counted here, once: a restart ordered on this signal may replace the handle before the
                    # exit completes, and the exit watcher then counts nothing.
                    agent.metrics.exits.inc()
                    state, code = seen
                    what = "process" if p == pid else f"engine process {p}"
                    reason = f"{what} exited" + (f" with code {code}" if code is not None else "") + \
                        ("" if state == "zombie" else f" ({state}: seen as its exit began)")
                    log.warning("worker %s: %s", wid, reason)
                    await agent.signal(wid, "process", Severity.FATAL, reason, pid=p, exit_code=code)
                    break


class EngineWatch:
    """The *engine-frozen* detector's evidence: engine processes sampled, requests running read, probes sent."""

    def __init__(self, agent: NodeAgent, exits: ExitWatch) -> None:
        self.agent = agent
        self.exits = exits
        config = agent.config
        self.detector = EngineFrozenDetector(clock=agent.clock, no_progress_s=config.engine_no_progress_s,
                                             stall_s=config.engine_stall_s,
                                             probe_interval_s=config.engine_probe_interval_s)
        self.activity = EngineActivity(clock=agent.clock)  # evidence for the controller: is the engine computing?
        self._http = httpx.AsyncClient(timeout=2.0)
        self._running: dict[str, tuple[int, float]] = {}  # worker -> requests running per its metrics, read at
        self._reads: dict[str, asyncio.Task[None]] = {}  # a worker's /metrics read under way
        self._probes: dict[str, tuple[list[float], asyncio.Task[None]]] = {}  # a probe: [sent at] once written, task

    async def aclose(self) -> None:
        """Cancel the reads and probes under way (the agent is closing)."""
        tasks = [*self._reads.values(), *(t for _, t in self._probes.values())]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._reads.clear()
        self._probes.clear()
        await self._http.aclose()

    async def monitor(self) -> None:
        """Each worker's engine processes every ``engine_check_interval_s`` (state, CPU time, context switches).
        An engine that shows no progress has its /metrics read (requests running?) and, at most every
        ``engine_probe_interval_s``, gets a one-token probe, so that work is known to wait on it (see
        :class:`~fleetward.supervisor.detectors.EngineFrozenDetector`). Reads and probes run beside the
        sampling, which a frozen worker that answers nothing must not hold up.

        Only workers that registered (ready, with an exit watcher) are looked at. One still starting has
        nothing to judge: vLLM listens before its engine is handed work (its socket is bound first, the
        app served last), so a probe sent then waits in the socket's backlog while the idle engine is, rightly,
        not scheduled; that is not a freeze. A start that hangs is the start timeout's to catch."""
        agent = self.agent
        ticks = 0
        while True:
            await agent.clock.sleep(agent.config.engine_check_interval_s)
            ticks += 1
            for wid, handle in list(agent.handles.items()):
                if (handle.process.pid is None or not handle.process.is_running or agent.is_restarting(wid)
                        or not self.exits.is_registered(wid)):
                    continue  # no process to look at (a server known by URL only), being replaced, or starting
                sample = await asyncio.to_thread(self._sample, handle)
                if agent.handles.get(wid) is not handle or agent.is_restarting(wid):
                    continue
                watched = self.exits.tree(wid)
                for pid, name, _, _ in sample.processes:
                    if pid != handle.process.pid and pid not in watched:
                        self.exits.watch_tree_member(wid, handle, pid, name)
                signals = self.detector.observe(wid, sample)
                if sample.processes:
                    signals += self.activity.observe(wid, sum(p[3] for p in sample.processes))
                for sig in signals:
                    if sig.severity is not Severity.OK:
                        log.warning("worker %s: %s", wid, sig.reason)
                    await agent.signal(wid, sig.detector, sig.severity, sig.reason, **sig.extra)
                stalled = self.detector.probe_due(wid)
                if ticks % 8 == 0 or stalled or not self.detector.ran_last(wid):
                    self._start_read(wid, handle)
                if stalled:
                    self._start_probe(wid, handle)

    def _sample(self, handle: WorkerHandle) -> EngineSample:
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

    def _start_read(self, wid: str, handle: WorkerHandle) -> None:
        """Read the worker's requests running from its /metrics, unless a read is under way."""
        if wid in self._reads and not self._reads[wid].done():
            return
        clock = self.agent.clock

        async def read() -> None:
            try:
                r = await self._http.get(f"{handle.bind_url}/metrics", timeout=1.0)
                self._running[wid] = (int(parse_prometheus(r.text, (RUNNING,)).get(RUNNING, 0)), clock.monotonic())
            except (httpx.HTTPError, ValueError):
                self._running.pop(wid, None)

        self._reads[wid] = self.agent.spawn(read(), name=f"metrics-{wid}")

    def _start_probe(self, wid: str, handle: WorkerHandle) -> None:
        """A one-token request to the worker, unless one is under way: while it is unanswered, work waits."""
        if wid in self._probes and not self._probes[wid][1].done():
            return
        agent = self.agent
        config = agent.config
        body = {"model": handle.spec.model, "prompt": config.canary_prompt, "max_tokens": 1, "temperature": 0}

        sent: list[float] = []

        async def trace(event: str, _info: dict[str, Any]) -> None:
            if event == "http11.send_request_body.complete":
                sent.append(agent.clock.monotonic())

        async def probe() -> None:
            try:
                await self._http.post(f"{handle.bind_url}/v1/completions", json=body,
                                      timeout=config.canary_timeout_s + config.engine_stall_s,
                                      extensions={"trace": trace})
            except httpx.HTTPError:
                pass  # the answer does not matter: only how long the engine leaves it waiting
            finally:
                if agent.handles.get(wid) is handle:
                    self.detector.probe_done(wid)

        # Sent when its bytes are written, not when it is asked for: a held-up event loop may write it late.
        self._probes[wid] = (sent, agent.spawn(probe(), name=f"probe-{wid}"))


class GpuWatch:
    """The *gpu* detector: the host's GPU events, classified by the policy, signalled for the workers on that GPU.

    A source that cannot be read for a while (dcgm-exporter down) is logged when it fails and when it is back,
    and ``fleetward_agent_gpu_source_up`` says so meanwhile; its events resume with the next good poll.
    """

    def __init__(self, agent: NodeAgent, source: GpuHealthSource, policy: GpuPolicy) -> None:
        self.agent = agent
        self.source = source
        self.policy = policy
        self.degraded: set[int] = set()  # GPUs throttled right now
        self.failing: str | None = None  # why the source cannot be read now
        # What this detector last said of each worker: a level (a lost GPU, reported on every poll) is
        # written once, not once a poll. Forgotten when someone else writes the key (a fresh process).
        self.said: dict[str, tuple[Severity, str]] = {}

    async def poll(self) -> list[GpuEvent]:
        """One poll of the source (in a thread: NVML calls and HTTP block briefly); [] while it fails."""
        agent = self.agent
        try:
            events = await asyncio.to_thread(self.source.poll)
        except GpuSourceError as exc:
            if self.failing is None:
                log.error("GPU health cannot be read, GPU faults go unseen until it can: %s", exc)
            self.failing = str(exc)
            agent.metrics.gpu_source_up.labels(agent.gpu_choice.source).set(0)
            return []
        if self.failing is not None:
            log.warning("GPU health can be read again (it could not: %s)", self.failing)
            self.failing = None
        agent.metrics.gpu_source_up.labels(agent.gpu_choice.source).set(1)
        return events

    async def monitor(self) -> None:
        agent = self.agent
        while True:
            await agent.clock.sleep(agent.config.gpu_poll_interval_s)
            for event in await self.poll():
                await self.classify(event)

    async def classify(self, event: GpuEvent) -> None:
        agent = self.agent
        action: Action | None
        action, reason = self.policy.classify(event)
        if event.kind is GpuEventKind.THROTTLE_STOPPED:
            action = None  # clears the degraded mark below
            self.degraded.discard(event.gpu)
        elif action is Action.IGNORE:
            return
        elif action is Action.DEGRADED:
            self.degraded.add(event.gpu)
        severity, extra = Severity.OK, {}
        if action is Action.DRAIN_AND_QUARANTINE:
            severity, extra = Severity.FATAL, {"action": "quarantine"}
        elif action is Action.RESTART_WORKER:
            severity, extra = Severity.FATAL, {"action": "restart"}
        elif action is Action.DEGRADED:
            severity = Severity.DEGRADED
        for wid, spec in list(agent.specs.items()):
            if event.gpu not in spec.gpus or self.said.get(wid) == (severity, reason):
                continue
            self.said[wid] = (severity, reason)
            await agent.signal(wid, "gpu", severity, reason, gpu=event.gpu, **extra)


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
