"""The KV-transfer hook: the seam every prefill -> decode KV transfer passes through.

The prefill/decode (P/D) path calls :meth:`KvTransferHook.transfer` on every transfer of a request's KV
cache from a prefill worker to a decode worker, before the decode side uses it, and checks what comes out
(:attr:`KvTransfer.intact`). In production the hook is :class:`PassThrough`; chaos runs put a faulty one in
its place (:class:`fleetward.chaos.faults.kv.FaultyKvTransfer`), so the P/D path's handling of dropped,
late, corrupted and truncated transfers is tested through the same seam it uses in production.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Literal, Protocol

from fleetward.fleet.errors import FleetwardError

__all__ = ["KvTransfer", "KvTransferError", "KvTransferHook", "PassThrough"]


@dataclass(frozen=True)
class KvTransfer:
    """One request's KV cache on its way from a prefill worker to a decode worker."""

    request_id: str
    source: str  # prefill worker id
    dest: str  # decode worker id
    token_ids: tuple[int, ...]  # the prompt tokens the blocks cover
    blocks: tuple[bytes, ...]
    checksum: str = ""  # of the blocks as sent (``sealed()`` fills it)

    @staticmethod
    def digest(blocks: tuple[bytes, ...]) -> str:
        h = hashlib.blake2b(digest_size=16)
        for b in blocks:
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
        return h.hexdigest()

    def sealed(self) -> KvTransfer:
        return replace(self, checksum=self.digest(self.blocks))

    @property
    def intact(self) -> bool:
        """Whether the blocks are what was sent (the decode side's check)."""
        return self.digest(self.blocks) == self.checksum


class KvTransferError(FleetwardError):
    """A transfer that did not complete; the decode side must re-prefill or fail the request."""

    def __init__(self, kind: Literal["dropped", "prefill_died"], transfer: KvTransfer, *, blocks: int = 0) -> None:
        super().__init__(f"kv transfer of {transfer.request_id} {transfer.source}->{transfer.dest}: {kind}"
                         + (f" after {blocks} block(s)" if kind == "prefill_died" else ""))
        self.kind = kind
        self.transfer = transfer
        self.blocks_delivered = blocks


class KvTransferHook(Protocol):
    """Called by the P/D path for every KV transfer, before the decode worker uses it.

    Returns the transfer as delivered: unchanged, or altered (corrupted, truncated); may take long
    (delayed, stalled); raises :class:`KvTransferError` when it never completes (dropped, the prefill
    died mid-transfer). Cancellation propagates.
    """

    async def transfer(self, t: KvTransfer) -> KvTransfer: ...


class PassThrough:
    """The hook outside chaos runs."""

    async def transfer(self, t: KvTransfer) -> KvTransfer:
        return t
