"""Metrics every fleetward service exposes about its own links: whether etcd and the broker answer.

``fleetward_etcd_up`` is 1 while the service's last etcd call got through (0 once one gave up after its
bounded retries) and ``fleetward_broker_up`` is 1 while its MQTT publisher is connected. Its outbox of events
waiting for the broker and its subscribers' inboxes are bounded: ``fleetward_bus_events_dropped_total{queue}``
counts what they shed when full (events are never the only copy of state: etcd is). Each service adds them
to its own registry with :func:`link_gauges`; they are read when Prometheus scrapes, never polled.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["link_gauges"]


def link_gauges(registry: CollectorRegistry, *, store: object, bus: object) -> None:
    """Add ``fleetward_etcd_up`` and ``fleetward_broker_up`` for ``store`` and ``bus`` to ``registry``."""
    etcd = Gauge("fleetward_etcd_up", "1 while this process's last etcd call got through, 0 once one gave up "
                 "after its retries.", registry=registry)
    etcd.set_function(lambda: 1.0 if getattr(store, "reachable", True) else 0.0)
    broker = Gauge("fleetward_broker_up", "1 while this process's MQTT publisher is connected to the broker.",
                   registry=registry)
    broker.set_function(lambda: 1.0 if getattr(bus, "connected", True) else 0.0)
    registry.register(_Dropped(bus))


class _Dropped(Collector):
    """The bus's own count of events it shed, read at scrape time."""

    def __init__(self, bus: object) -> None:
        self.bus = bus

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("fleetward_bus_events_dropped", "Events this process's MQTT client shed: "
                                     "queue=outbox, the oldest first because it was full while the broker was "
                                     "away; queue=inbox, received while a consumer had fallen that far behind.",
                                     labels=["queue"])
        family.add_metric(["outbox"], float(getattr(self.bus, "dropped", 0)))
        family.add_metric(["inbox"], float(getattr(self.bus, "dropped_in", 0)))
        yield family
