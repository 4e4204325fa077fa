"""ManagedProcess: whole-tree stop, stopped processes, prompt exit codes, no orphans after kill -9."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from fleetward.fleet import procs
from fleetward.fleet.errors import PortInUseError, ProcessError
from fleetward.fleet.procs import (
    ManagedProcess,
    ensure_port,
    free_port,
    is_gone,
    last_log_line,
    listening_socket,
    port_is_free,
)

# A child that starts a grandchild in a session of its own (so a process-group signal cannot reach it,
# only the remembered tree), prints the grandchild's pid, then waits for signals.
PARENT_OF_GRANDCHILD = """
import signal, subprocess, sys
ignore_term = sys.argv[1] == "ignore-term"
if ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = subprocess.Popen(
    [sys.executable, "-c",
     "import signal, sys\\n"
     "if sys.argv[1] == 'ignore-term': signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
     "print('READY', flush=True)\\n"
     "while True: signal.pause()", sys.argv[1]],
    start_new_session=True, stdout=subprocess.PIPE, text=True)
assert grandchild.stdout.readline().strip() == "READY"
print(f"GRANDCHILD {grandchild.pid}")
print("READY")
while True:
    signal.pause()
"""

# A child that starts a grandchild through ManagedProcess (PDEATHSIG), prints its pid, then waits.
MANAGER = """
import signal, sys
from pathlib import Path
from fleetward.fleet.procs import ManagedProcess
grandchild = ManagedProcess("grandchild", [sys.executable, "-c", "import signal\\nwhile True: signal.pause()"],
                            log_path=Path("grandchild.log")).start()
print(f"GRANDCHILD {grandchild.pid}")
print("READY")
while True:
    signal.pause()
"""

# A child that leaves a grandchild behind in its own process group when it exits (on SIGUSR1).
EXITS_LEAVING_A_GRANDCHILD = """
import signal, subprocess, sys
grandchild = subprocess.Popen([sys.executable, "-c", "import signal\\nwhile True: signal.pause()"])
print(f"GRANDCHILD {grandchild.pid}")
signal.signal(signal.SIGUSR1, lambda *_: sys.exit(0))
print("READY")
while True:
    signal.pause()
"""

WAIT_FOR_USR1_THEN_EXIT_3 = """
import signal, sys
signal.signal(signal.SIGUSR1, lambda *_: sys.exit(3))
print("READY")
while True:
    signal.pause()
