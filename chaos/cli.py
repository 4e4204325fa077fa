"""``fleetward chaos``: run experiments, re-check saved runs, list the fault catalogue.

    fleetward chaos run FILE [--out DIR] [--attach [--live-fleet] [--cluster C] [--run-dir D]] [--etcd H:P]
                             [--mqtt H:P] [--dry-run]
    fleetward chaos check RUN_DIR [--json] [--report]
    fleetward chaos faults [--family F] [--json]
    fleetward chaos validate FILE...

Exit codes: 0 the run completed, the hypothesis held and no checker failed; 1 otherwise; 2 a bad
experiment file or flag, a fault outside the blast radius, faults for an attached fleet without
``--live-fleet`` or its admin token, or a fleet to attach to that is not the declared one (the run never
began, nothing was injected: no checks are printed, only the error); 130 interrupted. ``--dry-run`` prints
the plan (fleet, workload, blast radius, each fault's targets and schedule) and exits 0, or 2 as above.
``--strict`` also exits 3 when a checker could not tell (``unknown``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from fleetward.fleet.errors import ConfigError
from fleetward.fleet.shutdown import install_stop_handlers

__all__ = ["main"]

out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False, soft_wrap=True)

_STYLE = {"pass": "green", "unknown": "yellow", "fail": "red", "completed": "green", "failed": "red",
          "aborted": "red", "interrupted": "yellow"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fleetward chaos", description="Chaos experiments on an inference fleet.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run an experiment file and write a run folder")
    run.add_argument("file", type=Path, help="experiment YAML (see docs/chaos.md)")
    run.add_argument("--out", type=Path, help="the run folder (default runs/chaos/<time>-<title>)")
    run.add_argument("--attach", action="store_true", help="use the fleet `fleetward up` runs instead of "
                     "bringing one up (process faults are not available then); the experiment's workers "
                     "<fleet.node>-w<i> are the fleet's <its node>-w<i>")
    run.add_argument("--live-fleet", dest="live_fleet", action="store_true",
                     help="with --attach: confirm that faults may be injected into that fleet, which this run did "
                     "not start (also needs a declared blast_radius and the fleet's admin token: "
                     "FLEETWARD_ADMIN_TOKEN or its admin-token file)")
    run.add_argument("--dry-run", dest="dry_run", action="store_true",
                     help="print what the run would do, to which targets and when, without starting a fleet or "
                     "load or injecting anything")
    run.add_argument("--cluster", help="with --attach: the local fleet's cluster (default: the experiment's, or "
                     "local)")
    run.add_argument("--run-dir", dest="run_dir", type=Path, default=Path(".fleetward"),
                     help="with --attach: where `fleetward up` keeps its state (default .fleetward)")
    run.add_argument("--etcd", help="bring the fleet up on this etcd (host:port) instead of a private one")
    run.add_argument("--mqtt", help="... and on this MQTT broker")
    run.add_argument("--no-report", dest="report", action="store_false", help="skip report.html")
    run.add_argument("--strict", action="store_true", help="exit 3 when a checker could not tell (unknown)")

    chk = sub.add_parser("check", help="re-run the checkers on a saved run folder")
    chk.add_argument("run", type=Path, help="a run folder (journal.json, history.jsonl)")
    chk.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    chk.add_argument("--report", action="store_true", help="write report.html again with these verdicts")
    chk.add_argument("--strict", action="store_true", help="exit 3 when a checker could not tell (unknown)")

    flt = sub.add_parser("faults", help="list the fault catalogue by family")
    flt.add_argument("--family", help="only this family (process, gpu, network, kv, control, load)")
    flt.add_argument("--json", action="store_true")

    val = sub.add_parser("validate", help="check experiment files without running them")
    val.add_argument("files", type=Path, nargs="+")
    return p


# -- run ----------------------------------------------------------------------------------------------------


class _Display:
    """Progress while a run goes: a live panel on a terminal, plain lines elsewhere (CI logs)."""

    def __init__(self) -> None:
        self.lines: deque[str] = deque(maxlen=8)
        self.runner: Any = None
        self.t0 = time.monotonic()
        self.live = err.is_terminal

    def event(self, kind: str, text: str) -> None:
        line = f"{time.monotonic() - self.t0:6.1f}s  {text}"
        if self.live:
            self.lines.append(line)
        else:
            err.print(line)

    def render(self) -> Group:
        snap: dict[str, Any] = self.runner.snapshot() if self.runner is not None else {"phase": "starting"}
        head = Text.assemble(("phase ", "dim"), (snap["phase"], "bold"))
        rows: list[Any] = [head]
        if "elapsed" in snap:
            done = min(1.0, snap["elapsed"] / max(snap["duration"], 1e-9))
            bar = "█" * int(done * 30) + "░" * (30 - int(done * 30))
            rows.append(Text(f"workload {snap['elapsed']:5.1f}/{snap['duration']:g} s {bar}"))
            rows.append(Text(f"requests sent {snap['sent']}  ok {snap['ok']}  failed {snap['failed']}  cancelled "
                             f"{snap['cancelled']}  in flight {snap['in_flight']}  ·  {snap['tokens_per_s']:.0f} "
                             "tokens/s"))
        if snap.get("active"):
            rows.append(Text("in effect: " + ", ".join(snap["active"]), style="red"))
        rows += [Text(line, style="dim") for line in self.lines]
        return Group(*rows)


def _install_stop(stop: asyncio.Event) -> None:
    install_stop_handlers(stop, say=lambda text: err.print(escape(text)))


def _hosts_for(args: argparse.Namespace) -> Any:
    """The hosts of an experiment with ``fleet.hosts`` > 1, made and entered (this process moves onto the clients'
    network) before the event loop or any thread starts, so that every socket and child is made there; None
    for any other run."""
    from fleetward.chaos.hostnet import HostNetwork
    from fleetward.chaos.runner import experiment_of

    exp, _ = experiment_of(args.file)
    if exp.fleet.hosts <= 1 or args.attach or args.dry_run:
        return None
    reason = HostNetwork.unavailable_reason()
    if reason:
        raise ConfigError(f"fleet.hosts: {exp.fleet.hosts}: {reason}", field="fleet.hosts")
    if threading.active_count() > 1:
        raise RuntimeError("the hosts must be made before any thread starts (a thread would stay on this network)")
    net = HostNetwork(exp.fleet.hosts).create()
    err.print(f"hosts: namespaces {net.prefix}h0..h{exp.fleet.hosts - 1} on {net.switch}, clients in "
              f"{net.clients.ns} ({net.clients.address}); this run lives there")
    net.enter("clients")
    return net


async def _run(args: argparse.Namespace, network: Any = None) -> int:
    from fleetward.chaos.runner import Runner, RunOptions, experiment_of

    if args.live_fleet and not args.attach:
        raise ConfigError("it confirms injecting into a fleet the run attaches to: it goes with --attach",
                          field="--live-fleet")
    exp, base = experiment_of(args.file)
    stop = asyncio.Event()
    _install_stop(stop)
    display = _Display()
    opts = RunOptions(out=args.out, attach=args.attach, live_fleet=args.live_fleet, cluster=args.cluster,
                      run_dir=args.run_dir, etcd=args.etcd, mqtt=args.mqtt, base=base, progress=display.event,
                      stop=stop, report=args.report, network=network)
    runner = Runner(exp, opts)
    if args.dry_run:
        return _dry_run(runner, args)
    display.runner = runner
    err.print(f"[bold]fleetward chaos run[/]: {exp.title} ({len(exp.method)} fault(s), "
              f"{exp.workload.duration_s:g} s of workload, seed {exp.seed})")
    if display.live:
        from rich.live import Live

        with Live(get_renderable=display.render, console=err, refresh_per_second=4, transient=True):
            result = await runner.run()
    else:
        result = await runner.run()
    _print_verdicts(result.verdicts)
    j = result.journal
    style = _STYLE.get(result.status, "")
    out.print(f"\nrun [{style}]{result.status}[/]" + (f" ({j.get('reason')})" if j.get("reason") else "")
              + f"; {_hypothesis(j)}; checks [{_STYLE[result.check_status]}]{result.check_status}[/]")
    out.print(f"run folder: {result.run_dir}  (report.html, journal.json, history.jsonl)")
    if stop.is_set():
        return 130
    return _code(result.exit_code, result.check_status, args.strict)


def _dry_run(runner: Any, args: argparse.Namespace) -> int:
    """The plan, after the refusals a run would meet before it begins (a :class:`ConfigError`: exit 2)."""
    from fleetward.chaos.plan import plan, render

    runner.preflight()
    attach = None
    if args.attach:
        cluster = args.cluster or runner.exp.fleet.cluster or "local"
        attach = f"the local fleet {cluster} ({args.run_dir / cluster / 'fleet.json'})"
    for line in render(plan(runner.exp, attach=attach, etcd=args.etcd, mqtt=args.mqtt)):
        out.print(escape(line))
    return 0


def _hypothesis(journal: dict[str, Any]) -> str:
    before, after = (journal.get("steady_states") or {}).get("before"), (journal.get("steady_states") or {}).get(
        "after")
    if before is None:
        return "the hypothesis was not checked"
    if not before.get("steady_state_met"):
        return "the hypothesis [red]did not hold[/] before the method"
    if after is None:
        return "the hypothesis held before (not checked after)"
    return "the hypothesis [red]deviated[/]" if journal.get("deviated") else "the hypothesis held"


def _code(code: int, checks: str, strict: bool) -> int:
    return 3 if code == 0 and strict and checks == "unknown" else code


def _print_verdicts(verdicts: Sequence[Any]) -> None:
    table = Table(title="checks", title_justify="left")
    for col in ("CHECKER", "VERDICT", "WHAT IT FOUND"):
        table.add_column(col)
    for v in verdicts:
        summary = v.summary
        for d in v.details[:3]:
            summary += "\n  " + str(d.get("text") or d.get("problem") or json.dumps(d, default=str))[:200]
        if len(v.details) > 3:
            summary += f"\n  ... {len(v.details) - 3} more (journal.json)"
        table.add_row(v.checker, f"[{_STYLE[v.status]}]{v.status}[/]", summary)
    out.print(table)


# -- check, faults, validate --------------------------------------------------------------------------------


def _check(args: argparse.Namespace) -> int:
    from fleetward.chaos.runner import check_run

    result = check_run(args.run)
    if args.json:
        print(json.dumps({"status": result.check_status, "exit_code": result.exit_code,
                          "verdicts": [v.to_json() for v in result.verdicts]}, indent=2, default=str))
    else:
        _print_verdicts(result.verdicts)
        out.print(f"run {result.status}; {_hypothesis(result.journal)}; checks "
                  f"[{_STYLE[result.check_status]}]{result.check_status}[/]")
    if args.report:
        from fleetward.chaos.history import read_history
        from fleetward.chaos.report import write_report

        write_report(args.run, result.journal, list(read_history(args.run / "history.jsonl")), result.verdicts)
    return _code(result.exit_code, result.check_status, args.strict)


def _params(model: Any) -> list[dict[str, Any]]:
    rows = []
    for name, f in model.model_fields.items():
        default = None if f.is_required() else f.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump(mode="json", exclude_defaults=True)
        rows.append({"name": name, "type": getattr(f.annotation, "__name__", str(f.annotation)).replace(
            "typing.", ""), "default": default, "required": f.is_required(), "description": f.description or ""})
    return rows


_COMMON = ("verify_timeout_s", "recover_timeout_s")  # FaultParams: shown once under the tables
def _faults(args: argparse.Namespace) -> int:
    from fleetward.chaos.catalogue import backends_for, fault_catalogue, target_kinds
    from fleetward.chaos.fault import FAMILIES
    from fleetward.chaos.validation import REQUIREMENTS
    from fleetward.fleet.backends import BACKENDS

    catalogue, problems = fault_catalogue()
    specs = [s for s in catalogue.values() if args.family in (None, s.family)]
    if args.json:
        print(json.dumps({"faults": [{"name": s.name, "family": s.family, "summary": s.summary,
                                      "targets": list(target_kinds(s)), "needs_root": s.needs_root,
                                      "backends": backends_for(s), "params": _params(s.params)} for s in specs],
                          "problems": problems}, indent=2, default=str))
        return 0
    for family in FAMILIES:
        mine = sorted((s for s in specs if s.family == family), key=lambda s: s.name)
        if not mine:
            continue
        table = Table(title=f"{family} ({len(mine)})", title_justify="left", show_lines=False)
        for col in ("FAULT", "TARGETS", "WHAT IT DOES", "PARAMS"):
            table.add_column(col, overflow="fold")
        for s in mine:
            params = ", ".join(f"{p['name']}={json.dumps(p['default'], default=str)}" if not p["required"]
                               else f"{p['name']} (required)" for p in _params(s.params) if p["name"] not in _COMMON)
            works = backends_for(s)
            notes = [*([] if len(works) == len(BACKENDS) else [f"{'/'.join(works)} only"]),
                     *(["needs root"] if s.needs_root else []),
                     *(f"needs {REQUIREMENTS[r][2]}" for r in s.extra.get("requires", ()))]
            table.add_row(s.name, ", ".join(target_kinds(s)) or "-",
                          escape(s.summary + (f" [{'; '.join(notes)}]" if notes else "")), escape(params or "-"))
        out.print(table)
    if args.family != "load":
        out.print("Every fault but the load family's also takes verify_timeout_s and recover_timeout_s. Names are "
                  "<family>.<name>; `fleetward chaos faults --json` has every parameter with its description.")
    for module, problem in problems.items():
        err.print(f"[yellow]warning:[/] {module} could not be loaded: {problem}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    from fleetward.chaos.validation import load_experiment

    bad = 0
    for f in args.files:
        try:
            exp = load_experiment(f)
        except ConfigError as exc:
            err.print(f"[red]error:[/] {escape(str(exc))}")
            bad += 1
            continue
        out.print(f"{f}: ok ({exp.title}: {len(exp.method)} fault(s), {exp.workload.duration_s:g} s)")
    return 2 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``fleetward chaos ...``: called by the fleetward CLI, which turns errors into messages and exit codes."""
    args = _parser().parse_args(argv)
    if args.command == "run":
        network = _hosts_for(args)
        try:
            return asyncio.run(_run(args, network))
        finally:
            if network is not None:
                network.destroy()
    if args.command == "check":
        return _check(args)
    if args.command == "faults":
        return _faults(args)
    if args.command == "validate":
        return _validate(args)
    raise AssertionError(f"unhandled command {args.command}")

