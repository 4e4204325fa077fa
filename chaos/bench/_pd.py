"""``fleetward bench pd``: prefill/decode against aggregated serving, and what each KV recovery policy costs.

Two fleets of four simulated workers on the same etcd and broker: one aggregated, one split into two prefill
and two decode workers whose KV moves over the wire (docs/pd.md; the link's cost model is the bench's
``SIM``). The same closed-loop streaming load, at a few input/output length mixes, goes to one fleet's router
then the other's, in rotating order, ``rounds`` times. Reported per mix: TTFT and ITL percentiles of each,
and P/D ÷ aggregated in the same round.

Then the recovery policies, at the mix with the longest prompts: on the P/D fleet, every KV transfer
corrupted on the wire (both prefill workers), one router per ``routing.kv_failure_policy``; each against the
same fleet without the fault, in the same round. Reported: TTFT and tokens/s of each ÷ the fault-free P/D
run, and that every request succeeded.
"""

from __future__ import annotations

import statistics
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
    progress,
    ratio,
    require_extras,
    summarize,
    table,
    wait_idle,
)
from fleetward.chaos.harness import TestFleet
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.config import RouterConfig, SimConfig

__all__ = ["PdBench", "run_pd_bench"]

# A small GPU model's shape (sim defaults) with a KV link of 1 KiB per token over 10 Gbit/s.
SIM = SimConfig(seed=21, kv_bytes_per_token=1024, kv_bandwidth_gbps=10.0, kv_latency_ms=0.5, max_model_len=8192)
POLICIES = ("retry", "recompute", "aggregated")


@dataclass(frozen=True)
class PdBench:
    out: Path
    mixes: tuple[tuple[int, int], ...] = ((128, 128), (2048, 64), (256, 256))  # (input tokens, output tokens)
    streams: int = 16
    rounds: int = 2
    warmup_s: float = 2.0
    duration_s: float = 8.0
    policies: bool = True
    plots: bool = True
    etcd: str | None = None
    mqtt: str | None = None


def _metric(run: dict[str, Any], name: str) -> float | None:
    """``tokens_per_s``, or ``<ttft|itl>_<p50|p99>_ms`` of one run."""
    if name == "tokens_per_s":
        return float(run["tokens_per_s"])
    family, _, rest = name.partition("_")
    value = run[family][rest]
    return None if value is None else float(value)


def _policy_mix(cfg: PdBench) -> tuple[int, int]:
    """The policies run on the longest prompts: where recomputing on a decode worker costs its batch most."""
    return max(cfg.mixes, key=lambda m: m[0])


def _med(values: list[float | None]) -> float | None:
    vs = [v for v in values if v is not None]
    return statistics.median(vs) if vs else None


async def _run(router: str, cfg: PdBench, mix: tuple[int, int], seed: int) -> dict[str, Any]:
    body = {"model": SIM.model_name, "max_tokens": mix[1], "ignore_eos": True, "return_token_ids": True,
            "temperature": 0}
    r = await client_load({"urls": [router], "body": body, "prompt_len": mix[0], "streams": cfg.streams,
                           "warmup_s": cfg.warmup_s, "duration_s": cfg.duration_s, "seed": seed, "cpu_pids": {}})
    return {"tokens_per_s": r["tokens"] / r["window_s"], "requests_ok": r["requests_ok"],
            "requests_failed": r["requests_failed"], "errors": r["errors"], "ttft": summarize(r["ttft_us"]),
            "itl": summarize(r["gaps_us"])}


