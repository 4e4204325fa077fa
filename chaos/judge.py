"""Judging a run: the checkers on its history, against its fault-free reference; the exit code.

:func:`judge` runs the experiment's checkers on the recorded history (pure, but for reading
``reference.jsonl``); :func:`check_run` does it again on a saved run folder. The exit code is 1 when the
run did not complete, the hypothesis deviated or a checker failed; else 0.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetward.chaos.checkers import CheckContext, Verdict, combine, run_checkers
from fleetward.chaos.history import Record, read_history
from fleetward.chaos.reference import reference_of
from fleetward.chaos.runview import RunView
from fleetward.fleet.errors import ConfigError

__all__ = ["RunResult", "check_run", "exit_code", "finish_journal", "judge"]


@dataclass
class RunResult:
    run_dir: Path
    journal: dict[str, Any]
    verdicts: list[Verdict]

    @property
    def status(self) -> str:
        return str(self.journal["status"])

    @property
    def deviated(self) -> bool:
        return bool(self.journal["deviated"])

    @property
    def check_status(self) -> str:
        return str(self.journal["checks"]["status"])

    @property
    def exit_code(self) -> int:
        return int(self.journal["exit_code"])

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def failures(self) -> list[str]:
        """One line per reason the run is not ok (for test failure messages)."""
        out = []
        if self.status != "completed":
            out.append(f"run {self.status}: {self.journal.get('reason') or ''}".rstrip(": "))
        if self.deviated:
            out.append("the steady-state hypothesis deviated after the method")
        out += [f"{v.checker}: {v.status}: {v.summary}" for v in self.verdicts if v.status == "fail"]
        return out


def exit_code(status: str, deviated: bool, checks: str) -> int:
    return 0 if status == "completed" and not deviated and checks != "fail" else 1


def judge(journal: Mapping[str, Any], records: list[Record], run_dir: Path) -> list[Verdict]:
    """Run the experiment's checkers on ``records`` (pure but for reading ``reference.jsonl``)."""
    ctxinfo = journal.get("context") or {}
    ctx = CheckContext(reference_of(journal.get("reference") or {}, run_dir),
                       migration_limit=ctxinfo.get("migration_limit"), supervisor=ctxinfo.get("supervisor"))
    specs = journal.get("experiment", {}).get("checkers")
    chosen = None if specs is None else [(c["name"], c.get("params") or {}) for c in specs]
    return run_checkers(RunView.of(records), ctx, chosen)


def finish_journal(journal: dict[str, Any], verdicts: list[Verdict]) -> None:
    checks = combine(v.status for v in verdicts)
    journal["checks"] = {"status": checks, "verdicts": [v.to_json() for v in verdicts]}
    journal["exit_code"] = exit_code(str(journal["status"]), bool(journal["deviated"]), checks)


def check_run(run_dir: Path) -> RunResult:
    """Re-run the checkers on a saved run folder; the result's exit code follows the same rules."""
    try:
        journal = json.loads((run_dir / "journal.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"{run_dir} has no journal.json: not a run folder", field="run") from None
    records = list(read_history(run_dir / "history.jsonl"))
    verdicts = judge(journal, records, run_dir)
    finish_journal(journal, verdicts)
    return RunResult(run_dir, journal, verdicts)
