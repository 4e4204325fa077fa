"""``fleetward bench restart``: how long a router takes to be whole again over a large key space.

Two clusters in one etcd: ``empty`` (nothing registered: the baseline) and ``full`` (``workers``
registered workers, each with ``health/<id>`` ready, and ``checkpoints`` request checkpoints of a dead
router, each the size of a real one: 500 prompt ids, 200 emitted tokens, their text). Restarts alternate
between the two, ``repeats`` times each, in two ways:

- **process**: ``fleetward router`` is spawned; measured from spawn to the first ``/health`` 200 (the
  router answers 200 only once its state is loaded and it accepts requests);
- **in-process**: ``Router.start()`` alone (state read, watches, lease, registration), with the loaded
  state checked (workers seen, orphaned checkpoints found).

Also measured once: the interpreter with the router's imports (``python -c "import ..."``), which the
process time includes.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from fleetward.chaos.bench._common import (
    BenchError,
    Infra,
    Results,
    console,
    fmt,
    progress,
    ratio,
    require_extras,
    table,
)
from fleetward.fleet.bus import MqttBus
from fleetward.fleet.config import RouterConfig
from fleetward.fleet.etcd import EtcdStore, Put
from fleetward.fleet.keys import Keys
from fleetward.fleet.launch import router_argv, start_service
from fleetward.fleet.procs import free_port
from fleetward.fleet.worker import HealthRecord, HealthState, WorkerRecord
from fleetward.migration.journal import Journal, Kind

__all__ = ["RestartBench", "checkpoint_value", "run_restart_bench"]

DEAD_ROUTER = "bench-dead-router"


@dataclass(frozen=True)
class RestartBench:
    out: Path
    workers: int = 1000
    checkpoints: int = 10000
    repeats: int = 3
    prompt_ids: int = 500
    emitted: int = 200
    plots: bool = True
    etcd: str | None = None
    mqtt: str | None = None


def checkpoint_value(i: int, prompt_ids: int = 500, emitted: int = 200) -> bytes:
    """A checkpoint as the router writes it, for a request ``prompt_ids`` long with ``emitted`` tokens."""
    prompt = [(i * 31 + k * 7) % 1000 + 16 for k in range(prompt_ids)]
    j = Journal(id=f"cmpl-fwbench{i:012d}", kind=Kind.COMPLETION, created=time.time(),
                deadline=time.time() + 600,
                body={"model": "sim-tiny", "prompt": prompt, "max_tokens": 1000, "stream": True,
                      "return_token_ids": True, "temperature": 0})
    for k in range(emitted):
        j.record([(i + k * 13) % 1000 + 16], " tok", None, None)
    j.worker = f"bench-w{i % 1000}"
    j.attempts = 1
    return orjson.dumps(j.checkpoint(DEAD_ROUTER))


async def _populate(store: EtcdStore, keys: Keys, cfg: RestartBench, lease: int) -> int:
    """Write the full cluster's key space; returns the bytes written."""
    ops: list[Put] = []
    size = 0
    for w in range(cfg.workers):
        wid = f"bench-w{w}"
        rec = WorkerRecord(id=wid, url=f"http://127.0.0.1:{10000 + w}", role="aggregated", model="sim-tiny",
                           node=f"node{w // 8}", backend="sim", started_at=time.time(), pid=None)
        ops.append(Put(keys.worker(wid), rec.to_json(), lease))
        ops.append(Put(keys.health_of(wid), HealthRecord(HealthState.READY, "bench", "bench", time.time()).to_json()))
    template = checkpoint_value(0, cfg.prompt_ids, cfg.emitted)
    for i in range(cfg.checkpoints):
        rid = f"cmpl-fwbench{i:012d}"
        value = template.replace(b"cmpl-fwbench000000000000", rid.encode())
        ops.append(Put(keys.request(rid), value, lease))
    batch: list[Put] = []
    batch_bytes = 0
    for op in ops:
        batch.append(op)
        batch_bytes += len(op.value)
        size += len(op.value) + len(op.key)
        if len(batch) >= 120 or batch_bytes > 1_000_000:
            await store.txn((), batch)
            batch, batch_bytes = [], 0
    if batch:
        await store.txn((), batch)
    return size


