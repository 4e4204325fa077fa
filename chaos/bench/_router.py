"""``fleetward bench router``: what a router adds per token, direct vs fleetward vs vllm-router.

Two simulated workers with fast steps; the same closed-loop streaming load (C concurrent streams, each
sending one request after another) goes (a) straight to the workers, the client balancing round robin
itself, (b) through fleetward's router, (c) through ``vllm-router`` (round robin), one after the other in
rotating order, ``rounds`` times per concurrency. Every ratio is taken within a round (same minute, same
noise) and the median over rounds is reported.
"""

from __future__ import annotations

import contextlib
import statistics
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from fleetward.chaos.bench._common import (
    BenchError,
    Infra,
    Results,
    cdf_points,
    client_load,
    console,
    fmt,
    progress,
    ratio,
    require_extras,
    summarize,
    table,
    vllm_router_argv,
    wait_idle,
)
from fleetward.chaos.harness import TestFleet
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.config import RouterConfig, SimConfig
from fleetward.fleet.launch import router_argv, service_env, start_service, write_service_config
from fleetward.fleet.procs import ManagedProcess, free_port

__all__ = ["SIM", "RouterBench", "run_router_bench"]

TARGETS = ("direct", "fleetward", "fleetward-worker-text", "vllm-router")
# fleetward-worker-text: the router passes the workers' text on instead of detokenizing (its cost is the
# difference). Also available: fleetward's router without checkpoints, to tell the proxy's cost from the
# checkpoints'.
# fleetward-2proc: a router group of two processes on one port (routing.processes: 2).
# fleetward-baseline: the router of another checkout (``RouterBench.baseline``), for a before/after.
OPTIONAL_TARGETS = ("fleetward-no-checkpoints", "fleetward-2proc", "fleetward-baseline")
_VARIANTS: dict[str, dict[str, Any]] = {"fleetward-worker-text": {"detokenize": False},
                                        "fleetward-no-checkpoints": {"checkpoints": False},
                                        "fleetward-2proc": {"processes": 2}}

# Fast steps: the workers are cheap and the routers' per-token cost shows. At 256 streams (128 per
# worker) a step is 10 + 128 * 0.02 = 12.6 ms, i.e. ~20k tokens/s offered: more than 2 cores carry.
SIM = SimConfig(decode_step_ms=10.0, decode_ms_per_seq=0.02, prefill_ms_per_token=0.01, max_num_seqs=512,
                kv_capacity_tokens=1 << 20, max_num_batched_tokens=16384, seed=11)


@dataclass(frozen=True)
class RouterBench:
    out: Path
    streams: tuple[int, ...] = (1, 64, 256)
    targets: tuple[str, ...] = TARGETS
    rounds: int = 3
    warmup_s: float = 2.0
    duration_s: float = 8.0
    max_tokens: int = 128
    prompt_len: int = 32
    client_procs: int = 1
    plots: bool = True
    baseline: Path | None = None
    etcd: str | None = None
    mqtt: str | None = None


@contextlib.asynccontextmanager
async def vllm_router(worker_urls: list[str], log_dir: Path) -> AsyncIterator[tuple[str, ManagedProcess]]:
    """``vllm-router`` (round robin) in front of ``worker_urls``: its URL and process, stopped on exit."""
    port, metrics_port = free_port(), free_port()
    argv = [*vllm_router_argv(), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
            "--policy", "round_robin", "--log-level", "warning", "--prometheus-port", str(metrics_port),
            "--prometheus-host", "127.0.0.1"]
    proc = ManagedProcess("vllm-router", argv, log_path=log_dir / "vllm-router.log").start()
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(timeout=2, trust_env=False) as client:
            async def healthy() -> bool:
                return (await client.get(url + "/health")).status_code == 200

            await proc.wait_ready(healthy, timeout=60, interval=0.1)
        yield url, proc
    finally:
        await proc.stop(grace=5)


