"""``fleetward bench checkpoints``: what checkpointing every stream costs, in etcd and with a peer router.

Fleetward routers on the same two simulated workers: ``on`` with checkpoints as configured by default
(incremental, in etcd: a base, then the tokens since the last flush), ``whole`` writing every live journal
whole at each flush (``checkpoint_incremental: false``, what checkpoints did before), ``peers`` keeping them
with a peer router instead of etcd (``checkpoint_store: peers``: a second router holds the copies, its CPU
counted as ``holder``), and ``off`` (``--no-checkpoints``); the same closed-loop streaming load goes to each
in rotating order, ``rounds`` times per concurrency. Reported: tokens/s with checkpoints ÷ without (same
round), the bytes of checkpoint values the router wrote per second (``fleetward_router_checkpoint_bytes_total``:
to etcd, or to its peer), its flushes and writes (etcd transactions, or requests to its peer) per second,
how long a flush held the event loop at a stretch (p99 of ``fleetward_router_checkpoint_slice_seconds``, a
bucket bound), and what etcd itself saw per second (its ``/metrics``: bytes received from clients, puts,
transactions, WAL fsyncs), next to CPU per component.
"""

from __future__ import annotations

import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetward.chaos.bench._common import (
    Infra,
    Results,
    client_load,
    console,
    fmt,
    histogram_quantiles,
    metric_delta,
    progress,
    ratio,
    require_extras,
    scrape,
    summarize,
    table,
    wait_idle,
)
from fleetward.chaos.bench._router import SIM
from fleetward.chaos.harness import TestFleet
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.config import RouterConfig

__all__ = ["CheckpointBench", "run_checkpoint_bench"]

CASES = ("on", "whole", "peers", "off")
# etcd's own counters (summed over label sets): what reached it, whatever the client thinks it sent.
_ETCD = {
    "etcd_grpc_bytes": "etcd_network_client_grpc_received_bytes_total",
    "etcd_puts": "etcd_mvcc_put_total",
    "etcd_txns": "etcd_mvcc_txn_total",
    "etcd_fsyncs": "etcd_disk_wal_fsync_duration_seconds_count",
}


@dataclass(frozen=True)
class CheckpointBench:
    out: Path
    streams: tuple[int, ...] = (64, 256)
    rounds: int = 3
    warmup_s: float = 2.0
    duration_s: float = 8.0
    max_tokens: int = 256
    prompt_len: int = 32
    plots: bool = True
    etcd: str | None = None
    mqtt: str | None = None


