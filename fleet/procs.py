"""Child processes that cannot outlive us.

Every process fleetward starts (etcd, the broker, workers) goes through :class:`ManagedProcess`:

- it runs in its own session (its pid is its process group id), so its whole tree (e.g. vLLM's API
  server → EngineCore → Worker) can be signalled at once;
- it gets ``PR_SET_PDEATHSIG=SIGKILL`` (Linux), so if the fleetward process that started it is
  ``kill -9``-ed the child dies with it instead of becoming an orphan. The kernel ties this to the *thread*
  that forked the child: call :meth:`ManagedProcess.start` from a thread that lives as long as the child
  should (the main / event-loop thread), never from a short-lived worker thread. Grandchildren are covered
  only if the child does the same (a child that is itself a ``ManagedProcess`` user does);
- its output goes to a log file whose tail is quoted when it fails to start;
- :meth:`ManagedProcess.stop` is ordered: SIGCONT (a stopped process cannot act on SIGTERM), SIGTERM to
  the group and every descendant seen so far, wait with a deadline, SIGKILL what is left, reap. It works
  on a SIGSTOPped tree and on descendants that moved to another process group, and returns the exit code
  of the process itself (negative: killed by that signal). "Seen so far" means seen by :meth:`tree`,
  :meth:`kill` or :meth:`stop` while the process lived, plus what was left in its process group when it
  exited (:meth:`wait_exit` looks before it reaps). Its group itself is signalled only while the exited
  child is not yet reaped: afterwards its pid may belong to someone else;
- :meth:`ManagedProcess.wait_exit` wakes the moment the process exits (a pidfd in the event loop), which
  is what crash detection needs.

Errors: :class:`~fleetward.fleet.errors.ProcessError` when a process cannot be started or dies before it
is ready; :class:`~fleetward.fleet.errors.PortInUseError` from :func:`ensure_port` and :func:`listening_socket`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import psutil

from fleetward.fleet.errors import PortInUseError, ProcessError

__all__ = [
    "KEEP_ENVIRON",
    "RUN_MARK",
    "AdoptedProcess",
    "ManagedProcess",
    "WorkerProcess",
    "advertised_host",
    "dies_with_parent",
    "ensure_port",
    "free_port",
    "is_gone",
    "is_local_only",
    "is_the_process",
    "kill_tree",
    "last_log_line",
    "listening_socket",
    "marked_processes",
    "never_a_target",
    "pid_from_file",
    "pid_of_container",
    "pid_of_pidfile",
    "pid_of_unit",
    "port_is_free",
    "reserve_port",
    "spread_cores",
    "tree_of",
]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _load_libc() -> ctypes.CDLL | None:
    # Loaded once here, in the parent: dlopen between fork and exec of a threaded process can deadlock.
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


_LIBC = _load_libc()


def dies_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets ``sig`` (``PR_SET_PDEATHSIG``) when the thread that forks it (this
    process's) dies, however it dies; SIGTERM for a child that should stop in order."""
    parent_pid = os.getpid()

    def setup() -> None:  # runs in the child between fork and exec: no allocation-heavy work here
        if _LIBC is not None:
            _LIBC.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        # The parent may have died between fork and prctl; then no signal will ever come.
        if os.getppid() != parent_pid:
            os._exit(1)

    return setup


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    """Whether a listener could bind ``host:port`` now (SO_REUSEADDR, as servers do)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
        return True


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """A socket bound to a free port of ``host`` and held, not listening, so that the port stays free for the
    process that will listen on it later: neither a bind nor the kernel's choice of a local port for an
    outgoing connection takes a port a socket is bound to. Close it just before that process starts. For a
    port chosen long before its server starts (:func:`free_port` leaves it to whoever comes first)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, 0))
    except BaseException:
        s.close()
        raise
    return s


