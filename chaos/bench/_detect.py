"""``fleetward bench detect``: how fast the supervisor names a failure, whether it cries wolf, what it costs.

Three parts, each with its own fleet (``--parts``):

**latency.** Simulated workers (and with ``--vllm`` real vLLM on the CPU) under a node agent in this
process, a router process, and a supervisor controller as its own process (``fleetward supervisor
--role controller``), as ``fleetward up`` runs them. Closed-loop streams run through the router; one
worker (the one with the most streams) fails:

- ``crash``: SIGKILL of the worker's whole process tree;
- ``engine-kill`` (vLLM): SIGKILL of ``VLLM::EngineCore`` only, the API server stays up;
- ``hang``: the sim's ``hang`` switch (the engine stops, ``/health`` stays 200); on vLLM, SIGSTOP of
  EngineCore (``engine-hang``).

The verdict is the first ``health.changed`` event with ``state: unhealthy`` for the victim. Clocks: the
injection is stamped with this process's ``time.time()`` and ``time.monotonic()`` right before the
kill/signal/``POST``; the verdict's time is the event's ``ts``, the controller's ``time.time()`` when it
published the verdict (after the fenced etcd write of ``health/<id>``). Both processes read the same
system clocks. "Observed" is this process's monotonic time when the event arrived over MQTT.

For hangs the target is counted from the **first missed token deadline**: the moment the worker's
silence exceeded the router's allowance. During hang trials this process polls the router's
``GET /fleetward/v1/progress`` every 10 ms; each answer gives the victim's ``silent_for_s`` and
``allowed_silence_s``. The router's last relayed token is ``(sent + received) / 2 - silent_for_s`` of
the answers with the smallest round trip (the router's ``time.monotonic()`` is the same clock as ours),
and the first missed deadline is that plus the allowance in force in the last answer before the
verdict (or before the router moved the streams away). A negative "verdict after the miss" means the
verdict came before any deadline was missed (vLLM's SIGSTOP is seen by the node agent directly).

**soak.** Three simulated workers, one router, a controller with default settings. First the fleet's
capacity for a mix of short and long prompts is measured: closed loop with many more streams than the
workers hold (their KV caches fill, the rest queues), and capacity is the completed requests per
second. Then Poisson arrivals at ``load`` x capacity (default 0.9) for ``soak_s`` seconds. Every
``hang.detected``, non-ready ``health.changed``, ``restart``, ``quarantine`` and router migration in
either phase is a false positive: no fault is injected.

**cpu.** ``workers`` simulated workers hosted in one process (``_multisim``: worker ``i`` under
``/w/<i>``), registered in etcd the way a node agent does it (``health/<id>`` starting, the process
signal, ``workers/<id>`` under a lease), a controller process with default settings, and routers whose
progress views list every worker (one request per worker through each router). Once every worker is
ready and a full canary interval has passed, the controller's CPU (psutil ``cpu_times``, user + system)
is measured over a window, at each size of ``workers`` in turn (the smaller one is the baseline).
Optionally ``py-spy`` profiles the controller afterwards.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
import yaml

from fleetward.chaos.bench._common import (
    BenchError,
    Infra,
    Results,
    console,
    fmt,
    quantile,
    require_extras,
    run_client,
    scrape,
    table,
    wait_idle,
)
from fleetward.chaos.harness import TestFleet
from fleetward.fleet.bus import Event, MqttBus
from fleetward.fleet.config import RouterConfig, SimConfig, SupervisorConfig, VllmConfig
from fleetward.fleet.etcd import Compare, EtcdStore, LeaseKeeper, Put
from fleetward.fleet.keys import Keys
from fleetward.fleet.procs import ManagedProcess, free_port
from fleetward.fleet.worker import HealthRecord, HealthState, WorkerRecord
from fleetward.supervisor.signals import Severity, Signal

__all__ = ["DetectBench", "run_detect_bench"]

SIM = SimConfig(seed=5)  # the default, GPU-like latency model (as bench migration)
ADMIN_TOKEN = "bench-detect-admin-token"
# Remediation settings only: a crash-loop budget this many trials would exhaust, and quick restarts.
# Detection itself runs with the defaults (canaries, progress polling, the router's stall floor).
LATENCY_SUPERVISOR = SupervisorConfig(restart_budget=1000, backoff_initial_s=0.1, backoff_max_s=1.0)
VLLM_SUPERVISOR = SupervisorConfig(restart_budget=1000, backoff_initial_s=0.1, backoff_max_s=1.0,
                                   canary_timeout_s=5.0)  # as tests/vllm: a CPU canary can wait behind a batch
# The soak's request mix: prompt and output lengths in tokens (the sim's context is 4096).
MIX: tuple[dict[str, Any], ...] = (
    {"name": "short", "weight": 0.50, "prompt": [32, 256], "max_tokens": [64, 256]},
    {"name": "long", "weight": 0.35, "prompt": [512, 1536], "max_tokens": [64, 256]},
    {"name": "near-context", "weight": 0.15, "prompt": [2048, 3584], "max_tokens": [16, 256]},
)
FALSE_POSITIVE_KINDS = ("hang.detected", "restart", "quarantine")


@dataclass(frozen=True)
class DetectBench:
    out: Path
    parts: tuple[str, ...] = ("latency", "soak", "cpu")
    sim_trials: int = 10
    streams: int = 24
    max_tokens: int = 300
    prompt_len: int = 128
    fault_after_s: float = 2.0
    vllm: bool = False
    vllm_trials: int = 2
    vllm_streams: int = 4
    soak_s: float = 600.0
    calib_s: float = 30.0
    calib_warmup_s: float = 10.0
    calib_streams: int = 384
    load: float = 0.9
    cpu_workers: tuple[int, ...] = (100, 1000)
    cpu_window_s: float = 60.0
    cpu_settle_s: float | None = None  # default: one canary interval + 5 s
    cpu_routers: int = 2
    profile: bool = False
    profile_s: float = 20.0
    plots: bool = True
    etcd: str | None = None
    mqtt: str | None = None


# -- shared pieces ------------------------------------------------------------------------------------------


class _Events:
    """Every event of one cluster as it arrives, with this process's monotonic time of arrival."""

    def __init__(self, bus: MqttBus) -> None:
        self.seen: list[tuple[float, Event]] = []
        self.subscribed = asyncio.Event()
        self._new = asyncio.Event()
        self._task = asyncio.create_task(self._run(bus), name="bench-events")

    async def _run(self, bus: MqttBus) -> None:
        async for e in bus.subscribe(subscribed=self.subscribed):
            self.seen.append((time.monotonic(), e))
            self._new.set()

    def find(self, pred: Callable[[Event], bool], since: float) -> tuple[float, Event] | None:
        return next(((t, e) for t, e in self.seen if t >= since and pred(e)), None)

    def since(self, since: float, until: float = float("inf")) -> list[tuple[float, Event]]:
        return [(t, e) for t, e in self.seen if since <= t <= until]

    async def wait(self, pred: Callable[[Event], bool], since: float, timeout: float) -> tuple[float, Event] | None:
        deadline = time.monotonic() + timeout
        while True:
            hit = self.find(pred, since)
            if hit is not None:
                return hit
            self._new.clear()
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await self._new.wait()
            except TimeoutError:
                return self.find(pred, since)

    async def aclose(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task


def _is_verdict(worker: str) -> Callable[[Event], bool]:
    return lambda e: e.kind == "health.changed" and e.worker == worker and e.data.get("state") == "unhealthy"


async def _start_controller(etcd: str, mqtt: str, cluster: str, run_dir: Path, config: SupervisorConfig,
                            store: EtcdStore) -> tuple[ManagedProcess, str]:
    """``fleetward supervisor --role controller`` as its own process; returns it and its control API URL once
    it leads."""
    conf = run_dir / f"controller-{cluster}.yaml"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(yaml.safe_dump({"cluster": cluster, "supervisor": config.model_dump(mode="json")}))
    cid = f"bench-controller-{uuid.uuid4().hex[:6]}"
    argv = [sys.executable, "-m", "fleetward.fleet.cli", "supervisor", "--role", "controller", "--config", str(conf),
            "--etcd", etcd, "--mqtt", mqtt, "--cluster", cluster, "--id", cid]
    proc = ManagedProcess(cid, argv, log_path=run_dir / "logs" / f"{cid}.log",
                          env={"PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1",
                               "FLEETWARD_ADMIN_TOKEN": ADMIN_TOKEN}).start()
    keys = Keys(cluster)
    url = ""

    async def leads() -> bool:
        nonlocal url
        snap = await store.get_prefix(keys.leader("supervisor"))
        if not snap.items:
            return False
        first = min(snap.items, key=lambda kv: kv.create_revision)
        cand = json.loads(first.json()["candidate"])
        url = cand.get("url", "")
        return bool(cand.get("id") == cid)

    await proc.wait_ready(leads, timeout=120, interval=0.05)
    return proc, url


def _cpu_seconds(pids: Sequence[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
    return total


def _tree_pids(pid: int) -> list[int]:
    try:
        p = psutil.Process(pid)
        return [pid, *(c.pid for c in p.children(recursive=True))]
    except psutil.Error:
        return []


def _stats_ms(values: Sequence[float]) -> dict[str, Any]:
    """n, p50, p99, min, max, mean in ms of values in seconds (p99 of a few trials is their max)."""
    if not values:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "min_ms": None, "max_ms": None, "mean_ms": None}
    ms = [v * 1000.0 for v in values]
    return {"n": len(ms), "p50_ms": statistics.median(ms), "p99_ms": quantile(ms, 0.99), "min_ms": min(ms),
            "max_ms": max(ms), "mean_ms": statistics.fmean(ms)}


async def _openloop(spec: dict[str, Any], *, lead_s: float = 1.0) -> dict[str, Any]:
    """Run ``_openloop`` (its own process) on ``spec``; its result."""
    return await run_client("fleetward.chaos.bench._openloop", {**spec, "start_at": time.monotonic() + lead_s},
                            "the open-loop client")


# -- part 1: detection latency ------------------------------------------------------------------------------


@dataclass
class _Sample:
    t0: float
    t1: float
    in_flight: int
    silent_s: float
    allowed_s: float

    @property
    def last_token(self) -> float:
        return (self.t0 + self.t1) / 2 - self.silent_s


async def _poll_progress(router_url: str, worker: str, samples: list[_Sample], interval: float = 0.01) -> None:
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
        while True:
            t0 = time.monotonic()
            with contextlib.suppress(httpx.HTTPError, ValueError):
                view = (await client.get(router_url + "/fleetward/v1/progress")).json()
                t1 = time.monotonic()
                w = (view.get("workers") or {}).get(worker)
                if w is not None:
                    samples.append(_Sample(t0, t1, int(w["in_flight"]), float(w["silent_for_s"]),
                                           float(w["allowed_silence_s"])))
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - t0)))


