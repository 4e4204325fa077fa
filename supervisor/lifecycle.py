"""How the node agent starts, restarts and stops its workers, and says what a starting one is at.

- **Start** (:meth:`Lifecycle.start_workers`): every worker launched, then each registered once ready. One
  that fails to start is started again like a restart; one that never starts is recorded (``failed`` and a
  fatal ``start`` signal), not raised.
- **Restart** (:meth:`Lifecycle.restart`): what is left of the worker stopped, a delay, a GPU self-test
  first when it owns GPUs, then start attempts with tenacity's exponential backoff (``restart_attempts``),
  another port when its own was taken meanwhile. A server fleetward did not start and cannot restart is
  left for an operator.
- **Start phase** (:func:`reporting_start`): while a worker starts, the last line it logged, as an ``ok``
  ``start`` signal whenever it changes (``fleetward status`` shows it beside ``starting``).

Restarts and stops of one worker are serialised. Exits of a worker being restarted are expected: the
local detectors ask :meth:`Lifecycle.is_restarting` before they speak.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from tenacity import AsyncRetrying, RetryError, stop_after_attempt, wait_exponential

from fleetward.fleet.backends import WorkerHandle
from fleetward.fleet.clock import Clock
from fleetward.fleet.errors import FleetwardError, UnavailableError
from fleetward.fleet.external import LeftForOperator
from fleetward.fleet.procs import free_port, last_log_line, port_is_free, spread_cores
from fleetward.fleet.worker import ROLES, WorkerSpec
from fleetward.supervisor.gpuhost import assign
from fleetward.supervisor.signals import Severity

if TYPE_CHECKING:
    from fleetward.supervisor.agent import NodeAgent

__all__ = ["START_REPORT_S", "Lifecycle", "Progress", "reporting_start"]

log = logging.getLogger(__name__)

START_REPORT_S = 2.0  # how often a starting worker's phase (its last log line) is looked at, and said if it changed

Progress = Callable[[str, str], None]  # (worker id, what happened)


@contextlib.asynccontextmanager
async def reporting_start(handle: WorkerHandle, *, clock: Clock,
                          say: Callable[[str], Awaitable[None]]) -> AsyncIterator[None]:
    """While the worker starts, what it is at (the last line it logged) through ``say`` every ``START_REPORT_S``
    it changes. A line that cannot be said is not worth a failed start."""
    async def report() -> None:
        said = ""
        while True:
            await clock.sleep(START_REPORT_S)
            line = last_log_line(handle.process.log_tail(5))[:160]
            if line and line != said:
                said = line
                with contextlib.suppress(FleetwardError):
                    await say(line)

    # Owned by this block: cancelled and awaited when it ends, however it ends.
    task = asyncio.create_task(report(), name=f"agent-start-{handle.spec.id}")
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class Lifecycle:
    """The starting, restarting and stopping of one :class:`~fleetward.supervisor.agent.NodeAgent`'s workers."""

    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent
        self._restarting: set[str] = set()  # workers an action is restarting: their exits are expected
        self._locks: dict[str, asyncio.Lock] = {}  # one restart/stop of a worker at a time

    def is_restarting(self, worker_id: str) -> bool:
        return worker_id in self._restarting

    def _lock(self, worker_id: str) -> asyncio.Lock:
        return self._locks.setdefault(worker_id, asyncio.Lock())

    def _reporting(self, worker_id: str, handle: WorkerHandle) -> contextlib.AbstractAsyncContextManager[None]:
        """The start phase as an ``ok`` ``start`` signal; the leader's health record is not touched."""
        async def say(line: str) -> None:
            await self.agent.signal(worker_id, "start", Severity.OK, line)

        return reporting_start(handle, clock=self.agent.clock, say=say)

    async def start_workers(self, specs: Sequence[WorkerSpec], *, progress: Progress | None = None) -> None:
        agent = self.agent
        note = progress or (lambda _w, _what: None)
        launched: list[tuple[WorkerSpec, WorkerHandle | None, str]] = []
        for spec in specs:
            agent.specs[spec.id] = spec
            await agent.initial_health(spec.id)
            try:
                handle = agent.backend.launch(spec, agent.log_dir, agent.worker_env)
            except FleetwardError as exc:
                launched.append((spec, None, str(exc)))
                continue
            agent.handles[spec.id] = handle
            launched.append((spec, handle, ""))
            note(spec.id, "launched")

        async def one(spec: WorkerSpec, handle: WorkerHandle | None, failure: str) -> None:
            if handle is not None:
                try:
                    async with self._reporting(spec.id, handle):
                        await agent.backend.wait_ready(handle)
                    await agent.register(handle)
                    note(spec.id, "ready")
                    return
                except FleetwardError as exc:
                    await agent.backend.stop(handle)
                    agent.handles.pop(spec.id, None)
                    failure = str(exc)
            log.warning("worker %s did not start (%s); starting it again with backoff", spec.id, failure)
            note(spec.id, "retrying")
            try:
                await self.restart(spec.id, spec=spec, delay=agent.config.backoff_initial_s)
            except FleetwardError as exc:
                await self._start_failed(spec.id, str(exc))
                note(spec.id, "failed")
                return
            note(spec.id, "ready")

        async with asyncio.TaskGroup() as tg:
            for spec, launch, failure in launched:
                tg.create_task(one(spec, launch, failure))

    async def _start_failed(self, worker_id: str, reason: str) -> None:
        agent = self.agent
        log.error("worker %s failed to start: %s", worker_id, reason)
        agent.failed[worker_id] = reason
        first_line = reason.splitlines()[0] if reason else "failed to start"
        await agent.signal(worker_id, "start", Severity.FATAL, f"failed to start: {first_line}", action="dead")
        await agent.bus.publish("worker.down", worker=worker_id, node=agent.node, reason=first_line)

    async def start_new(self, worker_id: str, *, role: str = "aggregated") -> tuple[bool, str]:
        """A worker the leader asked for (scale-up): this node's backend and model, a free port."""
        agent = self.agent
        if worker_id in agent.handles:
            return True, "running already"
        own = [s for s in agent.specs.values() if s.cpus]  # its cores: as if this host had started one more
        gpus: tuple[int, ...] = ()
        if agent.gpu is not None and agent.gpus_per_worker:
            taken = {g for s in agent.specs.values() for g in s.gpus}
            gpus = assign(1, agent.gpus_per_worker, gpus=len(agent.gpu.gpus()), taken=taken)[0]
            if not gpus and not agent.backend.simulated:
                return False, (f"no {agent.gpus_per_worker} free GPU(s) on node {agent.node}: GPUs "
                               f"{sorted(taken)} are in use by its workers")
        spec = WorkerSpec(id=worker_id, host=agent.worker_host, port=free_port(agent.worker_host),
                          model=agent.backend.model_name, role=role if role in ROLES else "aggregated",
                          node=agent.node, advertise_host=agent.advertise_host, cpus=spread_cores(len(own) + 1)[-1],
                          gpus=gpus)
        await agent.start_workers([spec])
        failed = agent.failed.get(worker_id)
        return (False, failed.splitlines()[0]) if failed else (True, f"started on port {spec.port}")

    async def stop(self, worker_id: str) -> None:
        async with self._lock(worker_id):
            await self._stop(worker_id)

    async def _stop(self, worker_id: str) -> None:
        agent = self.agent
        agent.exits.forget_tree(worker_id)
        handle = agent.handles.pop(worker_id, None)
        backend = agent.backend_for(worker_id)
        if handle is not None and backend.owns_processes:
            await backend.stop(handle, grace=5)
        with contextlib.suppress(UnavailableError):
            await agent.store.delete(agent.keys.worker(worker_id))

    async def selftest(self, worker_id: str) -> tuple[bool, str]:
        spec = self.agent.specs.get(worker_id)
        if spec is None or not spec.gpus:
            return True, "no GPU to test"
        from fleetward.supervisor.gpu import run_selftest

        source = self.agent.gpu
        if source is None:
            return False, f"GPU(s) {list(spec.gpus)} have no health source to self-test them"
        for gpu in spec.gpus:
            result = await asyncio.to_thread(run_selftest, source, gpu)
            if not result.passed:
                return False, f"GPU {gpu}: {result.reason}"
        return True, f"GPU(s) {list(spec.gpus)} passed the self-test"

    async def restart(self, worker_id: str, *, spec: WorkerSpec | None = None, delay: float = 0.0) -> WorkerHandle:
        async with self._lock(worker_id):
            return await self._restart(worker_id, spec=spec, delay=delay)

    async def _restart(self, worker_id: str, *, spec: WorkerSpec | None, delay: float) -> WorkerHandle:
        agent = self.agent
        backend = agent.backend_for(worker_id)
        if not backend.can_restart:
            await agent.leave_for_operator(worker_id)
            raise LeftForOperator(f"{worker_id} is a server fleetward did not start, with no restart_command: "
                                  "drained and left for an operator (it is taken back once it serves again)")
        self._restarting.add(worker_id)
        try:
            agent.exits.forget_tree(worker_id)
            old = agent.handles.pop(worker_id, None)
            agent.exits.unwatch(worker_id)
            if old is not None:
                await backend.stop(old, grace=5)
            await agent.exits.cleared(worker_id)  # what an exit seen before this restart left behind
            spec = spec or agent.specs.get(worker_id)
            if spec is None:
                raise FleetwardError(f"unknown worker {worker_id} on node {agent.node}")
            if delay > 0:
                await agent.clock.sleep(delay)
            if spec.gpus:
                ok, reason = await self.selftest(worker_id)
                if not ok:
                    raise FleetwardError(f"self-test failed before restart: {reason}")
            agent.engines.detector.forget(worker_id)
            for sig in agent.engines.activity.forget(worker_id):
                await agent.signal(worker_id, sig.detector, sig.severity, sig.reason, **sig.extra)
            config = agent.config
            try:
                async for attempt in AsyncRetrying(stop=stop_after_attempt(config.restart_attempts),
                                                   wait=wait_exponential(multiplier=config.backoff_initial_s,
                                                                         max=config.backoff_max_s),
                                                   sleep=agent.clock.sleep, reraise=True):
                    with attempt:
                        # Our own worker moves to a free port; a server someone else runs keeps its address.
                        if backend.owns_processes and not port_is_free(spec.host, spec.port):
                            spec = dataclasses.replace(spec, port=free_port(spec.host))
                        agent.specs[worker_id] = spec
                        handle = backend.launch(spec, agent.log_dir, agent.worker_env)
                        agent.handles[worker_id] = handle
                        try:
                            async with self._reporting(worker_id, handle):
                                await backend.wait_ready(handle)
                        except FleetwardError:
                            agent.handles.pop(worker_id, None)
                            await backend.stop(handle, grace=2)
                            raise
            except RetryError as exc:  # pragma: no cover - reraise=True gives the last error instead
                raise FleetwardError(str(exc)) from exc
            await agent.register(handle)
            return handle
        finally:
            self._restarting.discard(worker_id)