def listening_socket(host: str, port: int, *, name: str, reuse_port: bool = False) -> socket.socket:
    """A TCP socket listening on ``host:port`` (a port the OS picks when it is 0; :class:`PortInUseError` when
    ``port`` is taken), for a server to be handed once it runs (``uvicorn.Server.serve(sockets=...)``).

    Bound *before* the service writes its address anywhere (etcd): from then on a connection to it waits in
    the backlog until the server accepts it, where one to a port nobody listens on yet is refused. A router
    that read a new peer's address was refused that way, and passed the peer over for a lease's length.
    ``reuse_port``: one of several processes on one port (``SO_REUSEPORT``; the kernel spreads connections).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(host, port, name=name) from exc
            raise
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


def ensure_port(host: str, port: int, *, name: str) -> int:
    """``port`` if it is free (raising :class:`PortInUseError` if not), or a free port when it is 0."""
    if port == 0:
        return free_port(host)
    if not port_is_free(host, port):
        raise PortInUseError(host, port, name=name)
    return port


def tree_of(pid: int) -> list[psutil.Process]:
    """The process and all its descendants (empty when it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def is_gone(proc: psutil.Process) -> bool:
    """True once ``proc`` has exited: no such process, or a zombie nobody reaped yet."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:
        return False


def kill_tree(procs: Iterable[psutil.Process], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to each process that is still there (identity checked by psutil, so no stray pid)."""
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p.send_signal(sig)


def _peek_exit(popen: subprocess.Popen[bytes]) -> int | None:
    """Our child's exit code if it exited, without reaping it (so its pid, its group id, stays ours)."""
    if popen.returncode is not None:
        return popen.returncode
    try:
        info = os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped behind Popen's back
        return popen.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _exited(popen: subprocess.Popen[bytes]) -> bool:
    return _peek_exit(popen) is not None


async def _pidfd_wait(pid: int, exited_now: Callable[[], bool]) -> bool:
    """Wait until ``pid`` exits (its pidfd turns readable: no polling); False when no pidfd can be had."""
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        return False
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(fd, on_readable)
    try:
        if not exited_now():
            await exited
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return True


class ManagedProcess:
    """One child process (and its tree) with an ordered, orphan-free life (see the module docstring)."""

    def __init__(self, name: str, argv: Sequence[str], *, log_path: Path, env: Mapping[str, str] | None = None,
                 cwd: Path | None = None, nice: int = 0, unset: Sequence[str] = ()) -> None:
        self.name = name
        self.unset = tuple(unset)  # variables of our environment the child does not inherit
        self.nice = nice
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self._popen: subprocess.Popen[bytes] | None = None
        self._known: dict[int, psutil.Process] = {}
        self.survivors: list[psutil.Process] = []  # what the last stop could not end (should stay empty)

    def start(self) -> ManagedProcess:
        """Spawn the process (output appended to ``log_path``); :class:`ProcessError` if exec fails.

        A stopped or exited process may be started again (same argv, same log).
        """
        if self.is_running:
            raise ProcessError(f"{self.name} is already running (pid {self.pid})", name=self.name)
        if self._popen is not None:
            self._popen.wait()  # reap the previous run (it exited)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in self.unset} | (self.env or {})
        self._known.clear()
        with open(self.log_path, "ab", buffering=0) as out:
            try:
                self._popen = subprocess.Popen(
                    self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                    cwd=self.cwd, start_new_session=True,
                    preexec_fn=dies_with_parent(),
                )
            except OSError as exc:
                raise ProcessError(f"{self.name}: cannot start {self.argv[0]}: {exc.strerror}",
                                   name=self.name) from exc
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = self._known[self.pid] = psutil.Process(self.pid)
            if self.nice:
                proc.nice(self.nice)  # inherited by everything it forks from now on
        log.debug("started %s pid %d: %s", self.name, self.pid, " ".join(self.argv))
        return self

    @property
    def pid(self) -> int:
        if self._popen is None:
            raise ProcessError(f"{self.name} was never started", name=self.name)
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit code once the process exited (negative: killed by that signal), else None."""
        # Peeking does not reap: until wait_exit or stop reaps it, the exited child's group can still be
        # found and signalled (its descendants may live on in it).
        return None if self._popen is None else _peek_exit(self._popen)

    @property
    def is_running(self) -> bool:
        return self._popen is not None and _peek_exit(self._popen) is None

    def _remember_group(self) -> None:
        """Remember every process in the child's group; only while the child is unreaped (pid still ours)."""
        if self._popen is None or self._popen.returncode is not None:
            return
        pgid = self._popen.pid
        for pid in psutil.pids():
            with contextlib.suppress(OSError, psutil.Error):
                if pid not in self._known and os.getpgid(pid) == pgid:
                    self._known[pid] = psutil.Process(pid)

    def tree(self) -> list[psutil.Process]:
        """The live process tree, remembered so that :meth:`stop` can find descendants whose parent died."""
        procs = tree_of(self.pid) if self.is_running else []
        for p in procs:
            self._known[p.pid] = p
        return procs

    def log_tail(self, lines: int = 30) -> str:
        try:
            data = self.log_path.read_bytes()[-8192:]
        except OSError:
            return ""
        return "\n".join(data.decode(errors="replace").splitlines()[-lines:])

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process itself (not its tree); nothing if it already exited."""
        if self.is_running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    async def wait_exit(self) -> int:
        """Return the exit code as soon as the process exits (pidfd readiness, no polling)."""
        popen = self._popen
        if popen is None:
            raise ProcessError(f"{self.name} was never started", name=self.name)
        if popen.returncode is not None:
            return popen.returncode
        if not await _pidfd_wait(popen.pid, lambda: _exited(popen)):  # old kernel or not Linux: a worker thread
            return await asyncio.to_thread(popen.wait)
        self._remember_group()  # before reaping: what it left behind in its group, for stop()
        return popen.wait()  # the process is a zombie by now: reaping does not block

    async def wait_ready(self, ready: Callable[[], Awaitable[bool]], *, timeout: float,
                         interval: float = 0.1, progress_cap: float | None = None) -> None:
        """Poll ``ready()`` until it is true; fail fast with the log tail if the process exits first.

        Exceptions from ``ready()`` count as "not yet". Raises :class:`ProcessError` on exit or timeout. With
        ``progress_cap``, ``timeout`` counts from the last sign of progress instead of from the start: CPU time
        used by the process's tree, or its log growing (a large model loading from slow storage, a start
        starved by a busy neighbour); a start that stops progressing is given up, one that progresses is
        waited for up to ``progress_cap`` seconds in all.
        """
        started = last_progress = time.monotonic()
        mark = self._progress_mark() if progress_cap is not None else None
        looked = started
        while True:
            if not self.is_running:
                raise ProcessError(
                    f"{self.name} exited with code {self.returncode} before it was ready; "
                    f"log {self.log_path}:\n{self.log_tail()}",
                    name=self.name, exit_code=self.returncode, log_tail=self.log_tail())
            with contextlib.suppress(Exception):
                if await ready():
                    return
            now = time.monotonic()
            if progress_cap is not None and now - looked >= 1.0:
                looked = now
                seen = self._progress_mark()
                if seen != mark:
                    mark, last_progress = seen, now
            if now - last_progress >= timeout or (progress_cap is not None and now - started >= progress_cap):
                tail = self.log_tail()
                last = last_log_line(tail) or "(nothing logged)"
                why = (f"not ready after {timeout:.0f}s" if progress_cap is None else
                       f"not ready: no progress for {timeout:.0f}s (no CPU time used, nothing logged)"
                       if now - last_progress >= timeout else f"not ready after {progress_cap:.0f}s, progressing")
                raise ProcessError(f"{self.name} {why}; it was at: {last}; log {self.log_path}:\n{tail}",
                                   name=self.name, log_tail=tail)
            await asyncio.sleep(interval)

    def _progress_mark(self) -> tuple[float, int]:
        """(CPU seconds of the process tree, log size): either moving is progress."""
        cpu = 0.0
        for p in self.tree():
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                cpu += t.user + t.system + t.children_user + t.children_system
        try:
            size = self.log_path.stat().st_size
        except OSError:
            size = -1
        return round(cpu, 1), size

    def _killpg(self, sig: int) -> None:
        # Only while our child is unreaped: until then its pid (= its group id) cannot be reused by anyone.
        if self._popen is not None and self._popen.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._popen.pid, sig)

    def stop_now(self, grace: float = 5.0) -> int | None:
        """Synchronous ordered stop (for signal paths and atexit): CONT, TERM, wait, KILL, reap.

        Blocks up to ``grace`` seconds (plus a little for SIGKILL). Returns the exit code of the process
        itself, or None if it was never started.
        """
        popen = self._popen
        if popen is None:
            return None
        self.tree()
        self._remember_group()
        root = popen.pid
        # psutil would reap our direct child (and lose its exit code): it only watches the others, and the
        # child is reaped last, after the final signal to its group.
        others = [p for pid, p in self._known.items() if pid != root and not is_gone(p)]
        for sig in (signal.SIGCONT, signal.SIGTERM):
            self._signal_all(others, sig)
        if not self._wait_all(popen, others, grace):
            left = sum(not is_gone(p) for p in others) + (not _exited(popen))
            log.warning("%s: %d process(es) ignored SIGTERM for %.1fs; killing", self.name, left, grace)
            self._signal_all(others, signal.SIGKILL)
            self._wait_all(popen, others, 5.0)
        self._killpg(signal.SIGKILL)  # anything that joined the group meanwhile
        rc = popen.wait()
        self.survivors = [p for p in others if not is_gone(p)]
        if self.survivors:
            log.error("%s: %d process(es) of its tree survived SIGKILL: %s", self.name, len(self.survivors),
                      ", ".join(str(p.pid) for p in self.survivors))
        self._known.clear()
        return rc

    def leftovers(self) -> list[psutil.Process]:
        """Processes of its tree still alive after the process itself exited (e.g. vLLM's EngineCore when
        only the API server was killed): what :meth:`stop` still has to stop."""
        return [p for pid, p in self._known.items() if self._popen is not None and pid != self._popen.pid
                and not is_gone(p)]

    def _signal_all(self, others: Sequence[psutil.Process], sig: int) -> None:
        """The group, every remembered descendant, and the child itself (even if it left its group)."""
        self._killpg(sig)
        kill_tree(others, sig)
        if self._popen is not None and self._popen.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._popen.pid, sig)

    @staticmethod
    def _wait_all(popen: subprocess.Popen[bytes], others: Sequence[psutil.Process], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            if _exited(popen) and all(is_gone(p) for p in others):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)  # in a worker thread (see stop); nothing can block on another's exit here

    async def stop(self, grace: float = 5.0) -> int | None:
        """:meth:`stop_now` in a worker thread, so the event loop keeps running meanwhile."""
        return await asyncio.to_thread(self.stop_now, grace)

    def kill(self) -> None:
        """SIGKILL the whole tree at once (what a crash looks like); :meth:`wait_exit` or :meth:`stop` reaps."""
        if self._popen is None:
            return
        self.tree()
        self._killpg(signal.SIGKILL)
        kill_tree(self._known.values(), signal.SIGKILL)


class WorkerProcess(Protocol):
    """A worker's process as the node agent sees it: one it started (:class:`ManagedProcess`) or one it
    adopted (:class:`AdoptedProcess`). ``pid`` is None while none is known (a server known by URL only)."""

    name: str
    survivors: list[psutil.Process]

    @property
    def pid(self) -> int | None: ...

    @property
    def is_running(self) -> bool: ...

    def tree(self) -> list[psutil.Process]: ...

    def leftovers(self) -> list[psutil.Process]: ...

    def kill(self) -> None: ...

    def signal(self, sig: int) -> None: ...

    async def wait_exit(self) -> int | None: ...

    async def wait_ready(self, ready: Callable[[], Awaitable[bool]], *, timeout: float,
                         interval: float = 0.1, progress_cap: float | None = None) -> None: ...

    async def stop(self, grace: float = 5.0) -> int | None: ...

    def log_tail(self, lines: int = 30) -> str: ...


class AdoptedProcess:
    """The process of a server fleetward did not start, found through ``locate`` (a pidfile, a systemd unit,
    a container; None: known by URL only, no process to watch).

    It is watched like a child (a pidfd wakes :meth:`wait_exit` the moment it exits, its tree is sampled
    and remembered) but it is not ours: its exit code is unknown (None), and only :meth:`kill` and
    :meth:`stop`, called when the operator configured how to restart it, act on it. Every process is
    held by psutil identity (pid and start time), so a reused pid is never signalled.
    """

    def __init__(self, name: str, locate: Callable[[], int | None] | None) -> None:
        self.name = name
        self._locate = locate
        self._proc: psutil.Process | None = None
        self._known: dict[int, psutil.Process] = {}
        self.survivors: list[psutil.Process] = []
        self.refresh()  # made in a thread by an async caller (supervisor/adoption.py): a locator may take time

    def refresh(self) -> int | None:
        """Find the process again (after a restart: a new pid); its pid, or None."""
        pid = None
        if self._locate is not None:
            with contextlib.suppress(OSError, ValueError, subprocess.SubprocessError):
                pid = self._locate()
        if pid in never_a_target():  # a unit, container or search that names init or the agent's own
            log.warning("%s: its locator named pid %d (init, or this process or an ancestor); ignored", self.name, pid)
            pid = None
        proc = None
        if pid:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
        if proc is not None and (self._proc is None or proc.pid != self._proc.pid or not self._proc.is_running()):
            self._proc = proc
            self._known = {proc.pid: proc}
        return self.pid

    @property
    def watched(self) -> bool:
        """Whether there is a process to watch at all (not a server known by URL only)."""
        return self._locate is not None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def is_running(self) -> bool:
        if not self.watched:
            return True  # nothing to watch: its health is the supervisor's to judge, by its behaviour
        return self._proc is not None and not is_gone(self._proc)

    def tree(self) -> list[psutil.Process]:
        if self._proc is None or is_gone(self._proc):
            return []
        procs = tree_of(self._proc.pid)
        if procs and procs[0].create_time() != self._proc.create_time():
            return []  # the pid now belongs to another process
        for p in procs:
            self._known[p.pid] = p
        return procs

    def leftovers(self) -> list[psutil.Process]:
        root = self.pid
        return [p for pid, p in self._known.items() if pid != root and not is_gone(p)]

    def kill(self) -> None:
        self.tree()
        kill_tree(self._known.values(), signal.SIGKILL)

    def signal(self, sig: int) -> None:
        if self._proc is not None:
            kill_tree([self._proc], sig)

    async def wait_exit(self) -> int | None:
        """Return (None: the code of a process we did not start is not ours to read) once it exits."""
        proc = self._proc
        if proc is None:
            await asyncio.Event().wait()  # known by URL only: nothing to wait for until cancelled
            return None
        await _pidfd_wait(proc.pid, lambda: is_gone(proc))  # False: no pidfd, as it is already gone
        return None

    async def wait_ready(self, ready: Callable[[], Awaitable[bool]], *, timeout: float,
                         interval: float = 0.1, progress_cap: float | None = None) -> None:
        """Poll ``ready()`` (finding the process again on the way) until it is true or ``timeout`` passes (not
        ours: ``progress_cap`` is not used)."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(Exception):
                if await ready():
                    await self.located()
                    return
            if time.monotonic() >= deadline:
                raise ProcessError(f"{self.name} not ready after {timeout:.0f}s", name=self.name)
            await self.located()
            await asyncio.sleep(interval)

    async def located(self) -> int | None:
        """:meth:`refresh` off the event loop: a locator runs a command or reads every process."""
        return await asyncio.to_thread(self.refresh)

    def stop_now(self, grace: float = 5.0) -> int | None:
        """CONT, TERM, wait, KILL: the whole tree as last seen (what a restart must clear first)."""
        self.tree()
        procs = [p for p in self._known.values() if not is_gone(p)]
        for sig in (signal.SIGCONT, signal.SIGTERM):
            kill_tree(procs, sig)
        _, alive = psutil.wait_procs(procs, timeout=grace)
        if alive:
            log.warning("%s: %d process(es) ignored SIGTERM for %.1fs; killing", self.name, len(alive), grace)
            kill_tree(alive, signal.SIGKILL)
            psutil.wait_procs(alive, timeout=5.0)
        self.survivors = [p for p in procs if not is_gone(p)]
        if self.survivors:
            log.error("%s: %d process(es) survived SIGKILL: %s", self.name, len(self.survivors),
                      ", ".join(str(p.pid) for p in self.survivors))
        self._known.clear()
        return None

    async def stop(self, grace: float = 5.0) -> int | None:
        return await asyncio.to_thread(self.stop_now, grace)

    def log_tail(self, lines: int = 30) -> str:
        return ""


