"""Coalesced, incremental checkpoints of every in-flight journal to etcd (``requests/<id>``).

Every ``interval`` the checkpointer writes all journals that changed since the last flush in one
transaction (split only past ``max_ops`` operations, 64, half etcd's default ``--max-txn-ops``; the parts
are sent at once), so the etcd write rate follows the flush interval, not the token rate. A request that
finishes before its first flush never touches etcd.

Incremental: a request's first write is its whole checkpoint, the *base* (``requests/<id>``: body, prompt
ids, every token so far). Each later flush writes only what changed since, a *delta*
(``requests/<id>/<n>``: the tokens, text and offsets since the last write, and the few small fields
whole), so the bytes written per second follow the token rate, not stream length times flush rate. The
deltas are folded into a new base (*compaction*, deltas deleted in the same transaction) when they have
grown as large as the base (so a stream's bases cost at most twice its deltas) or number
``max_deltas``, when another router claims the request (:meth:`Checkpointer.claim`), and they go with the
base when the request ends. :func:`read_checkpoint` reads a base and its deltas as one journal.

Ownership: each write (base or delta) is made with a compare on the mod revision of the base this
router last wrote, so when another router replica claims a request (a client resumed there with
``Last-Event-ID``) this router's next write of it fails and ``on_lost(id)`` tells the router to stop that
stream. Keys are bound to a lease (``ttl``) that the router keeps alive: what a dead router leaves behind
expires on its own.

A flush never holds the event loop for long: it encodes journals in slices of ``slice_s`` (0.5 ms) and
lets tokens through in between.

With a :class:`~fleetward.migration.replicas.PeerLink` (``routing.checkpoint_store: peers``) the same bases
and deltas go to a peer router instead of etcd, one HTTP request per flush (``migration/replicas.py``); with
no peer at hand they go to etcd as above. Each request remembers where it was written (``_Written.where``):
when the target changes, its next write is a whole base to the new one, and its keys in etcd are deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import orjson

from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.errors import FleetwardError
from fleetward.fleet.etcd import Compare, Delete, Put, StateStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.lease import LeaseKeeper
from fleetward.migration.journal import Journal
from fleetward.migration.replicas import NotClaimable, PeerLink, Replicas, encode_batch

__all__ = ["Checkpointer", "read_checkpoint"]

_ETCD = "etcd"

log = logging.getLogger(__name__)


def _deltas_of(key: str) -> str:
    return key + "/"


async def read_checkpoint(store: StateStore, keys: Keys, request_id: str) -> tuple[Journal, int] | None:
    """The journal a request's checkpoint holds (its base with every delta folded in), and the base's mod
    revision; None when there is none. One read, so base and deltas are of one revision."""
    key = keys.request(request_id)
    snap = await store.get_prefix(key)
    base = next((kv for kv in snap.items if kv.key == key), None)
    if base is None:
        return None
    journal = Journal.from_checkpoint(orjson.loads(base.value))
    for kv in sorted((kv for kv in snap.items if kv.key.startswith(_deltas_of(key))), key=lambda kv: kv.key):
        if not journal.apply_delta(orjson.loads(kv.value)):
            log.warning("checkpoint of %s: delta %s does not follow what came before; the tokens after it are "
                        "regenerated", request_id, kv.key)
            break
    return journal, base.mod_revision


@dataclass(slots=True)
class _Written:
    """What this router holds in etcd for one request."""

    mod: int = 0  # mod revision of our last base write (0: none)
    n: int = 0  # tokens and text characters the base and deltas hold, as acknowledged
    c: int = 0
    base_bytes: int = 0
    deltas: int = 0  # deltas attempted since the base (one that timed out may still have been written)
    delta_bytes: int = 0
    seq: int = 0  # the next delta's number: never reused, so a write that failed cannot shadow a later one
    static: tuple[int, float] | None = None  # the base's prompt ids (identity) and deadline: deltas carry neither
    where: str = _ETCD  # etcd, or the id of the peer router that holds it


@dataclass(slots=True)
class _Item:
    rid: str
    compare: Compare
    ops: list[Put | Delete]
    journal: Journal | None
    what: Literal["base", "delta", "delete", "leave"]
    n: int = 0
    c: int = 0
    size: int = 0
    static: tuple[int, float] | None = None
    value: bytes = b""


class NotResumable(Exception):
    """A checkpointed request that cannot be continued exactly (tokens sent, and a parameter that forbids a
    resume: see :meth:`Journal.resumable`). Its checkpoint was left as it was."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class Checkpointer:
    def __init__(self, store: StateStore, keys: Keys, router_id: str, *, interval_s: float = 0.075,
                 ttl_s: int = 30, max_ops: int = 64, incremental: bool = True, max_deltas: int = 512,
                 slice_s: float = 0.0005, clock: Clock = SYSTEM_CLOCK,
                 on_lost: Callable[[str], None] | None = None) -> None:
        self.store = store
        self.keys = keys
        self.router_id = router_id
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.max_ops = max_ops
        self.incremental = incremental
        self.max_deltas = max_deltas
        self.slice_s = slice_s
        self.clock = clock
        self.on_lost = on_lost or (lambda _rid: None)
        self.live: dict[str, Journal] = {}
        self._written: dict[str, _Written] = {}
        self._deleting: set[str] = set()
        self.lease: LeaseKeeper | None = None
        self.flushes = 0
        self.txns = 0
        self.keys_written = 0
        self.bytes_written = 0
        self.compactions = 0
        self.enabled = True
        self.last_ok = clock.monotonic()  # when a flush last ended without error (checkpoint lag counts from it)
        self.on_flush: Callable[[float], None] | None = None  # each flush's duration, for the histogram
        self.on_slice: Callable[[float], None] | None = None  # each stretch a flush held the loop, likewise
        self.peers: PeerLink | None = None  # routing.checkpoint_store: peers
        self.replicas: Replicas | None = None  # the copies this router holds for others (peers)
        self._sent = 0.0  # when this router last wrote to its peer (a quiet one is written to every ttl / 3)

    async def start(self) -> None:
        self.lease = await LeaseKeeper(self.store, self.ttl_s, clock=self.clock).start()

    async def renew(self) -> None:
        """After the lease expired (its keys are gone): a new lease, and every live journal written again."""
        self.lease = await LeaseKeeper(self.store, self.ttl_s, clock=self.clock).start()
        self._written = {rid: _Written() for rid in self.live}
        self._deleting.clear()
        for j in self.live.values():
            j.dirty = True

    def adopt(self, journal: Journal) -> None:
        """A journal claimed from a peer's copy: written whole to this router's target at the next flush."""
        self.live[journal.id] = journal
        self._written[journal.id] = _Written(where="")
        journal.dirty = True

    def track(self, journal: Journal, *, mod_revision: int = 0) -> None:
        self.live[journal.id] = journal
        self._written.setdefault(journal.id, _Written(mod=mod_revision))
        journal.dirty = True

    def done(self, journal: Journal) -> None:
        """The request ended (finished, failed or abandoned): its checkpoint goes at the next flush."""
        self.live.pop(journal.id, None)
        w = self._written.get(journal.id)
        if w is not None and (w.mod or (w.where and w.where != _ETCD)):
            self._deleting.add(journal.id)
        else:
            self._written.pop(journal.id, None)

    async def run(self) -> None:
        took = 0.0
        while True:
            # Flushes start every interval, whatever a flush takes (but a quarter interval apart at least).
            await self.clock.sleep(max(self.interval_s / 4, self.interval_s - took))
            started = self.clock.monotonic()
            try:
                await self.flush()
            except FleetwardError as exc:
                log.warning("checkpoint flush failed (%s); will retry", exc)
                took = 0.0
                continue
            self.last_ok = self.clock.monotonic()
            took = self.last_ok - started
            if self.on_flush is not None:
                self.on_flush(took)

    @property
    def lag_s(self) -> float:
        """Seconds since a flush last succeeded: what a router that dies now could lose to a resume."""
        return self.clock.monotonic() - self.last_ok if self.enabled else 0.0

    def _item(self, rid: str, j: Journal, lease: int, where: str = _ETCD) -> _Item:
        """The write that brings ``rid``'s checkpoint up to ``j`` at ``where`` (etcd, or a peer): a delta, or a
        new base (compaction; or the first write there)."""
        w = self._written.setdefault(rid, _Written())
        key = self.keys.request(rid)
        compare = Compare(key, "mod", "==", w.mod)
        n, c = len(j.emitted), len(j.text)
        static = j.static_key  # deltas carry neither prompt ids nor deadline: a change needs a new base
        written_here = w.mod > 0 if where == _ETCD else w.where == where
        if self.incremental and written_here and w.deltas < self.max_deltas and w.delta_bytes < w.base_bytes \
                and w.static == static:
            value = j.delta_bytes(w.n, w.c)
            w.seq += 1
            w.deltas += 1
            w.delta_bytes += len(value)
            return _Item(rid, compare, [Put(f"{_deltas_of(key)}{w.seq:010d}", value, lease)], j, "delta", n, c,
                         len(value), value=value)
        value = j.checkpoint_bytes(self.router_id)
        ops: list[Put | Delete] = [Put(key, value, lease)]
        if w.deltas and written_here:
            ops.append(Delete(_deltas_of(key), prefix=True))
            self.compactions += 1
        return _Item(rid, compare, ops, j, "base", n, c, len(value), static, value)

    async def flush(self) -> None:
        if not self.enabled or self.lease is None:
            return
        peer = self.peers.peer() if self.peers is not None else None
        where = _ETCD if peer is None else peer[0]
        lease = self.lease.id
        etcd: list[_Item] = []
        sent: list[_Item] = []
        for rid in list(self._deleting):
            w = self._written.get(rid) or _Written()
            if w.mod:
                etcd.append(self._delete(rid, w))
            if peer is not None and w.where == where:
                sent.append(_Item(rid, Compare("", "mod", "==", 0), [], None, "delete"))
            if not w.mod and (peer is None or w.where != where):  # held where it is no longer written to
                self._deleting.discard(rid)
                self._written.pop(rid, None)
        began = time.perf_counter()
        for rid, j in list(self.live.items()):
            was = self._written.get(rid)
            moved = was is not None and was.where != where  # written elsewhere than now (or claimed from a peer)
            if not j.dirty and not moved:
                continue
            j.dirty = False
            if moved and peer is not None and was is not None and was.mod:  # off etcd: its keys there go
                etcd.append(self._delete(rid, was, leave=True))
            item = self._item(rid, j, lease, where)
            self.bytes_written += item.size
            (etcd if peer is None else sent).append(item)
            if time.perf_counter() - began > self.slice_s:  # let tokens through between slices (the p99 of ITL)
                self._sliced(began)
                await asyncio.sleep(0)
                began = time.perf_counter()
        self._sliced(began)
        quiet = peer is not None and self.clock.monotonic() - self._sent > self.ttl_s / 3
        if not etcd and not sent and not quiet:
            return
        if etcd or sent:
            self.flushes += 1
        batches: list[list[_Item]] = [[]]
        ops = 0
        for item in etcd:
            if batches[-1] and ops + len(item.ops) > self.max_ops:
                batches.append([])
                ops = 0
            batches[-1].append(item)
            ops += len(item.ops)
        batches = [b for b in batches if b]
        # Counted with the flush, in the same step: a reader between the two (the metrics' mirror) never sees
        # a flush without its transactions.
        self.txns += len(batches) + (peer is not None)
        # At once: each transaction's request is built in a task step of its own (so the loop runs between
        # them), and etcd commits them together rather than one round trip and fsync after another.
        writes = [self._write(b) for b in batches]
        if peer is not None:
            writes.append(self._send(peer, sent))
        results = await asyncio.gather(*writes, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    def _delete(self, rid: str, w: _Written, *, leave: bool = False) -> _Item:
        """The deletion of ``rid``'s keys in etcd (``leave``: it goes on, written to a peer from now on)."""
        key = self.keys.request(rid)
        return _Item(rid, Compare(key, "mod", "==", w.mod), [Delete(key), Delete(_deltas_of(key), prefix=True)],
                     self.live.get(rid), "leave" if leave else "delete")

    async def _send(self, peer: tuple[str, str], items: list[_Item]) -> None:
        """One write to the peer (an empty one keeps this router's copies there alive)."""
        assert self.peers is not None
        body = encode_batch(self.router_id, self.ttl_s, [(i.rid, i.what, i.n, i.value) for i in items])
        try:
            answer = await self.peers.send(peer, body)
        except BaseException:
            for i in items:
                if i.journal is not None:
                    i.journal.dirty = True
            raise
        self._sent = self.clock.monotonic()
        lost, rebase = set(answer.get("lost") or ()), set(answer.get("rebase") or ())
        for item in items:
            rid = item.rid
            if rid in lost:
                self._lost(rid)
            elif item.what == "delete":
                self._deleting.discard(rid)
                self._written.pop(rid, None)
            elif rid in rebase:  # the peer has no base for it: whole at the next flush
                self._written.setdefault(rid, _Written()).where = ""
            else:
                w = self._written.setdefault(rid, _Written())
                w.where, w.n, w.c = peer[0], item.n, item.c
                if item.what == "base":
                    w.base_bytes, w.deltas, w.delta_bytes, w.static = item.size, 0, 0, item.static
                self.keys_written += 1
                if rid not in self.live:  # it finished while this write was on its way: delete it next
                    self._deleting.add(rid)

    def _lost(self, rid: str) -> None:
        log.info("request %s was claimed by another router; letting go of it", rid)
        self.live.pop(rid, None)
        self._deleting.discard(rid)
        self._written.pop(rid, None)
        self.on_lost(rid)

    def _sliced(self, began: float) -> None:
        if self.on_slice is not None:
            self.on_slice(time.perf_counter() - began)

    async def _write(self, batch: list[_Item]) -> None:
        """One transaction (counted by :meth:`flush`); on a conflict, one per key to find which was lost."""
        try:
            result = await self.store.txn([i.compare for i in batch], [op for i in batch for op in i.ops])
        except BaseException:
            for i in batch:
                if i.journal is not None:
                    i.journal.dirty = True
            raise
        if result.succeeded:
            self._committed(batch, result.revision)
            return
        # Someone else wrote one of these keys: find which, one key at a time (rare).
        for item in batch:
            self.txns += 1
            single = await self.store.txn([item.compare], item.ops)
            if single.succeeded:
                self._committed([item], single.revision)
            else:
                self._lost(item.rid)

    def _committed(self, batch: list[_Item], revision: int) -> None:
        for item in batch:
            rid = item.rid
            if item.what == "delete":
                self._deleting.discard(rid)
                self._written.pop(rid, None)
                continue
            w = self._written.setdefault(rid, _Written())
            if item.what == "leave":  # its keys in etcd are gone; it is written to a peer now
                w.mod = 0
                continue
            w.where = _ETCD
            w.n, w.c = item.n, item.c
            if item.what == "base":
                w.mod, w.base_bytes, w.deltas, w.delta_bytes, w.static = revision, item.size, 0, 0, item.static
            self.keys_written += 1
            if rid not in self.live:  # it finished while this write was on its way: delete it next
                self._deleting.add(rid)

    async def claim(self, request_id: str, *, owner: str | None = None) -> Journal | None:
        """Take over a request another router checkpointed (a client resuming here); None if gone, if this
        router finished it (its checkpoint is deleted at the next flush), or if it belongs to another API key
        than ``owner``; :class:`NotResumable` if it cannot be continued exactly. In those cases it is left as
        it is. Its deltas are compacted into one base, written as this router's: the old owner's next write
        fails. A copy held by a router (``routing.checkpoint_store: peers``) is looked for first here, then in
        etcd, then on the other routers; it is written whole to this router's target at the next flush."""
        if request_id in self._deleting or self.lease is None:
            return None
        try:
            if self.replicas is not None:
                j = self.replicas.claim(request_id, by=self.router_id, key=owner)
                if j is not None:
                    self.adopt(j)
                    return j
            j = await self._claim_etcd(request_id, owner=owner)
            if j is None and self.peers is not None:
                j = await self.peers.claim(request_id, key=owner)
                if j is not None:
                    self.adopt(j)
        except NotClaimable as exc:
            raise NotResumable(exc.why) from None
        return j

    async def _claim_etcd(self, request_id: str, *, owner: str | None) -> Journal | None:
        found = await read_checkpoint(self.store, self.keys, request_id)
        if found is None or self.lease is None or found[0].owner != owner:
            return None
        journal, mod = found
        why = journal.resumable()
        if why is not None:
            raise NotResumable(why)
        key = self.keys.request(request_id)
        value = journal.checkpoint_bytes(self.router_id)
        result = await self.store.txn([Compare(key, "mod", "==", mod)],
                                      [Put(key, value, self.lease.id), Delete(_deltas_of(key), prefix=True)])
        if not result.succeeded:
            return None
        self._written[request_id] = _Written(mod=result.revision, n=len(journal.emitted), c=len(journal.text),
                                             base_bytes=len(value), static=journal.static_key)
        self.live[request_id] = journal
        journal.dirty = False
        return journal

    async def aclose(self, *, revoke: bool = True) -> None:
        if self.lease is not None:
            with contextlib.suppress(asyncio.CancelledError, FleetwardError):
                await self.lease.aclose(revoke=revoke)
            self.lease = None
