"""fleet/loops.py: restarting loops, reaped one-off tasks, close and cancellation. No sleeps race here:
every wait is on a condition (an event, a clock sleeper, a predicate polled once per loop turn)."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from fleetward.fleet.clock import ManualClock
from fleetward.fleet.loops import LoopMetrics, Loops, capped_exponential


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0)  # one loop turn: the conditions are plain state, not events


def restarts(metrics: LoopMetrics, service: str, loop: str) -> float:
    value = metrics.registry.get_sample_value("fleetward_loop_restarts_total", {"service": service, "loop": loop})
    return value or 0.0


def test_capped_exponential_doubles_up_to_the_cap() -> None:
    delay = capped_exponential(initial=0.5, cap=3.0)
    assert [delay(n) for n in (1, 2, 3, 4, 100_000)] == [0.5, 1.0, 2.0, 3.0, 3.0]


async def test_a_crashing_loop_is_logged_counted_and_restarted_after_its_backoff(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock()
    metrics = LoopMetrics(CollectorRegistry())
    asked: list[int] = []
    runs = 0
    steady = asyncio.Event()

    def backoff(n: int) -> float:
        asked.append(n)
        return 2.0

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs <= 2:
            raise RuntimeError(f"boom {runs}")
        steady.set()
        await asyncio.Event().wait()

    with caplog.at_level(logging.ERROR, logger="fleetward.fleet.loops"):
        async with Loops(service="router", metrics=metrics, backoff=backoff, clock=clock) as loops:
            loops.run("view", flaky)
            for crash in (1, 2):
                await until(lambda: clock.sleepers == 1)  # waiting out its backoff, not restarted early
                assert runs == crash and restarts(metrics, "router", "view") == crash
                clock.advance(1.9)
                assert clock.sleepers == 1
                clock.advance(0.1)
            await steady.wait()
            assert loops.names == {"view"}
    assert asked == [1, 2]
    assert runs == 3
    assert [r.exc_info[1].args for r in caplog.records if r.exc_info and r.exc_info[1]] == [("boom 1",), ("boom 2",)]


async def test_the_crash_count_starts_again_after_a_healthy_run() -> None:
    clock = ManualClock()
    asked: list[int] = []
    runs = 0

    def backoff(n: int) -> float:
        asked.append(n)
        return 1.0

    async def crashes_late() -> None:
        nonlocal runs
        runs += 1
        if runs == 2:
            await clock.sleep(10.0)  # a long healthy run before this crash
        raise RuntimeError("late")

    async with Loops(service="agent", backoff=backoff, clock=clock, healthy_after_s=10.0) as loops:
        loops.run("lease", crashes_late)
        await until(lambda: clock.sleepers == 1 and runs == 1)
        clock.advance(1.0)  # restart -> run 2 sleeps 10 s
        await until(lambda: runs == 2 and clock.sleepers == 1)
        clock.advance(10.0)  # run 2 crashes after a healthy 10 s
        await until(lambda: len(asked) == 2)
        clock.advance(1.0)
        await until(lambda: len(asked) == 3)
    assert asked == [1, 1, 2]


async def test_a_loop_that_returns_is_done_and_not_restarted() -> None:
    calls = 0

    async def once() -> None:
        nonlocal calls
        calls += 1

    async with Loops(service="router", backoff=lambda n: 0.0) as loops:
        task = loops.run("once", once)
        await task
        assert calls == 1 and loops.names == frozenset() and len(loops) == 0
        loops.run("once", once)  # the name is free again


async def test_loop_names_are_unique_while_running() -> None:
    async with Loops(service="router") as loops:
        loops.run("view", lambda: asyncio.Event().wait())
        with pytest.raises(ValueError, match="view"):
            loops.run("view", lambda: asyncio.Event().wait())


async def test_finished_spawned_tasks_are_not_retained() -> None:
    async def quick(i: int) -> int:
        await asyncio.sleep(0)
        return i

    async with Loops(service="router") as loops:
        tasks = [loops.spawn(f"t{i}", quick(i)) for i in range(100)]
        assert len(loops) == 100
        await asyncio.wait(tasks)
        await until(lambda: len(loops) == 0)  # done callbacks run one loop turn after completion


async def test_a_failing_spawned_task_is_logged_and_does_not_stop_the_others(
        caplog: pytest.LogCaptureFixture) -> None:
    survivor = asyncio.Event()

    async def fail() -> None:
        raise ValueError("bad")

    with caplog.at_level(logging.ERROR, logger="fleetward.fleet.loops"):
        async with Loops(service="router") as loops:
            other = loops.spawn("waits", survivor.wait())
            await loops.spawn("fails", fail())
            await until(lambda: len(loops) == 1)
            assert not other.done()
            survivor.set()
    assert any(r.exc_info and isinstance(r.exc_info[1], ValueError) for r in caplog.records)


async def test_close_cancels_and_awaits_every_task() -> None:
    started = asyncio.Event()
    cleaned: list[str] = []

    async def forever(name: str) -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)  # cleanup that itself awaits: close must wait for it
            cleaned.append(name)

    loops = Loops(service="agent").start()
    loop_task = loops.run("loop", lambda: forever("loop"))
    spawned = loops.spawn("once", forever("once"))
    await started.wait()
    await loops.aclose()
    assert sorted(cleaned) == ["loop", "once"]
    assert loop_task.cancelled() and spawned.cancelled()
    assert len(loops) == 0
    await loops.aclose()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        loops.run("late", lambda: forever("late"))
    coro = forever("never")
    with pytest.raises(RuntimeError, match="closed"):
        loops.spawn("late", coro)
    assert inspect.getcoroutinestate(coro) == "CORO_CLOSED"  # closed, so no "never awaited" warning


async def test_a_cancelled_loop_is_not_counted_or_restarted() -> None:
    metrics = LoopMetrics(CollectorRegistry())
    runs = 0

    async def forever() -> None:
        nonlocal runs
        runs += 1
        await asyncio.Event().wait()

    async with Loops(service="router", metrics=metrics, backoff=lambda n: 0.0) as loops:
        task = loops.run("view", forever)
        await until(lambda: runs == 1)
        task.cancel()
        await asyncio.wait([task])
        assert loops.names == frozenset()
    assert runs == 1 and restarts(metrics, "router", "view") == 0


async def test_cancelling_the_owner_propagates_and_still_cancels_its_tasks() -> None:
    inside = asyncio.Event()
    children: list[asyncio.Task[None]] = []

    async def service() -> None:
        async with Loops(service="router") as loops:
            children.append(loops.run("view", lambda: asyncio.Event().wait()))
            inside.set()
            await asyncio.Event().wait()

    owner = asyncio.create_task(service())
    await inside.wait()
    owner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await owner
    assert owner.cancelled()
    assert children[0].cancelled()


async def test_a_caller_cancelled_during_close_gets_its_cancellation() -> None:
    release = asyncio.Event()
    running = asyncio.Event()
    in_cleanup = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            running.set()
            await asyncio.Event().wait()
        finally:
            in_cleanup.set()
            await release.wait()

    loops = Loops(service="router").start()
    child = loops.run("slow", slow_to_stop)
    await running.wait()
    closer = asyncio.create_task(loops.aclose())
    await in_cleanup.wait()
    closer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closer
    assert not child.done()  # told to stop, still cleaning up
    release.set()
    await asyncio.wait([child])
    assert child.cancelled()
