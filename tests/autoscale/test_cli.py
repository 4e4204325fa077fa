"""``fleetward up --autoscale`` and ``fleetward profile`` as a user runs them: real processes, default paths where
the user would leave them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fleetward.autoscale.capacity import CapacityModel, Sla


async def test_up_autoscale_scales_to_the_minimum_and_sigterm_leaves_nothing(tmp_path: Path, wait_until: Any,
                                                                           fleetward_up: Any) -> None:
    conf = tmp_path / "fleet.yaml"
    conf.write_text("workers: 1\nautoscale:\n  interval_s: 0.5\n  min_workers: 2\n  max_workers: 3\n"
                    "  per_worker_rps: 4\n")
    async with fleetward_up("--autoscale", "--config", str(conf), run_dir=tmp_path, cluster="astest") as up:
        def two_ready() -> dict[str, Any] | None:
            data = up.status()
            return data if data and sorted(w["health"] for w in data["workers"]) == ["ready", "ready"] else None

        data = await wait_until(two_ready, timeout=90, interval=0.5, message="the autoscaler brought a second worker")
        node = data["workers"][0]["node"]
        assert {w["id"] for w in data["workers"]} == {f"{node}-w0", f"{node}-w1"}
        assert "scale   fleetward policy" in up.process.log_tail(4000)


def test_profile_measures_a_worker_it_starts_and_writes_a_model_the_autoscaler_takes(tmp_path: Path,
                                                                                   fleetward_cli: Any) -> None:
    r = fleetward_cli("profile", "--rates", "1,8", "--step", "2", "--max-tokens", "16", "--out", "cap.json",
                      cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "wrote cap.json: 2 point(s)" in r.stdout and "the worker serves after" in r.stderr
    model = CapacityModel.load(tmp_path / "cap.json")
    assert [p.rate for p in model.points] == [1.0, 8.0] and model.startup_s > 0
    assert model.max_rate(Sla(ttft_s=10, itl_s=1)) == 8.0
    assert (tmp_path / ".fleetward" / "profile" / "worker-profile-w0.log").exists(), "the default run dir"
    # The work model and the mix it was measured at: the planner weighs requests by them.
    assert (model.mean_input, model.mean_output) == (128.0, 16.0)
    assert model.prefill_tokens_per_s and model.decode_s_per_token and "prompt tokens/s" in r.stderr
    assert model.relative_cost(256.0, 16.0) > 1.0


def test_profile_refuses_bad_rates_and_an_unreachable_server_clearly(tmp_path: Path, fleetward_cli: Any) -> None:
    run = fleetward_cli
    r = run("profile", "--rates", "4,2", cwd=tmp_path)
    assert r.returncode == 2 and "--rates: positive requests/s, strictly rising" in r.stderr
    r = run("profile", "--url", "http://127.0.0.1:9", cwd=tmp_path)
    assert r.returncode == 2 and "no model listed at /v1/models" in r.stderr
    r = run("autoscaler", "--etcd", "127.0.0.1:2379", cwd=tmp_path)
    assert r.returncode == 2 and "needs --etcd and --mqtt" in r.stderr


def test_impossible_autoscale_settings_are_refused_with_file_line_and_field(tmp_path: Path) -> None:
    from fleetward.autoscale.daemon import capacity_for
    from fleetward.fleet.config import AutoscaleConfig, load_fleet_config
    from fleetward.fleet.errors import ConfigError

    conf = tmp_path / "fleet.yaml"
    conf.write_text("cluster: c\nautoscale:\n  min_workers: 5\n  max_workers: 2\n")
    with pytest.raises(ConfigError) as info:
        load_fleet_config(conf)
    assert "fleet.yaml:2: autoscale:" in str(info.value) and "min_workers 5 is above max_workers 2" in str(info.value)
    conf.write_text("cluster: c\nautoscale:\n  polcy: fleetward\n")
    with pytest.raises(ConfigError, match=r"fleet.yaml:3: autoscale.polcy: unknown field"):
        load_fleet_config(conf)
    with pytest.raises(ConfigError, match="no measured load meets the SLA"):
        capacity_for(AutoscaleConfig(itl_s=0.0001), backend="sim")
    with pytest.raises(ConfigError, match="fleetward profile"):
        capacity_for(AutoscaleConfig(), backend="vllm")
