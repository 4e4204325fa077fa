"""The simulated worker's side of prefill/decode KV transfer (``fleetward.fleet.kv``; docs/pd.md).

A prefill worker answers a request that says ``kv_transfer_params.do_remote_decode`` with an offer
(:meth:`KvTransfer.offer`) and keeps the KV of the prompt's whole blocks for ``kv_lease_s``; a decode worker
pulls it from ``GET /kv/{transfer_id}`` (:meth:`KvTransfer.endpoint`) when a request carries that offer
(:meth:`KvTransfer.load`), and starts from it instead of computing the prompt. The transfer goes through the
worker's fault hook (:mod:`.kvfaults`), so KV faults happen on the wire.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from fleetward.fleet.clock import Clock
from fleetward.fleet.config import SimConfig
from fleetward.fleet.kv import KvFrame, KvLink, KvOffer, KvSenderDied, KvTransferError, digest, frames_of
from fleetward.fleet.kv import pull as pull_kv
from fleetward.fleet.kv import send as send_kv
from fleetward.sim.engine import SimEngine
from fleetward.sim.kvfaults import KvFaultHook
from fleetward.sim.responses import json_response

__all__ = ["KvTransfer"]

log = logging.getLogger("fleetward.simworker")


@dataclass(slots=True)
class _StoredKv:
    frames: list[KvFrame]
    expires: float


class KvTransfer:
    """The KV this worker offers and the KV it loads, with the fault hook (:attr:`hook`) both go through.

    :attr:`stats` counts offers, sends, loads, recomputes and failures by kind (``GET /admin/state``'s ``kv``).
    ``die`` is what a fault that kills the sender calls.
    """

    def __init__(self, config: SimConfig, engine: SimEngine, clock: Clock, *, die: Callable[[], None]) -> None:
        self._config = config
        self._engine = engine
        self._clock = clock
        self.hook = KvFaultHook(die=die)
        self._link = KvLink(config.kv_latency_ms / 1000, config.kv_bandwidth_gbps * 1.25e8)
        # By transfer id, oldest first (every entry has the same lease, so expiry follows insertion order).
        self._store: dict[str, _StoredKv] = {}
        self.stats: dict[str, Any] = {"offered": 0, "sent": 0, "loaded": 0, "recomputed": 0, "failed": {}}
        self._session: aiohttp.ClientSession | None = None

    async def aclose(self) -> None:
        self.hook.clear()
        if self._session is not None:
            await self._session.close()

    def offer(self, base_url: str, prompt_ids: list[int]) -> KvOffer | None:
        """Keep the KV of ``prompt_ids``' whole blocks (all but the last token) for a decode worker to pull
        from this worker (at ``base_url``)."""
        bs = self._config.kv_block_size
        covered = (len(prompt_ids) - 1) // bs * bs
        if covered <= 0:
            return None
        now = self._clock.monotonic()
        store = self._store
        while store and next(iter(store.values())).expires <= now:
            del store[next(iter(store))]
        blocks = self._engine.scheduler.model.kv_blocks(prompt_ids[:covered], self._config.kv_bytes_per_token, bs)
        tid = f"kv-{secrets.token_hex(8)}"
        store[tid] = _StoredKv(frames_of(tid, blocks, bs), now + self._config.kv_lease_s)
        self.stats["offered"] += 1
        return KvOffer(base_url, tid, covered, len(blocks), digest(prompt_ids[:covered], blocks),
                       sum(len(b) for b in blocks))

    async def endpoint(self, request: Request) -> Response:
        """``GET /kv/{transfer_id}``: the offered KV, framed, once; 404 when unknown or its lease ran out."""
        tid = request.path_params["transfer_id"]
        stored = self._store.get(tid)
        if stored is None or stored.expires <= self._clock.monotonic():
            self._store.pop(tid, None)
            return json_response({"error": {"message": f"no KV transfer {tid} here (unknown, or its lease of "
                                            f"{self._config.kv_lease_s:g} s ran out)", "type": "NotFoundError",
                                            "code": 404}}, 404)
        self.stats["sent"] += 1

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in send_kv(tid, stored.frames, self.hook, self._link):
                    yield chunk
            except KvSenderDied as exc:
                log.warning("kv transfer cut by a fault: %s", exc)
                raise
            # Sent: the blocks are freed, as a prefill worker frees them once the decode side has read them
            # (a second pull of this transfer finds it expired, and the router prefills again).
            self._store.pop(tid, None)

        return StreamingResponse(body(), media_type="application/octet-stream")

    async def load(self, params: dict[str, Any], offer: KvOffer, prompt_ids: list[int]) -> tuple[int, int] | None:
        """Pull a prefill worker's KV for ``prompt_ids``: ``(tokens, state)`` to start from, or None to compute
        the prompt here (the transfer failed and the request said ``kv_load_failure_policy: recompute``).
        Raises :class:`KvTransferError` otherwise."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        covered = min(offer.tokens, len(prompt_ids))
        try:
            got = await pull_kv(self._session, offer, prompt_ids, timeout=self._config.kv_timeout_s,
                                verify=params.get("verify", True) is not False)
        except KvTransferError as exc:
            failed = self.stats["failed"]
            failed[exc.kind] = failed.get(exc.kind, 0) + 1
            if params.get("kv_load_failure_policy") != "recompute":
                raise
            log.info("%s; computing the prompt here (kv_load_failure_policy recompute)", exc)
            self.stats["recomputed"] += 1
            return None
        self.stats["loaded"] += 1
        model, bs = self._engine.scheduler.model, self._config.kv_block_size
        return covered, model.state_from_kv(prompt_ids, covered, got.payload, self._config.kv_bytes_per_token, bs)