async def _process_restart(etcd: str, mqtt: str, cluster: str, log_dir: Path, n: int) -> dict[str, Any]:
    port = free_port()
    argv = router_argv(etcd=etcd, mqtt=mqtt, cluster=cluster, port=port, router_id=f"bench-restart-{n}")
    t0 = time.monotonic()
    try:
        # Polled every 5 ms: the time to the first 200 is what is measured.
        router = await start_service(f"router-{n}", argv, url=f"http://127.0.0.1:{port}",
                                     log_path=log_dir / f"restart-{cluster}-{n}.log", timeout=60, interval=0.005)
    except Exception as exc:  # the process is stopped already
        return {"ok": False, "error": str(exc)[-800:]}
    try:
        elapsed = time.monotonic() - t0
        async with httpx.AsyncClient(timeout=1, trust_env=False) as client:
            metrics = (await client.get(router.url + "/metrics")).text
        routable = next((float(line.split()[-1]) for line in metrics.splitlines()
                         if line.startswith("fleetward_router_workers_routable ")), None)
        return {"ok": True, "to_health_s": elapsed, "workers_routable": routable}
    finally:
        await router.process.stop(grace=10)


async def _inprocess_restart(etcd: str, mqtt: str, cluster: str, n: int) -> dict[str, Any]:
    from fleetward.migration.router import Router

    store = EtcdStore(etcd)
    bus = await MqttBus(mqtt, cluster).start()
    router = Router(RouterConfig(drain_timeout_s=0), store=store, bus=bus, keys=Keys(cluster),
                    router_id=f"bench-inproc-{n}")
    try:
        await store.get(Keys(cluster).root)  # connect first: measured is start(), not the channel
        t0 = time.monotonic()
        await asyncio.wait_for(router.start(), 60)
        elapsed = time.monotonic() - t0
        return {"ok": True, "start_s": elapsed, "workers": len(router.view.fleet.workers),
                "routable": len(router.view.fleet.routable()), "orphans": len(router.orphans)}
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[-800:]}
    finally:
        with contextlib.suppress(Exception):
            await router.aclose()
        await bus.aclose()
        await store.aclose()


def _import_time() -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import fleetward.cli, fleetward.migration.server"], check=True,
                   env={"PYTHONSAFEPATH": "1"})
    return time.monotonic() - t0


