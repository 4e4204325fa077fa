"""``fleetward bench detect``, part **latency**: from a fault to the supervisor's ``unhealthy`` verdict.

Simulated workers (and with ``--vllm`` real vLLM on the CPU) under a node agent in this process, a router
process, and a supervisor controller as its own process (``fleetward supervisor --role controller``), as
``fleetward up`` runs them. Closed-loop streams run through the router; one worker (the one with the most
streams) fails:

- ``crash``: SIGKILL of the worker's whole process tree;
- ``engine-kill`` (vLLM): SIGKILL of ``VLLM::EngineCore`` only, the API server stays up;
- ``hang``: the sim's ``hang`` switch (the engine stops, ``/health`` stays 200); on vLLM, SIGSTOP of
  EngineCore (``engine-hang``);
- ``cgroup-freeze``: ``process.hang`` with ``mode: cgroup_freeze``, the engine processes frozen by the cgroup
  freezer, a stop without a signal (vLLM: EngineCore and its Worker, ``/health`` stays 200; sim: its one
  process); ``cgroup-freeze-idle``: the same on a worker with no work at all (no streams run in that trial).
  The fault is recovered (thawed) once the verdict is in, so that the supervisor's restart can complete.

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

After each trial the fleet is restored (:meth:`~fleetward.fleet.handle.Fleet.restore`): the supervisor
restarts the failed worker, and a new vLLM process is warmed up before the next trial.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import random
import signal
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import psutil

from fleetward.chaos.bench._common import Infra, Results, client_load, console, fmt, table, worker_pid
from fleetward.chaos.bench._detect import (
    ADMIN_TOKEN,
    SIM,
    DetectBench,
    Events,
    is_verdict,
    lead_controller,
    stats_ms,
)
from fleetward.chaos.fault import CATALOGUE, Target
from fleetward.chaos.faults.process import FreezerGroup, HangWorker
from fleetward.chaos.harness import TestFleet
from fleetward.fleet.backends import Backend, SimBackend, VllmBackend
from fleetward.fleet.config import RouterConfig, SupervisorConfig, VllmConfig
from fleetward.sim.tinymodel import ensure_tiny_model

__all__ = ["plot", "run", "section", "summarize"]

# Remediation settings only: a crash-loop budget this many trials would exhaust, and quick restarts.
# Detection itself runs with the defaults (canaries, progress polling, the router's stall floor).
LATENCY_SUPERVISOR = SupervisorConfig(restart_budget=1000, backoff_initial_s=0.1, backoff_max_s=1.0)
VLLM_SUPERVISOR = SupervisorConfig(restart_budget=1000, backoff_initial_s=0.1, backoff_max_s=1.0,
                                   canary_timeout_s=5.0)  # as tests/vllm: a CPU canary can wait behind a batch
FAULTS = ("crash", "engine-kill", "hang", "engine-hang", "cgroup-freeze", "cgroup-freeze-idle")
HANGS = ("hang", "engine-hang", "cgroup-freeze")
FREEZES = ("cgroup-freeze", "cgroup-freeze-idle")
VERDICT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class _Plan:
    """One backend's trials: its fleet, its faults and its load."""

    make_backend: Callable[[], Backend]  # called when its trials start (vLLM's model is written then)
    workers: int
    what: str  # the workers, as the progress line names them
    node: str
    faults: tuple[str, ...]
    trials: int
    streams: int
    max_tokens: int
    prompt_len: int
    fault_after_s: float
    load_after_fault_s: float  # the load runs on this long after the fault
    supervisor: SupervisorConfig
    ready_timeout_s: float  # for the fleet to be back after a trial


def _tiny_vllm() -> Backend:
    # nice 10: on two cores vLLM's spinning OMP threads must not starve etcd, routers and the bench
    backend = VllmBackend(VllmConfig(nice=10))  # the tiny local model under .fleetward
    ensure_tiny_model(backend.model_path, tokenizer=backend.config.tokenizer)
    return backend


