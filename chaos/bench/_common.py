"""What every benchmark shares: infrastructure, the client processes, statistics, results, progress."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fleetward.fleet.errors import FleetwardError
from fleetward.fleet.handle import Fleet
from fleetward.fleet.infra import LocalBroker, LocalEtcd

__all__ = [
    "BenchError",
    "Infra",
    "Results",
    "cdf_points",
    "client_load",
    "client_main",
    "console",
    "fmt",
    "histogram_quantiles",
    "metric_delta",
    "metric_total",
    "progress",
    "quantile",
    "ratio",
    "require_extras",
    "run_client",
    "scrape",
    "summarize",
    "table",
    "vllm_router_argv",
    "wait_idle",
    "worker_pid",
]

console = Console(stderr=True, highlight=False, soft_wrap=True)
INSTALL_HINT = "pip install 'fleetward[bench]'"


class BenchError(FleetwardError):
    """A benchmark could not run (a missing extra, a component that did not start)."""


def vllm_router_argv() -> list[str]:
    """How to start ``vllm-router`` (the PyPI package's console script, next to this interpreter)."""
    exe = Path(sys.executable).parent / "vllm-router"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("vllm-router")
    if found:
        return [found]
    if importlib.util.find_spec("vllm_router") is not None:
        return [sys.executable, "-m", "vllm_router.launch_router"]
    raise BenchError(f"vllm-router is not installed: {INSTALL_HINT} (or leave it out with --targets)")


def require_extras(*, plots: bool, vllm_router: bool = False) -> None:
    """A clear error naming the extra when what a benchmark needs is missing."""
    if plots and importlib.util.find_spec("matplotlib") is None:
        raise BenchError(f"plots need matplotlib: {INSTALL_HINT} (or pass --no-plots for JSON only)")
    if vllm_router:
        vllm_router_argv()


def quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(samples_us: Sequence[int]) -> dict[str, float | None]:
    """p50/p90/p99/p99.9/max/mean in milliseconds of microsecond samples."""
    if not samples_us:
        return {"n": 0, "p50_ms": None, "p90_ms": None, "p99_ms": None, "p999_ms": None, "max_ms": None,
                "mean_ms": None}
    s = sorted(samples_us)

    def q(x: float) -> float:
        return s[min(len(s) - 1, int(x * len(s)))] / 1000.0

    return {"n": len(s), "p50_ms": q(0.5), "p90_ms": q(0.9), "p99_ms": q(0.99), "p999_ms": q(0.999),
            "max_ms": s[-1] / 1000.0, "mean_ms": statistics.fmean(s) / 1000.0}


def cdf_points(samples_us: Sequence[int], points: int = 200) -> list[tuple[float, float]]:
    """(quantile, ms) pairs for a CDF plot, small enough to keep in the raw results."""
    if not samples_us:
        return []
    s = sorted(samples_us)
    qs = [i / points for i in range(points)] + [0.999, 0.9999, 1.0]
    return [(q, s[min(len(s) - 1, int(q * len(s)))] / 1000.0) for q in sorted(set(qs))]


def machine() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "platform": platform.platform(), "python": platform.python_version(),
            "load_avg_at_start": os.getloadavg(), "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}


@dataclass
class Results:
    """Raw results (``<name>.json``) and plots (``<name>-*.png``) of one benchmark run in ``out``."""

    name: str
    out: Path
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.data.setdefault("benchmark", self.name)
        self.data.setdefault("machine", machine())
        self.data.setdefault("argv", ["fleetward", "bench", *sys.argv[2:]] if sys.argv[1:2] == ["bench"] else
                             sys.argv)

    @property
    def json_path(self) -> Path:
        return self.out / f"{self.name}.json"

    def write(self) -> Path:
        self.data["machine"]["load_avg_at_end"] = os.getloadavg()
        self.json_path.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        return self.json_path

    def plot_path(self, what: str) -> Path:
        return self.out / f"{self.name}-{what}.png"


def progress() -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=False)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def table(title: str, columns: Iterable[str], rows: Iterable[Iterable[str]]) -> None:
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c, justify="right" if c[:1].isdigit() or c.startswith(("p", "x", "tok", "cpu")) else "left")
    for r in rows:
        t.add_row(*r)
    Console(highlight=False, width=200 if not sys.stdout.isatty() else None).print(t)


@dataclass
class Infra:
    """etcd and an MQTT broker: the given endpoints, or private ones started (and stopped) here."""

    run_dir: Path
    etcd: str | None = None
    mqtt: str | None = None
    _etcd: LocalEtcd | None = None
    _broker: LocalBroker | None = None

    @contextlib.asynccontextmanager
    async def up(self) -> AsyncIterator[Infra]:
        logs = self.run_dir / "logs"
        try:
            if not self.etcd:
                shutil.rmtree(self.run_dir / "etcd-data", ignore_errors=True)
                self._etcd = LocalEtcd(self.run_dir / "etcd-data")
                self._etcd.start(logs)
                await self._etcd.wait_ready()
                self.etcd = self._etcd.endpoint
            if not self.mqtt:
                self._broker = LocalBroker(self.run_dir / "broker")
                self._broker.start(logs)
                await self._broker.wait_ready()
                self.mqtt = self._broker.endpoint
            yield self
        finally:
            if self._broker is not None:
                await self._broker.stop()
            if self._etcd is not None:
                await self._etcd.stop()

    @property
    def etcd_pid(self) -> int | None:
        return self._etcd.process.pid if self._etcd is not None and self._etcd.process is not None else None


