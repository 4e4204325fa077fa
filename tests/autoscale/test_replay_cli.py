"""``fleetward replay``, as a user runs it: one JSON object with every policy, clear errors on bad input; the
live replay as a process, against the local fleet it starts and stops."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from fleetward.autoscale.planner import POLICIES
from fleetward.cli import main


def trace(tmp_path: Path) -> Path:
    rng = random.Random(2)
    rows, t = [], 0.0
    for rate, seconds in ((1.0, 600), (8.0, 600), (1.0, 600)):
        end = t + seconds
        while (t := t + rng.expovariate(rate)) < end:
            rows.append(f"{t:.3f},{rng.randint(100, 1500)},{rng.randint(20, 200)}")
        t = end
    path = tmp_path / "small.csv"
    path.write_text("arrival_s,input_tokens,output_tokens\n" + "\n".join(rows) + "\n")
    return path


def heavy(tmp_path: Path) -> Path:
    """Long requests, 2 a second: one worker's capacity is below 1 req/s, so profiling it takes a second."""
    path = tmp_path / "heavy.csv"
    path.write_text("arrival_s,input_tokens,output_tokens\n" + "".join(f"{k / 2:.3f},4000,1000\n" for k in range(200)))
    return path


def test_replay_simulate_json_prints_every_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The first 15 minutes (``--limit``): the quiet start and half of the burst."""
    code = main(["replay", str(trace(tmp_path)), "--simulate", "--limit", "900", "--json", "--out",
                 str(tmp_path / "out")])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["mode"] == "simulated" and 0 < result["trace"]["requests"] < 6025
    assert result["trace"]["duration_s"] <= 900
    assert set(result["policies"]) == set(POLICIES)
    for entry in result["policies"].values():
        keys = {"sla_attainment", "worker_hours", "cut_streams", "goodput_per_worker_hour", "scale_events"}
        assert keys <= set(entry)
        assert entry["cut_streams"] == 0 and 0 <= entry["sla_attainment"] <= 1
    assert (tmp_path / "out" / "replay.json").exists() and (tmp_path / "out" / "replay.png").exists()


def test_replay_refuses_bad_input_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_s,input_tokens,output_tokens\n1.0,ten,3\n")
    assert main(["replay", str(bad), "--simulate"]) == 2
    assert "bad.csv:2: column input_tokens: 'ten' is not an integer" in capsys.readouterr().err
    good = trace(tmp_path)
    assert main(["replay", str(good), "--policies", "oracle"]) == 2
    assert "oracle cannot run live (the oracle needs the future: use --simulate)" in capsys.readouterr().err
    # Errors found by profiling the worker: on long requests, which a worker carries few of.
    long = heavy(tmp_path)
    assert main(["replay", str(long), "--simulate", "--itl", "0.001", "--no-plots"]) == 2
    assert "no measured load meets the SLA" in capsys.readouterr().err
    assert main(["replay", str(long), "--simulate", "--max", "1", "--no-plots"]) == 2
    assert "raise it or scale the trace's rate down" in capsys.readouterr().err


def test_live_replay_runs_the_trace_through_a_local_fleet_with_the_autoscaler(tmp_path: Path) -> None:
    """60x faster and at 2.5 % of the rate: 1.5 req/s, then 12, then 1.5, for 10 s each."""
    r = subprocess.run([sys.executable, "-m", "fleetward.cli", "replay", str(trace(tmp_path)), "--speed", "60",
                        "--rate-scale", "0.025", "--max-output", "32", "--json", "--out", "out"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout)
    assert result["mode"] == "live" and set(result["policies"]) == {"fleetward"}
    live = result["policies"]["fleetward"]
    assert live["cut_streams"] == 0 and live["failed"] == 0 and live["requests"] > 100
    assert live["scale_events"] >= 2, "up for the burst, down after it"
    assert 0 < live["sla_attainment"] <= 1 and live["worker_hours"] > 0
    assert (tmp_path / "out" / "replay-live.png").exists() and (tmp_path / "out" / "capacity.json").exists()
