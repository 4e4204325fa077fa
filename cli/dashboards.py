"""Grafana dashboards as code (grafana-foundation-sdk): runbooks/dashboards/*.json, importable as they are.

Four dashboards: fleet health, the request path, faults and recovery, autoscaling. Every panel reads the
metrics of docs/metrics.md through a ``datasource`` variable (any Prometheus). ``python -m
fleetward.cli.dashboards --write`` regenerates the files; a test fails when they and this module disagree,
and another runs every panel's query against a live Prometheus during a fault and requires data. Queries
on counters that stay absent in a healthy fleet (failures, errors) end in ``or vector(0)``, so their panel
shows 0 rather than "no data"; every other query needs the fleet to produce the series.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["DIRECTORY", "dashboards", "panel_queries", "render"]

DIRECTORY = Path(__file__).resolve().parents[1] / "runbooks" / "dashboards"

# (title, unit, [(PromQL, legend)]) per panel; rows by title.
Panel = tuple[str, str, list[tuple[str, str]]]

_SPECS: dict[str, tuple[str, list[tuple[str, list[Panel]]]]] = {
    "fleetward-fleet": ("fleetward: fleet health", [
        ("Workers", [
            ("Workers by health state", "short", [("sum by (state) (fleetward_supervisor_workers)", "{{state}}")]),
            ("Routable workers (per router)", "short", [("fleetward_router_workers_routable", "{{instance}}")]),
            ("Worker processes per node, and exits", "short", [
                ("sum by (instance) (fleetward_agent_workers)", "{{instance}} running"),
                ("sum(increase(fleetward_agent_worker_exits_total[15m]))", "exits (last 15 min)")]),
        ]),
        ("Control plane", [
            ("Leaders", "short", [("max(fleetward_supervisor_is_leader)", "supervisor"),
                                  ("max(fleetward_autoscaler_is_leader) or vector(0)", "autoscaler")]),
            ("etcd and broker links up", "short", [("min by (job) (fleetward_etcd_up)", "etcd from {{job}}"),
                                                   ("min by (job) (fleetward_broker_up)", "broker from {{job}}")]),
        ]),
        ("Detections and remediation", [
            ("Signals by detector (per s)", "ops", [
                ("sum by (detector) (rate(fleetward_supervisor_signals_total{severity!=\"ok\"}[1m])) or vector(0)",
                 "{{detector}}")]),
            ("Actions by kind (per s)", "ops", [
                ("sum by (kind) (rate(fleetward_supervisor_actions_total[1m])) or vector(0)", "{{kind}}")]),
            ("Detection latency (first evidence to verdict)", "s", [
                ("histogram_quantile(0.99, sum by (le, detector) (rate(fleetward_supervisor_detection_seconds_bucket"
                 "[15m])))", "p99 {{detector}}")]),
        ]),
    ]),
    "fleetward-requests": ("fleetward: request path", [
        ("Traffic", [
            ("Requests by outcome (per s)", "reqps", [
                ("sum by (outcome) (rate(fleetward_router_requests_total[1m]))", "{{outcome}}")]),
            ("Tokens delivered (per s)", "short", [("sum(rate(fleetward_router_tokens_total[1m]))", "tokens/s")]),
            ("In flight", "short", [("sum(fleetward_router_in_flight_requests)", "requests")]),
        ]),
        ("Latency", [
            ("Time to first token", "s", [
                ("histogram_quantile(0.5, sum by (le) (rate(fleetward_router_time_to_first_token_seconds_bucket"
                 "[5m])))", "p50"),
                ("histogram_quantile(0.99, sum by (le) (rate(fleetward_router_time_to_first_token_seconds_bucket"
                 "[5m])))", "p99")]),
            ("Mean inter-token latency per stream", "s", [
                ("histogram_quantile(0.99, sum by (le) (rate(fleetward_router_time_per_output_token_seconds_bucket"
                 "[5m])))", "p99")]),
        ]),
        ("Migration and checkpoints", [
            ("Migrations by trigger (per s)", "ops", [
                ("sum by (reason) (rate(fleetward_router_migrations_total[5m]))", "{{reason}}")]),
            ("Migration stall (client-visible gap)", "s", [
                ("histogram_quantile(0.99, sum by (le) (rate(fleetward_router_migration_stall_seconds_bucket[5m])))",
                 "p99")]),
            ("Streams not resumed (per s)", "ops", [
                ("sum by (reason) (rate(fleetward_router_migration_failures_total[5m])) or vector(0)",
                 "{{reason}}")]),
            ("Checkpoint flush and lag", "s", [
                ("histogram_quantile(0.99, sum by (le) (rate(fleetward_router_checkpoint_flush_seconds_bucket[5m])))",
                 "flush p99"),
                ("max(fleetward_router_checkpoint_lag_seconds)", "lag")]),
        ]),
    ]),
    "fleetward-faults": ("fleetward: faults and recovery", [
        ("What went wrong", [
            ("Health transitions (per s)", "ops", [
                ("sum by (state) (rate(fleetward_supervisor_health_transitions_total[5m]))", "{{state}}")]),
            ("Hangs, restarts, quarantines (last 15 min)", "short", [
                ("sum(increase(fleetward_supervisor_hangs_detected_total[15m]))", "hangs"),
                ("sum(increase(fleetward_supervisor_actions_total{kind=\"restart\"}[15m])) or vector(0)", "restarts"),
                ("sum(increase(fleetward_supervisor_quarantines_total[15m]))", "quarantines")]),
            ("Alerts firing", "short", [
                ("count by (alertname) (ALERTS{alertstate=\"firing\"}) or vector(0)", "{{alertname}}")]),
            ("Chaos faults in effect", "short", [
                ("max by (family) (fleetward_chaos_faults_active)", "{{family}}")]),
            ("Workers failed while serving (last 15 min)", "short", [
                ("sum(increase(fleetward_supervisor_failures_total[15m]))", "failures")]),
        ]),
        ("How it was handled", [
            ("Canaries by result (per s)", "ops", [
                ("sum by (result) (rate(fleetward_supervisor_canaries_total[5m]))", "{{result}}")]),
            ("Upstream errors by kind (per s)", "ops", [
                ("sum by (kind) (rate(fleetward_router_upstream_errors_total[5m])) or vector(0)", "{{kind}}")]),
            ("Upstream attempts per client request; retries the budget refused (per s)", "short", [
                ("sum(rate(fleetward_router_upstream_attempts_total[5m])) / "
                 "sum(rate(fleetward_router_upstream_attempts_total{attempt=\"first\"}[5m]))", "amplification"),
                ("sum(rate(fleetward_router_retry_budget_refused_total[5m])) or vector(0)", "refused")]),
            ("Migration stall", "s", [
                ("histogram_quantile(0.99, sum by (le) (rate(fleetward_router_migration_stall_seconds_bucket[5m])))",
                 "p99")]),
        ]),
    ]),
    "fleetward-autoscaling": ("fleetward: autoscaling", [
        ("Pools", [
            ("Desired and serving workers", "short", [
                ("max by (pool) (fleetward_autoscaler_desired_workers)", "{{pool}} desired"),
                ("max by (pool) (fleetward_autoscaler_workers{state=\"serving\"})", "{{pool}} serving")]),
            ("Starting, retiring, parked", "short", [
                ("max by (pool, state) (fleetward_autoscaler_workers{state!=\"serving\"})", "{{pool}} {{state}}")]),
            ("Arrival rate", "reqps", [("max by (pool) (fleetward_autoscaler_arrival_rate)", "{{pool}}")]),
            ("SLA attainment (last interval)", "percentunit", [
                ("max by (pool, slo) (fleetward_autoscaler_sla_attainment_ratio)", "{{pool}} {{slo}}")]),
        ]),
        ("Actions", [
            ("Workers started and retired (last 15 min)", "short", [
                ("sum by (direction) (increase(fleetward_autoscaler_scale_events_total[15m])) or vector(0)",
                 "{{direction}}")]),
            ("Scaling steps not carried out (last 15 min)", "short", [
                ("sum(increase(fleetward_autoscaler_actuation_errors_total[15m])) or vector(0)", "errors")]),
        ]),
    ]),
}


def _build(uid: str, title: str, rows: list[tuple[str, list[Panel]]]) -> dict[str, Any]:
    from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, Row
    from grafana_foundation_sdk.builders.prometheus import Dataquery
    from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    source = DataSourceRef(type_val="prometheus", uid="${datasource}")
    board = (Dashboard(title).uid(uid).tags(["fleetward"]).refresh("10s").time("now-1h", "now")
             .with_variable(DatasourceVariable("datasource").label("Prometheus").type("prometheus")))
    ids = iter(range(1, 1000))  # Grafana wants every panel (and row) to have its own id
    for row_title, panels in rows:
        board = board.with_row(Row(row_title).id(next(ids)))
        for panel_title, unit, queries in panels:
            panel = Timeseries().id(next(ids)).title(panel_title).unit(unit).datasource(source).height(8).span(8)
            for i, (expr, legend) in enumerate(queries):
                panel = panel.with_target(Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + i))
                                          .datasource(source))
            board = board.with_panel(panel)
    built: dict[str, Any] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    return built


def dashboards() -> dict[str, dict[str, Any]]:
    """uid -> the dashboard's JSON model."""
    return {uid: _build(uid, title, rows) for uid, (title, rows) in _SPECS.items()}


def panel_queries() -> list[tuple[str, str, str]]:
    """(dashboard uid, panel title, PromQL) for every query of every panel."""
    return [(uid, title, expr) for uid, (_, rows) in _SPECS.items() for _, panels in rows
            for title, _, queries in panels for expr, _ in queries]


def render() -> dict[str, str]:
    """File name -> its text, as written under runbooks/dashboards/."""
    return {f"{uid}.json": json.dumps(model, indent=1, sort_keys=True) + "\n" for uid, model in dashboards().items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fleetward.cli.dashboards", description=__doc__)
    p.add_argument("--write", action="store_true", help=f"rewrite {DIRECTORY}")
    args = p.parse_args(argv)
    files = render()
    if not args.write:
        sys.stdout.write(next(iter(files.values())))
        return 0
    DIRECTORY.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (DIRECTORY / name).write_text(text)
        print(f"wrote {DIRECTORY / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
