"""``fleetward bench detect``, part **cpu**: the supervisor controller's CPU at many workers.

``workers`` simulated workers hosted in one process (``_multisim``: worker ``i`` under ``/w/<i>``),
registered in etcd the way a node agent does it (``health/<id>`` starting, the process signal,
``workers/<id>`` under a lease), a controller process with default settings, and routers whose progress
views list every worker (one request per worker through each router). Once every worker is ready and a
full canary interval has passed, the controller's CPU (psutil ``cpu_times``, user + system) is measured
over a window, at each size of ``workers`` in turn (the smaller one is the baseline). Optionally
``py-spy`` profiles the controller afterwards.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import shutil
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil

from fleetward.chaos.bench._common import Infra, Results, console, fmt, metric_delta, scrape, table
from fleetward.chaos.bench._detect import ADMIN_TOKEN, SIM, DetectBench, Events
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.bus import MqttBus
from fleetward.fleet.config import SupervisorConfig
from fleetward.fleet.etcd import Compare, EtcdStore, Put
from fleetward.fleet.keys import Keys
from fleetward.fleet.launch import (
    ServiceProcess,
    controller_argv,
    router_argv,
    service_env,
    start_service,
    wait_leader,
    write_service_config,
)
from fleetward.fleet.lease import LeaseKeeper
from fleetward.fleet.procs import ManagedProcess, free_port
from fleetward.fleet.worker import WorkerRecord
from fleetward.migration.policy import prefix_key, rendezvous
from fleetward.supervisor.agent import launched_health, running_signal

__all__ = ["plot", "run", "section", "summarize"]


def section() -> dict[str, Any]:
    return {}


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


def _targeting_prompts(candidates: Sequence[str], wanted: Sequence[str], seed: int) -> dict[str, list[int]]:
    """For each wanted worker, a prompt that the router's rendezvous hashing (LeastLoadedAffinity over
    ``candidates``) sends to it when loads are even."""
    rng = random.Random(seed)
    left = set(wanted)
    out: dict[str, list[int]] = {}
    tries = 0
    while left and tries < 40 * max(1, len(candidates)) * 10:
        tries += 1
        prompt = [rng.randrange(16, 250) for _ in range(8)]
        best = rendezvous(candidates, prefix_key(prompt))
        if best in left:
            left.discard(best)
            out[best] = prompt
    return out


def _node(n: int) -> str:
    return f"node{n // 8}"


async def _register(store: EtcdStore, keys: Keys, lease: int, host_url: str, ids: Sequence[tuple[int, str]],
                    pid: int, *, per_s: float = 50.0) -> None:
    """Register workers with the records a node agent writes: ``starting`` health (create-only), the process
    signal, then ``workers/<id>`` under the lease. Batched as no agent does: 40 workers per transaction (etcd
    allows 128 operations), ``per_s`` workers a second (agents bring workers up over time; each new worker
    gets a canary at once)."""
    now = time.time()
    for i in range(0, len(ids), 40):
        chunk = ids[i:i + 40]
        for n, wid in chunk:
            key = keys.health_of(wid)
            await store.txn([Compare(key, "create", "==", 0)], [Put(key, launched_health(_node(n), now).to_json())])
        puts = []
        for n, wid in chunk:
            puts.append(Put(keys.signal(wid, "process"), running_signal(wid, pid, time.time()).to_json()))
            rec = WorkerRecord(id=wid, url=f"{host_url}/w/{n}", role="aggregated", model=SIM.model_name,
                               node=_node(n), backend=SimBackend.name, started_at=now, pid=pid)
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


@dataclass
class _Services:
    """What the part runs besides etcd and the broker: the workers' host, a controller, routers."""

    host: ManagedProcess
    host_url: str
    controller: ServiceProcess
    routers: list[ServiceProcess]


