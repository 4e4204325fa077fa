"""The production GPU health sources over the boundaries they read: NVML's bindings (the fake of
tests/fakenvml installed in place of the ``pynvml`` module) and dcgm-exporter's ``/metrics`` (its documented
metric names, served over HTTP); which one a host opens (``gpu:``), and the GPUs its workers get."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from gpufakes import FAKE_BINDINGS, HEALTHY, FakeDcgmExporter, FakeNvml
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetward.fleet.clock import ManualClock
from fleetward.fleet.config import FleetConfig, GpuActionName, GpuConfig, ThrottleReason, load_fleet_config
from fleetward.fleet.errors import ConfigError, FleetwardError
from fleetward.supervisor.dcgm import DcgmExporterSource, parse_metrics
from fleetward.supervisor.gpu import (
    THROTTLE_REASONS,
    Action,
    GpuEvent,
    GpuEventKind,
    GpuPolicy,
    GpuSourceError,
    NvmlSource,
)
from fleetward.supervisor.gpuhost import assign, gpus_of, open_source, policy_of

K = GpuEventKind


def kinds(events: list[GpuEvent]) -> list[tuple[int, GpuEventKind, int | None]]:
    return [(e.gpu, e.kind, e.code) for e in events]


# ------------------------------------------------------------------------------ NVML over its fake bindings


@pytest.fixture
def nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    """The fake bindings in place of ``pynvml`` for this test, over 3 GPUs."""
    spec = importlib.util.spec_from_file_location("pynvml", FAKE_BINDINGS / "pynvml.py")
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    spec.loader.exec_module(module)
    fake = FakeNvml(tmp_path / "nvml.json", gpus=3)
    monkeypatch.setenv("FLEETWARD_FAKE_NVML", str(fake.path))
    return fake


def test_nvml_reports_xids_after_it_opened_and_a_bus_fault_loses_the_gpu(nvml: FakeNvml) -> None:
    nvml.xid(0, 13)  # before the source opened: NVML's event set never sees it
    with NvmlSource(clock=ManualClock()) as source:
        assert [g.uuid for g in source.gpus()] == [nvml.uuid(i) for i in range(3)]
        assert source.poll() == []
        nvml.xid(2, 79)
        nvml.xid(1, 31)
        assert kinds(source.poll()) == [(2, K.XID, 79), (1, K.XID, 31), (2, K.LOST, None)]
        assert kinds(source.poll()) == [(2, K.LOST, None)], "a lost GPU is a level, and nothing else"
        assert source.processes()[2] == frozenset(), "a lost GPU runs nothing NVML can name"
        result = source.selftest(2)
        assert not result.passed and "lost" in result.reason
    with NvmlSource() as again:  # an agent that restarts on this host: the lost GPU is watched, as lost
        assert [g.name for g in again.gpus()] == ["NVIDIA H100 80GB HBM3 (fake)"] * 2 + ["lost GPU"]
        assert kinds(again.poll()) == [(2, K.LOST, None)]


def test_nvml_reports_what_is_wrong_already_when_it_opens(nvml: FakeNvml) -> None:
    nvml.state["gpus"][1].update(dbe=2, clocks_event_reasons=0x40, remap_pending=1)
    nvml.state["gpus"][2]["ecc"] = False  # a board without ECC: its counts are not supported, not an error
    nvml.throttle(0, 0x04)
    with NvmlSource() as source:
        got = kinds(source.poll())
        assert (1, K.ECC_DBE, None) in got and (1, K.THROTTLE_STARTED, None) in got
        assert (1, K.RETIREMENT_PENDING, None) in got and (0, K.THROTTLE_STARTED, None) in got
        assert not [e for e in got if e[0] == 2]
        assert source.poll() == [], "edges: reported once"
        nvml.throttle(1, 0)
        assert kinds(source.poll()) == [(1, K.THROTTLE_STOPPED, None)]


def test_nvml_names_the_processes_on_each_gpu(nvml: FakeNvml) -> None:
    nvml.run_process(1, 4242)
    nvml.run_process(1, 4243)
    with NvmlSource() as source:
        assert source.processes() == {0: frozenset(), 1: frozenset({4242, 4243}), 2: frozenset()}
        assert gpus_of([1, 4243], source.processes()) == (1,)
        assert gpus_of([1, 2], source.processes()) == ()


def test_auto_opens_nvml_where_it_sees_a_gpu_and_nothing_where_it_cannot(nvml: FakeNvml, tmp_path: Path) -> None:
    source, choice = open_source(GpuConfig())
    assert source is not None and choice.source == "nvml" and "3 GPUs: NVIDIA H100" in choice.detail
    source.close()
    FakeNvml(nvml.path, init_error="NVML_ERROR_DRIVER_NOT_LOADED")
    source, choice = open_source(GpuConfig())
    assert source is None and choice.source == "off" and "NVML_ERROR_DRIVER_NOT_LOADED" in choice.detail
    with pytest.raises(FleetwardError, match=r"NVML cannot initialise"):
        open_source(GpuConfig(source="nvml"))  # asked for by name: an error, not a host that watches nothing
    assert open_source(GpuConfig(source="off"))[1].line == "GPU health: off (gpu: off in the fleet file)"


def test_auto_without_bindings_says_how_to_install_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    source, choice = open_source(GpuConfig())
    assert source is None and "pip install 'fleetward[gpu]'" in choice.detail


# ---------------------------------------------------------------------------------------- dcgm-exporter


@pytest.fixture
def exporter() -> Iterator[FakeDcgmExporter]:
    with FakeDcgmExporter() as e:
        yield e


def test_dcgm_reads_the_gpus_and_their_names_from_the_exporter(exporter: FakeDcgmExporter) -> None:
    exporter.set({0: HEALTHY, 1: HEALTHY})
    with DcgmExporterSource(exporter.url) as source:
        gpus = source.gpus()
        assert [(g.index, g.name) for g in gpus] == [(0, "NVIDIA H100 80GB HBM3"), (1, "NVIDIA H100 80GB HBM3")]
        assert gpus[1].uuid == "GPU-dc9m0001-0000-4000-8000-000000000000"
        assert source.poll() == [] and source.processes() == {}


def test_dcgm_xids_ecc_and_throttling_become_the_same_events_as_nvml(exporter: FakeDcgmExporter) -> None:
    exporter.set({0: {**HEALTHY, "DCGM_FI_DEV_XID_ERRORS": 13}, 1: {**HEALTHY, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 1}})
    with DcgmExporterSource(exporter.url) as source:
        # At open: the last Xid is the past (not reported); a volatile DBE count is now (reported).
        assert kinds(source.poll()) == [(1, K.ECC_DBE, None)]
        exporter.set({0: {**HEALTHY, "DCGM_FI_DEV_XID_ERRORS": 48, "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": 0x40},
                      1: {**HEALTHY, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 1}})
        assert kinds(source.poll()) == [(0, K.XID, 48), (0, K.THROTTLE_STARTED, None)]
        assert source.poll() == [], "the same page again: nothing new"
        exporter.set({0: {**HEALTHY, "DCGM_FI_DEV_XID_ERRORS": 79}, 1: HEALTHY})
        events = source.poll()
        assert kinds(events) == [(0, K.XID, 79), (0, K.LOST, None)]
        assert [GpuPolicy().classify(e)[0] for e in events] == [Action.DRAIN_AND_QUARANTINE] * 2
        exporter.set({1: HEALTHY})  # the lost GPU's rows are gone
        assert kinds(source.poll()) == [(0, K.LOST, None)]


def test_dcgm_sees_an_xid_repeat_through_the_windowed_count(exporter: FakeDcgmExporter) -> None:
    exporter.set({0: {**HEALTHY, "DCGM_FI_DEV_XID_ERRORS": 31}}, {0: {31: 1}})
    with DcgmExporterSource(exporter.url) as source:
        assert source.poll() == []
        exporter.set({0: {**HEALTHY, "DCGM_FI_DEV_XID_ERRORS": 31}}, {0: {31: 2}})
        assert kinds(source.poll()) == [(0, K.XID, 31)], "the gauge did not move; the count did"
        exporter.set({0: {**HEALTHY, "DCGM_FI_DEV_XID_ERRORS": 31}}, {0: {31: 1}})  # the window slid
        assert source.poll() == []


def test_dcgm_a_gpu_missing_from_the_page_is_lost(exporter: FakeDcgmExporter) -> None:
    exporter.set({0: HEALTHY, 1: HEALTHY})
    with DcgmExporterSource(exporter.url) as source:
        source.poll()
        exporter.set({0: HEALTHY})
        assert kinds(source.poll()) == [(1, K.LOST, None)]
        assert not source.selftest(1).passed


def test_dcgm_pending_retirement_and_remap_failure(exporter: FakeDcgmExporter) -> None:
    exporter.set({0: HEALTHY, 1: HEALTHY})
    with DcgmExporterSource(exporter.url) as source:
        source.poll()
        exporter.set({0: {**HEALTHY, "DCGM_FI_DEV_RETIRED_PENDING": 2},
                      1: {**HEALTHY, "DCGM_FI_DEV_ROW_REMAP_FAILURE": 1}})
        events = source.poll()
        assert kinds(events) == [(0, K.RETIREMENT_PENDING, None), (1, K.RETIREMENT_PENDING, None)]
        assert "DCGM_FI_DEV_ROW_REMAP_FAILURE" in events[1].detail
        assert source.poll() == []


def test_dcgm_lifetime_ecc_counts_only_count_from_now(exporter: FakeDcgmExporter) -> None:
    older = {"DCGM_FI_DEV_XID_ERRORS": 0, "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": 7, "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": 900,
             "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": 0}  # an exporter with only the aggregate counters, older names
    exporter.set({0: older})
    with DcgmExporterSource(exporter.url) as source:
        assert source.poll() == [], "a lifetime count is history, not news"
        exporter.set({0: {**older, "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": 8, "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": 0x20}})
        events = source.poll()
        assert kinds(events) == [(0, K.ECC_DBE, None), (0, K.THROTTLE_STARTED, None)]
        assert events[0].count == 1 and events[1].reasons == {"sw_thermal"}


def test_dcgm_an_exporter_that_goes_away_fails_the_poll_and_comes_back(exporter: FakeDcgmExporter) -> None:
    exporter.set({0: HEALTHY})
    with DcgmExporterSource(exporter.url) as source:
        source.poll()
        exporter.status = 503
        with pytest.raises(GpuSourceError, match="HTTP 503"):
            source.poll()
        exporter.status = 200
        exporter.set({0: {**HEALTHY, "DCGM_FI_DEV_XID_ERRORS": 43}})
        assert kinds(source.poll()) == [(0, K.XID, 43)]


def test_dcgm_that_never_answers_is_a_clear_error_after_a_few_tries(exporter: FakeDcgmExporter) -> None:
    exporter.text = "# HELP something_else nothing to do with GPUs\nsomething_else 1\n"
    with pytest.raises(FleetwardError, match=r"no GPU metrics after 2 tries.*no GPU in it"):
        DcgmExporterSource(exporter.url, attempts=2)
    exporter.close()
    with pytest.raises(FleetwardError, match=r"did not answer.*is dcgm-exporter running"):
        DcgmExporterSource(exporter.url, attempts=1)


def test_auto_reads_dcgm_when_the_file_names_its_url(exporter: FakeDcgmExporter) -> None:
    exporter.set({0: HEALTHY})
    source, choice = open_source(GpuConfig(dcgm_url=exporter.url))
    assert source is not None and choice.source == "dcgm" and exporter.url in choice.detail
    source.close()


FIELDS = st.fixed_dictionaries({
    "DCGM_FI_DEV_XID_ERRORS": st.sampled_from([0, 13, 31, 48, 63, 92]),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": st.integers(0, 3), "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": st.integers(0, 50),
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": st.sampled_from([0, 0x04, 0x20, 0x40, 0x64, 0xE8]),
    "DCGM_FI_DEV_RETIRED_PENDING": st.integers(0, 1), "DCGM_FI_DEV_ROW_REMAP_PENDING": st.integers(0, 1)})


@settings(max_examples=40, deadline=None)
@given(schedule=st.lists(st.tuples(FIELDS, FIELDS), min_size=1, max_size=6))
def test_dcgm_events_are_edges_whatever_the_pages(schedule: list[tuple[dict[str, int], dict[str, int]]]) -> None:
    """Over any run of pages: reading the same page twice reports nothing the second time, and every Xid
    event is a change of the gauge to a non-zero value the GPU did not show before."""
    with FakeDcgmExporter() as exporter:
        exporter.set({0: schedule[0][0], 1: schedule[0][1]})
        with DcgmExporterSource(exporter.url, attempts=1) as source:
            source.poll()
            last = dict(enumerate(schedule[0]))
            for a, b in schedule[1:]:
                exporter.set({0: a, 1: b})
                for e in source.poll():
                    assert e.kind is not K.LOST
                    if e.kind is K.XID:
                        now = (a, b)[e.gpu]["DCGM_FI_DEV_XID_ERRORS"]
                        assert e.code == now != last[e.gpu]["DCGM_FI_DEV_XID_ERRORS"] and now
                last = {0: a, 1: b}
                assert source.poll() == []


def test_a_page_that_is_not_prometheus_text_is_refused() -> None:
    with pytest.raises(ValueError):
        parse_metrics("<html>dcgm-exporter is behind a login page</html>")


# ------------------------------------------------------------------------------------- config and choice


def test_the_fleet_file_names_the_source_in_short_or_in_full(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("gpu: nvml\n")
    assert load_fleet_config(tmp_path / "a.yaml").gpu.source == "nvml"
    (tmp_path / "b.yaml").write_text("cluster: x\ngpu:\n  source: dcgm\n")
    with pytest.raises(ConfigError) as exc:
        load_fleet_config(tmp_path / "b.yaml")
    assert "b.yaml:2: gpu:" in str(exc.value) and "dcgm needs dcgm_url" in str(exc.value)
    (tmp_path / "c.yaml").write_text("gpu:\n  policy:\n    xid:\n      13: drain_and_quarantine\n"
                                     "      119: {action: ignore, reason: noisy GSP on our driver}\n"
                                     "    throttle: {sw_power_cap: degraded}\n")
    policy = policy_of(load_fleet_config(tmp_path / "c.yaml").gpu)
    assert policy.xid[13].action is Action.DRAIN_AND_QUARANTINE and "Graphics Engine" in policy.xid[13].reason
    assert policy.xid[119].reason == "noisy GSP on our driver"
    assert policy.throttle["sw_power_cap"].action is Action.DEGRADED
    (tmp_path / "d.yaml").write_text("gpu:\n  policy:\n    xid:\n      13: reboot_the_planet\n")
    with pytest.raises(ConfigError) as exc:
        load_fleet_config(tmp_path / "d.yaml")
    assert "d.yaml:4: gpu.policy.xid[13].action: Input should be 'ignore'" in str(exc.value)


def test_the_config_knows_the_policys_names() -> None:
    assert set(GpuActionName.__args__) == {a.value for a in Action}  # type: ignore[attr-defined]
    assert set(ThrottleReason.__args__) == THROTTLE_REASONS  # type: ignore[attr-defined]
    assert FleetConfig().gpu == GpuConfig(source="auto", per_worker=1)


def test_workers_get_their_own_gpus_as_far_as_they_go() -> None:
    assert assign(3, 1, gpus=4) == [(0,), (1,), (2,)]
    assert assign(3, 2, gpus=5) == [(0, 1), (2, 3), ()]
    assert assign(2, 1, gpus=4, taken=[0, 2]) == [(1,), (3,)]
    assert assign(2, 0, gpus=4) == [(), ()]
