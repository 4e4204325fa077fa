"""Shared fixtures: one real etcd and one real Mosquitto per session, and per-test views of them.

Infrastructure (session-scoped, started on first use, stopped at the end of the session):

- ``etcd_endpoint`` (``host:port``) of a real etcd (:class:`LocalEtcd`, data under the session tmp dir);
- ``broker_endpoint`` (``host:port``) of a real MQTT broker (:class:`LocalBroker`: Mosquitto, or amqtt
  where Mosquitto is missing);
- ``session_processes``: the registry of processes that legitimately live for the whole session (the
  two above register themselves; a conftest that keeps its own long-lived processes registers them too).

Per test (function-scoped):

- ``cluster``: a cluster name unique to the test (``[a-z0-9-]``); ``keys``: its :class:`Keys`;
- ``store``: an :class:`EtcdStore` on the session etcd, closed after the test; the test's key space
  ``/fleetward/<cluster>/`` is deleted afterwards;
- ``bus``: a started :class:`MqttBus` on the session broker for ``cluster``, closed after the test;
- ``wait_until(predicate, timeout=..., interval=..., message=...)``: await a condition (sync or async
  predicate) with a deadline; fails the test with ``message`` when the deadline passes. Returns the
  predicate's truthy value;
- ``make_etcd(**kw)`` / ``make_broker(**kw)``: private etcd / broker instances for tests that stop or
  restart them (the shared ones are never restarted); stopped after the test;
- ``spawn_python(code, *args, ready="READY")``: run ``python -c code args...`` as a
  :class:`ManagedProcess` and wait until its output holds the ``ready`` line; stopped after the test;
- ``outside_servers(n, sim_config, prefix=())``: simulated workers started as an operator starts servers
  (detached, a pidfile each, a command to start one again; ``prefix`` runs before the server's argv), for
  fleetward to adopt; their trees killed after the test;
- ``fleetward_up(*args, run_dir=, cluster=)``: ``fleetward up ARGS`` as a user runs it (an async context
  manager yielding the process and a ``status()`` that returns ``fleetward status --json`` or None); on
  leaving, SIGTERM, and the test fails unless it exits 0 leaving no process behind;
  ``fleetward_cli(*args, cwd=None)``: any other ``fleetward`` command, run to completion.
- ``prometheus_installed``: Debian's prometheus is there (fails as root, where ``./dev setup`` installs it;
  skips otherwise);
- ``browser``: headless Chromium (Debian's ``chromium``, same rule): ``await browser.dom(url)`` is the page's
  DOM after its scripts ran, ``await browser.screenshot(url, path)`` a PNG of it.

Leftover processes: after each test module, any process started during the module that is still alive
(a descendant of pytest, or an orphan carrying this session's mark in its environment) and not registered
in ``session_processes`` is reported as a warning; if it is still alive when the session ends (after every
fixture was torn down) it is killed and the run fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest
import pytest_asyncio
from costreport import pytest_runtest_logreport, pytest_terminal_summary
from testkit import same_answer_of

from fleetward.chaos.runguard import MARK, MARK_VAR
from fleetward.fleet.bus import MqttBus
from fleetward.fleet.config import AttachConfig, SimConfig
from fleetward.fleet.errors import FleetwardError
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.infra import LocalBroker, LocalEtcd
from fleetward.fleet.keys import Keys
from fleetward.fleet.procs import ManagedProcess, free_port, is_gone, kill_tree, pid_from_file, tree_of

__all__ = ["pytest_runtest_logreport", "pytest_terminal_summary"]  # the cost report (tests/costreport.py)

# -- leftover processes -----------------------------------------------------------------------------------


class LeftoverProcessWarning(UserWarning):
    """A test module left a child process running."""


class SessionProcesses:
    """Pids (with their descendants) that may outlive a test module: session-scoped infrastructure."""

    def __init__(self) -> None:
        self._roots: set[int] = set()

    def register(self, proc: ManagedProcess | int) -> None:
        self._roots.add(proc if isinstance(proc, int) else proc.pid)

    def owns(self, proc: psutil.Process) -> bool:
        try:
            lineage = [proc.pid, *(p.pid for p in proc.parents())]
        except psutil.NoSuchProcess:
            return True
        return any(pid in self._roots for pid in lineage)


_SESSION_PROCESSES = SessionProcesses()
_SUSPECTS: dict[int, tuple[psutil.Process, str]] = {}


# Every process started from this session inherits the run's mark (fleetward.chaos.runguard, loaded by the pytest
# config), so one that was orphaned (reparented to init, no longer a descendant of pytest) is still found; the
# run's reaper ends it if the run itself dies first.


def _marked(p: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error, OSError):
        return p.environ().get(MARK_VAR) == MARK
    return False


def _live_children() -> list[psutil.Process]:
    """Live descendants of pytest, and orphans started from this session."""
    me = os.getpid()
    found = {p.pid: p for p in psutil.Process().children(recursive=True)}
    for p in psutil.process_iter():
        if p.pid != me and p.pid not in found and _marked(p):
            found[p.pid] = p
    return [p for p in found.values() if not is_gone(p)]


def _describe(p: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return f"pid {p.pid}: {' '.join(p.cmdline())[:200]}"
    return f"pid {p.pid}"


@pytest.fixture(scope="session")
def session_processes() -> SessionProcesses:
    return _SESSION_PROCESSES


@pytest.fixture(scope="module", autouse=True)
def _no_leftover_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    before = {p.pid for p in _live_children()}
    yield
    leftovers = [p for p in _live_children() if p.pid not in before and not _SESSION_PROCESSES.owns(p)]
    for p in leftovers:
        _SUSPECTS[p.pid] = (p, request.module.__name__)
    if leftovers:
        warnings.warn(LeftoverProcessWarning(
            f"{request.module.__name__} left {len(leftovers)} process(es) running (fails the session if "
            f"still alive at its end): " + "; ".join(_describe(p) for p in leftovers)), stacklevel=1)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    orphans = [(p, module) for p, module in _SUSPECTS.values() if not is_gone(p)]
    if not orphans:
        return
    lines = [f"  {module}: {_describe(p)}" for p, module in orphans]
    for p, _ in orphans:
        with contextlib.suppress(psutil.Error):
            for q in [*p.children(recursive=True), p]:
                q.kill()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = "child processes outlived the session (killed now):\n" + "\n".join(lines)
    if reporter is not None:
        reporter.write("\n")
        reporter.write_line(message, red=True)
    else:  # pragma: no cover
        print(message, file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


# -- running on several processes (pytest-xdist, ``./dev test`` asks for it) ----------------------------------

# Modules that take minutes, longest first: they start first, so none of them is left for the end.
_FIRST = ("tests/vllm/", "tests/chaos/test_soak.py", "tests/cli/test_bench.py", "tests/chaos/test_library.py",
          "tests/operations/test_alert_lifecycle.py", "tests/autoscale/test_live.py",
          "tests/autoscale/test_replay_cli.py", "tests/operations/test_prometheus.py", "tests/clients/")


def _rank(item: pytest.Item) -> int:
    path = Path(str(item.fspath)).as_posix()
    return next((i for i, part in enumerate(_FIRST) if f"/{part}" in path), len(_FIRST))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_rank)  # stable: a module's tests keep their order


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Each module runs on one process (its module-scoped fixtures start once), and the vLLM modules all on one:
    two sets of vLLM servers on 2 cores would starve each other's engines."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "tests/vllm" if module.startswith("tests/vllm/") else module

    return ModuleScheduling(config, log)


# -- session infrastructure ------------------------------------------------------------------------------


# The session's etcd and broker are the plugin's (fleetward.chaos.plugin, loaded by the pytest config): one
# fixture for users' tests and ours. Their processes live for the whole session.


@pytest.fixture(scope="session")
def etcd_endpoint(fleetward_etcd_server: LocalEtcd) -> str:
    assert fleetward_etcd_server.process is not None
    _SESSION_PROCESSES.register(fleetward_etcd_server.process)
    return fleetward_etcd_server.endpoint


@pytest.fixture(scope="session")
def broker_endpoint(fleetward_mqtt_server: LocalBroker) -> str:
    assert fleetward_mqtt_server.process is not None
    _SESSION_PROCESSES.register(fleetward_mqtt_server.process)
    return fleetward_mqtt_server.endpoint


# -- per-test views ---------------------------------------------------------------------------------------


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> str:
    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")
    return f"t{uuid.uuid4().hex[:8]}-{name[:40]}".rstrip("-")


@pytest.fixture
def keys(cluster: str) -> Keys:
    return Keys(cluster)


@pytest_asyncio.fixture
async def store(etcd_endpoint: str, keys: Keys) -> AsyncIterator[EtcdStore]:
    s = EtcdStore(etcd_endpoint, timeout_s=5.0, attempts=5, retry_budget_s=10.0)
    try:
        yield s
    finally:
        await s.aclose()
        async with EtcdStore(etcd_endpoint, attempts=2, retry_budget_s=2.0) as cleanup:
            with contextlib.suppress(FleetwardError):
                await cleanup.delete(keys.root, prefix=True)


@pytest_asyncio.fixture
async def bus(broker_endpoint: str, cluster: str) -> AsyncIterator[MqttBus]:
    b = await MqttBus(broker_endpoint, cluster, connect_attempts=3).start()
    try:
        yield b
    finally:
        await b.aclose(flush_timeout=1.0)


WaitUntil = Callable[..., Awaitable[Any]]


async def _wait_until(predicate: Callable[[], Any], *, timeout: float = 10.0, interval: float = 0.02,
                      message: str | None = None) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if loop.time() >= deadline:
            pytest.fail(f"not within {timeout}s: {message or getattr(predicate, '__name__', predicate)}")
        await asyncio.sleep(interval)


@pytest_asyncio.fixture(loop_scope="module")
async def healthy(fleet: Any) -> AsyncIterator[Any]:
    """The module's ``fleet`` (a :class:`~fleetward.chaos.harness.TestFleet` the module defines) with every
    worker up, GPUs cleared, quarantines lifted and no fault switched on, before and after the test."""
    await fleet.restore(timeout=60)
    yield fleet
    await fleet.restore(timeout=60)


@pytest.fixture
def wait_until() -> WaitUntil:
    return _wait_until


@pytest.fixture
def same_answer() -> Callable[[bytes, bytes], None]:
    """``same_answer(got, want)``: asserts two answers to one request read the same (``testkit.same_answer_of``)."""
    return same_answer_of


@pytest_asyncio.fixture
async def make_etcd(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[LocalEtcd]]]:
    started: list[LocalEtcd] = []

    async def make(**kw: Any) -> LocalEtcd:
        n = len(started)
        etcd = LocalEtcd(kw.pop("data_dir", tmp_path / f"etcd-{n}"), **kw)
        started.append(etcd)
        etcd.start(tmp_path / "logs")
        await etcd.wait_ready()
        return etcd

    try:
        yield make
    finally:
        for etcd in started:
            await etcd.stop()


@pytest_asyncio.fixture
async def make_broker(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[LocalBroker]]]:
    started: list[LocalBroker] = []

    async def make(**kw: Any) -> LocalBroker:
        n = len(started)
        broker = LocalBroker(kw.pop("data_dir", tmp_path / f"broker-{n}"), **kw)
        started.append(broker)
        broker.start(tmp_path / "logs")
        await broker.wait_ready()
        return broker

    try:
        yield make
    finally:
        for broker in started:
            await broker.stop()


@pytest_asyncio.fixture
async def spawn_python(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[ManagedProcess]]]:
    started: list[ManagedProcess] = []

    async def spawn(code: str, *args: str, ready: str | None = "READY", timeout: float = 30.0,
                    name: str | None = None) -> ManagedProcess:
        name = name or f"py{len(started)}"
        proc = ManagedProcess(name, [sys.executable, "-c", code, *args], log_path=tmp_path / f"{name}.log",
                              env={"PYTHONUNBUFFERED": "1", "PYTHONSAFEPATH": "1"},
                              cwd=tmp_path)
        started.append(proc)
        proc.start()
        if ready is not None:
            async def has_ready_line() -> bool:
                return ready in proc.log_tail(200).splitlines()

            await proc.wait_ready(has_ready_line, timeout=timeout, interval=0.02)
        return proc

    try:
        yield spawn
    finally:
        for proc in started:
            await proc.stop(grace=2.0)



# -- servers fleetward did not start -----------------------------------------------------------------------

# What an operator's start script does: run the server detached (its own session), write its pid, return.
START = """
import subprocess, sys
port, pidfile, log, config, *prefix = sys.argv[1:]
p = subprocess.Popen([*prefix, sys.executable, "-m", "fleetward.sim.server", "--port", port, "--config-json", config],
                     stdout=open(log, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                     start_new_session=True)
open(pidfile, "w").write(str(p.pid))
"""


class OutsideServer:
    """One server started outside fleetward, and the command that starts it (again)."""

    def __init__(self, root: Path, name: str, config: SimConfig, prefix: Sequence[str] = ()) -> None:
        self.config = config
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.pidfile = root / f"{name}.pid"
        self.command = [sys.executable, "-c", START, str(self.port), str(self.pidfile), str(root / f"{name}.log"),
                        self.config.model_dump_json(), *prefix]

    def start(self) -> None:
        subprocess.run(self.command, check=True, timeout=30)

    @property
    def process(self) -> psutil.Process | None:
        pid = pid_from_file(self.pidfile)
        try:
            return psutil.Process(pid) if pid else None
        except psutil.NoSuchProcess:
            return None

    def kill(self) -> None:
        """SIGKILL its whole tree, and wait until it is gone."""
        p = self.process
        if p is not None and not is_gone(p):
            tree = tree_of(p.pid)
            kill_tree(tree)
            psutil.wait_procs(tree, timeout=10)

    def entry(self, *, restart: bool, process: bool = True, **kw: Any) -> AttachConfig:
        return AttachConfig(url=self.url, process={"pidfile": self.pidfile} if process else None,
                            restart_command=self.command if restart else (), **kw)




@pytest.fixture
def outside_servers(tmp_path: Path) -> Iterator[Callable[..., list[OutsideServer]]]:
    """``outside_servers(n, sim_config, prefix=())``: n simulated workers started the way an operator starts
    theirs (detached, a pidfile each), for fleetward to adopt. Killed after the test with their trees, wherever
    they were restarted."""
    made: list[OutsideServer] = []

    def start(n: int, config: SimConfig, prefix: Sequence[str] = ()) -> list[OutsideServer]:
        batch = [OutsideServer(tmp_path / "outside", f"s{len(made) + i}", config, prefix) for i in range(n)]
        (tmp_path / "outside").mkdir(exist_ok=True)
        for server in batch:
            server.start()
        made.extend(batch)
        return batch

    try:
        yield start
    finally:
        for server in made:
            server.kill()


# -- the CLI as a user runs it ----------------------------------------------------------------------------

FLEETWARD = [sys.executable, "-m", "fleetward.cli"]


def _cli(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FLEETWARD, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "PYTHONSAFEPATH": "1"})


@pytest.fixture
def fleetward_cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    return _cli


class UpProcess:
    def __init__(self, process: ManagedProcess, run_dir: Path, cluster: str) -> None:
        self.process, self.run_dir, self.cluster = process, run_dir, cluster

    def status(self) -> dict[str, Any] | None:
        r = _cli("status", "--json", "--run-dir", str(self.run_dir), "--cluster", self.cluster, timeout=60)
        return json.loads(r.stdout) if r.returncode == 0 else None


@pytest.fixture
def fleetward_up() -> Callable[..., contextlib.AbstractAsyncContextManager[UpProcess]]:
    @contextlib.asynccontextmanager
    async def up(*args: str, run_dir: Path, cluster: str) -> AsyncIterator[UpProcess]:
        proc = ManagedProcess("fleetward up", [*FLEETWARD, "up", *args, "--run-dir", str(run_dir), "--cluster",
                                               cluster], log_path=run_dir / "up.log",
                              env={"PYTHONSAFEPATH": "1"}).start()
        try:
            yield UpProcess(proc, run_dir, cluster)
            tree = proc.tree()
            proc.signal(signal.SIGTERM)
            assert await proc.wait_exit() == 0, proc.log_tail()
            assert "stopped; no process left behind" in proc.log_tail()
            assert [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
        finally:
            if proc.is_running:
                await proc.stop(grace=5)

    return up


def _need_debian(what: str, found: bool, package: str) -> None:
    if found:
        return
    message = f"no {what}: `./dev setup` installs Debian's {package} package"
    if os.geteuid() == 0:  # CI and `./dev setup` as root install it: missing is a failure
        pytest.fail(message)
    pytest.skip(message + " (needs root)")


@pytest.fixture
def prometheus_installed() -> None:
    from fleetward.fleet.errors import ProcessError
    from fleetward.fleet.prometheus import prometheus_binary

    try:
        prometheus_binary()
    except ProcessError:
        _need_debian("prometheus binary", False, "prometheus")


class Browser:
    """Headless Chromium, one short-lived process per page load (what an operator's browser would show)."""

    def __init__(self, binary: str, profile: Path) -> None:
        self.binary, self.profile = binary, profile

    async def _run(self, url: str, *flags: str, budget_ms: int = 3000) -> str:
        proc = await asyncio.create_subprocess_exec(
            self.binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
            f"--user-data-dir={self.profile}", f"--virtual-time-budget={budget_ms}", *flags, url,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise
        assert proc.returncode == 0, f"chromium exited {proc.returncode} on {url}"
        return out.decode(errors="replace")

    async def dom(self, url: str) -> str:
        """The rendered document, without its scripts (their source is not what the page shows)."""
        return re.sub(r"<script\b.*?</script>", "", await self._run(url, "--dump-dom"), flags=re.S)

    async def screenshot(self, url: str, path: Path, *, width: int = 1400, height: int = 1100) -> Path:
        await self._run(url, f"--screenshot={path}", f"--window-size={width},{height}")
        return path


@pytest.fixture
def browser(tmp_path: Path) -> Browser:
    import shutil

    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    _need_debian("chromium", binary is not None, "chromium")
    assert binary is not None
    return Browser(binary, tmp_path / "chromium-profile")