RUN_MARK = "FLEETWARD_RUN"  # set by a fleet in its own environment: every process it starts inherits it
# ... and this, so that the mark stays readable: setproctitle (vLLM's EngineCore and workers name themselves
# with it) writes the title over /proc/<pid>/environ unless SPT_NOENV is set; the title is then as long as the
# command line was, which is longer than vLLM's titles.
KEEP_ENVIRON = {"SPT_NOENV": "1"}


def marked_processes(mark: str, var: str = RUN_MARK) -> list[psutil.Process]:
    """Every live process (but this one) whose environment carries ``var=mark``: whatever a run started,
    however deep, including what was reparented to init when its parent died."""
    found = []
    me = os.getpid()
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        with contextlib.suppress(psutil.Error, OSError):
            if p.environ().get(var) == mark and not is_gone(p):
                found.append(p)
    return found


def never_a_target() -> set[int]:
    """The pids no process found by a pidfile, a record or a search may be: init (pid 1; in a pod that shares its
    process namespace, the pause container), this process and its ancestors (the shell, service manager or
    container runtime that runs it). Signalling one of them would take down the host's or the caller's own."""
    me = psutil.Process()
    with contextlib.suppress(psutil.Error):
        return {1, me.pid, *(p.pid for p in me.parents())}
    return {1, me.pid}


