"""Steady-state probes: the measurements an experiment's hypothesis is made of, in a registry.

A probe is an async function of a :class:`ProbeContext` and its validated arguments that returns a value
(a count, a share, a bool); the experiment's tolerance says whether the value is acceptable (see
:class:`fleetward.chaos.experiment.Probe`). Register one with :func:`probe`; experiment files name it in
``steady_state_hypothesis.probes[].probe``.

=====================  =================================================================================
probe                  value
=====================  =================================================================================
``workers_routable``   how many of the declared workers etcd says take new work
``routers_healthy``    how many routers answer ``/health`` with 200 (through their client proxies)
``requests``           the share of ``count`` probe requests through the routers that complete, and
                       exactly where the engine's output is known without a run (the simulated worker)
=====================  =================================================================================
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import BaseModel, Field

from fleetward.chaos.workload import Live, Workload, make_prompt
from fleetward.fleet.config import Frozen
from fleetward.fleet.handle import Fleet
from fleetward.fleet.registry import read_fleet
from fleetward.sim.model import SimModel

__all__ = ["PROBES", "NoArgs", "ProbeContext", "ProbeSpec", "RequestsProbeArgs", "probe"]


@dataclass(frozen=True)
class ProbeContext:
    """What a probe may look at: the fleet, the experiment's declared workers and routers, the workload."""

    fleet: Fleet
    workers: Sequence[str]  # the declared workers
    router_urls: Sequence[str]  # where clients connect
    workload: Workload | None
    seed: int
    name: str  # the probe's name in the experiment
    when: str  # before / after
    ignore_eos: bool = False


ProbeFn = Callable[[ProbeContext, Any], Awaitable[Any]]


@dataclass(frozen=True)
class ProbeSpec:
    name: str
    summary: str
    args: type[BaseModel]
    fn: ProbeFn


PROBES: dict[str, ProbeSpec] = {}


class NoArgs(Frozen):
    pass


def probe(name: str, summary: str, args: type[BaseModel] = NoArgs) -> Callable[[ProbeFn], ProbeFn]:
    """Register ``fn`` as the probe ``name`` taking ``args``."""

    def deco(fn: ProbeFn) -> ProbeFn:
        PROBES[name] = ProbeSpec(name, summary, args, fn)
        return fn

    return deco


@probe("workers_routable", "how many of the declared workers etcd says take new work")
async def workers_routable(ctx: ProbeContext, args: NoArgs) -> int:
    fleet = await read_fleet(ctx.fleet.store, ctx.fleet.keys)
    return sum(1 for w in fleet.routable() if w.id in ctx.workers)


@probe("routers_healthy", "how many routers answer /health with 200")
async def routers_healthy(ctx: ProbeContext, args: NoArgs) -> int:
    async with httpx.AsyncClient(timeout=3.0, trust_env=False) as http:
        n = 0
        for url in ctx.router_urls:
            with contextlib.suppress(httpx.HTTPError):
                n += (await http.get(f"{url}/health")).status_code == 200
        return n


class RequestsProbeArgs(Frozen):
    count: int = Field(4, ge=1, le=256)
    max_tokens: int = Field(16, ge=1)
    prompt_tokens: int = Field(16, ge=1)
    timeout_s: float = Field(30.0, gt=0)


@probe("requests", "the share of probe requests that complete (exactly, where the output is known)",
       RequestsProbeArgs)
async def requests(ctx: ProbeContext, args: RequestsProbeArgs) -> float:
    w = ctx.workload
    if w is None:
        raise RuntimeError("the requests probe needs the run's workload")
    ref = ctx.fleet.backend.reference()
    model = SimModel.of_reference(ref) if ref and ref.get("kind") == "model" else None
    results: list[bool] = []

    async def one(k: int) -> None:
        p = w.new_request("probe", prompt=make_prompt(ctx.seed, f"probe-{ctx.when}-{ctx.name}", k,
                                                       args.prompt_tokens), max_tokens=args.max_tokens)
        live = Live(f"p-{ctx.when}-{p.index:04d}", "probe", p)
        async with asyncio.timeout(args.timeout_s):
            out = await w.client.run(p, live, router_index=k)
        exact = True
        if model is not None and out.ok:
            prompt = w.client.reference_prompt(p)
            exact = list(out.tokens) == model.continuation(prompt, p.max_tokens, ignore_eos=ctx.ignore_eos)
        results.append(out.ok and exact)

    async with asyncio.TaskGroup() as tg:
        for k in range(args.count):
            tg.create_task(one(k))
    return round(sum(results) / len(results), 4)
