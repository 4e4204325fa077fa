"""GPU faults: through the fleet's GPU health source (the fake one here), or DCGM injection on GPU hosts.

Targets are workers: a fault hits a GPU the worker owns (``WorkerSpec.gpus``; ``gpu`` picks which by
position, its first by default). The node agent must watch a source the fault can drive: the ``gpu``
service, which a :class:`~fleetward.chaos.harness.TestFleet` built with ``gpu=FakeGpuSource(n)`` and
``gpus_per_worker=k`` provides (``fleet.gpus_per_worker: k`` in an experiment file).

=========================  ========================================================================
fault                      what happens
=========================  ========================================================================
``gpu.xid``                an Xid on the GPU: 13, 31, 43 (application faults), 48, 63, 64, 74, 79,
                           92, 94, 95 (hardware faults), or any other code the policy knows
``gpu.ecc_dbe``            an uncorrectable double-bit ECC error (Xid 48 and the volatile DBE count)
``gpu.lost``               the GPU becomes inaccessible (``off_bus``: by Xid 79, fallen off the bus)
``gpu.thermal_throttle``   clocks slow down (``hw_thermal`` by default) and the worker really slows:
                           the sim's ``slowdown`` switch, or on vLLM a CPU cgroup limit on its process
                           tree (:class:`~fleetward.fleet.cgroups.CpuGroup`, root)
``gpu.silent_corruption``  the worker emits wrong tokens with HTTP 200 (the sim's ``wrong_tokens``
                           switch; no way exists to make vLLM compute wrong, so it is sim only)
=========================  ========================================================================

What "took effect" means (``verify``) follows the reaction the supervisor's policy
(:class:`~fleetward.supervisor.gpu.GpuPolicy`) prescribes for the event:

- *restart* (Xid 13, 31, 43, ...): the supervisor restarted the worker: its health record's restart count
  rose after the injection;
- *quarantine* (Xid 48, 63, 64, 74, 79, 92, 94, 95, ECC DBE, a lost GPU): the worker's health is
  ``quarantined`` and ``quarantine/<node>/<gpu>`` names it;
- *degraded* (throttling): the worker is ``suspect`` by the ``gpu`` detector, still routable, and it is
  slower for real (the switch is set, or the cgroup limits it);
- *silent corruption*: a greedy completion asked of the worker directly differs from the model's (the
  simulated model is a pure function of the prompt, so the right answer is known).

Without a supervisor controller nobody decides, so the bar is lower: the node agent's poll saw the event,
i.e. ``signals/<worker>/gpu`` carries the policy's verdict, stamped after the injection.

Recovery clears the GPU (reset or replaced: ``FakeGpuSource.clear``). A quarantined worker comes back
through the supervisor leader's control API, as an operator would bring it back
(``POST /v1/workers/<id>/quarantine/clear``: the supervisor runs the GPU self-test, then restarts it);
a restarted one needs nothing more. ``verify_recovered``: the worker is ``ready`` again and serves.

DCGM (``source: dcgm``, on a GPU host with DCGM's ``nv-hostengine`` running): the fault injects into
DCGM's field cache with ``dcgmi test --inject --gpuid <gpu> -f <field> -v <value>``:

========================  ========================================================================
fault                     DCGM field and value
========================  ========================================================================
``gpu.xid``               230 ``DCGM_FI_DEV_XID_ERRORS``: the Xid
``gpu.ecc_dbe``           230: 48, then 311 ``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL``: ``count``
``gpu.lost``              230: 79 (DCGM has no field for a lost GPU; Xid 79 is how one shows)
``gpu.thermal_throttle``  112 ``DCGM_FI_DEV_CLOCKS_EVENT_REASONS``: the reason's bit (``hw_thermal``
                          0x40, ``sw_thermal`` 0x20, ``hw_slowdown`` 0x08, ``hw_power_brake``
                          0x80), injected again every second while the fault holds (injected
                          samples age out of the cache); recovery injects 0
========================  ========================================================================

Injected values live in DCGM's cache only: DCGM's health watches, policies and ``dcgm-exporter`` see
them; NVML does not, so the node agent's :class:`~fleetward.supervisor.gpu.NvmlSource` never will.
Verifying a DCGM injection needs a DCGM-backed ``GpuHealthSource``, which fleetward does not have yet:
the hook is here so that such a source can be tested on a GPU host. Silent corruption cannot be injected
through DCGM. Where ``dcgmi`` or an NVIDIA GPU is missing, injection raises ``FaultUnavailable`` with the
reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import httpx
import orjson
from pydantic import Field, field_validator

from fleetward.chaos.fault import FaultContext
from fleetward.chaos.faults._base import (
    BaseFault,
    FaultParams,
    FaultUnavailable,
    catalogued,
    eventually,
    fleet_of,
    quietly,
    running_tree,
)
from fleetward.fleet.errors import FleetwardError
from fleetward.fleet.handle import Fleet
from fleetward.fleet.registry import read_fleet
from fleetward.supervisor.gpu import THROTTLE_REASONS, Action, GpuEvent, GpuEventKind, GpuPolicy

__all__ = ["DCGM_FIELDS", "DcgmInjector", "GpuFault"]

# DCGM field ids (dcgm_fields.h) and the clock-event reason bits, which DCGM shares with NVML.
DCGM_FIELDS = {"xid": 230, "ecc_dbe_volatile": 311, "clocks_event_reasons": 112}
_REASON_BITS = {"sw_power_cap": 0x04, "hw_slowdown": 0x08, "sw_thermal": 0x20, "hw_thermal": 0x40,
                "hw_power_brake": 0x80}
_POLICY = GpuPolicy()  # the agent's own (it classifies with the defaults)


class DcgmInjector:
    """``dcgmi test --inject`` on this host's DCGM host engine (see the module docstring)."""

    @staticmethod
    def unavailable_reason() -> str | None:
        if shutil.which("dcgmi") is None:
            return "DCGM injection needs `dcgmi` (datacenter-gpu-manager) and a running nv-hostengine"
        if not Path("/dev/nvidia0").exists():
            return "DCGM injection needs an NVIDIA GPU (no /dev/nvidia0)"
        return None

    @staticmethod
    def argv(gpu: int, field: int, value: int) -> list[str]:
        return ["dcgmi", "test", "--inject", "--gpuid", str(gpu), "-f", str(field), "-v", str(value)]

    async def inject(self, gpu: int, field: int, value: int) -> None:
        argv = self.argv(gpu, field, value)
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        out, _ = await proc.communicate()
        text = out.decode(errors="replace").strip()
        if proc.returncode != 0 or "success" not in text.lower():
            raise FleetwardError(f"{' '.join(argv)} failed ({proc.returncode}): {text[-300:]}")


