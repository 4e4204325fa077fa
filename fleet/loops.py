"""The owner of a service's background tasks: named loops that restart, and one-off tasks that are reaped.

A service (router, node agent, controller) holds one :class:`Loops` for its lifetime, either as a scope::

    async with Loops(service="router", metrics=LoopMetrics(registry)) as loops:
        loops.run("fleet-view", view.run)
        ...

or across its own lifecycle: ``loops.start()`` in the service's ``start()``, ``await loops.aclose()`` in its
``aclose()``.

Contract (``asyncio.TaskGroup`` ownership, with failures contained instead of tearing the group down):

- ``run(name, factory)`` starts a long-running loop ``factory()``. If it raises (anything but cancellation)
  the error is logged with its traceback, counted in ``fleetward_loop_restarts_total{service,loop}``, and
  ``factory()`` is called again after a backoff (capped exponential by default: 0.1 s doubling to 30 s; the
  count of consecutive crashes starts again once a run lasted ``healthy_after_s``). A loop that returns is
  done and is not restarted. Names are unique among the live loops.
- ``spawn(name, coro)`` owns a short one-off task: it is dropped from the set as soon as it finishes (nothing
  piles up), a failure is logged with its traceback (it does not stop the service), and it is cancelled and
  awaited on close.
- ``aclose()`` cancels every task and waits for all of them to finish; it is idempotent. If the caller is
  cancelled while waiting, the cancellation propagates (the tasks have all been told to stop). Leaving the
  ``async with`` block closes, and an exception from the block (cancellation included) propagates unchanged.
- ``run`` / ``spawn`` before ``start()`` or after ``aclose()`` raise :class:`RuntimeError`.

Time is injected (a :class:`~fleetward.fleet.clock.Clock` for the backoff sleeps and run lengths).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from fleetward.fleet.clock import SYSTEM_CLOCK, Clock

__all__ = ["Backoff", "LoopMetrics", "Loops", "capped_exponential"]

log = logging.getLogger(__name__)

Backoff = Callable[[int], float]
"""Seconds to wait before restart number ``n`` (1 for the first restart after a crash)."""


def capped_exponential(initial: float = 0.1, cap: float = 30.0, factor: float = 2.0) -> Backoff:
    """``initial * factor**(n-1)``, at most ``cap``."""
    if initial < 0 or cap < 0 or factor < 1:
        raise ValueError("capped_exponential: initial and cap must be >= 0 and factor >= 1")

    def delay(n: int) -> float:
        return min(cap, initial * factor ** min(max(n - 1, 0), 64))

    return delay


class LoopMetrics:
    """The loop counters, on the service's registry (a private one when none is given)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.restarts = Counter("fleetward_loop_restarts", "Times a background loop raised and was set to restart, "
                                "by service and loop: one that keeps rising is crash-looping.", ["service", "loop"],
                                registry=r)


class Loops:
    """Named restarting loops and reaped one-off tasks, all cancelled and awaited on close."""

    def __init__(self, *, service: str, metrics: LoopMetrics | None = None, backoff: Backoff | None = None,
                 clock: Clock = SYSTEM_CLOCK, healthy_after_s: float = 60.0) -> None:
        self.service = service
        self.metrics = metrics if metrics is not None else LoopMetrics()
        self._backoff = backoff if backoff is not None else capped_exponential()
        self._clock = clock
        self._healthy_after_s = healthy_after_s
        self._tasks: set[asyncio.Task[None]] = set()
        self._loops: dict[str, asyncio.Task[None]] = {}
        self._state = "new"  # new -> open -> closed

    # lifecycle

    def start(self) -> Loops:
        if self._state != "new":
            raise RuntimeError(f"Loops({self.service}) already {'started' if self._state == 'open' else 'closed'}")
        self._state = "open"
        return self

    async def aclose(self) -> None:
        self._state = "closed"
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            # A cancelled caller gets CancelledError out of wait() (never swallowed); every task was told to stop.
            await asyncio.wait(tasks)

    async def __aenter__(self) -> Loops:
        return self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    # what is running

    @property
    def names(self) -> frozenset[str]:
        """Names of the loops still running."""
        return frozenset(self._loops)

    def __len__(self) -> int:
        """Tasks still owned (loops and unfinished one-off tasks)."""
        return len(self._tasks)

    # starting tasks

    def run(self, name: str, factory: Callable[[], Coroutine[Any, Any, object]]) -> asyncio.Task[None]:
        self._check_open(name)
        if name in self._loops:
            raise ValueError(f"Loops({self.service}): a loop named {name!r} is already running")
        task = self._own(self._supervise(name, factory), name)
        self._loops[name] = task
        task.add_done_callback(lambda _t: self._loops.pop(name, None))
        return task

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[None]:
        try:
            self._check_open(name)
        except RuntimeError:
            coro.close()  # never awaited: say so now, not as a "was never awaited" warning later
            raise
        return self._own(self._once(name, coro), name)

    # internals

    def _check_open(self, name: str) -> None:
        if self._state != "open":
            raise RuntimeError(f"Loops({self.service}) is {self._state}: cannot start {name!r}")

    def _own(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=f"{self.service}-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _supervise(self, name: str, factory: Callable[[], Coroutine[Any, Any, object]]) -> None:
        crashes = 0
        while True:
            began = self._clock.monotonic()
            try:
                await factory()
                return
            except Exception:
                if self._clock.monotonic() - began >= self._healthy_after_s:
                    crashes = 0
                crashes += 1
                delay = self._backoff(crashes)
                log.exception("%s: loop %s crashed (%d in a row); restarting in %.2fs", self.service, name,
                              crashes, delay)
                self.metrics.restarts.labels(self.service, name).inc()
            await self._clock.sleep(delay)

    async def _once(self, name: str, coro: Coroutine[Any, Any, Any]) -> None:
        try:
            await coro
        except Exception:
            log.exception("%s: task %s failed", self.service, name)