async def run_checkpoint_bench(cfg: CheckpointBench) -> Results:
    require_extras(plots=cfg.plots)
    res = Results("checkpoints", cfg.out, {"config": {**cfg.__dict__, "out": str(cfg.out)}, "sim": SIM.model_dump(),
                                           "routing": RouterConfig().model_dump(), "runs": []})
    run_dir = cfg.out / "run-checkpoints"
    async with Infra(run_dir, cfg.etcd, cfg.mqtt).up() as infra:
        assert infra.etcd and infra.mqtt
        etcd_metrics = f"http://{infra.etcd}/metrics"
        console.print("starting 2 simulated workers and five routers (checkpoints incremental, whole, with a peer "
                      "and its holder, off)…")
        async with TestFleet(etcd=infra.etcd, mqtt=infra.mqtt, cluster=f"bench-cp-{uuid.uuid4().hex[:6]}",
                             run_dir=run_dir, workers=2, backend=SimBackend(SIM), routing=RouterConfig()) as fleet:
            await fleet.wait_workers_routable(2)
            routers = {"on": await fleet.start_router("bench-cp-on"),
                       "whole": await fleet.start_router("bench-cp-whole", checkpoint_incremental=False),
                       "peers": await fleet.start_router("bench-cp-peers-a", checkpoint_store="peers"),
                       "off": await fleet.start_router("bench-cp-off", checkpoints=False)}
            holder = await fleet.start_router("bench-cp-peers-b", checkpoint_store="peers")
            body = {"model": SIM.model_name, "max_tokens": cfg.max_tokens, "ignore_eos": True,
                    "return_token_ids": True, "temperature": 0}
            base_pids = {"workers": [p.pid for w in fleet.worker_ids for p in fleet.processes(w)[:1]]}
            if infra.etcd_pid:
                base_pids["etcd"] = [infra.etcd_pid]
            with progress() as bar:
                task = bar.add_task("checkpoint bench", total=len(cfg.streams) * cfg.rounds * len(CASES))
                for c in cfg.streams:
                    for rnd in range(cfg.rounds):
                        for case in CASES if rnd % 2 == 0 else tuple(reversed(CASES)):
                            bar.update(task, description=f"{c} streams, round {rnd + 1}/{cfg.rounds}: "
                                                         f"checkpoints {case}")
                            router = routers[case]
                            await wait_idle(fleet)
                            r0, e0 = await scrape(router.url + "/metrics"), await scrape(etcd_metrics)
                            spec = {"urls": [router.url], "body": body, "prompt_len": cfg.prompt_len, "streams": c,
                                    "warmup_s": cfg.warmup_s, "duration_s": cfg.duration_s, "seed": rnd,
                                    "cpu_pids": {**base_pids, "router": [router.process.pid],
                                                 **({"holder": [holder.process.pid]} if case == "peers" else {})}}
                            # Counters are read around the whole run: divide by the run, not the window.
                            t0 = time.monotonic()
                            r = await client_load(spec)
                            elapsed = time.monotonic() - t0
                            r1, e1 = await scrape(router.url + "/metrics"), await scrape(etcd_metrics)
                            run: dict[str, Any] = {
                                "streams": c, "round": rnd, "case": case, "tokens_per_s": r["tokens"] / r["window_s"],
                                "requests_failed": r["requests_failed"], "itl": summarize(r["gaps_us"]),
                                "cpu_cores": r["cpu_cores"], "run_s": elapsed,
                                **{f"router_{what}_per_s": metric_delta(
                                    r0, r1, f"fleetward_router_checkpoint_{what}_total") / elapsed
                                   for what in ("txns", "bytes", "flushes")},
                                "slice_p99_le_s": histogram_quantiles(
                                    r0, r1, "fleetward_router_checkpoint_slice_seconds")["p99_le_s"],
                                "flush_p99_le_s": histogram_quantiles(
                                    r0, r1, "fleetward_router_checkpoint_flush_seconds")["p99_le_s"],
                            }
                            for key, name in _ETCD.items():
                                run[f"{key}_per_s"] = metric_delta(e0, e1, name) / elapsed
                            res.data["runs"].append(run)
                            bar.advance(task)
    _summarize(res, cfg)
    res.write()
    if cfg.plots:
        _plot(res, cfg)
    return res


def _med(values: list[float | None]) -> float | None:
    vs = [v for v in values if v is not None]
    return statistics.median(vs) if vs else None


