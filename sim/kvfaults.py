"""The simulated worker's KV fault switches: a :class:`~fleetward.fleet.kv.KvSendHook` with rules.

``POST /admin/faults`` takes ``{"kv": {"add": {"id": ..., "kind": ..., ...}}}``, ``{"kv": {"remove": id}}``
and ``{"kv": {"clear": true}}``; ``GET /admin/faults`` lists the rules with the transfers each hit. Every
rule acts on every transfer this worker sends while it is on (rules apply in the order they were added):

================  ========================================================================================
kind              what the transfer does on the wire
================  ========================================================================================
``drop``          nothing arrives: the connection is cut before the first frame
``delay``         arrives ``delay_ms`` late
``stall``         nothing arrives until the rule is removed (then it arrives whole)
``corrupt``       one byte of the first block flipped after framing (``at: wire``: its check fails) or
                  before (``at: source``: frames are sound, the digest is not)
``truncate``      only the first ``keep`` share of the blocks, then an end frame as if that were all
``duplicate``     the first block is sent twice
``stale``         the blocks of the transfer sent before this one (blocks freed and reused), framed
                  soundly for this transfer; zeroed blocks if there was none
``prefill_dies``  ``blocks_before`` blocks, then the connection is cut; with ``kill`` the worker's process
                  exits there (the prefill worker dies mid-transfer)
================  ========================================================================================
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

from fleetward.fleet.kv import KvFrame, KvSenderDied

__all__ = ["KV_FAULT_KINDS", "KvFaultHook", "KvRule"]

KvFaultKind = Literal["drop", "delay", "stall", "corrupt", "truncate", "duplicate", "stale", "prefill_dies"]
KV_FAULT_KINDS: tuple[str, ...] = get_args(KvFaultKind)


@dataclass(eq=False)
class KvRule:
    id: str
    kind: KvFaultKind
    delay_ms: float = 0.0
    at: Literal["wire", "source"] = "wire"
    keep: float = 0.5
    blocks_before: int = 1
    kill: bool = False
    hits: int = 0
    released: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    def parse(cls, raw: object) -> KvRule:
        """A rule from ``POST /admin/faults``; ValueError naming the field."""
        if not isinstance(raw, dict):
            raise ValueError("kv.add: expected an object")
        kind = raw.get("kind")
        if kind not in KV_FAULT_KINDS:
            raise ValueError(f"kv.add.kind: one of {', '.join(KV_FAULT_KINDS)}, not {kind!r}")
        rid = raw.get("id")
        if not isinstance(rid, str) or not rid:
            raise ValueError("kv.add.id: a non-empty string")
        rule = cls(rid, kind)
        for name, lo, hi in (("delay_ms", 0.0, 3.6e6), ("keep", 0.0, 1.0)):
            if name in raw:
                v = raw[name]
                if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
                    raise ValueError(f"kv.add.{name}: a number in [{lo:g}, {hi:g}], not {v!r}")
                setattr(rule, name, float(v))
        if "blocks_before" in raw:
            v = raw["blocks_before"]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"kv.add.blocks_before: a count >= 0, not {v!r}")
            rule.blocks_before = v
        if "at" in raw:
            if raw["at"] not in ("wire", "source"):
                raise ValueError(f"kv.add.at: wire or source, not {raw['at']!r}")
            rule.at = raw["at"]
        if "kill" in raw:
            if not isinstance(raw["kill"], bool):
                raise ValueError(f"kv.add.kill: true or false, not {raw['kill']!r}")
            rule.kill = raw["kill"]
        return rule

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "kind": self.kind, "hits": self.hits}
        if self.kind == "delay":
            out["delay_ms"] = self.delay_ms
        elif self.kind == "corrupt":
            out["at"] = self.at
        elif self.kind == "truncate":
            out["keep"] = self.keep
        elif self.kind == "prefill_dies":
            out.update(blocks_before=self.blocks_before, kill=self.kill)
        return out


def _flip(frame: KvFrame) -> KvFrame:
    b = bytearray(frame.payload)
    b[len(b) // 2] ^= 0xFF
    return replace(frame, payload=bytes(b))


class KvFaultHook:
    """The worker's send hook: its rules, applied to every transfer it sends (see the module docstring)."""

    def __init__(self, die: Callable[[], None]) -> None:
        self.rules: list[KvRule] = []
        self.sent = 0
        self._die = die
        self._previous: list[KvFrame] = []

    def add(self, rule: KvRule) -> None:
        self.remove(rule.id)
        self.rules.append(rule)

    def remove(self, rule_id: str) -> None:
        for r in [r for r in self.rules if r.id == rule_id]:
            self.rules.remove(r)
            r.released.set()

    def clear(self) -> None:
        for r in list(self.rules):
            self.remove(r.id)

    def to_json(self) -> list[dict[str, Any]]:
        return [r.to_json() for r in self.rules]

    async def send(self, transfer_id: str, frames: Sequence[KvFrame]) -> AsyncIterator[KvFrame]:
        self.sent += 1
        blocks = [f for f in frames if not f.end]
        previous, self._previous = self._previous, blocks
        end = frames[-1] if frames and frames[-1].end else None
        cut: int | None = None
        kill = False
        for rule in list(self.rules):
            rule.hits += 1
            if rule.kind == "drop":
                cut = 0
            elif rule.kind == "delay":
                await asyncio.sleep(rule.delay_ms / 1000)
            elif rule.kind == "stall":
                await rule.released.wait()
            elif rule.kind == "corrupt" and blocks:
                blocks[0] = _flip(blocks[0]) if rule.at == "wire" else _flip(blocks[0]).sealed()
            elif rule.kind == "truncate":
                blocks = blocks[:int(len(blocks) * rule.keep)]
                end = KvFrame(transfer_id, len(blocks), end=True).sealed()
            elif rule.kind == "duplicate" and blocks:
                blocks = [blocks[0], *blocks]
            elif rule.kind == "stale":
                blocks = [replace(f, payload=(previous[i].payload if i < len(previous) else bytes(len(f.payload)))[
                    :len(f.payload)].ljust(len(f.payload), b"\0")).sealed(transfer_id) for i, f in enumerate(blocks)]
            elif rule.kind == "prefill_dies":
                cut = rule.blocks_before if cut is None else min(cut, rule.blocks_before)
                kill = kill or rule.kill
        out = [*blocks, *([end] if end is not None else [])]
        for i, f in enumerate(out):
            if cut is not None and i >= cut:
                break
            yield f
        if cut is not None:
            if kill:
                self._die()
            raise KvSenderDied(f"{transfer_id}: cut after {min(cut, len(out))} frame(s)")
