"""A test run stopped mid-way leaves nothing behind (chaos/runguard.py, chaos/leftovers.py), proven as processes.

Each test starts a real pytest run (the plugin loaded as the suite loads it, its own lock file so that it is not
refused beside this one) that holds what the suite holds: a simulated fleet (etcd, broker, agent, controller,
router, a worker), a vLLM server started detached as tests/vllm starts its servers (killed while it loads:
that costs nothing and it is a live vLLM process), and, as root, a process frozen by the cgroup freezer, an
iptables chain and a host network. Then the run is ended the way runs are ended, and nothing may be left.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from fleetward.chaos.leftovers import MARK_VAR
from fleetward.chaos.runguard import MARK
from fleetward.fleet.claims import Owner
from fleetward.fleet.procs import is_gone

ROOT = Path(__file__).resolve().parents[2]
AS_ROOT = os.geteuid() == 0

INI = """[pytest]
addopts = -p fleetward.chaos.runguard -p fleetward.chaos.plugin -p no:cacheprovider -s
asyncio_mode = auto
asyncio_default_fixture_loop_scope = function
"""

# What the run holds; each fixture says FINALIZED <name> when its teardown ran. The test prints HOLDING {json}.
HOLD = '''
import asyncio, json, os, subprocess, sys
import psutil, pytest
from fleetward.chaos.runguard import MARK
from fleetward.fleet.backends import VllmBackend
from fleetward.fleet.config import VllmConfig
from fleetward.fleet.procs import free_port, kill_tree, tree_of
from fleetward.fleet.worker import WorkerSpec

AS_ROOT = os.geteuid() == 0
# An operator's start script, as tests/vllm/conftest.py runs its servers: detached, in a session of its own.
START = """
import json, os, subprocess, sys
argv, env = json.loads(sys.argv[1]), json.loads(sys.argv[2])
p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                     env={**os.environ, **env}, start_new_session=True, preexec_fn=lambda: os.nice(10))
print(p.pid)
"""


def finalized(name):
    print(f"FINALIZED {name}", flush=True)


def titled(p):
    """Whether the process has set a vLLM process title (False once it is gone: a short-lived helper)."""
    try:
        return p.name().startswith("VLLM::")
    except psutil.Error:
        return False


async def engine_started(pid):
    """Until the server's engine process runs: vLLM's EngineCore, which sets its process title."""
    while not any(titled(p) for p in tree_of(pid)[1:]):
        assert psutil.pid_exists(pid), "the vLLM server died while it loaded"
        await asyncio.sleep(0.2)


@pytest.fixture
async def vllm_server():
    if os.environ.get("WITH_VLLM") is None:
        yield None
        return
    backend = VllmBackend(VllmConfig(), os.environ["TINY_MODEL"])
    spec = WorkerSpec(id="w", host="127.0.0.1", port=free_port(), model=backend.model_name, node="cpu")
    pid = int(subprocess.run([sys.executable, "-c", START, json.dumps(backend.argv(spec)),
                              json.dumps(backend.env(spec))], capture_output=True, text=True, check=True).stdout)
    if os.environ["WITH_VLLM"] == "engine":
        await asyncio.wait_for(engine_started(pid), 180)
    yield pid
    tree = tree_of(pid)
    kill_tree(tree)
    psutil.wait_procs(tree, timeout=10)
    finalized("vllm")


@pytest.fixture
def frozen(tmp_path):
    if not AS_ROOT:
        yield None
        return
    from fleetward.chaos.faults.process import FreezerGroup
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
    group = FreezerGroup(f"runguard-{os.getpid()}")
    group.add([sleeper.pid])
    group.freeze()
    yield {"pid": sleeper.pid, "group": str(group.path)}
    group.thaw()
    sleeper.kill()
    sleeper.wait()
    group.remove()
    finalized("frozen")


@pytest.fixture
async def chain():
    if not AS_ROOT:
        yield None
        return
    from fleetward.chaos.net.iptables import IptablesFilter
    f = IptablesFilter(f"runguard-{os.getpid()}")
    await f.block(free_port())
    yield f.chain
    await f.clear()
    finalized("chain")


@pytest.fixture
def network():
    if not AS_ROOT or os.environ.get("WITH_NETWORK") != "1":
        yield None
        return
    from fleetward.chaos.hostnet import HostNetwork
    net = HostNetwork(1).create()
    yield net.prefix
    net.destroy()
    finalized("network")


@pytest.fixture
async def fleet(fleetward_fleet):
    if os.environ.get("WITH_FLEET") != "1":
        yield None
        return
    async with fleetward_fleet(workers=1) as f:
        yield f
    finalized("fleet")


async def test_hold(fleet, frozen, chain, network, vllm_server):  # the vLLM server last: it loads on both cores
    tree = tree_of(vllm_server)[1:] if vllm_server else []  # some are short-lived helpers of multiprocessing
    engine = [p.pid for p in tree if titled(p)]  # the engine's processes, which live as long as the server
    print("HOLDING " + json.dumps({"mark": MARK, "pytest": os.getpid(), "vllm": vllm_server, "engine": engine,
                                   "tree": [p.pid for p in tree],
                                   "frozen": frozen, "chain": chain, "network": network}), flush=True)
    await asyncio.sleep(3600)
'''


class Run:
    """One pytest run in a session of its own, reading its output as it comes."""

    def __init__(self, folder: Path, lock: Path, test: str, env: dict[str, str]) -> None:
        self.lock = lock
        base = folder / f"base-{time.monotonic_ns()}"  # not /tmp/pytest-of-<user>, whose older runs it would rotate
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", test, f"--basetemp={base}"], cwd=folder, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            bufsize=0, start_new_session=True,
            env={**os.environ, "FLEETWARD_TEST_LOCK": str(lock), "PYTHONSAFEPATH": "1", **env})
        self.lines: list[str] = []
        self._partial = b""

    def read_until(self, prefix: str, within: float = 240.0) -> str:
        """What follows ``prefix`` on the first line that has it; fails, with the run's output, when the run ends
        without one or none comes within ``within`` seconds (a hung run, not a timing claim)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            while b"\n" in self._partial:
                raw, self._partial = self._partial.split(b"\n", 1)
                line = raw.decode(errors="replace") + "\n"
                self.lines.append(line)
                if prefix in line:  # after pytest's "test_hold.py " on the same line
                    return line.split(prefix, 1)[1].strip()
            if select.select([fd], [], [], 1.0)[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    pytest.fail(f"the run ended before {prefix!r}:\n{self.output}")
                self._partial += chunk
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.finish()
        pytest.fail(f"no {prefix!r} within {within} s:\n{self.output}")

    def finish(self) -> int:
        """The run's exit code once it exited, with what it wrote; not waiting for the end of its output, which
        what it left behind may hold open."""
        code = self.proc.wait(timeout=120)
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while select.select([fd], [], [], 0)[0] and (chunk := os.read(fd, 65536)):
            self._partial += chunk
        self.lines.append(self._partial.decode(errors="replace"))
        self._partial = b""
        return code

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def reapers(self) -> list[psutil.Process]:
        found = [p for p in psutil.Process(self.proc.pid).children() if "--reap" in p.cmdline()]
        assert found, "a run has its reaper"
        return found

    def reaped(self, owner: int) -> str | None:
        """What the run's reaper said once its run ended (None until it did)."""
        log = Path(f"{self.lock}.reaper.log")
        lines = log.read_text().splitlines() if log.exists() else []
        return next((line for line in lines if f" run {owner}:" in line), None)


def _until(cond: Callable[[], Any], within: float = 60.0, what: str = "") -> Any:
    """Until ``cond()`` holds (a deadline, not a timing claim)."""
    deadline = time.monotonic() + within
    while not (value := cond()):
        assert time.monotonic() < deadline, f"not within {within} s: {what}"
        time.sleep(0.05)
    return value


def _with_mark(mark: str) -> list[int]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARK_VAR) == mark and not is_gone(p):
                found.append(p.pid)
        except (psutil.Error, OSError):
            continue
    return found