def _plans(cfg: DetectBench) -> list[_Plan]:
    freezes = FREEZES if FreezerGroup.unavailable_reason() is None else ()
    plans = [_Plan(lambda: SimBackend(SIM), workers=3, what="simulated", node="node",
                   faults=("crash", "hang", *freezes),
                   trials=cfg.sim_trials, streams=cfg.streams, max_tokens=cfg.max_tokens, prompt_len=cfg.prompt_len,
                   fault_after_s=cfg.fault_after_s, load_after_fault_s=6.0, supervisor=LATENCY_SUPERVISOR,
                   ready_timeout_s=90)]
    if cfg.vllm:
        plans.append(_Plan(_tiny_vllm, workers=2, what="vLLM", node="cpu",
                           faults=("crash", "engine-kill", "engine-hang", *freezes), trials=cfg.vllm_trials,
                           streams=cfg.vllm_streams, max_tokens=1000, prompt_len=64, fault_after_s=4.0,
                           load_after_fault_s=12.0, supervisor=VLLM_SUPERVISOR, ready_timeout_s=300))
    if cfg.faults:
        plans = [dataclasses.replace(p, faults=tuple(f for f in p.faults if f in cfg.faults)) for p in plans]
    return [p for p in plans if p.faults]


def section() -> dict[str, Any]:
    return {"supervisor": LATENCY_SUPERVISOR.model_dump(), "vllm_supervisor": VLLM_SUPERVISOR.model_dump(),
            "trials": []}


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


async def _inject(fleet: TestFleet, worker: str, fault: str) -> HangWorker | None:
    """Inject ``fault`` into ``worker``; a fault object that must be recovered once the verdict is in."""
    if fault in FREEZES:
        spec = CATALOGUE["process.hang"]
        hang = spec.factory(spec.params(mode="cgroup_freeze"), Target(kind="worker", ids=(worker,)))
        assert isinstance(hang, HangWorker)
        await hang.inject(fleet.fault_context())
        return hang
    if fault == "crash":
        fleet.kill(worker)
    elif fault == "hang":
        await fleet.fault(worker, hang=True)
    elif fault == "engine-kill":
        for p in fleet.engine_processes(worker):
            with contextlib.suppress(psutil.Error):
                if "EngineCore" in p.name():  # not its workers: the engine dies as it would of its own accord
                    p.send_signal(signal.SIGKILL)
    elif fault == "engine-hang":
        fleet.signal_engine(worker, signal.SIGSTOP)
    else:
        raise ValueError(fault)
    return None


async def _trial(fleet: TestFleet, router_url: str, events: Events, plan: _Plan, fault: str,
                 seed: int) -> dict[str, Any]:
    body = {"model": fleet.backend.model_name, "max_tokens": plan.max_tokens, "ignore_eos": True,
            "return_token_ids": True, "temperature": 0}
    lead = 1.0
    idle = fault.endswith("-idle")  # no streams at all: only what the supervisor sends finds the fault
    spec = {"urls": [router_url], "body": body, "prompt_len": plan.prompt_len, "streams": plan.streams,
            "warmup_s": 0.0, "duration_s": plan.fault_after_s + plan.load_after_fault_s, "seed": seed,
            "sock_read_s": 120}
    load = None if idle else asyncio.create_task(client_load(spec, lead_s=lead))
    await asyncio.sleep(lead + plan.fault_after_s)
    async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
        view = (await client.get(router_url + "/fleetward/v1/progress")).json()["workers"]
    in_flight = {w: int((view.get(w) or {}).get("in_flight", 0)) for w in fleet.worker_ids}
    victim = max(fleet.worker_ids, key=lambda w: (in_flight[w], w))
    if idle:
        victim = fleet.worker_ids[seed % len(fleet.worker_ids)]
    pid = worker_pid(fleet, victim)
    samples: list[_Sample] = []
    hang = fault in HANGS
    poller = asyncio.create_task(_poll_progress(router_url, victim, samples)) if hang else None
    if poller is not None:
        await asyncio.sleep(0.1)
    t_mono, t_wall = time.monotonic(), time.time()
    injected = await _inject(fleet, victim, fault)
    injected_in = time.monotonic() - t_mono
    try:
        verdict = await events.wait(is_verdict(victim), t_mono, VERDICT_TIMEOUT_S)
    finally:
        if injected is not None:  # thawed: the supervisor's restart kills what was frozen
            await injected.recover(fleet.fault_context())
    if poller is not None:
        await asyncio.sleep(0.05)
        poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poller
    result = await load if load is not None else {"requests_ok": 0, "requests_failed": 0, "errors": {}}
    out: dict[str, Any] = {"backend": fleet.backend.name, "fault": fault, "victim": victim, "victim_pid": pid,
                           "victim_in_flight": in_flight[victim], "injected_wall": t_wall,
                           "inject_call_ms": injected_in * 1000.0, "verdict": None,
                           "requests_ok": result["requests_ok"], "requests_failed": result["requests_failed"],
                           "errors": result["errors"]}
    if verdict is None:
        console.print(f"[red]no unhealthy verdict for {victim} within {VERDICT_TIMEOUT_S:.0f}s of the {fault}[/red]")
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


