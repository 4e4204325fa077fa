"""Test doubles: faults that flip a simulated worker's own switches (``POST /admin/faults``).

They are trivial on purpose, so the engine's tests do not depend on the real fault families. Imported
through ``FLEETWARD_FAULT_MODULES=chaos_doubles`` (the conftest sets it; subprocesses get it with
``PYTHONPATH``), they register ``process.double_hang`` and ``process.double_wrong_tokens`` (named like
every fault: ``<family>.<name>``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from pydantic import BaseModel, Field

from fleetward.chaos.fault import CATALOGUE, Fault, FaultContext, FaultSpec, Target, register
from fleetward.chaos.faults._base import BaseFault, P, eventually, quietly
from fleetward.fleet.config import Frozen


class NoParams(Frozen):
    pass


class HangParams(Frozen):
    recover_delay_s: float = Field(0.0, ge=0, description="recovery takes this long (a worker slow to restart)")


class WrongParams(Frozen):
    after: int = Field(5, ge=0, description="corrupt every token from this output index on")


class _Switch(BaseFault[P]):
    family = "process"

    def on(self) -> dict[str, Any]:
        raise NotImplementedError

    def off(self) -> dict[str, Any]:
        raise NotImplementedError

    def took(self, state: dict[str, Any]) -> bool:
        raise NotImplementedError

    async def inject(self, ctx: FaultContext) -> None:
        self.targets = ctx.resolve(self.target)
        assert ctx.fleet is not None
        for w in self.targets:
            await ctx.fleet.fault(w, **self.on())

    async def verify(self, ctx: FaultContext) -> bool:
        assert ctx.fleet is not None
        return all([self.took(await ctx.fleet.state(w)) for w in self.targets])

    async def recover(self, ctx: FaultContext) -> None:
        # The supervisor may be restarting the worker meanwhile (it saw the hang): then there is nothing to
        # switch off, and the new process starts without the switch.
        await asyncio.sleep(getattr(self.params, "recover_delay_s", 0.0))
        assert ctx.fleet is not None
        for w in self.targets:
            await quietly(f"switch {self.name} off on {w}", ctx.fleet.fault(w, **self.off()))

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        fleet = ctx.fleet
        assert fleet is not None

        async def off() -> bool:
            return not any([self.took(await fleet.state(w)) for w in self.targets])

        return await eventually(off, 30.0, 0.1)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "family": self.family, "targets": self.targets,
                "params": self.params.model_dump()}


class SimHang(_Switch[HangParams]):
    name = "process.double_hang"

    def on(self) -> dict[str, Any]:
        return {"hang": True}

    def off(self) -> dict[str, Any]:
        return {"hang": False}

    def took(self, state: dict[str, Any]) -> bool:
        return bool(state["hung"])


class SimWrongTokens(_Switch[WrongParams]):
    name = "process.double_wrong_tokens"

    def on(self) -> dict[str, Any]:
        return {"wrong_tokens_after": self.params.after}

    def off(self) -> dict[str, Any]:
        return {"wrong_tokens_after": None}

    def took(self, state: dict[str, Any]) -> bool:
        return state["faults"]["wrong_tokens_after"] is not None


# A fault class takes its own parameters' model; the catalogue validates them before it calls the factory.
Factory = Callable[[BaseModel, Target], Fault]

for _spec in (
    FaultSpec("process.double_hang", "process", "test double: the simulated engine stops (hang switch)", HangParams,
              cast(Factory, SimHang), needs=("fault_switches",), extra={"target": "worker"}),
    FaultSpec("process.double_wrong_tokens", "process", "test double: the simulated engine emits wrong tokens",
              WrongParams, cast(Factory, SimWrongTokens), needs=("fault_switches",), extra={"target": "worker"}),
):
    if _spec.name not in CATALOGUE:
        register(_spec)


async def attachable(fleet: Any, root: Path, **state: Any) -> Path:
    """A router for ``fleet``, and the state file and admin token ``fleetward up`` would write for it under
    ``root`` (``state``: more fields of the state file): what ``chaos run --attach`` finds (test_run,
    test_chaos_safety)."""
    router = await fleet.start_router("router-0")
    state_dir = root / fleet.cluster
    state_dir.mkdir(parents=True)
    (state_dir / "admin-token").write_text(fleet.admin_token)
    (state_dir / "fleet.json").write_text(json.dumps({
        "cluster": fleet.cluster, "etcd": fleet.etcd_endpoints[0], "mqtt": fleet.mqtt, "router": router.url,
        "workers": {w: fleet.url(w) for w in fleet.worker_ids}, **state}))
    return root
