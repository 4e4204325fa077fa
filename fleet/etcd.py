"""The state store: etcd v3 through aetcd, with the operations fleetward's design needs.

Contract of :class:`StateStore` (the only thing the rest of fleetward sees):

- ``get_prefix(prefix, revision=None)`` reads a consistent snapshot and returns its revision, so a reader
  can then ``watch_prefix(prefix, start_revision=snapshot.revision + 1)`` and miss nothing.
- ``watch_prefix`` survives connection loss: it reconnects with bounded retries and resumes from the
  revision after the last event it delivered. If etcd compacted that revision meanwhile it raises
  :class:`~fleetward.fleet.errors.StoreError` (``compacted=True``); the caller must re-read.
- Unary calls retry transient failures (unavailable, deadline) a bounded number of times with jittered
  exponential backoff (tenacity) and then raise :class:`StoreUnavailable` naming the endpoint.
- Leases: :meth:`grant`, :meth:`keepalive` (returns the remaining TTL, 0 once expired), :meth:`revoke`;
  :class:`LeaseKeeper` keeps one alive in the background and reports when it was lost.
- Transactions are all-or-nothing compare-and-swap over :class:`Compare` and :class:`Put` / :class:`Delete`.
- :class:`Election` is the usual etcd recipe (lowest create-revision under a prefix wins) and gives the
  leader a fencing comparison to put in every transaction it makes as leader.

Several endpoints may be given (a 3-member cluster); an unavailable one makes the client move to the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import aetcd
import aetcd.exceptions as aex
from aetcd import rpc
from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.errors import StoreError, StoreUnavailable

__all__ = [
    "KV",
    "Compare",
    "Delete",
    "Election",
    "EtcdStore",
    "LeaseKeeper",
    "Put",
    "Snapshot",
    "StateStore",
    "TxnResult",
    "WatchEvent",
    "prefix_end",
]

log = logging.getLogger(__name__)

_TRANSIENT = (aex.ConnectionFailedError, aex.ConnectionTimeoutError, aex.InternalError)


@dataclass(frozen=True, slots=True)
class KV:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    def json(self) -> Any:
        return json.loads(self.value)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Keys under a prefix as of ``revision``."""

    revision: int
    items: tuple[KV, ...]


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    key: str
    value: bytes
    revision: int
    create_revision: int = 0

    def json(self) -> Any:
        return json.loads(self.value)


@dataclass(frozen=True, slots=True)
class Compare:
    """``target(key) op value``; target is one of value, version, create, mod, lease."""

    key: str
    target: Literal["value", "version", "create", "mod", "lease"]
    op: Literal["==", "!=", "<", ">"]
    value: int | bytes


@dataclass(frozen=True, slots=True)
class Put:
    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Delete:
    key: str
    prefix: bool = False


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int


class StateStore(Protocol):
    """What fleetward needs from etcd (see the module docstring for semantics and errors)."""

    @property
    def endpoint(self) -> str: ...

    async def get(self, key: str) -> KV | None: ...

    async def get_prefix(self, prefix: str, *, revision: int | None = None) -> Snapshot: ...

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int: ...

    async def delete(self, key: str, *, prefix: bool = False) -> int: ...

    async def txn(self, compare: Sequence[Compare], success: Sequence[Put | Delete],
                  failure: Sequence[Put | Delete] = ()) -> TxnResult: ...

    def watch_prefix(self, prefix: str, *, start_revision: int) -> AsyncIterator[WatchEvent]: ...

    async def grant(self, ttl: int) -> int: ...

    async def keepalive(self, lease: int) -> int: ...

    async def revoke(self, lease: int) -> None: ...

    async def aclose(self) -> None: ...


def prefix_end(prefix: bytes) -> bytes:
    """The exclusive end of the key range holding every key that starts with ``prefix``."""
    return aetcd.utils.prefix_range_end(prefix)


_OPS = {"==": rpc.Compare.EQUAL, "!=": rpc.Compare.NOT_EQUAL, "<": rpc.Compare.LESS, ">": rpc.Compare.GREATER}