class GpuParams(FaultParams):
    gpu: int = Field(0, ge=0, description="which of the worker's GPUs, by position (0: its first)")
    source: Literal["fleet", "dcgm"] = Field("fleet", description="fleet: the fleet's GPU health source (the "
                                             "fake one); dcgm: dcgmi test --inject on a GPU host")
    recover_timeout_s: float = Field(60.0, gt=0, description="how long the worker may take to be ready again")


GpuP = TypeVar("GpuP", bound=GpuParams)


class GpuFault(BaseFault[GpuP]):
    """A GPU event on each targeted worker's GPU, judged by the reaction the policy prescribes."""

    family = "gpu"
    dcgm: ClassVar[bool] = True  # whether DCGM can inject it

    def setup(self) -> None:
        self.gpus: dict[str, int] = {}  # worker -> the GPU hit (the source's index)
        self._since = 0.0
        self._before: dict[str, int] = {}  # worker -> restart count before the injection
        self._source: Any = None
        self._dcgm: DcgmInjector | None = None

    # -- what subclasses say --------------------------------------------------------------------------

    def event(self, gpu: int) -> GpuEvent:
        """The event the agent will see (classified by the policy to know the reaction to expect)."""
        raise NotImplementedError

    def apply(self, source: Any, gpu: int) -> None:
        raise NotImplementedError

    def dcgm_values(self) -> list[tuple[int, int]]:
        raise NotImplementedError

    @property
    def expected(self) -> Action:
        return _POLICY.classify(self.event(0))[0]

    # -- the life -------------------------------------------------------------------------------------

    async def inject(self, ctx: FaultContext) -> None:
        fleet = fleet_of(ctx)
        self.targets = ctx.resolve(self.target)
        p = self.params
        for w in self.targets:
            spec = fleet.spec(w)
            if not spec.gpus:
                raise FaultUnavailable(f"worker {w} owns no GPU: give the fleet a GPU source "
                                       "(fleet.gpus_per_worker: 1)")
            if p.gpu >= len(spec.gpus):
                raise FaultUnavailable(f"worker {w} owns {len(spec.gpus)} GPU(s); gpu: {p.gpu} is not one")
            self.gpus[w] = spec.gpus[p.gpu]
        self.detail.update(gpus=dict(self.gpus), expected=self.expected.value)
        health = (await read_fleet(fleet.store, fleet.keys)).health
        self._before = {w: int(health[w].extra.get("restart_count", 0)) if w in health else 0 for w in self.targets}
        self._since = time.time()
        if p.source == "dcgm":
            reason = DcgmInjector.unavailable_reason() if self.dcgm else f"{self.name} cannot be injected by DCGM"
            if reason:
                raise FaultUnavailable(reason)
            self._dcgm = DcgmInjector()
            for g in self.gpus.values():
                for field, value in self.dcgm_values():
                    await self._dcgm.inject(g, field, value)
            return
        try:
            self._source = ctx.service("gpu")
        except KeyError:
            raise FaultUnavailable("GPU faults need the fleet's GPU health source (the `gpu` service: "
                                   "fleet.gpus_per_worker > 0)") from None
        for g in self.gpus.values():
            self.apply(self._source, g)

    async def _signal(self, fleet: Fleet, worker: str) -> dict[str, Any] | None:
        kv = await fleet.store.get(fleet.keys.signal(worker, "gpu"))
        if kv is None:
            return None
        body: dict[str, Any] = orjson.loads(kv.value)
        return body if float(body.get("ts", 0)) >= self._since - 0.5 else None

    async def _reacted(self, fleet: Fleet, worker: str) -> bool:
        """Whether the supervisor reacted to the event on ``worker`` as the policy says (module docstring)."""
        if not fleet.supervised:
            sig = await self._signal(fleet, worker)
            if sig is None:
                return False
            want = {Action.RESTART_WORKER: ("fatal", "restart"), Action.DRAIN_AND_QUARANTINE: ("fatal", "quarantine"),
                    Action.DEGRADED: ("degraded", None)}.get(self.expected)
            return want is not None and sig.get("severity") == want[0] and sig.get("action") == want[1]
        h = (await read_fleet(fleet.store, fleet.keys)).health.get(worker)
        if h is None:
            return False
        if self.expected is Action.RESTART_WORKER:
            return int(h.extra.get("restart_count", 0)) > self._before.get(worker, 0)
        if self.expected is Action.DRAIN_AND_QUARANTINE:
            node = fleet.spec(worker).node
            return h.state.value == "quarantined" and await fleet.store.get(
                fleet.keys.quarantine_of(node, self.gpus[worker])) is not None
        if self.expected is Action.DEGRADED:
            return h.state.value == "suspect" and h.detector == "gpu"
        return False

    async def verify(self, ctx: FaultContext) -> bool:
        fleet = fleet_of(ctx)

        async def reacted() -> bool:
            return bool(self.gpus) and all([await self._reacted(fleet, w) for w in self.targets])

        ok = await eventually(reacted, self.params.verify_timeout_s, 0.1)
        self.detail["reaction"] = "seen" if ok else "none"
        return ok

    async def recover(self, ctx: FaultContext) -> None:
        fleet = fleet_of(ctx)
        if self._dcgm is not None:
            return  # DCGM's cached samples age out; a real GPU is reset by its operator
        for g in self.gpus.values():
            self._source.clear(g)  # reset or replaced: healthy, counters at zero, self-test passes
        if self.expected is Action.DRAIN_AND_QUARANTINE and fleet.supervised:
            for w in self.gpus:
                await quietly(f"clear the quarantine of {w}", self._unquarantine(fleet, w))

    async def _unquarantine(self, fleet: Fleet, worker: str) -> None:
        async def quarantined() -> bool:
            h = (await read_fleet(fleet.store, fleet.keys)).health.get(worker)
            return h is not None and h.state.value == "quarantined"

        # A quarantine on its way (the agent's next poll) still lands: wait for it before clearing it.
        if await eventually(quarantined, self.params.verify_timeout_s, 0.1):
            r = await fleet.supervisor_command(worker, "quarantine/clear")
            self.detail.setdefault("unquarantine", {})[worker] = r.status_code
            r.raise_for_status()

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        fleet = fleet_of(ctx)

        async def back() -> bool:
            health = (await read_fleet(fleet.store, fleet.keys)).health
            for w in self.targets:
                h = health.get(w)
                if fleet.supervised and (h is None or h.state.value != "ready"):
                    return False
                if not await fleet.worker_serving(w, timeout=5):
                    return False
            return True

        return await eventually(back, self.params.recover_timeout_s, 0.2)


