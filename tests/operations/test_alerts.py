"""The alert rules: valid for Prometheus, unit-tested with promtool (every alert fires on its fault's series,
only after its ``for``, and not on healthy series), each with a runbook that says what to do, and every
metric they use is one the code exposes (docs/metrics.md)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from fleetward.cli.metricsref import catalogue

RUNBOOKS = Path(__file__).resolve().parents[2] / "runbooks"
RULES = RUNBOOKS / "alerts" / "fleetward.rules.yml"
TESTS = RUNBOOKS / "alerts" / "fleetward.tests.yml"
ALERTMANAGER = RUNBOOKS / "alerts" / "alertmanager.example.yml"
SECTIONS = ("## Meaning", "## Impact", "## Diagnosis", "## Remedy", "## Escalate")


def promtool() -> str:
    return _debian_tool("promtool", "prometheus")


def amtool() -> str:
    return _debian_tool("amtool", "prometheus-alertmanager")


def _debian_tool(name: str, package: str) -> str:
    found = shutil.which(name)
    if found is None:
        if os.geteuid() == 0:  # CI and `./dev setup` as root install the Debian package: missing is a failure
            pytest.fail(f"{name} is missing: `./dev setup` installs Debian's {package} package")
        pytest.skip(f"{name} is missing and this user cannot install Debian's {package} package")
    return found


def alerts() -> list[dict[str, object]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for g in groups for rule in g["rules"] if "alert" in rule]


def test_promtool_finds_the_rules_valid() -> None:
    r = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_fires_on_its_fault_and_not_before_in_promtools_unit_tests() -> None:
    r = subprocess.run([promtool(), "test", "rules", TESTS.name], capture_output=True, text=True, cwd=TESTS.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    tested = set(re.findall(r"alertname: (\w+)", TESTS.read_text()))
    assert {str(a["alert"]) for a in alerts()} <= tested, "an alert without a unit test"


def test_every_alert_has_a_severity_a_summary_and_a_runbook_that_says_what_to_do() -> None:
    for rule in alerts():
        labels, notes = rule["labels"], rule["annotations"]
        assert isinstance(labels, dict) and labels.get("severity") in ("page", "warning", "info"), rule["alert"]
        assert isinstance(notes, dict) and notes.get("summary") and notes.get("description"), rule["alert"]
        runbook = RUNBOOKS.parent / str(notes["runbook_url"])
        assert runbook.is_file(), f"{rule['alert']}: no runbook at {notes['runbook_url']}"
        text = runbook.read_text()
        assert str(rule["alert"]) in text, f"{runbook.name} does not name {rule['alert']}"
        for section in SECTIONS:
            assert section in text, f"{runbook.name}: no {section}"


def test_the_rules_use_only_metrics_the_code_exposes() -> None:
    exposed = {r.name for r in catalogue()}
    used = set(re.findall(r"\b(fleetward_[a-z0-9_]+)", RULES.read_text()))
    for name in used:
        base = re.sub(r"_(bucket|count|sum)$", "", name)
        assert name in exposed or base in exposed, f"the rules use {name}, which nothing exposes"


def test_the_example_alertmanager_config_is_valid_routes_by_severity_and_groups_hosts_together() -> None:
    r = subprocess.run([amtool(), "check-config", str(ALERTMANAGER)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    receivers = {"page": "fleetward-pager", "warning": "fleetward-tickets", "info": "fleetward-log"}
    for rule in alerts():
        severity = rule["labels"]["severity"]  # type: ignore[index]
        r = subprocess.run([amtool(), "config", "routes", "test", f"--config.file={ALERTMANAGER}",
                            f"--verify.receivers={receivers[severity]}", f"alertname={rule['alert']}",
                            f"severity={severity}", "instance=host-1:9100", "job=fleetward-agent"],
                           capture_output=True, text=True)
        assert r.returncode == 0, f"{rule['alert']} ({severity}): {r.stdout}{r.stderr}"
    config = yaml.safe_load(ALERTMANAGER.read_text())
    assert not {"instance", "job", "..."} & set(config["route"]["group_by"]), "one notification for many hosts"


def test_every_alert_an_inhibition_names_exists() -> None:
    names = {str(a["alert"]) for a in alerts()}
    for rule in yaml.safe_load(ALERTMANAGER.read_text())["inhibit_rules"]:
        for matcher in rule["source_matchers"] + rule["target_matchers"]:
            named = re.fullmatch(r'alertname=~?"([^"]+)"', matcher)
            assert named, matcher
            assert set(named.group(1).split("|")) <= names, matcher


def runbook_queries() -> list[tuple[str, str]]:
    """Every PromQL expression a runbook gives (a backquoted span that names a fleetward metric)."""
    return [(md.name, q) for md in sorted(RUNBOOKS.glob("*.md"))
            for q in re.findall(r"`([^`]*fleetward_[^`]*)`", md.read_text())]


def test_every_query_in_a_runbook_parses_and_names_metrics_labels_and_detectors_that_exist(tmp_path: Path) -> None:
    """An on-call engineer pastes these at 3 am: one that returns nothing (a detector named ``engine`` where
    the code says ``engine-frozen``) sends them the wrong way."""
    from fleetward.supervisor import detectors

    queries = runbook_queries()
    assert len(queries) > 20
    rules = {"groups": [{"name": "runbooks", "rules": [{"record": f"runbook:query{i}", "expr": q}
                                                       for i, (_, q) in enumerate(queries)]}]}
    (tmp_path / "queries.yml").write_text(yaml.safe_dump(rules))
    r = subprocess.run([promtool(), "check", "rules", str(tmp_path / "queries.yml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    labels = {row.name: set(row.labels) | {"job", "instance"} for row in catalogue()}
    named_detectors = set(re.findall(r"^([a-z-]+) +(?:agent|controller) ", detectors.__doc__ or "", re.M))
    for runbook, query in queries:
        for metric, matchers in re.findall(r"\b(fleetward_[a-z0-9_]+)(\{[^}]*\})?", query):
            base = re.sub(r"_(bucket|count|sum)$", "", metric)
            assert metric in labels or base in labels, f"{runbook}: {query}: nothing exposes {metric}"
            known = labels.get(metric, labels.get(base, set())) | ({"le"} if base != metric else set())
            for label, value in re.findall(r'(\w+)=~?"([^"]*)"', matchers):
                assert label in known, f"{runbook}: {query}: {metric} has no label {label}"
                if label == "detector":
                    assert value in named_detectors, f"{runbook}: {query}: no detector is named {value}"
