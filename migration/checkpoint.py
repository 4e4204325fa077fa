"""Coalesced checkpoints of every in-flight journal to etcd (``requests/<id>``).

Every ``interval`` the checkpointer writes all journals that changed since the last flush in one
transaction (split only when a transaction would exceed etcd's ``--max-txn-ops``, 128 by default), so the
etcd write rate follows the flush interval, not the token rate. A request that finishes before its
first flush never touches etcd.

Ownership: each key is written with a compare on the mod revision this router last wrote, so when
another router replica claims a request (a client resumed there with ``Last-Event-ID``) this router's
next write of it fails and ``on_lost(id)`` tells the router to stop that stream. Keys are bound to a
lease (``ttl``) that the router keeps alive: what a dead router leaves behind expires on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import orjson

from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.errors import FleetwardError
from fleetward.fleet.etcd import Compare, Delete, LeaseKeeper, Put, StateStore
from fleetward.fleet.keys import Keys
from fleetward.migration.journal import Journal

__all__ = ["Checkpointer"]

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, store: StateStore, keys: Keys, router_id: str, *, interval_s: float = 0.075,
                 ttl_s: int = 30, max_ops: int = 128, clock: Clock = SYSTEM_CLOCK,
                 on_lost: Callable[[str], None] | None = None) -> None:
        self.store = store
        self.keys = keys
        self.router_id = router_id
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.max_ops = max_ops
        self.clock = clock
        self.on_lost = on_lost or (lambda _rid: None)
        self.live: dict[str, Journal] = {}
        self._mod: dict[str, int] = {}  # request id -> mod revision of our last write (0: never written)
        self._deleting: set[str] = set()
        self.lease: LeaseKeeper | None = None
        self.flushes = 0
        self.txns = 0
        self.keys_written = 0
        self.bytes_written = 0
        self.enabled = True
        self.last_ok = clock.monotonic()  # when a flush last ended without error (checkpoint lag counts from it)
        self.on_flush: Callable[[float], None] | None = None  # each flush's duration, for the histogram

    async def start(self) -> None:
        self.lease = await LeaseKeeper(self.store, self.ttl_s, clock=self.clock).start()

    async def renew(self) -> None:
        """After the lease expired (its keys are gone): a new lease, and every live journal written again."""
        self.lease = await LeaseKeeper(self.store, self.ttl_s, clock=self.clock).start()
        self._mod = {rid: 0 for rid in self.live}
        self._deleting.clear()
        for j in self.live.values():
            j.dirty = True

    def track(self, journal: Journal, *, mod_revision: int = 0) -> None:
        self.live[journal.id] = journal
        self._mod.setdefault(journal.id, mod_revision)
        journal.dirty = True

    def done(self, journal: Journal) -> None:
        """The request ended (finished, failed or abandoned): its checkpoint goes at the next flush."""
        self.live.pop(journal.id, None)
        if self._mod.get(journal.id):
            self._deleting.add(journal.id)
        else:
            self._mod.pop(journal.id, None)

    async def run(self) -> None:
        while True:
            await self.clock.sleep(self.interval_s)
            started = self.clock.monotonic()
            try:
                await self.flush()
            except FleetwardError as exc:
                log.warning("checkpoint flush failed (%s); will retry", exc)
                continue
            self.last_ok = self.clock.monotonic()
            if self.on_flush is not None:
                self.on_flush(self.last_ok - started)

    @property
    def lag_s(self) -> float:
        """Seconds since a flush last succeeded: what a router that dies now could lose to a resume."""
        return self.clock.monotonic() - self.last_ok if self.enabled else 0.0

    async def flush(self) -> None:
        if not self.enabled or self.lease is None:
            return
        lease = self.lease.id
        ops: list[tuple[str, Compare, Put | Delete, Journal | None]] = []
        for rid in list(self._deleting):
            key = self.keys.request(rid)
            ops.append((rid, Compare(key, "mod", "==", self._mod.get(rid, 0)), Delete(key), None))
        encoded = 0
        for rid, j in list(self.live.items()):
            if not j.dirty:
                continue
            j.dirty = False
            key = self.keys.request(rid)
            value = j.checkpoint_bytes(self.router_id)
            self.bytes_written += len(value)
            ops.append((rid, Compare(key, "mod", "==", self._mod.get(rid, 0)), Put(key, value, lease), j))
            encoded += len(value)
            if encoded > 256_000:  # let tokens through between slices of a big flush (the p99 of ITL)
                encoded = 0
                await asyncio.sleep(0)
        if not ops:
            return
        self.flushes += 1
        for i in range(0, len(ops), self.max_ops):
            await self._write(ops[i : i + self.max_ops])

    async def _write(self, batch: list[tuple[str, Compare, Put | Delete, Journal | None]]) -> None:
        self.txns += 1
        try:
            result = await self.store.txn([c for _, c, _, _ in batch], [op for _, _, op, _ in batch])
        except BaseException:
            for _, _, _, j in batch:
                if j is not None:
                    j.dirty = True
            raise
        if result.succeeded:
            self._committed(batch, result.revision)
            return
        # Someone else wrote one of these keys: find which, one key at a time (rare).
        for item in batch:
            rid, compare, op, j = item
            self.txns += 1
            single = await self.store.txn([compare], [op])
            if single.succeeded:
                self._committed([item], single.revision)
            else:
                log.info("request %s was claimed by another router; letting go of it", rid)
                self.live.pop(rid, None)
                self._deleting.discard(rid)
                self._mod.pop(rid, None)
                self.on_lost(rid)

    def _committed(self, batch: list[tuple[str, Compare, Put | Delete, Journal | None]], revision: int) -> None:
        for rid, _, op, _ in batch:
            if isinstance(op, Delete):
                self._deleting.discard(rid)
                self._mod.pop(rid, None)
            else:
                self._mod[rid] = revision
                self.keys_written += 1
                if rid not in self.live:  # it finished while this write was on its way: delete it next
                    self._deleting.add(rid)

    async def claim(self, request_id: str) -> Journal | None:
        """Take over a request another router checkpointed (a client resuming here); None if gone."""
        key = self.keys.request(request_id)
        kv = await self.store.get(key)
        if kv is None or self.lease is None:
            return None
        data: dict[str, Any] = orjson.loads(kv.value)
        journal = Journal.from_checkpoint(data)
        data["router"] = self.router_id
        result = await self.store.txn([Compare(key, "mod", "==", kv.mod_revision)],
                                      [Put(key, orjson.dumps(data), self.lease.id)])
        if not result.succeeded:
            return None
        self._mod[request_id] = result.revision
        self.live[request_id] = journal
        journal.dirty = False
        return journal

    async def aclose(self, *, revoke: bool = True) -> None:
        if self.lease is not None:
            with contextlib.suppress(asyncio.CancelledError, FleetwardError):
                await self.lease.aclose(revoke=revoke)
            self.lease = None
