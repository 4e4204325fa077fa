"""Operational data: Prometheus alert rules and their promtool tests (``alerts/``), one runbook per alert
(``*.md``); Grafana dashboards are to come."""

__all__: list[str] = []
