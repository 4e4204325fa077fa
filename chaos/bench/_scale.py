"""``fleetward bench scale``: the per-unit costs of docs/scale.md's load model, measured on this machine, and the
table they give at 10, 100, 1,000 and 10,000 hosts.

Four measurements, each of the product's own code or processes:

- **checkpoint sizes**: the bytes of a base and of a delta (key and value), from ``Journal`` and ``Keys`` on a
  request shaped like the workload's (prompt ids, 4-character tokens), at two sizes each to split the fixed
  part from the part per token;
- **a streaming run**: two simulated workers, two routers keeping their checkpoints with each other
  (``checkpoint_store: peers``), ``streams`` closed-loop streams through one: the CPU per token of both
  routers together (the one that relays and the one that holds its copies), memory per stream, the
  checkpoint bytes per token and what reached etcd per token, the series each process serves, the etcd
  watchers a router adds;
- **the controller**: ``bench detect``'s CPU part at two fleet sizes (simulated workers registered in etcd):
  the controller's CPU per worker, canaries per worker, etcd writes per worker in a steady fleet;
- **the broker**: QoS 1 messages through the MQTT broker to one subscriber, as fast as it takes them.

Results: ``scale.json`` (``table``: the design for a large fleet, checkpoints kept by peer routers;
``designs``: every checkpoint design of the paper comparison, today's default ``etcd`` among them; ``units``,
``workload``, ``limits``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import aiomqtt
import psutil
from prometheus_client import generate_latest

from fleetward.chaos.bench import _scalemodel as model
from fleetward.chaos.bench._common import (
    Infra,
    Results,
    client_load,
    console,
    fmt,
    metric_delta,
    metric_total,
    progress,
    require_extras,
    scrape,
    table,
)
from fleetward.chaos.bench._router import SIM
from fleetward.chaos.harness import TestFleet
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.config import RouterConfig
from fleetward.fleet.keys import Keys
from fleetward.migration.journal import Journal, Kind, new_request_id

__all__ = ["ScaleBench", "run_scale_bench"]

WATCHERS = "etcd_debugging_mvcc_watcher_total"


@dataclass(frozen=True)
class ScaleBench:
    out: Path
    streams: int = 128
    warmup_s: float = 2.0
    duration_s: float = 8.0
    cpu_workers: tuple[int, int] = (100, 1000)
    cpu_window_s: float = 30.0
    cpu_settle_s: float | None = 45.0  # past the new workers' first canaries (a window with them costs more)
    mqtt_messages: int = 20000
    plots: bool = True
    etcd: str | None = None
    mqtt: str | None = None


def _series(text: str) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def checkpoint_sizes(w: model.Workload, cluster: str = "fleet") -> dict[str, float]:
    """Bytes of a checkpoint's base and of a delta (key and value), split into a fixed part and a part per
    token, on a request shaped like ``w``'s."""
    rng = random.Random(7)
    keys = Keys(cluster)

    def journal(prompt: int, output: int) -> Journal:
        words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(round(w.chars_per_token)))
                 for _ in range(prompt + output)]
        j = Journal(id=new_request_id(Kind.COMPLETION), kind=Kind.COMPLETION,
                    body={"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": "".join(words[:prompt]),
                          "max_tokens": w.output_tokens, "stream": True, "temperature": 0.7},
                    deadline=time.time() + 600)
        j.prompt_ids = [rng.randrange(128000) for _ in range(prompt)]
        for word in words[prompt:]:
            j.emitted.append(rng.randrange(128000))
            j.text += word
            j.text_ends.append(len(j.text))
        j.worker = "host-0123-gpu7"
        return j

    def base(prompt: int, output: int) -> int:
        j = journal(prompt, output)
        return len(j.checkpoint_bytes("router-a1b2c3")) + len(keys.request(j.id))

    def delta(k: int) -> int:
        j = journal(8, 64)
        n = len(j.emitted) - k
        return len(j.delta_bytes(n, j.text_ends[n - 1])) + len(keys.request(j.id)) + len("/0000000001")

    b00, b_p, b_o = base(0, 0), base(1000, 0), base(0, 200)
    d1, d17 = delta(1), delta(17)
    per_token = (d17 - d1) / 16
    return {"checkpoint_base_fixed_bytes": b00, "checkpoint_base_bytes_per_prompt_token": (b_p - b00) / 1000,
            "checkpoint_base_bytes_per_output_token": (b_o - b00) / 200,
            "checkpoint_delta_fixed_bytes": d1 - per_token, "checkpoint_delta_bytes_per_token": per_token}