"""


def _grandchild_pid(proc: ManagedProcess) -> int:
    line = next(line for line in proc.log_tail(200).splitlines() if line.startswith("GRANDCHILD "))
    return int(line.split()[1])


def _gone(pid: int) -> bool:
    try:
        return is_gone(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return True


async def test_stop_kills_the_whole_tree_including_a_grandchild_in_another_session(spawn_python) -> None:
    proc = await spawn_python(PARENT_OF_GRANDCHILD, "plain")
    grandchild = _grandchild_pid(proc)
    assert not _gone(grandchild)

    rc = await proc.stop()

    assert rc == -signal.SIGTERM
    assert _gone(grandchild)
    assert not proc.is_running


async def test_stop_kills_what_ignores_sigterm_after_the_grace(spawn_python) -> None:
    proc = await spawn_python(PARENT_OF_GRANDCHILD, "ignore-term")
    grandchild = _grandchild_pid(proc)

    rc = await proc.stop(grace=0.5)

    assert rc == -signal.SIGKILL
    assert _gone(grandchild)


async def test_stop_works_on_a_sigstopped_process(spawn_python, wait_until) -> None:
    proc = await spawn_python(PARENT_OF_GRANDCHILD, "plain")
    grandchild = _grandchild_pid(proc)
    for pid in (proc.pid, grandchild):
        os.kill(pid, signal.SIGSTOP)
    await wait_until(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED,
                     message="child stopped")

    rc = await proc.stop()

    assert rc == -signal.SIGTERM  # it was continued and then acted on SIGTERM, no SIGKILL needed
    assert _gone(grandchild)


async def test_wait_exit_returns_the_exit_code_when_the_process_exits(spawn_python) -> None:
    proc = await spawn_python(WAIT_FOR_USR1_THEN_EXIT_3)
    async with asyncio.TaskGroup() as tg:
        waiter = tg.create_task(proc.wait_exit())
        proc.signal(signal.SIGUSR1)
        async with asyncio.timeout(10):
            assert await waiter == 3
    assert proc.returncode == 3


async def test_stop_after_a_crash_kills_what_the_child_left_in_its_group(spawn_python) -> None:
    proc = await spawn_python(EXITS_LEAVING_A_GRANDCHILD)
    grandchild = _grandchild_pid(proc)

    proc.signal(signal.SIGUSR1)
    async with asyncio.timeout(10):
        assert await proc.wait_exit() == 0
    assert not _gone(grandchild)  # orphaned, but still in the child's process group

    await proc.stop()

    assert _gone(grandchild)


async def test_wait_exit_reports_death_by_signal_and_an_already_exited_process(spawn_python) -> None:
    proc = await spawn_python(WAIT_FOR_USR1_THEN_EXIT_3)
    proc.kill()
    async with asyncio.timeout(10):
        assert await proc.wait_exit() == -signal.SIGKILL
        assert await proc.wait_exit() == -signal.SIGKILL  # again, after it was reaped


async def test_kill_9_of_the_parent_kills_its_managed_grandchild(spawn_python, wait_until) -> None:
    parent = await spawn_python(MANAGER)
    grandchild = _grandchild_pid(parent)
    assert not _gone(grandchild)

    os.kill(parent.pid, signal.SIGKILL)  # only the parent: the grandchild must die by PDEATHSIG

    async with asyncio.timeout(10):
        assert await parent.wait_exit() == -signal.SIGKILL
    await wait_until(lambda: _gone(grandchild), timeout=10, message="grandchild died with its parent")


async def test_wait_ready_fails_fast_with_the_log_tail_when_the_process_exits(tmp_path: Path) -> None:
    proc = ManagedProcess("crasher", [sys.executable, "-c", "print('boom: bad config'); raise SystemExit(2)"],
                          log_path=tmp_path / "crasher.log").start()

    async def never() -> bool:
        return False

    with pytest.raises(ProcessError) as err:
        await proc.wait_ready(never, timeout=30)
    assert err.value.exit_code == 2
    assert "boom: bad config" in str(err.value)
    assert "crasher" in str(err.value)


LOADING = "import time\nwhile True:\n    print('loading weights', time.monotonic(), flush=True)\n    time.sleep(0.1)\n"


def _span(log: Path) -> float:
    """Seconds between the first and the last line the loader logged, by its own clock. Only whole lines count:
    the log is read while the loader writes, so its last line may be cut short ("loading weights")."""
    whole = log.read_text().split("\n")[:-1]
    stamps = [float(line.split()[-1]) for line in whole if line.startswith("loading")]
    return stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0


async def test_a_start_that_progresses_is_waited_for_past_the_timeout_and_one_that_stalls_is_not(
        tmp_path: Path, wait_until) -> None:
    """A vLLM start beside a busy worker, or a large model on slow storage, outlasts any fixed deadline while it
    progresses; the timeout counts from its last progress (CPU time, log output) instead."""
    loader = ManagedProcess("loader", [sys.executable, "-c", LOADING], log_path=tmp_path / "loader.log").start()
    ready = asyncio.Event()

    async def is_ready() -> bool:
        return ready.is_set()

    try:
        waiting = asyncio.create_task(loader.wait_ready(is_ready, timeout=2.0, progress_cap=600.0))
        await wait_until(lambda: _span(tmp_path / "loader.log") > 5.0, timeout=60, message="five seconds logged")
        assert not waiting.done(), "still waited for: it progresses"
        ready.set()
        await waiting
    finally:
        await loader.stop()
    silent = ManagedProcess("silent", [sys.executable, "-c", "import time; print('at the step that hangs', "
                                       "flush=True); time.sleep(3600)"], log_path=tmp_path / "silent.log").start()
    try:
        # Once at that step: an interpreter still starting on a loaded host has not logged it yet.
        await wait_until(lambda: "hangs" in (tmp_path / "silent.log").read_text(), timeout=60, message="at the step")
        with pytest.raises(ProcessError, match="no progress for 1s") as err:
            await silent.wait_ready(is_never, timeout=1.0, progress_cap=600.0)
        assert "it was at: at the step that hangs" in str(err.value)
    finally:
        await silent.stop()
    capped = ManagedProcess("capped", [sys.executable, "-c", LOADING], log_path=tmp_path / "capped.log").start()
    try:
        with pytest.raises(ProcessError, match="progressing"):
            await capped.wait_ready(is_never, timeout=60.0, progress_cap=1.0)
    finally:
        await capped.stop()


async def is_never() -> bool:
    return False


def test_start_of_a_missing_program_raises_process_error(tmp_path: Path) -> None:
    proc = ManagedProcess("ghost", [str(tmp_path / "no-such-program")], log_path=tmp_path / "ghost.log")
    with pytest.raises(ProcessError, match="ghost: cannot start"):
        proc.start()


def test_ensure_port_refuses_a_port_in_use_and_picks_one_for_zero() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        assert not port_is_free("127.0.0.1", busy)
        with pytest.raises(PortInUseError) as err:
            ensure_port("127.0.0.1", busy, name="thing")
    assert err.value.port == busy
    assert f"port {busy}" in str(err.value) and "in use" in str(err.value)
    picked = ensure_port("127.0.0.1", 0, name="thing")
    assert picked > 0 and port_is_free("127.0.0.1", picked)
    assert free_port() > 0


def test_a_listening_socket_queues_connections_before_anyone_accepts_and_refuses_a_port_in_use() -> None:
    with listening_socket("127.0.0.1", 0, name="thing") as held:
        port = held.getsockname()[1]
        assert port > 0
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # waits in the backlog, not refused
            pass
        with pytest.raises(PortInUseError, match=f"thing: port {port}"):
            listening_socket("127.0.0.1", port, name="thing")


def test_what_a_process_was_at_is_its_last_message_without_timestamp_level_or_source_lines() -> None:
    vllm = ("(APIServer pid=7) INFO 11-27 05:31:27 [model.py:2152] Using max model len 2048\n"
            "(EngineCore pid=9) INFO 11-27 05:33:27 [default_loader.py:501] Loading weights took 0.21 seconds\n"
            "/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: leaked semaphores\n"
            "  warnings.warn('resource_tracker: There appear to be %d '\n\n")
    assert last_log_line(vllm) == "/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: " \
                                  "leaked semaphores"
    assert last_log_line(vllm.rsplit("/usr", 1)[0]) == "Loading weights took 0.21 seconds"
    assert last_log_line("INFO:     Started server process [123]") == "Started server process [123]"
    assert last_log_line("2026-11-27 05:32:51,123 INFO fleetward.sim: serving") == "fleetward.sim: serving"
    assert last_log_line("") == last_log_line("\n  indented only\n") == ""


async def test_a_command_line_match_finds_the_oldest_process_not_its_children(tmp_path: Path) -> None:
    """``process.match``: a server's children that share its command line (forked workers) are not taken for it."""
    from fleetward.fleet.procs import pid_matching

    mark = f"fleetward-match-{os.getpid()}-{free_port()}"
    script = ("import subprocess, sys, time\n"
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', sys.argv[1]])\n"
              "time.sleep(60)\n")
    parent = ManagedProcess("matched", [sys.executable, "-c", script, mark], log_path=tmp_path / "m.log").start()
    try:
        for _ in range(500):
            if len(parent.tree()) == 2:
                break
            await asyncio.sleep(0.02)
        assert len(parent.tree()) == 2, "the child started"
        assert pid_matching(rf"{mark}$") == parent.pid
        assert pid_matching(mark + "-not-running") is None
    finally:
        await parent.stop(grace=2)


