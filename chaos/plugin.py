"""fleetward's pytest plugin: opt-in, thin and lazy.

Installing fleetward does not load it into every pytest run. Ask for it: ``pytest -p fleetward.chaos.plugin``
(or ``addopts = "-p fleetward.chaos.plugin"`` in the pytest config), or ``pytest_plugins =
["fleetward.chaos.plugin"]`` in the top-level conftest. Loading it imports nothing but pytest; fleets,
proxies and experiments are imported when a test asks.

Fixtures
    ``fleetward_etcd`` / ``fleetward_mqtt`` (session): ``host:port`` of an etcd and an MQTT broker started
    for the session (override either in a conftest to use your own); ``fleetward_etcd_server`` /
    ``fleetward_mqtt_server`` are the servers themselves (``LocalEtcd`` / ``LocalBroker``).
    ``fleetward_fleet``: a factory of :class:`~fleetward.chaos.harness.TestFleet` on them, each used as
    ``async with fleetward_fleet(workers=2) as fleet:`` (a unique cluster and run folder per fleet).
    ``fleetward_proxy``: a factory of :class:`fleetward.chaos.net.Proxy` (``async with
    fleetward_proxy("name", ("127.0.0.1", port), http=True) as proxy:``).
    ``fleetward_gpu``: a factory of the fake GPU health source (skips while there is none).
    ``fleetward_experiment``: ``result = await fleetward_experiment("exp.yaml", **options)`` runs an
    experiment on the session's etcd and broker with its run folder under ``tmp_path``; see
    :func:`fleetward.chaos.runner.run_experiment`.

Experiment files as tests
    Files matching the ini option ``fleetward_chaos_files`` (default ``chaos_*.yaml``) are collected, one
    test each, marked ``fleetward_chaos``. A test fails when the run does not complete, the hypothesis
    deviates or a checker fails; its run folder is named in the failure. A bad file is a collection error
    naming file, line and field. ``--fleetward-etcd`` / ``--fleetward-mqtt`` run them on existing
    infrastructure instead of a private etcd and broker per experiment; ``--fleetward-chaos-out DIR``
    keeps their run folders there.

Markers
    ``fleetward_chaos`` (a chaos scenario), ``root`` (needs root: skipped with a reason otherwise;
    experiments with a root-only fault get it automatically).

Async tests
    The fleet and experiment fixtures are used from ``async def`` tests, which pytest runs only through a
    plugin (pytest-asyncio: ``@pytest.mark.asyncio`` or ``asyncio_mode = "auto"``; or anyio's marker). An
    ``async def`` test that uses a ``fleetward_*`` fixture and that no such plugin takes fails at setup,
    before any fixture starts, saying what to add (pytest alone says only that async functions are not
    natively supported). docs/chaos.md has a complete example.
"""

from __future__ import annotations

import asyncio
import fnmatch
import inspect
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from fleetward.fleet.infra import LocalBroker, LocalEtcd