def _first_miss(samples: list[_Sample], injected: float, until: float) -> dict[str, Any] | None:
    """The router's last relayed token before the hang and the deadline it missed (monotonic), from the
    progress answers between the injection and ``until`` (the verdict's arrival)."""
    window: list[_Sample] = []
    for s in samples:
        if s.t0 < injected or s.t0 > until:
            continue
        if s.in_flight == 0:
            break  # the router moved the streams away: silence is no longer counted
        window.append(s)
    if not window:
        return None
    last = window[-1]
    episode = [s for s in window if abs(s.last_token - last.last_token) < 0.02]
    best = min(episode, key=lambda s: s.t1 - s.t0)
    return {"last_token_mono": best.last_token, "allowed_silence_s": last.allowed_s,
            "first_miss_mono": best.last_token + last.allowed_s, "max_silent_seen_s": max(s.silent_s for s in window),
            "stalled_seen": any(s.silent_s > s.allowed_s for s in window), "samples": len(window),
            "rtt_ms": (best.t1 - best.t0) * 1000.0}


async def _warm_vllm(url: str) -> None:
    """vLLM on a CPU compiles kernels on first use of a shape and stalls the machine meanwhile: a long
    generation and a small batch first (as tests/vllm do)."""
    async with httpx.AsyncClient(timeout=180, trust_env=False) as client:
        async def one(prompt: list[int], n: int) -> None:
            await client.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": n,
                                                             "ignore_eos": True, "temperature": 0})

        await one([40, 41, 42], 1500)
        await asyncio.gather(*(one([50 + i] * (10 + 50 * i), 64) for i in range(8)))


