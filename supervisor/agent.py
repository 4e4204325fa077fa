"""The node agent: one per host. Starts this node's workers, registers them, reports their ups and downs.

- Each ready worker is registered under ``workers/<id>`` bound to the agent's lease: if the agent dies,
  the keys vanish within the lease TTL; a clean stop revokes the lease, so they vanish at once.
- The agent watches every worker process (a pidfd per process: an exit is seen immediately) and
  publishes ``worker.up`` / ``worker.down`` on the event bus.
- If etcd reports the lease expired (a partition longer than the TTL), the agent takes a new lease and
  registers its live workers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from fleetward.fleet.backends import WorkerBackend, WorkerHandle
from fleetward.fleet.bus import EventBus
from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.errors import FleetwardError, StoreUnavailable
from fleetward.fleet.etcd import LeaseKeeper, StateStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.procs import free_port, port_is_free
from fleetward.fleet.worker import HealthRecord, HealthState, WorkerRecord, WorkerSpec

__all__ = ["NodeAgent"]

log = logging.getLogger(__name__)

Progress = Callable[[str, str], None]  # (worker id, what happened)


class NodeAgent:
    def __init__(self, *, store: StateStore, bus: EventBus, keys: Keys, backend: WorkerBackend, node: str,
                 log_dir: Path, lease_ttl: int = 5, clock: Clock = SYSTEM_CLOCK,
                 worker_env: Mapping[str, str] | None = None) -> None:
        self.store = store
        self.bus = bus
        self.keys = keys
        self.backend = backend
        self.node = node
        self.log_dir = log_dir
        self.lease_ttl = lease_ttl
        self.clock = clock
        self.worker_env = dict(worker_env or {})
        self.handles: dict[str, WorkerHandle] = {}
        self.specs: dict[str, WorkerSpec] = {}
        self.failed: dict[str, str] = {}
        self._lease: LeaseKeeper | None = None
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._lease_task: asyncio.Task[None] | None = None
        self._closing = False

    async def start(self) -> None:
        self._lease = await LeaseKeeper(self.store, self.lease_ttl, clock=self.clock).__aenter__()
        self._lease_task = asyncio.create_task(self._renew_lost_lease(), name="agent-lease")

    async def start_workers(self, specs: Sequence[WorkerSpec], *, progress: Progress | None = None) -> None:
        """Launch every worker, then register each as soon as it is ready. Failures are recorded, not raised."""
        if self._lease is None:
            await self.start()
        note = progress or (lambda _w, _what: None)
        handles = []
        for spec in specs:
            self.specs[spec.id] = spec
            await self._set_health(spec.id, HealthState.STARTING, "launched", "agent")
            try:
                handle = self.backend.launch(spec, self.log_dir, self.worker_env)
            except FleetwardError as exc:
                await self._record_failure(spec.id, str(exc))
                note(spec.id, "failed")
                continue
            self.handles[spec.id] = handle
            handles.append(handle)
            note(spec.id, "launched")

        async def one(handle: WorkerHandle) -> None:
            try:
                await self.backend.wait_ready(handle)
            except FleetwardError as exc:
                await self.backend.stop(handle)
                self.handles.pop(handle.spec.id, None)
                await self._record_failure(handle.spec.id, str(exc))
                note(handle.spec.id, "failed")
                return
            await self._register(handle)
            note(handle.spec.id, "ready")

        async with asyncio.TaskGroup() as tg:
            for h in handles:
                tg.create_task(one(h))

    async def _record_failure(self, worker_id: str, reason: str) -> None:
        log.error("worker %s failed to start: %s", worker_id, reason)
        self.failed[worker_id] = reason
        first_line = reason.splitlines()[0] if reason else "failed to start"
        await self._set_health(worker_id, HealthState.DEAD, first_line, "agent")
        await self.bus.publish("worker.down", worker=worker_id, node=self.node, reason=first_line)

    async def _register(self, handle: WorkerHandle) -> None:
        spec = handle.spec
        await self._put_record(handle)
        await self._set_health(spec.id, HealthState.READY, "answered /health and /v1/models", "agent")
        await self.bus.publish("worker.up", worker=spec.id, url=spec.url, node=self.node, role=spec.role)
        self._watchers[spec.id] = asyncio.create_task(self._watch_exit(handle), name=f"watch-{spec.id}")

    async def _put_record(self, handle: WorkerHandle) -> None:
        assert self._lease is not None
        spec = handle.spec
        record = WorkerRecord(id=spec.id, url=spec.url, role=spec.role, model=spec.model, node=spec.node,
                              backend=handle.backend, gpus=spec.gpus, started_at=handle.started_at,
                              pid=handle.process.pid)
        await self.store.put(self.keys.worker(spec.id), record.to_json(), lease=self._lease.id)

    async def _set_health(self, worker_id: str, state: HealthState, reason: str, detector: str) -> None:
        record = HealthRecord(state, reason=reason, detector=detector, since=self.clock.wall())
        await self.store.put(self.keys.health_of(worker_id), record.to_json())

    async def _watch_exit(self, handle: WorkerHandle) -> None:
        code = await handle.process.wait_exit()
        if self._closing:
            return
        worker_id = handle.spec.id
        reason = f"process exited with code {code}"
        log.warning("worker %s: %s", worker_id, reason)
        self.handles.pop(worker_id, None)
        with contextlib.suppress(StoreUnavailable):
            await self.store.delete(self.keys.worker(worker_id))
            await self._set_health(worker_id, HealthState.DEAD, reason, "process")
        await self.bus.publish("worker.down", worker=worker_id, node=self.node, reason=reason, exit_code=code)

    async def restart(self, worker_id: str, *, spec: WorkerSpec | None = None) -> WorkerHandle:
        """Stop the worker's process tree (if any is left), start it again, wait until ready, register it.

        Raises :class:`~fleetward.fleet.errors.ProcessError` when the new process does not become ready.
        """
        old = self.handles.pop(worker_id, None)
        watcher = self._watchers.pop(worker_id, None)
        if watcher is not None:
            watcher.cancel()
        if old is not None:
            await self.backend.stop(old, grace=5)
        spec = spec or self.specs.get(worker_id)
        if spec is None:
            raise KeyError(f"unknown worker {worker_id}")
        if not port_is_free(spec.host, spec.port):
            spec = dataclasses.replace(spec, port=free_port(spec.host))
        self.specs[worker_id] = spec
        await self._set_health(worker_id, HealthState.STARTING, "restarting", "agent")
        handle = self.backend.launch(spec, self.log_dir, self.worker_env)
        self.handles[worker_id] = handle
        try:
            await self.backend.wait_ready(handle)
        except FleetwardError as exc:
            await self.backend.stop(handle)
            self.handles.pop(worker_id, None)
            await self._record_failure(worker_id, str(exc))
            raise
        self.failed.pop(worker_id, None)
        await self._register(handle)
        return handle

    async def _renew_lost_lease(self) -> None:
        while True:
            assert self._lease is not None
            await self._lease.lost.wait()
            log.warning("agent lease expired; registering %d worker(s) again under a new lease", len(self.handles))
            self._lease = await LeaseKeeper(self.store, self.lease_ttl, clock=self.clock).__aenter__()
            for handle in list(self.handles.values()):
                await self._put_record(handle)

    async def aclose(self, *, grace: float = 10.0) -> None:
        """Stop every worker (ordered), revoke the lease (keys vanish now), publish ``worker.down``."""
        self._closing = True
        for task in [*self._watchers.values(), *([self._lease_task] if self._lease_task else [])]:
            task.cancel()
        for task in [*self._watchers.values(), *([self._lease_task] if self._lease_task else [])]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        handles = list(self.handles.values())
        await asyncio.gather(*(self.backend.stop(h, grace=grace) for h in handles), return_exceptions=True)
        if self._lease is not None:
            await self._lease.aclose()
            self._lease = None
        with contextlib.suppress(StoreUnavailable):
            for worker_id in [*self.handles, *self.failed]:
                await self.store.delete(self.keys.health_of(worker_id))
        for h in handles:
            await self.bus.publish("worker.down", worker=h.spec.id, node=self.node, reason="stopped")
        self.handles.clear()
