"""A test run's guard: one run at a time, nothing left behind however it ends, and what older runs left
reclaimed before it starts. A pytest plugin (``-p fleetward.chaos.runguard``; fleetward's own suite loads it
in its pytest config), in the way of testcontainers' Ryuk.

- **Its mark.** Loading the plugin marks the run: ``FLEETWARD_TEST_SESSION=<pid>:<start time>/<id>`` in its
  environment, which every process it starts inherits, however deep, detached or reparented (vLLM servers
  started as an operator starts them, fleets in their own session). The mark names its owner, the pytest
  process, by pid *and* start time.
- **Its reaper.** A process of its own session (``python -m fleetward.chaos.runguard --reap ...``) waits for
  the run's process to end, however it ends (SIGKILL, the OOM killer), then reclaims what it left
  (:func:`fleetward.chaos.leftovers.reclaim`): processes carrying a dead owner's mark, cgroups under
  ``fleetward/`` (thawed first), ``FW-*`` iptables chains and ``fw*`` namespaces whose owner is gone, and the
  run folders named below. What it did goes to ``<lock>.reaper.log``.
- **Signals end the run through its finalizers.** SIGINT, SIGTERM and SIGHUP stop the run as Ctrl-C does
  (fixture teardown, ``pytest_sessionfinish``; pytest exits 2). Finalizers get :data:`STOP_S` seconds; a
  second signal, or the deadline, ends the process at once and leaves the rest to the reaper.
- **One run at a time.** The run holds an exclusive lock on ``/tmp/fleetward-tests.lock``
  (``FLEETWARD_TEST_LOCK`` overrides it) for its life; the kernel drops it however the process dies. A second
  run says which process holds it and since when, and exits 4 (``./dev test`` says so before it sets up).
- **The next run reclaims** what an older one left (its reaper was killed with it, or the machine lost
  power mid-way), before its first test, and says what in one line.

Under pytest-xdist each process has its own mark and reaper; the controller alone holds the lock and
reclaims. Run folders reclaimed: ``<rootdir>/.fleetward/readme-*`` (the README test's ``fleetward up`` runs
in the checkout) whose fleet is not running.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import pytest

from fleetward.chaos.leftovers import MARK_VAR, Reclaimed, reclaim
from fleetward.fleet.claims import Owner
from fleetward.fleet.procs import KEEP_ENVIRON

__all__ = ["MARK", "MARK_VAR", "STOP_S", "lock_path"]

STOP_S = 60.0  # how long finalizers get once a signal asked the run to stop
_REFUSED = 4  # the exit code of a run refused because another one is going

# The mark, made when pytest loads the plugin: before any conftest (which may start processes) is imported.
MARK = f"{Owner.of()}/{uuid.uuid4().hex[:12]}"
if __name__ != "__main__":
    os.environ[MARK_VAR] = MARK
    os.environ.update(KEEP_ENVIRON)  # vLLM's engine processes would write their titles over it


def lock_path() -> Path:
    return Path(os.environ.get("FLEETWARD_TEST_LOCK") or "/tmp/fleetward-tests.lock")


def _run_folders(rootdir: Path) -> list[Path]:
    return sorted((rootdir / ".fleetward").glob("readme-*"))


# -- one run at a time ------------------------------------------------------------------------------------------


def _hold_lock(path: Path) -> int:
    """The lock's fd once this process holds it; :func:`pytest.exit` naming the holder when another does. A
    moment's wait: ``./dev test`` looks at the lock (a shared hold) just before it starts the run."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    deadline = time.monotonic() + 2.0
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            holder = os.pread(fd, 1000, 0).decode(errors="replace").strip() or "a process that did not say"
            os.close(fd)
            pytest.exit(f"another test run is going on this machine: {holder}. Wait for it, or end it; one run "
                        f"at a time (two starve each other's event loops on a small host, and their iptables "
                        f"chains and cgroups share names). The lock: {path}", returncode=_REFUSED)
    me = f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S %Z')} in {Path.cwd()}: {' '.join(sys.argv)}"
    os.ftruncate(fd, 0)
    os.pwrite(fd, (me[:900] + "\n").encode(), 0)
    return fd


# -- signals ------------------------------------------------------------------------------------------------------