def _inject(fleet: TestFleet, worker: str, fault: str) -> None:
    if fault == "crash":
        fleet.kill(worker)
    elif fault == "engine-kill":
        for p in fleet.handle(worker).engine_processes():
            with contextlib.suppress(psutil.Error):
                if "EngineCore" in p.name():
                    p.send_signal(signal.SIGKILL)
    elif fault == "engine-hang":
        fleet.signal_engine(worker, signal.SIGSTOP)
    else:
        raise ValueError(fault)


async def _trial(fleet: TestFleet, router_url: str, events: _Events, *, backend: str, fault: str, streams: int,
                 max_tokens: int, prompt_len: int, fault_after_s: float, seed: int) -> dict[str, Any]:
    from fleetward.chaos.bench._common import client_load

    model = "tiny" if backend == "vllm" else SIM.model_name
    body = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "return_token_ids": True,
            "temperature": 0}
    verdict_timeout = 30.0
    lead = 1.0
    spec = {"urls": [router_url], "body": body, "prompt_len": prompt_len, "streams": streams, "warmup_s": 0.0,
            "duration_s": fault_after_s + (12.0 if backend == "vllm" else 6.0), "seed": seed, "sock_read_s": 120}
    load = asyncio.create_task(client_load(spec, lead_s=lead))
    await asyncio.sleep(lead + fault_after_s)
    async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
        view = (await client.get(router_url + "/fleetward/v1/progress")).json()["workers"]
    in_flight = {w: int((view.get(w) or {}).get("in_flight", 0)) for w in fleet.worker_ids}
    victim = max(fleet.worker_ids, key=lambda w: (in_flight[w], w))
    pid = fleet.handle(victim).process.pid
    samples: list[_Sample] = []
    hang = fault in ("hang", "engine-hang")
    poller = asyncio.create_task(_poll_progress(router_url, victim, samples)) if hang else None
    if poller is not None:
        await asyncio.sleep(0.1)
    t_mono, t_wall = time.monotonic(), time.time()
    if fault == "hang":
        await fleet.fault(victim, hang=True)
    else:
        _inject(fleet, victim, fault)
    injected_in = time.monotonic() - t_mono
    verdict = await events.wait(_is_verdict(victim), t_mono, verdict_timeout)
    if poller is not None:
        await asyncio.sleep(0.05)
        poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poller
    result = await load
    out: dict[str, Any] = {"backend": backend, "fault": fault, "victim": victim, "victim_pid": pid,
                           "victim_in_flight": in_flight[victim], "injected_wall": t_wall,
                           "inject_call_ms": injected_in * 1000.0, "verdict": None,
                           "requests_ok": result["requests_ok"], "requests_failed": result["requests_failed"],
                           "errors": result["errors"]}
    if verdict is None:
        console.print(f"[red]no unhealthy verdict for {victim} within {verdict_timeout:.0f}s of the {fault}[/red]")
        return out
    recv, ev = verdict
    out["verdict"] = {"ts": ev.ts, "detector": ev.data.get("detector"), "reason": ev.data.get("reason"),
                      "latency_s": ev.ts - t_wall, "observed_s": recv - t_mono}
    hang_ev = events.find(lambda e: e.kind == "hang.detected" and e.worker == victim, t_mono)
    out["hang_detected"] = None if hang_ev is None else {"ts": hang_ev[1].ts, "latency_s": hang_ev[1].ts - t_wall,
                                                         "detector": hang_ev[1].data.get("detector")}
    suspect = events.find(lambda e: e.kind == "health.changed" and e.worker == victim
                          and e.data.get("state") == "suspect", t_mono)
    out["suspect"] = None if suspect is None or suspect[0] > recv else {
        "latency_s": suspect[1].ts - t_wall, "detector": suspect[1].data.get("detector"),
        "reason": suspect[1].data.get("reason")}
    if hang:
        miss = _first_miss(samples, t_mono, recv)
        out["silence"] = miss
        if miss is not None:
            offset = t_wall - t_mono  # wall minus monotonic, this process, at the injection
            out["silence"]["first_miss_wall"] = miss["first_miss_mono"] + offset
            out["silence"]["last_token_after_inject_s"] = miss["last_token_mono"] - t_mono
            out["verdict"]["after_first_miss_s"] = ev.ts - (miss["first_miss_mono"] + offset)
    return out