# -- the catalogue ------------------------------------------------------------------------------------------


class XidParams(GpuParams):
    code: int = Field(..., ge=1, le=1023, description="the Xid: 13/31/43 restart the worker; 48/63/64/74/79/92/94/95 "
                      "quarantine the GPU (supervisor.gpu.DEFAULT_XID_RULES)")

    @field_validator("code")
    @classmethod
    def _acted_on(cls, code: int) -> int:
        action, _ = _POLICY.classify(GpuEvent(0, GpuEventKind.XID, 0.0, code=code))
        if action is Action.IGNORE:
            raise ValueError(f"the supervisor ignores Xid {code}: injecting it would show nothing")
        return code


@catalogued("an Xid on the worker's GPU: 13/31/43 restart the worker, 48/63/64/74/79/92/94/95 quarantine the GPU",
            requires=("gpus",))
class XidFault(GpuFault[XidParams]):
    name = "gpu.xid"

    def event(self, gpu: int) -> GpuEvent:
        p = self.params
        return GpuEvent(gpu, GpuEventKind.XID, 0.0, code=p.code)

    def apply(self, source: Any, gpu: int) -> None:
        p = self.params
        source.inject_xid(gpu, p.code)

    def dcgm_values(self) -> list[tuple[int, int]]:
        p = self.params
        return [(DCGM_FIELDS["xid"], p.code)]


