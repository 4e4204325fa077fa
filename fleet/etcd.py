"""The state store: etcd v3 through aetcd, with the operations fleetward's design needs.

Contract of :class:`StateStore` (the only thing the rest of fleetward sees):

- ``get_prefix(prefix, revision=None)`` reads a consistent snapshot and returns its revision, so a reader
  can then ``watch_prefix(prefix, start_revision=snapshot.revision + 1)`` and miss nothing. With
  ``revision`` it is a historical read (:class:`StoreError` if that revision was compacted or is in the
  future). With ``keys_only`` every value is ``b""`` (keys, revisions and leases only: cheap over many
  large values).
- ``watch_prefix`` yields every change under the prefix from ``start_revision`` on, in revision order
  (the events of one transaction share a revision and keep their order). It survives connection loss and
  etcd restarts: it re-creates the watch with bounded retries and resumes right after the last event it
  delivered, so nothing is missed and nothing is delivered twice. If etcd stays away longer than the retry
  budget it raises :class:`StoreUnavailable`; if etcd compacted the revision it must resume from, it raises
  :class:`StoreError` (the message says "compacted"): the caller must re-read with ``get_prefix``. It ends
  quietly when the store is closed. Close it (``contextlib.aclosing``) when you stop reading early, so the
  watch is cancelled on the server too.
- Unary calls retry transient failures (unavailable, deadline) a bounded number of times with jittered
  exponential backoff (tenacity) and then raise :class:`StoreUnavailable` naming the endpoint(s). A call
  whose connection failed mid-flight has an unknown outcome and is retried as well: a compare-and-swap that
  had in fact been applied then reports ``succeeded=False``, so callers that must know re-read.
- Leases: :meth:`~StateStore.grant`, :meth:`~StateStore.keepalive` (returns the remaining TTL, 0 once
  expired), :meth:`~StateStore.revoke` (revoking an unknown or expired lease is not an error);
  :class:`~fleetward.fleet.lease.LeaseKeeper` keeps one alive in the background and reports when it was lost.
- Transactions are all-or-nothing compare-and-swap over :class:`Compare` and :class:`Put` / :class:`Delete`.
- The recipes built on these calls live beside this module, over :class:`StateStore` only: the lease keeper
  (``fleet/lease.py``) and leader election with its lead-campaign-again loop (``fleet/election.py``).

Any other failure etcd reports becomes :class:`StoreError`; so does any call on a closed store, and a refusal
of this client's credentials (a wrong password, a user without the permission: the message says so).

TLS and auth (an :class:`~fleetward.fleet.config.Access`): the channel is TLS when it says so (its CA verifies
etcd, its client certificate answers etcd's ``--client-cert-auth``); with a username the client authenticates
on connecting and sends etcd's token with every call. etcd drops a token it has not seen used for
``--auth-token-ttl`` (5 minutes), and every token of a user whose password or roles changed: a call refused
for its token authenticates again and is retried. Several
endpoints may be given (a 3-member cluster); an unavailable one makes the client move to the next.

One module (over 600 lines) because the store's calls share one client, its endpoint failover and its error
translation.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol, TypeVar

import aetcd
import aetcd.exceptions as aex
import grpc
from aetcd import rpc
from grpc.aio import UsageError
from pydantic import SecretStr
from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
    wait_random,
)

from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.config import Access
from fleetward.fleet.errors import StoreError, StoreUnavailable

__all__ = [
    "KV",
    "Compare",
    "Delete",
    "EtcdStore",
    "Put",
    "Snapshot",
    "StateStore",
    "TxnResult",
    "WatchEvent",
    "dumps",
    "enable_auth",
    "loads_all",
    "prefix_end",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT: tuple[type[Exception], ...] = (
    aex.ConnectionFailedError, aex.ConnectionTimeoutError, aex.InternalError,
)
# Creating a watch waits for etcd's "created" reply; aetcd reports a missing reply as WatchTimeoutError.
_WATCH_TRANSIENT: tuple[type[Exception], ...] = (*_TRANSIENT, aex.WatchTimeoutError)
_FOREIGN: tuple[type[Exception], ...] = (aex.ClientError, rpc.AioRpcError, UsageError)
# etcd's words for a token it no longer honours (expired or revoked; issued before a change of roles).
_STALE_TOKEN = ("invalid auth token", "revision of auth store is old")

# gRPC's reconnect backoff grows to 120 s by default: a restarted etcd would stay unused for minutes while
# fail-fast calls keep failing. Keepalive pings find a dead peer under an idle watch stream (etcd refuses
# pings more often than every 5 s, hence 10 s).
_CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
}


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
    """One change: ``revision`` is the revision of the change (for a delete, of the deletion)."""

    kind: Literal["put", "delete"]
    key: str
    value: bytes
    revision: int
    create_revision: int = 0

    def json(self) -> Any:
        return json.loads(self.value)


@dataclass(frozen=True, slots=True)
class Compare:
    """``target(key) op value``; target is one of value, version, create, mod, lease.

    A missing key has version, create and mod revision 0, so ``Compare(k, "create", "==", 0)`` means
    "k does not exist".
    """

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

    async def get_prefix(self, prefix: str, *, revision: int | None = None, keys_only: bool = False) -> Snapshot: ...

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int: ...

    async def delete(self, key: str, *, prefix: bool = False) -> int: ...

    async def txn(self, compare: Sequence[Compare], success: Sequence[Put | Delete],
                  failure: Sequence[Put | Delete] = ()) -> TxnResult: ...

    def watch_prefix(self, prefix: str, *, start_revision: int) -> AsyncGenerator[WatchEvent, None]: ...

    async def grant(self, ttl: int) -> int: ...

    async def keepalive(self, lease: int, *, attempt_timeout: float | None = None) -> int: ...

    async def revoke(self, lease: int) -> None: ...

    async def aclose(self) -> None: ...


def prefix_end(prefix: bytes) -> bytes:
    """The exclusive end of the key range holding every key that starts with ``prefix``."""
    end: bytes = aetcd.utils.prefix_range_end(prefix)
    return end


_OPS = {"==": rpc.Compare.EQUAL, "!=": rpc.Compare.NOT_EQUAL, "<": rpc.Compare.LESS, ">": rpc.Compare.GREATER}


@functools.lru_cache(maxsize=8192)
def _compare_msg(c: Compare) -> Any:
    """The message of a compare (cached: a writer that keeps ownership of its keys, like the checkpointer,
    sends the same compares flush after flush; a message is copied into each request, never changed)."""
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


class _Reauthenticated(aex.ClientError):
    """A call was refused for a stale token; the client has a fresh one now (the call is retried)."""


class _WatchRefused(aex.ClientError):
    """etcd answered a watch's creation by cancelling it (``cancel_reason``: with auth on, a stream whose
    token etcd no longer knows reads as "permission denied")."""


class _Watcher(aetcd.watcher.Watcher):  # aetcd is untyped: its attributes are Any
    """aetcd's watcher, except that a creation etcd cancels fails (aetcd would wait on a watch that never
    delivers)."""

    async def _handle_response(self, response: Any) -> None:
        if response.created and response.canceled and not response.compact_revision:  # compacted: aetcd's error
            async with self._lock:
                if self._new_callback is not None:
                    self._new_callback.error = _WatchRefused(response.cancel_reason or "watch cancelled by etcd")
                    self._new_callback_ready.notify_all()
            return
        await super()._handle_response(response)

    async def restart_stream(self) -> None:
        """End the stream (its watches fail as after a lost connection, and are re-created by their
        owners); the next watch opens a new stream with the current token."""
        await self._terminate_stream(aex.ConnectionFailedError("watch stream restarted with a fresh auth token"))


class _Client(aetcd.Client):  # aetcd is untyped: its attributes are Any
    """aetcd's client on a TLS channel when ``access`` asks for one (aetcd 1.x opens only insecure channels),
    able to authenticate again when etcd drops its token."""

    _is_connecting: bool
    metadata: Any

    def __init__(self, host: str, port: int, *, access: Access, timeout: float, options: dict[str, Any]) -> None:
        password = access.password.get_secret_value() if access.password is not None else None
        super().__init__(host=host, port=port, username=access.username, password=password, timeout=timeout,
                         options=options)
        self._access = access
        self._auth_lock = asyncio.Lock()

    def _channel(self) -> Any:
        target = f"{self._host}:{self._port}"
        if not self._access.tls:
            return rpc.insecure_channel(target, options=self._options.items())
        a = self._access
        try:
            creds = grpc.ssl_channel_credentials(
                root_certificates=a.ca_file.read_bytes() if a.ca_file is not None else None,
                private_key=a.key_file.read_bytes() if a.key_file is not None else None,
                certificate_chain=a.cert_file.read_bytes() if a.cert_file is not None else None)
        except OSError as exc:
            raise StoreError(f"etcd: cannot read a TLS file: {exc.filename}: {exc.strerror}") from exc
        return grpc.aio.secure_channel(target, creds, options=list(self._options.items()))

    async def connect(self) -> None:
        # aetcd's connect with the channel made by _channel (same attributes, same order).
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            self.channel = self._channel()
            if self._username is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                await self._authenticate()
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = _Watcher(rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata)
            self._connected.set()
        except BaseException:
            if self.channel is not None:
                await self.channel.close()
            self._init_channel_attrs()
            raise
        finally:
            self._is_connecting = False

    async def _authenticate(self) -> None:
        request = rpc.AuthenticateRequest(name=self._username, password=self._password)
        try:
            resp = await self.auth_stub.Authenticate(request, timeout=self._timeout)
        except rpc.AioRpcError as exc:
            aex._handle_exception(exc)
        self.metadata = (("token", resp.token),)
        if self._watcher is not None:  # a watch stream opened from now on carries the new token
            self._watcher._metadata = self.metadata

    async def reauthenticate(self, stale: Any, *, watch_refused: bool = False) -> None:
        """A fresh token, unless another call already replaced the ``stale`` one. ``watch_refused``: the watch
        stream's own token is stale too (etcd reads a stream's token when the stream opens), so the stream
        is restarted."""
        async with self._auth_lock:
            if self.metadata == stale:
                await self._authenticate()
            if watch_refused and self._watcher is not None:
                await self._watcher.restart_stream()


def _stale_token(exc: BaseException) -> bool:
    return isinstance(exc, aex.ClientError | rpc.AioRpcError) and any(s in str(exc) for s in _STALE_TOKEN)


def _refusal(exc: BaseException, access: Access) -> str:
    """Why etcd refused this client, in the operator's words (or "")."""
    text = str(exc)
    if "authentication failed" in text or "user name is empty" in text:
        return (f" (etcd refused user {access.username!r}: check etcd_access.username and its password)"
                if access.username else " (etcd wants a user: set etcd_access.username and a password)")
    if "permission denied" in text:
        return (f" (user {access.username!r} lacks the permission on this key range)" if access.username
                else " (etcd has auth on: set etcd_access.username and a password)")
    if "authentication is not enabled" in text:
        return " (etcd_access gives a username, but auth is not enabled on this etcd)"
    return ""


