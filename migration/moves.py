"""Planned moves: a stream moved for a plan carries its KV instead of computing it again (docs/pd.md).

A crash loses a stream's KV with its worker, so the stream resumes elsewhere by computing its prompt and
every emitted token again. A *planned* move leaves a healthy worker whose KV is intact: a drain past its
deadline (``drain``), an autoscaler's scale-down (``scale-down``), ``fleetward move`` (``operator``), or a
worker far busier than the others (``rebalance``, ``routing.moves.rebalance``). Such a move goes:

1. :meth:`Moves.plan` queues the streams to move, longest context first (the most to save). A queued stream
   keeps streaming where it is; :meth:`Moves.run` starts moves while fewer than ``concurrency`` are in
   flight and the token budget (``budget_tokens_s``: KV moves leave the link to live prefill/decode
   transfers) allows, and only when another worker can take the stream.
2. It stops the stream there (its upstream connection is closed: the worker cancels the generation and
   keeps the KV, as vLLM's prefix cache keeps an aborted request's blocks) after the last token the router
   journaled.
3. :meth:`Moves.carry` asks that worker for the KV of the prompt plus the emitted tokens, as the prefill
   step of prefill/decode asks a prefill worker (:meth:`~fleetward.migration.prefill.Prefill.ask`): it finds
   the blocks it holds and hands them over through its KV connector (a simulated worker offers them over the
   checked wire; vLLM with fleetward's connector saves them as checked files).
4. The destination loads the KV, checks it, and continues from the next token. The client sees one stream,
   as with every migration.

Any failure of the KV path falls back to computing the stream again on the destination: the worker it left
does not answer in ``timeout_s`` or is gone, the destination refuses the KV (its check failed), or the
destination fails. Later, never wrong. :meth:`Moves.done` counts each move by trigger and outcome (``kv``,
``reprefill``, ``failed``), its stall (last token before, first token after) and the KV it carried, and
publishes a ``move`` event (the fleet page's timeline).

Orders come from the fleet's etcd (``moves/<id>``, written by the controller: a drain's deadline, the
control API's ``POST /v1/moves``): every router watches them and moves the streams of its own that match.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fleetward.fleet.bus import EventBus
from fleetward.fleet.clock import Clock
from fleetward.fleet.config import MovesConfig
from fleetward.fleet.etcd import StateStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.moveorders import MoveOrderRecord
from fleetward.fleet.registry import FleetView
from fleetward.migration.journal import Journal
from fleetward.migration.metrics import RouterMetrics
from fleetward.migration.placement import Placement
from fleetward.migration.prefill import Prefill, kv_refusal
from fleetward.migration.upstream import UpstreamError

if TYPE_CHECKING:
    from fleetward.migration.router import Active

__all__ = ["MoveOrder", "Moves"]

log = logging.getLogger(__name__)

@dataclass(slots=True)
class MoveOrder:
    """One stream's planned move, from the order to its first token on the next worker."""

    trigger: str
    source: str  # the worker it leaves
    to: str | None = None  # where an operator asked it to go (when that worker can take it)
    kv: bool = True  # carry its KV (off once the KV path failed, or for a stream with no token yet)
    tokens: int = 0  # the context it had when queued (the budget's measure)
    queued_at: float = 0.0  # monotonic
    carried_tokens: int = 0
    carried_bytes: int = 0


