"""``fleetward profile``: measure what one worker carries within the SLA, and how long one takes to start.

By default it starts one worker of the fleet file's backend (``--backend sim|vllm``), measuring the time from
launch to serving, drives it at rising load (:func:`fleetward.autoscale.profile.profile_worker`), stops it,
and writes the capacity model (``--out``, default ``capacity.json``) that ``autoscale.capacity`` (or
``fleetward autoscaler --capacity``) takes. ``--url`` profiles a server that already runs instead (one you
started, or a vLLM server fleetward did not start); its start-up time is then ``--startup`` (default 60 s).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from pathlib import Path

from rich.console import Console

from fleetward.autoscale.capacity import CapacityModel, CapacityPoint, Sla
from fleetward.fleet.backends import BACKENDS
from fleetward.fleet.config import FleetConfig, load_fleet_config
from fleetward.fleet.errors import ConfigError

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("profile", help="measure one worker's capacity against the SLA (the autoscaler's model)")
    p.add_argument("--config", type=Path, help="fleet YAML file: its backend, sim: and vllm: sections")
    p.add_argument("--backend", choices=list(BACKENDS), help="the worker to start (default: the file's, else sim)")
    p.add_argument("--model", help="vllm: model folder (default: the tiny local model)")
    p.add_argument("--url", help="profile this running server instead of starting one")
    p.add_argument("--served-model", dest="served_model", help="with --url: the model name (default: its first)")
    p.add_argument("--startup", type=float, help="start-up time to record, s (default: measured; 60 with --url)")
    p.add_argument("--out", type=Path, default=Path("capacity.json"), help="where the model goes")
    p.add_argument("--ttft", type=float, default=Sla().ttft_s, help="SLA: p99 TTFT, s (stops 4x past it)")
    p.add_argument("--itl", type=float, default=Sla().itl_s, help="SLA: p99 mean ITL, s (stops 4x past it)")
    p.add_argument("--ttft-per-1k", dest="ttft_per_1k", type=float, default=0.0,
                   help="SLA: TTFT allowed per 1,000 prompt tokens on top of --ttft, s (default 0)")
    p.add_argument("--rates", help="comma-separated requests/s (default 0.25 rising by 1.5x until the SLA breaks)")
    p.add_argument("--step", type=float, default=20.0, help="seconds per rate (default 20)")
    p.add_argument("--prompt-tokens", dest="prompt_tokens", type=int, default=128)
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=64)
    p.add_argument("--work-prompt-tokens", dest="work_prompt_tokens", type=int, default=1024,
                   help="prompt length that measures prefill tokens/s (default 1024)")
    p.add_argument("--work-batch", dest="work_batch", type=int, default=16,
                   help="streams at once that measure decode cost per token (default 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", dest="run_dir", type=Path, help="where the worker's log goes (default .fleetward)")


def _rates(text: str | None) -> list[float]:
    if not text:
        from fleetward.autoscale.profile import rising_rates

        return rising_rates()
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise ConfigError(f"--rates: {exc}", field="--rates") from None
    if not rates or any(r <= 0 for r in rates) or rates != sorted(set(rates)):
        raise ConfigError("--rates: positive requests/s, strictly rising", field="--rates")
    return rates


async def _served_model(url: str) -> str:
    import httpx

    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        try:
            r = await client.get(url + "/v1/models")
            return str(r.json()["data"][0]["id"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            raise ConfigError(f"--url {url}: no model listed at /v1/models ({exc!r}); pass --served-model",
                              field="--url") from None


async def _profile(args: argparse.Namespace, err: Console) -> CapacityModel:
    # Imported here, not with the parser, which every fleetward process builds (the load driver and its MQTT
    # and backend parts cost a router's start-up a tenth of a second).
    from fleetward.autoscale.profile import measure_work, profile_worker

    sla = Sla(args.ttft, args.itl, args.ttft_per_1k)
    rates = _rates(args.rates)
    if args.work_prompt_tokens < 1 or args.work_batch < 1:
        raise ConfigError("--work-prompt-tokens and --work-batch must be at least 1", field="--work-batch")

    def step(rate: float, point: CapacityPoint | None, failed: int) -> None:
        lost = f", [red]{failed} failed[/]" if failed else ""
        if point is None:
            err.print(f"  {rate:8.3f} req/s: nothing answered{lost}")
        else:
            ok = point.ttft_p99 <= sla.ttft_for(args.prompt_tokens) and point.itl_p99 <= sla.itl_s
            err.print(f"  {rate:8.3f} req/s: p99 TTFT {point.ttft_p99:7.3f} s, ITL {point.itl_p99 * 1000:7.1f} ms  "
                      f"{'[green]within[/]' if ok else '[yellow]beyond[/]'} the SLA{lost}")

    async def measure(url: str, model: str, startup: float) -> CapacityModel:
        err.print(f"measuring the work: {args.work_prompt_tokens}-token prompts alone, then {args.work_batch} "
                  f"streams at once:")
        prefill, decode = await measure_work(url, model=model, prompt_tokens=args.work_prompt_tokens,
                                             batch=args.work_batch, seed=args.seed)
        err.print(f"  prefill {prefill:,.0f} prompt tokens/s; decode {decode * 1000:.2f} ms per output token "
                  f"at a batch of {args.work_batch}")
        err.print(f"driving {url} ({model}) at rising load, {args.step:g} s per rate:")
        points = await profile_worker(url, model=model, sla=sla, rates=rates, step_s=args.step,
                                      prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, seed=args.seed,
                                      on_step=step)
        # Against an SLA per prompt token, each TTFT counts against its prompt's target: scaled to the base one.
        points = [dataclasses.replace(p, ttft_p99=sla.base_ttft(p.ttft_p99, args.prompt_tokens)) for p in points]
        return CapacityModel(tuple(points), startup, float(args.prompt_tokens), float(args.max_tokens), prefill,
                             decode, sla.ttft_per_1k_s)

    if args.url:
        url = args.url.rstrip("/")
        return await measure(url, args.served_model or await _served_model(url),
                             args.startup if args.startup is not None else 60.0)

    from fleetward.fleet.backends import make_backend
    from fleetward.fleet.procs import free_port
    from fleetward.fleet.worker import WorkerSpec

    overrides = {k: v for k, v in (("backend", args.backend), ("vllm.model", args.model), ("run_dir", args.run_dir))
                 if v is not None}
    config = load_fleet_config(args.config, overrides) if args.config or overrides else FleetConfig()
    backend = make_backend(config.backend, sim=config.sim, vllm=config.vllm, run_dir=config.run_dir)
    if (tiny := backend.tiny_model()) is not None:
        from fleetward.sim.tinymodel import ensure_tiny_model

        ensure_tiny_model(tiny.path, tokenizer=tiny.tokenizer, say=lambda t: err.print(f"  {t}"))
    backend.check()
    spec = WorkerSpec(id="profile-w0", host="127.0.0.1", port=free_port(), model=backend.model_name)
    log_dir = config.run_dir / "profile"
    log_dir.mkdir(parents=True, exist_ok=True)
    with err.status(f"starting one {config.backend} worker (its start-up time is measured)…"):
        t0 = time.monotonic()
        handle = backend.launch(spec, log_dir)
    try:
        await backend.wait_ready(handle)
        startup = time.monotonic() - t0
        err.print(f"  the worker serves after [bold]{startup:.1f} s[/] (log: {log_dir})")
        await backend.warm_up(spec.url)
        return await measure(spec.url, backend.model_name,
                             args.startup if args.startup is not None else round(startup, 2))
    finally:
        await backend.stop(handle, grace=5)


def run(args: argparse.Namespace, out: Console, err: Console) -> int:
    model = asyncio.run(_profile(args, err))
    sla = Sla(args.ttft, args.itl, args.ttft_per_1k)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(model.to_json() + "\n")
    try:
        carried = f"{model.max_rate(sla):.2f} req/s per worker within the SLA"
    except ConfigError as exc:
        carried = f"[yellow]{exc}[/]"
    out.print(f"wrote {args.out}: {len(model.points)} point(s), start-up {model.startup_s:g} s; {carried}")
    return 0