async def _streaming(cfg: ScaleBench, infra: Infra) -> dict[str, Any]:
    assert infra.etcd and infra.mqtt
    etcd_metrics = f"http://{infra.etcd}/metrics"
    run_dir = cfg.out / "run-scale"
    watchers_pre = metric_total(await scrape(etcd_metrics), WATCHERS)  # another client's, when etcd is not ours
    async with TestFleet(etcd=infra.etcd, mqtt=infra.mqtt, cluster=f"bench-scale-{uuid.uuid4().hex[:6]}",
                         run_dir=run_dir, workers=2, backend=SimBackend(SIM), routing=RouterConfig()) as fleet:
        await fleet.wait_workers_routable(2)
        watchers0 = metric_total(await scrape(etcd_metrics), WATCHERS)
        router = await fleet.start_router("bench-scale-router", checkpoint_store="peers")
        await asyncio.sleep(1.0)  # its watches are opened once it serves; a second for the last of them
        watchers1 = metric_total(await scrape(etcd_metrics), WATCHERS)
        holder = await fleet.start_router("bench-scale-holder", checkpoint_store="peers")
        proc = psutil.Process(router.process.pid)
        rss_idle = proc.memory_info().rss
        peak = [rss_idle]

        async def sample() -> None:
            while True:
                with contextlib.suppress(psutil.Error):
                    peak[0] = max(peak[0], proc.memory_info().rss)
                await asyncio.sleep(0.2)

        body = {"model": SIM.model_name, "max_tokens": 256, "ignore_eos": True, "return_token_ids": True,
                "temperature": 0}
        r0, e0 = await scrape(router.url + "/metrics"), await scrape(etcd_metrics)
        sampler = asyncio.create_task(sample())
        try:
            r = await client_load({"urls": [router.url], "body": body, "prompt_len": 32, "streams": cfg.streams,
                                   "warmup_s": cfg.warmup_s, "duration_s": cfg.duration_s, "seed": 1,
                                   "cpu_pids": {"router": [router.process.pid], "holder": [holder.process.pid]}})
        finally:
            sampler.cancel()
        r1, e1 = await scrape(router.url + "/metrics"), await scrape(etcd_metrics)
        worker = await scrape(fleet.url(fleet.worker_ids[0]) + "/metrics")
        tokens = metric_delta(r0, r1, "fleetward_router_tokens_total")
        tok_s = r["tokens"] / r["window_s"]
        return {
            "streams": cfg.streams, "tokens_per_s": tok_s, "requests_failed": r["requests_failed"],
            "router_cpu_cores": r["cpu_cores"]["router"], "holder_cpu_cores": r["cpu_cores"]["holder"],
            "router_cpu_s_per_token": ((r["cpu_cores"]["router"] + r["cpu_cores"]["holder"]) / tok_s
                                       if tok_s else None),
            "router_rss_idle_bytes": rss_idle, "router_rss_peak_bytes": peak[0],
            "router_rss_bytes_per_stream": (peak[0] - rss_idle) / cfg.streams,
            "checkpoint_bytes_per_token": metric_delta(r0, r1, "fleetward_router_checkpoint_bytes_total")
            / max(tokens, 1),
            "etcd_puts_per_token": metric_delta(e0, e1, "etcd_mvcc_put_total") / max(tokens, 1),
            "etcd_bytes_in_per_token": metric_delta(e0, e1, "etcd_network_client_grpc_received_bytes_total")
            / max(tokens, 1),
            "watchers_agent_and_controller": watchers0 - watchers_pre, "watchers_per_router": watchers1 - watchers0,
            "series_per_router": len(r1), "series_per_agent": _series(
                generate_latest(fleet.agent.metrics.registry).decode()),
            "series_per_sim_worker": len(worker),
        }


