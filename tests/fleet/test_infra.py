"""Local infrastructure: busy ports are refused clearly; the embedded broker fallback works with MqttBus."""

from __future__ import annotations

import asyncio
import importlib.util
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetward.fleet.bus import MqttBus
from fleetward.fleet.errors import PortInUseError
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.infra import LocalBroker, LocalEtcd, etcd_binary


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_etcd_binary_is_shipped_by_the_wheel() -> None:
    assert etcd_binary().is_file()


def test_local_etcd_on_a_busy_port_raises_port_in_use(tmp_path: Path, busy_port: int) -> None:
    with pytest.raises(PortInUseError) as err:
        LocalEtcd(tmp_path / "etcd", client_port=busy_port)
    assert err.value.port == busy_port
    assert f"port {busy_port}" in str(err.value) and "already in use" in str(err.value)
    assert "etcd" in str(err.value)


def test_local_broker_on_a_busy_port_raises_port_in_use(tmp_path: Path, busy_port: int) -> None:
    with pytest.raises(PortInUseError) as err:
        LocalBroker(tmp_path / "broker", port=busy_port)
    assert err.value.port == busy_port
    assert f"port {busy_port}" in str(err.value) and "already in use" in str(err.value)
    assert "broker" in str(err.value)


async def test_local_etcd_keeps_its_data_and_port_across_a_restart(make_etcd) -> None:
    etcd = await make_etcd()
    async with EtcdStore(etcd.endpoint) as store:
        await store.put("/restart/k", b"v")
    await etcd.stop()
    assert not etcd.process.is_running

    etcd.start(etcd.data_dir.parent / "logs")
    await etcd.wait_ready()

    async with EtcdStore(etcd.endpoint) as store:
        kv = await store.get("/restart/k")
    assert kv is not None and kv.value == b"v"


@pytest.mark.skipif(importlib.util.find_spec("amqtt") is None,
                    reason="amqtt (the embedded-broker extra) is not installed; Mosquitto is used instead")
async def test_amqtt_fallback_broker_carries_mqtt_bus_events(make_broker, cluster: str) -> None:
    broker = await make_broker(kind="amqtt")
    assert broker.kind == "amqtt"
    subscribed = asyncio.Event()
    async with MqttBus(broker.endpoint, cluster, connect_attempts=3) as bus:
        received: list[str] = []

        async def consume() -> None:
            async for event in bus.subscribe(["worker.up"], subscribed=subscribed):
                received.append(event.id)
                return

        async with asyncio.TaskGroup() as tg, asyncio.timeout(20):
            tg.create_task(consume())
            await subscribed.wait()
            sent = await bus.publish("worker.up", worker="w1")
        assert received == [sent.id]
        assert await bus.flush(5)


def test_unknown_broker_kind_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kind"):
        LocalBroker(tmp_path / "broker", kind="rabbit")