# A process that runs `pid_matching(argv[1])` and prints what it found: its parent (this test's pytest, the
# shell, ...) and init are never an answer, even when the pattern matches them.
MATCH_FROM_A_CHILD = "import sys; from fleetward.fleet.procs import pid_matching; print(pid_matching(sys.argv[1]))"


def test_a_command_line_match_never_takes_init_or_an_ancestor_of_the_caller() -> None:
    """``process.match`` in a pod that shares its process namespace: a pattern that also matches pid 1 or the
    command that started the agent must not hand either over to be killed."""
    import re
    import subprocess

    me = psutil.Process()
    forbidden = {"1", str(me.pid), *(str(p.pid) for p in me.parents())}  # init and the child's ancestors
    init = re.escape(" ".join(psutil.Process(1).cmdline()))
    ancestor = re.escape(" ".join(me.cmdline()))  # this pytest: the child's parent
    for pattern in (init, ancestor):
        out = subprocess.run([sys.executable, "-c", MATCH_FROM_A_CHILD, pattern], capture_output=True, text=True,
                             check=True, env={**os.environ, "PYTHONSAFEPATH": "1"}).stdout.strip()
        assert out not in forbidden, (pattern, out)


async def test_a_pidfile_names_its_process_only_while_that_process_is_the_one_it_was_written_for(
        tmp_path: Path) -> None:
    """A stale pidfile whose pid now belongs to a process started after the file was written, or one that names
    init or the caller, names nobody: an agent would otherwise restart (kill) a stranger."""
    from fleetward.fleet.procs import pid_of_pidfile

    server = ManagedProcess("server", [sys.executable, "-c", "import time; time.sleep(60)"],
                            log_path=tmp_path / "s.log").start()
    pidfile = tmp_path / "server.pid"
    try:
        pidfile.write_text(str(server.pid))  # as its start script writes it: after the process started
        assert pid_of_pidfile(pidfile) == server.pid
        started = psutil.Process(server.pid).create_time()
        os.utime(pidfile, (started - 60, started - 60))  # written a minute before this process started: stale
        assert pid_of_pidfile(pidfile) is None
        for stranger in (1, os.getpid()):  # init, the caller itself
            pidfile.write_text(str(stranger))
            assert pid_of_pidfile(pidfile) is None
        pidfile.unlink()
        assert pid_of_pidfile(pidfile) is None
    finally:
        await server.stop(grace=2)


