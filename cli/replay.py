"""``fleetward replay TRACE``: scaling policies on one request trace, live or in the fleet simulator.

- ``--simulate``: every policy (fleetward's planner, the baselines and the oracle) in the discrete-event fleet
  simulator, days of trace in minutes.
- without it: a live local fleet of simulated workers (etcd, broker, supervisor, router, the autoscaler
  daemon, all real processes) is started, the trace is sent through the router at its (compressed) arrival
  times, and what every client saw is measured; one run per policy (``fleetward`` unless ``--policies``
  names others; the oracle needs the future and is simulated only).

Prints a table (or, with ``--json``, one JSON object: ``{"mode", "policies": {name: {"sla_attainment",
"worker_hours", "cut_streams", "goodput_per_worker_hour", "scale_events", ...}}, ...}``) and writes plots of
load, replicas and latency over time unless ``--no-plots``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from fleetward.autoscale.capacity import Sla
from fleetward.autoscale.evaluate import Evaluation, evaluate
from fleetward.autoscale.planner import POLICIES
from fleetward.autoscale.predict import PREDICTORS
from fleetward.autoscale.simulate import DEFAULT_WORKER, FleetResult, profile_capacity
from fleetward.autoscale.traces import Trace, TraceRequest, load_trace
from fleetward.fleet.errors import ConfigError

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("replay", help="replay a request trace against every scaling policy (--simulate)")
    p.add_argument("trace", type=Path, help="Azure CSV, ServeGen CSV (requests or 10-minute rates) or Mooncake JSONL")
    p.add_argument("--simulate", action="store_true", help="in the fleet simulator (default: against a live local "
                   "fleet of simulated workers with the autoscaler)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--policies", help=f"comma-separated; default {','.join(POLICIES)} (simulated), fleetward (live)")
    p.add_argument("--speed", type=float, default=1.0, help="time compression (2: the trace in half the time)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="requests per second multiplied by this")
    p.add_argument("--limit", type=float, help="only the first LIMIT seconds of the (compressed) trace")
    p.add_argument("--ttft", type=float, default=Sla().ttft_s, help="SLA: time to first token, s (default 2)")
    p.add_argument("--itl", type=float, default=Sla().itl_s, help="SLA: mean inter-token latency, s (default 0.05)")
    p.add_argument("--ttft-per-1k", dest="ttft_per_1k", type=float, default=0.0,
                   help="SLA: TTFT allowed per 1,000 prompt tokens on top of --ttft, s (long-context SLOs; default 0)")
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
    live = p.add_argument_group("live replay (without --simulate)")
    live.add_argument("--max-output", dest="max_output", type=int, default=256,
                      help="output tokens per request at most (default 256)")
    live.add_argument("--max-prompt", dest="max_prompt", type=int, default=1024,
                      help="prompt tokens per request at most (default 1024)")


def run(args: argparse.Namespace, out: Console, err: Console) -> int:
    trace = load_trace(args.trace, speed=args.speed, rate_scale=args.rate_scale, seed=args.seed,
                       limit_s=args.limit)
    if not args.simulate:
        return asyncio.run(_run_live(args, trace, out, err))
    policies = [p.strip() for p in (args.policies or ",".join(POLICIES)).split(",") if p.strip()]
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeElapsedColumn(), console=err, transient=True) as bar:
        task = bar.add_task("measuring one worker's capacity", total=max(1.0, trace.duration_s) * len(policies))
        done = {p: 0.0 for p in policies}

        def progress(policy: str, t: float) -> None:
            done[policy] = t
            bar.update(task, description=f"{trace.name}: {policy}", completed=sum(done.values()))

        ev = evaluate(trace, policies=policies, sla=Sla(args.ttft, args.itl, args.ttft_per_1k), startup_s=args.startup,
                      interval_s=args.interval, min_workers=args.min_workers, max_workers=args.max_workers,
                      predictor=args.predictor, failures_per_worker_hour=args.failures_per_hour,
                      migration=not args.no_migration, config=DEFAULT_WORKER, seed=args.seed, progress=progress)
    summary = {"mode": "simulated", **ev.summary()}
    folder = _folder(args, trace)
    (folder / "replay.json").write_text(json.dumps(summary, indent=1) + "\n")
    if not args.no_plots:
        _plot(ev, folder)
    if args.json:
        out.print_json(json.dumps(summary))
        return 0
    table = Table(title=f"{trace.name} ({trace.format}, {len(trace.requests)} requests, "
                        f"{trace.duration_s / 3600:.2f} h): SLA {ev.sla.describe()}; "
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
    fig, axes = plt.subplots(4, 1, figsize=(11, 11), sharex=True)
    load, replicas, ttft, itl = axes
    first = next(iter(ev.results.values()))
    hours = [r.t / 3600 for r in first.timeline]
    load.plot(hours, [r.arrival_rate for r in first.timeline], color="black")
    load.set_ylabel("arrivals (req/s)")
    for name, res in ev.results.items():
        h = [r.t / 3600 for r in res.timeline]
        replicas.step(h, [r.healthy for r in res.timeline], where="post", label=name)
        ttft.plot(h, [r.ttft_p99 or 0 for r in res.timeline], label=name, linewidth=0.8)
        itl.plot(h, [1000 * (r.itl_p99 or 0) for r in res.timeline], label=name, linewidth=0.8)
    replicas.set_ylabel("serving workers")
    replicas.legend(fontsize=8)
    ttft.set_yscale("symlog", linthresh=1.0)
    ttft.set_ylim(bottom=0)
    if ev.sla.ttft_per_1k_s:  # each request has its own target: no one line to draw
        ttft.set_ylabel("p99 TTFT per interval (s;\nthe target grows with the prompt)")
    else:
        ttft.axhline(ev.sla.ttft_s, color="red", linestyle="--", linewidth=0.8)
        ttft.set_ylabel("p99 TTFT per interval (s)")
    itl.axhline(1000 * ev.sla.itl_s, color="red", linestyle="--", linewidth=0.8)
    itl.set_ylabel("p99 ITL per interval (ms)")
    itl.set_xlabel("trace time (h)")
    fig.suptitle(f"{ev.trace.name}: load, replicas and latency by policy ({ev.sla.describe()})")
    fig.tight_layout()
    fig.savefig(folder / "replay.png", dpi=110)
    plt.close(fig)


def _folder(args: argparse.Namespace, trace: Trace) -> Path:
    folder: Path = args.out or Path(".fleetward") / "replay" / f"{trace.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


LIVE_POLICIES = ("fleetward", "reactive", "dynamo-style", "static-peak")


async def _run_live(args: argparse.Namespace, trace: Trace, out: Console, err: Console) -> int:
    from fleetward.autoscale.live import replay_live
    from fleetward.cli.compose import LocalFleet
    from fleetward.fleet.config import AutoscaleConfig, FleetConfig, SimConfig

    policies = [p.strip() for p in (args.policies or "fleetward").split(",") if p.strip()]
    unknown = [p for p in policies if p not in LIVE_POLICIES]
    if unknown:
        raise ConfigError(f"live replay: {', '.join(unknown)} cannot run live (the oracle needs the future: use "
                          f"--simulate); choose from {', '.join(LIVE_POLICIES)}", field="--policies")
    if not trace.requests:
        raise ConfigError(f"trace {trace.name} has no requests")
    sla = Sla(args.ttft, args.itl, args.ttft_per_1k)
    folder = _folder(args, trace)
    sim = SimConfig()
    sample = [TraceRequest(0.0, min(r.input_tokens, args.max_prompt), min(r.output_tokens, args.max_output))
              for r in random.Random(args.seed).sample(list(trace.requests), min(2000, len(trace.requests)))]
    # Live simulated workers start in about a second: the planner's lead time is that, not --startup.
    capacity = profile_capacity(sample, startup_s=2.0, config=sim, seed=args.seed, sla=sla)
    per_worker = capacity.max_rate(sla)
    (folder / "capacity.json").write_text(capacity.to_json() + "\n")
    interval = args.interval / args.speed  # the same planning interval in trace time, on the compressed clock
    rates = trace.rate_per_interval(interval)
    peak = math.ceil(max(rates) / per_worker)
    top = args.max_workers if args.max_workers is not None else max(2 * peak, args.min_workers + 1)
    first = max(args.min_workers, math.ceil(rates[0] / per_worker))
    err.print(f"{trace.name}: {len(trace.requests)} requests over {trace.duration_s:.0f} s (wall), "
              f"{per_worker:.2f} req/s per worker; planning every {interval:g} s, {args.min_workers}-{top} workers")
    results: dict[str, FleetResult] = {}
    for name in policies:
        config = FleetConfig(cluster=f"replay-{os.getpid()}", run_dir=folder / "fleet", workers=first, sim=sim,
                             autoscale=AutoscaleConfig(
                                 enabled=True, policy=name, interval_s=interval, min_workers=args.min_workers,
                                 max_workers=top, predictor=args.predictor, ttft_s=sla.ttft_s, itl_s=sla.itl_s,
                                 ttft_per_1k_s=sla.ttft_per_1k_s,
                                 capacity=(folder / "capacity.json").resolve(), drain_deadline_s=60.0))
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=err, transient=True) as bar:
            task = bar.add_task(f"{name}: starting a fleet of {first}", total=len(trace.requests))
            async with LocalFleet(config, progress=lambda _s, _w: None) as fleet:
                def progress(sent: int, finished: int, task: TaskID = task, name: str = name) -> None:
                    bar.update(task, description=f"{name}: {sent} sent", completed=finished)

                result, _ = await replay_live(trace, router=fleet.router_url, model=fleet.backend.model_name,
                                              store=fleet.store, keys=fleet.keys, bus=fleet.bus, sla=sla,
                                              max_prompt_tokens=args.max_prompt, max_output_tokens=args.max_output,
                                              seed=args.seed, on_progress=progress)
        result.policy = name
        results[name] = result
    summary = {"mode": "live", "trace": {"name": trace.name, "format": trace.format, "requests": len(trace.requests),
                                         "duration_s": round(trace.duration_s, 1)},
               "sla": {"ttft_s": sla.ttft_s, "itl_s": sla.itl_s, "ttft_per_1k_s": sla.ttft_per_1k_s},
               "capacity": {"per_worker_rps": round(per_worker, 3), "startup_s": capacity.startup_s},
               "policies": {name: r.summary() for name, r in results.items()}}
    (folder / "replay.json").write_text(json.dumps(summary, indent=1) + "\n")
    if not args.no_plots:
        _plot_live(results, trace, sla, folder)
    if args.json:
        out.print_json(json.dumps(summary))
        return 0
    table = Table(title=f"{trace.name} live ({len(trace.requests)} requests, {trace.duration_s:.0f} s): SLA TTFT "
                        f"{sla.describe()}; {per_worker:.2f} req/s per worker")
    for col in ("policy", "SLA attainment", "worker-hours", "goodput/worker-h", "scale events", "cut streams",
                "failed", "migrated"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for name, r in results.items():
        table.add_row(name, f"{100 * r.sla_attainment:.2f} %", f"{r.worker_hours:.4f}",
                      f"{r.goodput_per_worker_hour:.0f}", str(r.scale_events), str(r.cut_streams), str(r.failed),
                      str(r.migrated))
    out.print(table)
    err.print(f"results and plots: {folder}")
    return 0


def _plot_live(results: dict[str, FleetResult], trace: Trace, sla: Sla, folder: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (load, replicas) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    width = max(1.0, trace.duration_s / 200)
    counts = [0] * (int(trace.duration_s // width) + 1)
    for r in trace.requests:
        counts[int(r.arrival_s // width)] += 1
    load.plot([k * width for k in range(len(counts))], [c / width for c in counts], color="black")
    load.set_ylabel("arrivals (req/s)")
    for name, res in results.items():
        replicas.step([r.t for r in res.timeline], [r.desired for r in res.timeline], where="post",
                      label=f"{name}: desired")
        replicas.step([r.t for r in res.timeline], [r.healthy for r in res.timeline], where="post",
                      label=f"{name}: serving", linestyle="--")
    replicas.set_ylabel("workers")
    replicas.set_xlabel("time (s)")
    replicas.legend(fontsize=8)
    fig.suptitle(f"{trace.name}, live: load and workers (SLA TTFT {sla.ttft_s:g} s, ITL {sla.itl_s * 1000:g} ms)")
    fig.tight_layout()
    fig.savefig(folder / "replay-live.png", dpi=110)
    plt.close(fig)