async def run_pd_bench(cfg: PdBench) -> Results:
    require_extras(plots=cfg.plots)
    res = Results("pd", cfg.out, {"config": {**cfg.__dict__, "out": str(cfg.out)}, "sim": SIM.model_dump(),
                                  "runs": [], "policy_runs": []})
    run_dir = cfg.out / "run-pd"
    async with Infra(run_dir, cfg.etcd, cfg.mqtt).up() as infra:
        assert infra.etcd and infra.mqtt
        tag = uuid.uuid4().hex[:6]
        console.print("starting two fleets of 4 simulated workers: aggregated, and 2 prefill + 2 decode…")
        async with TestFleet(etcd=infra.etcd, mqtt=infra.mqtt, cluster=f"bench-agg-{tag}", run_dir=run_dir / "agg",
                             workers=4, backend=SimBackend(SIM), routing=RouterConfig()) as agg, \
                TestFleet(etcd=infra.etcd, mqtt=infra.mqtt, cluster=f"bench-pd-{tag}", run_dir=run_dir / "pd",
                          workers=4, prefill_workers=2, backend=SimBackend(SIM), routing=RouterConfig()) as pd:
            await agg.wait_workers_routable(4)
            await pd.wait_workers_routable(4)
            routers = {"aggregated": (await agg.start_router("bench-agg")).url,
                       "pd": (await pd.start_router("bench-pd")).url}
            fleets = {"aggregated": agg, "pd": pd}
            policy_routers = {p: (await pd.start_router(f"bench-pd-{p}", kv_failure_policy=p)).url
                              for p in POLICIES} if cfg.policies else {}
            steps = len(cfg.mixes) * cfg.rounds * 2 + (cfg.rounds * (1 + len(POLICIES)) if cfg.policies else 0)
            with progress() as bar:
                task = bar.add_task("pd bench", total=steps)
                for mix in cfg.mixes:
                    for rnd in range(cfg.rounds):
                        for case in ("aggregated", "pd") if rnd % 2 == 0 else ("pd", "aggregated"):
                            bar.update(task, description=f"in {mix[0]}, out {mix[1]}: round {rnd + 1}: {case}")
                            await wait_idle(fleets[case])
                            run = await _run(routers[case], cfg, mix, rnd)
                            res.data["runs"].append({"mix": list(mix), "round": rnd, "case": case, **run})
                            bar.advance(task)
                if cfg.policies:
                    mix = _policy_mix(cfg)
                    prefill = pd.worker_ids[:2]
                    for rnd in range(cfg.rounds):
                        bar.update(task, description=f"policies, round {rnd + 1}: no fault")
                        await wait_idle(pd)
                        run = await _run(routers["pd"], cfg, mix, rnd)
                        res.data["policy_runs"].append({"round": rnd, "case": "no fault", **run})
                        bar.advance(task)
                        for w in prefill:
                            await pd.fault(w, kv={"add": {"id": "bench", "kind": "corrupt"}})
                        try:
                            for policy in POLICIES:
                                bar.update(task, description=f"policies, round {rnd + 1}: every KV corrupted, "
                                                             f"{policy}")
                                await wait_idle(pd)
                                run = await _run(policy_routers[policy], cfg, mix, rnd)
                                res.data["policy_runs"].append({"round": rnd, "case": policy, **run})
                                bar.advance(task)
                        finally:
                            for w in prefill:
                                await pd.fault(w, kv={"clear": True})
    _summarize(res, cfg)
    res.write()
    if cfg.plots:
        _plot(res, cfg)
    return res