def _compare_msg(c: Compare) -> Any:
    msg = rpc.Compare(key=c.key.encode(), result=_OPS[c.op])
    if c.target == "value":
        msg.target = rpc.Compare.VALUE
        msg.value = c.value if isinstance(c.value, bytes) else str(c.value).encode()
    elif c.target == "version":
        msg.target = rpc.Compare.VERSION
        msg.version = int(c.value)
    elif c.target == "create":
        msg.target = rpc.Compare.CREATE
        msg.create_revision = int(c.value)
    elif c.target == "mod":
        msg.target = rpc.Compare.MOD
        msg.mod_revision = int(c.value)
    else:
        msg.target = rpc.Compare.LEASE
        msg.lease = int(c.value)
    return msg


def _op_msg(op: Put | Delete) -> Any:
    if isinstance(op, Put):
        return rpc.RequestOp(request_put=rpc.PutRequest(key=op.key.encode(), value=op.value, lease=op.lease))
    key = op.key.encode()
    req = rpc.DeleteRangeRequest(key=key, range_end=prefix_end(key) if op.prefix else b"")
    return rpc.RequestOp(request_delete_range=req)


def _kv(raw: Any) -> KV:
    return KV(raw.key.decode(), bytes(raw.value), raw.create_revision, raw.mod_revision, raw.version, raw.lease)