__all__ = ["ExperimentFailed", "ExperimentFile", "ExperimentItem"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("fleetward_chaos_files", "glob of experiment files collected as tests", default="chaos_*.yaml")
    group = parser.getgroup("fleetward", "fleetward chaos experiments")
    group.addoption("--fleetward-etcd", dest="fleetward_etcd", default=None,
                    help="run collected experiments on this etcd (host:port) instead of a private one each")
    group.addoption("--fleetward-mqtt", dest="fleetward_mqtt", default=None,
                    help="... and on this MQTT broker")
    group.addoption("--fleetward-chaos-out", dest="fleetward_chaos_out", default=None,
                    help="keep the run folders of collected experiments under this folder")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fleetward_chaos: a fleetward chaos scenario")
    config.addinivalue_line("markers", "root: needs root (skipped with a reason otherwise)")


_FIXTURES = ("fleetward_etcd", "fleetward_mqtt", "fleetward_etcd_server", "fleetward_mqtt_server",
             "fleetward_fleet", "fleetward_proxy", "fleetward_gpu",
             "fleetward_experiment")
_ASYNC_MARKERS = ("asyncio", "anyio")  # pytest-asyncio (its auto mode adds the marker at collection), anyio


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    unrun = _unrun_coroutine(item)
    if unrun is not None:
        pytest.fail(unrun, pytrace=False)
    if item.get_closest_marker("root") is not None and os.geteuid() != 0:
        pytest.skip("needs root (this test run is not root)")


def _unrun_coroutine(item: pytest.Item) -> str | None:
    """What to add when ``item`` is an ``async def`` test using our fixtures that no plugin will run."""
    fn = getattr(item, "obj", None)
    if not isinstance(item, pytest.Function) or not (inspect.iscoroutinefunction(fn)
                                                     or inspect.isasyncgenfunction(fn)):
        return None
    ours = [f for f in item.fixturenames if f in _FIXTURES]
    if not ours or any(item.get_closest_marker(m) is not None for m in _ASYNC_MARKERS):
        return None
    named = [f for f in inspect.signature(fn).parameters if f in ours] or ours  # not those they depend on
    install = "" if item.config.pluginmanager.hasplugin("asyncio") else "pip install pytest-asyncio, then "
    return (f"{item.name} is an async def test (it uses {', '.join(named)}) and nothing runs it: "
            f"{install}mark it @pytest.mark.asyncio, or set asyncio_mode = \"auto\" in the pytest config "
            "(with asyncio_default_fixture_loop_scope = \"function\"); see \"A complete example\" in "
            "fleetward's docs/chaos.md")


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if file_path.suffix in (".yaml", ".yml") and fnmatch.fnmatch(file_path.name,
                                                                  parent.config.getini("fleetward_chaos_files")):
        return ExperimentFile.from_parent(parent, path=file_path)
    return None


# -- experiment files as tests ------------------------------------------------------------------------------


class ExperimentFailed(Exception):
    def __init__(self, result: Any) -> None:
        super().__init__("; ".join(result.failures()))
        self.result = result


class ExperimentFile(pytest.File):
    def collect(self) -> Iterator[pytest.Item]:
        from fleetward.chaos.catalogue import fault_catalogue
        from fleetward.chaos.runner import experiment_of
        from fleetward.fleet.errors import ConfigError

        try:
            exp, base = experiment_of(self.path)
        except ConfigError as exc:
            raise self.CollectError(str(exc)) from None
        catalogue, _ = fault_catalogue()
        item = ExperimentItem.from_parent(self, name=self.path.stem, experiment=exp, base=base)
        item.add_marker("fleetward_chaos")
        if any(catalogue[a.fault].needs_root for a in exp.method):
            item.add_marker("root")
        yield item


class ExperimentItem(pytest.Item):
    def __init__(self, *, experiment: Any, base: Path | None, **kw: Any) -> None:
        super().__init__(**kw)
        self.experiment = experiment
        self.base = base

    def runtest(self) -> None:
        from fleetward.chaos.runner import run_experiment

        opt = self.config.getoption
        root = opt("fleetward_chaos_out")
        if root:
            out = Path(root) / f"{self.path.stem}-{uuid.uuid4().hex[:6]}"
        else:
            out = self.config._tmp_path_factory.mktemp(f"chaos-{self.path.stem}"[:30]) / "run"  # type: ignore[attr-defined]
        result = asyncio.run(run_experiment(self.experiment, out=out, base=self.base, etcd=opt("fleetward_etcd"),
                                            mqtt=opt("fleetward_mqtt")))
        self.user_properties.append(("run_dir", str(result.run_dir)))
        if not result.ok:
            raise ExperimentFailed(result)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        from fleetward.fleet.errors import ConfigError

        if isinstance(excinfo.value, ConfigError):  # the run never began (e.g. the root-only faults)
            return f"experiment {self.experiment.title!r} could not run: {excinfo.value}"
        if isinstance(excinfo.value, ExperimentFailed):
            result = excinfo.value.result
            return "\n".join([f"experiment {self.experiment.title!r} did not pass:",
                              *(f"  {line}" for line in result.failures()),
                              f"run folder: {result.run_dir} (report.html)"])
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, f"chaos experiment: {self.experiment.title}"


# -- fixtures -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def fleetward_etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    """The session's etcd (:class:`~fleetward.fleet.infra.LocalEtcd`, its process as ``.process``)."""
    from fleetward.fleet.infra import LocalEtcd

    root = tmp_path_factory.mktemp("fleetward-etcd")
    etcd = LocalEtcd(root / "data")
    etcd.start(root / "logs")
    try:
        asyncio.run(etcd.wait_ready())
        yield etcd
    finally:
        asyncio.run(etcd.stop())


@pytest.fixture(scope="session")
def fleetward_mqtt_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBroker]:
    """The session's MQTT broker (:class:`~fleetward.fleet.infra.LocalBroker`, its process as ``.process``)."""
    from fleetward.fleet.infra import LocalBroker

    root = tmp_path_factory.mktemp("fleetward-mqtt")
    broker = LocalBroker(root / "data")
    broker.start(root / "logs")
    try:
        asyncio.run(broker.wait_ready())
        yield broker
    finally:
        asyncio.run(broker.stop())