async def enable_auth(endpoint: str, *, access: Access, root_password: SecretStr, user: str, password: SecretStr,
                      prefix: str, timeout_s: float = 5.0) -> None:
    """Turn etcd's auth on at ``endpoint`` (a fresh etcd, auth still off; ``access`` its TLS): a ``root`` user
    with ``root_password`` (etcd requires one), and ``user`` with ``password`` and a role of the same name
    that may read and write every key under ``prefix``. :class:`StoreError` when etcd refuses a step."""
    client = _Client(*_host_port(endpoint), access=replace(access, username=None, password=None),
                     timeout=timeout_s, options=_CHANNEL_OPTIONS)
    try:
        await client.connect()
        stub = rpc.AuthStub(client.channel)
        key = prefix.encode()
        steps: list[tuple[str, Any, Any]] = [
            ("add user root", stub.UserAdd, rpc.AuthUserAddRequest(name="root",
                                                                   password=root_password.get_secret_value())),
            ("add role root", stub.RoleAdd, rpc.AuthRoleAddRequest(name="root")),
            ("grant root", stub.UserGrantRole, rpc.AuthUserGrantRoleRequest(user="root", role="root")),
            (f"add user {user}", stub.UserAdd, rpc.AuthUserAddRequest(name=user, password=password.get_secret_value())),
            (f"add role {user}", stub.RoleAdd, rpc.AuthRoleAddRequest(name=user)),
            (f"let {user} read and write {prefix}", stub.RoleGrantPermission, rpc.AuthRoleGrantPermissionRequest(
                name=user, perm=rpc.Permission(permType=rpc.Permission.READWRITE, key=key,
                                               range_end=prefix_end(key)))),
            (f"grant {user}", stub.UserGrantRole, rpc.AuthUserGrantRoleRequest(user=user, role=user)),
            ("enable auth", stub.AuthEnable, rpc.AuthEnableRequest()),
        ]
        for what, method, request in steps:
            try:
                await method(request, timeout=timeout_s)
            except rpc.AioRpcError as exc:
                raise StoreError(f"etcd at {endpoint}: cannot {what}: {exc.details()}") from exc
    finally:
        await client.close()