async def run_restart_bench(cfg: RestartBench) -> Results:
    require_extras(plots=cfg.plots)
    res = Results("restart", cfg.out, {"config": {**cfg.__dict__, "out": str(cfg.out)}, "runs": []})
    run_dir = cfg.out / "run-restart"
    tag = uuid.uuid4().hex[:6]
    clusters = {"empty": f"bench-restart-empty-{tag}", "full": f"bench-restart-full-{tag}"}
    async with Infra(run_dir, cfg.etcd, cfg.mqtt).up() as infra:
        assert infra.etcd and infra.mqtt
        store = EtcdStore(infra.etcd, timeout_s=30)
        lease = await store.grant(3600)
        try:
            with console.status(f"writing {cfg.workers} workers and {cfg.checkpoints} checkpoints into etcd…"):
                t0 = time.monotonic()
                size = await _populate(store, Keys(clusters["full"]), cfg, lease)
                res.data["populate"] = {"bytes": size, "seconds": time.monotonic() - t0,
                                        "checkpoint_bytes": len(checkpoint_value(0, cfg.prompt_ids, cfg.emitted))}
            res.data["import_s"] = _import_time()
            total = cfg.repeats * 2 * 2
            with progress() as bar:
                task = bar.add_task("restart bench", total=total)
                for rep in range(cfg.repeats):
                    for case in ("empty", "full") if rep % 2 == 0 else ("full", "empty"):
                        bar.update(task, description=f"repeat {rep + 1}/{cfg.repeats}: {case}, process")
                        r = await _process_restart(infra.etcd, infra.mqtt, clusters[case], run_dir / "logs", rep)
                        res.data["runs"].append({"case": case, "mode": "process", "repeat": rep, **r})
                        bar.advance(task)
                        bar.update(task, description=f"repeat {rep + 1}/{cfg.repeats}: {case}, in-process")
                        r = await _inprocess_restart(infra.etcd, infra.mqtt, clusters[case], rep)
                        res.data["runs"].append({"case": case, "mode": "in-process", "repeat": rep, **r})
                        bar.advance(task)
        finally:
            with contextlib.suppress(Exception):
                await store.revoke(lease)
            for cluster in clusters.values():
                with contextlib.suppress(Exception):
                    await store.delete(Keys(cluster).root, prefix=True)
            await store.aclose()
    _summarize(res, cfg)
    res.write()
    if cfg.plots:
        _plot(res)
    failed = [r for r in res.data["runs"] if not r["ok"]]
    if failed:
        raise BenchError(f"{len(failed)} restart(s) failed; first: {failed[0]['error']} (results: {res.json_path})")
    return res


def _summarize(res: Results, cfg: RestartBench) -> None:
    summary: dict[str, Any] = {}
    for mode, key in (("process", "to_health_s"), ("in-process", "start_s")):
        for case in ("empty", "full"):
            runs = [r for r in res.data["runs"] if r["mode"] == mode and r["case"] == case and r["ok"]]
            vals = [r[key] for r in runs]
            summary[f"{mode}/{case}"] = {"n": len(vals), "median_s": statistics.median(vals) if vals else None,
                                         "max_s": max(vals) if vals else None,
                                         "failed": sum(1 for r in res.data["runs"] if r["mode"] == mode
                                                       and r["case"] == case and not r["ok"])}
        full, empty = summary[f"{mode}/full"]["median_s"], summary[f"{mode}/empty"]["median_s"]
        summary[f"{mode}/ratio_full_vs_empty"] = ratio(full, empty)
    loaded = [r for r in res.data["runs"] if r["mode"] == "in-process" and r["case"] == "full" and r["ok"]]
    if loaded:
        summary["state_loaded"] = {"workers": loaded[-1]["workers"], "routable": loaded[-1]["routable"],
                                   "orphaned_checkpoints": loaded[-1]["orphans"]}
    res.data["summary"] = summary
    rows = []
    for mode in ("process", "in-process"):
        e, f = summary[f"{mode}/empty"], summary[f"{mode}/full"]
        rows.append([mode, fmt(e["median_s"], ".3f"), fmt(f["median_s"], ".3f"), fmt(f["max_s"], ".3f"),
                     fmt(summary[f"{mode}/ratio_full_vs_empty"], ".2f"), str(e["failed"] + f["failed"])])
    table(f"bench restart: {cfg.workers} workers + {cfg.checkpoints} checkpoints "
          f"({res.data['populate']['bytes'] / 2**20:.0f} MiB) vs an empty cluster, median of {cfg.repeats} "
          f"(imports alone: {res.data['import_s']:.2f}s)",
          ["mode", "empty s", "full s", "full max s", "x full/empty", "failed"], rows)


def _plot(res: Results) -> None:
    from fleetward.chaos.bench import _plots

    s = res.data["summary"]
    _plots.grouped_bars(res.plot_path("times"), title="Router restart to full state (median)",
                        groups=["process start → /health 200", "Router.start()"],
                        series={case: [s[f"process/{case}"]["median_s"], s[f"in-process/{case}"]["median_s"]]
                                for case in ("empty", "full")}, ylabel="seconds", hline=1.0, fmt="{:.3f}")
