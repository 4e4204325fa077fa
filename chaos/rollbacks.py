"""Rollbacks: what an experiment runs after its method, whatever happened, in a registry.

A rollback is an async function of a :class:`RollbackContext` and a deadline that mends the fleet and
returns what it did (journaled). Register one with :func:`rollback`; experiment files name it in
``rollbacks[].action``.

===================  ==============================================================================
rollback             what it does
===================  ==============================================================================
``restore_fleet``    everything below, and quarantines lifted (:meth:`Fleet.restore`)
``restart_dead``     start dead workers and routers again (not on an attached fleet: not ours)
``clear_sim_faults`` turn the simulated workers' fault switches off
``wait_routable``    wait until every declared worker is routable
===================  ==============================================================================
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from fleetward.fleet.handle import Fleet, NotOurs

__all__ = ["ROLLBACKS", "RollbackContext", "RollbackSpec", "rollback"]


@dataclass(frozen=True)
class RollbackContext:
    fleet: Fleet
    workers: Sequence[str]  # the declared workers
    routers_changed: Callable[[], None]  # the routers may have moved: clients look them up again


RollbackFn = Callable[[RollbackContext, float], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class RollbackSpec:
    name: str
    summary: str
    fn: RollbackFn


ROLLBACKS: dict[str, RollbackSpec] = {}


def rollback(name: str, summary: str) -> Callable[[RollbackFn], RollbackFn]:
    """Register ``fn`` as the rollback ``name``."""

    def deco(fn: RollbackFn) -> RollbackFn:
        ROLLBACKS[name] = RollbackSpec(name, summary, fn)
        return fn

    return deco


@rollback("restore_fleet", "back to healthy: quarantines lifted, fault switches off, dead parts restarted, routable")
async def restore_fleet(ctx: RollbackContext, timeout: float) -> dict[str, Any]:
    done = await ctx.fleet.restore(workers=ctx.workers, timeout=timeout)
    ctx.routers_changed()
    return {**{k: v for k, v in done.items() if v}, "routable": True}


@rollback("restart_dead", "start dead workers and routers again")
async def restart_dead(ctx: RollbackContext, timeout: float) -> dict[str, Any]:
    restarted: list[str] = []
    for w in ctx.workers:
        with contextlib.suppress(NotOurs):
            if not await ctx.fleet.worker_serving(w, timeout=5):
                await ctx.fleet.ensure_serving(w, timeout=timeout)
                restarted.append(w)
    for r in list(ctx.fleet.routers):
        if not r.is_running:
            await ctx.fleet.restart_router(r, timeout=timeout)
            restarted.append(r.id)
    ctx.routers_changed()
    return {"restarted": restarted}


@rollback("clear_sim_faults", "turn the simulated workers' fault switches off")
async def clear_sim_faults(ctx: RollbackContext, timeout: float) -> dict[str, Any]:
    cleared: list[str] = []
    if ctx.fleet.backend.fault_switches:
        for w in ctx.workers:
            with contextlib.suppress(httpx.HTTPError, KeyError):
                await ctx.fleet.fault(w, clear=True)
                cleared.append(w)
    return {"cleared": cleared}


@rollback("wait_routable", "wait until every declared worker is routable")
async def wait_routable(ctx: RollbackContext, timeout: float) -> dict[str, Any]:
    await ctx.fleet.wait_workers_routable(len(ctx.workers), timeout=timeout)
    return {"routable": True}
