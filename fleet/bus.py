"""The event bus: MQTT (QoS 1) through aiomqtt, JSON events on ``fleetward/<cluster>/events/<kind>``.

Contract of :class:`EventBus`:

- :meth:`~EventBus.publish` never waits for the broker. Events go into a bounded outbox that a background
  task (started by :meth:`MqttBus.start`) drains in order once connected; an event leaves the outbox only
  when the broker acknowledged it (PUBACK). So a broker restart loses nothing published while it was down
  (delivery is at least once: consumers dedupe on ``id``). When the outbox is full the oldest event is
  dropped and counted in ``dropped`` (events are never the only copy of state; etcd is). Events published
  before :meth:`MqttBus.start` wait in the outbox too. Extra fields may not reuse the envelope's names
  (``v``, ``id``, ``ts``, ``cluster``, ``kind``): ValueError.
- :meth:`~EventBus.flush` waits (up to a timeout) until everything published so far was acknowledged.
- :meth:`~EventBus.subscribe` yields events across broker restarts, each ``id`` once (redeliveries are
  recognised among the last 50,000 ids). With a ``session``
  name it uses a persistent MQTT session: the broker keeps the subscription and queues QoS 1 events while
  this subscriber is away (and, with Mosquitto's persistence, across a broker restart). Without one,
  events published while it is disconnected are missed. The optional ``subscribed`` event is set each time
  the subscription is in place (cleared while disconnected), so a caller knows when it may read etcd and
  rely on the bus for later changes. A persistent session outlives the subscriber: the broker keeps
  queueing for it until it returns.

Errors: :meth:`MqttBus.start` raises :class:`~fleetward.fleet.errors.BusUnavailable` when the broker cannot
be reached after bounded retries, or at once when it refuses this client's username or password; later
disconnects are retried in the background, forever.

TLS and credentials come from an :class:`~fleetward.fleet.config.Access`: its CA verifies the broker (and
the broker's name or address), its client certificate answers a broker that requires one
(``require_certificate``), its username and password go in CONNECT.

Payload: ``{"v": 1, "id", "ts", "cluster", "kind", "worker"?, "request"?, ...}`` (see docs/architecture.md,
"MQTT topics").
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import ssl
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import aiomqtt
from aiomqtt.exceptions import MqttConnectError
from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)

from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.config import Access
from fleetward.fleet.errors import BusUnavailable

__all__ = ["EVENT_KINDS", "FAULT_FAMILIES", "Event", "EventBus", "MqttBus", "topic_for"]

log = logging.getLogger(__name__)

T = TypeVar("T")

EVENT_KINDS = (
    "worker.up", "worker.down", "health.changed", "hang.detected", "migration", "restart", "quarantine",
    "action", "scale", "move", "fault.start", "fault.stop", "poison",
)

# The fault families a ``fault.start`` event names (chaos's catalogue groups its faults by them).
FAULT_FAMILIES = ("process", "gpu", "network", "kv", "control", "load", "partition")

_RESERVED = frozenset({"v", "id", "ts", "cluster", "kind"})
_BATCH = 64
_SEEN_IDS = 50_000


def topic_for(cluster: str, kind: str) -> str:
    return f"fleetward/{cluster}/events/{kind}"


@dataclass(frozen=True)
class Event:
    """One event; ``data`` holds the optional fields (``worker``, ``request``, ...) at the top level of JSON."""

    kind: str
    cluster: str
    ts: float
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def worker(self) -> str | None:
        return self.data.get("worker")

    @property
    def request(self) -> str | None:
        return self.data.get("request")

    def to_json(self) -> bytes:
        body = {**self.data, "v": 1, "id": self.id, "ts": self.ts, "cluster": self.cluster, "kind": self.kind}
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> Event:
        """Parse a payload; ValueError, KeyError or TypeError if it is not an event."""
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise TypeError("an event is a JSON object")
        data = {k: v for k, v in body.items() if k not in _RESERVED}
        return cls(kind=str(body["kind"]), cluster=str(body["cluster"]), ts=float(body["ts"]),
                   id=str(body["id"]), data=data)


class EventBus(Protocol):
    """Publish and subscribe to fleet events (see the module docstring)."""

    async def publish(self, kind: str, **data: Any) -> Event: ...

    def subscribe(self, kinds: Sequence[str] = ("#",), *, session: str | None = None,
                  subscribed: asyncio.Event | None = None) -> AsyncGenerator[Event, None]: ...

    async def flush(self, timeout: float) -> bool: ...

    async def aclose(self) -> None: ...


class MqttBus:
    """:class:`EventBus` on an MQTT broker at ``host:port``, or on the first that answers of several
    (``a:1883,b:1883``: a bridged pair; a connection that breaks is made again to the next one).

    ``outbox_size`` bounds the events waiting for the broker; ``inbox_size`` the events each subscriber has
    received and not yet taken (a consumer that falls behind sheds the newest: ``dropped_in``);
    ``connect_attempts`` bounds the first connection made by :meth:`start`. ``access``: TLS and credentials
    (none by default).
    """

    def __init__(self, endpoint: str, cluster: str, *, outbox_size: int = 10_000, inbox_size: int = 10_000,
                 clock: Clock = SYSTEM_CLOCK, client_id: str | None = None, connect_attempts: int = 5,
                 access: Access | None = None) -> None:
        # "a:1883,b:1883": brokers to fail over between (a bridged pair), tried in turn after a failure.
        self._brokers: list[tuple[str, int]] = []
        for one in (e.strip() for e in endpoint.split(",") if e.strip()):
            host, sep, port = one.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"MQTT endpoint {one!r} is not host:port")
            self._brokers.append((host, int(port)))
        if not self._brokers:
            raise ValueError("at least one MQTT endpoint is needed")
        self._current = 0
        if outbox_size < 1 or inbox_size < 1 or connect_attempts < 1:
            raise ValueError("outbox_size, inbox_size and connect_attempts must be at least 1")
        self.endpoint = endpoint
        self.cluster = cluster
        self._clock = clock
        self._client_id = client_id or f"fleetward-pub-{uuid.uuid4().hex[:10]}"
        self._outbox: collections.deque[Event] = collections.deque(maxlen=outbox_size)
        self._wakeup = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self._connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._attempts = connect_attempts
        self._access = access or Access()
        self._tls = _tls_context(self._access, endpoint) if self._access.tls else None
        self.dropped = 0  # events the outbox shed
        self.dropped_in = 0  # events a subscriber's inbox shed
        self.published = 0
        self._inbox_size = inbox_size

    # -- publishing -------------------------------------------------------------------------------------

    async def start(self) -> MqttBus:
        """Start the publisher; fails with :class:`BusUnavailable` if the first connection cannot be made.

        Later disconnects are retried forever in the background (events queue in the outbox meanwhile).
        """
        if self._task is not None:
            return self
        await self._probe()
        self._task = asyncio.create_task(self._pump(), name=f"mqtt-outbox-{self._client_id}")
        return self

    async def __aenter__(self) -> MqttBus:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _next(self, at: int) -> int:
        """The broker after ``at`` (with several: a bridged pair); each connection loop keeps its own place."""
        return (at + 1) % len(self._brokers)

    def _client(self, identifier: str, at: int | None = None, **kw: Any) -> aiomqtt.Client:
        a = self._access
        host, port = self._brokers[self._current if at is None else at]
        return aiomqtt.Client(host, port, identifier=identifier, tls_context=self._tls,
                              username=a.username,
                              password=a.password.get_secret_value() if a.password is not None else None, **kw)

    async def _probe(self) -> None:
        try:
            async for attempt in AsyncRetrying(stop=stop_after_attempt(self._attempts),
                                               wait=wait_exponential(multiplier=0.1, max=2.0) + wait_random(0, 0.1),
                                               retry=retry_if_exception_type(aiomqtt.MqttError),
                                               sleep=self._clock.sleep):
                with attempt:
                    try:
                        async with _session(self._client(f"{self._client_id}-probe", timeout=3)):
                            pass
                    except MqttConnectError as exc:
                        if _refused(exc):
                            who = f"user {self._access.username!r}" if self._access.username else "anonymous clients"
                            raise BusUnavailable(
                                f"MQTT broker at {self.endpoint} refused {who} ({exc}): check mqtt_access.username "
                                "and its password", endpoint=self.endpoint, attempts=1) from exc
                        self._current = self._next(self._current)
                        raise
                    except aiomqtt.MqttError:
                        self._current = self._next(self._current)
                        raise
        except RetryError as exc:
            cause = exc.last_attempt.exception()
            hint = ("is the broker running, and does it speak TLS? (check mqtt_access: ca_file, cert_file, key_file)"
                    if self._access.tls or "ssl" in str(cause).lower()
                    else "is the broker running? (`fleetward up` starts one, or pass --mqtt host:port)")
            raise BusUnavailable(
                f"MQTT broker unreachable at {self.endpoint} after {self._attempts} attempt(s) ({cause}); {hint}",
                endpoint=self.endpoint, attempts=self._attempts) from cause

    async def publish(self, kind: str, **data: Any) -> Event:
        """Queue an event (``None`` values are left out) and return it; never waits for the broker."""
        if not kind or any(c in kind for c in "#+/"):
            raise ValueError(f"event kind {kind!r} must be non-empty and free of '#', '+' and '/'")
        reserved = _RESERVED.intersection(data)
        if reserved:
            raise ValueError(f"event fields {sorted(reserved)} are reserved")
        event = Event(kind=kind, cluster=self.cluster, ts=self._clock.wall(),
                      data={k: v for k, v in data.items() if v is not None})
        if len(self._outbox) == self._outbox.maxlen:
            self.dropped += 1
            log.warning("event outbox full (%d); dropping the oldest event", self._outbox.maxlen)
        self._outbox.append(event)
        self._drained.clear()
        self._wakeup.set()
        return event

    async def flush(self, timeout: float) -> bool:
        """Wait until every event published so far was acknowledged by the broker (or ``timeout``)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._drained.wait()
        return self._drained.is_set()

    @property
    def pending(self) -> int:
        """Events waiting in the outbox (not yet acknowledged by the broker)."""
        return len(self._outbox)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    async def _pump(self) -> None:
        backoff = 0.1
        at = self._current
        while True:
            try:
                async with (
                    _session(self._client(self._client_id, at, timeout=5, keepalive=10)) as client,
                    asyncio.TaskGroup() as tg,
                ):
                    # _send publishes a batch at once on purpose: aiomqtt's "pending publish calls" warning
                    # would fire on every busy batch.
                    client.pending_calls_threshold = _BATCH
                    self._connected.set()
                    backoff = 0.1
                    tg.create_task(_until_disconnected(client))
                    tg.create_task(self._send(client))
            except* (aiomqtt.MqttError, OSError) as group:
                log.info("MQTT publisher disconnected from %s (%s); %d event(s) wait in the outbox",
                         self.endpoint, group.exceptions[0], len(self._outbox))
                at = self._next(at)
            self._connected.clear()
            await self._clock.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _send(self, client: aiomqtt.Client) -> None:
        """Publish the outbox in order while connected; returns never (the connection ends it)."""
        while True:
            if not self._outbox:
                self._drained.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = list(itertools.islice(self._outbox, _BATCH))
            results = await asyncio.gather(
                *(client.publish(topic_for(e.cluster, e.kind), e.to_json(), qos=1) for e in batch),
                return_exceptions=True)
            acked = {e.id for e, r in zip(batch, results, strict=True) if r is None}
            self.published += len(acked)
            # publish() may have appended (and dropped the oldest) meanwhile: keep what is still unacked.
            kept = [e for e in self._outbox if e.id not in acked]
            self._outbox.clear()
            self._outbox.extend(kept)
            failure = next((r for r in results if isinstance(r, BaseException)), None)
            if failure is not None:
                raise failure

    # -- subscribing ------------------------------------------------------------------------------------

    def _inbox_type(self) -> type[asyncio.Queue[aiomqtt.Message]]:
        """The queue aiomqtt puts received messages in, counting what it sheds when full (aiomqtt drops the
        message and logs a warning)."""
        bus = self

        class Inbox(asyncio.Queue[aiomqtt.Message]):
            def put_nowait(self, item: aiomqtt.Message) -> None:
                try:
                    super().put_nowait(item)
                except asyncio.QueueFull:
                    bus.dropped_in += 1
                    raise

        return Inbox

    async def subscribe(self, kinds: Sequence[str] = ("#",), *, session: str | None = None,
                        subscribed: asyncio.Event | None = None) -> AsyncGenerator[Event, None]:
        """Events of ``kinds`` (``"#"`` for all) of this bus's cluster, across broker restarts.

        ``session`` names a persistent session (also the MQTT client id, so one consumer per name).
        ``subscribed`` is set once the broker acknowledged the subscription, cleared while disconnected.
        """
        identifier = session or f"fleetward-sub-{uuid.uuid4().hex[:10]}"
        topics = [topic_for(self.cluster, k) for k in kinds]
        seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        backoff = 0.1
        at = self._current
        while True:
            try:
                async with _session(self._client(identifier, at, clean_session=session is None, timeout=5,
                                                 keepalive=10, queue_type=self._inbox_type(),
                                                 max_queued_incoming_messages=self._inbox_size)) as client:
                    for t in topics:
                        await _to_the_end(client.subscribe(t, qos=1))
                    if subscribed is not None:
                        subscribed.set()
                    backoff = 0.1
                    async for message in client.messages:
                        try:
                            event = Event.from_json(bytes(message.payload))
                        except (ValueError, KeyError, TypeError):
                            log.warning("ignoring malformed event on %s", message.topic)
                            continue
                        if event.id in seen:  # at-least-once delivery: drop redeliveries
                            continue
                        seen[event.id] = None
                        if len(seen) > _SEEN_IDS:
                            seen.popitem(last=False)
                        yield event
            except aiomqtt.MqttError as exc:
                log.info("MQTT subscriber %s disconnected (%s); reconnecting", identifier, exc)
                at = self._next(at)
            if subscribed is not None:
                subscribed.clear()
            await self._clock.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def aclose(self, *, flush_timeout: float = 2.0) -> None:
        """Give the outbox up to ``flush_timeout`` seconds to drain, then stop the publisher.

        Events still in the outbox afterwards are lost (``pending`` tells how many).
        """
        task, self._task = self._task, None
        if task is not None:
            await self.flush(flush_timeout)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