async def _back_to_ready(fleet: TestFleet, plan: _Plan) -> None:
    """Every worker back and ready (the supervisor restarts the failed one; a sim hang it left is switched
    off) and new vLLM processes warmed up; then ready again, as a warm-up can make a worker look silent."""
    await fleet.restore(timeout=plan.ready_timeout_s)
    await fleet.wait_healthy(timeout=plan.ready_timeout_s)


async def _latency(cfg: DetectBench, infra: Infra, plan: _Plan, res: Results) -> None:
    assert infra.etcd and infra.mqtt
    backend = plan.make_backend()
    run_dir = cfg.out / f"run-latency-{backend.name}"
    cluster = f"bench-detect-{backend.name}-{uuid.uuid4().hex[:6]}"
    console.print(f"latency on {backend.name}: starting {plan.workers} {plan.what} workers, a router and a "
                  "controller process…")
    fleet = TestFleet(etcd=infra.etcd, mqtt=infra.mqtt, cluster=cluster, run_dir=run_dir, workers=plan.workers,
                      backend=backend, routing=RouterConfig(), supervisor=plan.supervisor, controller=False,
                      node=plan.node, admin_token=ADMIN_TOKEN)
    events: Events | None = None
    async with fleet:
        try:
            await lead_controller(fleet)
            events = Events(fleet.bus)
            await events.subscribed.wait()
            await _back_to_ready(fleet, plan)
            router = await fleet.start_router("bench-detect")
            faults = [f for _ in range(plan.trials) for f in plan.faults]
            for i, fault in enumerate(faults):
                console.print(f"  trial {i + 1}/{len(faults)}: {backend.name} {fault}")
                trial = await _trial(fleet, router.url, events, plan, fault, seed=i)
                v = trial["verdict"]
                if v is not None:
                    extra = f", {v['after_first_miss_s'] * 1000:.0f} ms after the first missed deadline" \
                        if "after_first_miss_s" in v else ""
                    console.print(f"    verdict after {v['latency_s'] * 1000:.1f} ms ({v['detector']}){extra}")
                res.data["latency"]["trials"].append(trial)
                res.write()
                await _back_to_ready(fleet, plan)
        finally:
            if events is not None:
                await events.aclose()


async def run(cfg: DetectBench, infra: Infra, res: Results) -> None:
    for plan in _plans(cfg):
        await _latency(cfg, infra, plan, res)


def summarize(res: Results) -> None:
    trials = res.data["latency"]["trials"]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = collections.defaultdict(list)
    for t in trials:
        groups[t["backend"], t["fault"]].append(t)
    backends = list(dict.fromkeys(t["backend"] for t in trials))  # in the order they ran
    summary: dict[str, Any] = {}
    rows = []
    for (backend, fault), ts in sorted(groups.items(), key=lambda g: (backends.index(g[0][0]), FAULTS.index(g[0][1]))):
        got = [t for t in ts if t["verdict"] is not None]
        s: dict[str, Any] = {
            "trials": len(ts), "verdicts": len(got),
            "detectors": dict(collections.Counter(t["verdict"]["detector"] for t in got)),
            "verdict": stats_ms([t["verdict"]["latency_s"] for t in got]),
            "observed": stats_ms([t["verdict"]["observed_s"] for t in got]),
            "hang_detected_events": sum(1 for t in got if t.get("hang_detected")),
        }
        if fault in HANGS:
            after = [t["verdict"]["after_first_miss_s"] for t in got if "after_first_miss_s" in t["verdict"]]
            s["after_first_miss"] = stats_ms(after)
            s["allowed_silence_s"] = [t["silence"]["allowed_silence_s"] for t in got if t.get("silence")]
            s["last_token_after_inject"] = stats_ms(
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


def plot(res: Results) -> None:
    trials = res.data["latency"]["trials"]
    if not trials:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