def _chains() -> str:
    return subprocess.run(["iptables", "-w", "-S"], capture_output=True, text=True, check=True).stdout


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def _nothing_left(held: dict[str, Any]) -> bool:
    """Nothing the run held is left: no process of its mark, no freezer group, chain or namespace."""
    return not (_with_mark(held["mark"]) or any(psutil.pid_exists(p) for p in held["tree"])
                or (held["frozen"] and (Path(held["frozen"]["group"]).exists()
                                        or psutil.pid_exists(held["frozen"]["pid"])))
                or (held["chain"] and f"-N {held['chain']}" in _chains())
                or (held["network"] and held["network"] in _namespaces()))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fleetward.sim.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "pytest.ini").write_text(INI)
    (tmp_path / "test_hold.py").write_text(HOLD)
    (tmp_path / "test_empty.py").write_text("def test_empty():\n    pass\n")
    return tmp_path


@pytest.fixture
def start(folder: Path, tiny_model: Path) -> Iterator[Callable[..., tuple[Run, dict[str, Any]]]]:
    runs: list[Run] = []

    def run(**env: str) -> tuple[Run, dict[str, Any]]:
        r = Run(folder, folder / "lock", "test_hold.py", {"TINY_MODEL": str(tiny_model), **env})
        runs.append(r)
        held = json.loads(r.read_until("HOLDING "))
        assert held["vllm"] is None or psutil.pid_exists(held["vllm"]), "the vLLM server runs when the run ends"
        assert held["mark"] != MARK and _with_mark(held["mark"]), "the run's processes carry its own mark"
        return r, held

    yield run
    for r in runs:
        if r.proc.poll() is None:
            os.killpg(r.proc.pid, signal.SIGKILL)
            r.proc.wait()


