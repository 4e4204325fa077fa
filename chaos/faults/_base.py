"""What every fault in the catalogue shares: parameters, the catalogue entry, bounded polling, probes."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import typing
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Generic, TypeVar

import httpx
import psutil
from pydantic import BaseModel, ConfigDict, Field

from fleetward.chaos.fault import CATALOGUE, Family, FaultContext, FaultSpec, Target, register
from fleetward.fleet.errors import FleetwardError
from fleetward.fleet.handle import AgentWorkers, Fleet, NotOurs

__all__ = ["BaseFault", "FaultCheckFailed", "FaultParams", "FaultUnavailable", "ParamsT", "catalogued", "cycle",
           "eventually"]

log = logging.getLogger("fleetward.chaos.faults")


class FaultUnavailable(FleetwardError):
    """The fault cannot be injected here (needs root, a cgroup controller, a service the run lacks, ...)."""


class FaultParams(BaseModel):
    """Parameters every fault takes. Validated strictly: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    verify_timeout_s: float = Field(10.0, gt=0, description="how long verify waits for the fault to show")
    recover_timeout_s: float = Field(60.0, gt=0, description="how long recovery may take")


P = TypeVar("P", bound=BaseModel)  # a fault's parameters (a FaultParams, or a plain frozen model: load faults)
ParamsT = TypeVar("ParamsT", bound=FaultParams)  # a family base's: its faults name theirs
FaultT = TypeVar("FaultT", bound="type[BaseFault[Any]]")


class BaseFault(Generic[P]):
    """Common state: parameters, target selector, resolved targets, and a ``detail`` dict for the journal.

    A fault names its parameters' model as the type argument and writes no ``__init__``::

        class KillWorker(BaseFault[KillParams]):
            name = "process.kill_worker"
            family = "process"

            def setup(self) -> None:  # its own state, empty until it is injected
                self._killed: dict[str, list[psutil.Process]] = {}

    ``Params`` (what the catalogue validates an experiment's ``params`` against) is that type argument;
    ``self.params`` is typed by it. Every fault takes the same :class:`~fleetward.chaos.fault.Target` selector.
    """

    name: ClassVar[str]
    family: ClassVar[Family]
    Params: ClassVar[type[BaseModel]] = FaultParams

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "Params" in vars(cls):  # said outright (a class made at run time, network's toxic faults)
            return
        for base in vars(cls).get("__orig_bases__", ()):
            args = typing.get_args(base)
            origin = typing.get_origin(base)
            if not (args and isinstance(origin, type) and issubclass(origin, BaseFault)):
                continue
            arg = args[0]
            if isinstance(arg, TypeVar):  # a family's generic base: its bound until a fault names its own
                arg = arg.__bound__
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                cls.Params = arg

    def __init__(self, params: P, target: Target) -> None:
        assert isinstance(params, self.Params), f"{self.name}: expected {self.Params.__name__}"
        self.params: P = params
        self.target = target
        self.targets: list[str] = []
        self.detail: dict[str, Any] = {}
        self.setup()

    def setup(self) -> None:
        """Make the fault's own state (what it injected, to undo at recovery); called once, at construction.
        A fault under a family base with state of its own (``GpuFault``) calls ``super().setup()`` first."""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "family": self.family, "targets": list(self.targets),
                "params": self.params.model_dump(mode="json"), "detail": dict(self.detail)}


def catalogued(summary: str, *, needs_root: bool = False, needs: tuple[str, ...] = (),
               target: str | None = "worker", **extra: Any) -> Callable[[FaultT], FaultT]:
    """Register the class in :data:`~fleetward.chaos.fault.CATALOGUE` under its ``name``, with its ``Params``.
    ``needs`` are the backend capabilities the fault acts through (``fault_switches``, ``model_reference``);
    ``target`` the kind of component it hits (None: it says ``target_kinds`` in ``extra``, as load faults do)."""

    def deco(cls: FaultT) -> FaultT:
        register(FaultSpec(name=cls.name, family=cls.family, summary=summary, params=cls.Params,
                           factory=cls, needs_root=needs_root, needs=needs,  # type: ignore[arg-type]
                           extra={**({"target": target} if target else {}), **extra}))
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
