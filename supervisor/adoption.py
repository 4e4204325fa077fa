"""Adopting servers fleetward did not start: a node agent's half that protects what someone else runs.

``attach/<id>`` in etcd lists the servers to adopt (written from the fleet file's ``attach:`` by
:func:`fleetward.fleet.registry.publish_attachments`, or by ``fleetward worker add``). The agent of the
entry's node adopts it:

1. it waits until the server answers (``/v1/models``: its model, when the entry names none, and its
   tokenizer, the model folder vLLM names as ``root`` when this host has it), then
   registers it under its lease like a worker of its own (``workers/<id>``, backend ``external``), so
   routers route and migrate its streams and the supervisor watches it;
2. with a process locator (pidfile, systemd unit, container, a match over command lines: a Kubernetes
   sidecar in the server's pod) the agent's process and engine detectors
   watch it too (its exit, a stopped or frozen EngineCore), and its GPUs are those on which NVML lists a
   process of its tree (unless the entry names them, ``gpus:``), so the gpu detector marks it;
3. a restart runs the entry's ``restart_command``, or with ``restart_by_exit`` ends the server's process tree
   for what runs it (the kubelet) to start it again; without either, the worker is deregistered (routers stop
   sending it work) and left for an operator. It is taken back by itself once it serves again as a new
   process (a new pid, or an answer after it had stopped answering), or when it is added again;
4. ``attach/<id>`` deleted (``fleetward worker remove``): the agent gives the server up; it keeps running.

Nothing here kills a server: only a restart the operator configured clears its old process tree first.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import orjson

from fleetward.fleet.backends import WorkerHandle, worker_ready
from fleetward.fleet.config import AttachConfig
from fleetward.fleet.errors import StoreError, UnavailableError
from fleetward.fleet.external import ExternalBackend, discover
from fleetward.fleet.procs import is_local_only
from fleetward.fleet.worker import WorkerSpec
from fleetward.supervisor.gpuhost import gpus_of

if TYPE_CHECKING:
    from fleetward.supervisor.agent import NodeAgent

__all__ = ["Adopter"]

log = logging.getLogger(__name__)

POLL_S = 2.0  # how often a server not (or no longer) answering is looked at


class Adopter:
    """The adopting half of a :class:`~fleetward.supervisor.agent.NodeAgent` (see the module docstring)."""

    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent
        self.entries: dict[str, AttachConfig] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def adopted(self, worker_id: str) -> bool:
        return worker_id in self.entries

    async def follow(self) -> None:
        """Adopt and give up servers as ``attach/`` says, for this node, until cancelled."""
        prefix = self.agent.keys.attach
        while True:
            try:
                snap = await self.agent.store.get_prefix(prefix)
                wanted = {kv.key[len(prefix):]: kv.value for kv in snap.items}
                for wid in [w for w in self.entries if w not in wanted]:
                    await self.give_up(wid)
                for wid, value in wanted.items():
                    self._put(wid, value)
                async for ev in self.agent.store.watch_prefix(prefix, start_revision=snap.revision + 1):
                    wid = ev.key[len(prefix):]
                    if ev.kind == "put":
                        self._put(wid, ev.value)
                    elif wid in self.entries:
                        await self.give_up(wid)
            except StoreError as exc:
                log.warning("attach watch lost (%s); reading again", exc)
                await self.agent.clock.sleep(POLL_S)

    def _put(self, worker_id: str, value: bytes) -> None:
        try:
            body = orjson.loads(value)
            entry = AttachConfig.model_validate({k: v for k, v in body.items() if k != "signature"})
        except (ValueError, AttributeError) as exc:
            log.error("ignoring attach/%s: %s", worker_id, exc)
            return
        if (entry.node or self.agent.node) != self.agent.node:
            return
        signer = self.agent.attach_signer
        restarts = entry.restart_command or entry.restart_by_exit
        if restarts and signer is not None and not signer.signed(worker_id, body):
            # Anyone with the fleet's etcd credentials could otherwise have this (root) agent run a command, or
            # end whatever process a forged match names.
            how = list(entry.restart_command) if entry.restart_command else "restart_by_exit"
            log.error("attach/%s: its restart (%s) is not signed with the admin token (written by hand, or "
                      "forged): not done; the server is adopted without it (drained and left for an operator when "
                      "it fails). Add it with `fleetward worker add` or a fleet file's attach:, which sign it",
                      worker_id, how)
            self.agent.metrics.attach_refused.inc()
            entry = entry.model_copy(update={"restart_command": (), "restart_by_exit": False})
        known = self.entries.get(worker_id)
        if known == entry and worker_id in self.agent.handles and self._tasks.get(worker_id) is None:
            return  # adopted and registered: nothing changed
        self.entries[worker_id] = entry
        self._start(worker_id, self._adopt(worker_id, entry))

    def _start(self, worker_id: str, coro: Coroutine[Any, Any, None]) -> None:
        old = self._tasks.pop(worker_id, None)
        if old is not None:
            old.cancel()
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks[worker_id] = task
        task.add_done_callback(lambda t: self._tasks.pop(worker_id, None) if self._tasks.get(worker_id) is t
                               else None)

    async def _adopt(self, worker_id: str, entry: AttachConfig) -> None:
        """Wait until the server answers, then register it (a server given up meanwhile is not)."""
        agent = self.agent
        found = await discover(entry.url)
        while found is None:
            await agent.clock.sleep(POLL_S)
            found = await discover(entry.url)
        model = entry.model or found[0]
        host, port = entry.host_port
        # A URL only this host reaches (http://127.0.0.1:8000 in a fleet file shared by every host) is
        # registered at the address other hosts reach this node at; the agent itself still uses it as given.
        advertise = agent.advertise_host if is_local_only(host) else None
        spec = WorkerSpec(id=worker_id, host=host, port=port, model=model, role=entry.role, node=agent.node,
                          advertise_host=advertise, gpus=entry.gpus or ())
        if advertise is not None:
            log.info("%s: %s is registered as %s, the address other hosts reach this node at (advertise_host)",
                     worker_id, entry.url, spec.url)
        backend = ExternalBackend(entry, model=model, tokenizer=found[1])
        agent.adopted_backend(worker_id, backend, spec)
        await agent.initial_health(worker_id)
        handle = await asyncio.to_thread(backend.adopt, spec)  # its locator runs a command or reads /proc
        await backend.wait_ready(handle, timeout=float("inf"))
        await self._find_gpus(worker_id, entry, handle)
        log.info("adopting %s at %s (model %s, process %s, GPUs %s)", worker_id, entry.url, model,
                 handle.process.pid if handle.process.pid is not None else "not watched: known by URL only",
                 list(handle.spec.gpus) or "none known")
        agent.handles[worker_id] = handle
        await agent.register(handle)

    async def _find_gpus(self, worker_id: str, entry: AttachConfig, handle: WorkerHandle) -> None:
        """The GPUs of a server that names none (``gpus:``): those whose compute processes (NVML's) are in its
        process tree, found once it serves (its engine holds its CUDA context by then)."""
        source = self.agent.gpu
        if entry.gpus is not None or source is None:
            return
        tree = [p.pid for p in handle.process.tree()]
        if not tree:
            return
        gpus = gpus_of(tree, await asyncio.to_thread(source.processes))
        if gpus != handle.spec.gpus:
            handle.spec = dataclasses.replace(handle.spec, gpus=gpus)
            self.agent.specs[worker_id] = handle.spec

    async def give_up(self, worker_id: str) -> None:
        """Stop protecting the server (it keeps running): deregistered, its records gone."""
        self.entries.pop(worker_id, None)
        task = self._tasks.pop(worker_id, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        log.info("giving %s up (it keeps running)", worker_id)
        await self.agent.forget(worker_id)

    def watch_for_return(self, worker_id: str, last_pid: int | None) -> None:
        """The server was left for an operator: take it back once it serves again as a new process."""
        entry = self.entries.get(worker_id)
        if entry is not None:
            self._start(worker_id, self._returned(worker_id, entry, last_pid))

    async def _returned(self, worker_id: str, entry: AttachConfig, last_pid: int | None) -> None:
        agent = self.agent
        backend = ExternalBackend(entry, model=agent.specs[worker_id].model,
                                  tokenizer=agent.backend_for(worker_id).tokenizer)
        went_away = False
        while True:
            await agent.clock.sleep(POLL_S)
            handle = await asyncio.to_thread(backend.adopt, agent.specs[worker_id])
            new_process = handle.process.pid is not None and handle.process.pid != last_pid
            serving = await worker_ready(entry.url.rstrip("/"))
            went_away = went_away or not serving
            if serving and (new_process or went_away):
                log.info("%s serves again (%s): taking it back", worker_id,
                         f"pid {handle.process.pid}" if new_process else "it answers again")
                await self._find_gpus(worker_id, entry, handle)
                agent.handles[worker_id] = handle
                with contextlib.suppress(UnavailableError):
                    await agent.register(handle)
                return

    async def aclose(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