def _summarize(res: Results, cfg: PdBench) -> None:
    runs = res.data["runs"]
    summary: dict[str, Any] = {}
    rows = []
    for mix in cfg.mixes:
        key = f"{mix[0]}/{mix[1]}"
        per: dict[str, Any] = {}
        for case in ("aggregated", "pd"):
            mine = [r for r in runs if tuple(r["mix"]) == mix and r["case"] == case]
            per[case] = {"ttft_p50_ms": _med([r["ttft"]["p50_ms"] for r in mine]),
                         "ttft_p99_ms": _med([r["ttft"]["p99_ms"] for r in mine]),
                         "itl_p50_ms": _med([r["itl"]["p50_ms"] for r in mine]),
                         "itl_p99_ms": _med([r["itl"]["p99_ms"] for r in mine]),
                         "tokens_per_s": _med([r["tokens_per_s"] for r in mine]),
                         "failed": sum(r["requests_failed"] for r in mine)}
        for metric in ("ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms", "tokens_per_s"):
            pairs = []
            for rnd in range(cfg.rounds):
                same = {r["case"]: r for r in runs if tuple(r["mix"]) == mix and r["round"] == rnd}
                a, p = same.get("aggregated"), same.get("pd")
                if a and p:
                    pairs.append(ratio(_metric(p, metric), _metric(a, metric)))
            per[f"x_{metric}"] = _med(pairs)
        summary[key] = per
        for case in ("aggregated", "pd"):
            s = per[case]
            rows.append([key, case, fmt(s["ttft_p50_ms"], ".1f"), fmt(s["ttft_p99_ms"], ".1f"),
                         fmt(s["itl_p50_ms"], ".1f"), fmt(s["itl_p99_ms"], ".1f"), fmt(s["tokens_per_s"], ".0f"),
                         str(s["failed"]),
                         *([fmt(per["x_ttft_p99_ms"], ".2f"), fmt(per["x_itl_p99_ms"], ".2f"),
                            fmt(per["x_tokens_per_s"], ".2f")] if case == "pd" else ["1", "1", "1"])])
    res.data["summary"] = summary
    table(f"bench pd: {cfg.streams} closed-loop streams, medians of {cfg.rounds} interleaved round(s); "
          "x = P/D ÷ aggregated in the same round",
          ["in/out", "serving", "p50 TTFT ms", "p99 TTFT ms", "p50 ITL ms", "p99 ITL ms", "tok/s", "failed",
           "x p99 TTFT", "x p99 ITL", "x tok/s"], rows)
    if not res.data["policy_runs"]:
        return
    pruns = res.data["policy_runs"]
    psum: dict[str, Any] = {}
    prow = []
    for case in ("no fault", *POLICIES):
        mine = [r for r in pruns if r["case"] == case]
        base = {r["round"]: r for r in pruns if r["case"] == "no fault"}
        s = {"ttft_p50_ms": _med([r["ttft"]["p50_ms"] for r in mine]),
             "ttft_p99_ms": _med([r["ttft"]["p99_ms"] for r in mine]),
             "itl_p99_ms": _med([r["itl"]["p99_ms"] for r in mine]),
             "tokens_per_s": _med([r["tokens_per_s"] for r in mine]),
             "x_ttft_p50": _med([ratio(r["ttft"]["p50_ms"], base[r["round"]]["ttft"]["p50_ms"]) for r in mine]),
             "x_tokens_per_s": _med([ratio(r["tokens_per_s"], base[r["round"]]["tokens_per_s"]) for r in mine]),
             "ok": sum(r["requests_ok"] for r in mine), "failed": sum(r["requests_failed"] for r in mine)}
        psum[case] = s
        prow.append([case, fmt(s["ttft_p50_ms"], ".1f"), fmt(s["ttft_p99_ms"], ".1f"), fmt(s["itl_p99_ms"], ".1f"),
                     fmt(s["tokens_per_s"], ".0f"), fmt(s["x_ttft_p50"], ".2f"), fmt(s["x_tokens_per_s"], ".2f"),
                     str(s["ok"]), str(s["failed"])])
    res.data["policy_summary"] = psum
    mix = _policy_mix(cfg)
    table(f"bench pd, recovery policies: in {mix[0]}/out {mix[1]}, every KV transfer corrupted on the wire; "
          "x = ÷ the fault-free P/D run of the same round",
          ["kv_failure_policy", "p50 TTFT ms", "p99 TTFT ms", "p99 ITL ms", "tok/s", "x p50 TTFT", "x tok/s",
           "requests ok", "failed"], prow)


def _plot(res: Results, cfg: PdBench) -> None:
    from fleetward.chaos.bench import _plots

    s = res.data["summary"]
    groups = [f"in {m[0]} / out {m[1]}" for m in cfg.mixes]
    for metric, label in (("ttft_p99_ms", "p99 TTFT (ms)"), ("itl_p99_ms", "p99 ITL (ms)")):
        _plots.grouped_bars(res.plot_path(metric.split("_")[0]), title=f"{label}: aggregated vs prefill/decode "
                            f"({cfg.streams} streams, 4 workers each)", groups=groups,
                            series={case: [s[f"{m[0]}/{m[1]}"][case][metric] for m in cfg.mixes]
                                    for case in ("aggregated", "pd")}, ylabel=label, fmt="{:.0f}")
    if res.data.get("policy_summary"):
        p = res.data["policy_summary"]
        cases = ["no fault", *POLICIES]
        _plots.grouped_bars(res.plot_path("policies"), title="Every KV transfer corrupted: TTFT per recovery policy",
                            groups=cases, series={"p50 TTFT": [p[c]["ttft_p50_ms"] for c in cases],
                                                  "p99 TTFT": [p[c]["ttft_p99_ms"] for c in cases]},
                            ylabel="ms", fmt="{:.0f}")
