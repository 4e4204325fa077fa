"""The Grafana dashboards: generated from code (grafana-foundation-sdk), importable as they are (a datasource
variable, one query id per target), and every query reads metrics the code exposes. That every panel has
data against a live Prometheus during a fault is in tests/operations/test_prometheus.py."""

from __future__ import annotations

import json
import re

from fleetward.cli.dashboards import DIRECTORY, panel_queries, render
from fleetward.cli.metricsref import catalogue


def test_the_dashboard_files_are_generated_from_the_code() -> None:
    files = render()
    assert sorted(p.name for p in DIRECTORY.glob("*.json")) == sorted(files)
    for name, text in files.items():
        assert (DIRECTORY / name).read_text() == text, "regenerate them: python -m fleetward.cli.dashboards --write"


def test_every_dashboard_is_importable_as_it_is() -> None:
    for name in render():
        model = json.loads((DIRECTORY / name).read_text())
        variables = model["templating"]["list"]
        assert [v["type"] for v in variables] == ["datasource"] and variables[0]["query"] == "prometheus"
        panels = [p for p in model["panels"] if p["type"] != "row"]
        assert panels and len({p["id"] for p in model["panels"]}) == len(model["panels"]), name
        for p in panels:
            refs = [t["refId"] for t in p["targets"]]
            assert refs and len(set(refs)) == len(refs) and all(refs), (name, p["title"])
            assert p["datasource"]["uid"] == "${datasource}", (name, p["title"])


def test_every_query_reads_metrics_the_code_exposes() -> None:
    exposed = {r.name for r in catalogue()}
    for uid, title, expr in panel_queries():
        for name in re.findall(r"\b(fleetward_[a-z0-9_]+)", expr):
            base = re.sub(r"_(bucket|count|sum)$", "", name)
            assert name in exposed or base in exposed, f"{uid} / {title}: {name} is exposed by nothing"