def _host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


class EtcdStore:
    """:class:`StateStore` on a real etcd (one or more endpoints ``host:port``).

    ``timeout_s`` bounds each RPC; a call is tried at most ``attempts`` times and for at most
    ``retry_budget_s`` seconds before :class:`StoreUnavailable` (backoff 0.05 s doubling to 2 s: the
    defaults ride out an etcd restart or a leader election of several seconds). Connecting is lazy: the
    constructor never fails on an unreachable etcd, the first call does. Usable as ``async with``;
    :meth:`aclose` ends every watch of this store. ``access``: TLS and credentials (none by default).
    """

    def __init__(self, endpoints: str | Sequence[str], *, timeout_s: float = 5.0, attempts: int = 10,
                 retry_budget_s: float = 15.0, clock: Clock = SYSTEM_CLOCK, access: Access | None = None) -> None:
        # "a:2379,b:2379" is a cluster's members, as etcdctl's --endpoints writes them.
        listed = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
        self._endpoints = [e.strip() for e in listed if e.strip()]
        if not self._endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        for ep in self._endpoints:
            host, sep, port = ep.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"etcd endpoint {ep!r} is not host:port")
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self._current = 0
        self._timeout = timeout_s
        self._attempts = attempts
        self._budget = retry_budget_s
        self._clock = clock
        self._access = access or Access()
        self._client: _Client | None = None
        self._lock = asyncio.Lock()
        self._closed = False
        self.reachable = True  # the last call got through (False once one gave up: ``fleetward_etcd_up``)

    async def __aenter__(self) -> EtcdStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def endpoint(self) -> str:
        return self._endpoints[self._current]

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(self._endpoints)

    @property
    def closed(self) -> bool:
        return self._closed

    async def _connected(self) -> _Client:
        if self._closed:
            raise StoreError("etcd: the store was closed")
        if self._client is None:
            async with self._lock:
                if self._client is None:
                    host, _, port = self.endpoint.rpartition(":")
                    client = _Client(host, int(port), access=self._access, timeout=self._timeout,
                                     options=_CHANNEL_OPTIONS)
                    try:
                        # No I/O without a username: the channel connects on the first call.
                        await client.connect()
                    except _TRANSIENT:
                        if len(self._endpoints) > 1:
                            self._current = (self._current + 1) % len(self._endpoints)
                        raise
                    self._client = client
        return self._client

    async def _rotate(self, failed: aetcd.Client) -> None:
        """Move to the next endpoint after ``failed`` could not reach its own.

        With a single endpoint the client stays: its channel reconnects by itself, and closing it would
        break every other call and watch sharing it.
        """
        if len(self._endpoints) == 1:
            return
        async with self._lock:
            if self._client is failed:
                self._client = None
                self._current = (self._current + 1) % len(self._endpoints)
                with contextlib.suppress(Exception):
                    await failed.close()  # type: ignore[union-attr]  # aetcd is untyped: Any

    def _retrying(self, transient: tuple[type[Exception], ...]) -> AsyncRetrying:
        return AsyncRetrying(
            stop=stop_after_attempt(self._attempts) | stop_after_delay(self._budget),
            wait=wait_exponential(multiplier=0.05, max=2.0) + wait_random(0, 0.05),
            retry=retry_if_exception_type((*transient, _Reauthenticated)),
            sleep=self._clock.sleep,
            reraise=False,
        )

    async def _call(self, what: str, fn: Callable[[aetcd.Client], Awaitable[T]], *,
                    transient: tuple[type[Exception], ...] = _TRANSIENT) -> T:
        """Run ``fn(client)`` with bounded retries; translate aetcd's and gRPC's errors."""
        attempts = 0
        watch_refused = False  # once per call: refused again after a fresh token and stream, it is meant
        try:
            async for attempt in self._retrying(transient):
                with attempt:
                    attempts += 1
                    client = await self._connected()
                    stale = client.metadata
                    try:
                        result = await fn(client)
                        self.reachable = True
                        return result
                    except transient:
                        await self._rotate(client)
                        raise
                    except asyncio.CancelledError as exc:
                        task = asyncio.current_task()
                        if self._closed or (task is not None and task.cancelling()):
                            raise
                        # Not this task's cancellation: another call moved to the next endpoint and closed this
                        # client, and gRPC cancels every call in flight on a closed channel. Raised on, it
                        # would end the caller's task as if cancelled (a lease keepalive loop stopped
                        # silently, and the agent's workers vanished with its lease: the soak found it).
                        raise aex.ConnectionFailedError(f"client closed while in use ({what})") from exc
                    except _FOREIGN as exc:
                        if client is not self._client and not self._closed:
                            # Another call moved to the next endpoint and closed this client under us.
                            raise aex.ConnectionFailedError(f"client closed while in use: {exc}") from exc
                        if self._access.username is not None and _stale_token(exc):
                            log.info("etcd refused this client's token (%s); authenticating again", exc)
                            await client.reauthenticate(stale)
                            raise _Reauthenticated(str(exc)) from exc
                        if self._access.username is not None and isinstance(exc, _WatchRefused) \
                                and not watch_refused:
                            watch_refused = True
                            log.info("etcd cancelled a new watch (%s); authenticating again", exc)
                            await client.reauthenticate(stale, watch_refused=True)
                            raise _Reauthenticated(str(exc)) from exc
                        raise
        except RetryError as exc:
            cause = exc.last_attempt.exception()
            self.reachable = False
            hint = ("is etcd running, and does it speak TLS? (check etcd_access: ca_file, cert_file, key_file)"
                    if self._access.tls or "handshake" in str(cause).lower() or "ssl" in str(cause).lower()
                    else "is etcd running? (`fleetward up` starts one, or pass --etcd host:port)")
            raise StoreUnavailable(
                f"etcd unreachable at {', '.join(self._endpoints)}: {what} failed {attempts} time(s) "
                f"({type(cause).__name__}: {cause}); {hint}",
                endpoint=",".join(self._endpoints), attempts=attempts) from cause
        except aex.RevisionCompactedError as exc:
            raise StoreError(f"etcd: {what}: {exc} (compacted: re-read the current state)") from exc
        except _FOREIGN as exc:
            raise StoreError(f"etcd: {what} failed: {type(exc).__name__}: {exc}{_refusal(exc, self._access)}") \
                from exc
        raise AssertionError("unreachable")  # tenacity has either returned or raised by now

    async def get(self, key: str) -> KV | None:
        snap = await self._range(key.encode(), b"", None, what=f"get {key}")
        return snap.items[0] if snap.items else None

    async def get_prefix(self, prefix: str, *, revision: int | None = None, keys_only: bool = False) -> Snapshot:
        key = prefix.encode()
        what = f"get-prefix {prefix}" + (f" at revision {revision}" if revision else "")
        return await self._range(key, prefix_end(key), revision, what=what, keys_only=keys_only)

    async def _range(self, key: bytes, end: bytes, revision: int | None, *, what: str,
                     keys_only: bool = False) -> Snapshot:
        req = rpc.RangeRequest(key=key, range_end=end, revision=revision or 0, keys_only=keys_only)

        async def call(client: aetcd.Client) -> Snapshot:
            try:
                resp = await client.kvstub.Range(req, timeout=self._timeout, metadata=client.metadata)
            except rpc.AioRpcError as exc:
                if "compacted" in (exc.details() or ""):
                    raise aex.RevisionCompactedError(revision) from exc
                aex._handle_exception(exc)
            return Snapshot(resp.header.revision, tuple(_kv(kv) for kv in resp.kvs))

        return await self._call(what, call)

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Write ``key``; returns the revision of the write."""
        result = await self.txn((), (Put(key, value, lease),))
        return result.revision

    async def delete(self, key: str, *, prefix: bool = False) -> int:
        """Delete ``key`` (or every key under it); returns how many keys were deleted."""
        req = rpc.DeleteRangeRequest(key=key.encode(), range_end=prefix_end(key.encode()) if prefix else b"")

        async def call(client: aetcd.Client) -> int:
            try:
                resp = await client.kvstub.DeleteRange(req, timeout=self._timeout, metadata=client.metadata)
            except rpc.AioRpcError as exc:
                aex._handle_exception(exc)
            return int(resp.deleted)

        return await self._call(f"delete {key}", call)

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

        return await self._call("txn", call)

    async def grant(self, ttl: int) -> int:
        async def call(client: aetcd.Client) -> int:
            lease = await client.lease(ttl)
            return int(lease.id)

        return await self._call(f"grant lease ttl={ttl}", call)

    async def keepalive(self, lease: int, *, attempt_timeout: float | None = None) -> int:
        """Refresh ``lease``; its remaining TTL (0: it expired). ``attempt_timeout``: an attempt with no answer that
        soon counts as a failure of its endpoint, and the next attempt goes to the next member (a member cut off
        from the others, or whose leader was, answers nothing until its own timeout: seconds past a short TTL)."""
        async def call(client: aetcd.Client) -> int:
            try:
                async with asyncio.timeout(attempt_timeout):
                    reply = await client.refresh_lease(lease)
            except TimeoutError:
                raise aex.ConnectionTimeoutError(f"no answer within {attempt_timeout}s") from None
            return int(reply.TTL) if reply is not None else 0

        return await self._call(f"keepalive lease {lease:x}", call)

    async def revoke(self, lease: int) -> None:
        async def call(client: aetcd.Client) -> None:
            try:
                await client.revoke_lease(lease)
            except aex.ClientError as exc:
                if "not found" not in str(exc):
                    raise

        await self._call(f"revoke lease {lease:x}", call)

    async def watch_prefix(self, prefix: str, *, start_revision: int) -> AsyncGenerator[WatchEvent, None]:
        """Every change under ``prefix`` from ``start_revision`` on, in revision order, across reconnects."""
        key = prefix.encode()
        end = prefix_end(key)
        # Resume point: the revision of the last event delivered and how many of its events were delivered
        # (one transaction makes several events with the same revision; a break may fall between them).
        resume_rev, delivered_at_resume = start_revision, 0
        pause = 0.0  # before re-creating a watch that broke without delivering anything: no tight loop
        while not self._closed:
            if pause:
                await self._clock.sleep(pause)
            what = f"watch {prefix} from revision {resume_rev}"

            async def create(client: aetcd.Client, start: int = resume_rev) -> Any:
                # aetcd waits for the "created" reply with asyncio.wait_for, which on Python 3.11 drops a
                # cancellation that lands as the reply arrives: let creation finish, then honour the cancel.
                creating = asyncio.ensure_future(client.watch(key, range_end=end, start_revision=start))
                try:
                    return await asyncio.shield(creating)
                except asyncio.CancelledError:
                    with contextlib.suppress(Exception):
                        await (await creating).cancel()
                    raise

            try:
                watch = await self._call(what, create, transient=_WATCH_TRANSIENT)
            except StoreError:
                if self._closed:
                    return
                raise
            to_skip = delivered_at_resume
            pause = min(max(pause * 2, 0.05), 1.0)
            events = aiter(watch)
            try:
                async for ev in events:
                    kv = ev.kv
                    rev = int(kv.mod_revision)
                    if rev == resume_rev and to_skip > 0:
                        to_skip -= 1  # delivered before the break
                        continue
                    kind: Literal["put", "delete"] = "put" if ev.kind == "PUT" else "delete"
                    event = WatchEvent(kind, kv.key.decode(), bytes(kv.value), rev, int(kv.create_revision))
                    if rev == resume_rev:
                        delivered_at_resume += 1
                    else:
                        resume_rev, delivered_at_resume = rev, 1
                    pause = 0.0
                    yield event
                # The stream ended without an error: the client was closed (by aclose, or by a rotation).
                if not self._closed:
                    log.info("etcd watch on %s ended; resuming from revision %d", prefix, resume_rev)
            except aex.RevisionCompactedError as exc:
                raise StoreError(f"etcd: {what}: {exc} (compacted: re-read the current state)") from exc
            except _FOREIGN as exc:
                # Re-creating the watch retries (and moves to the next endpoint) if etcd is still away.
                log.info("etcd watch on %s broke (%s: %s); resuming from revision %d", prefix,
                         type(exc).__name__, exc, resume_rev)
            finally:
                with contextlib.suppress(Exception):
                    await events.aclose()
                with contextlib.suppress(Exception):
                    await asyncio.shield(watch.cancel())

    async def aclose(self) -> None:
        """Close the connection; watches of this store end, later calls raise :class:`StoreError`."""
        self._closed = True
        async with self._lock:
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()


def dumps(obj: Any) -> bytes:
    """The JSON encoding used for every value fleetward writes to etcd."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def loads_all(items: Iterable[KV]) -> dict[str, Any]:
    return {kv.key: kv.json() for kv in items}
