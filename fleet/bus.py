"""The event bus: MQTT (QoS 1) through aiomqtt, JSON events on ``fleetward/<cluster>/events/<kind>``.

Contract of :class:`EventBus`:

- :meth:`~EventBus.publish` never waits for the broker. Events go into a bounded outbox that a background
  task drains in order once connected; an event leaves the outbox only when the broker acknowledged it
  (PUBACK). So a broker restart loses nothing published while it was down (delivery is at least once:
  consumers dedupe on ``id``). When the outbox is full the oldest event is dropped and counted in
  ``dropped`` (events are never the only copy of state; etcd is).
- :meth:`~EventBus.subscribe` yields events across broker restarts. With a ``session`` name it uses a
  persistent MQTT session, so events published while the subscriber was disconnected are queued for it
  by the broker.

Payload: ``{"v": 1, "id", "ts", "cluster", "kind", "worker"?, "request"?, ...}`` (see DESIGN.md).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiomqtt

from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.errors import BusUnavailable

__all__ = ["EVENT_KINDS", "Event", "EventBus", "MqttBus", "topic_for"]

log = logging.getLogger(__name__)

EVENT_KINDS = (
    "worker.up", "worker.down", "health.changed", "hang.detected", "migration", "restart", "quarantine",
    "scale", "fault.start", "fault.stop",
)


def topic_for(cluster: str, kind: str) -> str:
    return f"fleetward/{cluster}/events/{kind}"


@dataclass(frozen=True)
class Event:
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
        body = {"v": 1, "id": self.id, "ts": self.ts, "cluster": self.cluster, "kind": self.kind, **self.data}
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> Event:
        body = json.loads(raw)
        data = {k: v for k, v in body.items() if k not in ("v", "id", "ts", "cluster", "kind")}
        return cls(kind=body["kind"], cluster=body["cluster"], ts=body["ts"], id=body["id"], data=data)


class EventBus(Protocol):
    async def publish(self, kind: str, **data: Any) -> Event: ...

    def subscribe(self, kinds: Sequence[str] = ("#",), *, session: str | None = None) -> AsyncIterator[Event]: ...

    async def flush(self, timeout: float) -> bool: ...

    async def aclose(self) -> None: ...


class MqttBus:
    """:class:`EventBus` on an MQTT broker at ``host:port``."""

    def __init__(self, endpoint: str, cluster: str, *, outbox_size: int = 10_000, clock: Clock = SYSTEM_CLOCK,
                 client_id: str | None = None, connect_attempts: int = 5) -> None:
        host, _, port = endpoint.rpartition(":")
        self.endpoint = endpoint
        self._host, self._port = host, int(port)
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
        self.dropped = 0
        self.published = 0

    # -- publishing -------------------------------------------------------------------------------------

    async def start(self) -> MqttBus:
        """Start the publisher; fails with :class:`BusUnavailable` if the first connection cannot be made.

        Later disconnects are retried forever in the background (events queue in the outbox meanwhile).
        """
        await self._probe()
        self._task = asyncio.create_task(self._pump(), name=f"mqtt-outbox-{self._client_id}")
        return self

    async def _probe(self) -> None:
        from tenacity import AsyncRetrying, RetryError, stop_after_attempt, wait_exponential_jitter

        try:
            async for attempt in AsyncRetrying(stop=stop_after_attempt(self._attempts),
                                               wait=wait_exponential_jitter(initial=0.1, max=2.0),
                                               sleep=self._clock.sleep):
                with attempt:
                    async with aiomqtt.Client(self._host, self._port, identifier=f"{self._client_id}-probe",
                                              timeout=3):
                        pass
        except RetryError as exc:
            cause = exc.last_attempt.exception()
            raise BusUnavailable(
                f"MQTT broker unreachable at {self.endpoint} after {self._attempts} attempts ({cause}); "
                "is the broker running? (`fleetward up` starts one, or pass --mqtt host:port)",
                endpoint=self.endpoint, attempts=self._attempts) from cause

    async def publish(self, kind: str, **data: Any) -> Event:
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
        return len(self._outbox)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    async def _pump(self) -> None:
        backoff = 0.1
        while True:
            try:
                async with aiomqtt.Client(self._host, self._port, identifier=self._client_id, timeout=5,
                                          keepalive=10) as client:
                    self._connected.set()
                    backoff = 0.1
                    while True:
                        if not self._outbox:
                            self._drained.set()
                            self._wakeup.clear()
                            await self._wakeup.wait()
                            continue
                        batch = list(self._outbox)[:64]
                        results = await asyncio.gather(
                            *(client.publish(topic_for(e.cluster, e.kind), e.to_json(), qos=1) for e in batch),
                            return_exceptions=True)
                        acked = {e.id for e, r in zip(batch, results, strict=True) if r is None}
                        self.published += len(acked)
                        kept = [e for e in self._outbox if e.id not in acked]
                        self._outbox.clear()
                        self._outbox.extend(kept)
                        failure = next((r for r in results if isinstance(r, BaseException)), None)
                        if failure is not None:
                            raise failure
            except aiomqtt.MqttError as exc:
                self._connected.clear()
                log.info("MQTT publisher disconnected from %s (%s); %d event(s) wait in the outbox",
                         self.endpoint, exc, len(self._outbox))
                await self._clock.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    # -- subscribing ------------------------------------------------------------------------------------

    async def subscribe(self, kinds: Sequence[str] = ("#",), *,
                        session: str | None = None) -> AsyncIterator[Event]:
        """Events of ``kinds`` (``"#"`` for all), across broker restarts.

        ``session`` names a persistent session: the broker keeps the subscription and queues QoS 1 events
        while this subscriber (or the broker, with persistence on) is away.
        """
        identifier = session or f"fleetward-sub-{uuid.uuid4().hex[:10]}"
        topics = [f"fleetward/{self.cluster}/events/{k}" for k in kinds]
        seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        backoff = 0.1
        while True:
            try:
                async with aiomqtt.Client(self._host, self._port, identifier=identifier,
                                          clean_session=session is None, timeout=5, keepalive=10) as client:
                    for t in topics:
                        await client.subscribe(t, qos=1)
                    backoff = 0.1
                    async for message in client.messages:
                        try:
                            event = Event.from_json(bytes(message.payload))  # type: ignore[arg-type]
                        except (ValueError, KeyError, TypeError):
                            log.warning("ignoring malformed event on %s", message.topic)
                            continue
                        if event.id in seen:  # at-least-once delivery: drop redeliveries
                            continue
                        seen[event.id] = None
                        if len(seen) > 50_000:
                            seen.popitem(last=False)
                        yield event
            except aiomqtt.MqttError as exc:
                log.info("MQTT subscriber %s disconnected (%s); reconnecting", identifier, exc)
                await self._clock.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def aclose(self, *, flush_timeout: float = 2.0) -> None:
        if self._task is not None:
            await self.flush(flush_timeout)
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
