"""GPU health: the fault-injectable source, the Xid/ECC policy table, the matmul self-test, NVML's errors."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from fleetward.chaos.fakegpu import FakeGpuSource
from fleetward.fleet.clock import ManualClock
from fleetward.fleet.errors import ConfigError, FleetwardError
from fleetward.supervisor.gpu import (
    DEFAULT_XID_RULES,
    Action,
    GpuEvent,
    GpuEventKind,
    GpuHealthSource,
    GpuPolicy,
    NvmlSource,
    run_selftest,
    selftest,
    selftest_in_child,
)

K = GpuEventKind


def summary(events: list[GpuEvent]) -> list[tuple[Any, ...]]:
    return [(e.gpu, e.kind, e.code, e.count, tuple(sorted(e.reasons)), e.ts) for e in events]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def fake(clock: ManualClock) -> FakeGpuSource:
    return FakeGpuSource(3, clock=clock)


# ------------------------------------------------------------------------------------------- the fake


def test_every_injected_fault_comes_out_of_poll_in_order_with_its_time(fake: FakeGpuSource,
                                                                       clock: ManualClock) -> None:
    t0 = clock.wall()
    fake.inject_xid(0, 13)
    clock.advance(1)
    fake.inject_ecc_sbe(1, n=3)
    clock.advance(1)
    fake.throttle(2, "hw_thermal")
    clock.advance(1)
    fake.inject_retirement_pending(1)
    fake.unthrottle(2, "hw_thermal")
    clock.advance(1)
    fake.lose(0)

    assert summary(fake.poll()) == [
        (0, K.XID, 13, 0, (), t0),
        (1, K.ECC_SBE, None, 3, (), t0 + 1),
        (2, K.THROTTLE_STARTED, None, 0, ("hw_thermal",), t0 + 2),
        (1, K.RETIREMENT_PENDING, None, 0, (), t0 + 3),
        (2, K.THROTTLE_STOPPED, None, 0, ("hw_thermal",), t0 + 3),
        (0, K.LOST, None, 0, (), t0 + 4),
    ]


def test_poll_returns_only_what_happened_since_the_previous_poll(fake: FakeGpuSource) -> None:
    fake.inject_xid(1, 31)
    assert [e.code for e in fake.poll()] == [31]
    assert fake.poll() == []
    fake.inject_xid(1, 43)
    assert [e.code for e in fake.poll()] == [43]


def test_a_lost_gpu_keeps_reporting_lost_and_nothing_else(fake: FakeGpuSource, clock: ManualClock) -> None:
    fake.lose(1)
    assert [(e.gpu, e.kind) for e in fake.poll()] == [(1, K.LOST)]
    clock.advance(5)
    fake.inject_xid(1, 13)
    fake.inject_ecc_dbe(1)
    fake.throttle(1, "sw_thermal")
    fake.lose(1)
    fake.inject_xid(2, 43)
    events = fake.poll()
    assert [(e.gpu, e.kind, e.code) for e in events] == [(2, K.XID, 43), (1, K.LOST, None)]
    assert events[-1].ts == clock.wall()  # re-reported now, not replayed from before
    assert [(e.gpu, e.kind) for e in fake.poll()] == [(1, K.LOST)]


def test_xid_79_means_the_gpu_fell_off_the_bus(fake: FakeGpuSource) -> None:
    fake.inject_xid(2, 79)
    assert [(e.kind, e.code) for e in fake.poll()] == [(K.XID, 79), (K.LOST, None)]
    assert [(e.gpu, e.kind) for e in fake.poll()] == [(2, K.LOST)]
    assert not run_selftest(fake, 2).passed


def test_a_double_bit_ecc_error_logs_xid_48_and_raises_the_dbe_count_either_way(fake: FakeGpuSource) -> None:
    fake.inject_ecc_dbe(0, n=2)
    fake.inject_xid(1, 48)
    assert [(e.gpu, e.kind, e.code, e.count) for e in fake.poll()] == [
        (0, K.XID, 48, 0), (0, K.ECC_DBE, None, 2), (1, K.XID, 48, 0), (1, K.ECC_DBE, None, 1)]


def test_throttling_reports_edges_per_reason(fake: FakeGpuSource) -> None:
    fake.throttle(0, "sw_power_cap")
    fake.throttle(0, "sw_power_cap")  # already active: no edge
    fake.throttle(0, "hw_slowdown")
    fake.unthrottle(0)
    fake.unthrottle(0)  # nothing left: no edge
    assert [(e.kind, tuple(sorted(e.reasons))) for e in fake.poll()] == [
        (K.THROTTLE_STARTED, ("sw_power_cap",)),
        (K.THROTTLE_STARTED, ("hw_slowdown",)),
        (K.THROTTLE_STOPPED, ("hw_slowdown", "sw_power_cap")),
    ]


def test_clear_resets_the_gpu_like_a_gpu_reset(fake: FakeGpuSource) -> None:
    fake.throttle(0, "hw_thermal")
    fake.fail_selftest(0)
    fake.lose(1)
    fake.poll()
    fake.clear(0)
    fake.clear(1)
    assert [(e.gpu, e.kind) for e in fake.poll()] == [(0, K.THROTTLE_STOPPED)]
    assert fake.poll() == []
    assert run_selftest(fake, 0).passed and run_selftest(fake, 1).passed


def test_the_fake_refuses_what_no_gpu_could_report(fake: FakeGpuSource) -> None:
    with pytest.raises(ValueError, match="no fake GPU 3"):
        fake.inject_xid(3, 13)
    with pytest.raises(ValueError, match="unknown throttle reason"):
        fake.throttle(0, "too_cool")
    fake.close()
    fake.close()
    with pytest.raises(FleetwardError, match="closed"):
        fake.poll()


def test_the_fake_is_a_gpu_health_source(clock: ManualClock) -> None:
    source: GpuHealthSource = FakeGpuSource(2, clock=clock)
    infos = source.gpus()
    assert [g.index for g in infos] == [0, 1]
    assert len({g.uuid for g in infos}) == 2 and all(g.uuid.startswith("GPU-") for g in infos)
    source.close()


# ---------------------------------------------------------------------------------------------- policy

APP_XIDS = [13, 31, 43, 45]
HARDWARE_XIDS = [48, 63, 64, 74, 79, 92, 94, 95]


@pytest.mark.parametrize("code", APP_XIDS)
def test_application_xids_restart_the_worker(code: int) -> None:
    action, reason = GpuPolicy().classify(GpuEvent(0, K.XID, 0.0, code=code))
    assert action is Action.RESTART_WORKER
    assert reason.startswith(f"Xid {code}:")


@pytest.mark.parametrize("code", HARDWARE_XIDS)
def test_hardware_xids_drain_and_quarantine_the_gpu(code: int) -> None:
    action, reason = GpuPolicy().classify(GpuEvent(0, K.XID, 0.0, code=code))
    assert action is Action.DRAIN_AND_QUARANTINE
    assert reason.startswith(f"Xid {code}:")


def test_every_xid_rule_names_its_code() -> None:
    for code, rule in DEFAULT_XID_RULES.items():
        assert rule.reason.startswith(f"Xid {code}: ")


def test_an_unknown_xid_gets_the_configured_default() -> None:
    event = GpuEvent(0, K.XID, 0.0, code=999)
    assert GpuPolicy().classify(event)[0] is Action.RESTART_WORKER
    strict = GpuPolicy.from_config({"unknown_xid": "drain_and_quarantine"})
    action, reason = strict.classify(event)
    assert action is Action.DRAIN_AND_QUARANTINE and "999" in reason


def test_the_table_is_overridden_from_config() -> None:
    policy = GpuPolicy.from_config({
        "xid": {13: "drain_and_quarantine", "119": {"action": "ignore", "reason": "noise on our driver"},
                200: {"action": "degraded"}},
        "throttle": {"sw_power_cap": "degraded"},
        "ecc_sbe": {"action": "degraded", "reason": "we are picky"},
    })
    action, reason = policy.classify(GpuEvent(0, K.XID, 0.0, code=13))
    assert action is Action.DRAIN_AND_QUARANTINE and "Graphics Engine Exception" in reason  # reason kept
    assert policy.classify(GpuEvent(0, K.XID, 0.0, code=119)) == (Action.IGNORE, "noise on our driver")
    assert policy.classify(GpuEvent(0, K.XID, 0.0, code=200)) == (Action.DEGRADED, "Xid 200")
    assert policy.classify(GpuEvent(0, K.THROTTLE_STARTED, 0.0, reasons=frozenset({"sw_power_cap"})))[0] \
        is Action.DEGRADED
    assert policy.classify(GpuEvent(0, K.ECC_SBE, 0.0, count=1)) == (Action.DEGRADED, "we are picky")
    assert policy.classify(GpuEvent(0, K.XID, 0.0, code=31))[0] is Action.RESTART_WORKER  # untouched
    assert GpuPolicy().classify(GpuEvent(0, K.XID, 0.0, code=13))[0] is Action.RESTART_WORKER  # defaults intact


@pytest.mark.parametrize(("data", "field"), [
    ({"xid": {13: "reboot"}}, "gpu_policy.xid.13.action"),
    ({"xid": {"thirteen": "ignore"}}, "gpu_policy.xid"),
    ({"xid": {13: {"action": "ignore", "severity": 3}}}, "gpu_policy.xid.13"),
    ({"xid": [13]}, "gpu_policy.xid"),
    ({"throttle": {"too_cool": "ignore"}}, "gpu_policy.throttle.too_cool"),
    ({"lost": {"action": "ignore", "reason": ""}}, "gpu_policy.lost.reason"),
    ({"xids": {}}, "gpu_policy.xids"),
])
def test_a_bad_policy_entry_names_its_field(data: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        GpuPolicy.from_config(data)
    assert err.value.field == field


def test_thermal_throttling_degrades_and_power_capping_is_normal() -> None:
    policy = GpuPolicy()

    def verdict(kind: GpuEventKind, *reasons: str) -> Action:
        return policy.classify(GpuEvent(0, kind, 0.0, reasons=frozenset(reasons)))[0]

    for reason in ("sw_thermal", "hw_thermal", "hw_slowdown", "hw_power_brake"):
        assert verdict(K.THROTTLE_STARTED, reason) is Action.DEGRADED
    assert verdict(K.THROTTLE_STARTED, "sw_power_cap") is Action.IGNORE
    assert verdict(K.THROTTLE_STARTED, "sw_power_cap", "hw_thermal") is Action.DEGRADED
    assert verdict(K.THROTTLE_STOPPED, "hw_thermal") is Action.IGNORE


def test_memory_and_bus_faults_from_the_fake_quarantine_the_gpu(fake: FakeGpuSource) -> None:
    fake.inject_ecc_dbe(0)
    fake.inject_retirement_pending(1)
    fake.lose(2)
    fake.inject_ecc_sbe(0)
    verdicts = [(e.kind, GpuPolicy().classify(e)[0]) for e in fake.poll()]
    assert verdicts == [
        (K.XID, Action.DRAIN_AND_QUARANTINE),
        (K.ECC_DBE, Action.DRAIN_AND_QUARANTINE),
        (K.RETIREMENT_PENDING, Action.DRAIN_AND_QUARANTINE),
        (K.LOST, Action.DRAIN_AND_QUARANTINE),
        (K.ECC_SBE, Action.IGNORE),
    ]


def test_actions_are_ordered_by_severity() -> None:
    ranked = sorted(Action, key=lambda a: a.rank)
    assert ranked == [Action.IGNORE, Action.DEGRADED, Action.RESTART_WORKER, Action.DRAIN_AND_QUARANTINE]


# ------------------------------------------------------------------------------------------- self-test


def test_the_selftest_passes_on_the_cpu_and_is_deterministic() -> None:
    first = selftest("cpu", size=64, seed=7)
    assert first.passed and first.mismatches == 0 and first.got == first.expected
    assert selftest("cpu", size=64, seed=7) == first
    assert selftest("cpu", size=64, seed=8).expected != first.expected


def test_the_selftest_catches_a_device_that_computes_one_entry_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    real_matmul = torch.matmul

    def off_by_one(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = real_matmul(a, b)
        if out.dtype == torch.float32:  # the device path; the int64 reference stays exact
            out[3, 5] += 1
        return out

    monkeypatch.setattr(torch, "matmul", off_by_one)
    result = selftest("cpu", size=32)
    assert not result.passed
    assert result.mismatches == 1 and result.got is not None and result.got != result.expected
    assert "1 of 1024 entries" in result.reason


def test_the_selftest_catches_non_finite_results(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    real_matmul = torch.matmul

    def nan_at_the_corner(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = real_matmul(a, b)
        if out.dtype == torch.float32:
            out[0, 0] = float("nan")
        return out

    monkeypatch.setattr(torch, "matmul", nan_at_the_corner)
    result = selftest("cpu", size=16)
    assert not result.passed and result.mismatches == 1 and result.got is None


def test_a_device_that_cannot_compute_fails_the_selftest() -> None:
    result = selftest("meta", size=8)  # meta tensors hold no data: copying the product back fails
    assert not result.passed and "the matmul failed on meta" in result.reason


def test_the_selftest_says_torch_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(FleetwardError, match="needs torch"):
        selftest("cpu")


def test_the_selftest_rejects_sizes_it_cannot_check_exactly() -> None:
    with pytest.raises(ValueError, match=r"1\.\.1024"):
        selftest("cpu", size=2048)


def test_a_forced_failure_fails_the_fleet_selftest_for_that_gpu_only(fake: FakeGpuSource) -> None:
    fake.fail_selftest(1, "bad SM on purpose")
    failed = run_selftest(fake, 1, size=16)
    assert not failed.passed and failed.gpu == 1 and failed.reason == "bad SM on purpose"
    ok = run_selftest(fake, 0, size=16)
    assert ok.passed and ok.gpu == 0 and ok.device == "cpu"  # the real matmul ran
    fake.pass_selftest(1)
    assert run_selftest(fake, 1, size=16).passed


def test_run_selftest_refuses_a_gpu_the_host_does_not_have(fake: FakeGpuSource) -> None:
    with pytest.raises(FleetwardError, match=r"no GPU 7 on this host \(GPUs: \[0, 1, 2\]\)"):
        run_selftest(fake, 7)


def test_the_selftest_runs_in_a_child_process_with_a_deadline() -> None:
    result = selftest_in_child("cpu", size=32, seed=3)
    assert result == selftest("cpu", size=32, seed=3)
    late = selftest_in_child("cpu", size=32, timeout=0.001)
    assert not late.passed and "did not finish within" in late.reason


# ------------------------------------------------------------------------------------------------ NVML


def test_nvml_source_says_how_to_install_nvml_bindings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(FleetwardError, match=r"pip install 'fleetward\[gpu\]'"):
        NvmlSource()


def test_nvml_source_says_nvml_cannot_initialise_without_a_gpu() -> None:
    try:
        source = NvmlSource()
    except FleetwardError as exc:
        assert "NVML cannot initialise" in str(exc) and "nvidia-smi" in str(exc)
        assert type(exc.__cause__).__module__ == "pynvml"  # translated, with the cause kept
    else:
        source.close()
        pytest.skip("this host has a working NVIDIA GPU")
