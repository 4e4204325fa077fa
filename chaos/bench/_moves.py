"""``fleetward bench moves``: the stall of a planned move that carries its KV, against computing it again.

A planned move (a drain, a scale-down, ``fleetward move``, a rebalance) stops a stream on a healthy worker;
with ``routing.moves.kv`` (as shipped) that worker hands over the KV of the prompt and the emitted tokens and
the destination continues from it, without it (``moves.kv: false``) the destination computes all of it again,
as after a crash (:mod:`fleetward.migration.moves`, docs/pd.md).

Two simulated workers (the cost model is the bench's ``SIM``), a controller, and two routers on them: ``kv``
(as shipped) and ``reprefill`` (``moves.kv: false``). For each context length, one router then the other (the
order alternates per context), ``streams`` streams start together, each a prompt of its own of that many
tokens; once every one has ``move_after`` tokens, an operator's move of each is ordered
(``POST /v1/moves``). Each stream asks for the router's trace (``X-Fleetward-Trace: 1``), so the client knows
the worker of every chunk: a stream's stall is the time from its last token on the worker it left to its first
on the next, as the client saw them.

Reported per context and mode: stall p50/p99/mean, the KV bytes the kv router carried, moves that fell back to
computing the stream again (the kv router's ``fleetward_router_moves_total{trigger="operator",
outcome="reprefill"}``), and whether every stream is the model's own continuation: the simulated worker
generates from the KV it loaded, so a wrong byte gives wrong tokens, and a wrong stream is reported as such
(``fleetward bench moves`` then exits 1).

What a KV move's stall is made of here: two engine steps (the hand-over on the worker it leaves, the first token
on the next), the link's time as the sender paces it, and the simulated workers' own Python work on the prompt
and the bytes (about 0.2 s at 32k tokens on a 2-core host with an infinitely fast link), which real workers do
not pay. ``--vllm`` adds the same on real vLLM (:mod:`._moves_vllm`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from fleetward.chaos.bench._common import (
    Infra,
    Results,
    console,
    fmt,
    progress,
    quantile,
    ratio,
    require_extras,
    scrape,
    table,
    wait_idle,
)
from fleetward.chaos.harness import TestFleet
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.config import MovesConfig, RouterConfig, SimConfig
from fleetward.fleet.sse import sse_lines
from fleetward.sim.model import SimModel
from fleetward.sim.tokenizer import BYTE_OFFSET

__all__ = ["MODES", "ROUTING", "MovesBench", "Stream", "run_context", "run_moves_bench", "stall_stats"]

# An 8B model on one GPU: a prompt token costs 0.05 ms of prefill (~20k tokens/s, the sim's default, so a
# 32k-token context costs 1.6 s to compute again), decode steps of 20 ms. Its KV is 128 KiB per token
# (Llama-3-8B in bf16: 32 layers x 8 KV heads x 128 x K,V x 2 bytes) over a 100 Gbit/s link: 10.5 us per
# token, a fifth of its prefill. Bytes and bandwidth are both scaled down KV_SCALE times (64 B per token at
# 100/2048 Gbit/s), which keeps that time per token while the simulated workers make, frame, check and send
# the bytes in Python (at 256 B per token that work added ~0.3 s to a 32k-token move, as much as the link).
# The lengths (max_model_len, the KV cache, the KV timeout) are sized per run for its contexts: ``_sim``.
KV_SCALE = 2048
SIM = SimConfig(seed=31, prefill_ms_per_token=0.05, decode_step_ms=20.0, kv_bytes_per_token=128 * 1024 // KV_SCALE,
                kv_bandwidth_gbps=100 / KV_SCALE, kv_latency_ms=0.5)
MODES = ("kv", "reprefill")
ROUTING = RouterConfig(affinity_tokens=0)  # least loaded: the streams split evenly over the two workers
_LABELS = re.compile(r'(\w+)="([^"]*)"')


@dataclass(frozen=True)
class MovesBench:
    out: Path
    contexts: tuple[int, ...] = (1024, 8192, 32768)  # prompt tokens of each stream
    streams: int = 6  # per context and mode, started together
    max_tokens: int = 48
    move_after: int = 8  # tokens every stream has before the moves are ordered
    vllm: bool = False
    plots: bool = True
    etcd: str | None = None
    mqtt: str | None = None


def _sim(cfg: MovesBench) -> SimConfig:
    """``SIM`` with room for every stream of the longest context on one worker (twice over: the worker a
    stream leaves holds its KV while handing it over), and a KV timeout well above its transfer."""
    longest = max(cfg.contexts) + cfg.max_tokens
    model_len = -(-longest // 1024) * 1024
    wire_s = longest * SIM.kv_bytes_per_token / (SIM.kv_bandwidth_gbps * 1.25e8)
    return SimConfig.model_validate({**SIM.model_dump(), "max_model_len": model_len,
                                     "kv_capacity_tokens": 2 * (cfg.streams + 1) * model_len,
                                     "kv_timeout_s": max(SIM.kv_timeout_s, round(4 * wire_s + 2.0, 1))})


def _prompt(context: int, mode: str, index: int) -> list[int]:
    """A prompt of its own (printable bytes at random), the same in every run of the bench. Each mode has its
    own: a worker keeps a stopped stream's KV for ``kv_lease_s``, and a move of the same prompt in the other
    mode could find it there and would not compute it again."""
    rng = random.Random(f"moves-{context}-{mode}-{index}")
    return [BYTE_OFFSET + 32 + i for i in rng.choices(range(95), k=context)]


@dataclass
class Stream:
    """One stream as its client read it: its chunks with the client's arrival time and the worker."""

    prompt: list[int]
    rid: str = ""
    tokens: list[int] = field(default_factory=list)
    chunks: list[tuple[float, str]] = field(default_factory=list)  # (monotonic arrival, worker), one per token
    error: str | None = None
    move_status: int | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # move_after tokens, or ended

    def switches(self) -> list[dict[str, Any]]:
        """Every change of worker: from, to, tokens before it, and the stall (last token there, first here)."""
        out = []
        for i in range(1, len(self.chunks)):
            (t0, w0), (t1, w1) = self.chunks[i - 1], self.chunks[i]
            if w1 != w0:
                out.append({"from": w0, "to": w1, "tokens_before": i, "stall_s": t1 - t0})
        return out


