"""Who made what a process leaves outside itself, so that what a dead process left can be found and removed.

Some of what fleetward makes outlives the process that made it unless that process cleans up: an iptables
chain (the network faults' kernel backend), network namespaces (hosts of a chaos run or of ``fleetward up
--hosts``), cgroups under ``fleetward/`` (frozen, throttled or memory-limited workers). A process killed
with SIGKILL cleans up nothing. So each is *claimed* before it is made: a file
``<claims dir>/<kind>/<name>`` names its owner, a process identified by its pid *and* its start time (a
pid alone may be a stranger's a minute later). It is released once the thing is gone. What a live owner
claimed is its own; what a dead owner claimed, or what nobody claimed, is left over
(:mod:`fleetward.chaos.leftovers` removes it).

The claims dir is ``/run/fleetward/claims`` for root (a tmpfs: it goes at reboot, with everything it
describes), else ``$TMPDIR/fleetward-<uid>/claims``; ``FLEETWARD_CLAIMS_DIR`` overrides it.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import psutil

__all__ = ["Owner", "claim", "claims", "claims_dir", "release"]


@dataclass(frozen=True)
class Owner:
    """A process as it was when it claimed something: its pid and its start time (seconds since the epoch)."""

    pid: int
    start: float

    @classmethod
    def of(cls, pid: int | None = None) -> Owner:
        """The process ``pid`` (this one by default); :class:`psutil.NoSuchProcess` when it is gone."""
        pid = os.getpid() if pid is None else pid
        return cls(pid, round(psutil.Process(pid).create_time(), 2))

    @classmethod
    def parse(cls, text: str) -> Owner | None:
        """``"<pid>:<start>"`` (as :meth:`__str__` writes it), or None when ``text`` is not that."""
        pid, _, start = text.partition(":")
        try:
            return cls(int(pid), float(start))
        except ValueError:
            return None

    def __str__(self) -> str:
        return f"{self.pid}:{self.start:.2f}"

    @property
    def alive(self) -> bool:
        """Whether this very process still runs: its pid exists, started when this one did, and is no zombie."""
        try:
            p = psutil.Process(self.pid)
            return abs(p.create_time() - self.start) < 0.05 and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


def claims_dir() -> Path:
    given = os.environ.get("FLEETWARD_CLAIMS_DIR")
    if given:
        return Path(given)
    if os.geteuid() == 0 and os.access("/run", os.W_OK):
        return Path("/run/fleetward/claims")
    return Path(tempfile.gettempdir()) / f"fleetward-{os.geteuid()}" / "claims"


def _path(kind: str, name: str) -> Path:
    return claims_dir() / kind / urllib.parse.quote(name, safe="")


def _trusted(folder: Path) -> bool:
    """Whether claims in ``folder`` were written by this user: it and the claims dir are ours and nobody else
    may write there. A reclaim removes what a claim names; a claim planted by another user must not count."""
    for f in (claims_dir(), folder):
        try:
            st = f.stat()
        except OSError:
            return False
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            return False
    return True


def claim(kind: str, name: str, owner: Owner | None = None) -> None:
    """Record that ``owner`` (this process by default) is about to make ``name`` of ``kind``: call it *before*
    making it, so that nothing exists unclaimed while its maker lives."""
    path = _path(kind, name)
    claims_dir().mkdir(mode=0o700, parents=True, exist_ok=True)  # its own and its kind's: this user's alone
    path.parent.mkdir(mode=0o700, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"owner": str(owner or Owner.of()), "since": time.time()}))
    tmp.replace(path)


def release(kind: str, name: str) -> None:
    """Forget the claim on ``name`` (call it *after* the thing is gone)."""
    with contextlib.suppress(FileNotFoundError):
        _path(kind, name).unlink()


def claims(kind: str) -> dict[str, Owner | None] | None:
    """Every claim of ``kind``: the name claimed and its owner (None when the claim cannot be read). None in
    place of them all when they cannot be trusted (the claims dir is another user's, or others may write to
    it): then nothing may be taken for unclaimed either."""
    found: dict[str, Owner | None] = {}
    folder = claims_dir() / kind
    if not folder.exists():
        return found  # nothing of this kind was ever claimed here
    if not _trusted(folder):
        return None
    with contextlib.suppress(FileNotFoundError):
        for path in folder.iterdir():
            if path.name.startswith("."):
                continue
            try:
                owner = Owner.parse(json.loads(path.read_text())["owner"])
            except (OSError, ValueError, KeyError, TypeError):
                owner = None
            found[urllib.parse.unquote(path.name)] = owner
    return found
