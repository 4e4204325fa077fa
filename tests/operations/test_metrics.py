"""The metrics catalogue cannot drift from the code, and every metric follows Prometheus' conventions."""

from __future__ import annotations

import asyncio
import re

from fleetward.cli.metricsref import PAGE, catalogue, render

# Labels whose values would grow with traffic: never allowed on a metric.
UNBOUNDED = {"request", "request_id", "id", "prompt", "user", "url", "trace"}


def test_the_catalogue_page_is_generated_from_the_code() -> None:
    assert PAGE.read_text() == render(), "regenerate it: python -m fleetward.cli.metricsref --write"


def test_every_metric_follows_the_naming_rules_and_keeps_its_labels_bounded() -> None:
    rows = catalogue()
    names = [r.name for r in rows]
    assert len(names) == len(set(names)), "one definition per name"
    for r in rows:
        assert r.help.strip(), f"{r.name} has no help"
        assert not UNBOUNDED & set(r.labels), f"{r.name}: an unbounded label"
        if r.process == "worker":
            assert r.name.startswith("vllm:"), f"{r.name}: workers keep vLLM's names"
            continue
        assert re.fullmatch(r"fleetward_[a-z0-9_]+", r.name), r.name
        assert r.name.endswith("_total") == (r.type == "counter"), f"{r.name}: _total for counters only"
        if r.type == "histogram" or "seconds" in r.help.lower():
            assert r.name.endswith("_seconds"), f"{r.name}: times in seconds"
        assert "_ms" not in r.name and "milliseconds" not in r.name, f"{r.name}: base units"


def test_the_catalogue_covers_what_operators_alert_on() -> None:
    names = {r.name for r in catalogue()}
    for needed in ("fleetward_router_requests_total", "fleetward_router_time_to_first_token_seconds",
                   "fleetward_router_time_per_output_token_seconds", "fleetward_router_migrations_total",
                   "fleetward_router_migration_failures_total", "fleetward_router_migration_stall_seconds",
                   "fleetward_router_checkpoint_flush_seconds", "fleetward_router_checkpoint_lag_seconds",
                   "fleetward_supervisor_signals_total", "fleetward_supervisor_workers",
                   "fleetward_supervisor_quarantines_total", "fleetward_supervisor_is_leader",
                   "fleetward_supervisor_leadership_changes_total", "fleetward_etcd_up", "fleetward_broker_up",
                   "fleetward_autoscaler_desired_workers", "fleetward_autoscaler_workers"):
        assert needed in names, needed


def test_an_outbox_that_sheds_events_counts_them_where_prometheus_reads() -> None:
    """The MQTT outbox is bounded: with the broker away, the oldest events go, and the count is a metric."""
    from prometheus_client import CollectorRegistry, generate_latest

    from fleetward.fleet.bus import MqttBus
    from fleetward.fleet.telemetry import link_gauges

    bus = MqttBus("127.0.0.1:1", "drops", outbox_size=2)  # never started: nothing leaves the outbox
    registry = CollectorRegistry()
    link_gauges(registry, store=object(), bus=bus)
    for i in range(5):
        asyncio.run(_publish(bus, i))
    text = generate_latest(registry).decode()
    assert 'fleetward_bus_events_dropped_total{queue="outbox"} 3.0' in text
    assert 'fleetward_bus_events_dropped_total{queue="inbox"} 0.0' in text


async def _publish(bus: object, i: int) -> None:
    await bus.publish("action", n=i)  # type: ignore[attr-defined]


def test_a_label_that_grows_with_the_fleet_is_counted_by_the_scale_model() -> None:
    """A metric with a series per worker (or host, router, GPU) multiplies Prometheus' series by the fleet's
    size: docs/scale.md's model must count it (``PER_WORKER_METRICS``, its term in ``loads``). A new one fails
    here until the model has it."""
    from fleetward.chaos.bench._scalemodel import FLEET_SIZED_LABELS, PER_WORKER_METRICS

    sized = {r.name for r in catalogue() if r.process != "worker" and FLEET_SIZED_LABELS & set(r.labels)}
    assert sized == PER_WORKER_METRICS