async def _read(client: httpx.AsyncClient, url: str, s: Stream, cfg: MovesBench, model: str) -> None:
    body = {"model": model, "prompt": s.prompt, "max_tokens": cfg.max_tokens, "stream": True,
            "return_token_ids": True, "ignore_eos": True, "temperature": 0}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 headers={"X-Fleetward-Trace": "1"}) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {(await r.aread())[:500]!r}"
                return
            s.rid = r.headers.get("x-request-id", "")
            async for line in sse_lines(r.aiter_bytes()):
                if not line.startswith("data: {"):
                    continue
                now = time.monotonic()
                data = orjson.loads(line[6:])
                if "error" in data:
                    s.error = str(data["error"].get("message"))
                    continue
                worker = str((data.get("fleetward") or {}).get("worker"))
                for c in data.get("choices") or []:
                    ids = c.get("token_ids") or []
                    s.tokens += ids
                    s.chunks += [(now, worker)] * len(ids)
                if len(s.tokens) >= cfg.move_after:
                    s.ready.set()
    except httpx.HTTPError as exc:
        s.error = f"{type(exc).__name__}: {exc}"
    finally:
        s.ready.set()


def _counters(page: dict[str, float], name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of one metric from :func:`scrape`'s page, by their labels."""
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for key, value in page.items():
        metric, _, labels = key.partition("{")
        if metric == name:
            out[tuple(sorted(_LABELS.findall(labels)))] = value
    return out


def _delta(before: dict[str, float], after: dict[str, float], name: str, **labels: str) -> float:
    """How much a counter (summed over the samples with ``labels``) grew between two scrapes."""
    want = set(labels.items())
    a, b = _counters(after, name), _counters(before, name)
    return sum(v - b.get(k, 0.0) for k, v in a.items() if want <= set(k))


async def _sim_exact(prompt: list[int], tokens: list[int], n: int) -> bool:
    return tokens == SimModel(seed=SIM.seed, eos_probability=SIM.eos_probability).continuation(prompt, n,
                                                                                           ignore_eos=True)


async def run_context(fleet: TestFleet, url: str, cfg: MovesBench, context: int, mode: str, *,
                      model: str = SIM.model_name,
                      exact: Callable[[list[int], list[int], int], Awaitable[bool]] = _sim_exact,
                      deadline: float | None = None, simulated: bool = True) -> dict[str, Any]:
    """One context through one router: the streams, their moves, what the router counted. ``exact``: whether
    a stream's tokens are its prompt's uninterrupted continuation."""
    if simulated:
        await wait_idle(fleet)
    before = await scrape(url + "/metrics")
    streams = [Stream(_prompt(context, mode, i)) for i in range(cfg.streams)]
    ordered_at = None
    # Longer than the slowest case could take: every prompt computed on one worker, twice.
    deadline = deadline or 60.0 + 2 * cfg.streams * (context + cfg.max_tokens) * SIM.prefill_ms_per_token / 1000
    async with httpx.AsyncClient(timeout=httpx.Timeout(deadline), trust_env=False,
                                 limits=httpx.Limits(max_connections=cfg.streams + 4)) as client, \
            asyncio.timeout(deadline):
        async with asyncio.TaskGroup() as tg:
            for s in streams:
                tg.create_task(_read(client, url, s, cfg, model))
            for s in streams:
                await s.ready.wait()
            ordered_at = time.monotonic()
            for s in streams:
                if s.rid and s.error is None and len(s.tokens) < cfg.max_tokens:
                    s.move_status = (await fleet.supervisor_post("/v1/moves", {"request": s.rid})).status_code
    after = await scrape(url + "/metrics")
    records = []
    for i, s in enumerate(streams):
        sw = s.switches()
        same = s.error is None and await exact(s.prompt, s.tokens, cfg.max_tokens)
        records.append({"stream": i, "request": s.rid, "tokens": len(s.tokens), "exact": same, "error": s.error,
                        "move_status": s.move_status, "switches": sw,
                        "stall_ms": sw[0]["stall_s"] * 1000 if sw else None,
                        "tokens_at_order": sum(1 for t, _ in s.chunks if ordered_at is not None and t <= ordered_at)})
    count = _delta(before, after, "fleetward_router_move_stall_seconds_count")
    total = _delta(before, after, "fleetward_router_move_stall_seconds_sum")
    return {"context": context, "mode": mode, "streams": records,
            "outcomes": {o: _delta(before, after, "fleetward_router_moves_total", trigger="operator", outcome=o)
                         for o in ("kv", "reprefill", "failed")},
            "kv_bytes": _delta(before, after, "fleetward_router_move_kv_bytes_total"),
            "kv_tokens": _delta(before, after, "fleetward_router_move_kv_tokens_total"),
            "router_stall_mean_ms": total / count * 1000 if count else None,
            "other_migrations": _delta(before, after, "fleetward_router_migrations_total")
            - _delta(before, after, "fleetward_router_migrations_total", reason="move")}


async def run_moves_bench(cfg: MovesBench) -> Results:
    require_extras(plots=cfg.plots)
    sim = _sim(cfg)
    res = Results("moves", cfg.out, {"config": {**cfg.__dict__, "out": str(cfg.out)}, "sim": sim.model_dump(),
                                     "routing": ROUTING.model_dump(), "runs": []})
    run_dir = cfg.out / "run-moves"
    async with Infra(run_dir, cfg.etcd, cfg.mqtt).up() as infra:
        assert infra.etcd and infra.mqtt
        console.print("starting 2 simulated workers, a controller and two routers (kv, reprefill)…")
        async with TestFleet(etcd=infra.etcd, mqtt=infra.mqtt, cluster=f"bench-moves-{uuid.uuid4().hex[:6]}",
                             run_dir=run_dir, workers=2, backend=SimBackend(sim), routing=ROUTING) as fleet:
            await fleet.wait_workers_routable(2)
            urls = {"kv": (await fleet.start_router("bench-kv")).url,
                    "reprefill": (await fleet.start_router("bench-reprefill", moves=MovesConfig(kv=False))).url}
            with progress() as bar:
                task = bar.add_task("moves bench", total=len(cfg.contexts) * len(MODES))
                for n, context in enumerate(cfg.contexts):
                    for mode in MODES if n % 2 == 0 else MODES[::-1]:
                        bar.update(task, description=f"{context} tokens: {mode}")
                        res.data["runs"].append(await run_context(fleet, urls[mode], cfg, context, mode))
                        bar.advance(task)
            with contextlib.suppress(Exception):
                await fleet.restore()
    _summarize(res, cfg)
    res.write()
    if cfg.plots:
        _plot(res, cfg)
    if cfg.vllm:
        from fleetward.chaos.bench._moves_vllm import run_vllm_part

        await run_vllm_part(cfg, res)
        res.write()
    return res


def stall_stats(values: list[float]) -> dict[str, float | None]:
    return {"n": len(values), "p50_ms": quantile(values, 0.5), "p99_ms": quantile(values, 0.99),
            "mean_ms": statistics.fmean(values) if values else None, "max_ms": max(values) if values else None}


def _summarize(res: Results, cfg: MovesBench) -> None:
    summary: dict[str, Any] = {}
    per_context: dict[str, Any] = {}
    failures: list[str] = []  # wrong streams, failed moves
    warnings: list[str] = []  # what makes a number less telling: a stream not moved, a migration besides the move
    rows = []
    for context in cfg.contexts:
        key = str(context)
        modes: dict[str, Any] = {}
        for run in (r for r in res.data["runs"] if r["context"] == context):
            mode, recs = run["mode"], run["streams"]
            stalls = [r["stall_ms"] for r in recs if r["stall_ms"] is not None]
            modes[mode] = {"stall": stall_stats(stalls), "streams": len(recs), "moved": len(stalls),
                           "moved_twice": sum(1 for r in recs if len(r["switches"]) > 1),
                           "exact": all(r["exact"] for r in recs), "outcomes": run["outcomes"],
                           "kv_bytes": run["kv_bytes"], "kv_tokens": run["kv_tokens"],
                           "router_stall_mean_ms": run["router_stall_mean_ms"],
                           "other_migrations": run["other_migrations"]}
            for r in recs:
                if not r["exact"]:
                    failures.append(f"{key} tokens, {mode}, stream {r['stream']} ({r['request']}): "
                                    + (r["error"] or f"wrong tokens ({r['tokens']} of {cfg.max_tokens})"))
                elif r["stall_ms"] is None:
                    warnings.append(f"{key} tokens, {mode}, stream {r['stream']}: not moved (move answered "
                                    f"{r['move_status']}, {r['tokens_at_order']} tokens when ordered)")
            if run["outcomes"]["failed"]:
                failures.append(f"{key} tokens, {mode}: {run['outcomes']['failed']:g} move(s) failed")
            if run["other_migrations"]:
                warnings.append(f"{key} tokens, {mode}: {run['other_migrations']:g} migration(s) besides the moves")
        kv, re_ = modes.get("kv", {}), modes.get("reprefill", {})
        kv_p50 = kv.get("stall", {}).get("p50_ms")
        re_p50 = re_.get("stall", {}).get("p50_ms")
        fallbacks = int(kv.get("outcomes", {}).get("reprefill", 0))
        summary[key] = {"kv_stall_ms": kv_p50, "reprefill_stall_ms": re_p50, "fallbacks": fallbacks}
        kv_bytes = kv.get("kv_bytes")
        per_context[key] = {**modes, "kv_bytes": kv_bytes, "fallbacks": fallbacks,
                            "kv_bytes_modeled": None if kv_bytes is None else kv_bytes * KV_SCALE,
                            "ratio_p50": ratio(kv_p50, re_p50),
                            "ratio_mean": ratio(kv.get("stall", {}).get("mean_ms"),
                                                re_.get("stall", {}).get("mean_ms")),
                            "exact": bool(kv.get("exact")) and bool(re_.get("exact"))}
        rows.append([key, fmt(kv_p50, ".0f"), fmt(re_p50, ".0f"),
                     fmt(kv.get("stall", {}).get("p99_ms"), ".0f"), fmt(re_.get("stall", {}).get("p99_ms"), ".0f"),
                     fmt(ratio(kv_p50, re_p50), ".2f"), str(fallbacks),
                     fmt(None if kv.get("kv_bytes") is None else kv["kv_bytes"] / 1e6, ".1f"),
                     "yes" if per_context[key]["exact"] else "NO"])
    exact = all(p["exact"] for p in per_context.values())
    res.data["summary"] = summary
    res.data["details"] = {"config": res.data["config"], "sim": res.data["sim"], "contexts": per_context,
                           "streams_per_mode": cfg.streams, "exact": exact, "failures": failures,
                           "warnings": warnings}
    table(f"bench moves: {cfg.streams} streams per context and mode over 2 simulated workers, each moved once "
          f"after {cfg.move_after} tokens (stalls in ms, client-side; x = kv ÷ re-prefill; KV bytes are the "
          f"model's ÷ {KV_SCALE})",
          ["context tokens", "p50 stall kv", "p50 stall re-prefill", "p99 stall kv", "p99 stall re-prefill",
           "x p50", "fallbacks", "MB moved", "exact"], rows)
    if not exact:
        console.print("[bold red]WRONG STREAMS: a stream is not the model's continuation (or ended in an error)[/]")
    for f in failures:
        console.print(f"[bold red]  {f}[/]")
    for w in warnings:
        console.print(f"[yellow]  {w}[/]")


def _plot(res: Results, cfg: MovesBench) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless, as chaos.bench._plots
    import matplotlib.pyplot as plt

    per = res.data["details"]["contexts"]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for mode, label, color in (("kv", "KV carried", "#4c72b0"), ("reprefill", "computed again", "#dd8452")):
        for q, style in (("p50_ms", "-o"), ("p99_ms", ":")):
            pts = [(c, per[str(c)].get(mode, {}).get("stall", {}).get(q)) for c in cfg.contexts]
            pts = [(c, v) for c, v in pts if v is not None]
            if pts:
                ax.plot([c for c, _ in pts], [v for _, v in pts], style, color=color,
                        label=f"{label}, {q.split('_')[0]}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(list(cfg.contexts), [str(c) for c in cfg.contexts])
    ax.set_xlabel("context tokens (prompt) when moved")
    ax.set_ylabel("client-visible stall (ms)")
    ax.set_title(f"Planned move: stall with the KV carried vs computed again ({cfg.streams} streams moved at once)",
                 fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(res.plot_path("stall"))
    plt.close(fig)