class EccParams(GpuParams):
    count: int = Field(1, ge=1, description="how much the volatile double-bit count rises")


@catalogued("an uncorrectable double-bit ECC error (Xid 48): the GPU is quarantined", requires=("gpus",))
class EccDbeFault(GpuFault[EccParams]):
    name = "gpu.ecc_dbe"

    def event(self, gpu: int) -> GpuEvent:
        return GpuEvent(gpu, GpuEventKind.ECC_DBE, 0.0, count=1)

    def apply(self, source: Any, gpu: int) -> None:
        p = self.params
        source.inject_ecc_dbe(gpu, p.count)

    def dcgm_values(self) -> list[tuple[int, int]]:
        p = self.params
        return [(DCGM_FIELDS["xid"], 48), (DCGM_FIELDS["ecc_dbe_volatile"], p.count)]


class LostParams(GpuParams):
    off_bus: bool = Field(False, description="lost by an Xid 79 (fallen off the bus) rather than silently")


@catalogued("the GPU is lost (or falls off the bus: Xid 79): the GPU is quarantined", requires=("gpus",))
class LostFault(GpuFault[LostParams]):
    name = "gpu.lost"

    def event(self, gpu: int) -> GpuEvent:
        return GpuEvent(gpu, GpuEventKind.LOST, 0.0)

    def apply(self, source: Any, gpu: int) -> None:
        p = self.params
        if p.off_bus:
            source.inject_xid(gpu, 79)
        else:
            source.lose(gpu)

    def dcgm_values(self) -> list[tuple[int, int]]:
        return [(DCGM_FIELDS["xid"], 79)]