@pytest.fixture(scope="session")
def fleetward_etcd(fleetward_etcd_server: LocalEtcd) -> str:
    """``host:port`` of an etcd for the session."""
    return fleetward_etcd_server.endpoint


@pytest.fixture(scope="session")
def fleetward_mqtt(fleetward_mqtt_server: LocalBroker) -> str:
    """``host:port`` of an MQTT broker for the session."""
    return fleetward_mqtt_server.endpoint


@pytest.fixture
def fleetward_fleet(fleetward_etcd: str, fleetward_mqtt: str, tmp_path: Path) -> Callable[..., Any]:
    """A factory of test fleets: ``async with fleetward_fleet(workers=2, sim=...) as fleet:``."""
    from fleetward.chaos.harness import TestFleet

    count = 0

    def make(**kw: Any) -> TestFleet:
        nonlocal count
        count += 1
        kw.setdefault("etcd", fleetward_etcd)
        kw.setdefault("mqtt", fleetward_mqtt)
        kw.setdefault("cluster", f"fw-{uuid.uuid4().hex[:8]}")
        kw.setdefault("run_dir", tmp_path / f"fleet-{count}")
        return TestFleet(**kw)

    return make


@pytest.fixture
def fleetward_proxy() -> Callable[..., Any]:
    """A factory of fault proxies (``fleetward.chaos.net.Proxy``), each an async context manager."""
    try:
        from fleetward.chaos import net as proxy
    except ImportError as exc:
        pytest.skip(f"the fault proxy is not available: {exc}")

    def make(name: str, upstreams: Any, **kw: Any) -> Any:
        return proxy.Proxy(name, upstreams, **kw)

    return make


@pytest.fixture
def fleetward_gpu() -> Callable[..., Any]:
    """A factory of fake GPU health sources (fault-injectable), for node agents under test."""
    try:
        from fleetward.chaos.fakegpu import FakeGpuSource
    except ImportError as exc:
        pytest.skip(f"the fake GPU health source is not available: {exc}")
    return FakeGpuSource


@pytest.fixture
def fleetward_experiment(fleetward_etcd: str, fleetward_mqtt: str, tmp_path: Path) -> Callable[..., Any]:
    """``result = await fleetward_experiment(path_or_model, **options)``: a run on the session's etcd and
    broker, its folder under ``tmp_path``."""
    from fleetward.chaos.runner import run_experiment

    count = 0

    async def run(experiment: Any, **options: Any) -> Any:
        nonlocal count
        count += 1
        options.setdefault("out", tmp_path / f"run-{count}")
        options.setdefault("etcd", fleetward_etcd)
        options.setdefault("mqtt", fleetward_mqtt)
        return await run_experiment(experiment, **options)

    return run