class Moves:
    """A router's planned moves (module docstring): the queue, the budget, the KV hand-over, the counts."""

    def __init__(self, config: MovesConfig, *, active: dict[str, Active], placement: Placement, view: FleetView,
                 prefill: Prefill, store: StateStore, keys: Keys, bus: EventBus, metrics: RouterMetrics, clock: Clock,
                 router_id: str) -> None:
        self.config = config
        self.active = active
        self.placement = placement
        self.view = view
        self.prefill = prefill
        self.store = store
        self.keys = keys
        self.bus = bus
        self.metrics = metrics
        self.clock = clock
        self.router_id = router_id
        self._queue: deque[tuple[str, MoveOrder]] = deque()
        self._wake = asyncio.Event()
        self.in_flight = 0  # moves started and not done
        self._allowance = float(config.budget_tokens_s)  # the token bucket; refills at budget_tokens_s
        self._refilled = clock.monotonic()

    # -- what to move ---------------------------------------------------------------------------------------

    def plan(self, trigger: str, *, source: str | None = None, request: str | None = None,
             to: str | None = None) -> list[str]:
        """Queue the streams of this router on ``source`` (or the one ``request``) that can move: every one
        that is streaming, resumable, and not moving already; longest context first. Returns their ids."""
        queued = {rid for rid, _ in self._queue}
        picked: list[tuple[int, str, MoveOrder]] = []
        for rid, a in self._streams(source, request):
            j = a.journal
            if rid in queued or a.move is not None or a.worker is None or j.resumable() is not None:
                log.info("request %s is not moved: %s", rid, "queued or moving already" if rid in queued or a.move
                         else j.resumable() or "not placed")
                continue
            context = len(j.prompt_ids or ()) + len(j.emitted)
            picked.append((context, rid, MoveOrder(trigger, a.worker, to, kv=bool(j.emitted) and self.config.kv,
                                                   tokens=context, queued_at=self.clock.monotonic())))
        picked.sort(key=lambda p: -p[0])
        self._queue.extend((rid, order) for _, rid, order in picked)
        if picked:
            self._wake.set()
            log.info("moving %d stream(s) (%s) off %s", len(picked), trigger, source or picked[0][2].source)
        return [rid for _, rid, _ in picked]

    def _streams(self, source: str | None, request: str | None) -> Iterator[tuple[str, Active]]:
        if request is not None:
            a = self.active.get(request)
            if a is not None and a.stream is not None and (source is None or a.worker == source):
                yield request, a
            elif a is not None:
                log.info("request %s is not moved: %s", request, "not streaming now (between attempts)"
                         if a.stream is None else f"it is on {a.worker}, not {source}")
            return
        for rid, a in list(self.active.items()):
            if a.worker == source and a.stream is not None:
                yield rid, a

    def rebalance(self) -> list[str]:
        """Queue moves off any worker whose load is above ``rebalance_ratio`` times the mean of the other
        workers of its model (and at least ``rebalance_min_streams`` of this router's streams): as many of its
        longest streams as bring it to the mean of all. Not while moves are under way."""
        cfg = self.config
        if self.in_flight or self._queue:
            return []  # the loads settle first: a stream being moved counts on neither worker meanwhile
        mine: dict[str, list[str]] = {}
        for rid, a in self.active.items():
            if a.worker is not None and a.stream is not None:
                mine.setdefault(a.worker, []).append(rid)
        load = self.placement.load()
        moved: list[str] = []
        for worker, rids in mine.items():
            rec = self.view.fleet.workers.get(worker)
            if rec is None or len(rids) < cfg.rebalance_min_streams:
                continue
            others = [w for w in self.placement.candidates(rec.model, [worker])[0] if w != worker]
            if not others:
                continue
            mean_others = sum(load.get(w, 0) for w in others) / len(others)
            here = load.get(worker, len(rids))
            if here <= cfg.rebalance_ratio * max(mean_others, 1.0):
                continue
            excess = int(here - (here + mean_others * len(others)) / (len(others) + 1))
            longest = sorted(rids, key=lambda r: -(len(self.active[r].journal.prompt_ids or ())
                                                   + len(self.active[r].journal.emitted)))[:max(0, excess)]
            for rid in longest:
                moved += self.plan("rebalance", source=worker, request=rid)
        return moved

    # -- the loops ------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Start queued moves within the concurrency limit and the token budget, one at a time. A move whose
        stream has no other worker to go to right now (none routable, or all silent) waits for one, for
        ``timeout_s`` from its order; the stream streams on where it is meanwhile."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            waiting: list[tuple[str, MoveOrder]] = []
            while self._queue and self.in_flight < self.config.concurrency:
                rid, order = self._queue.popleft()
                where = self._destinations(rid, order)
                if where is None:
                    continue  # it finished, failed or moved meanwhile
                if not where:
                    if self.clock.monotonic() - order.queued_at < self.config.timeout_s:
                        waiting.append((rid, order))
                    else:
                        log.warning("request %s stays on %s: no other worker could take it within %.0f s", rid,
                                    order.source, self.config.timeout_s)
                    continue
                await self._budget(order.tokens if order.kv else 0)
                self._start(rid, order)
            if waiting:
                self._queue.extendleft(reversed(waiting))
                await self.clock.sleep(0.1)
                self._wake.set()

    async def _budget(self, tokens: int) -> None:
        rate = self.config.budget_tokens_s
        if rate <= 0 or tokens <= 0:
            return
        while True:
            now = self.clock.monotonic()
            self._allowance = min(float(rate), self._allowance + (now - self._refilled) * rate)
            self._refilled = now
            need = min(tokens, rate)  # a move larger than one second's budget waits for a full bucket
            if self._allowance >= need:
                self._allowance -= tokens
                return
            await self.clock.sleep((need - self._allowance) / rate)

    def _destinations(self, rid: str, order: MoveOrder) -> list[str] | None:
        """The workers the stream could move to now (None: it is no longer streaming on its source)."""
        a = self.active.get(rid)
        if a is None or a.stream is None or a.worker != order.source or a.move is not None:
            return None
        return [w for w in self.placement.candidates(a.journal.model, [order.source])[0] if w != order.source]

    def _start(self, rid: str, order: MoveOrder) -> None:
        where = self._destinations(rid, order)  # again: the budget may have made it wait
        a = self.active.get(rid)
        if not where or a is None or a.stream is None:
            if where == []:
                self._queue.appendleft((rid, order))
            return
        if order.to is not None and order.to not in where:
            order.to = None
        a.move = order
        self.in_flight += 1
        a.stream.abort(f"move: {order.trigger}")

    async def watch(self) -> None:
        """Follow ``moves/`` in etcd from now on: every order for streams of this router is planned here."""
        snap = await self.store.get_prefix(self.keys.moves, keys_only=True)
        async for ev in self.store.watch_prefix(self.keys.moves, start_revision=snap.revision + 1):
            if ev.kind != "put":
                continue
            try:
                order = MoveOrderRecord.from_json(ev.value)
            except ValueError:
                log.warning("ignoring a malformed move order %s", ev.key)
                continue
            moving = self.plan(order.trigger, source=order.source, request=order.request, to=order.to)
            log.info("move order %s (%s): %d stream(s) of this router", ev.key[len(self.keys.moves):], order.trigger,
                     len(moving))

    # -- one move, as the attempt loop goes through it ------------------------------------------------------

    def stopped(self, a: Active, exc: UpstreamError) -> MoveOrder | None:
        """The order, when the attempt that just failed with ``exc`` was stopped for a planned move."""
        order, a.move = a.move, None
        if order is None or exc.kind != "aborted":
            if order is not None:  # it failed on its own as it was about to move: an ordinary migration
                self.release(order)
            return None
        return order

    async def carry(self, j: Journal, order: MoveOrder, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The destination's request: ``body`` with the KV the worker the stream left hands over (its
        ``kv_transfer_params``, checked by the destination, a refusal answered not recomputed), or ``body``
        as it is when it cannot (the move then computes the stream again: :attr:`MoveOrder.kv` is off)."""
        rec = self.view.fleet.workers.get(order.source)
        if not order.kv or rec is None:
            order.kv = False
            return body
        try:
            kv = await self.prefill.ask(rec.url, path, body, timeout=self.config.timeout_s)
        except UpstreamError as exc:
            log.warning("request %s: %s could not hand over its KV (%s); computing the stream again instead",
                        j.id, order.source, exc)
            order.kv = False
            return body
        if kv is None:  # a connector that finds KV by prompt (vLLM's ExampleConnector): saved, nothing to carry
            return body
        order.carried_tokens = int(kv.get("num_tokens") or 0)
        order.carried_bytes = int(kv.get("num_bytes") or 0)
        return {**body, "kv_transfer_params": {**kv, "verify": True, "kv_load_failure_policy": "fail"}}

    def refused(self, j: Journal, order: MoveOrder, exc: UpstreamError, worker: str) -> bool:
        """Whether the destination refused the KV it was given (its check failed): the move goes on without
        it, on the same worker."""
        kind = kv_refusal(exc)
        if kind is None or not order.kv:
            return False
        self.metrics.kv_failures.labels(kind).inc()
        log.warning("request %s: %s refused the KV moved from %s (%s: %s); computing the stream again there",
                    j.id, worker, order.source, kind, exc.message)
        order.kv, order.to = False, worker
        order.carried_tokens = order.carried_bytes = 0
        return True

    def release(self, order: MoveOrder) -> None:
        """Give back the move's place among the ``concurrency`` in flight (it is over, or never happened)."""
        self.in_flight = max(0, self.in_flight - 1)
        self._wake.set()

    async def done(self, order: MoveOrder, outcome: str | None, stall_s: float | None, *, request: str = "",
                   worker: str = "") -> None:
        """The move is over: continued on ``worker`` (``outcome`` None: as its order says), fell back, or failed."""
        outcome = outcome or ("kv" if order.kv else "reprefill")
        self.release(order)
        self.metrics.moves.labels(order.trigger, outcome).inc()
        if stall_s is not None:
            self.metrics.move_stall.labels(outcome).observe(stall_s)
        if outcome == "kv":
            self.metrics.move_tokens.inc(order.carried_tokens)
            self.metrics.move_bytes.inc(order.carried_bytes)
        await self.bus.publish(
            "move", request=request, worker=worker, from_worker=order.source, trigger=order.trigger,
            outcome=outcome, kv_tokens=order.carried_tokens if outcome == "kv" else 0,
            kv_bytes=order.carried_bytes if outcome == "kv" else 0,
            stall_s=None if stall_s is None else round(stall_s, 4), router=self.router_id)
