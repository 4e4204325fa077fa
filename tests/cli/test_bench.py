"""Every ``fleetward bench`` command runs end to end with tiny sizes and writes results of the right shape.

Benchmarks are not tests: nothing here looks at a number, only at what the results hold. Without the
``bench`` extra the commands run without plots (``--no-plots``) and without vllm-router.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

HAS_PLOTS = importlib.util.find_spec("matplotlib") is not None
HAS_VLLM_ROUTER = importlib.util.find_spec("vllm_router") is not None


def bench(name: str, out: Path, etcd: str, mqtt: str, *extra: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "fleetward.cli", "bench", name, "--quick", "--out", str(out),
            "--etcd", etcd, "--mqtt", mqtt, *extra]
    if not HAS_PLOTS:
        argv.append("--no-plots")
    result = subprocess.run(argv, capture_output=True, text=True, timeout=240,
                            env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"results: {out / (name + '.json')}" in result.stdout
    data: dict[str, Any] = json.loads((out / f"{name}.json").read_text())
    assert data["benchmark"] == name
    assert {"cpu", "cores", "memory_gib", "date"} <= set(data["machine"])
    if HAS_PLOTS:
        assert list(out.glob(f"{name}-*.png")), "no plot written"
    return data


def is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def test_bench_router_compares_targets_against_direct(tmp_path: Path, etcd_endpoint: str,
                                                      broker_endpoint: str) -> None:
    targets = ["direct", "fleetward", "fleetward-worker-text", *(["vllm-router"] if HAS_VLLM_ROUTER else [])]
    data = bench("router", tmp_path, etcd_endpoint, broker_endpoint, "--targets", ",".join(targets))
    streams = data["config"]["streams"]
    assert {(r["streams"], r["target"]) for r in data["runs"]} == {(c, t) for c in streams for t in targets}
    for run in data["runs"]:
        assert is_number(run["tokens_per_s"])
        assert {"p50_ms", "p99_ms"} <= set(run["itl"])
        assert "client" in run["cpu_cores"]
    for c in streams:
        for t in targets:
            assert is_number(data["summary"][str(c)][t]["throughput_ratio"])
            assert "itl_p99_ratio" in data["summary"][str(c)][t]


def test_bench_migration_reports_stalls_for_kill_and_hang(tmp_path: Path, etcd_endpoint: str,
                                                          broker_endpoint: str) -> None:
    data = bench("migration", tmp_path, etcd_endpoint, broker_endpoint)
    assert [t["kind"] for t in data["trials"]] == ["kill", "hang"]
    for trial in data["trials"]:
        assert {"victim", "moved", "router_stall", "unaffected_max_gaps_s"} <= set(trial)
    for kind in ("kill", "hang"):
        s = data["summary"][kind]
        assert {"client_stall", "reprefill_own", "reprefill_batch", "router_stall_metric"} <= set(s)
        assert {"p50_ms", "p99_ms", "max_ms"} <= set(s["client_stall"])


def test_bench_restart_measures_empty_and_full_clusters(tmp_path: Path, etcd_endpoint: str,
                                                        broker_endpoint: str) -> None:
    data = bench("restart", tmp_path, etcd_endpoint, broker_endpoint)
    assert {(r["case"], r["mode"]) for r in data["runs"]} == {
        (c, m) for c in ("empty", "full") for m in ("process", "in-process")}
    assert all(r["ok"] for r in data["runs"])
    loaded = data["summary"]["state_loaded"]
    assert (loaded["workers"], loaded["orphaned_checkpoints"]) == (data["config"]["workers"],
                                                                   data["config"]["checkpoints"])
    assert is_number(data["summary"]["process/full"]["median_s"])


def test_bench_checkpoints_compares_incremental_whole_peers_and_off(tmp_path: Path, etcd_endpoint: str,
                                                              broker_endpoint: str) -> None:
    data = bench("checkpoints", tmp_path, etcd_endpoint, broker_endpoint)
    assert {r["case"] for r in data["runs"]} == {"on", "whole", "peers", "off"}
    for c in data["config"]["streams"]:
        s = data["summary"][str(c)]
        assert is_number(s["throughput_ratio_on_vs_off"]) and is_number(s["throughput_ratio_whole_vs_off"])
        assert is_number(s["throughput_ratio_peers_vs_off"])
        assert s["peers"]["router_bytes_per_s"] > 0, "the peers router wrote its checkpoints (to its peer)"
        assert is_number(s["peers"]["cpu_holder"]) and s["on"]["cpu_holder"] is None
        for case in ("on", "whole", "peers", "off"):
            assert {"tokens_per_s", "router_txns_per_s", "router_bytes_per_s", "etcd_txns_per_s",
                    "etcd_grpc_bytes_per_s"} <= set(s[case])
        assert s["on"]["router_bytes_per_s"] > 0 and s["off"]["router_bytes_per_s"] == 0


def test_bench_pd_compares_prefill_decode_with_aggregated_and_prices_the_kv_policies(
        tmp_path: Path, etcd_endpoint: str, broker_endpoint: str) -> None:
    data = bench("pd", tmp_path, etcd_endpoint, broker_endpoint)
    assert {r["case"] for r in data["runs"]} == {"aggregated", "pd"}
    for mix in data["config"]["mixes"]:
        s = data["summary"][f"{mix[0]}/{mix[1]}"]
        assert all(is_number(s[k]) for k in ("x_ttft_p99_ms", "x_itl_p99_ms", "x_tokens_per_s"))
        assert s["aggregated"]["failed"] == s["pd"]["failed"] == 0
    policies = data["policy_summary"]
    assert set(policies) == {"no fault", "retry", "recompute", "aggregated"}
    assert all(p["failed"] == 0 and p["ok"] > 0 for p in policies.values()), "no policy loses a request"


def test_bench_moves_reports_the_stall_of_a_move_with_its_kv_and_computed_again(
        tmp_path: Path, etcd_endpoint: str, broker_endpoint: str) -> None:
    """The shape, the moves' outcomes and exactness; how the two stalls compare is the benchmark's to say
    (docs/benchmarks.md, section 8), not a test's: it depends on how busy the machine is."""
    data = bench("moves", tmp_path, etcd_endpoint, broker_endpoint)
    summary, details = data["summary"], data["details"]
    assert details["exact"] and not details["failures"], details["failures"]
    assert set(summary) == {"1024", "8192", "32768"}
    for context, s in summary.items():
        assert is_number(s["kv_stall_ms"]) and is_number(s["reprefill_stall_ms"]), (context, s)
        assert s["fallbacks"] == 0, (context, details["contexts"][context]["kv"]["outcomes"])
        c = details["contexts"][context]
        assert c["exact"] and c["kv_bytes"] > 0 and is_number(c["ratio_p50"])
        assert {"p50_ms", "p99_ms", "mean_ms"} <= set(c["kv"]["stall"]) & set(c["reprefill"]["stall"])
        assert c["kv"]["outcomes"]["kv"] == c["kv"]["moved"] > 0, "every move of the kv router carried its KV"
        assert c["reprefill"]["outcomes"]["reprefill"] == c["reprefill"]["moved"] > 0