# aiomqtt is not cancellation-safe, and a swallowed cancellation hangs whoever waits for the task:
# - Client.__aenter__ connects in a worker thread that a cancel cannot stop: the connection then completes
#   after the caller gave up and is never closed (paho later closes it from __del__, on a closed loop);
# - on Python 3.11 its asyncio.wait_for returns the result, dropping the cancel, when the awaited reply
#   (CONNACK, SUBACK, disconnect) arrives in the same loop iteration as the cancel;
# - Client.__aexit__ raises MqttError when the graceful disconnect fails, replacing a propagating
#   CancelledError or GeneratorExit, which a reconnect loop catching MqttError would then swallow.
# So every aiomqtt call that waits for the broker runs to its end (each is bounded by the client's
# timeout) and a cancellation is delivered right after.


def _tls_context(access: Access, endpoint: str) -> ssl.SSLContext:
    """A client context: the CA verifies the broker's certificate and name; the client certificate when given."""
    try:
        context = ssl.create_default_context(cafile=str(access.ca_file) if access.ca_file is not None else None)
        if access.cert_file is not None:
            context.load_cert_chain(str(access.cert_file), str(access.key_file) if access.key_file else None)
    except (OSError, ssl.SSLError) as exc:
        raise BusUnavailable(f"MQTT broker at {endpoint}: cannot load the TLS files of mqtt_access: {exc}",
                             endpoint=endpoint, attempts=0) from exc
    return context


