"""Time, injected.

This is the one module that reads ``time.monotonic`` / ``time.time`` and calls ``asyncio.sleep`` on behalf
of decision code. Detectors, planners and backoff policies take a :class:`Clock`; tests hand them a
:class:`ManualClock` and jump it instead of sleeping.

Monotonic seconds measure durations; wall seconds only stamp journals and events.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol

__all__ = ["SYSTEM_CLOCK", "Clock", "ManualClock", "SystemClock"]


class Clock(Protocol):
    """A source of time and of waiting."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards (for durations)."""
        ...

    def wall(self) -> float:
        """Seconds since the epoch (for timestamps people read)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of this clock's time."""
        ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


SYSTEM_CLOCK = SystemClock()


class ManualClock:
    """A clock that moves only when told to; sleepers wake when :meth:`advance` passes their deadline."""

    def __init__(self, start: float = 0.0, wall_offset: float = 1_700_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall_offset
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def monotonic(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._wall_offset + self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._seq), fut))
        await fut

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleeper whose deadline has passed."""
        if seconds < 0:
            raise ValueError("a monotonic clock cannot go backwards")
        self._now += seconds
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)

    @property
    def sleepers(self) -> int:
        """How many tasks are waiting on this clock."""
        return sum(1 for *_, fut in self._sleepers if not fut.done())