def test_bench_detect_reports_latency_false_positives_and_controller_cpu(tmp_path: Path, etcd_endpoint: str,
                                                                         broker_endpoint: str) -> None:
    data = bench("detect", tmp_path, etcd_endpoint, broker_endpoint)
    trials = data["latency"]["trials"]
    from fleetward.chaos.faults.process import FreezerGroup

    freezes = ("cgroup-freeze", "cgroup-freeze-idle") if FreezerGroup.unavailable_reason() is None else ()
    faults = ("crash", "hang", *freezes)  # the freezer cases where this machine can freeze (root, a freezer)
    assert [(t["backend"], t["fault"]) for t in trials] == [("sim", f) for f in faults]
    for trial in trials:
        assert {"victim", "injected_wall", "verdict", "requests_failed"} <= set(trial)
    for key in (f"sim/{f}" for f in faults):
        s = data["latency"]["summary"][key]
        assert {"p50_ms", "p99_ms", "max_ms"} <= set(s["verdict"])
        assert {"p50_ms", "p99_ms"} <= set(s["observed"])
    assert {"p50_ms", "p99_ms"} <= set(data["latency"]["summary"]["sim/hang"]["after_first_miss"])
    soak = data["soak"]
    assert is_number(soak["capacity"]["requests_per_s"])
    assert is_number(soak["soak"]["rate_per_s"])
    for phase in ("capacity", "soak"):
        fp = soak[phase]["false_positives"]
        assert {"hang.detected", "restart", "quarantine", "health_changed", "events"} <= set(fp)
        assert isinstance(soak[phase]["migrations"], dict)
    steps = data["cpu"]["steps"]
    assert [s["workers"] for s in steps] == sorted(data["config"]["cpu_workers"])
    for step in steps:
        assert {"controller", "workers host", "routers", "etcd"} <= set(step["cpu_cores"])
        assert is_number(step["cpu_cores"]["controller"])
        assert isinstance(step["health"], dict)


def test_bench_without_the_extra_names_what_to_install(tmp_path: Path) -> None:
    code = ("import sys, importlib.util as u; find = u.find_spec\n"
            "u.find_spec = lambda name, *a: None if name == 'matplotlib' else find(name, *a)\n"
            "from fleetward.cli import main; sys.exit(main(sys.argv[1:]))")
    result = subprocess.run([sys.executable, "-c", code, "bench", "restart", "--quick", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert result.returncode == 1
    assert "pip install 'fleetward[bench]'" in result.stderr


def test_bench_scale_writes_a_table_at_four_sizes_from_units_it_measured(tmp_path: Path, etcd_endpoint: str,
                                                                          broker_endpoint: str) -> None:
    data = bench("scale", tmp_path, etcd_endpoint, broker_endpoint)
    assert set(data["table"]) == {"10", "100", "1000", "10000"}
    resources = set(data["table"]["10"])
    assert {"etcd_requests_per_s", "etcd_bytes_per_s", "etcd_watchers", "mqtt_messages_per_s",
            "controller_cpu_cores", "router_cpu_cores", "prometheus_series"} <= resources
    for size in data["table"].values():
        assert set(size) == resources
        for row in size.values():
            assert is_number(row["load"]) and is_number(row["limit"]) and row["limit"] > 0
            assert isinstance(row["unit"], str) and row["unit"]
    measured = set(data["units"]["measured"])
    assert {"router_cpu_s_per_token", "checkpoint_delta_fixed_bytes", "checkpoint_delta_bytes_per_token",
            "series_per_router", "watchers_per_router", "mqtt_messages_per_s_capacity"} <= measured
    # The streaming run relayed every stream and checkpointed them.
    streaming = data["measurements"]["streaming"]
    assert streaming["requests_failed"] == 0 and streaming["checkpoint_bytes_per_token"] > 0
    assert set(data["designs"]) == {"etcd", "etcd-sharded", "etcd-log", "peer"}
    assert data["table"] == data["designs"][data["design"]]