def _refused(exc: MqttConnectError) -> bool:
    """Whether CONNACK refused the credentials (MQTT 3.1.1: 4 bad user name or password, 5 not authorised;
    MQTT 5: 134, 135), which no retry mends."""
    code = getattr(exc.rc, "value", exc.rc)
    return code in (4, 5, 134, 135)


async def _to_the_end(aw: Awaitable[T]) -> T:
    """Await an aiomqtt call without interrupting it; re-raise a cancellation once it has finished."""
    call = asyncio.ensure_future(aw)
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await call
        raise


@contextlib.asynccontextmanager
async def _session(client: aiomqtt.Client) -> AsyncIterator[aiomqtt.Client]:
    """Connect ``client`` for the block and always disconnect it; a failing disconnect is not an error."""
    entering = asyncio.ensure_future(client.__aenter__())
    try:
        await asyncio.shield(entering)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await entering
            await client.__aexit__(None, None, None)  # it connected after all
        raise
    try:
        yield client
    finally:
        with contextlib.suppress(aiomqtt.MqttError):
            await _to_the_end(client.__aexit__(None, None, None))


async def _until_disconnected(client: aiomqtt.Client) -> None:
    """Raise :class:`aiomqtt.MqttError` when ``client`` loses its connection (it subscribes to nothing)."""
    async for _ in client.messages:
        pass
    raise aiomqtt.MqttError("message stream ended")