class ThrottleParams(GpuParams):
    reason: str = Field("hw_thermal", description="the clock-slowdown reason (hw_thermal, sw_thermal, hw_slowdown, "
                        "hw_power_brake; sw_power_cap is ignored by the policy)")
    slowdown: float = Field(3.0, gt=1, le=100, description="how much slower the worker gets: the sim's step-time "
                            "factor; on vLLM its tree is limited to (CPUs / slowdown) CPUs")

    @field_validator("reason")
    @classmethod
    def _known(cls, reason: str) -> str:
        if reason not in THROTTLE_REASONS:
            raise ValueError(f"unknown throttle reason {reason!r}; one of {sorted(THROTTLE_REASONS)}")
        if _POLICY.throttle[reason].action is Action.IGNORE:
            raise ValueError(f"the supervisor ignores {reason} (normal under load): injecting it would show nothing")
        return reason


@catalogued("thermal throttling: the worker is marked degraded (suspect, not restarted) and really slows down",
            requires=("gpus",))
class ThermalThrottle(GpuFault[ThrottleParams]):
    name = "gpu.thermal_throttle"

    def setup(self) -> None:
        super().setup()
        self._slowed: list[str] = []
        self._groups: dict[str, Any] = {}
        self._reinject: asyncio.Task[None] | None = None

    def event(self, gpu: int) -> GpuEvent:
        p = self.params
        return GpuEvent(gpu, GpuEventKind.THROTTLE_STARTED, 0.0, reasons=frozenset({p.reason}))

    def apply(self, source: Any, gpu: int) -> None:
        p = self.params
        source.throttle(gpu, p.reason)

    def dcgm_values(self) -> list[tuple[int, int]]:
        p = self.params
        return [(DCGM_FIELDS["clocks_event_reasons"], _REASON_BITS[p.reason])]

    async def inject(self, ctx: FaultContext) -> None:
        await super().inject(ctx)
        fleet = fleet_of(ctx)
        p = self.params
        if self._dcgm is not None:
            self._reinject = asyncio.create_task(self._keep_injecting(), name=f"{self.name}-dcgm")  # owned: recover
        for w in self.targets:
            tree = running_tree(fleet, w)
            if fleet.backend.fault_switches:
                await fleet.fault(w, slowdown=p.slowdown)
            else:
                from fleetward.fleet.cgroups import CpuGroup, cgroups_available

                if not cgroups_available():
                    raise FaultUnavailable("slowing a vLLM worker down needs a CPU cgroup (root and the cpu "
                                           "controller)")
                group = self._groups[w] = CpuGroup(f"throttle-{w}")
                group.limit(max(0.05, (os.cpu_count() or 1) / p.slowdown))
                group.add_tree(tree[0].pid)
            self._slowed.append(w)
        self.detail["slowed"] = list(self._slowed)

    async def _keep_injecting(self) -> None:
        assert self._dcgm is not None
        while True:
            await asyncio.sleep(1.0)
            for g in self.gpus.values():
                for field, value in self.dcgm_values():
                    with contextlib.suppress(FleetwardError):
                        await self._dcgm.inject(g, field, value)

    async def _slow(self, fleet: Fleet, worker: str) -> bool:
        if worker in self._groups:
            return True
        p = self.params
        return bool(float((await fleet.state(worker))["faults"]["slowdown"]) == p.slowdown)

    async def _reacted(self, fleet: Fleet, worker: str) -> bool:
        return await super()._reacted(fleet, worker) and await self._slow(fleet, worker)

    async def recover(self, ctx: FaultContext) -> None:
        fleet = fleet_of(ctx)
        if self._reinject is not None:
            self._reinject.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reinject
            for g in self.gpus.values():
                assert self._dcgm is not None
                await quietly(f"clear GPU {g}", self._dcgm.inject(g, DCGM_FIELDS["clocks_event_reasons"], 0))
        for w in self._slowed:
            group = self._groups.pop(w, None)
            if group is not None:
                group.limit(None)
                with contextlib.suppress(OSError):
                    group.remove()
            else:
                await quietly(f"speed {w} up", fleet.fault(w, slowdown=1.0))
        if self._source is not None:
            for g in self.gpus.values():
                self._source.unthrottle(g)


