"""What the suite cost, printed at the end of every run: the total per test folder and the slowest tests.

A test's cost is its wall time: setup, call and teardown together, so a module-scoped fixture (a fleet, a pair
of vLLM servers) counts once, on the test that started it. The report is short on purpose: a change that adds
minutes shows in the run of that change (docs/architecture.md, "Tests", says how to keep a test cheap).

Wired by ``tests/conftest.py`` (its hooks are these two functions); with pytest-xdist, the controller receives
every worker's reports, so the totals are the whole run's. ``FLEETWARD_TEST_COST_FILE=PATH`` also writes every
test's cost there (JSON, most expensive first).
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

SLOWEST = 15

_cost: dict[str, float] = defaultdict(float)  # test id -> seconds (setup + call + teardown)
_started = time.monotonic()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _cost[report.nodeid] += report.duration


def folder(nodeid: str) -> str:
    """``tests/vllm/test_x.py::test_y`` -> ``tests/vllm``; a module at the top of tests/ is ``tests``."""
    path = nodeid.split("::", 1)[0]
    return path.rsplit("/", 1)[0] if "/" in path else "."


def report_lines(cost: dict[str, float], wall_s: float, slowest: int = SLOWEST) -> list[str]:
    """The report's lines: per folder (most expensive first, with its share of the total), then the slowest."""
    if not cost:
        return []
    total = sum(cost.values())
    per_folder: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for nodeid, seconds in cost.items():
        per_folder[folder(nodeid)] += seconds
        count[folder(nodeid)] += 1
    width = max(len(f) for f in per_folder)
    lines = [f"tests: {total:.0f} s in {len(cost)} test(s), {wall_s:.0f} s wall", "per folder:"]
    for name, seconds in sorted(per_folder.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:<{width}}  {seconds:7.1f} s  {100 * seconds / total:4.1f} %  {count[name]:4d} test(s)")
    lines.append(f"the {min(slowest, len(cost))} slowest:")
    for nodeid, seconds in sorted(cost.items(), key=lambda kv: -kv[1])[:slowest]:
        lines.append(f"  {seconds:7.1f} s  {nodeid}")
    return lines


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    out = os.environ.get("FLEETWARD_TEST_COST_FILE")
    if out and _cost:  # every test's cost, for deciding what to make cheaper: FLEETWARD_TEST_COST_FILE=cost.json
        Path(out).write_text(json.dumps(dict(sorted(_cost.items(), key=lambda kv: -kv[1])), indent=1))
    lines = report_lines(dict(_cost), time.monotonic() - _started)
    if lines:
        terminalreporter.section("test cost")
        for line in lines:
            terminalreporter.write_line(line)
