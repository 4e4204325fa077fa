"""Faults are objects: inject → verify it took effect → recover → verify recovery.

Every fault in the catalogue implements :class:`Fault`. The experiment runner drives each one through its
life and journals every step with timestamps. A fault whose :meth:`~Fault.verify` fails ("the fault did
nothing") fails the run: a chaos run that injected nothing proves nothing.

Faults act on a running fleet through :class:`FaultContext`. It holds the fleet harness (workers,
routers, etcd, broker), the network proxies components are wired through, the fake GPU health source,
and the history recorder. Targets are resolved from a selector (:class:`Target`) against the declared
fleet. A target outside it is refused, which is one of the safety rules.

Families: ``process``, ``gpu``, ``network``, ``kv`` (KV transfer), ``control`` (etcd, broker, routers,
supervisor leader) and ``load``. Every fault is named ``<family>.<name>`` with a snake_case name
(``process.kill_worker``, ``network.sse_cut``, ``gpu.xid``, ``load.burst``); :func:`register` refuses
any other name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict

from fleetward.fleet.bus import FAULT_FAMILIES
from fleetward.fleet.handle import Fleet
from fleetward.fleet.infra import LocalBroker, LocalEtcd

__all__ = [
    "CATALOGUE",
    "FAMILIES",
    "EtcdCluster",
    "Fault",
    "FaultContext",
    "FaultSpec",
    "Launcher",
    "OwnBroker",
    "Target",
    "register",
]

FAMILIES = FAULT_FAMILIES
Family = Literal["process", "gpu", "network", "kv", "control", "load", "partition"]


class Target(BaseModel):
    """Which part of the fleet a fault hits.

    ``kind`` names the component (worker, router, etcd, broker, link, supervisor, gpu, kv, fleet); ``ids``
    picks by id, or ``pick`` chooses ``count`` of them (``random`` uses the experiment's seed, ``serving``
    the ones with the most requests in flight at injection time, ``first`` the lowest ids). ``kv`` is the
    fleet's KV-transfer hook (one id, ``kv``, until the prefill/decode path names its transfer links);
    ``supervisor`` means the supervisor's controllers (the leader-kill fault picks the leader itself).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["worker", "router", "etcd", "broker", "link", "supervisor", "gpu", "kv", "fleet", "host"] = "worker"
    ids: tuple[str, ...] = ()
    pick: Literal["random", "serving", "first", "all"] = "random"
    count: int = 1


class FaultContext(Protocol):
    """What a fault may touch. The runner provides it; faults never reach around it."""

    @property
    def fleet(self) -> Fleet | None: ...  # the running fleet (None: a fault that needs none, e.g. kv hooks)

    def resolve(self, target: Target) -> list[str]:
        """Concrete ids for ``target`` within the declared fleet (raises when outside it)."""
        ...

    def record(self, kind: str, **data: Any) -> None:
        """Append to the run's history (fault.start / fault.stop are recorded by the runner)."""
        ...

    def service(self, name: str) -> Any:
        """An optional collaborator by name (``KeyError`` when the run has none): ``proxy:<link>``,
        ``proxies``, ``gpu``, ``kv``, ``workload``, ``history``, ``supervisor``, and the levers of a fleet
        the testbed started itself: ``etcd-cluster`` (:class:`EtcdCluster`), ``broker``
        (:class:`OwnBroker`), ``launcher`` (:class:`Launcher`)."""
        ...


class EtcdCluster(Protocol):
    """The ``etcd-cluster`` service: the fleet's own etcd members (control faults stop and start them)."""

    etcd_cluster: list[LocalEtcd]
    log_dir: Path

    def etcd_member(self, name: str) -> LocalEtcd: ...


class OwnBroker(Protocol):
    """The ``broker`` service: the fleet's own MQTT broker, which it can start again on the same port."""

    broker_impl: LocalBroker | None

    async def restart_broker(self) -> None: ...


class Launcher(Protocol):
    """The ``launcher`` service: how a worker's process is started from its next (re)start on."""

    log_dir: Path

    def wrap_launch(self, worker: str, prefix: Sequence[str] | None) -> None:
        """Start ``worker`` as ``prefix + its usual argv`` (None: as usual again)."""
        ...


class Fault(Protocol):
    """One injected fault instance (its parameters are fixed at construction)."""

    name: ClassVar[str]
    family: ClassVar[Family]

    targets: list[str]  # resolved at injection

    async def inject(self, ctx: FaultContext) -> None:
        """Make the fault happen; return once it was applied (not necessarily observed)."""
        ...

    async def verify(self, ctx: FaultContext) -> bool:
        """Whether the fault took effect (e.g. the process is gone, the link drops packets)."""
        ...

    async def recover(self, ctx: FaultContext) -> None:
        """Undo what can be undone (resume, reconnect, restart); no-op for faults the system must heal."""
        ...

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        """Whether the part the fault hit is back in service (the steady state is checked separately)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Name, family, targets and parameters, for the journal and the report."""
        ...


@dataclass(frozen=True)
class FaultSpec:
    """A catalogue entry: how to build the fault from validated parameters."""

    name: str
    family: Family
    summary: str
    params: type[BaseModel]
    factory: Callable[[BaseModel, Target], Fault]
    needs_root: bool = False
    needs: tuple[str, ...] = ()  # backend capabilities (fleetward.fleet.backends), e.g. ("fault_switches",)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def works_on(self, capabilities: frozenset[str]) -> bool:
        """Whether the fault can act on workers of a backend with these capabilities."""
        return set(self.needs) <= capabilities


CATALOGUE: dict[str, FaultSpec] = {}
_NAME = re.compile(r"^(?P<family>[a-z]+)\.[a-z][a-z0-9]*(?:_[a-z0-9]+)*$")


def register(spec: FaultSpec) -> FaultSpec:
    """Add ``spec`` to the catalogue (``fleetward chaos faults`` lists it; experiments may name it).

    The name must be ``<family>.<snake_case_name>`` with the spec's own family (``process.kill_worker``).
    """
    if spec.family not in FAMILIES:
        raise ValueError(f"unknown fault family {spec.family}")
    m = _NAME.match(spec.name)
    if m is None or m["family"] != spec.family:
        raise ValueError(f"fault name {spec.name!r} must be {spec.family}.<snake_case_name> (e.g. "
                         f"{spec.family}.my_fault)")
    if spec.name in CATALOGUE:
        raise ValueError(f"fault {spec.name} registered twice")
    CATALOGUE[spec.name] = spec
    return spec