async def _controller(cfg: ScaleBench, infra: Infra, res: Results) -> dict[str, Any]:
    from fleetward.chaos.bench import _detect_cpu
    from fleetward.chaos.bench._detect import DetectBench

    dcfg = DetectBench(out=cfg.out, parts=("cpu",), cpu_workers=cfg.cpu_workers, cpu_window_s=cfg.cpu_window_s,
                       cpu_settle_s=cfg.cpu_settle_s, cpu_routers=1, plots=False, etcd=infra.etcd, mqtt=infra.mqtt)
    res.data["cpu"] = _detect_cpu.section()
    await _detect_cpu.run(dcfg, infra, res)
    steps = res.data.pop("cpu")["steps"]
    (a, b) = steps[0], steps[-1]
    ca, cb = a["cpu_cores"]["controller"], b["cpu_cores"]["controller"]
    per = max(0.0, (cb - ca) / (b["workers"] - a["workers"]))
    return {"steps": steps, "controller_cores_per_worker": per,
            "controller_cores_fixed": max(0.0, ca - per * a["workers"]),
            "canaries_per_worker_s": sum(b["canaries_per_s"].values()) / b["workers"],
            "etcd_writes_per_worker_s": b["etcd_keys_written_per_s"] / b["workers"],
            "series_per_controller": b["controller_metric_series"]}