async def _restore(fleet: TestFleet, *, vllm: bool, warm: dict[str, int]) -> None:
    """Until every worker is back and ready (the supervisor restarts the failed one); warm up new vLLM ones."""
    await fleet.wait_healthy(timeout=300 if vllm else 90)
    for wid, h in fleet.agent.handles.items():
        if vllm and warm.get(wid) != h.process.pid:
            await _warm_vllm(h.url)
        warm[wid] = h.process.pid
    await fleet.wait_healthy(timeout=300 if vllm else 90)


async def _latency(cfg: DetectBench, infra: Infra, backend: str, res: Results) -> None:
    vllm = backend == "vllm"
    run_dir = cfg.out / f"run-latency-{backend}"
    faults = ("crash", "engine-kill", "engine-hang") if vllm else ("crash", "hang")
    trials = cfg.vllm_trials if vllm else cfg.sim_trials
    plan = [f for _ in range(trials) for f in faults]
    model_path = None
    if vllm:
        from fleetward.fleet.tinymodel import write_tiny_model

        model_path = (Path(".fleetward") / "models" / "tiny-seed0").resolve()  # the workers run in their own folders
        if not (model_path / "config.json").exists():
            write_tiny_model(model_path)
    sup = VLLM_SUPERVISOR if vllm else LATENCY_SUPERVISOR
    assert infra.etcd and infra.mqtt
    cluster = f"bench-detect-{backend}-{uuid.uuid4().hex[:6]}"
    console.print(f"latency on {backend}: starting {'2 vLLM' if vllm else '3 simulated'} workers, a router and a "
                  "controller process…")
    fleet = TestFleet(etcd=infra.etcd, mqtt=infra.mqtt, cluster=cluster, run_dir=run_dir, workers=2 if vllm else 3,
                      backend=backend, sim=SIM, vllm=VllmConfig(nice=10), model_path=model_path,
                      routing=RouterConfig(), supervisor=sup, controller=False, node="cpu" if vllm else "node",
                      admin_token=ADMIN_TOKEN)
    ctl: ManagedProcess | None = None
    events: _Events | None = None
    async with fleet:
        try:
            ctl, _ = await _start_controller(infra.etcd, infra.mqtt, cluster, run_dir, sup, fleet.store)
            events = _Events(fleet.bus)
            await events.subscribed.wait()
            warm: dict[str, int] = {}
            await _restore(fleet, vllm=vllm, warm=warm)
            router = await fleet.start_router("bench-detect")
            for i, fault in enumerate(plan):
                console.print(f"  trial {i + 1}/{len(plan)}: {backend} {fault}")
                trial = await _trial(fleet, router.url, events, backend=backend, fault=fault,
                                     streams=cfg.vllm_streams if vllm else cfg.streams,
                                     max_tokens=1000 if vllm else cfg.max_tokens,
                                     prompt_len=64 if vllm else cfg.prompt_len,
                                     fault_after_s=(4.0 if vllm else cfg.fault_after_s), seed=i)
                v = trial["verdict"]
                if v is not None:
                    extra = f", {v['after_first_miss_s'] * 1000:.0f} ms after the first missed deadline" \
                        if "after_first_miss_s" in v else ""
                    console.print(f"    verdict after {v['latency_s'] * 1000:.1f} ms ({v['detector']}){extra}")
                res.data["latency"]["trials"].append(trial)
                res.write()
                with contextlib.suppress(Exception):
                    # a hung sim worker the supervisor did not restart: let it run again
                    if fault == "hang" and fleet.agent.handles[trial["victim"]].process.pid == trial["victim_pid"]:
                        await fleet.fault(trial["victim"], clear=True)
                await _restore(fleet, vllm=vllm, warm=warm)
        finally:
            if events is not None:
                await events.aclose()
            if ctl is not None:
                await ctl.stop(grace=5)


