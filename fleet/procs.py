"""Child processes that cannot outlive us.

Every process fleetward starts (etcd, the broker, workers) goes through :class:`ManagedProcess`:

- it runs in its own session, so its whole tree (e.g. vLLM's API server → EngineCore → Worker) can be
  signalled at once;
- it gets ``PR_SET_PDEATHSIG=SIGKILL``, so if the fleetward process that started it is ``kill -9``-ed
  the child dies with it instead of becoming an orphan;
- its output goes to a log file whose tail is quoted when it fails to start;
- :meth:`ManagedProcess.stop` is ordered: SIGCONT (a stopped process cannot handle SIGTERM), SIGTERM to
  the tree, wait with a deadline, SIGKILL what is left, reap.
- :meth:`ManagedProcess.wait_exit` wakes the moment the process exits (a pidfd in the event loop), which
  is what crash detection needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

import psutil

from fleetward.fleet.errors import PortInUseError, ProcessError

__all__ = ["ManagedProcess", "free_port", "kill_tree", "port_is_free", "tree_of"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _child_setup() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
        return True


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


def kill_tree(procs: Sequence[psutil.Process], sig: int = signal.SIGKILL) -> None:
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p.send_signal(sig)


class ManagedProcess:
    """One child process (and its tree) with an ordered, orphan-free life."""

    def __init__(self, name: str, argv: Sequence[str], *, log_path: Path, env: Mapping[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self._popen: subprocess.Popen[bytes] | None = None
        self._known: dict[int, psutil.Process] = {}

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **(self.env or {})}
        with open(self.log_path, "ab", buffering=0) as out:
            try:
                self._popen = subprocess.Popen(  # noqa: S603 - argv is ours
                    self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                    cwd=self.cwd, start_new_session=True, preexec_fn=_child_setup,  # noqa: PLW1509
                )
            except OSError as exc:
                raise ProcessError(f"{self.name}: cannot start {self.argv[0]}: {exc.strerror}",
                                   name=self.name) from exc
        log.debug("started %s pid %d: %s", self.name, self.pid, " ".join(self.argv))
        return self

    @property
    def pid(self) -> int:
        if self._popen is None:
            raise ProcessError(f"{self.name} was never started", name=self.name)
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return None if self._popen is None else self._popen.poll()

    @property
    def is_running(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

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
        if self.is_running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    async def wait_exit(self) -> int:
        """Return the exit code as soon as the process exits (pidfd readiness, no polling)."""
        popen = self._popen
        if popen is None:
            raise ProcessError(f"{self.name} was never started", name=self.name)
        if (rc := popen.poll()) is not None:
            return rc
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(popen.pid)
        except (OSError, AttributeError):
            while (rc := popen.poll()) is None:
                await asyncio.sleep(0.02)
            return rc
        exited = loop.create_future()
        loop.add_reader(fd, lambda: exited.done() or exited.set_result(None))
        try:
            if popen.poll() is None:
                await exited
        finally:
            loop.remove_reader(fd)
            os.close(fd)
        rc = popen.wait()
        return rc

    async def wait_ready(self, ready: Callable[[], Awaitable[bool]], *, timeout: float,
                         interval: float = 0.1) -> None:
        """Poll ``ready()`` until it is true; fail fast with the log tail if the process exits first."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.is_running:
                raise ProcessError(
                    f"{self.name} exited with code {self.returncode} before it was ready; "
                    f"log {self.log_path}:\n{self.log_tail()}",
                    name=self.name, exit_code=self.returncode, log_tail=self.log_tail())
            with contextlib.suppress(Exception):
                if await ready():
                    return
            if time.monotonic() >= deadline:
                raise ProcessError(f"{self.name} not ready after {timeout:.0f}s; log {self.log_path}:\n"
                                   f"{self.log_tail()}", name=self.name, log_tail=self.log_tail())
            await asyncio.sleep(interval)

    def stop_now(self, grace: float = 5.0) -> int | None:
        """Synchronous ordered stop (for signal paths and atexit): CONT, TERM, wait, KILL, reap."""
        if self._popen is None:
            return None
        procs = {p.pid: p for p in [*self._known.values(), *self.tree()]}.values()
        live = [p for p in procs if p.is_running()]
        kill_tree(live, signal.SIGCONT)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGTERM)
        kill_tree(live, signal.SIGTERM)
        _, alive = psutil.wait_procs(live, timeout=grace)
        if alive:
            log.warning("%s: %d process(es) ignored SIGTERM for %.0fs; killing", self.name, len(alive), grace)
            kill_tree(alive, signal.SIGKILL)
            psutil.wait_procs(alive, timeout=5)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        rc = self._popen.wait()
        self._known.clear()
        return rc

    async def stop(self, grace: float = 5.0) -> int | None:
        return await asyncio.to_thread(self.stop_now, grace)

    def kill(self) -> None:
        """SIGKILL the whole tree at once (what a crash looks like)."""
        procs = self.tree()
        kill_tree(procs, signal.SIGKILL)
