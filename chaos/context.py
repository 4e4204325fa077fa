"""How chaos acts on a :class:`~fleetward.chaos.harness.TestFleet`: its fault context and its supervisor.

:class:`FleetContext` is the :class:`~fleetward.chaos.fault.FaultContext` faults act through (targets
resolved against the fleet, services such as proxies, etcd members, the fake GPUs, the KV hook);
:class:`HarnessSupervisor` is the ``supervisor`` service (kill and restart the supervisor's controllers).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import TYPE_CHECKING, Any

from fleetward.chaos.fault import Target
from fleetward.chaos.targets import resolve
from fleetward.fleet.launch import restart_service

if TYPE_CHECKING:
    from fleetward.chaos.harness import TestFleet

__all__ = ["FleetContext", "HarnessSupervisor"]


class HarnessSupervisor:
    """:class:`~fleetward.chaos.faults.control.SupervisorControl` over a :class:`TestFleet`'s controllers.

    ``kill`` of a controller process is a ``SIGKILL``: it neither resigns nor revokes its lease, so a
    standby takes over only once the lease expires (``supervisor.lease_ttl_s``), as after a real crash. An
    in-process controller can only be cancelled, and a cancelled one resigns on its way out (an orderly
    hand-over, not a crash): use controller processes to test a crash.
    """

    def __init__(self, fleet: TestFleet) -> None:
        self.fleet = fleet

    @property
    def ids(self) -> list[str]:
        return [c.id for c in self.fleet.controller_procs] + [c.id for c, _ in self.fleet.controllers]

    async def leader(self) -> str | None:
        leader = await self.fleet.leader()
        return None if leader is None else leader.id

    async def kill(self, controller: str) -> None:
        for c in self.fleet.controller_procs:
            if c.id == controller:
                c.process.kill()
                return
        for i, (ctl, task) in enumerate(self.fleet.controllers):
            if ctl.id == controller:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                del self.fleet.controllers[i]
                return
        raise KeyError(f"no controller {controller!r} (controllers: {', '.join(self.ids)})")

    def is_running(self, controller: str) -> bool:
        return any(c.id == controller and c.is_running for c in self.fleet.controller_procs) or any(
            c.id == controller and not task.done() for c, task in self.fleet.controllers)

    async def restart(self, controller: str) -> None:
        for c in self.fleet.controller_procs:
            if c.id == controller:
                await restart_service(c)
                return
        if controller not in self.ids:  # a cancelled in-process controller: a new one under the same id
            await self.fleet.start_controller(wait=False, controller_id=controller)


class FleetContext:
    """A :class:`~fleetward.chaos.fault.FaultContext` over a :class:`TestFleet`.

    ``resolve``: ``worker`` ids are the agent's workers, ``router`` the running routers, ``etcd`` the
    private cluster's members (``etcd-0`` ...), ``broker`` is ``broker`` (own broker only), ``link`` the
    proxies' link names (ids may be globs: ``*->etcd``). An id outside the fleet raises ``ValueError``
    (the safety rule). ``pick="serving"`` needs routers' live progress, which a synchronous resolve cannot
    read: it falls back to ``first``.
    ``service``: ``proxy:<link>`` (a :class:`~fleetward.chaos.net.Link`), ``proxies`` (the registry),
    ``etcd-cluster`` (the fleet), ``gpu`` (the fleet's GPU health source, when it has one), ``kv`` (the
    fleet's KV-transfer hook), ``supervisor`` (:class:`HarnessSupervisor`, when controllers run as
    processes: an in-process one can be cancelled, not crashed), and
    whatever was passed in ``services`` (which win).
    ``record`` appends to ``history`` (a :class:`~fleetward.chaos.history.History`) or to :attr:`records`.
    """

    def __init__(self, fleet: TestFleet, *, history: Any = None, seed: int = 0,
                 services: dict[str, Any] | None = None) -> None:
        self._fleet = fleet
        self.history = history
        self.records: list[tuple[str, dict[str, Any]]] = []
        self._rng = random.Random(seed)
        self._services = dict(services or {})

    @property
    def fleet(self) -> TestFleet:
        return self._fleet

    def universe(self, kind: str) -> list[str]:
        f = self._fleet
        if kind == "worker":
            return sorted(f.agent.specs)
        if kind == "router":
            return [r.id for r in f.routers]
        if kind == "etcd":
            return [m.name for m in f.etcd_cluster]
        if kind == "broker":
            return ["broker"] if f.broker_impl is not None else []
        if kind == "link":
            return f.proxies.names
        if kind == "fleet":
            return [f.cluster]
        if kind == "kv":  # the KV links: named by the prefill worker that sends on them
            return sorted(w for w, h in f.agent.handles.items() if h.spec.role == "prefill")
        if kind == "supervisor":
            return f.supervisor_control().ids
        known = self._services.get(kind)
        return list(getattr(known, "ids", []) or [])

    def resolve(self, target: Target) -> list[str]:
        return resolve(target, self.universe(target.kind), rng=self._rng)

    def record(self, kind: str, **data: Any) -> None:
        if self.history is not None:
            self.history.add(kind, **data)
        else:
            self.records.append((kind, data))

    def service(self, name: str) -> Any:
        if name.startswith("proxy:"):
            return self._fleet.proxies.get(name.removeprefix("proxy:"))
        if name == "proxies":
            return self._fleet.proxies
        if name in self._services:
            return self._services[name]
        if name in ("etcd-cluster", "launcher") or (name == "broker" and self._fleet.broker_impl is not None):
            return self._fleet
        if name == "gpu" and self._fleet.gpu is not None:
            return self._fleet.gpu
        if name == "supervisor" and self._fleet.controller_procs:  # an in-process controller cannot crash
            return self._fleet.supervisor_control()
        raise KeyError(f"no service {name!r} in this context")
