"""``fleetward bench moves --vllm``: the same planned moves on real vLLM (the tiny local model, on the CPU).

Two vLLM workers started by fleetward's agent, both ``kv_both`` with fleetward's connector
(:mod:`fleetward.fleet.kvconnector`: vLLM's ExampleConnector, KV as checked files under one folder), a
controller and the two routers of the simulated part (``kv``, ``reprefill``). The context is the longest the
tiny model serves: ``max_model_len`` less the output, off a multiple of vLLM's CPU block of 128 tokens (the
connector saves whole blocks of the prompt it is asked for). Each stream is checked against the same prompt
computed by one server alone, uninterrupted (greedy: vLLM is exact across servers here).

What a KV move costs on vLLM: the worker the stream leaves computes the tail its prefix cache lacks (under a
block) and writes every layer's KV as a file; the destination checks the files against their manifest and
loads them. Re-prefill computes the whole context on the destination (and, the connector being ``kv_both``,
writes its KV too: both modes pay that).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import uuid
from typing import Any

import httpx

from fleetward.chaos.bench._common import Infra, Results, console, fmt, progress, ratio, table
from fleetward.chaos.bench._moves import MODES, ROUTING, MovesBench, run_context, stall_stats
from fleetward.chaos.harness import TestFleet
from fleetward.fleet.backends import VllmBackend
from fleetward.fleet.config import MovesConfig, SupervisorConfig, VllmConfig
from fleetward.sim.tinymodel import ensure_tiny_model

__all__ = ["run_vllm_part"]

# As tests/vllm: a CPU canary can wait behind a batch; canaries rarely, so they do not sit in the stalls.
SUPERVISOR = SupervisorConfig(canary_timeout_s=5.0, canary_interval_s=60.0)


def _context(config: VllmConfig, cfg: MovesBench) -> int:
    longest = config.max_model_len - cfg.max_tokens - 1
    return longest - 1 if longest % 128 == 0 else longest


async def run_vllm_part(cfg: MovesBench, res: Results) -> None:
    """Run the moves on two vLLM workers; add ``vllm`` to the results and its context to their summary."""
    # The tiny model decodes fast: longer streams, so that every one is still running when its move comes.
    cfg = dataclasses.replace(cfg, max_tokens=max(cfg.max_tokens, 256), move_after=max(cfg.move_after, 16))
    run_dir = cfg.out / "run-moves-vllm"
    kv = run_dir / "kv"
    kv.mkdir(parents=True, exist_ok=True)
    connector = {"kv_connector": "FleetwardExampleConnector", "kv_connector_module_path": "fleetward.fleet.kvconnector",
                 "kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": str(kv)}}
    backend = VllmBackend(VllmConfig(nice=10, extra_args=("--kv-transfer-config", json.dumps(connector))))
    ensure_tiny_model(backend.model_path, tokenizer=backend.config.tokenizer)
    context = _context(backend.config, cfg)
    runs: list[dict[str, Any]] = []
    async with Infra(run_dir, cfg.etcd, cfg.mqtt).up() as infra:
        assert infra.etcd and infra.mqtt
        console.print("starting 2 vLLM workers (the tiny model, CPU), a controller and two routers…")
        async with TestFleet(etcd=infra.etcd, mqtt=infra.mqtt, cluster=f"bench-moves-vllm-{uuid.uuid4().hex[:6]}",
                             run_dir=run_dir, workers=2, backend=backend, routing=ROUTING, node="cpu",
                             supervisor=SUPERVISOR) as fleet:
            await fleet.wait_workers_routable(2, timeout=300)
            urls = {"kv": (await fleet.start_router("bench-kv")).url,
                    "reprefill": (await fleet.start_router("bench-reprefill", moves=MovesConfig(kv=False))).url}
            reference = fleet.url(fleet.worker_ids[0])

            async def exact(prompt: list[int], tokens: list[int], n: int) -> bool:
                async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
                    r = await client.post(reference + "/v1/completions", json={
                        "model": backend.model_name, "prompt": prompt, "max_tokens": n, "temperature": 0,
                        "ignore_eos": True, "return_token_ids": True})
                return r.status_code == 200 and tokens == r.json()["choices"][0]["token_ids"]

            with progress() as bar:
                task = bar.add_task("moves bench, vLLM", total=len(MODES))
                for mode in MODES:
                    bar.update(task, description=f"vLLM {context} tokens: {mode}")
                    runs.append(await run_context(fleet, urls[mode], cfg, context, mode, model=backend.model_name,
                                                  exact=exact, deadline=600.0, simulated=False))
                    bar.advance(task)
            with contextlib.suppress(Exception):
                await fleet.restore()
    modes = {r["mode"]: r for r in runs}
    stalls = {m: stall_stats([s["stall_ms"] for s in r["streams"] if s["stall_ms"] is not None])
              for m, r in modes.items()}
    kv_p50, re_p50 = stalls["kv"]["p50_ms"], stalls["reprefill"]["p50_ms"]
    fallbacks = int(modes["kv"]["outcomes"]["reprefill"])
    exact_all = all(s["exact"] for r in runs for s in r["streams"])
    res.data["summary"][str(context)] = {"kv_stall_ms": kv_p50, "reprefill_stall_ms": re_p50, "fallbacks": fallbacks,
                                         "backend": "vllm"}
    res.data["vllm"] = {"context": context, "vllm": backend.config.model_dump(mode="json"), "runs": runs,
                        "stall": stalls, "ratio_p50": ratio(kv_p50, re_p50), "exact": exact_all,
                        "kv_bytes": modes["kv"]["kv_bytes"], "kv_tokens": modes["kv"]["kv_tokens"]}
    res.data["details"]["exact"] = bool(res.data["details"]["exact"]) and exact_all
    table(f"bench moves --vllm: {cfg.streams} streams over 2 vLLM workers (tiny model, CPU), each moved once after "
          f"{cfg.move_after} tokens (stalls in ms, client-side)",
          ["context tokens", "p50 stall kv", "p50 stall re-prefill", "p99 stall kv", "p99 stall re-prefill", "x p50",
           "fallbacks", "exact"],
          [[str(context), fmt(kv_p50, ".0f"), fmt(re_p50, ".0f"), fmt(stalls["kv"]["p99_ms"], ".0f"),
            fmt(stalls["reprefill"]["p99_ms"], ".0f"), fmt(ratio(kv_p50, re_p50), ".2f"), str(fallbacks),
            "yes" if exact_all else "NO"]])
    if not exact_all:
        console.print("[bold red]WRONG STREAMS on vLLM: a stream is not what one server computes alone[/]")
