"""``fleetward bench migration``: the gap a client sees when its worker dies (or hangs) mid-stream.

Three simulated workers with the default (GPU-like) latency model behind fleetward's router; ``streams``
long streams start together; a few seconds in, one worker is SIGKILLed (``kill`` trials) or its engine
stops while ``/health`` stays 200 (``hang`` trials). Each stream asks for the router's trace
(``X-Fleetward-Trace: 1``), so the client knows which worker produced every chunk: the stall of a
migrated stream is the gap between its last token from the failed worker and its first from the next.

Reported per kind: client-side stall p50/p99/max of migrated streams, the router's own
``fleetward_router_migration_stall_seconds`` for the same migrations, the re-prefill time the simulated
worker charges (prompt + emitted tokens x ``prefill_ms_per_token``, alone and for the whole batch of
streams that moved to the same worker, since they are admitted in one step), and as a baseline the
largest gap of streams that were not migrated, in the same trials.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from fleetward.chaos.bench._common import (
    Infra,
    Results,
    client_load,
    console,
    fmt,
    histogram_quantiles,
    progress,
    quantile,
    require_extras,
    scrape,
    table,
    wait_idle,
    worker_pid,
)
from fleetward.chaos.harness import TestFleet
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.config import RouterConfig, SimConfig

__all__ = ["MigrationBench", "run_migration_bench"]

SIM = SimConfig(seed=5)  # the default latency model: ~18 ms steps + 0.35 ms per sequence, 0.05 ms per prompt token
STALL_METRIC = "fleetward_router_migration_stall_seconds"


@dataclass(frozen=True)
class MigrationBench:
    out: Path
    streams: int = 48
    kills: int = 3
    hangs: int = 2
    max_tokens: int = 300
    prompt_len: int = 256
    fault_after_s: float = 2.5
    plots: bool = True
    etcd: str | None = None
    mqtt: str | None = None


async def _trial(fleet: TestFleet, router_url: str, cfg: MigrationBench, kind: str, victim: str,
                 seed: int) -> dict[str, Any]:
    await fleet.restore()  # the last trial's victim back (a restart under way is waited for, not raced)
    await wait_idle(fleet)
    before = await scrape(router_url + "/metrics")
    body = {"model": SIM.model_name, "max_tokens": cfg.max_tokens, "ignore_eos": True, "return_token_ids": True,
            "temperature": 0}
    lead = 1.0
    spec = {"urls": [router_url], "body": body, "prompt_len": cfg.prompt_len, "streams": cfg.streams,
            "requests_per_stream": 1, "trace": True, "warmup_s": 0.0, "duration_s": 600.0, "max_s": 120.0,
            "seed": seed}
    load = asyncio.create_task(client_load(spec, lead_s=lead))
    await asyncio.sleep(lead + cfg.fault_after_s)
    async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
        progress_view = (await client.get(router_url + "/fleetward/v1/progress")).json()
    allowed = (progress_view["workers"].get(victim) or {}).get("allowed_silence_s")
    victim_pid = worker_pid(fleet, victim)
    fault_at = time.monotonic()
    if kind == "kill":
        fleet.kill(victim)
    else:
        await fleet.fault(victim, hang=True)
    result = await load
    after = await scrape(router_url + "/metrics")
    # The node agent may have acted on the fault meanwhile (e.g. restarted a hung worker): note it.
    replaced = worker_pid(fleet, victim) != victim_pid
    if kind == "hang" and not replaced:
        with contextlib.suppress(httpx.HTTPError, KeyError):
            await fleet.fault(victim, clear=True)
    migrations = {k.split('reason="', 1)[1].rstrip('"}'): v - before.get(k, 0.0) for k, v in after.items()
                  if k.startswith("fleetward_router_migrations_total{")}
    ms_per_token = SIM.prefill_ms_per_token
    moved: list[dict[str, Any]] = []
    unaffected_gaps: list[float] = []
    for rec in result["records"]:
        sw = next((s for s in rec["switches"] if s["from"] == victim), None)
        if sw is None:
            if rec["first_at"] is not None:
                unaffected_gaps.append(rec["max_gap_s"])
            continue
        moved.append({"stall_s": sw["gap_s"], "to": sw["to"], "tokens_before": sw["tokens_before"],
                      "since_fault_s": sw["at"] - fault_at, "max_gap_s": rec["max_gap_s"],
                      "reprefill_s": (rec["prompt_len"] + sw["tokens_before"]) * ms_per_token / 1000.0,
                      "finished": rec["finished"], "error": rec["error"]})
    batch: dict[str, float] = {}
    for m in moved:
        batch[m["to"]] = batch.get(m["to"], 0.0) + m["reprefill_s"]
    for m in moved:
        m["reprefill_batch_s"] = batch[m["to"]]
    return {"kind": kind, "victim": victim, "allowed_silence_s": allowed, "victim_replaced_by_agent": replaced,
            "moved": moved,
            "unaffected_max_gaps_s": unaffected_gaps, "router_stall": histogram_quantiles(before, after, STALL_METRIC),
            "migrations": migrations, "requests_ok": result["requests_ok"],
            "requests_failed": result["requests_failed"], "errors": result["errors"]}


def _stats(values: list[float]) -> dict[str, float | None]:
    return {"n": len(values), "p50_ms": _ms(quantile(values, 0.5)), "p99_ms": _ms(quantile(values, 0.99)),
            "max_ms": _ms(max(values) if values else None),
            "mean_ms": _ms(statistics.fmean(values) if values else None)}


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000.0


async def run_migration_bench(cfg: MigrationBench) -> Results:
    require_extras(plots=cfg.plots)
    res = Results("migration", cfg.out, {"config": {**cfg.__dict__, "out": str(cfg.out)}, "sim": SIM.model_dump(),
                                         "routing": RouterConfig().model_dump(), "trials": []})
    run_dir = cfg.out / "run-migration"
    kinds = ["kill"] * cfg.kills + ["hang"] * cfg.hangs
    async with Infra(run_dir, cfg.etcd, cfg.mqtt).up() as infra:
        assert infra.etcd and infra.mqtt
        console.print("starting 3 simulated workers and fleetward's router…")
        async with TestFleet(etcd=infra.etcd, mqtt=infra.mqtt, cluster=f"bench-migration-{uuid.uuid4().hex[:6]}",
                             run_dir=run_dir, workers=3, backend=SimBackend(SIM), routing=RouterConfig()) as fleet:
            await fleet.wait_workers_routable(3)
            router = await fleet.start_router("bench-migration")
            with progress() as bar:
                task = bar.add_task("migration bench", total=len(kinds))
                for i, kind in enumerate(kinds):
                    victim = fleet.worker_ids[i % 3]
                    bar.update(task, description=f"trial {i + 1}/{len(kinds)}: {kind} {victim}")
                    res.data["trials"].append(await _trial(fleet, router.url, cfg, kind, victim, seed=i))
                    bar.advance(task)
            with contextlib.suppress(Exception):
                await fleet.restore()
    _summarize(res, cfg)
    res.write()
    if cfg.plots:
        _plot(res)
    return res


def _summarize(res: Results, cfg: MigrationBench) -> None:
    summary: dict[str, Any] = {}
    rows = []
    for kind in ("kill", "hang"):
        trials = [t for t in res.data["trials"] if t["kind"] == kind]
        if not trials:
            continue
        moved = [m for t in trials for m in t["moved"]]
        stalls = [m["stall_s"] for m in moved]
        s = {
            "trials": len(trials),
            "streams_migrated": len(moved),
            "streams_failed": sum(t["requests_failed"] for t in trials),
            "client_stall": _stats(stalls),
            "client_max_gap_of_migrated": _stats([m["max_gap_s"] for m in moved]),
            "reprefill_own": _stats([m["reprefill_s"] for m in moved]),
            "reprefill_batch": _stats([m["reprefill_batch_s"] for m in moved]),
            "stall_minus_batch_reprefill": _stats([m["stall_s"] - m["reprefill_batch_s"] for m in moved]),
            "unaffected_max_gap": _stats([g for t in trials for g in t["unaffected_max_gaps_s"]]),
            "router_stall_metric": {
                "count": sum(t["router_stall"]["count"] for t in trials),
                "p50_le_s": max((t["router_stall"]["p50_le_s"] or 0) for t in trials),
                "p99_le_s": max((t["router_stall"]["p99_le_s"] or 0) for t in trials),
                "mean_s": statistics.fmean([t["router_stall"]["mean_s"] for t in trials
                                            if t["router_stall"]["mean_s"] is not None] or [0.0]),
            },
            "allowed_silence_s": [t["allowed_silence_s"] for t in trials],
            "migrations_by_reason": {},
        }
        for t in trials:
            for reason, n in t["migrations"].items():
                s["migrations_by_reason"][reason] = s["migrations_by_reason"].get(reason, 0) + n
        summary[kind] = s
        cs, rb = s["client_stall"], s["reprefill_batch"]
        rows.append([kind, str(len(trials)), str(len(moved)), str(s["streams_failed"]), fmt(cs["p50_ms"], ".0f"),
                     fmt(cs["p99_ms"], ".0f"), fmt(cs["max_ms"], ".0f"), fmt(rb["p50_ms"], ".0f"),
                     fmt(rb["p99_ms"], ".0f"), fmt(s["stall_minus_batch_reprefill"]["p99_ms"], ".0f"),
                     fmt(s["router_stall_metric"]["mean_s"] * 1000, ".0f"),
                     fmt(s["router_stall_metric"]["p99_le_s"], ".3g"),
                     fmt(s["unaffected_max_gap"]["p99_ms"], ".0f")])
    res.data["summary"] = summary
    table(f"bench migration: {cfg.streams} streams over 3 workers, one worker fails "
          f"{cfg.fault_after_s:.1f}s in (stalls in ms)",
          ["fault", "trials", "migrated", "failed", "p50 stall", "p99 stall", "max stall", "p50 re-prefill",
           "p99 re-prefill", "p99 stall-reprefill", "router mean", "router p99 ≤ s", "p99 gap unaffected"], rows)


def _plot(res: Results) -> None:
    from fleetward.chaos.bench import _plots

    series = {}
    for kind in ("kill", "hang"):
        stalls = sorted(m["stall_s"] * 1000 for t in res.data["trials"] if t["kind"] == kind for m in t["moved"])
        if stalls:
            series[f"{kind}: stall"] = [((i + 1) / len(stalls), v) for i, v in enumerate(stalls)]
        re = sorted(m["reprefill_batch_s"] * 1000 for t in res.data["trials"] if t["kind"] == kind
                    for m in t["moved"])
        if re and kind == "kill":
            series["re-prefill (batch)"] = [((i + 1) / len(re), v) for i, v in enumerate(re)]
    base = sorted(g * 1000 for t in res.data["trials"] for g in t["unaffected_max_gaps_s"])
    if base:
        series["largest gap, streams not migrated"] = [((i + 1) / len(base), v) for i, v in enumerate(base)]
    _plots.cdf(res.plot_path("stall-cdf"), title="Client-visible stall at migration (CDF over migrated streams)",
               series=series, xlabel="ms", vline=300.0)
