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

RUNBOOKS = Path(__file__).resolve().parents[1] / "runbooks"
RULES = RUNBOOKS / "alerts" / "fleetward.rules.yml"
TESTS = RUNBOOKS / "alerts" / "fleetward.tests.yml"
SECTIONS = ("## Meaning", "## Impact", "## Diagnosis", "## Remedy", "## Escalate")


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.geteuid() == 0:  # CI and `./dev setup` as root install Debian's prometheus: missing is a failure
            pytest.fail("promtool is missing: `./dev setup` installs Debian's prometheus package")
        pytest.skip("promtool is missing and this user cannot install Debian's prometheus package")
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