class CorruptionParams(GpuParams):
    probability: float = Field(1.0, gt=0, le=1, description="share of the tokens that come out wrong")


@catalogued("silent data corruption: the worker emits wrong tokens with HTTP 200 (vLLM cannot be made to compute "
            "wrong)", needs=("fault_switches", "model_reference"), requires=("gpus",))
class SilentCorruption(GpuFault[CorruptionParams]):
    """No GPU event: the source reports nothing (that is what makes it silent). Only the supervisor's golden
    canaries can catch it, and only on idle workers: a busy worker gets none."""

    name = "gpu.silent_corruption"
    dcgm = False
    _PROMPT = (40, 41, 42, 43, 44, 45, 46, 47)

    @property
    def expected(self) -> Action:
        return Action.IGNORE  # no GPU event, no policy verdict

    async def inject(self, ctx: FaultContext) -> None:
        p = self.params
        if p.source == "dcgm":
            raise FaultUnavailable("silent data corruption cannot be injected through DCGM")
        fleet = fleet_of(ctx)
        self.targets = ctx.resolve(self.target)
        if not fleet.backend.fault_switches or fleet.backend.reference() is None:
            raise FaultUnavailable(f"{self.name} needs simulated workers (their wrong_tokens switch and model)")
        for w in self.targets:
            spec = fleet.spec(w)
            self.gpus[w] = spec.gpus[p.gpu] if spec.gpus else -1
        self.detail["gpus"] = dict(self.gpus)
        for w in self.targets:
            await fleet.fault(w, wrong_tokens={"probability": p.probability})

    async def _reacted(self, fleet: Fleet, worker: str) -> bool:
        from fleetward.sim.model import SimModel

        if not fleet.processes(worker):
            return False
        n = 16
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            r = await client.post(f"{fleet.bind_url(worker)}/v1/completions",
                                  json={"model": fleet.backend.model_name, "prompt": list(self._PROMPT),
                                        "max_tokens": n, "temperature": 0, "ignore_eos": True,
                                        "return_token_ids": True})
        got = r.json()["choices"][0]["token_ids"]
        ref = fleet.backend.reference() or {}
        right = SimModel.of_reference(ref).continuation(self._PROMPT, n,
                                                                                       ignore_eos=True)
        self.detail.setdefault("probe", {})[worker] = {"got": got, "expected": right}
        return r.status_code == 200 and got != right

    async def recover(self, ctx: FaultContext) -> None:
        fleet = fleet_of(ctx)
        for w in self.targets:  # the supervisor may have restarted it already: then this is a no-op
            await quietly(f"clear wrong tokens on {w}", fleet.fault(w, wrong_tokens=None))

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        fleet = fleet_of(ctx)

        async def right() -> bool:
            return not any([await self._reacted(fleet, w) for w in self.targets])

        return await super().verify_recovered(ctx) and await eventually(right, self.params.recover_timeout_s, 0.2)
