"""Operational data: one runbook per alert, Prometheus alert rules and Grafana dashboards (to come)."""

__all__: list[str] = []
