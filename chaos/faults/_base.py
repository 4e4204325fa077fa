"""What every fault in the catalogue shares: parameters, the catalogue entry, bounded polling, probes."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import httpx
import psutil
from pydantic import BaseModel, ConfigDict, Field

from fleetward.chaos.fault import CATALOGUE, Family, FaultContext, FaultSpec, Target, register
from fleetward.fleet.errors import FleetwardError
from fleetward.fleet.handle import AgentWorkers, Fleet, NotOurs

__all__ = ["BaseFault", "FaultCheckFailed", "FaultParams", "FaultUnavailable", "catalogued", "cycle", "eventually"]

log = logging.getLogger("fleetward.chaos.faults")


class FaultUnavailable(FleetwardError):
    """The fault cannot be injected here (needs root, a cgroup controller, a service the run lacks, ...)."""


class FaultParams(BaseModel):
    """Parameters every fault takes. Validated strictly: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    verify_timeout_s: float = Field(10.0, gt=0, description="how long verify waits for the fault to show")
    recover_timeout_s: float = Field(60.0, gt=0, description="how long recovery may take")


class BaseFault:
    """Common state: parameters, target selector, resolved targets, and a ``detail`` dict for the journal."""

    name: ClassVar[str]
    family: ClassVar[Family]
    Params: ClassVar[type[FaultParams]] = FaultParams

    def __init__(self, params: BaseModel, target: Target) -> None:
        assert isinstance(params, self.Params), f"{self.name}: expected {self.Params.__name__}"
        self.params = params
        self.target = target
        self.targets: list[str] = []
        self.detail: dict[str, Any] = {}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "family": self.family, "targets": list(self.targets),
                "params": self.params.model_dump(mode="json"), "detail": dict(self.detail)}


def catalogued(summary: str, *, needs_root: bool = False, needs: tuple[str, ...] = (),
               target: str = "worker", **extra: Any) -> Callable[[type[BaseFault]], type[BaseFault]]:
    """Register the class in :data:`~fleetward.chaos.fault.CATALOGUE` under its ``name``. ``needs`` are the
    backend capabilities the fault acts through (``fault_switches``, ``model_reference``)."""

    def deco(cls: type[BaseFault]) -> type[BaseFault]:
        register(FaultSpec(name=cls.name, family=cls.family, summary=summary, params=cls.Params,
                           factory=cls, needs_root=needs_root, needs=needs,  # type: ignore[arg-type]
                           extra={"target": target, **extra}))
        return cls

    return deco


async def eventually(predicate: Callable[[], Any], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` (sync or async; exceptions count as false) until true or ``timeout`` passes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            result = predicate()
            if inspect.isawaitable(result):
                result = await result
        except (OSError, httpx.HTTPError, FleetwardError, TimeoutError, KeyError):
            result = False
        if result:
            return True
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(interval)


async def quietly(what: str, step: Awaitable[Any]) -> None:
    """Run one recovery step; log (do not raise) its failure so the other steps still run."""
    try:
        await step
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # recovery must go on whatever one step did
        log.warning("recovery step %s failed: %s", what, exc)


def fleet_of(ctx: FaultContext) -> Fleet:
    fleet = ctx.fleet
    if fleet is None:
        raise FaultUnavailable("this fault needs a running fleet")
    return fleet


def running_tree(fleet: Fleet, worker: str) -> list[psutil.Process]:
    """``worker``'s process tree, root first; :class:`FaultUnavailable` while it does not run (e.g. the
    supervisor is restarting it)."""
    tree = fleet.processes(worker)
    if not tree and not isinstance(fleet, AgentWorkers):  # attached: someone else runs its processes
        raise FaultUnavailable(f"{NotOurs(f'a process fault on worker {worker}')}: run the experiment on a fleet "
                               "it starts, or use the faults that act over the network (network, worker switches)")
    if not tree:
        raise FaultUnavailable(f"worker {worker} is not running")
    return tree


def service_of(ctx: FaultContext, name: str, why: str) -> Any:
    """``ctx.service(name)``, or :class:`FaultUnavailable` saying ``why`` it is needed."""
    try:
        return ctx.service(name)
    except KeyError:
        raise FaultUnavailable(why) from None


def suppress_all() -> contextlib.AbstractContextManager[None]:
    return contextlib.suppress(Exception)


class FaultCheckFailed(AssertionError):
    """A fault driven by :func:`cycle` took no effect, or its target did not recover (a failed test)."""


async def cycle(ctx: FaultContext, name: str, target: Target, **params: Any) -> Any:
    """Drive the catalogue's fault ``name`` through its whole life on ``target``: inject, verify it took
    effect, recover (always, even when verification failed), verify recovery. Returns the fault, whose
    ``detail`` says what it did; raises :class:`FaultCheckFailed` (an ``AssertionError``, so pytest shows
    it as a failed check) with the fault's description when a verification fails::

        fault = await cycle(ctx, "process.kill_worker", Target(kind="worker", ids=("node-w0",)), scope="tree")
    """
    spec = CATALOGUE[name]
    fault = spec.factory(spec.params(**params), target)
    try:
        await fault.inject(ctx)
        if not await fault.verify(ctx):
            raise FaultCheckFailed(f"{name} took no effect: {fault.describe()}")
    finally:
        await fault.recover(ctx)
    if not await fault.verify_recovered(ctx):
        raise FaultCheckFailed(f"{name} did not recover: {fault.describe()}")
    return fault
