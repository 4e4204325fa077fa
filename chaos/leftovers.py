"""What dead runs left on this machine, found and removed: a reaper after its run, a run before its start.

A test run, a chaos run or ``fleetward up --hosts`` that dies without cleaning up (SIGKILL, the OOM killer, a
CI runner's timeout) leaves behind what only it would have removed:

=============== ======================================================================================
processes       every process started from a run carries the run's mark in its environment
                (``FLEETWARD_TEST_SESSION=<owner>/<id>``, :data:`MARK_VAR`), however deep and wherever it
                was reparented; one whose owner (pid and start time) is dead is killed with its tree
cgroups         ``fleetward/*`` in the freezer, memory and cpu hierarchies (v1) or the unified one (v2):
                thawed, emptied (members moved to the root group) and removed
iptables chains ``FW-*`` chains of the filter table, with their jumps from ``OUTPUT``
namespaces      the host networks' ``fw<id>-*`` namespaces, with what runs inside them
run folders     folders a caller names (a test's ``fleetward up`` run dirs) whose ``fleet.lock`` is free,
                and folders claimed by a dead owner (a fault's state under ``/tmp``)
=============== ======================================================================================

What a live process claimed (:mod:`fleetward.fleet.claims`) is never touched; what a dead one claimed, or
what nobody claimed, is left over (everything fleetward makes is claimed before it is made). Nothing here
imports more than the standard library, psutil and fleet's process helpers: a reaper runs it in a process of
its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from fleetward.chaos.hostnet import leftover_namespaces, remove_namespaces
from fleetward.fleet.claims import Owner, claims, release
from fleetward.fleet.procs import never_a_target

__all__ = ["MARK_VAR", "Reclaimed", "mark_owner", "reclaim"]

MARK_VAR = "FLEETWARD_TEST_SESSION"
_CGROUP = Path("/sys/fs/cgroup")
_V1_HIERARCHIES = ("freezer", "memory", "cpu")


def mark_owner(mark: str) -> Owner | None:
    """The owner a run's mark names (``<pid>:<start>/<id>``), or None for a mark that names none."""
    owner, sep, _ = mark.partition("/")
    return Owner.parse(owner) if sep else None


@dataclass
class Reclaimed:
    """What one :func:`reclaim` removed, for its one line."""

    processes: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    chains: list[str] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    folders: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return any((self.processes, self.cgroups, self.chains, self.namespaces, self.folders, self.errors))

    def line(self) -> str:
        """What was reclaimed, in one line ("nothing" when nothing was)."""
        parts = [f"{len(items)} {what}: {', '.join(items)}" for what, items in (
            ("process(es)", self.processes), ("cgroup(s)", self.cgroups), ("iptables chain(s)", self.chains),
            ("namespace(s)", self.namespaces), ("run folder(s)", self.folders)) if items]
        if self.errors:
            parts.append(f"could not remove {len(self.errors)}: {'; '.join(self.errors)}")
        return "; ".join(parts) or "nothing"


def _owned_by_the_living(name: str, table: dict[str, Owner | None] | None) -> bool:
    """Whether a live process claimed ``name``; claims that cannot be trusted (None) spare everything."""
    if table is None:
        return True
    owner = table.get(name)
    return owner is not None and owner.alive


# -- processes ------------------------------------------------------------------------------------------------


def _orphaned_marked(var: str) -> list[psutil.Process]:
    spared = never_a_target()  # a run started from inside an older one's process must not end itself
    found = []
    for p in psutil.process_iter():
        if p.pid in spared:
            continue
        with contextlib.suppress(psutil.Error, OSError):
            mark = p.environ().get(var)
            if not mark:
                continue
            owner = mark_owner(mark)
            if owner is not None and not owner.alive and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
    return found