async def run_client(module: str, spec: dict[str, Any], what: str) -> dict[str, Any]:
    """Run the client process ``python -m <module>`` on ``spec`` (JSON on its stdin; see :func:`client_main`)
    and return its result; a client that fails raises :class:`BenchError` naming ``what`` with its stderr."""
    with tempfile.TemporaryDirectory(prefix="fleetward-client-") as tmp:
        path = Path(tmp) / "result.json"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONSAFEPATH": "1"})
        try:
            _, err = await proc.communicate(json.dumps({**spec, "result_path": str(path)}).encode())
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        if proc.returncode != 0 or not path.exists():
            raise BenchError(f"{what} failed (exit {proc.returncode}): {err.decode()[-2000:]}")
        result: dict[str, Any] = json.loads(path.read_bytes())
    return result


def client_main(run: Callable[[dict[str, Any]], Coroutine[Any, Any, dict[str, Any]]]) -> None:
    """The body of a client process: read the spec from stdin, run it on uvloop, write the result where the
    spec says (``result_path``), exit without interpreter teardown (nothing is left to flush)."""
    import orjson
    import uvloop

    spec = json.loads(sys.stdin.read())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        result: dict[str, Any] = runner.run(run(spec))
    with open(spec["result_path"], "wb") as f:
        f.write(orjson.dumps(result))
    os._exit(0)


async def wait_idle(fleet: Fleet, timeout: float = 10.0, interval: float = 0.1) -> None:
    """Until no worker of ``fleet`` runs or queues anything, or ``timeout`` (its workers must report their
    state: ``backend.fault_switches``)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            while True:
                states = [await fleet.state(w) for w in fleet.worker_ids]
                if all(s["running"] == 0 and s["waiting"] == 0 for s in states):
                    return
                await asyncio.sleep(interval)


def worker_pid(fleet: Fleet, worker: str) -> int | None:
    """The pid of the worker's process (the root of its tree), or None while it does not run."""
    tree = fleet.processes(worker)
    return tree[0].pid if tree else None


async def _one_client(spec: dict[str, Any]) -> dict[str, Any]:
    return await run_client("fleetward.chaos.bench._loadgen", spec, "the load generator")


async def client_load(spec: dict[str, Any], *, procs: int = 1, lead_s: float = 1.0) -> dict[str, Any]:
    """Run ``spec`` (see ``_loadgen``) split over ``procs`` client processes; merge their results.

    ``lead_s`` is the head start the processes get to import before the common ``start_at``.
    """
    streams = int(spec["streams"])
    procs = max(1, min(procs, streams))
    start_at = time.monotonic() + lead_s
    specs = []
    for i in range(procs):
        share = streams // procs + (1 if i < streams % procs else 0)
        specs.append({**spec, "streams": share, "start_at": start_at, "url_offset": i * 7919,
                      "seed": (spec.get("seed", 0) * 1000) + i, "cpu_pids": spec.get("cpu_pids") if i == 0 else {}})
    parts = await asyncio.gather(*(_one_client(s) for s in specs))
    merged: dict[str, Any] = {"window_s": max(p["window_s"] for p in parts), "tokens": 0, "requests_ok": 0,
                              "requests_failed": 0, "errors": {}, "gaps_us": [], "ttft_us": [], "records": [],
                              "cpu_cores": dict(parts[0]["cpu_cores"]), "client_procs": procs}
    merged["cpu_cores"]["client"] = 0.0
    for p in parts:
        for k in ("tokens", "requests_ok", "requests_failed"):
            merged[k] += p[k]
        for msg, n in p["errors"].items():
            merged["errors"][msg] = merged["errors"].get(msg, 0) + n
        merged["gaps_us"].extend(p["gaps_us"])
        merged["ttft_us"].extend(p["ttft_us"])
        merged["records"].extend(p.get("records") or [])
        merged["cpu_cores"]["client"] += p["cpu_cores"]["client"]
    return merged


async def scrape(url: str) -> dict[str, float]:
    """A Prometheus text page as ``{"name{labels}": value}`` (comments dropped)."""
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        r = await client.get(url)
        r.raise_for_status()
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[name] = float(value)
    return out


def metric_total(metrics: dict[str, float], name: str) -> float:
    """A metric of a :func:`scrape` summed over its label sets."""
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def metric_delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    """How much a metric (summed over its label sets) grew between two :func:`scrape` s."""
    return metric_total(after, name) - metric_total(before, name)


def histogram_quantiles(before: dict[str, float], after: dict[str, float], metric: str,
                        qs: Sequence[float] = (0.5, 0.99)) -> dict[str, Any]:
    """Quantiles (bucket upper bounds) of what a Prometheus histogram observed between two scrapes."""
    buckets: list[tuple[float, float]] = []
    prefix = metric + "_bucket{le=\""
    for key, value in after.items():
        if key.startswith(prefix):
            le = key[len(prefix):].split('"', 1)[0]
            bound = float("inf") if le == "+Inf" else float(le)
            buckets.append((bound, value - before.get(key, 0.0)))
    buckets.sort()
    count = after.get(metric + "_count", 0.0) - before.get(metric + "_count", 0.0)
    total = after.get(metric + "_sum", 0.0) - before.get(metric + "_sum", 0.0)
    out: dict[str, Any] = {"count": count, "mean_s": total / count if count else None}
    for q in qs:
        want = q * count
        out[f"p{round(q * 100):d}_le_s"] = next((b for b, c in buckets if c >= want), None) if count else None
    return out