def is_the_process(proc: psutil.Process, *, started_by: float, slack_s: float = 1.0) -> bool:
    """Whether ``proc`` can be the process a pidfile or a record written at ``started_by`` (seconds since the
    epoch) names: it runs, it is not :func:`never_a_target`, and it started no later than that (a pid reused
    after its process died belongs to one that started later). ``slack_s``: the clocks' resolution."""
    try:
        return (proc.pid not in never_a_target() and proc.create_time() <= started_by + slack_s
                and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def pid_from_file(path: Path) -> int | None:
    """The pid written in ``path`` (a pidfile), or None when there is none. Not checked: a pid to be signalled
    comes from :func:`pid_of_pidfile`."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text else None


def pid_of_pidfile(path: Path) -> int | None:
    """The pid a pidfile names, when that process can be the one the file was written for
    (:func:`is_the_process`, by the file's modification time): a stale pidfile whose pid now belongs to
    another process, or one that names init or the caller, gives None."""
    try:
        written = path.stat().st_mtime
        pid = pid_from_file(path)
    except (FileNotFoundError, ValueError):
        return None
    if not pid:
        return None
    try:
        proc = psutil.Process(pid)
    except psutil.Error:
        return None
    if not is_the_process(proc, started_by=written):
        if (path, pid) not in _STALE_SAID:
            _STALE_SAID.add((path, pid))
            log.warning("pidfile %s names pid %d, which is not the process it was written for (it started after "
                        "the file was written, or is init or this process's own); ignored", path, pid)
        return None
    return pid


_STALE_SAID: set[tuple[Path, int]] = set()  # each stale pidfile is said once, not at every look


def pid_of_unit(unit: str) -> int | None:
    """The main pid of a systemd unit (``systemctl show``), or None while it has none. The name, read from a
    record or a file, comes after ``--``: one that starts with ``-`` is a unit's name, never an option."""
    out = subprocess.run(["systemctl", "show", "--property", "MainPID", "--value", "--", unit], capture_output=True,
                         text=True, timeout=10, check=True).stdout.strip()
    return int(out) or None


def pid_of_container(name: str) -> int | None:
    """The host pid of a running container's main process (``docker inspect``), or None; the name after
    ``--``, as :func:`pid_of_unit`'s."""
    out = subprocess.run(["docker", "inspect", "--format", "{{.State.Pid}}", "--", name], capture_output=True,
                         text=True, timeout=10, check=True).stdout.strip()
    return int(out) or None


def command_line_pattern(pattern: str) -> Any:
    """``pattern`` compiled as RE2 (google-re2), which matches in time linear in the text whatever the pattern:
    it comes from a fleet file or an ``attach/`` record, written by someone, and the agent runs it over every
    process's command line. Raises ``ValueError`` for what RE2 does not take (backreferences, lookaround)."""
    import re2  # google-re2

    options = re2.Options()
    options.log_errors = False
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        raise ValueError(f"not a regular expression RE2 takes (no backreferences or lookaround): {exc}") from None


def pid_matching(pattern: str) -> int | None:
    """The oldest live process whose command line, its arguments joined by spaces, contains a match of the
    regular expression ``pattern`` (:func:`command_line_pattern`), or None; never init, this process or one of
    its ancestors (:func:`never_a_target`: a pattern that also matches the command that started the agent). The
    oldest, so a server's children that share or extend its command line (forked workers, vLLM's EngineCore) are
    never taken for it. It reads every process: call it off the event loop."""
    regex = command_line_pattern(pattern)
    spared = never_a_target()
    found: list[tuple[float, int]] = []
    for p in psutil.process_iter(["pid", "cmdline", "create_time", "status"]):
        info = p.info
        if info["pid"] in spared or not info["cmdline"] or info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if regex.search(" ".join(info["cmdline"])):
            found.append((info["create_time"], info["pid"]))
    return min(found)[1] if found else None


LOOPBACK = ("localhost", "::1")
WILDCARD = ("0.0.0.0", "::", "")


def is_local_only(host: str) -> bool:
    """An address only this host reaches (loopback), or one that names no address (listen on all)."""
    return host in LOOPBACK or host in WILDCARD or host.startswith("127.")


def advertised_host(host: str, etcd_endpoints: Sequence[str], configured: str | None = None) -> str:
    """The address other hosts reach ``host`` (where something on this node listens) at: ``configured`` when
    given; ``host`` itself when others can reach it, or when etcd is on this host too (a one-host fleet); else
    this host's address on its route to the first etcd endpoint (no packet is sent)."""
    if configured:
        return configured
    if not is_local_only(host):
        return host
    remote = [e for e in etcd_endpoints if not is_local_only(e.rsplit(":", 1)[0].strip("[]"))]
    if not remote:
        return "127.0.0.1" if host in WILDCARD else host
    etcd_host, _, port = remote[0].rpartition(":")
    family = socket.AF_INET6 if ":" in etcd_host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((etcd_host.strip("[]"), int(port or 2379)))
        return str(s.getsockname()[0])


# What servers put before each message: vLLM's "(EngineCore pid=12) INFO 11-27 05:32:51 [core.py:133] ", uvicorn's
# "INFO:     ", Python logging's "2026-11-27 05:32:51,123 INFO name: ".
_LOG_PREFIX = re.compile(r"^(\(\w+ pid=\d+\)\s+)?((\d{4}-)?\d\d-\d\d[ T]\d\d:\d\d:\d\d[.,\d]*\s+)?"
                         r"((DEBUG|INFO|WARNING|ERROR|CRITICAL):?\s+)?((\d{4}-)?\d\d-\d\d \d\d:\d\d:\d\d[.,\d]*\s+)?"
                         r"(\[[^\]]*\]\s+)?")


def last_log_line(tail: str) -> str:
    """The last thing a process logged, without its timestamp and level: what it was doing. Indented lines
    (a traceback's, a warning's source line) belong to the message above them and are skipped."""
    for line in reversed(tail.splitlines()):
        if line[:1].isspace():
            continue
        text = _LOG_PREFIX.sub("", line.strip()).strip()
        if text:
            return text
    return ""


def spread_cores(n: int, cores: Sequence[int] | None = None) -> list[tuple[int, ...]]:
    """The cores each of ``n`` workers on this host binds its compute threads to, so that no two share one
    while there are enough: ``cores`` (default: those this process may run on) in ``n`` contiguous slices,
    one core left to the rest (servers, engine loops, the control plane) when there are more cores than
    workers; with fewer cores than workers, one each, taken in turn. (vLLM's own ``auto`` binds every
    CPU server on a host to the same cores: a server starting beside a busy one then gets almost no CPU.)"""
    have = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if n <= 0 or not have:
        return []
    if len(have) <= n:
        return [(have[i % len(have)],) for i in range(n)]
    usable = have[:-1]
    size, extra = divmod(len(usable), n)
    out, at = [], 0
    for i in range(n):
        take = size + (1 if i < extra else 0)
        out.append(tuple(usable[at:at + take]))
        at += take
    return out
