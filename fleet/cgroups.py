"""CPU limits for process trees through the kernel's cgroup ``cpu`` controller (v1 or v2), root only.

Two uses: throttling a worker to a fraction of a CPU (how a thermally throttled or oversubscribed GPU
host looks from outside: the worker slows down, it does not fail), and weighting processes so a fleet's
control plane stays responsive next to CPU-bound workers on a small host.

Processes forked after a process joins a group inherit it, so limiting a worker's root process at start
covers its whole tree; :meth:`CpuGroup.add_tree` also moves an existing tree.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import psutil

from fleetward.fleet.claims import claim, release
from fleetward.fleet.errors import FleetwardError

__all__ = ["CpuGroup", "cgroups_available"]

_V1 = Path("/sys/fs/cgroup/cpu")
_V2 = Path("/sys/fs/cgroup")
_PERIOD_US = 100_000


def _root() -> tuple[Path, int] | None:
    if (_V1 / "cpu.cfs_quota_us").exists() or (_V1 / "cpu.shares").exists():
        return _V1, 1
    if (_V2 / "cgroup.controllers").exists() and "cpu" in (_V2 / "cgroup.controllers").read_text().split():
        return _V2, 2
    return None


def cgroups_available() -> bool:
    """Whether this process may create CPU cgroups (root and a mounted cpu controller)."""
    root = _root()
    return root is not None and os.geteuid() == 0 and os.access(root[0], os.W_OK)


class CpuGroup:
    """``/sys/fs/cgroup[/cpu]/fleetward/<name>``: created on first use, removed by :meth:`remove`."""

    def __init__(self, name: str) -> None:
        found = _root()
        if found is None or os.geteuid() != 0:
            raise FleetwardError("CPU cgroups are not available here (needs root and the cgroup cpu controller)")
        root, self.version = found
        parent = root / "fleetward"
        if self.version == 2:
            parent.mkdir(exist_ok=True)
            with contextlib.suppress(OSError):
                (root / "cgroup.subtree_control").write_text("+cpu")
                (parent / "cgroup.subtree_control").write_text("+cpu")
        self.path = parent / name
        claim("cgroup", str(self.path))  # a run killed before remove() leaves it to the next one's reclaim
        self.path.mkdir(parents=True, exist_ok=True)

    def limit(self, cpus: float | None) -> None:
        """At most ``cpus`` CPUs worth of time (0.1 = 10% of one core); None lifts the limit."""
        if self.version == 1:
            quota = -1 if cpus is None else max(1000, int(cpus * _PERIOD_US))
            (self.path / "cpu.cfs_period_us").write_text(str(_PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            value = "max" if cpus is None else str(max(1000, int(cpus * _PERIOD_US)))
            (self.path / "cpu.max").write_text(f"{value} {_PERIOD_US}")

    def weight(self, relative: float) -> None:
        """CPU share relative to an ordinary process (1.0); 0.1 yields to everything else under contention."""
        if self.version == 1:
            (self.path / "cpu.shares").write_text(str(max(2, int(1024 * relative))))
        else:
            (self.path / "cpu.weight").write_text(str(min(10_000, max(1, int(100 * relative)))))

    def add_tree(self, pid: int) -> int:
        """Move a process and all its descendants (every thread) into the group; returns how many processes."""
        procs = []
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        moved = 0
        for p in procs:
            try:
                (self.path / "cgroup.procs").write_text(str(p.pid))
                moved += 1
            except OSError:
                continue  # exited meanwhile
        return moved

    def remove(self) -> None:
        """Move members back to the root group and delete the group."""
        root = self.path.parent.parent
        with contextlib.suppress(OSError):
            for line in (self.path / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (root / "cgroup.procs").write_text(line)
        with contextlib.suppress(OSError):
            self.path.rmdir()
        if not self.path.exists():
            release("cgroup", str(self.path))