@pytest.mark.parametrize(("look", "tool"), [(procs.pid_of_unit, "systemctl"), (procs.pid_of_container, "docker")])
def test_a_unit_or_container_name_from_a_record_is_never_an_option(monkeypatch: pytest.MonkeyPatch, look: Any,
                                                                   tool: str) -> None:
    """The name comes from an adopted server's record or a fleet file, written by someone: after ``--``, one that
    starts with ``-`` is a name the tool looks up, not an option it obeys."""
    ran: list[list[str]] = []

    def run(argv: list[str], **_kw: Any) -> Any:
        ran.append(argv)
        return type("Done", (), {"stdout": "0\n"})()

    monkeypatch.setattr(procs.subprocess, "run", run)
    assert look("--host=attacker") is None
    (argv,) = ran
    assert argv[0] == tool and argv[-2:] == ["--", "--host=attacker"]


def test_a_command_line_pattern_is_linear_however_it_is_written() -> None:
    """A ``process.match`` is written by whoever wrote the fleet file or the attach/ record, and the root agent
    runs it over every process's command line: ``(a+)+$`` over 10,000 a's and a b backtracks for ever in
    Python's ``re``; RE2 answers at once (not timed here: a backtracking engine would not return in the test's
    life)."""
    from fleetward.fleet.procs import command_line_pattern

    assert command_line_pattern(r"(a+)+$").search("a" * 10_000 + "b") is None
    assert command_line_pattern(r"vllm serve|vllm\.entrypoints").search("python -m vllm.entrypoints.openai")
    with pytest.raises(ValueError, match="no backreferences"):
        command_line_pattern(r"(vllm) \1")
