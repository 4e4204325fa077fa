"""``fleetward replay TRACE --simulate``: every scaling policy on one request trace, in the fleet simulator.

Prints a table (or, with ``--json``, one JSON object: ``{"policies": {name: {"sla_attainment", "worker_hours",
"cut_streams", "goodput_per_worker_hour", "scale_events", ...}}, ...}``) and writes plots of load, replicas
and latency over time unless ``--no-plots``. The live replay against a local fleet is not built yet.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fleetward.autoscale.capacity import Sla
from fleetward.autoscale.evaluate import Evaluation, evaluate
from fleetward.autoscale.planner import POLICIES
from fleetward.autoscale.predict import PREDICTORS
from fleetward.autoscale.simulate import DEFAULT_WORKER
from fleetward.autoscale.traces import load_trace
from fleetward.fleet.errors import ConfigError

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("replay", help="replay a request trace against every scaling policy (--simulate)")
    p.add_argument("trace", type=Path, help="Azure CSV, ServeGen CSV (requests or 10-minute rates) or Mooncake JSONL")
    p.add_argument("--simulate", action="store_true", help="in the fleet simulator (the only mode so far)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated; default {','.join(POLICIES)}")
    p.add_argument("--speed", type=float, default=1.0, help="time compression (2: the trace in half the time)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="requests per second multiplied by this")
    p.add_argument("--limit", type=float, help="only the first LIMIT seconds of the (compressed) trace")
    p.add_argument("--ttft", type=float, default=Sla().ttft_s, help="SLA: time to first token, s (default 2)")
    p.add_argument("--itl", type=float, default=Sla().itl_s, help="SLA: mean inter-token latency, s (default 0.05)")
    p.add_argument("--interval", type=float, default=30.0, help="planning interval, s (default 30)")
    p.add_argument("--startup", type=float, default=45.0, help="a new worker's start-up time, s (default 45)")
    p.add_argument("--min", dest="min_workers", type=int, default=1, help="fewest workers (default 1)")
    p.add_argument("--max", dest="max_workers", type=int, help="most workers (default twice the peak's need)")
    p.add_argument("--predictor", choices=sorted(PREDICTORS), default="holt-winters")
    p.add_argument("--failures-per-hour", type=float, default=0.0, help="worker failures per worker-hour")
    p.add_argument("--no-migration", action="store_true", help="failed workers' streams fail instead of moving")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="folder for plots and results (default .fleetward/replay/<trace>-<time>)")
    p.add_argument("--no-plots", action="store_true")


def run(args: argparse.Namespace, out: Console, err: Console) -> int:
    if not args.simulate:
        raise ConfigError("the live replay against a local fleet is not built yet; add --simulate to replay the "
                          "trace in the fleet simulator")
    trace = load_trace(args.trace, speed=args.speed, rate_scale=args.rate_scale, seed=args.seed,
                       limit_s=args.limit)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeElapsedColumn(), console=err, transient=True) as bar:
        task = bar.add_task("measuring one worker's capacity", total=max(1.0, trace.duration_s) * len(policies))
        done = {p: 0.0 for p in policies}

        def progress(policy: str, t: float) -> None:
            done[policy] = t
            bar.update(task, description=f"{trace.name}: {policy}", completed=sum(done.values()))

        ev = evaluate(trace, policies=policies, sla=Sla(args.ttft, args.itl), startup_s=args.startup,
                      interval_s=args.interval, min_workers=args.min_workers, max_workers=args.max_workers,
                      predictor=args.predictor, failures_per_worker_hour=args.failures_per_hour,
                      migration=not args.no_migration, config=DEFAULT_WORKER, seed=args.seed, progress=progress)
    summary = ev.summary()
    folder = args.out or Path(".fleetward") / "replay" / f"{trace.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "replay.json").write_text(json.dumps(summary, indent=1) + "\n")
    if not args.no_plots:
        _plot(ev, folder)
    if args.json:
        out.print_json(json.dumps(summary))
        return 0
    table = Table(title=f"{trace.name} ({trace.format}, {len(trace.requests)} requests, "
                        f"{trace.duration_s / 3600:.2f} h): SLA TTFT {args.ttft:g} s, ITL {args.itl * 1000:g} ms; "
                        f"{ev.per_worker:.2f} req/s per worker, start-up {args.startup:g} s")
    for col in ("policy", "SLA attainment", "worker-hours", "vs oracle", "goodput/worker-h", "scale events",
                "cut streams", "failed", "migrated"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    oracle = ev.results.get("oracle")
    for name, r in ev.results.items():
        ratio = f"{r.worker_hours / oracle.worker_hours:.2f}" if oracle and oracle.worker_hours else "-"
        table.add_row(name, f"{100 * r.sla_attainment:.2f} %", f"{r.worker_hours:.2f}", ratio,
                      f"{r.goodput_per_worker_hour:.0f}", str(r.scale_events), str(r.cut_streams), str(r.failed),
                      str(r.migrated))
    out.print(table)
    err.print(f"results and plots: {folder}")
    return 0


def _plot(ev: Evaluation, folder: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    load, replicas, itl = axes
    first = next(iter(ev.results.values()))
    hours = [r.t / 3600 for r in first.timeline]
    load.plot(hours, [r.arrival_rate for r in first.timeline], color="black")
    load.set_ylabel("arrivals (req/s)")
    for name, res in ev.results.items():
        h = [r.t / 3600 for r in res.timeline]
        replicas.step(h, [r.healthy for r in res.timeline], where="post", label=name)
        itl.plot(h, [1000 * (r.itl_p99 or 0) for r in res.timeline], label=name, linewidth=0.8)
    replicas.set_ylabel("serving workers")
    replicas.legend(fontsize=8)
    itl.axhline(1000 * ev.sla.itl_s, color="red", linestyle="--", linewidth=0.8)
    itl.set_ylabel("p99 ITL per interval (ms)")
    itl.set_xlabel("trace time (h)")
    fig.suptitle(f"{ev.trace.name}: load, replicas and latency by policy")
    fig.tight_layout()
    fig.savefig(folder / "replay.png", dpi=110)
    plt.close(fig)