def _summarize(res: Results, cfg: CheckpointBench) -> None:
    runs = res.data["runs"]
    summary: dict[str, Any] = {}
    rows = []
    for c in cfg.streams:
        per: dict[str, Any] = {}
        for case in CASES:
            mine = [r for r in runs if r["streams"] == c and r["case"] == case]
            keys = ["tokens_per_s", "router_txns_per_s", "router_bytes_per_s", "router_flushes_per_s",
                    "slice_p99_le_s", "flush_p99_le_s", *[f"{k}_per_s" for k in _ETCD]]
            per[case] = {k: _med([r[k] for r in mine]) for k in keys}
            per[case]["itl_p99_ms"] = _med([r["itl"]["p99_ms"] for r in mine])
            for comp in ("router", "holder", "etcd", "workers", "client"):
                per[case][f"cpu_{comp}"] = _med([r["cpu_cores"].get(comp) for r in mine])
        for case in ("on", "whole", "peers"):
            ratios = []
            for rnd in range(cfg.rounds):
                one = next((r for r in runs if r["streams"] == c and r["round"] == rnd and r["case"] == case), None)
                off = next((r for r in runs if r["streams"] == c and r["round"] == rnd and r["case"] == "off"), None)
                if one and off:
                    ratios.append(ratio(one["tokens_per_s"], off["tokens_per_s"]))
            per[f"throughput_ratio_{case}_vs_off"] = _med(ratios)
        per["throughput_loss_pct"] = None if per["throughput_ratio_on_vs_off"] is None else \
            100 * (1 - per["throughput_ratio_on_vs_off"])
        summary[str(c)] = per
        for case in CASES:
            s = per[case]
            rows.append([str(c), case, fmt(s["tokens_per_s"], ".0f"),
                         fmt(per.get(f"throughput_ratio_{case}_vs_off"), ".3f") if case != "off" else "1",
                         fmt((s["router_bytes_per_s"] or 0) / 1e6, ".3f"), fmt(s["router_flushes_per_s"], ".1f"),
                         fmt(s["router_txns_per_s"], ".1f"), fmt((s["etcd_grpc_bytes_per_s"] or 0) / 1e6, ".2f"),
                         fmt(s["etcd_puts_per_s"], ".0f"), fmt(s["etcd_fsyncs_per_s"], ".1f"),
                         fmt(None if s["slice_p99_le_s"] is None else s["slice_p99_le_s"] * 1000, ".2f"),
                         fmt(None if s["flush_p99_le_s"] is None else s["flush_p99_le_s"] * 1000, ".1f"),
                         fmt(s["itl_p99_ms"], ".1f"), fmt(s["cpu_router"], ".2f"), fmt(s["cpu_holder"], ".2f"),
                         fmt(s["cpu_etcd"], ".2f")])
    res.data["summary"] = summary
    table(f"bench checkpoints: medians of {cfg.rounds} interleaved round(s); ratio = tok/s ÷ off's in the same round; "
          "slice and flush p99 are histogram bucket bounds",
          ["streams", "checkpoints", "tok/s", "x tok/s", "written MB/s", "flush/s", "router txn/s", "etcd MB/s in",
           "etcd put/s", "fsync/s", "slice p99 ms", "flush p99 ms", "p99 ITL ms", "cpu router", "cpu holder",
           "cpu etcd"], rows)


def _plot(res: Results, cfg: CheckpointBench) -> None:
    from fleetward.chaos.bench import _plots

    s = res.data["summary"]
    groups = [f"{c} streams" for c in cfg.streams]
    _plots.grouped_bars(res.plot_path("throughput"), title="Tokens/s with checkpoints on vs off (median of rounds)",
                        groups=groups, series={f"checkpoints {case}": [s[str(c)][case]["tokens_per_s"]
                                                                       for c in cfg.streams] for case in CASES},
                        ylabel="tokens/s", fmt="{:.0f}")
    _plots.grouped_bars(res.plot_path("etcd"), title="etcd load with checkpoints on vs off",
                        groups=[f"{g}: {m}" for g in groups for m in ("txn/s", "MB/s")],
                        series={f"checkpoints {case}": [v for c in cfg.streams for v in
                                                        (s[str(c)][case]["etcd_txns_per_s"],
                                                         (s[str(c)][case]["etcd_grpc_bytes_per_s"] or 0) / 1e6)]
                                for case in CASES}, ylabel="per second", fmt="{:.1f}")
    written = ("on", "whole", "peers")
    _plots.grouped_bars(res.plot_path("written"), title="Checkpoint bytes written per second: incremental vs whole",
                        groups=groups,
                        series={f"checkpoints {case}": [(s[str(c)][case]["router_bytes_per_s"] or 0) / 1e6
                                                        for c in cfg.streams] for case in written},
                        ylabel="MB/s into etcd (values)", fmt="{:.2f}")
