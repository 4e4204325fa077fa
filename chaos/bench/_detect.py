"""``fleetward bench detect``: how fast the supervisor names a failure, whether it cries wolf, what it costs.

Three parts, each with its own fleet (``--parts``), each in its own module:

- **latency** (``_detect_latency``): closed-loop streams through a router, one worker fails (a crash, a
  killed or stopped vLLM engine, a hang); the time from the fault to the ``unhealthy`` verdict;
- **soak** (``_detect_soak``): no fault at all, the fleet near its capacity for a while; every verdict,
  restart and migration is a false positive;
- **cpu** (``_detect_cpu``): the supervisor controller's CPU in steady state at many registered workers.

Here is what they share: the config (:class:`DetectBench`), the event follower (:class:`Events`), the
supervisor controller as its own process, as ``fleetward up`` runs it (:func:`lead_controller`), and the
command (:func:`run_detect_bench`), which runs the parts, records what each measured (a part's failure does
not lose the others'), and plots them.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fleetward.chaos.bench._common import BenchError, Infra, Results, console, quantile, require_extras
from fleetward.chaos.harness import ControllerProcess, TestFleet
from fleetward.fleet.bus import Event, EventBus
from fleetward.fleet.config import RouterConfig, SimConfig
from fleetward.fleet.launch import wait_leader

__all__ = ["ADMIN_TOKEN", "SIM", "DetectBench", "Events", "is_verdict", "lead_controller", "run_detect_bench",
           "stats_ms"]

SIM = SimConfig(seed=5)  # the default, GPU-like latency model (as bench migration)
ADMIN_TOKEN = "bench-detect-admin-token"


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
    faults: tuple[str, ...] = ()  # latency: only these fault cases (default: every case of each backend)
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


class Events:
    """Every event of one cluster as it arrives, with this process's monotonic time of arrival."""

    def __init__(self, bus: EventBus) -> None:
        self.seen: list[tuple[float, Event]] = []
        self.subscribed = asyncio.Event()
        self._new = asyncio.Event()
        self._task = asyncio.create_task(self._run(bus), name="bench-events")

    async def _run(self, bus: EventBus) -> None:
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


def is_verdict(worker: str) -> Callable[[Event], bool]:
    """The supervisor's verdict on ``worker``: a ``health.changed`` event to ``unhealthy``."""
    return lambda e: e.kind == "health.changed" and e.worker == worker and e.data.get("state") == "unhealthy"


async def lead_controller(fleet: TestFleet) -> ControllerProcess:
    """A supervisor controller for ``fleet`` as its own process (the fleet's settings); returns once it leads."""
    ctl = await fleet.start_controller_process(f"bench-controller-{uuid.uuid4().hex[:6]}")
    await wait_leader(fleet.store, fleet.keys, timeout=120, leader_id=ctl.id)
    return ctl


def stats_ms(values: Sequence[float]) -> dict[str, Any]:
    """n, p50, p99, min, max, mean in ms of values in seconds (p99 of a few trials is their max)."""
    if not values:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "min_ms": None, "max_ms": None, "mean_ms": None}
    ms = [v * 1000.0 for v in values]
    return {"n": len(ms), "p50_ms": statistics.median(ms), "p99_ms": quantile(ms, 0.99), "min_ms": min(ms),
            "max_ms": max(ms), "mean_ms": statistics.fmean(ms)}


class _Part(Protocol):
    """What each part's module offers."""

    def section(self) -> dict[str, Any]:
        """Its results section before it runs (``res.data[<part>]``)."""
        ...

    async def run(self, cfg: DetectBench, infra: Infra, res: Results) -> None: ...

    def summarize(self, res: Results) -> None:
        """Its summary into its section, and its table printed."""
        ...

    def plot(self, res: Results) -> None:
        """Its plots, from what its section holds (nothing when it holds nothing)."""
        ...


def _parts() -> dict[str, _Part]:
    """The parts in the order they run. Imported here, not at the top: the parts import this module."""
    from fleetward.chaos.bench import _detect_cpu, _detect_latency, _detect_soak

    return {"latency": _detect_latency, "soak": _detect_soak, "cpu": _detect_cpu}


async def run_detect_bench(cfg: DetectBench) -> Results:
    require_extras(plots=cfg.plots)
    parts = _parts()
    res = Results("detect", cfg.out, {"config": {**cfg.__dict__, "out": str(cfg.out)}, "sim": SIM.model_dump(),
                                      "routing": RouterConfig().model_dump(),
                                      **{name: part.section() for name, part in parts.items()}})
    failed: list[str] = []
    async with Infra(cfg.out / "run-infra", cfg.etcd, cfg.mqtt).up() as infra:
        for name, part in parts.items():
            if name not in cfg.parts:
                continue
            # A part's failure is recorded and reported; the other parts still run and are kept.
            try:
                await part.run(cfg, infra, res)
                part.summarize(res)
            except Exception as exc:
                failed.append(f"{name}: {type(exc).__name__}: {exc}")
                res.data[name]["error"] = failed[-1]
                console.print(f"[red]part {name} failed:[/] {type(exc).__name__}: {exc}")
            res.write()
    res.write()
    if cfg.plots:
        for part in parts.values():
            part.plot(res)
    if failed:
        raise BenchError("; ".join(failed) + f" (what the other parts measured is in {res.json_path})")
    return res
