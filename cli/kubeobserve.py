"""The observability objects of ``fleetward deploy kubernetes``, made from the sources in runbooks/.

- a ``PrometheusRule`` whose groups are runbooks/alerts/fleetward.rules.yml's, read when the manifests are made;
- scrape targets for the Prometheus Operator: a ``ServiceMonitor`` for the routers, ``PodMonitor``s for the
  controllers, the autoscalers, the sidecar agents and vLLM itself. Each sets ``job`` as fleetward's own
  Prometheus does (router, controller, autoscaler, agent, worker: the alerts and dashboards group by it) and
  ``instance`` to the pod's name;
- one ConfigMap per Grafana dashboard (runbooks/dashboards/*.json, the text as it is), labelled
  ``grafana_dashboard: "1"`` for Grafana's sidecar.

No rule or dashboard is written twice: a change in runbooks/ reaches the manifests when they are generated
again, and the drift test says when they were not.
"""

from __future__ import annotations

from typing import Any

import yaml

from fleetward.cli.kubernetes import CONFIGMAP_LIMIT, ROOT, WORKER_LABEL, Plan, meta, selector
from fleetward.fleet.errors import ConfigError

__all__ = ["DASHBOARDS", "RULES", "dashboards", "monitoring"]

RULES = ROOT / "runbooks" / "alerts" / "fleetward.rules.yml"
DASHBOARDS = ROOT / "runbooks" / "dashboards"


def _relabel(job: str, *more: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"action": "replace", "targetLabel": "job", "replacement": job},
            {"action": "replace", "sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "instance"},
            *more]


def _endpoint(job: str, *more: dict[str, Any], port: str | None = None, number: int | None = None) \
        -> dict[str, Any]:
    where: dict[str, Any] = {"port": port} if port is not None else {"portNumber": number}
    return {**where, "path": "/metrics", "interval": "15s", "relabelings": _relabel(job, *more)}


def _pod_monitor(p: Plan, name: str, component: str, pods: dict[str, Any],
                 endpoint: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": meta(p, name, component),
            "spec": {"selector": pods, "podMetricsEndpoints": [endpoint]}}


def monitoring(p: Plan) -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": meta(p, "fleetward", "monitoring"), "spec": {"groups": groups}}
    routers = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
               "metadata": meta(p, "fleetward-router", "router"),
               "spec": {"selector": {"matchLabels": selector(p, "router")},
                        "endpoints": [_endpoint("router", port="http")]}}
    workers = {"matchLabels": {WORKER_LABEL: "true"}}
    pool = {"action": "replace", "sourceLabels": ["__meta_kubernetes_pod_label_fleetward_pool"], "targetLabel": "role"}
    node = {"action": "replace", "sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "node"}
    return [
        rule, routers,
        _pod_monitor(p, "fleetward-controller", "controller", {"matchLabels": selector(p, "controller")},
                     _endpoint("controller", port="control")),
        _pod_monitor(p, "fleetward-autoscaler", "autoscaler", {"matchLabels": selector(p, "autoscaler")},
                     _endpoint("autoscaler", port="metrics")),
        _pod_monitor(p, "fleetward-agent", "agent", workers, _endpoint("agent", port="fleetward")),
        # vLLM's own /metrics, by number: its container need not name the port.
        _pod_monitor(p, "fleetward-worker", "agent", workers,
                     _endpoint("worker", node, pool, number=p.options.vllm_port)),
    ]


def dashboards(p: Plan) -> list[dict[str, Any]]:
    maps = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        text = path.read_text()
        if len(text.encode()) > CONFIGMAP_LIMIT:
            raise ConfigError(f"{len(text.encode()):,} bytes: over a ConfigMap's 1 MiB", file=str(path))
        m = meta(p, f"fleetward-dashboard-{path.stem.removeprefix('fleetward-')}", "monitoring")
        m["labels"]["grafana_dashboard"] = "1"
        maps.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": m, "data": {path.name: text}})
    return maps