def _summarize_latency(res: Results) -> None:
    trials = res.data["latency"]["trials"]
    summary: dict[str, Any] = {}
    rows = []
    for backend in ("sim", "vllm"):
        for fault in ("crash", "engine-kill", "hang", "engine-hang"):
            ts = [t for t in trials if t["backend"] == backend and t["fault"] == fault]
            if not ts:
                continue
            got = [t for t in ts if t["verdict"] is not None]
            s: dict[str, Any] = {
                "trials": len(ts), "verdicts": len(got),
                "detectors": dict(collections.Counter(t["verdict"]["detector"] for t in got)),
                "verdict": _stats_ms([t["verdict"]["latency_s"] for t in got]),
                "observed": _stats_ms([t["verdict"]["observed_s"] for t in got]),
                "hang_detected_events": sum(1 for t in got if t.get("hang_detected")),
            }
            if fault in ("hang", "engine-hang"):
                after = [t["verdict"]["after_first_miss_s"] for t in got if "after_first_miss_s" in t["verdict"]]
                s["after_first_miss"] = _stats_ms(after)
                s["allowed_silence_s"] = [t["silence"]["allowed_silence_s"] for t in got if t.get("silence")]
                s["last_token_after_inject"] = _stats_ms(
                    [t["silence"]["last_token_after_inject_s"] for t in got if t.get("silence")])
            summary[f"{backend}/{fault}"] = s
            v, a = s["verdict"], s.get("after_first_miss") or {}
            rows.append([backend, fault, f"{len(got)}/{len(ts)}", ",".join(s["detectors"]), fmt(v["p50_ms"], ".1f"),
                         fmt(v["p99_ms"], ".1f"), fmt(v["max_ms"], ".1f"), fmt(a.get("p50_ms"), ".0f"),
                         fmt(a.get("p99_ms"), ".0f"), fmt(s["observed"]["p50_ms"], ".1f")])
    res.data["latency"]["summary"] = summary
    table("bench detect: fault -> unhealthy verdict (ms)",
          ["backend", "fault", "verdicts", "detector", "p50", "p99", "max", "p50 after miss", "p99 after miss",
           "p50 observed"], rows)


# -- part 2: false positives under load ---------------------------------------------------------------------


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
    return {"ttft": _stats_ms(ttft), "max_gap_per_request": _stats_ms(gaps)}


async def _soak(cfg: DetectBench, infra: Infra, res: Results) -> None:
    assert infra.etcd and infra.mqtt
    run_dir = cfg.out / "run-soak"
    cluster = f"bench-detect-soak-{uuid.uuid4().hex[:6]}"
    sup = SupervisorConfig()
    console.print("soak: starting 3 simulated workers, a router and a controller process (default settings)…")
    fleet = TestFleet(etcd=infra.etcd, mqtt=infra.mqtt, cluster=cluster, run_dir=run_dir, workers=3, sim=SIM,
                      routing=RouterConfig(), supervisor=sup, controller=False, admin_token=ADMIN_TOKEN)
    data: dict[str, Any] = res.data["soak"]
    data["mix"] = list(MIX)
    ctl: ManagedProcess | None = None
    events: _Events | None = None
    async with fleet:
        try:
            ctl, ctl_url = await _start_controller(infra.etcd, infra.mqtt, cluster, run_dir, sup, fleet.store)
            events = _Events(fleet.bus)
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
            if ctl is not None:
                await ctl.stop(grace=5)


def _summarize_soak(res: Results) -> None:
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


# -- part 3: controller CPU at many workers -----------------------------------------------------------------


def _targeting_prompts(candidates: Sequence[str], wanted: Sequence[str], seed: int) -> dict[str, list[int]]:
    """For each wanted worker, a prompt that the router's rendezvous hashing (LeastLoadedAffinity over
    ``candidates``) sends to it when loads are even."""
    from fleetward.migration.policy import prefix_key

    rng = random.Random(seed)
    left = set(wanted)
    out: dict[str, list[int]] = {}
    encoded = [(w, w.encode()) for w in candidates]
    tries = 0
    while left and tries < 40 * max(1, len(candidates)) * 10:
        tries += 1
        prompt = [rng.randrange(16, 250) for _ in range(8)]
        key = prefix_key(prompt)
        best = max(encoded, key=lambda we: hashlib.blake2b(key + we[1], digest_size=8).digest())[0]
        if best in left:
            left.discard(best)
            out[best] = prompt
    return out


async def _register(store: EtcdStore, keys: Keys, lease: int, host_url: str, ids: Sequence[tuple[int, str]],
                    pid: int, *, per_s: float = 50.0) -> None:
    """Register workers as a node agent does: ``starting`` health (create-only), the process signal, then
    ``workers/<id>`` under the lease; 40 workers per transaction (etcd allows 128 operations), ``per_s``
    workers a second (agents bring workers up over time; each new worker gets a canary at once)."""
    now = time.time()
    for i in range(0, len(ids), 40):
        chunk = ids[i:i + 40]
        for n, wid in chunk:
            node = f"node{n // 8}"
            rec = HealthRecord(HealthState.STARTING, reason="launched", detector="agent", since=now,
                               extra={"node": node})
            key = keys.health_of(wid)
            await store.txn([Compare(key, "create", "==", 0)], [Put(key, rec.to_json())])
        puts = []
        for n, wid in chunk:
            node = f"node{n // 8}"
            sig = Signal(wid, "process", Severity.OK, f"running (pid {pid})", time.time())
            puts.append(Put(keys.signal(wid, "process"), sig.to_json()))
            rec = WorkerRecord(id=wid, url=f"{host_url}/w/{n}", role="aggregated", model=SIM.model_name, node=node,
                               backend="sim", started_at=now, pid=pid)
            puts.append(Put(keys.worker(wid), rec.to_json(), lease))
        await store.txn((), puts)
        await asyncio.sleep(len(chunk) / per_s)


