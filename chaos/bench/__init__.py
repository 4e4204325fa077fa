"""Benchmarks (``fleetward bench router|migration|restart|checkpoints|detect|pd|moves|scale``).

Each benchmark starts what it measures (etcd, an MQTT broker, simulated workers, routers, client
processes), measures its baseline in the same run, interleaved with the candidate, prints ratios, writes
its raw results as JSON and its plots as PNG into ``--out``, and stops everything it started. Results and
how to read them: docs/benchmarks.md. Benchmarks are not tests: nothing here asserts a number.

Needs the ``bench`` extra (matplotlib for plots, vllm-router for the comparison):
``pip install 'fleetward[bench]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _mixes(text: str) -> tuple[tuple[int, int], ...]:
    try:
        mixes = tuple((int(a), int(b)) for a, _, b in (m.strip().partition("/") for m in text.split(",") if m.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected IN/OUT token pairs like 128/128,2048/64, got {text!r}") from None
    if not mixes or any(a < 2 or b < 1 for a, b in mixes):
        raise argparse.ArgumentTypeError(f"expected input >= 2 and output >= 1 tokens, got {text!r}")
    return mixes


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fleetward bench", description="Benchmarks of the router and the supervisor; "
                                "results and plots go to --out (see docs/benchmarks.md).")
    sub = p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--out", type=Path, default=None,
                        help="folder for <name>.json and plots (default .fleetward/bench/<name>-<time>)")
        sp.add_argument("--etcd", help="use this etcd (host:port) instead of starting one")
        sp.add_argument("--mqtt", help="use this MQTT broker (host:port) instead of starting one")
        sp.add_argument("--no-plots", dest="plots", action="store_false", help="JSON only (no matplotlib needed)")
        sp.add_argument("--quick", action="store_true", help="tiny sizes: checks that the benchmark runs")

    r = sub.add_parser("router", help="added latency per token and throughput: direct vs fleetward vs vllm-router")
    common(r)
    r.add_argument("--streams", type=_ints, default=(1, 64, 256), help="concurrencies (default 1,64,256)")
    r.add_argument("--targets", type=_names, default=("direct", "fleetward", "fleetward-worker-text", "vllm-router"),
                   help="direct, fleetward, fleetward-worker-text (the router passes workers' text on: the "
                   "difference is what detokenizing costs), vllm-router, fleetward-no-checkpoints, fleetward-2proc "
                   "(two router processes on one port), fleetward-baseline (with --baseline)")
    r.add_argument("--rounds", type=int, default=3, help="interleaved rounds per concurrency (default 3)")
    r.add_argument("--duration", type=float, default=8.0, help="measured seconds per run (default 8)")
    r.add_argument("--warmup", type=float, default=2.0, help="seconds before measuring (default 2)")
    r.add_argument("--max-tokens", dest="max_tokens", type=int, default=128)
    r.add_argument("--client-procs", dest="client_procs", type=int, default=1,
                   help="client processes sharing the streams (default 1)")
    r.add_argument("--baseline", type=Path, default=None,
                   help="a folder holding another fleetward checkout as fleetward/ (git worktree add DIR/fleetward "
                   "COMMIT): its router runs as target fleetward-baseline, for a before/after in one run")

    m = sub.add_parser("migration", help="client-visible stall when a worker is killed (or hangs) under load")
    common(m)
    m.add_argument("--streams", type=int, default=48, help="concurrent long streams (default 48)")
    m.add_argument("--kills", type=int, default=3, help="SIGKILL trials (default 3)")
    m.add_argument("--hangs", type=int, default=2, help="silent-hang trials (default 2)")
    m.add_argument("--max-tokens", dest="max_tokens", type=int, default=300)
    m.add_argument("--prompt-len", dest="prompt_len", type=int, default=256)

    s = sub.add_parser("restart", help="router restart to full state with many workers and checkpoints in etcd")
    common(s)
    s.add_argument("--workers", type=int, default=1000, help="registered workers (default 1000)")
    s.add_argument("--checkpoints", type=int, default=10000, help="request checkpoints (default 10000)")
    s.add_argument("--repeats", type=int, default=3, help="restarts measured per case (default 3)")

    c = sub.add_parser("checkpoints", help="throughput and etcd writes with checkpoints on vs off")
    common(c)
    c.add_argument("--streams", type=_ints, default=(64, 256))
    c.add_argument("--rounds", type=int, default=3)
    c.add_argument("--duration", type=float, default=8.0)
    c.add_argument("--warmup", type=float, default=2.0)
    c.add_argument("--max-tokens", dest="max_tokens", type=int, default=256)

    d = sub.add_parser("detect", help="supervisor: detection latency per fault, false positives in a soak, "
                       "controller CPU at many workers")
    common(d)
    d.add_argument("--parts", type=_names, default=("latency", "soak", "cpu"),
                   help="which parts to run (default latency,soak,cpu)")
    d.add_argument("--trials", type=int, default=10, help="trials per fault type on simulated workers (default 10)")
    d.add_argument("--streams", type=int, default=24, help="streams running during sim trials (default 24)")
    d.add_argument("--vllm", action="store_true", help="also measure detection on real vLLM (the tiny model, CPU)")
    d.add_argument("--vllm-trials", dest="vllm_trials", type=int, default=2,
                   help="trials per fault type on vLLM (default 2; each costs a ~40 s restart)")
    d.add_argument("--faults", type=_names, default=(),
                   help="latency: only these fault cases, e.g. cgroup-freeze,cgroup-freeze-idle (default: all)")
    d.add_argument("--soak-s", dest="soak_s", type=float, default=600.0, help="soak length in seconds (default 600)")
    d.add_argument("--load", type=float, default=0.9, help="soak arrival rate as a share of capacity (default 0.9)")
    d.add_argument("--calib-s", dest="calib_s", type=float, default=30.0,
                   help="measured seconds of the capacity run (default 30, after 10 s warm-up)")
    d.add_argument("--workers", type=_ints, default=(100, 1000),
                   help="registered workers for the controller CPU part, in turn (default 100,1000)")
    d.add_argument("--cpu-window-s", dest="cpu_window_s", type=float, default=60.0,
                   help="measured seconds per size (default 60)")
    d.add_argument("--routers", type=int, default=2, help="routers the controller polls (default 2)")
    d.add_argument("--profile", action="store_true", help="profile the controller with py-spy after the CPU part")
    pd = sub.add_parser("pd", help="prefill/decode vs aggregated serving (TTFT, ITL) at a few length mixes, and "
                        "the cost of each KV recovery policy")
    common(pd)
    pd.add_argument("--mixes", type=_mixes, default=((128, 128), (2048, 64), (256, 256)),
                    help="input/output token mixes (default 128/128,2048/64,256/256; the policies run on the one "
                    "with the longest prompts)")
    pd.add_argument("--streams", type=int, default=16, help="concurrent closed-loop streams (default 16)")
    pd.add_argument("--rounds", type=int, default=2, help="interleaved rounds per mix (default 2)")
    pd.add_argument("--duration", type=float, default=8.0, help="measured seconds per run (default 8)")
    pd.add_argument("--warmup", type=float, default=2.0, help="seconds before measuring (default 2)")
    pd.add_argument("--no-policies", dest="policies", action="store_false", help="skip the recovery policies part")
    mv = sub.add_parser("moves", help="a planned move's stall with the stream's KV carried vs computed again, "
                        "by context length")
    common(mv)
    mv.add_argument("--contexts", type=_ints, default=(1024, 8192, 32768),
                    help="prompt tokens of the moved streams (default 1024,8192,32768)")
    mv.add_argument("--streams", type=int, default=6, help="streams moved at once per context and mode (default 6)")
    mv.add_argument("--vllm", action="store_true", help="also move streams between real vLLM workers")
    sc = sub.add_parser("scale", help="the per-unit costs of the load model (docs/scale.md), measured here, and "
                        "every shared resource's load at 10, 100, 1,000 and 10,000 hosts against its limit")
    common(sc)
    sc.add_argument("--streams", type=int, default=128, help="streams of the router measurement (default 128)")
    sc.add_argument("--duration", type=float, default=8.0, help="measured seconds of the router run (default 8)")
    sc.add_argument("--workers", type=_ints, default=(100, 1000),
                    help="two fleet sizes for the controller's CPU per worker (default 100,1000)")
    sc.add_argument("--cpu-window-s", dest="cpu_window_s", type=float, default=30.0,
                    help="measured seconds per controller size (default 30)")
    return p


def main(argv: Sequence[str]) -> int:
    """``fleetward bench ...`` (called lazily by the CLI)."""
    args = _parser().parse_args(list(argv))
    status = 0
    out: Path = args.out or Path(".fleetward") / "bench" / f"{args.bench}-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.bench == "router":
        from fleetward.chaos.bench._router import RouterBench, run_router_bench

        cfg = RouterBench(out=out, streams=(1, 4) if args.quick else args.streams,
                          targets=args.targets, rounds=1 if args.quick else args.rounds,
                          warmup_s=0.5 if args.quick else args.warmup, duration_s=1.0 if args.quick else args.duration,
                          max_tokens=16 if args.quick else args.max_tokens, client_procs=args.client_procs,
                          plots=args.plots, etcd=args.etcd, mqtt=args.mqtt, baseline=args.baseline)
        res = asyncio.run(run_router_bench(cfg))
    elif args.bench == "migration":
        from fleetward.chaos.bench._migration import MigrationBench, run_migration_bench

        mcfg = MigrationBench(out=out, streams=6 if args.quick else args.streams, kills=1 if args.quick else args.kills,
                              hangs=1 if args.quick else args.hangs, max_tokens=120 if args.quick else args.max_tokens,
                              prompt_len=32 if args.quick else args.prompt_len,
                              fault_after_s=0.8 if args.quick else 2.5, plots=args.plots, etcd=args.etcd,
                              mqtt=args.mqtt)
        res = asyncio.run(run_migration_bench(mcfg))
    elif args.bench == "restart":
        from fleetward.chaos.bench._restart import RestartBench, run_restart_bench

        rcfg = RestartBench(out=out, workers=20 if args.quick else args.workers,
                            checkpoints=100 if args.quick else args.checkpoints,
                            repeats=1 if args.quick else args.repeats, plots=args.plots, etcd=args.etcd,
                            mqtt=args.mqtt)
        res = asyncio.run(run_restart_bench(rcfg))
    elif args.bench == "detect":
        from fleetward.chaos.bench._detect import DetectBench, run_detect_bench

        q = args.quick
        dcfg = DetectBench(out=out, parts=args.parts, sim_trials=1 if q else args.trials,
                           streams=6 if q else args.streams, max_tokens=120 if q else 300,
                           prompt_len=32 if q else 128, fault_after_s=1.0 if q else 2.0, vllm=args.vllm,
                           vllm_trials=1 if q else args.vllm_trials, soak_s=4.0 if q else args.soak_s,
                           calib_s=2.0 if q else args.calib_s, calib_warmup_s=1.0 if q else 10.0,
                           calib_streams=24 if q else 384, load=args.load,
                           cpu_workers=(5, 20) if q else args.workers, cpu_window_s=3.0 if q else args.cpu_window_s,
                           cpu_settle_s=1.0 if q else None, cpu_routers=1 if q else args.routers,
                           profile=args.profile, profile_s=3.0 if q else 20.0, plots=args.plots, etcd=args.etcd,
                           mqtt=args.mqtt, faults=args.faults)
        res = asyncio.run(run_detect_bench(dcfg))
    elif args.bench == "pd":
        from fleetward.chaos.bench._pd import PdBench, run_pd_bench

        q = args.quick
        pcfg = PdBench(out=out, mixes=((64, 16), (512, 8)) if q else args.mixes, streams=4 if q else args.streams,
                       rounds=1 if q else args.rounds, warmup_s=0.5 if q else args.warmup,
                       duration_s=1.5 if q else args.duration, policies=args.policies, plots=args.plots,
                       etcd=args.etcd, mqtt=args.mqtt)
        res = asyncio.run(run_pd_bench(pcfg))
    elif args.bench == "moves":
        from fleetward.chaos.bench._moves import MovesBench, run_moves_bench

        vcfg = MovesBench(out=out, contexts=args.contexts, streams=2 if args.quick else args.streams,
                          vllm=args.vllm, plots=args.plots, etcd=args.etcd, mqtt=args.mqtt)
        res = asyncio.run(run_moves_bench(vcfg))
        status = 0 if res.data["details"]["exact"] else 1  # a wrong stream fails the command, results written
    elif args.bench == "scale":
        from fleetward.chaos.bench._scale import ScaleBench, run_scale_bench

        q = args.quick
        workers = (args.workers[0], args.workers[-1]) if len(args.workers) > 1 else (10, args.workers[0])
        scfg = ScaleBench(out=out, streams=16 if q else args.streams, warmup_s=0.5 if q else 2.0,
                          duration_s=1.5 if q else args.duration, cpu_workers=(5, 20) if q else workers,
                          cpu_window_s=3.0 if q else args.cpu_window_s, cpu_settle_s=1.0 if q else 45.0,
                          mqtt_messages=2000 if q else 20000, plots=args.plots, etcd=args.etcd, mqtt=args.mqtt)
        res = asyncio.run(run_scale_bench(scfg))
    else:
        from fleetward.chaos.bench._checkpoints import CheckpointBench, run_checkpoint_bench

        ccfg = CheckpointBench(out=out, streams=(4,) if args.quick else args.streams,
                               rounds=1 if args.quick else args.rounds,
                               warmup_s=0.5 if args.quick else args.warmup,
                               duration_s=1.5 if args.quick else args.duration,
                               max_tokens=40 if args.quick else args.max_tokens, plots=args.plots, etcd=args.etcd,
                               mqtt=args.mqtt)
        res = asyncio.run(run_checkpoint_bench(ccfg))
    print(f"results: {res.json_path}")
    return status