async def _start(cfg: DetectBench, infra: Infra, cluster: str, run_dir: Path, sup: SupervisorConfig,
                 store: EtcdStore, started: list[ManagedProcess]) -> _Services:
    """The workers' host (``n_max`` workers), a controller that leads, ``cfg.cpu_routers`` routers; each
    process goes into ``started`` as it starts, so a failure part way stops what did start."""
    assert infra.etcd and infra.mqtt
    logs = run_dir / "logs"
    port = free_port()
    host_url = f"http://127.0.0.1:{port}"
    host = ManagedProcess("multisim", [sys.executable, "-m", "fleetward.chaos.bench._multisim", "--port", str(port),
                                       "--workers", str(max(cfg.cpu_workers)), "--config-json", SIM.model_dump_json(),
                                       "--admin-token", ADMIN_TOKEN],
                          log_path=logs / "multisim.log", env={"PYTHONSAFEPATH": "1"}).start()
    started.append(host)
    async with httpx.AsyncClient(timeout=2, trust_env=False) as client:
        async def host_up() -> bool:
            return (await client.get(f"{host_url}/w/0/health")).status_code == 200

        await host.wait_ready(host_up, timeout=120, interval=0.2)
    cid, ctl_port = f"bench-controller-{uuid.uuid4().hex[:6]}", free_port()
    conf = write_service_config(run_dir / f"{cid}.yaml", cluster=cluster, supervisor=sup)
    ctl = await start_service(cid, controller_argv(etcd=infra.etcd, mqtt=infra.mqtt, cluster=cluster, config=conf,
                                                   port=ctl_port, controller_id=cid),
                              url=f"http://{sup.host}:{ctl_port}", log_path=logs / f"{cid}.log",
                              env=service_env(admin_token=ADMIN_TOKEN), timeout=120)
    started.append(ctl.process)
    await wait_leader(store, Keys(cluster), timeout=120, leader_id=cid)
    routers = []
    for r in range(cfg.cpu_routers):
        rport = free_port()
        router = await start_service(f"router-{r}", router_argv(etcd=infra.etcd, mqtt=infra.mqtt, cluster=cluster,
                                                                port=rport, router_id=f"bench-cpu-router-{r}"),
                                     url=f"http://127.0.0.1:{rport}", log_path=logs / f"router-{r}.log", timeout=60)
        started.append(router.process)
        routers.append(router)
    return _Services(host, host_url, ctl, routers)


async def _step(size: int, services: _Services, infra: Infra, store: EtcdStore, keys: Keys, events: Events,
                window_s: float, ready_after: float) -> dict[str, Any]:
    """The CPU of each component (and the controller's over time) over a window of ``window_s``."""
    views = []
    async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
        for r in services.routers:
            views.append(len((await client.get(r.url + "/fleetward/v1/progress")).json().get("workers", {})))
    ctl = services.controller
    pids = {"controller": [ctl.process.pid], "workers host": _tree_pids(services.host.pid),
            "routers": [r.process.pid for r in services.routers], "etcd": [infra.etcd_pid] if infra.etcd_pid else [],
            "bench (registrations, events)": [os.getpid()]}
    etcd_metrics = f"http://{infra.etcd}/metrics"
    m0, e0 = await scrape(ctl.url + "/metrics"), await scrape(etcd_metrics)
    c0 = {k: _cpu_seconds(v) for k, v in pids.items()}
    t0 = time.monotonic()
    series = []
    while time.monotonic() - t0 < window_s:
        a, ta = _cpu_seconds(pids["controller"]), time.monotonic()
        await asyncio.sleep(min(5.0, max(0.5, window_s - (ta - t0))))
        series.append({"t": time.monotonic() - t0,
                       "cores": (_cpu_seconds(pids["controller"]) - a) / (time.monotonic() - ta)})
    c1, t1 = {k: _cpu_seconds(v) for k, v in pids.items()}, time.monotonic()
    m1, e1 = await scrape(ctl.url + "/metrics"), await scrape(etcd_metrics)
    window = t1 - t0
    written = sum(metric_delta(e0, e1, k) for k in ("etcd_mvcc_put_total", "etcd_mvcc_delete_total"))
    cores = {k: (c1[k] - c0[k]) / window for k in pids}
    canaries = {k.split('result="', 1)[1].rstrip('"}'): (v - m0.get(k, 0.0)) / window for k, v in m1.items()
                if k.startswith("fleetward_supervisor_canaries_total{")}
    health = await _count_ready(store, keys)
    transitions = [e.data.get("state") for t, e in events.since(t0 + 0.0, t1) if e.kind == "health.changed"]
    rss = 0.0
    with contextlib.suppress(psutil.Error):
        rss = psutil.Process(ctl.process.pid).memory_info().rss / 2**20
    return {"workers": size, "window_s": window, "cpu_cores": cores, "controller_series": series,
            "canaries_per_s": canaries, "health": health, "transitions_in_window": len(transitions),
            "transition_states": dict(collections.Counter(transitions)), "router_view_workers": views,
            "ready_after_registration_s": ready_after, "controller_rss_mib": rss, "load_avg": os.getloadavg(),
            "etcd_keys_written_per_s": written / window, "controller_metric_series": len(m1)}