class EtcdStore:
    """:class:`StateStore` on a real etcd (one or more endpoints ``host:port``)."""

    def __init__(self, endpoints: str | Sequence[str], *, timeout_s: float = 5.0, attempts: int = 5,
                 retry_budget_s: float = 15.0, clock: Clock = SYSTEM_CLOCK) -> None:
        self._endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not self._endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self._current = 0
        self._timeout = timeout_s
        self._attempts = attempts
        self._budget = retry_budget_s
        self._clock = clock
        self._client: aetcd.Client | None = None
        self._lock = asyncio.Lock()
        self._closed = False

    @property
    def endpoint(self) -> str:
        return self._endpoints[self._current]

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(self._endpoints)

    async def _connected(self) -> aetcd.Client:
        if self._closed:
            raise StoreError("the store was closed")
        if self._client is None:
            async with self._lock:
                if self._client is None:
                    host, _, port = self.endpoint.rpartition(":")
                    client = aetcd.Client(host=host, port=int(port), timeout=self._timeout)
                    await client.connect()
                    self._client = client
        return self._client

    async def _rotate(self, failed: aetcd.Client | None) -> None:
        """Drop a client that failed and move to the next endpoint."""
        async with self._lock:
            if failed is not None and self._client is failed:
                self._client = None
                self._current = (self._current + 1) % len(self._endpoints)
                with contextlib.suppress(Exception):
                    await failed.close()

    def _retrying(self) -> AsyncRetrying:
        return AsyncRetrying(
            stop=stop_after_attempt(self._attempts) | stop_after_delay(self._budget),
            wait=wait_exponential_jitter(initial=0.05, max=2.0),
            retry=retry_if_exception_type(_TRANSIENT),
            sleep=self._clock.sleep,
            reraise=False,
        )

    async def _call(self, what: str, fn: Any) -> Any:
        """Run ``fn(client)`` with bounded retries; translate aetcd's errors."""
        attempts = 0
        try:
            async for attempt in self._retrying():
                with attempt:
                    attempts += 1
                    client = await self._connected()
                    try:
                        return await fn(client)
                    except _TRANSIENT:
                        if len(self._endpoints) > 1:
                            await self._rotate(client)
                        raise
        except RetryError as exc:
            cause = exc.last_attempt.exception()
            raise StoreUnavailable(
                f"etcd unreachable at {', '.join(self._endpoints)}: {what} failed {attempts} times "
                f"({type(cause).__name__}: {cause}); is etcd running? (`fleetward up` starts one, "
                f"or pass --etcd host:port)",
                endpoint=",".join(self._endpoints), attempts=attempts) from cause
        except aex.RevisionCompactedError as exc:
            raise StoreError(f"etcd: {what}: {exc}") from exc
        except aex.ClientError as exc:
            raise StoreError(f"etcd: {what} failed: {exc}") from exc
        raise AssertionError("unreachable")

    async def get(self, key: str) -> KV | None:
        snap = await self._range(key.encode(), b"", None, what=f"get {key}")
        return snap.items[0] if snap.items else None

    async def get_prefix(self, prefix: str, *, revision: int | None = None) -> Snapshot:
        key = prefix.encode()
        return await self._range(key, prefix_end(key), revision, what=f"get-prefix {prefix}")

    async def _range(self, key: bytes, end: bytes, revision: int | None, *, what: str) -> Snapshot:
        req = rpc.RangeRequest(key=key, range_end=end, revision=revision or 0)

        async def call(client: aetcd.Client) -> Snapshot:
            try:
                resp = await client.kvstub.Range(req, timeout=self._timeout, metadata=client.metadata)
            except rpc.AioRpcError as exc:
                if "compacted" in (exc.details() or ""):
                    raise aex.RevisionCompactedError(revision) from exc
                aex._handle_exception(exc)
            return Snapshot(resp.header.revision, tuple(_kv(kv) for kv in resp.kvs))

        result: Snapshot = await self._call(what, call)
        return result

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        result = await self.txn((), (Put(key, value, lease),))
        return result.revision

    async def delete(self, key: str, *, prefix: bool = False) -> int:
        req = rpc.DeleteRangeRequest(key=key.encode(), range_end=prefix_end(key.encode()) if prefix else b"")

        async def call(client: aetcd.Client) -> int:
            try:
                resp = await client.kvstub.DeleteRange(req, timeout=self._timeout, metadata=client.metadata)
            except rpc.AioRpcError as exc:
                aex._handle_exception(exc)
            return int(resp.deleted)

        result: int = await self._call(f"delete {key}", call)
        return result

    async def txn(self, compare: Sequence[Compare], success: Sequence[Put | Delete],
                  failure: Sequence[Put | Delete] = ()) -> TxnResult:
        req = rpc.TxnRequest(compare=[_compare_msg(c) for c in compare],
                             success=[_op_msg(o) for o in success], failure=[_op_msg(o) for o in failure])

        async def call(client: aetcd.Client) -> TxnResult:
            try:
                resp = await client.kvstub.Txn(req, timeout=self._timeout, metadata=client.metadata)
            except rpc.AioRpcError as exc:
                aex._handle_exception(exc)
            return TxnResult(bool(resp.succeeded), int(resp.header.revision))

        result: TxnResult = await self._call("txn", call)
        return result

    async def grant(self, ttl: int) -> int:
        async def call(client: aetcd.Client) -> int:
            lease = await client.lease(ttl)
            return int(lease.id)

        result: int = await self._call(f"grant lease ttl={ttl}", call)
        return result

    async def keepalive(self, lease: int) -> int:
        async def call(client: aetcd.Client) -> int:
            reply = await client.refresh_lease(lease)
            return int(reply.TTL) if reply is not None else 0

        result: int = await self._call(f"keepalive lease {lease:x}", call)
        return result

    async def revoke(self, lease: int) -> None:
        async def call(client: aetcd.Client) -> None:
            try:
                await client.revoke_lease(lease)
            except aex.ClientError as exc:
                if "not found" not in str(exc):
                    raise

        await self._call(f"revoke lease {lease:x}", call)

    async def watch_prefix(self, prefix: str, *, start_revision: int) -> AsyncIterator[WatchEvent]:
        """Every change under ``prefix`` from ``start_revision`` on, in revision order, across reconnects."""
        key = prefix.encode()
        next_rev = start_revision
        while True:
            client = await self._call(f"watch {prefix}", lambda c: asyncio.sleep(0, c))
            try:
                watch = await client.watch(key, range_end=prefix_end(key), start_revision=next_rev)
            except aex.RevisionCompactedError as exc:
                raise StoreError(f"etcd: watch {prefix} from revision {next_rev}: {exc}") from exc
            except _TRANSIENT + (aex.WatchTimeoutError,):
                await self._rotate(client)
                await self._clock.sleep(0.2)
                continue
            try:
                async for ev in watch:
                    kv = ev.kv
                    kind: Literal["put", "delete"] = "put" if ev.kind == "PUT" else "delete"
                    yield WatchEvent(kind, kv.key.decode(), bytes(kv.value), kv.mod_revision,
                                     kv.create_revision)
                    next_rev = kv.mod_revision + 1
                return  # cancelled by aclose of the store
            except aex.RevisionCompactedError as exc:
                raise StoreError(f"etcd: watch {prefix} from revision {next_rev}: {exc}") from exc
            except (aex.ClientError, rpc.AioRpcError) as exc:
                log.info("etcd watch on %s broke (%s); resuming from revision %d", prefix, exc, next_rev)
                await self._rotate(client)
                await self._clock.sleep(0.2)
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.shield(watch.cancel())

    async def aclose(self) -> None:
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()