async def _count_ready(store: EtcdStore, keys: Keys) -> dict[str, int]:
    snap = await store.get_prefix(keys.health)
    counts: dict[str, int] = {}
    for kv in snap.items:
        st = str(orjson.loads(kv.value).get("state"))
        counts[st] = counts.get(st, 0) + 1
    return counts


async def _wait_ready(store: EtcdStore, keys: Keys, n: int, *, timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while True:
            if (await _count_ready(store, keys)).get("ready", 0) >= n:
                return
            await asyncio.sleep(0.5)


async def _prime_routers(routers: Sequence[str], prompts: dict[str, list[int]]) -> int:
    """One 1-token request per worker through each router, so every router's progress view lists every worker."""
    sent = 0
    limit = asyncio.Semaphore(16)
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        async def one(url: str, prompt: list[int]) -> None:
            nonlocal sent
            async with limit:
                with contextlib.suppress(httpx.HTTPError):
                    r = await client.post(url + "/v1/completions", json={"model": SIM.model_name, "prompt": prompt,
                                                                         "max_tokens": 1, "temperature": 0})
                    sent += r.status_code == 200

        await asyncio.gather(*(one(u, p) for u in routers for p in prompts.values()))
    return sent


async def _profile(pid: int, seconds: float, out: Path) -> dict[str, Any] | None:
    exe = Path(sys.executable).parent / "py-spy"
    found = str(exe) if exe.exists() else shutil.which("py-spy")
    if not found:
        console.print("[yellow]py-spy not found: no profile[/yellow]")
        return None
    raw = out / "detect-controller-profile.txt"
    proc = await asyncio.create_subprocess_exec(found, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "100",
                                                "--format", "raw", "-o", str(raw), "--nonblocking",
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0 or not raw.exists():
        console.print(f"[yellow]py-spy failed: {err.decode()[-500:]}[/yellow]")
        return None
    return _profile_summary(raw)


def _profile_summary(raw: Path) -> dict[str, Any]:
    """Shares of samples: by the function on top (self), and by a few known entry points (inclusive)."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    files: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        top = frames[-1]
        own[top.split(" (", 1)[0] + " (" + top.rsplit("/", 1)[-1]] += n
        seen: set[str] = set()
        for f in frames:
            name = f.split(" (", 1)[0]
            where = f.split(" (", 1)[1] if " (" in f else ""
            label = f"{name} ({where.rsplit('/', 1)[-1].split(':')[0]})"
            if label not in seen:
                seen.add(label)
                inclusive[label] += n
        top_where = top.split(" (", 1)[1] if " (" in top else ""
        pkg = top_where.split("site-packages/", 1)[-1].split("/", 1)[0] if "site-packages/" in top_where else (
            "python stdlib" if "/lib/python" in top_where else "fleetward" if top_where else "?")
        files[pkg] += n

    def shares(c: collections.Counter[str], k: int) -> list[tuple[str, float]]:
        return [(name, n / total) for name, n in c.most_common(k)] if total else []

    return {"samples": total, "self_top": shares(own, 25), "inclusive_top": shares(inclusive, 60),
            "self_by_package": shares(files, 15)}


async def _cpu(cfg: DetectBench, infra: Infra, res: Results) -> None:
    assert infra.etcd and infra.mqtt
    run_dir = cfg.out / "run-cpu"
    logs = run_dir / "logs"
    cluster = f"bench-detect-cpu-{uuid.uuid4().hex[:6]}"
    keys = Keys(cluster)
    sizes = sorted(set(cfg.cpu_workers))
    n_max = sizes[-1]
    sup = SupervisorConfig()
    settle = cfg.cpu_settle_s if cfg.cpu_settle_s is not None else sup.canary_interval_s + 5.0
    data: dict[str, Any] = res.data["cpu"]
    data.update({"supervisor": sup.model_dump(), "settle_s": settle, "window_s": cfg.cpu_window_s, "steps": []})
    store = EtcdStore(infra.etcd)
    bus = await MqttBus(infra.mqtt, cluster).start()
    events = _Events(bus)
    procs: list[ManagedProcess] = []
    lease: LeaseKeeper | None = None
    ctl: ManagedProcess | None = None
    try:
        await events.subscribed.wait()
        port = free_port()
        host_url = f"http://127.0.0.1:{port}"
        console.print(f"cpu: {n_max} simulated workers in one process, a controller and {cfg.cpu_routers} router(s)…")
        host = ManagedProcess("multisim", [sys.executable, "-m", "fleetward.chaos.bench._multisim", "--port", str(port),
                                           "--workers", str(n_max), "--config-json", SIM.model_dump_json(),
                                           "--admin-token", ADMIN_TOKEN],
                              log_path=logs / "multisim.log", env={"PYTHONSAFEPATH": "1"}).start()
        procs.append(host)
        async with httpx.AsyncClient(timeout=2, trust_env=False) as client:
            async def host_up() -> bool:
                return (await client.get(f"{host_url}/w/0/health")).status_code == 200

            await host.wait_ready(host_up, timeout=120, interval=0.2)
        ctl, ctl_url = await _start_controller(infra.etcd, infra.mqtt, cluster, run_dir, sup, store)
        routers: list[tuple[str, ManagedProcess]] = []
        for r in range(cfg.cpu_routers):
            rport = free_port()
            rp = ManagedProcess(f"router-{r}", [sys.executable, "-m", "fleetward.fleet.cli", "router", "--etcd",
                                                infra.etcd, "--mqtt", infra.mqtt, "--cluster", cluster, "--port",
                                                str(rport), "--id", f"bench-cpu-router-{r}"],
                                log_path=logs / f"router-{r}.log", env={"PYTHONSAFEPATH": "1"}).start()
            procs.append(rp)
            routers.append((f"http://127.0.0.1:{rport}", rp))
        async with httpx.AsyncClient(timeout=2, trust_env=False) as client:
            for url, rp in routers:
                async def router_up(u: str = url) -> bool:
                    return (await client.get(u + "/health")).status_code == 200

                await rp.wait_ready(router_up, timeout=60, interval=0.1)
        lease = await LeaseKeeper(store, 10).start()
        ids = [(i, f"sim{i:04d}") for i in range(n_max)]
        registered = 0
        for size in sizes:
            console.print(f"  registering workers {registered}..{size - 1} and waiting until they are ready…")
            t_reg = time.monotonic()
            await _register(store, keys, lease.id, host_url, ids[registered:size], host.pid)
            await _wait_ready(store, keys, size, timeout=300)
            ready_after = time.monotonic() - t_reg
            prompts = await asyncio.to_thread(_targeting_prompts, [w for _, w in ids[:size]],
                                              [w for _, w in ids[registered:size]], seed=size)
            primed = await _prime_routers([u for u, _ in routers], prompts)
            registered = size
            console.print(f"  {size} ready after {ready_after:.1f}s; routers primed ({primed} requests); settling "
                          f"{settle:.0f}s…")
            await asyncio.sleep(settle)
            views = []
            async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
                for url, _ in routers:
                    views.append(len((await client.get(url + "/fleetward/v1/progress")).json().get("workers", {})))
            pids = {"controller": [ctl.pid], "workers host": _tree_pids(host.pid),
                    "routers": [rp.pid for _, rp in routers], "etcd": [infra.etcd_pid] if infra.etcd_pid else [],
                    "bench (registrations, events)": [os.getpid()]}
            m0 = await scrape(ctl_url + "/metrics")
            c0 = {k: _cpu_seconds(v) for k, v in pids.items()}
            t0 = time.monotonic()
            series = []
            while time.monotonic() - t0 < cfg.cpu_window_s:
                a, ta = _cpu_seconds(pids["controller"]), time.monotonic()
                await asyncio.sleep(min(5.0, max(0.5, cfg.cpu_window_s - (ta - t0))))
                series.append({"t": time.monotonic() - t0,
                               "cores": (_cpu_seconds(pids["controller"]) - a) / (time.monotonic() - ta)})
            c1, t1 = {k: _cpu_seconds(v) for k, v in pids.items()}, time.monotonic()
            m1 = await scrape(ctl_url + "/metrics")
            window = t1 - t0
            cores = {k: (c1[k] - c0[k]) / window for k in pids}
            canaries = {k.split('result="', 1)[1].rstrip('"}'): (v - m0.get(k, 0.0)) / window for k, v in m1.items()
                        if k.startswith("fleetward_supervisor_canaries_total{")}
            health = await _count_ready(store, keys)
            transitions = [e.data.get("state") for t, e in events.since(t0 + 0.0, t1) if e.kind == "health.changed"]
            rss = 0.0
            with contextlib.suppress(psutil.Error):
                rss = psutil.Process(ctl.pid).memory_info().rss / 2**20
            step = {"workers": size, "window_s": window, "cpu_cores": cores, "controller_series": series,
                    "canaries_per_s": canaries, "health": health, "transitions_in_window": len(transitions),
                    "transition_states": dict(collections.Counter(transitions)), "router_view_workers": views,
                    "ready_after_registration_s": ready_after, "controller_rss_mib": rss,
                    "load_avg": os.getloadavg()}
            data["steps"].append(step)
            console.print(f"  {size} workers: controller {cores['controller']:.3f} cores, canaries "
                          f"{sum(canaries.values()):.1f}/s, transitions in window {len(transitions)}")
            res.write()
        if cfg.profile:
            console.print(f"  profiling the controller with py-spy for {cfg.profile_s:.0f}s…")
            data["profile"] = await _profile(ctl.pid, cfg.profile_s, cfg.out)
    finally:
        await events.aclose()
        if ctl is not None:
            await ctl.stop(grace=5)
        for p in reversed(procs):
            await p.stop(grace=5)
        if lease is not None:
            await lease.aclose()
        with contextlib.suppress(Exception):
            await store.delete(keys.root, prefix=True)
        await bus.aclose()
        await store.aclose()


def _summarize_cpu(res: Results) -> None:
    rows = []
    for s in res.data["cpu"]["steps"]:
        c = s["cpu_cores"]
        rows.append([str(s["workers"]), fmt(c["controller"], ".3f"), fmt(c["workers host"], ".3f"),
                     fmt(c["routers"], ".3f"), fmt(c["etcd"], ".3f"), fmt(sum(s["canaries_per_s"].values()), ".1f"),
                     str(s["transitions_in_window"]), ",".join(map(str, s["router_view_workers"])),
                     fmt(s["controller_rss_mib"], ".0f")])
    table("bench detect: controller CPU (cores) in steady state",
          ["workers", "controller", "workers host", "routers", "etcd", "canaries/s", "transitions", "router views",
           "controller MiB"], rows)


# -- the command --------------------------------------------------------------------------------------------


async def run_detect_bench(cfg: DetectBench) -> Results:
    require_extras(plots=cfg.plots)
    res = Results("detect", cfg.out, {"config": {**cfg.__dict__, "out": str(cfg.out)}, "sim": SIM.model_dump(),
                                      "routing": RouterConfig().model_dump(),
                                      "latency": {"supervisor": LATENCY_SUPERVISOR.model_dump(),
                                                  "vllm_supervisor": VLLM_SUPERVISOR.model_dump(), "trials": []},
                                      "soak": {}, "cpu": {}})
    failed: list[str] = []

    async def part(name: str, run: Callable[[], Any], summarize: Callable[[Results], None]) -> None:
        """One part; its failure is recorded and reported, and the other parts still run and are kept."""
        try:
            await run()
            summarize(res)
        except Exception as exc:
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
            res.data[name]["error"] = failed[-1]
            console.print(f"[red]part {name} failed:[/] {type(exc).__name__}: {exc}")
        res.write()

    async def latency() -> None:
        await _latency(cfg, infra, "sim", res)
        if cfg.vllm:
            await _latency(cfg, infra, "vllm", res)

    async with Infra(cfg.out / "run-infra", cfg.etcd, cfg.mqtt).up() as infra:
        if "latency" in cfg.parts:
            await part("latency", latency, _summarize_latency)
        if "soak" in cfg.parts:
            await part("soak", lambda: _soak(cfg, infra, res), _summarize_soak)
        if "cpu" in cfg.parts:
            await part("cpu", lambda: _cpu(cfg, infra, res), _summarize_cpu)
    res.write()
    if cfg.plots:
        _plot(res)
    if failed:
        raise BenchError("; ".join(failed) + f" (what the other parts measured is in {res.json_path})")
    return res


# -- plots --------------------------------------------------------------------------------------------------


def _plot(res: Results) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fleetward.chaos.bench import _plots

    trials = res.data["latency"]["trials"]
    if trials:
        groups: dict[str, list[float]] = {}
        for t in trials:
            if t["verdict"] is None:
                continue
            groups.setdefault(f"{t['backend']} {t['fault']}\nkill/hang -> verdict", []).append(
                t["verdict"]["latency_s"] * 1000)
            if "after_first_miss_s" in t["verdict"]:
                groups.setdefault(f"{t['backend']} {t['fault']}\nmissed deadline -> verdict", []).append(
                    t["verdict"]["after_first_miss_s"] * 1000)
        fig, ax = plt.subplots(figsize=(9, 4.4), dpi=110)
        names = list(groups)
        rng = random.Random(0)
        for i, name in enumerate(names):
            ys = groups[name]
            ax.scatter([i + rng.uniform(-0.12, 0.12) for _ in ys], [max(y, 0.5) for y in ys], s=18,
                       color="#4c72b0" if "miss" not in name else "#dd8452", alpha=0.8)
            ax.hlines(statistics.median(ys), i - 0.3, i + 0.3, color="black", linewidth=1.2)
        ax.axhline(100, color="#c44e52", linestyle="--", linewidth=0.8, label="crash target 100 ms")
        ax.axhline(2000, color="#55a868", linestyle="--", linewidth=0.8, label="hang target 2 s after the miss")
        ax.set_yscale("log")
        ax.set_xticks(range(len(names)), names, fontsize=7)
        ax.set_ylabel("ms (log; bar = median; values < 0.5 ms drawn at 0.5)")
        ax.set_title("Fault -> unhealthy verdict, each trial", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(res.plot_path("latency"))
        plt.close(fig)
    soak = res.data["soak"].get("soak")
    if soak and soak["load_samples"]:
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
    steps = res.data["cpu"].get("steps") or []
    if steps:
        comps = ["controller", "workers host", "routers", "etcd"]
        _plots.grouped_bars(res.plot_path("controller-cpu"),
                            title="CPU in steady state (cores), by registered simulated workers",
                            groups=[f"{s['workers']} workers" for s in steps],
                            series={c: [s["cpu_cores"].get(c) for s in steps] for c in comps},
                            ylabel="cores", hline=1.0, fmt="{:.3f}")