async def _broker(cfg: ScaleBench, infra: Infra) -> dict[str, Any]:
    """QoS 1 messages/s through the broker to one subscriber: 8 publishers, ``mqtt_messages`` in all."""
    assert infra.mqtt
    host, _, port = infra.mqtt.rpartition(":")
    topic = f"fleetward/bench-scale-{uuid.uuid4().hex[:6]}/events/x"
    payload = b'{"v":1,"kind":"health.changed","worker":"host-0123-gpu7","state":"ready","reason":"canary ok"}'
    n, pubs = cfg.mqtt_messages, 8
    got = 0
    done = asyncio.Event()
    async with aiomqtt.Client(host, int(port), identifier=f"scale-sub-{uuid.uuid4().hex[:6]}") as sub:
        await sub.subscribe(topic, qos=1)

        async def receive() -> None:
            nonlocal got
            async for _ in sub.messages:
                got += 1
                if got >= n:
                    done.set()
                    return

        async def publish(i: int) -> None:
            async with aiomqtt.Client(host, int(port), identifier=f"scale-pub-{i}-{uuid.uuid4().hex[:6]}") as pub:
                for _ in range(n // pubs):
                    await pub.publish(topic, payload, qos=1)

        receiver = asyncio.create_task(receive())
        t0 = time.monotonic()
        try:
            await asyncio.gather(*(publish(i) for i in range(pubs)))
            await asyncio.wait_for(done.wait(), timeout=60)
        finally:
            receiver.cancel()
        elapsed = time.monotonic() - t0
    return {"messages": n, "seconds": elapsed, "mqtt_messages_per_s_capacity": n / elapsed}


async def run_scale_bench(cfg: ScaleBench) -> Results:
    require_extras(plots=cfg.plots)
    w = model.Workload()
    res = Results("scale", cfg.out, {"config": {**asdict(cfg), "out": str(cfg.out)}, "workload": model.describe(w)})
    async with Infra(cfg.out / "run-scale", cfg.etcd, cfg.mqtt).up() as infra:
        with progress() as bar:
            task = bar.add_task("checkpoint sizes", total=4)
            sizes = checkpoint_sizes(w)
            bar.update(task, advance=1, description=f"streaming: {cfg.streams} streams through one router")
            streaming = await _streaming(cfg, infra)
            bar.update(task, advance=1, description=f"controller: {cfg.cpu_workers[0]} then "
                                                    f"{cfg.cpu_workers[1]} workers")
            controller = await _controller(cfg, infra, res)
            bar.update(task, advance=1, description="broker: QoS 1 messages/s")
            broker = await _broker(cfg, infra)
            bar.advance(task)
    measured: dict[str, float] = {**sizes, **{k: streaming[k] for k in (
        "router_cpu_s_per_token", "router_rss_bytes_per_stream", "watchers_per_router", "series_per_router",
        "series_per_agent")}, "router_rss_bytes_base": streaming["router_rss_idle_bytes"],
        "series_per_vllm_server": streaming["series_per_sim_worker"],
        **{k: controller[k] for k in ("controller_cores_per_worker", "controller_cores_fixed",
                                      "canaries_per_worker_s", "etcd_writes_per_worker_s", "series_per_controller")},
        "mqtt_messages_per_s_capacity": broker["mqtt_messages_per_s_capacity"]}
    # The agent's watchers: what the test fleet opened, with its in-process controller's: an upper bound.
    measured["watchers_per_agent"] = streaming["watchers_agent_and_controller"]
    measured = {k: v for k, v in measured.items() if v is not None}
    known = {f.name for f in fields(model.Units)}
    units = model.Units(**{k: v for k, v in measured.items() if k in known}, measured=tuple(sorted(measured)))
    res.data.update({"measurements": {"checkpoint_sizes": sizes, "streaming": streaming, "controller": controller,
                                      "broker": broker},
                     "units": asdict(units),
                     "limits": {k: asdict(v) for k, v in model.LIMITS.items()},
                     "design": "peer",
                     "table": model.table(w, units, "peer"),
                     "designs": {d: model.table(w, units, d) for d in model.DESIGNS}})
    res.data["first_over"] = {d: model.first_over(t) for d, t in res.data["designs"].items()}
    _print(res)
    res.write()
    if cfg.plots:
        _plot(res)
    return res


def _print(res: Results) -> None:
    tab = res.data["table"]
    sizes = list(tab)
    rows = []
    for name in tab[sizes[0]]:
        cells = []
        for h in sizes:
            row = tab[h][name]
            x = row["load"] / row["limit"] if row["limit"] else None
            cells.append(f"{row['load']:.3g} ({fmt(x, '.2f')}x){' OVER' if x is not None and x > 1 else ''}")
        rows.append([name, *cells, res.data["limits"][name]["unit"]])
    table("bench scale: load (share of its limit), checkpoints kept by peer routers (routing.checkpoint_store: "
          "peers)",
          ["resource", *[f"{h} hosts" for h in sizes], "unit"], rows)
    cmp_rows = []
    for d, first in res.data["first_over"].items():
        over = ", ".join(f"{r['resource']} {r['times_limit']:.1f}x" for r in first["resources"][:3]) if first else "-"
        cmp_rows.append([d, str(first["hosts"]) if first else "none up to 10000", over])
    table("checkpoint designs on paper: the first size at which a resource passes its limit",
          ["design", "first over at hosts", "resources over there"], cmp_rows)
    console.print(f"units measured here: {', '.join(res.data['units']['measured'])}")


def _plot(res: Results) -> None:
    from fleetward.chaos.bench import _plots

    designs = res.data["designs"]
    h = "1000"
    names = list(designs["etcd"][h])
    _plots.grouped_bars(res.plot_path("1000-hosts"),
                        title="Load ÷ limit at 1,000 hosts, by checkpoint design (above the dashed line: over)",
                        groups=[n.replace("_per_s", "/s").replace("_", " ") for n in names],
                        series={d: [max(1e-3, designs[d][h][n]["load"] / designs[d][h][n]["limit"]) for n in names]
                                for d in designs},
                        ylabel="load ÷ limit (log; 0.001 stands for less)", hline=1.0, log=True, fmt="{:.2g}",
                        rotate=True)
