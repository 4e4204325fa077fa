"""What a run's processes hold while it runs: resident memory and open file descriptors, sampled into the history.

Every ``interval_s`` the runner writes a ``resources`` record: one entry per process of the run, the runner's own
and every process it started (its descendants), each with ``role``, ``id``, ``pid``, ``rss_mb`` and ``fds``.
Roles come from the command line:

============  ==========================================================================================
role          process
============  ==========================================================================================
runner        the runner itself: it hosts the node agent (``TestFleet`` runs the agent in-process), the
              supervisor controller when ``fleet.controllers`` is 1, the fault proxies and the workload's
              clients. Its numbers are the agent's, with that company.
router        ``fleetward router --id <id>``
controller    ``fleetward supervisor --role controller --id <id>``
agent         ``fleetward supervisor --role agent`` (an agent of its own, not the harness's)
worker        a simulated (``fleetward.sim.server``) or vLLM worker process, by its port
etcd, broker  the run's private etcd members and MQTT broker
============  ==========================================================================================

After the fleet is torn down, an ``after`` record lists the processes the run started that are still alive
(``left``): a process the run leaked. Processes that existed before the run (a test session's etcd) are not
the run's. The ``resources`` checker (:mod:`fleetward.chaos.checkers`) judges the records.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import psutil

__all__ = ["INTERVAL_S", "ProcessSample", "ResourceSampler", "classify", "existing", "left_over", "sample"]

INTERVAL_S = 2.0  # how often a run samples its processes


class _Recorder(Protocol):
    def add(self, type_: str, **data: Any) -> Any: ...


@dataclass(frozen=True)
class ProcessSample:
    role: str
    id: str
    pid: int
    rss_mb: float
    fds: int

    def as_json(self) -> dict[str, Any]:
        return {"role": self.role, "id": self.id, "pid": self.pid, "rss_mb": self.rss_mb, "fds": self.fds}


def _flag(argv: list[str], name: str) -> str | None:
    with contextlib.suppress(ValueError, IndexError):
        return argv[argv.index(name) + 1]
    return None


def classify(proc: psutil.Process, *, me: int) -> tuple[str, str]:
    """(role, id) of a process of the run, from its command line (see the module docstring)."""
    if proc.pid == me:
        return "runner", "runner"
    try:
        argv = proc.cmdline()
        name = proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "gone", str(proc.pid)
    joined = " ".join(argv)
    if "fleetward.sim.server" in joined or "vllm.entrypoints" in joined:
        return "worker", f"port {_flag(argv, '--port') or '?'}"
    if "router" in argv and "fleetward" in joined:
        return "router", _flag(argv, "--id") or str(proc.pid)
    if "supervisor" in argv and "fleetward" in joined:
        role = _flag(argv, "--role") or "supervisor"
        return role, _flag(argv, "--id") or str(proc.pid)
    if name.startswith("etcd") or "etcd" in os.path.basename(argv[0] if argv else ""):
        return "etcd", _flag(argv, "--name") or str(proc.pid)
    if "mosquitto" in name or "amqtt" in joined or "broker" in joined:
        return "broker", "broker"
    return name or "process", str(proc.pid)


def _one(proc: psutil.Process, *, me: int) -> ProcessSample | None:
    try:
        with proc.oneshot():
            rss = proc.memory_info().rss
            fds = proc.num_fds()
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    role, ident = classify(proc, me=me)
    return ProcessSample(role, ident, proc.pid, round(rss / 2**20, 2), fds)


def sample(root: psutil.Process | None = None) -> list[ProcessSample]:
    """One look at ``root`` (default: this process) and every process below it."""
    root = root or psutil.Process()
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    return [s for s in (_one(p, me=root.pid) for p in procs) if s is not None]


def _key(p: psutil.Process) -> tuple[int, float] | None:
    try:
        return p.pid, p.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def existing(root: psutil.Process | None = None) -> set[tuple[int, float]]:
    """The processes below ``root`` now (pid, start time): those a later :func:`left_over` does not blame."""
    root = root or psutil.Process()
    return {k for k in (_key(p) for p in root.children(recursive=True)) if k is not None}


def left_over(before: Iterable[tuple[int, float]], root: psutil.Process | None = None) -> list[dict[str, Any]]:
    """The live processes below ``root`` that were not there ``before`` (zombies not yet reaped excluded)."""
    root = root or psutil.Process()
    known = set(before)
    out = []
    for p in root.children(recursive=True):
        k = _key(p)
        if k is None or k in known:
            continue
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            role, ident = classify(p, me=root.pid)
            out.append({"pid": p.pid, "role": role, "id": ident, "cmdline": " ".join(p.cmdline())[:200]})
    return out


class ResourceSampler:
    """Writes a ``resources`` record every ``interval_s`` while :meth:`run` runs (cancel it to stop)."""

    def __init__(self, recorder: _Recorder, *, interval_s: float = INTERVAL_S) -> None:
        self.recorder = recorder
        self.interval_s = interval_s
        self.root = psutil.Process()

    def record(self, phase: str = "sample") -> list[ProcessSample]:
        samples = sample(self.root)
        self.recorder.add("resources", phase=phase, procs=[s.as_json() for s in samples])
        return samples

    async def run(self) -> None:
        while True:
            self.record()
            await asyncio.sleep(self.interval_s)