def test_sigterm_to_the_run_s_process_group_ends_it_through_its_finalizers_leaving_nothing(
        start: Callable[..., tuple[Run, dict[str, Any]]]) -> None:
    """SIGTERM to the group, as a CI runner's timeout sends it: every fixture's teardown runs, the run exits
    non-zero, and its reaper finds nothing to reclaim (the finalizers did it all)."""
    run, held = start(WITH_FLEET="1", WITH_VLLM="loading")
    os.killpg(run.proc.pid, signal.SIGTERM)
    assert run.finish() == pytest.ExitCode.INTERRUPTED, run.output
    names = ["vllm", "fleet"] + (["frozen", "chain"] if AS_ROOT else [])
    assert [n for n in names if f"FINALIZED {n}" not in run.output] == [], run.output
    assert _nothing_left(held)
    said = _until(lambda: run.reaped(held["pytest"]), what="the reaper's line")
    assert said.endswith("reclaimed: nothing"), said


def test_sigkill_of_pytest_alone_leaves_nothing_once_its_reaper_ran(
        start: Callable[..., tuple[Run, dict[str, Any]]]) -> None:
    """SIGKILL of pytest alone (the OOM killer): no finalizer runs; the run's reaper ends the detached vLLM
    server and the fleet, thaws and removes the freezer group and removes the chain."""
    run, held = start(WITH_FLEET="1", WITH_VLLM="engine")
    assert held["engine"], "the server's engine runs: a process that sets its title (vLLM's EngineCore)"
    os.kill(held["pytest"], signal.SIGKILL)
    run.finish()
    assert "FINALIZED" not in run.output
    said = _until(lambda: run.reaped(held["pytest"]), what="the reaper's line")
    assert [p for p in [held["vllm"], *held["engine"]] if str(p) not in said] == [], said
    if AS_ROOT:
        assert "freezer/fleetward/" in said and held["chain"] in said, said
    assert _nothing_left(held), said


@pytest.mark.skipif(not AS_ROOT, reason="cgroups, chains and namespaces need root")
def test_the_next_run_reclaims_what_a_run_killed_with_its_reapers_left_and_says_so_in_one_line(
        folder: Path, start: Callable[..., tuple[Run, dict[str, Any]]]) -> None:
    """The run and its reapers are killed (the whole job was): a detached server, a frozen process, a chain and a
    host network stay. The next run reclaims them before its first test and says what, in one line."""
    run, held = start(WITH_NETWORK="1", WITH_VLLM="loading")
    for p in run.reapers():  # the run's own and its host network's
        p.kill()
    os.kill(held["pytest"], signal.SIGKILL)
    run.finish()
    assert psutil.pid_exists(held["vllm"]) and Path(held["frozen"]["group"]).exists()
    assert f"-N {held['chain']}" in _chains() and held["network"] in _namespaces()
    following = Run(folder, folder / "lock", "test_empty.py", {})
    assert following.finish() == 0, following.output
    (line,) = [line for line in following.output.splitlines() if "left by earlier runs and reclaimed:" in line]
    for part in (str(held["vllm"]), "freezer/fleetward/runguard-", held["chain"], held["network"]):
        assert part in line, line
    assert _nothing_left(held), line


def test_a_second_run_is_refused_naming_the_first_before_anything_is_set_up(tmp_path: Path) -> None:
    """Another run holds the lock: ``./dev test`` says so before it sets anything up, and so does pytest."""
    lock = tmp_path / "lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"pid {os.getpid()} since 2026-12-07 10:00:00 UTC in /src: pytest\n".encode())
    try:
        env = {**os.environ, "FLEETWARD_TEST_LOCK": str(lock)}
        dev = subprocess.run([str(ROOT / "dev"), "test"], capture_output=True, text=True, env=env, timeout=60)
        assert dev.returncode != 0
        assert f"another test run is going on this machine: pid {os.getpid()} since 2026-12-07" in dev.stderr
        assert "installing" not in dev.stderr and "static checks" not in dev.stderr, dev.stderr
        (tmp_path / "pytest.ini").write_text(INI)
        (tmp_path / "test_empty.py").write_text("def test_empty():\n    pass\n")
        second = Run(tmp_path, lock, "test_empty.py", {})
        assert second.finish() == 4, second.output
        assert f"another test run is going on this machine: pid {os.getpid()} since" in second.output
    finally:
        os.close(fd)


def test_a_mark_names_its_owner_so_that_a_dead_one_s_processes_are_found() -> None:
    from fleetward.chaos.leftovers import mark_owner

    owner = mark_owner(MARK)
    assert owner == Owner.of() and owner.alive
    assert mark_owner("0a1b2c") is None  # an older run's mark, without its owner: not this code's to judge
    assert not Owner(owner.pid, owner.start - 5).alive  # same pid, another start: someone else