class _Stop:
    """SIGINT, SIGTERM and SIGHUP as one Ctrl-C: the finalizers run, within :data:`STOP_S`."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.finishing = False  # in pytest_sessionfinish: the finalizers run already, nothing to interrupt

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self.on_signal)

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            self.exit_now(signum, f"a second signal ({name})")
        self.signum = signum
        sys.stderr.write(f"\nfleetward: {name}: the run ends through its finalizers (at most {STOP_S:.0f} s; "
                         "a second signal ends it now)\n")
        threading.Thread(target=self.deadline, args=(signum,), name="fleetward stop deadline", daemon=True).start()
        if not self.finishing:
            raise KeyboardInterrupt(name)

    def deadline(self, signum: int) -> None:
        time.sleep(STOP_S)
        self.exit_now(signum, f"finalizers still running {STOP_S:.0f} s after {signal.Signals(signum).name}")

    @staticmethod
    def exit_now(signum: int, why: str) -> None:
        sys.stderr.write(f"\nfleetward: {why}: exiting now; the run's reaper ends what it left\n")
        sys.stderr.flush()
        os._exit(128 + signum)


_STOP = _Stop()


# -- the reaper -----------------------------------------------------------------------------------------------------


def _start_reaper(rootdir: Path) -> subprocess.Popen[bytes]:
    """The reaper of this process, in a session of its own (a signal to the run's group does not reach it),
    without the mark (it is not the run's to end)."""
    env = {k: v for k, v in os.environ.items() if k != MARK_VAR}
    with open(f"{lock_path()}.reaper.log", "ab") as log:  # the child keeps its own copy
        return subprocess.Popen(
            [sys.executable, "-m", "fleetward.chaos.runguard", "--reap", str(Owner.of()),
             *map(str, _run_folders(rootdir))], start_new_session=True, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, env=env)


def _wait_for(owner: Owner) -> None:
    """Return once ``owner`` has ended (at once when it is gone already)."""
    try:
        fd = os.pidfd_open(owner.pid)
    except ProcessLookupError:
        return
    try:
        if owner.alive:  # checked after the pidfd was opened: the pid is not a newcomer's
            select.select([fd], [], [])
    finally:
        os.close(fd)


def _reap(owner: Owner, folders: Sequence[Path]) -> None:
    _wait_for(owner)
    done = reclaim(folders=folders)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    print(f"{stamp} run {owner} ended; reclaimed: {done.line()}", flush=True)


# -- pytest hooks ----------------------------------------------------------------------------------------------------


class _Guard:
    def __init__(self) -> None:
        self.lock: int | None = None
        self.reaper: subprocess.Popen[bytes] | None = None
        self.reclaimed: Reclaimed | None = None


_GUARD = _Guard()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    rootdir = Path(str(config.rootpath))
    if not hasattr(config, "workerinput"):  # the controller (or the only process): lock, then reclaim
        _GUARD.lock = _hold_lock(lock_path())
        _GUARD.reclaimed = reclaim(folders=_run_folders(rootdir))
    _GUARD.reaper = _start_reaper(rootdir)
    _STOP.install()


def pytest_report_header(config: pytest.Config) -> str | None:
    if _GUARD.reclaimed is None:
        return None
    return f"fleetward: this run holds {lock_path()}; left by earlier runs and reclaimed: {_GUARD.reclaimed.line()}"


def pytest_sessionstart(session: pytest.Session) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if _GUARD.reclaimed and reporter is not None and reporter.verbosity < 0:  # the header is not shown
        reporter.write_line(f"fleetward: left by earlier runs and reclaimed: {_GUARD.reclaimed.line()}")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> object:
    _STOP.finishing = True
    yield


def pytest_unconfigure(config: pytest.Config) -> None:
    if _GUARD.lock is not None:
        os.close(_GUARD.lock)
        _GUARD.lock = None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fleetward.chaos.runguard",
                                description="Reclaim what dead test runs left on this machine.")
    p.add_argument("--reap", metavar="PID:START", help="(internal) wait for this process to end first")
    p.add_argument("folders", nargs="*", type=Path, help="run folders to remove unless a fleet holds them")
    args = p.parse_args(argv)
    if args.reap:
        owner = Owner.parse(args.reap)
        if owner is None:
            p.error(f"--reap: not PID:START: {args.reap}")
        with contextlib.suppress(KeyboardInterrupt):
            _reap(owner, args.folders)
        return 0
    print(f"reclaimed: {reclaim(folders=args.folders).line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
