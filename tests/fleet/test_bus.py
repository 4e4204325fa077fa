"""MqttBus against a real Mosquitto: event shape and topics, the outbox across a broker restart, dedupe."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence

import aiomqtt
import pytest

from fleetward.fleet.bus import Event, MqttBus, topic_for
from fleetward.fleet.errors import BusUnavailable
from fleetward.fleet.procs import free_port


async def _consume(bus: MqttBus, into: list[Event], subscribed: asyncio.Event, *,
                   kinds: Sequence[str] = ("#",), session: str | None = None) -> None:
    async for event in bus.subscribe(kinds, session=session, subscribed=subscribed):
        into.append(event)


def test_event_round_trips_json_in_the_design_shape() -> None:
    event = Event(kind="migration", cluster="c1", ts=1700000000.5,
                  data={"worker": "w1", "request": "r9", "from": "w0", "tokens": 17})
    body = json.loads(event.to_json())
    assert body == {"v": 1, "id": event.id, "ts": 1700000000.5, "cluster": "c1", "kind": "migration",
                    "worker": "w1", "request": "r9", "from": "w0", "tokens": 17}
    back = Event.from_json(event.to_json())
    assert back == event
    assert (back.worker, back.request) == ("w1", "r9")
    assert topic_for("c1", "migration") == "fleetward/c1/events/migration"


async def test_published_events_arrive_on_their_kind_topic(bus: MqttBus, broker_endpoint: str,
                                                           cluster: str, wait_until) -> None:
    host, _, port = broker_endpoint.rpartition(":")
    raw: list[aiomqtt.Message] = []
    only_up: list[Event] = []
    subscribed = asyncio.Event()

    async def listen_raw(ready: asyncio.Event) -> None:
        async with aiomqtt.Client(host, int(port)) as client:
            await client.subscribe(f"fleetward/{cluster}/events/#", qos=1)
            ready.set()
            async for message in client.messages:
                raw.append(message)

    async with asyncio.TaskGroup() as tg:
        raw_ready = asyncio.Event()
        listeners = [tg.create_task(listen_raw(raw_ready)),
                     tg.create_task(_consume(bus, only_up, subscribed, kinds=["worker.up"]))]
        await raw_ready.wait()
        await subscribed.wait()

        down = await bus.publish("worker.down", worker="w0", reason="exit 1")
        up = await bus.publish("worker.up", worker="w1", request=None, url="http://127.0.0.1:9")
        await wait_until(lambda: len(raw) == 2 and len(only_up) == 1, message="events delivered")
        for t in listeners:
            t.cancel()

    assert [str(m.topic) for m in raw] == [topic_for(cluster, "worker.down"), topic_for(cluster, "worker.up")]
    assert json.loads(bytes(raw[1].payload)) == {
        "v": 1, "id": up.id, "ts": up.ts, "cluster": cluster, "kind": "worker.up", "worker": "w1",
        "url": "http://127.0.0.1:9"}  # None values are left out
    assert only_up == [up]
    assert down.id != up.id
    assert await bus.flush(5) and bus.pending == 0 and bus.published == 2


async def test_events_published_while_the_broker_is_down_arrive_after_it_returns(
        make_broker, cluster: str, wait_until) -> None:
    """The outbox holds events while Mosquitto is down; persistent sessions get them all after the restart:
    ``live`` stays subscribed (reconnecting) throughout, ``away`` left before the stop and returns only after
    the publisher flushed, so its events waited in the session the broker persisted across its restart."""
    broker = await make_broker(kind="mosquitto")
    n = 20
    live: list[Event] = []
    away: list[Event] = []
    live_session, away_session = (f"{who}-{uuid.uuid4().hex[:8]}" for who in ("live", "away"))
    async with MqttBus(broker.endpoint, cluster) as bus, asyncio.TaskGroup() as tg:
        live_subscribed, away_subscribed = asyncio.Event(), asyncio.Event()
        live_consumer = tg.create_task(_consume(bus, live, live_subscribed, session=live_session))
        away_consumer = tg.create_task(_consume(bus, away, away_subscribed, session=away_session))
        await live_subscribed.wait()
        await away_subscribed.wait()
        first = await bus.publish("fault.start", fault="broker-restart")
        await wait_until(lambda: len(live) == len(away) == 1, message="first event delivered")
        away_consumer.cancel()  # disconnects; its session stays on the broker

        await broker.stop()
        published = [first] + [await bus.publish("health.changed", worker=f"w{i}", state="down")
                               for i in range(n)]
        assert bus.pending == n  # nothing can leave while the broker is away

        broker.start(broker.data_dir.parent / "logs")
        await broker.wait_ready()
        assert await bus.flush(30)  # the broker acknowledged every event

        await wait_until(lambda: len(live) >= n + 1, timeout=30, message="live subscriber got everything")
        away_subscribed.clear()
        away_consumer = tg.create_task(_consume(bus, away, away_subscribed, session=away_session))
        await wait_until(lambda: len(away) >= n + 1, timeout=30, message="returning subscriber got everything")
        live_consumer.cancel()
        away_consumer.cancel()
    assert [e.id for e in live] == [e.id for e in published]
    assert [e.id for e in away] == [e.id for e in published]
    assert bus.dropped == 0


async def test_a_redelivered_event_is_dropped_by_id(bus: MqttBus, broker_endpoint: str, cluster: str,
                                                    wait_until) -> None:
    host, _, port = broker_endpoint.rpartition(":")
    received: list[Event] = []
    subscribed = asyncio.Event()
    twice = Event(kind="restart", cluster=cluster, ts=1.0, data={"worker": "w1"})
    async with asyncio.TaskGroup() as tg:
        consumer = tg.create_task(_consume(bus, received, subscribed))
        await subscribed.wait()
        async with aiomqtt.Client(host, int(port)) as client:
            for _ in range(2):
                await client.publish(topic_for(cluster, "restart"), twice.to_json(), qos=1)
        marker = await bus.publish("restart", worker="w2")  # arrives after both copies
        await wait_until(lambda: any(e.id == marker.id for e in received), message="marker delivered")
        consumer.cancel()
    assert [e.id for e in received] == [twice.id, marker.id]


async def test_the_outbox_is_bounded_and_drops_the_oldest(broker_endpoint: str, cluster: str,
                                                          wait_until) -> None:
    bus = MqttBus(broker_endpoint, cluster, outbox_size=3)
    events = [await bus.publish("scale", pool="decode", replicas=i) for i in range(5)]  # not started yet
    assert bus.dropped == 2
    assert bus.pending == 3

    received: list[Event] = []
    subscribed = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        consumer = tg.create_task(_consume(bus, received, subscribed))
        await subscribed.wait()
        async with bus:
            assert await bus.flush(10)
            await wait_until(lambda: len(received) == 3, message="the newest three delivered")
        consumer.cancel()
    assert [e.data["replicas"] for e in received] == [2, 3, 4]
    assert [e.id for e in received] == [e.id for e in events[2:]]


async def test_a_subscriber_that_falls_behind_sheds_into_a_bounded_inbox_and_counts_it(
        broker_endpoint: str, cluster: str, wait_until) -> None:
    listener = MqttBus(broker_endpoint, cluster, inbox_size=3)
    subscribed = asyncio.Event()
    events = listener.subscribe(subscribed=subscribed)
    first = asyncio.create_task(anext(events))
    await subscribed.wait()
    async with MqttBus(broker_endpoint, cluster) as publisher:
        sent = [await publisher.publish("scale", n=i) for i in range(10)]
        assert await publisher.flush(10)
    assert (await first).id == sent[0].id  # then nobody reads: the rest wait in the inbox, three at most
    # Six or seven shed (seven when all ten arrived before the first was taken), every one counted.
    await wait_until(lambda: listener.dropped_in >= 6, message="the inbox shed what did not fit")
    kept = [(await anext(events)).id for _ in range(10 - 1 - listener.dropped_in)]
    order = [e.id for e in sent]
    assert len(kept) in (2, 3) and sorted(kept, key=order.index) == kept, "what was kept, in order"
    await events.aclose()


async def test_start_raises_bus_unavailable_when_no_broker_listens() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    with pytest.raises(BusUnavailable) as err:
        await MqttBus(endpoint, "c", connect_attempts=2).start()
    assert endpoint in str(err.value) and "unreachable" in str(err.value)
    assert err.value.endpoint == endpoint and err.value.attempts == 2


async def test_publish_refuses_reserved_fields_and_wildcard_kinds(bus: MqttBus) -> None:
    with pytest.raises(ValueError, match="reserved"):
        await bus.publish("worker.up", id="mine")
    with pytest.raises(ValueError, match="kind"):
        await bus.publish("worker/#")


async def test_with_two_brokers_the_bus_fails_over_to_the_one_that_is_up(make_broker, cluster: str,
                                                                            wait_until) -> None:
    """``a:port,b:port`` (a bridged pair): when the broker in use stops, publisher and subscriber move to the
    other, and the events waiting in the outbox arrive there."""
    first, second = await make_broker(kind="mosquitto"), await make_broker(kind="mosquitto")
    got: list[Event] = []
    async with MqttBus(f"{first.endpoint},{second.endpoint}", cluster) as bus, asyncio.TaskGroup() as tg:
        subscribed = asyncio.Event()
        consumer = tg.create_task(_consume(bus, got, subscribed))
        await subscribed.wait()
        await bus.publish("fault.start", fault="one")
        await wait_until(lambda: len(got) == 1, message="delivered through the first broker")
        subscribed.clear()  # set again once the subscriber has subscribed on the second broker
        await first.stop()
        await subscribed.wait()  # an event published before that would pass it by: the brokers are not bridged
        await bus.publish("fault.start", fault="two")
        await wait_until(lambda: len(got) == 2, timeout=30, message="delivered through the second broker")
        assert bus.connected and bus.pending == 0
        consumer.cancel()
    assert [e.data["fault"] for e in got] == ["one", "two"]