def _describe(p: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return f"{p.pid} ({p.name()})"
    return str(p.pid)


def _sessions_of(leaders: list[psutil.Process]) -> list[psutil.Process]:
    """The other members of the sessions these processes lead (a detached server's children, whatever their
    environment)."""
    sids = {p.pid for p in leaders if _sid(p.pid) == p.pid}
    if not sids:
        return []
    spared = never_a_target()
    return [p for p in psutil.process_iter() if p.pid not in spared and p.pid not in sids and _sid(p.pid) in sids]


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _kill_orphans(var: str, out: Reclaimed) -> None:
    victims = _orphaned_marked(var)
    victims += [p for p in _sessions_of(victims) if p not in victims]
    names = {p.pid: _describe(p) for p in victims}
    for p in victims:
        with contextlib.suppress(psutil.Error):
            p.kill()
    _, alive = psutil.wait_procs(victims, timeout=10)
    out.processes += [names[p.pid] for p in victims if p not in alive]
    out.errors += [f"process {names[p.pid]} survived SIGKILL" for p in alive]


# -- cgroups --------------------------------------------------------------------------------------------------


def _cgroup_roots() -> list[Path]:
    """The roots under which fleetward makes its ``fleetward/`` groups."""
    roots = [_CGROUP / h for h in _V1_HIERARCHIES if (_CGROUP / h / "cgroup.procs").exists()]
    if (_CGROUP / "cgroup.controllers").exists():
        roots.append(_CGROUP)
    return roots


def _groups(root: Path) -> list[Path]:
    """``root/fleetward``'s groups, deepest first (a group is removed after its children)."""
    base = root / "fleetward"
    if not base.is_dir():
        return []
    found = [Path(d) for d, _, _ in os.walk(base) if Path(d) != base]
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _empty(group: Path, root: Path) -> None:
    """Thaw ``group`` and move its processes to ``root``."""
    for name, value in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
        with contextlib.suppress(OSError):
            (group / name).write_text(value)
    with contextlib.suppress(OSError):
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (root / "cgroup.procs").write_text(pid)


def _leftover_groups() -> list[tuple[Path, Path]]:
    found = [(g, root) for root in _cgroup_roots() for g in _groups(root)]
    table = claims("cgroup")  # read after the listing: whatever was listed was claimed before it was made
    return [(g, root) for g, root in found if not _owned_by_the_living(str(g), table)]


def _remove_groups(groups: list[tuple[Path, Path]], out: Reclaimed) -> list[tuple[Path, Path]]:
    """Remove each group (emptied first); those that cannot be removed yet are returned."""
    left = []
    for group, root in groups:
        _empty(group, root)
        try:
            group.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            left.append((group, root))
            continue
        release("cgroup", str(group))
        out.cgroups.append(str(group.relative_to(_CGROUP)))
    return left


# -- iptables chains ------------------------------------------------------------------------------------------


def _iptables(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["iptables", "-w", *args], capture_output=True, text=True, check=False, timeout=30)


def _remove_chains(out: Reclaimed) -> None:
    if os.geteuid() != 0 or shutil.which("iptables") is None:
        return
    listing = _iptables("-S").stdout.splitlines()
    chains = [line.split()[1] for line in listing if line.startswith("-N FW-")]
    table = claims("iptables")  # read after the listing: whatever was listed was claimed before it was made
    for chain in chains:
        if _owned_by_the_living(chain, table):
            continue
        for line in listing:  # every jump to it, as it was written
            words = line.split()
            if words[:1] == ["-A"] and words[-2:] == ["-j", chain]:
                _iptables("-D", *words[1:])
        _iptables("-F", chain)
        if _iptables("-X", chain).returncode == 0:
            release("iptables", chain)
            out.chains.append(chain)
        else:
            out.errors.append(f"iptables chain {chain}")


# -- namespaces -----------------------------------------------------------------------------------------------


def _remove_namespaces(out: Reclaimed) -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return
    prefixes = sorted({ns[:ns.index("-") + 1] for ns in leftover_namespaces()})
    table = claims("netns")  # read after the listing: whatever was listed was claimed before it was made
    for prefix in prefixes:
        if _owned_by_the_living(prefix, table):
            continue
        names = leftover_namespaces(prefix)
        remove_namespaces(names)
        release("netns", prefix)
        out.namespaces += names


# -- run folders ----------------------------------------------------------------------------------------------


def _lock_is_free(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def _remove_folders(folders: Iterable[Path], out: Reclaimed) -> None:
    """The run folders named (removed unless a live fleet holds them), and the folders claimed by a dead owner
    (a fault's state under /tmp)."""
    for folder in folders:
        if folder.is_dir() and _lock_is_free(folder / "fleet.lock"):
            shutil.rmtree(folder, ignore_errors=True)
            (out.errors if folder.exists() else out.folders).append(str(folder))
    for name, owner in (claims("folder") or {}).items():
        if owner is not None and owner.alive:
            continue
        folder = Path(name)
        shutil.rmtree(folder, ignore_errors=True)
        if folder.exists():
            out.errors.append(str(folder))
            continue
        release("folder", name)
        out.folders.append(name)


# -- all of it ------------------------------------------------------------------------------------------------


def reclaim(*, mark_var: str = MARK_VAR, folders: Iterable[Path] = ()) -> Reclaimed:
    """Remove what dead runs left (see the module docstring); ``folders``: run folders to remove unless a live
    fleet holds them. Groups are thawed before their processes are killed: on cgroup v1 a frozen process
    dies only once thawed."""
    out = Reclaimed()
    groups = _leftover_groups()
    for group, root in groups:
        _empty(group, root)
    _kill_orphans(mark_var, out)
    for group, _root in _remove_groups(groups, out):
        out.errors.append(f"cgroup {group.relative_to(_CGROUP)}")
    _remove_chains(out)
    _remove_namespaces(out)
    _remove_folders(folders, out)
    return out