class LeaseKeeper:
    """Grants a lease and keeps it alive until :meth:`aclose` revokes it.

    ``lost`` is set when etcd says the lease expired (e.g. after a partition longer than the TTL): keys
    bound to it are gone, and the owner must register again under a new lease.
    """

    def __init__(self, store: StateStore, ttl: int, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.store = store
        self.ttl = ttl
        self.id = 0
        self.lost = asyncio.Event()
        self._clock = clock
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LeaseKeeper:
        self.id = await self.store.grant(self.ttl)
        self._task = asyncio.create_task(self._run(), name=f"lease-keepalive-{self.id:x}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _run(self) -> None:
        while True:
            await self._clock.sleep(max(0.5, self.ttl / 3))
            try:
                remaining = await self.store.keepalive(self.id)
            except StoreUnavailable as exc:
                log.warning("lease %x keepalive failed: %s", self.id, exc)
                continue
            if remaining <= 0:
                log.warning("lease %x expired; its keys are gone", self.id)
                self.lost.set()
                return

    async def aclose(self, *, revoke: bool = True) -> None:
        """Stop keeping the lease alive; revoke it (its keys vanish now) unless ``revoke`` is false."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if revoke and self.id and not self.lost.is_set():
            with contextlib.suppress(StoreUnavailable, StoreError):
                await self.store.revoke(self.id)


class Election:
    """Leader election under ``prefix`` (e.g. ``/fleetward/c/leader/supervisor/``).

    Each candidate puts ``prefix + <lease id>`` bound to its lease; the key with the lowest create
    revision is the leader. :meth:`campaign` returns once this candidate leads. Every action the leader
    takes should include :attr:`fence` in its transaction: it fails as soon as leadership is lost, so two
    leaders never both act.
    """

    def __init__(self, store: StateStore, prefix: str, *, candidate: str, lease: LeaseKeeper) -> None:
        self.store = store
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.candidate = candidate
        self.lease = lease
        self.key = ""
        self.create_revision = 0

    @property
    def fence(self) -> Compare:
        """A comparison that holds only while this candidate's key still stands (it is the leader)."""
        if not self.create_revision:
            raise StoreError("not campaigning")
        return Compare(self.key, "create", "==", self.create_revision)

    async def campaign(self) -> None:
        self.key = f"{self.prefix}{self.lease.id:x}"
        value = json.dumps({"candidate": self.candidate}).encode()
        res = await self.store.txn([Compare(self.key, "create", "==", 0)], [Put(self.key, value, self.lease.id)])
        kv = await self.store.get(self.key)
        if kv is None:
            raise StoreError(f"election key {self.key} vanished right after it was created (lease expired?)")
        self.create_revision = kv.create_revision
        del res
        while True:
            snap = await self.store.get_prefix(self.prefix)
            older = [kv for kv in snap.items if kv.create_revision < self.create_revision]
            if not any(kv.key == self.key for kv in snap.items):
                raise StoreError(f"election key {self.key} was deleted while campaigning")
            if not older:
                return
            # Wait for the candidate right before us to go away, then look again.
            target = max(older, key=lambda kv: kv.create_revision).key
            async for ev in self.store.watch_prefix(self.prefix, start_revision=snap.revision + 1):
                if ev.kind == "delete" and ev.key in (target, self.key):
                    break

    async def leader(self) -> str | None:
        """The current leader's candidate name, or None."""
        snap = await self.store.get_prefix(self.prefix)
        if not snap.items:
            return None
        first = min(snap.items, key=lambda kv: kv.create_revision)
        candidate: str = first.json()["candidate"]
        return candidate

    async def is_leader(self) -> bool:
        if not self.create_revision:
            return False
        res = await self.store.txn([self.fence], ())
        if not res.succeeded:
            return False
        snap = await self.store.get_prefix(self.prefix)
        return min(snap.items, key=lambda kv: kv.create_revision).key == self.key

    async def resign(self) -> None:
        if self.key:
            await self.store.txn([self.fence], [Delete(self.key)])
        self.create_revision = 0


def dumps(obj: Any) -> bytes:
    """The JSON encoding used for every value fleetward writes to etcd."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def loads_all(items: Iterable[KV]) -> dict[str, Any]:
    return {kv.key: kv.json() for kv in items}
