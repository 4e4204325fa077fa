"""KV-transfer faults: on the wire between prefill and decode workers (docs/pd.md).

A prefill worker sends every KV transfer through its send hook (:mod:`fleetward.fleet.kv`); a simulated
worker's hook has fault switches (:mod:`fleetward.sim.kvfaults`), and these faults set them. So a KV fault
acts on the real transfers of the fleet's requests, on the wire, and the decode workers' checks and the
router's ``routing.kv_failure_policy`` meet it there.

===================  ==========================================================================
fault                what a transfer from a targeted prefill worker does
===================  ==========================================================================
``kv.drop``          never arrives (the connection is cut before the first block)
``kv.delay``         arrives ``delay_ms`` late
``kv.corrupt``       one byte of one block flipped on the wire (``at: wire``, its frame check fails) or
                     at the source (``at: source``: sound frames, wrong KV; only the digest shows it)
``kv.truncate``      only the first ``keep`` share of its blocks, then an end frame as if complete
``kv.duplicate``     a block comes twice
``kv.stale``         the blocks of the transfer sent before (freed blocks reused), framed soundly
``kv.stall``         does not arrive until recovery (the decode side times out first)
``kv.prefill_dies``  ``blocks_before`` blocks arrive, then the connection is cut; with
                     ``kill_worker`` the prefill worker's process exits there
===================  ==========================================================================

Targets: ``{kind: kv}`` (the default) names KV links by the prefill worker that sends on them, so its ids
are the fleet's prefill workers (``fleet.prefill_workers``). Each fault verifies that it acted: the
transfers it hit, counted by the worker; while none did, it sends a probe transfer of its own (prefill on
the target, pull and check as a decode worker would) and records what the probe met. Recovery removes the
switch and checks a probe transfer arrives intact. KV faults do not count towards the safety share: they
act on transfers, not on a component's availability. They need simulated workers (fault switches).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, ClassVar, TypeVar

import aiohttp
from pydantic import Field

from fleetward.chaos.fault import FaultContext
from fleetward.chaos.faults._base import BaseFault, FaultParams, FaultUnavailable, catalogued, eventually, fleet_of
from fleetward.fleet.handle import Fleet
from fleetward.fleet.kv import KvOffer, KvTransferError, pull

__all__ = ["probe_transfer"]

_PROBE_TIMEOUT_S = 2.0
_PROBE_PROMPT = [40 + (i * 7) % 60 for i in range(65)]  # ids every built-in vocabulary has; several KV blocks


async def probe_transfer(fleet: Fleet, worker: str, *, timeout: float = 10.0) -> str:
    """One KV transfer from prefill worker ``worker``, checked as a decode worker checks it: ``intact``,
    the :class:`KvTransferError` kind, ``no kv`` (the worker offered none) or the error met."""
    body = {"model": fleet.spec(worker).model, "prompt": _PROBE_PROMPT, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        try:
            async with session.post(fleet.bind_url(worker) + "/v1/completions", json=body) as r:
                answer = await r.json(content_type=None)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            return f"prefill failed: {type(exc).__name__}"
        offer = KvOffer.of(answer.get("kv_transfer_params") if isinstance(answer, dict) else None)
        if offer is None:
            return "no kv"
        try:
            await pull(session, offer, _PROBE_PROMPT, timeout=timeout)
        except KvTransferError as exc:
            return exc.kind
    return "intact"


class KvParams(FaultParams):
    probe: bool = Field(True, description="send probe transfers while verifying, until a transfer of the fleet's "
                        "own was hit")


_KV: dict[str, Any] = {"target": "kv", "counts_toward_share": False, "needs": ("fault_switches",)}


KvP = TypeVar("KvP", bound=KvParams)


class _KvFault(BaseFault[KvP]):
    family = "kv"
    kind: ClassVar[str]

    def setup(self) -> None:
        self.rule_id = f"{self.name}-{uuid.uuid4().hex[:8]}"

    def rule(self) -> dict[str, Any]:
        return {"id": self.rule_id, "kind": self.kind}

    async def _hits(self, fleet: Fleet) -> dict[str, int]:
        out: dict[str, int] = {}
        for w in self.targets:
            rules = (await fleet.fault(w)).get("kv") or []
            out[w] = sum(r["hits"] for r in rules if r.get("id") == self.rule_id)
        return out

    async def inject(self, ctx: FaultContext) -> None:
        fleet = fleet_of(ctx)
        if not fleet.backend.fault_switches:
            raise FaultUnavailable(f"KV faults act through the simulated worker's switches; {fleet.backend.name} "
                                   "workers have none")
        self.targets = ctx.resolve(self.target)
        if not self.targets:
            raise FaultUnavailable("KV faults need prefill workers (fleet.prefill_workers) to act on")
        for w in self.targets:
            await fleet.fault(w, kv={"add": self.rule()})

    async def verify(self, ctx: FaultContext) -> bool:
        fleet = fleet_of(ctx)
        p = self.params
        probes: list[asyncio.Task[str]] = []
        hits: dict[str, int] = {}

        async def hit() -> bool:
            nonlocal hits
            hits = await self._hits(fleet)
            if any(hits.values()):
                return True
            if p.probe and len(probes) < 3 and all(t.done() for t in probes):
                probes.append(asyncio.create_task(probe_transfer(fleet, self.targets[0], timeout=_PROBE_TIMEOUT_S)))
            return False

        try:
            ok = await eventually(hit, p.verify_timeout_s, 0.05)
            if probes:  # what the last probe met, for the journal (a stalled one times out)
                await asyncio.wait(probes, timeout=_PROBE_TIMEOUT_S + 1)
        finally:
            for t in probes:
                t.cancel()
            await asyncio.gather(*probes, return_exceptions=True)
        self.detail.update(hits=hits, probes=[t.result() if t.done() and not t.cancelled() and t.exception() is None
                                              else "held" for t in probes])
        return ok

    async def recover(self, ctx: FaultContext) -> None:
        fleet = fleet_of(ctx)
        for w in self.targets:
            try:
                got = await fleet.fault(w, kv={"remove": self.rule_id})
            except Exception as exc:  # a killed worker has no switches left to clear
                self.detail.setdefault("recover", {})[w] = f"{type(exc).__name__}: {exc}"
                continue
            self.detail.setdefault("hits_at_recovery", {})[w] = sum(
                r["hits"] for r in got.get("kv") or [] if r.get("id") == self.rule_id)

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        fleet = fleet_of(ctx)

        async def clean() -> bool:
            for w in self.targets:
                if any(r.get("id") == self.rule_id for r in (await fleet.fault(w)).get("kv") or []):
                    return False
                if await probe_transfer(fleet, w) != "intact":
                    return False
            return True

        return await eventually(clean, self.params.recover_timeout_s, 0.2)


@catalogued("KV transfers are dropped (never arrive)", **_KV)
class KvDrop(_KvFault[KvParams]):
    name = "kv.drop"
    kind = "drop"


class KvDelayParams(KvParams):
    delay_ms: float = Field(500.0, ge=0, le=3.6e6)


@catalogued("KV transfers arrive delay_ms late", **_KV)
class KvDelay(_KvFault[KvDelayParams]):
    name = "kv.delay"
    kind = "delay"

    def rule(self) -> dict[str, Any]:
        p = self.params
        return {**super().rule(), "delay_ms": p.delay_ms}


class KvCorruptParams(KvParams):
    at: str = Field("wire", pattern="^(wire|source)$", description="wire: after framing (a frame check fails); "
                    "source: before (sound frames, wrong KV: only the digest shows it)")


@catalogued("KV transfers arrive with one byte flipped", **_KV)
class KvCorrupt(_KvFault[KvCorruptParams]):
    name = "kv.corrupt"
    kind = "corrupt"

    def rule(self) -> dict[str, Any]:
        p = self.params
        return {**super().rule(), "at": p.at}


class KvTruncateParams(KvParams):
    keep: float = Field(0.5, ge=0, lt=1, description="share of the blocks that arrive")


@catalogued("KV transfers arrive with only their first blocks", **_KV)
class KvTruncate(_KvFault[KvTruncateParams]):
    name = "kv.truncate"
    kind = "truncate"

    def rule(self) -> dict[str, Any]:
        p = self.params
        return {**super().rule(), "keep": p.keep}


@catalogued("KV transfers carry a block twice", **_KV)
class KvDuplicate(_KvFault[KvParams]):
    name = "kv.duplicate"
    kind = "duplicate"


@catalogued("KV transfers carry stale blocks (another transfer's, framed soundly)", **_KV)
class KvStale(_KvFault[KvParams]):
    name = "kv.stale"
    kind = "stale"


@catalogued("KV transfers stall until recovery (then arrive whole)", **_KV)
class KvStall(_KvFault[KvParams]):
    name = "kv.stall"
    kind = "stall"


class KvPrefillDiesParams(KvParams):
    blocks_before: int = Field(1, ge=0, description="blocks that arrive before the prefill side dies")
    kill_worker: bool = Field(False, description="the prefill worker's process exits there too")


@catalogued("the prefill side dies mid-transfer (optionally its worker process exits)", **_KV)
class KvPrefillDies(_KvFault[KvPrefillDiesParams]):
    name = "kv.prefill_dies"
    kind = "prefill_dies"

    def rule(self) -> dict[str, Any]:
        p = self.params
        return {**super().rule(), "blocks_before": p.blocks_before, "kill": p.kill_worker}
