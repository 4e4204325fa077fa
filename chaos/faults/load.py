"""Load faults: what clients do to a fleet, driven through the run's workload (the ``workload`` service).

===========================  ===========================================================================
fault                        what the clients do
===========================  ===========================================================================
``load.burst``               ``count`` requests at once (or spread over ``spread_s``), on top of the workload
``load.long_prompt_storm``   long prompts arrive at ``rate`` while the fault holds (prefill pressure)
``load.mass_cancel``         a share of open streams, and of new ones while the fault holds, disconnects
``load.retry_storm``         every failed request is retried at once, up to ``max_retries`` times
``load.slow_clients``        a share of the clients (open streams, and new ones while the fault holds) read
                             slowly (``read_delay_ms`` after each event) or stop reading for ``stall_s``
                             once they hold ``stall_after_tokens`` tokens; no other stream may wait on them
===========================  ===========================================================================

Load faults target the fleet as a whole and do not count towards the safety share.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
from collections.abc import Callable
from typing import Any

from pydantic import Field

from fleetward.chaos.experiment import Lengths
from fleetward.chaos.fault import FaultContext
from fleetward.chaos.faults._base import BaseFault, P, catalogued
from fleetward.chaos.workload import SlowRead, Workload
from fleetward.fleet.config import Frozen

__all__ = ["BurstFault", "LongPromptStorm", "MassCancel", "RetryStorm", "SlowClients"]


class BurstParams(Frozen):
    count: int = Field(50, ge=1, le=10_000, description="requests sent at once")
    spread_s: float = Field(0.0, ge=0, description="spread them evenly over this many seconds (0: all at once)")
    isl: Lengths | None = Field(None, description="prompt lengths (default: the workload's)")
    osl: Lengths | None = Field(None, description="output lengths (default: the workload's)")


class StormParams(Frozen):
    rate: float = Field(4.0, gt=0, le=1000, description="long prompts per second while the fault holds")
    isl: Lengths = Field(Lengths(dist="uniform", min=1024, max=1536), description="prompt lengths")
    osl: Lengths = Field(Lengths(value=8), description="output lengths")


class MassCancelParams(Frozen):
    share: float = Field(0.5, gt=0, le=1, description="share of open streams (and, while the fault holds, of "
                         "new ones) whose client disconnects mid-stream")
    after_tokens: int = Field(1, ge=1, description="a client disconnects once it has this many tokens")


class RetryStormParams(Frozen):
    max_retries: int = Field(5, ge=1, le=100, description="immediate retries per failed request")


class SlowClientParams(Frozen):
    share: float = Field(0.2, gt=0, le=1, description="share of the open streams and, while the fault holds, of new "
                         "ones whose client reads slowly")
    read_delay_ms: float = Field(50.0, ge=0, le=60_000, description="a slow client waits this long after each "
                                 "event before it reads the next")
    stall_after_tokens: int | None = Field(8, ge=1, description="once it holds this many tokens, it stops reading "
                                           "for stall_s (null: it never stalls)")
    stall_s: float = Field(5.0, ge=0, le=600, description="how long a stalled client reads nothing")


# Load faults target the fleet as a whole (no "target" kind of their own) and take nothing out of service.
_LOAD: dict[str, Any] = {"target": None, "counts_toward_share": False, "target_kinds": ("fleet",)}


class _LoadFault(BaseFault[P]):
    family = "load"

    def setup(self) -> None:
        self.tag = ""
        self.workload: Workload | None = None

    def _workload(self, ctx: FaultContext) -> Workload:
        w = ctx.service("workload")
        if not isinstance(w, Workload) or not w.running:
            raise RuntimeError(f"{self.name} needs a running workload")
        self.targets = ctx.resolve(self.target)
        self.tag = f"{self.name}@{w.elapsed():.3f}"
        return w

    @property
    def running(self) -> Workload:
        """The workload this fault acts on (set at injection)."""
        if self.workload is None:
            raise RuntimeError(f"{self.name} was not injected")
        return self.workload

    async def _until(self, ctx: FaultContext, predicate: Callable[[], bool]) -> bool:
        """Poll ``predicate`` (the runner bounds verify with a deadline)."""
        while True:
            if predicate():
                return True
            await asyncio.sleep(0.02)

    async def recover(self, ctx: FaultContext) -> None:
        return None

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        return True

    def describe(self) -> dict[str, Any]:  # no detail: what a load fault did is in its own keys
        return {"name": self.name, "family": self.family, "targets": self.targets,
                "params": self.params.model_dump(mode="json")}


@catalogued("a burst of requests at once (open loop, on top of the workload)", **_LOAD)
class BurstFault(_LoadFault[BurstParams]):
    name = "load.burst"

    async def inject(self, ctx: FaultContext) -> None:
        w = self._workload(ctx)
        self.workload = w
        p = self.params
        self.before = w.by_source[self.name]
        if p.spread_s <= 0:
            for _ in range(p.count):
                w.launch(w.new_request(self.name, isl=p.isl, osl=p.osl))
            return

        async def spread() -> None:
            for i in range(p.count):
                if i:
                    await w.clock.sleep(p.spread_s / p.count)
                w.launch(w.new_request(self.name, isl=p.isl, osl=p.osl))

        w.spawn(spread())

    async def verify(self, ctx: FaultContext) -> bool:
        return await self._until(ctx, lambda: self.running.by_source[self.name] - self.before >= 1)


@catalogued("long prompts arrive at a rate while the fault holds (prefill pressure)", **_LOAD)
class LongPromptStorm(_LoadFault[StormParams]):
    name = "load.long_prompt_storm"

    async def inject(self, ctx: FaultContext) -> None:
        w = self._workload(ctx)
        self.workload = w
        self.stop = asyncio.Event()
        self.before = w.by_source[self.name]
        p = self.params
        rng = random.Random(f"{w.seed}:{self.tag}")

        async def storm() -> None:
            while not self.stop.is_set() and w.running:
                w.launch(w.new_request(self.name, isl=p.isl, osl=p.osl))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(rng.expovariate(p.rate)):
                        await self.stop.wait()

        self.task = w.spawn(storm())

    async def verify(self, ctx: FaultContext) -> bool:
        return await self._until(ctx, lambda: self.running.by_source[self.name] - self.before >= 1)

    async def recover(self, ctx: FaultContext) -> None:
        self.stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        return self.task.done()

    def describe(self) -> dict[str, Any]:
        sent = self.workload.by_source[self.name] - self.before if self.workload is not None else 0
        return {**super().describe(), "sent": sent}


@catalogued("clients disconnect mid-stream: a share of open streams now, and of new ones while the fault "
            "holds", **_LOAD)
class MassCancel(_LoadFault[MassCancelParams]):
    name = "load.mass_cancel"

    async def inject(self, ctx: FaultContext) -> None:
        w = self._workload(ctx)
        self.workload = w
        p = self.params
        rng = random.Random(f"{w.seed}:{self.tag}")
        w.modes.cancel_share, w.modes.cancel_after = p.share, p.after_tokens
        w.modes.cancel_rng, w.modes.cancel_tag = rng, self.tag
        w.cancel_in_flight(p.share, p.after_tokens, rng, self.tag)

    async def verify(self, ctx: FaultContext) -> bool:
        return await self._until(ctx, lambda: self.running.cancelled_by[self.tag] >= 1)

    async def recover(self, ctx: FaultContext) -> None:
        m = self.running.modes
        if m.cancel_tag == self.tag:
            m.cancel_share, m.cancel_tag = 0.0, ""

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        return self.running.modes.cancel_tag != self.tag

    def describe(self) -> dict[str, Any]:
        done = self.workload.cancelled_by[self.tag] if self.workload is not None else 0
        return {**super().describe(), "cancelled": done}


@catalogued("clients retry every failed request at once while the fault holds", **_LOAD)
class RetryStorm(_LoadFault[RetryStormParams]):
    name = "load.retry_storm"

    async def inject(self, ctx: FaultContext) -> None:
        w = self._workload(ctx)
        self.workload = w
        w.modes.retries, w.modes.retry_tag = self.params.max_retries, self.tag

    async def verify(self, ctx: FaultContext) -> bool:
        # The storm is armed: clients now retry every failure at once. It needs failures to amplify, so
        # pair it with a fault that causes some.
        return self.running.modes.retry_tag == self.tag

    async def recover(self, ctx: FaultContext) -> None:
        m = self.running.modes
        if m.retry_tag == self.tag:
            m.retries, m.retry_tag = 0, ""

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        return self.running.modes.retry_tag != self.tag

    def describe(self) -> dict[str, Any]:
        done = self.workload.retried_by[self.tag] if self.workload is not None else 0
        return {**super().describe(), "retries": done}


@catalogued("a share of the clients read their streams slowly or stall for a while (no other stream may "
            "wait on them)", **_LOAD)
class SlowClients(_LoadFault[SlowClientParams]):
    name = "load.slow_clients"

    async def inject(self, ctx: FaultContext) -> None:
        w = self._workload(ctx)
        self.workload = w
        p = self.params
        pattern = SlowRead(self.tag, p.read_delay_ms / 1000, p.stall_after_tokens, p.stall_s, clock=w.clock)
        rng = random.Random(f"{w.seed}:{self.tag}")
        w.modes.slow, w.modes.slow_share, w.modes.slow_rng = pattern, p.share, rng
        for live in sorted(w.live.values(), key=lambda lv: lv.req):
            if live.source != "probe" and live.slow is None and rng.random() < p.share:
                live.slow = dataclasses.replace(pattern)
                w.slowed_by[self.tag] += 1
                ctx.record("note", text=f"{self.name}: the client of {live.req} reads slowly from now on",
                           req=live.req, slow=self.tag)

    async def verify(self, ctx: FaultContext) -> bool:
        return await self._until(ctx, lambda: self.running.slowed_by[self.tag] >= 1)

    async def recover(self, ctx: FaultContext) -> None:
        # New clients read normally again; those already slow stay slow until their stream ends.
        m = self.running.modes
        if m.slow is not None and m.slow.tag == self.tag:
            m.slow, m.slow_share = None, 0.0

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        m = self.running.modes
        return m.slow is None or m.slow.tag != self.tag

    def describe(self) -> dict[str, Any]:
        done = self.workload.slowed_by[self.tag] if self.workload is not None else 0
        return {**super().describe(), "slowed": done}
