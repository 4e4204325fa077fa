"""``fleetward bench detect``, part **soak**: false positives of the supervisor under load, no fault injected.

Three simulated workers, one router, a controller with default settings. First the fleet's
capacity for a mix of short and long prompts is measured: closed loop with many more streams than the
workers hold (their KV caches fill, the rest queues), and capacity is the completed requests per
second. Then Poisson arrivals at ``load`` x capacity (default 0.9) for ``soak_s`` seconds. Every
``hang.detected``, non-ready ``health.changed``, ``restart``, ``quarantine`` and router migration in
either phase is a false positive: no fault is injected.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
import uuid
from collections.abc import Sequence
from typing import Any

import httpx

from fleetward.chaos.bench._common import Infra, Results, console, fmt, run_client, scrape, table, wait_idle
from fleetward.chaos.bench._detect import ADMIN_TOKEN, SIM, DetectBench, Events, lead_controller, stats_ms
from fleetward.chaos.harness import TestFleet
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.bus import Event
from fleetward.fleet.config import RouterConfig, SupervisorConfig

__all__ = ["plot", "run", "section", "summarize"]

# The request mix: prompt and output lengths in tokens (the sim's context is 4096).
MIX: tuple[dict[str, Any], ...] = (
    {"name": "short", "weight": 0.50, "prompt": [32, 256], "max_tokens": [64, 256]},
    {"name": "long", "weight": 0.35, "prompt": [512, 1536], "max_tokens": [64, 256]},
    {"name": "near-context", "weight": 0.15, "prompt": [2048, 3584], "max_tokens": [16, 256]},
)
FALSE_POSITIVE_KINDS = ("hang.detected", "restart", "quarantine")


def section() -> dict[str, Any]:
    return {}


async def _openloop(spec: dict[str, Any], *, lead_s: float = 1.0) -> dict[str, Any]:
    """Run ``_openloop`` (its own process) on ``spec``; its result."""
    return await run_client("fleetward.chaos.bench._openloop", {**spec, "start_at": time.monotonic() + lead_s},
                            "the open-loop client")


async def _sample_workers(fleet: TestFleet, samples: list[dict[str, Any]], t_start: float,
                          interval: float = 5.0) -> None:
    while True:
        await asyncio.sleep(interval)
        row: dict[str, Any] = {"t": time.monotonic() - t_start, "load_avg_1m": os.getloadavg()[0], "workers": {}}
        for wid in fleet.worker_ids:
            with contextlib.suppress(httpx.HTTPError, KeyError):
                st = await fleet.state(wid)
                row["workers"][wid] = {k: st.get(k) for k in ("running", "waiting", "kv_usage")}
        samples.append(row)


def _false_positives(events: list[tuple[float, Event]], workers: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {k: 0 for k in FALSE_POSITIVE_KINDS}
    out["health_changed"] = {}
    detail = []
    for t, e in events:
        if e.worker not in workers:
            continue
        if e.kind in FALSE_POSITIVE_KINDS:
            out[e.kind] += 1
            detail.append({"t": t, "kind": e.kind, "worker": e.worker, **e.data})
        elif e.kind == "health.changed":
            st = str(e.data.get("state"))
            out["health_changed"][st] = out["health_changed"].get(st, 0) + 1
            detail.append({"t": t, "kind": e.kind, "worker": e.worker, **e.data})
    out["events"] = detail
    return out


def _migrations(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k.split('reason="', 1)[1].rstrip('"}'): v - before.get(k, 0.0) for k, v in after.items()
            if k.startswith("fleetward_router_migrations_total{") and v - before.get(k, 0.0) > 0}


def _load_summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    kv = [w["kv_usage"] for s in samples for w in s["workers"].values() if w.get("kv_usage") is not None]
    running = [sum(w.get("running") or 0 for w in s["workers"].values()) for s in samples]
    waiting = [sum(w.get("waiting") or 0 for w in s["workers"].values()) for s in samples]
    return {"samples": len(samples),
            "kv_usage_mean": statistics.fmean(kv) if kv else None, "kv_usage_max": max(kv) if kv else None,
            "running_mean": statistics.fmean(running) if running else None,
            "waiting_mean": statistics.fmean(waiting) if waiting else None,
            "waiting_max": max(waiting) if waiting else None,
            "share_of_samples_with_queue": (sum(1 for w in waiting if w > 0) / len(waiting)) if waiting else None,
            "load_avg_1m": [s["load_avg_1m"] for s in samples]}


def _ttft(result: dict[str, Any]) -> dict[str, Any]:
    ttft = [x / 1e6 for x in result["ttft_us"]]
    gaps = [x / 1e6 for x in result["max_gap_us"]]
    return {"ttft": stats_ms(ttft), "max_gap_per_request": stats_ms(gaps)}


async def run(cfg: DetectBench, infra: Infra, res: Results) -> None:
    assert infra.etcd and infra.mqtt
    run_dir = cfg.out / "run-soak"
    cluster = f"bench-detect-soak-{uuid.uuid4().hex[:6]}"
    sup = SupervisorConfig()
    console.print("soak: starting 3 simulated workers, a router and a controller process (default settings)…")
    fleet = TestFleet(etcd=infra.etcd, mqtt=infra.mqtt, cluster=cluster, run_dir=run_dir, workers=3,
                      backend=SimBackend(SIM), routing=RouterConfig(), supervisor=sup, controller=False,
                      admin_token=ADMIN_TOKEN)
    data: dict[str, Any] = res.data["soak"]
    data["mix"] = list(MIX)
    events: Events | None = None
    async with fleet:
        try:
            ctl_url = (await lead_controller(fleet)).url
            events = Events(fleet.bus)
            await events.subscribed.wait()
            await fleet.wait_healthy(timeout=90)
            router = await fleet.start_router("bench-soak")
            body = {"model": SIM.model_name, "ignore_eos": True, "return_token_ids": True, "temperature": 0}
            workers = fleet.worker_ids
            # Capacity: saturated closed loop with the same mix.
            console.print(f"  capacity: {cfg.calib_streams} closed-loop streams, {cfg.calib_warmup_s:.0f}s warm-up + "
                          f"{cfg.calib_s:.0f}s measured…")
            m0, c0 = time.monotonic(), await scrape(router.url + "/metrics")
            samples: list[dict[str, Any]] = []
            sampler = asyncio.create_task(_sample_workers(fleet, samples, m0, interval=2.0))
            calib = await _openloop({"urls": [router.url], "body": body, "mix": list(MIX),
                                     "streams": cfg.calib_streams, "warmup_s": cfg.calib_warmup_s,
                                     "duration_s": cfg.calib_s, "drain_s": 5.0, "seed": 1})
            sampler.cancel()
            m1, c1 = time.monotonic(), await scrape(router.url + "/metrics")
            capacity = calib["completed_in_window"] / cfg.calib_s
            data["capacity"] = {"streams": cfg.calib_streams, "window_s": cfg.calib_s,
                                "requests_per_s": capacity, "tokens_per_s": calib["tokens_in_window"] / cfg.calib_s,
                                "requests_failed": calib["requests_failed"], "errors": calib["errors"],
                                "client_cpu_cores": calib["client_cpu_cores"], **_ttft(calib),
                                "load": _load_summary(samples),
                                "false_positives": _false_positives(events.since(m0, m1), workers),
                                "migrations": _migrations(c0, c1)}
            console.print(f"  capacity {capacity:.1f} requests/s ({calib['tokens_in_window'] / cfg.calib_s:.0f} "
                          "tokens/s)")
            await fleet.wait_healthy(timeout=90)
            await wait_idle(fleet, timeout=30.0, interval=0.2)
            rate = cfg.load * capacity
            console.print(f"  soak: Poisson arrivals at {rate:.1f}/s ({cfg.load:.0%} of capacity) for "
                          f"{cfg.soak_s:.0f}s…")
            ctl_before = await scrape(ctl_url + "/metrics")
            s0, r0 = time.monotonic(), await scrape(router.url + "/metrics")
            samples = []
            sampler = asyncio.create_task(_sample_workers(fleet, samples, s0))
            soak = await _openloop({"urls": [router.url], "body": body, "mix": list(MIX), "rate": rate,
                                    "warmup_s": 0.0, "duration_s": cfg.soak_s, "drain_s": 60.0, "seed": 2})
            sampler.cancel()
            s1, r1 = time.monotonic(), await scrape(router.url + "/metrics")
            ctl_after = await scrape(ctl_url + "/metrics")
            await asyncio.sleep(1.0)  # events published at the very end
            canaries = {k.split('result="', 1)[1].rstrip('"}'): v - ctl_before.get(k, 0.0) for k, v in ctl_after.items()
                        if k.startswith("fleetward_supervisor_canaries_total{")}
            signals = {k[len("fleetward_supervisor_signals_total"):]: v - ctl_before.get(k, 0.0)
                       for k, v in ctl_after.items()
                       if k.startswith("fleetward_supervisor_signals_total{") and v - ctl_before.get(k, 0.0) > 0}
            data["soak"] = {"started_mono": s0, "rate_per_s": rate, "load": cfg.load, "duration_s": cfg.soak_s,
                            "sent": soak["sent"],
                            "requests_ok": soak["requests_ok"], "requests_failed": soak["requests_failed"],
                            "errors": soak["errors"], "completed_per_s": soak["completed_in_window"] / cfg.soak_s,
                            "tokens_per_s": soak["tokens_in_window"] / cfg.soak_s,
                            "client_cpu_cores": soak["client_cpu_cores"], **_ttft(soak),
                            "load_samples": samples, "load_summary": _load_summary(samples),
                            "false_positives": _false_positives(events.since(s0, s1 + 1.0), workers),
                            "migrations": _migrations(r0, r1), "canaries": canaries, "signals": signals}
        finally:
            if events is not None:
                await events.aclose()


def summarize(res: Results) -> None:
    data = res.data["soak"]
    rows = []
    for phase in ("capacity", "soak"):
        d = data.get(phase)
        if not d:
            continue
        fp = d["false_positives"]
        bad = {k: v for k, v in fp["health_changed"].items() if k != "ready"}
        load = d.get("load_summary") or d.get("load") or {}
        rate = d.get("rate_per_s") or d.get("requests_per_s")
        rows.append([phase, fmt(rate, ".1f"), fmt(d.get("completed_per_s", d.get("requests_per_s")), ".1f"),
                     fmt(d["tokens_per_s"], ".0f"), fmt(d["ttft"]["p50_ms"], ".0f"), fmt(d["ttft"]["p99_ms"], ".0f"),
                     fmt(load.get("kv_usage_mean"), ".2f"), fmt(load.get("waiting_mean"), ".1f"),
                     str(fp["hang.detected"]), str(sum(bad.values())), str(fp["restart"]),
                     str(int(sum(d["migrations"].values()))), str(d["requests_failed"])])
    table("bench detect: false positives (no fault injected)",
          ["phase", "offered/s", "done/s", "tok/s", "p50 TTFT", "p99 TTFT", "kv mean", "waiting", "hang.detected",
           "not ready", "restarts", "migrations", "failed"], rows)


def plot(res: Results) -> None:
    soak = res.data["soak"].get("soak")
    if not soak or not soak["load_samples"]:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = soak["load_samples"]
    ts = [x["t"] for x in s]
    fig, ax = plt.subplots(figsize=(9, 4.0), dpi=110)
    kv = [statistics.fmean([w["kv_usage"] for w in x["workers"].values() if w.get("kv_usage") is not None] or [0])
          for x in s]
    ax.plot(ts, kv, label="KV cache usage (mean of workers)", color="#4c72b0")
    ax2 = ax.twinx()
    ax2.plot(ts, [sum(w.get("running") or 0 for w in x["workers"].values()) for x in s], color="#55a868",
             label="running sequences (fleet)")
    ax2.plot(ts, [sum(w.get("waiting") or 0 for w in x["workers"].values()) for x in s], color="#dd8452",
             label="waiting requests (fleet)")
    fps = [e for e in soak["false_positives"]["events"] if e["kind"] in FALSE_POSITIVE_KINDS
           or e.get("state") not in ("ready", None)]
    for e in fps:
        ax.axvline(e["t"] - soak["started_mono"], color="#c44e52", linewidth=0.8)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("s into the soak")
    ax.set_ylabel("KV usage")
    ax2.set_ylabel("sequences")
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
    ax.legend(lines, labels, fontsize=8, loc="lower right")
    ax.set_title(f"Soak at {soak['load']:.0%} of capacity: load over time "
                 f"({len(fps)} false positive(s) marked in red)", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(res.plot_path("soak"))
    plt.close(fig)
