"""KV-transfer faults, injected through the product's KV-transfer hook (:mod:`fleetward.fleet.kv`).

No P/D path exists yet. When it lands, the code that moves a request's KV cache from a prefill worker to a
decode worker calls :meth:`~fleetward.fleet.kv.KvTransferHook.transfer` on every transfer, before the
decode side uses it, and the chaos run provides the hook as the ``kv`` service
(``FleetContext(services={"kv": FaultyKvTransfer()})``). Outside chaos runs the hook is
:class:`~fleetward.fleet.kv.PassThrough`.

===================  ==========================================================================
fault                what the transfer does
===================  ==========================================================================
``kv.drop``          never arrives: :class:`KvTransferError` (``kind="dropped"``)
``kv.delay``         arrives ``delay_ms`` late
``kv.corrupt``       arrives with one byte of one block flipped (same length: only a checksum or
                     the decoded tokens show it)
``kv.truncate``      arrives with only the first ``keep`` share of its blocks
``kv.stall``         does not arrive until the fault is recovered (then it arrives whole)
``kv.prefill_dies``  ``blocks_before`` blocks arrive, then the prefill side dies:
                     :class:`KvTransferError` (``kind="prefill_died"``); with ``kill_worker``
                     the prefill worker's process is SIGKILLed too (needs a fleet)
===================  ==========================================================================

Each fault counts the transfers it hit (``verify``: at least one) and is removed on recovery
(``verify_recovered``: a probe transfer passes unchanged). While it verifies, a fault sends probe transfers
through the hook (``probe: true``, the default), the way network faults probe their link: until the P/D
path exists nothing else calls the hook, so the kv family is **hook only** (``fleetward chaos faults`` says
so): an experiment exercises the hook and the fault objects, and no request of the fleet goes through it.

Targets: ``{kind: kv}`` (the default), the fleet's one hook, ``kv``. KV faults do not count towards the
safety share: they act on transfers, not on a component's availability.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

from pydantic import Field

from fleetward.chaos.fault import FaultContext, Target
from fleetward.chaos.faults._base import BaseFault, FaultParams, FaultUnavailable, catalogued, eventually, fleet_of
from fleetward.fleet.kv import KvTransfer, KvTransferError

__all__ = ["FaultyKvTransfer", "KvRule"]


@dataclass(eq=False)
class KvRule:
    """One active KV fault inside :class:`FaultyKvTransfer`."""

    kind: Literal["drop", "delay", "corrupt", "truncate", "stall", "prefill_dies"]
    delay_ms: float = 0.0
    keep: float = 0.5
    blocks_before: int = 1
    on_die: Callable[[KvTransfer], Any] | None = None
    hits: int = 0
    released: asyncio.Event = field(default_factory=asyncio.Event)


class FaultyKvTransfer:
    """A :class:`KvTransferHook` with switchable faults (rules apply in the order they were added)."""

    def __init__(self) -> None:
        self.rules: list[KvRule] = []
        self.transfers = 0

    def add(self, rule: KvRule) -> KvRule:
        self.rules.append(rule)
        return rule

    def remove(self, rule: KvRule) -> None:
        if rule in self.rules:
            self.rules.remove(rule)
        rule.released.set()

    async def transfer(self, t: KvTransfer) -> KvTransfer:
        self.transfers += 1
        for rule in list(self.rules):
            if rule.released.is_set():
                continue
            rule.hits += 1
            if rule.kind == "drop":
                raise KvTransferError("dropped", t)
            if rule.kind == "delay":
                await asyncio.sleep(rule.delay_ms / 1000)
            elif rule.kind == "stall":
                await rule.released.wait()
            elif rule.kind == "corrupt" and t.blocks:
                first = next((i for i, b in enumerate(t.blocks) if b), None)
                if first is not None:
                    b = bytearray(t.blocks[first])
                    b[len(b) // 2] ^= 0xFF
                    t = replace(t, blocks=(*t.blocks[:first], bytes(b), *t.blocks[first + 1:]))
            elif rule.kind == "truncate":
                t = replace(t, blocks=t.blocks[:int(len(t.blocks) * rule.keep)])
            elif rule.kind == "prefill_dies":
                if rule.on_die is not None:
                    result = rule.on_die(t)
                    if asyncio.iscoroutine(result):
                        await result
                raise KvTransferError("prefill_died", t, blocks=min(rule.blocks_before, len(t.blocks)))
        return t


def _probe_transfer() -> KvTransfer:
    return KvTransfer("kv-probe", "probe-prefill", "probe-decode", (1, 2, 3), (b"\x01" * 64, b"\x02" * 64)).sealed()


def _outcome(t: asyncio.Task[KvTransfer]) -> str:
    """What a probe transfer met: intact, altered (same blocks, wrong bytes), n/2 blocks, dropped, held..."""
    if t.cancelled():
        return "held"
    exc = t.exception()
    if isinstance(exc, KvTransferError):
        return exc.kind
    if exc is not None:
        return f"{type(exc).__name__}: {exc}"
    got = t.result()
    if len(got.blocks) != 2:
        return f"{len(got.blocks)}/2 blocks"
    return "intact" if got.intact else "altered"


class KvParams(FaultParams):
    probe: bool = Field(True, description="send probe transfers through the hook while verifying (nothing else "
                        "calls it until the P/D path lands)")


_KV: dict[str, Any] = {"target": "kv", "counts_toward_share": False, "hook_only": True}


class _KvFault(BaseFault):
    family = "kv"
    kind: ClassVar[str]
    Params: ClassVar[type[FaultParams]] = KvParams

    def __init__(self, params: Any, target: Target) -> None:
        super().__init__(params, target)
        self._hook: FaultyKvTransfer | None = None
        self._rule: KvRule | None = None

    def rule(self, ctx: FaultContext) -> KvRule:
        return KvRule(self.kind)  # type: ignore[arg-type]

    async def inject(self, ctx: FaultContext) -> None:
        try:
            hook = ctx.service("kv")
        except KeyError:
            raise FaultUnavailable("KV faults need the `kv` service (a FaultyKvTransfer wired to the P/D path)"
                                   ) from None
        if not isinstance(hook, FaultyKvTransfer):
            raise FaultUnavailable(f"the kv service is a {type(hook).__name__}, not a FaultyKvTransfer")
        self._hook = hook
        self.targets = ctx.resolve(self.target)
        self._rule = hook.add(self.rule(ctx))

    async def verify(self, ctx: FaultContext) -> bool:
        rule, hook = self._rule, self._hook
        if rule is None or hook is None:
            return False
        p: Any = self.params
        probes: list[asyncio.Task[KvTransfer]] = []

        def hit() -> bool:
            if rule.hits > 0:
                return True
            if p.probe and all(t.done() for t in probes):
                probes.append(asyncio.create_task(hook.transfer(_probe_transfer()), name=f"{self.name}-probe"))
            return False

        try:
            ok = await eventually(hit, self.params.verify_timeout_s, 0.02)
            if probes:  # let a probe finish (a delayed one arrives; a stalled one stays held), for the journal
                await asyncio.wait(probes, timeout=0.05 + getattr(p, "delay_ms", 0.0) / 1000)
        finally:
            for t in probes:
                t.cancel()
            if probes:
                await asyncio.wait(probes)
        outcomes = [_outcome(t) for t in probes]
        self.detail.update(hits=rule.hits, probes=outcomes)
        return ok

    async def recover(self, ctx: FaultContext) -> None:
        if self._hook is not None and self._rule is not None:
            self._hook.remove(self._rule)
            self.detail["hits"] = self._rule.hits

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        if self._hook is None or self._rule in self._hook.rules:
            return False
        probe = _probe_transfer()
        try:
            got = await asyncio.wait_for(self._hook.transfer(probe), self.params.recover_timeout_s)
        except (KvTransferError, TimeoutError):
            return False
        return got.intact and got.blocks == probe.blocks


@catalogued("KV transfers are dropped (never arrive)", **_KV)
class KvDrop(_KvFault):
    name = "kv.drop"
    kind = "drop"


class KvDelayParams(KvParams):
    delay_ms: float = Field(500.0, ge=0)


@catalogued("KV transfers arrive delay_ms late", **_KV)
class KvDelay(_KvFault):
    name = "kv.delay"
    kind = "delay"
    Params = KvDelayParams

    def rule(self, ctx: FaultContext) -> KvRule:
        p: Any = self.params
        return KvRule("delay", delay_ms=p.delay_ms)


@catalogued("KV transfers arrive with one byte flipped", **_KV)
class KvCorrupt(_KvFault):
    name = "kv.corrupt"
    kind = "corrupt"


class KvTruncateParams(KvParams):
    keep: float = Field(0.5, ge=0, lt=1, description="share of the blocks that arrive")


@catalogued("KV transfers arrive with only their first blocks", **_KV)
class KvTruncate(_KvFault):
    name = "kv.truncate"
    kind = "truncate"
    Params = KvTruncateParams

    def rule(self, ctx: FaultContext) -> KvRule:
        p: Any = self.params
        return KvRule("truncate", keep=p.keep)


@catalogued("KV transfers stall until recovery (then arrive whole)", **_KV)
class KvStall(_KvFault):
    name = "kv.stall"
    kind = "stall"


class KvPrefillDiesParams(KvParams):
    blocks_before: int = Field(1, ge=0, description="blocks that arrive before the prefill side dies")
    kill_worker: bool = Field(False, description="also SIGKILL the prefill worker's process (needs a fleet)")


@catalogued("the prefill side dies mid-transfer (optionally its worker process is killed)", **_KV)
class KvPrefillDies(_KvFault):
    name = "kv.prefill_dies"
    kind = "prefill_dies"
    Params = KvPrefillDiesParams

    def rule(self, ctx: FaultContext) -> KvRule:
        p: Any = self.params
        on_die = None
        if p.kill_worker:
            fleet = fleet_of(ctx)

            def on_die(t: KvTransfer) -> None:
                fleet.kill(t.source)

        return KvRule("prefill_dies", blocks_before=p.blocks_before, on_die=on_die)