async def run(cfg: DetectBench, infra: Infra, res: Results) -> None:
    assert infra.etcd and infra.mqtt
    run_dir = cfg.out / "run-cpu"
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
    events = Events(bus)
    started: list[ManagedProcess] = []
    lease: LeaseKeeper | None = None
    try:
        await events.subscribed.wait()
        console.print(f"cpu: {n_max} simulated workers in one process, a controller and {cfg.cpu_routers} router(s)…")
        services = await _start(cfg, infra, cluster, run_dir, sup, store, started)
        lease = await LeaseKeeper(store, 10).start()
        ids = [(i, f"sim{i:04d}") for i in range(n_max)]
        registered = 0
        for size in sizes:
            console.print(f"  registering workers {registered}..{size - 1} and waiting until they are ready…")
            t_reg = time.monotonic()
            await _register(store, keys, lease.id, services.host_url, ids[registered:size], services.host.pid)
            await _wait_ready(store, keys, size, timeout=300)
            ready_after = time.monotonic() - t_reg
            prompts = await asyncio.to_thread(_targeting_prompts, [w for _, w in ids[:size]],
                                              [w for _, w in ids[registered:size]], seed=size)
            primed = await _prime_routers([r.url for r in services.routers], prompts)
            registered = size
            console.print(f"  {size} ready after {ready_after:.1f}s; routers primed ({primed} requests); settling "
                          f"{settle:.0f}s…")
            await asyncio.sleep(settle)
            step = await _step(size, services, infra, store, keys, events, cfg.cpu_window_s, ready_after)
            data["steps"].append(step)
            console.print(f"  {size} workers: controller {step['cpu_cores']['controller']:.3f} cores, canaries "
                          f"{sum(step['canaries_per_s'].values()):.1f}/s, transitions in window "
                          f"{step['transitions_in_window']}")
            res.write()
        if cfg.profile:
            console.print(f"  profiling the controller with py-spy for {cfg.profile_s:.0f}s…")
            data["profile"] = await _profile(services.controller.process.pid, cfg.profile_s, cfg.out)
    finally:
        await events.aclose()
        for p in reversed(started):
            await p.stop(grace=5)
        if lease is not None:
            await lease.aclose()
        with contextlib.suppress(Exception):
            await store.delete(keys.root, prefix=True)
        await bus.aclose()
        await store.aclose()


def summarize(res: Results) -> None:
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


def plot(res: Results) -> None:
    steps = res.data["cpu"].get("steps") or []
    if not steps:
        return
    from fleetward.chaos.bench import _plots

    comps = ["controller", "workers host", "routers", "etcd"]
    _plots.grouped_bars(res.plot_path("controller-cpu"),
                        title="CPU in steady state (cores), by registered simulated workers",
                        groups=[f"{s['workers']} workers" for s in steps],
                        series={c: [s["cpu_cores"].get(c) for s in steps] for c in comps},
                        ylabel="cores", hline=1.0, fmt="{:.3f}")