def _agg(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


async def run_router_bench(cfg: RouterBench) -> Results:
    require_extras(plots=cfg.plots, vllm_router="vllm-router" in cfg.targets)
    unknown = set(cfg.targets) - set(TARGETS) - set(OPTIONAL_TARGETS)
    if unknown:
        raise BenchError(f"unknown target(s) {sorted(unknown)}; choose from {', '.join(TARGETS + OPTIONAL_TARGETS)}")
    if "direct" not in cfg.targets:
        raise BenchError("--targets must include direct: every ratio is against it")
    if ("fleetward-baseline" in cfg.targets) != (cfg.baseline is not None):
        raise BenchError("target fleetward-baseline and --baseline go together")
    if cfg.baseline is not None and not (cfg.baseline / "fleetward" / "migration" / "router.py").exists():
        raise BenchError(f"--baseline {cfg.baseline}: no fleetward checkout in {cfg.baseline / 'fleetward'}")
    res = Results("router", cfg.out, {"config": {**cfg.__dict__, "out": str(cfg.out)}, "sim": SIM.model_dump(),
                                     "runs": []})
    run_dir = cfg.out / "run-router"
    async with Infra(run_dir, cfg.etcd, cfg.mqtt).up() as infra, contextlib.AsyncExitStack() as stack:
        assert infra.etcd and infra.mqtt
        console.print("starting 2 simulated workers, fleetward's router and vllm-router…")
        fleet = await stack.enter_async_context(TestFleet(
            etcd=infra.etcd, mqtt=infra.mqtt, cluster=f"bench-router-{uuid.uuid4().hex[:6]}", run_dir=run_dir,
            workers=2, backend=SimBackend(SIM), routing=RouterConfig(), lease_ttl=10))
        await fleet.wait_workers_routable(2)
        worker_urls = [fleet.url(w) for w in fleet.worker_ids]
        urls: dict[str, list[str]] = {"direct": worker_urls}
        pids: dict[str, dict[str, list[int]]] = {}
        worker_pids = [p.pid for w in fleet.worker_ids for p in fleet.processes(w)[:1]]
        base_pids = {"workers": worker_pids}
        if infra.etcd_pid:
            base_pids["etcd"] = [infra.etcd_pid]
        pids["direct"] = base_pids
        if "fleetward" in cfg.targets:
            fw = await fleet.start_router("bench-fleetward")
            urls["fleetward"] = [fw.url]
            pids["fleetward"] = {**base_pids, "router": [fw.process.pid]}
        for target, overrides in _VARIANTS.items():
            if target in cfg.targets:
                variant = await fleet.start_router(f"bench-{target}", **overrides)
                urls[target] = [variant.url]
                # A group's parent only waits: its children (ready once it is) do the work.
                group = [p.pid for p in psutil.Process(variant.process.pid).children()]
                pids[target] = {**base_pids, "router": [variant.process.pid, *group]}
        if cfg.baseline is not None:
            # The other checkout's router: its code first on the path; a config file with only the cluster
            # (an older RouterConfig may not know today's fields).
            rid, port = "bench-fleetward-baseline", free_port()
            etcd, mqtt = fleet.etcd_endpoints[0], fleet.mqtt
            conf = write_service_config(fleet.run_dir / f"{rid}.yaml", cluster=fleet.cluster)
            base = await start_service(rid, router_argv(etcd=etcd, mqtt=mqtt, cluster=fleet.cluster, config=conf,
                                                        port=port, router_id=rid),
                                       url=f"http://127.0.0.1:{port}", log_path=fleet.log_dir / f"{rid}.log",
                                       env={**service_env(), "PYTHONPATH": str(cfg.baseline.resolve())})
            stack.push_async_callback(lambda: base.process.stop(grace=10))
            urls["fleetward-baseline"] = [base.url]
            pids["fleetward-baseline"] = {**base_pids, "router": [base.process.pid]}
        if "vllm-router" in cfg.targets:
            vr_url, vr_proc = await stack.enter_async_context(vllm_router(worker_urls, fleet.log_dir))
            urls["vllm-router"] = [vr_url]
            pids["vllm-router"] = {**base_pids, "router": [vr_proc.pid]}
        body = {"model": SIM.model_name, "max_tokens": cfg.max_tokens, "ignore_eos": True, "return_token_ids": True,
                "temperature": 0}
        total = len(cfg.streams) * cfg.rounds * len(cfg.targets)
        with progress() as bar:
            task = bar.add_task("router bench", total=total)
            for c in cfg.streams:
                for rnd in range(cfg.rounds):
                    order = list(cfg.targets[rnd % len(cfg.targets):]) + list(cfg.targets[:rnd % len(cfg.targets)])
                    for target in order:
                        bar.update(task, description=f"{c} stream(s), round {rnd + 1}/{cfg.rounds}: {target}")
                        await wait_idle(fleet)
                        spec = {"urls": urls[target], "body": body, "prompt_len": cfg.prompt_len, "streams": c,
                                "warmup_s": cfg.warmup_s, "duration_s": cfg.duration_s, "cpu_pids": pids[target],
                                "seed": rnd}
                        r = await client_load(spec, procs=cfg.client_procs)
                        res.data["runs"].append({
                            "streams": c, "round": rnd, "target": target, "window_s": r["window_s"],
                            "tokens": r["tokens"], "tokens_per_s": r["tokens"] / r["window_s"],
                            "requests_ok": r["requests_ok"], "requests_failed": r["requests_failed"],
                            "errors": r["errors"], "itl": summarize(r["gaps_us"]), "ttft": summarize(r["ttft_us"]),
                            "itl_cdf": cdf_points(r["gaps_us"]), "cpu_cores": r["cpu_cores"],
                        })
                        bar.advance(task)
    _summarize(res, cfg)
    res.write()
    if cfg.plots:
        _plot(res, cfg)
    return res


def _summarize(res: Results, cfg: RouterBench) -> None:
    runs = res.data["runs"]
    summary: dict[str, Any] = {}
    for c in cfg.streams:
        per: dict[str, Any] = {}
        for target in cfg.targets:
            mine = [r for r in runs if r["streams"] == c and r["target"] == target]
            rows = []
            for r in mine:
                d = next((x for x in runs if x["streams"] == c and x["round"] == r["round"]
                          and x["target"] == "direct"), None)
                row = {"tokens_per_s": r["tokens_per_s"], "itl_p50_ms": r["itl"]["p50_ms"],
                       "itl_p99_ms": r["itl"]["p99_ms"], "ttft_p50_ms": r["ttft"]["p50_ms"],
                       "ttft_p99_ms": r["ttft"]["p99_ms"], "failed": r["requests_failed"]}
                if d is not None:
                    row["throughput_ratio"] = ratio(r["tokens_per_s"], d["tokens_per_s"])
                    row["itl_p50_ratio"] = ratio(r["itl"]["p50_ms"], d["itl"]["p50_ms"])
                    row["itl_p99_ratio"] = ratio(r["itl"]["p99_ms"], d["itl"]["p99_ms"])
                    if r["itl"]["p50_ms"] is not None and d["itl"]["p50_ms"] is not None:
                        row["added_p50_ms"] = r["itl"]["p50_ms"] - d["itl"]["p50_ms"]
                        row["added_p99_ms"] = r["itl"]["p99_ms"] - d["itl"]["p99_ms"]
                for comp, cores in r["cpu_cores"].items():
                    row[f"cpu_{comp}"] = cores
                if r["cpu_cores"].get("router") and r["tokens_per_s"]:
                    row["router_us_per_token"] = r["cpu_cores"]["router"] / r["tokens_per_s"] * 1e6
                rows.append(row)
            keys = sorted({k for row in rows for k in row})
            per[target] = {k: _agg(rows, k) for k in keys}
        summary[str(c)] = per
    res.data["summary"] = summary
    out_rows = []
    for c in cfg.streams:
        for target in cfg.targets:
            s = summary[str(c)][target]
            out_rows.append([str(c), target, fmt(s.get("tokens_per_s"), ".0f"), fmt(s.get("throughput_ratio"), ".3f"),
                             fmt(s.get("itl_p50_ms"), ".2f"), fmt(s.get("itl_p99_ms"), ".2f"),
                             fmt(s.get("added_p50_ms"), "+.2f"), fmt(s.get("added_p99_ms"), "+.2f"),
                             fmt(s.get("itl_p99_ratio"), ".3f"), fmt(s.get("cpu_router"), ".2f"),
                             fmt(s.get("router_us_per_token"), ".1f"),
                             fmt(s.get("cpu_workers"), ".2f"), fmt(s.get("cpu_client"), ".2f"),
                             str(int(s.get("failed") or 0))])
    table(f"bench router: medians of {cfg.rounds} interleaved round(s); ratios vs direct in the same round",
          ["streams", "target", "tok/s", "x tok/s", "p50 ITL ms", "p99 ITL ms", "p50 added ms", "p99 added ms",
           "x p99", "cpu router", "µs/tok router", "cpu workers", "cpu client", "failed"], out_rows)


def _plot(res: Results, cfg: RouterBench) -> None:
    from fleetward.chaos.bench import _plots

    s = res.data["summary"]
    groups = [f"{c} stream{'s' if c > 1 else ''}" for c in cfg.streams]
    targets = [t for t in cfg.targets if t != "direct"]
    _plots.grouped_bars(res.plot_path("throughput"), title="Throughput relative to direct (median of rounds)",
                        groups=groups, series={t: [s[str(c)][t].get("throughput_ratio") for c in cfg.streams]
                                               for t in targets}, ylabel="tokens/s ÷ direct", hline=1.0,
                        fmt="{:.3f}")
    for q in ("p50", "p99"):
        _plots.grouped_bars(res.plot_path(f"itl-{q}"), title=f"Client-side inter-token latency, {q}",
                            groups=groups, series={t: [s[str(c)][t].get(f"itl_{q}_ms") for c in cfg.streams]
                                                   for t in cfg.targets}, ylabel="ms")
    pick = max((c for c in cfg.streams if c <= 64), default=cfg.streams[0])
    last = {r["target"]: r for r in res.data["runs"] if r["streams"] == pick}
    _plots.cdf(res.plot_path("itl-cdf"), title=f"Inter-token latency CDF at {pick} stream(s) (last round)",
               series={t: last[t]["itl_cdf"] for t in cfg.targets if t in last}, xlabel="ms")
    comps = ["workers", "router", "client", "etcd"]
    labels: list[str] = []
    series: dict[str, list[float]] = {comp: [] for comp in comps}
    for c in cfg.streams:
        for t in cfg.targets:
            labels.append(f"{t} @{c}")
            for comp in comps:
                series[comp].append(s[str(c)][t].get(f"cpu_{comp}") or 0.0)
    _plots.stacked_bars(res.plot_path("cpu"), title="CPU cores used per component (2 cores in all)",
                        groups=labels, series=series, ylabel="cores")
