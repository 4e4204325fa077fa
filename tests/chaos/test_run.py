"""Experiments end to end on real simulated workers, a real router, etcd and broker; and the CLI's exit codes.

``chaos run`` and ``chaos faults --json`` run as processes (``python -m fleetward.cli``, as fleetward starts its
own); the other ``chaos`` commands run through the same entry in this process (:func:`chaos_here`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from chaos_doubles import attachable

from fleetward.chaos.fault import Target
from fleetward.chaos.runner import Runner, RunOptions, SafetyAbort, check_run
from fleetward.chaos.validation import validate_experiment
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.errors import ConfigError

CHAOS = [sys.executable, "-m", "fleetward.cli", "chaos"]
SIM = {"decode_step_ms": 3, "decode_ms_per_seq": 0.05, "prefill_ms_per_token": 0.01, "seed": 11}


def experiment(**over: Any) -> dict[str, Any]:
    exp: dict[str, Any] = {
        "title": "hang and burst on two workers",
        "seed": 11,
        "fleet": {"workers": 2, "routers": 1, "sim": SIM, "routing": {"stall_floor_s": 0.4}},
        "workload": {"duration_s": 4.5, "arrival": {"kind": "poisson", "rate": 10}, "isl": 16,
                     "osl": {"dist": "uniform", "min": 8, "max": 40}, "drain_s": 20},
        "method": [
            # Longer than the router's allowance for a first token (stall floor + 1 s): streams move away.
            {"name": "hang", "fault": "process.double_hang", "at": 0.8, "duration": 2.5,
             "target": {"kind": "worker", "pick": "serving"}},
            {"name": "burst", "fault": "load.burst", "at": 3.5, "params": {"count": 12}},
            {"name": "cancel", "fault": "load.mass_cancel", "at": 1.0, "duration": 1.0,
             "params": {"share": 0.5, "after_tokens": 2}},
            {"name": "retries", "fault": "load.retry_storm", "at": 0.8, "duration": 2.5},
        ],
        "checkers": ["stream_exactness", "sse_ids", "availability", "migration_limit", "fault_verification"],
    }
    exp.update(over)
    return exp


def chaos(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CHAOS, *args], capture_output=True, text=True, timeout=timeout, env=env)


def chaos_here(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``fleetward chaos ARGS`` through the CLI's own entry (:func:`fleetward.cli.main.main`) in this process: what
    :func:`chaos` does without a Python start (the fault doubles are in this process's catalogue too). The
    process entry point (``python -m fleetward.cli``) is what :func:`chaos` tests."""
    from fleetward.cli.main import main

    capsys.readouterr()
    code = main(["chaos", *args])
    got = capsys.readouterr()
    return subprocess.CompletedProcess(["fleetward", "chaos", *args], code, got.out, got.err)


def statuses(verdicts: list[dict[str, Any]]) -> dict[str, str]:
    return {v["checker"]: v["status"] for v in verdicts}


async def test_a_run_writes_its_folder_and_chaos_check_reproduces_its_verdicts(
        fleetward_experiment: Any, capsys: pytest.CaptureFixture[str]) -> None:
    result = await fleetward_experiment(experiment())
    run = result.run_dir
    assert result.status == "completed" and not result.deviated, result.failures()
    assert statuses([v.to_json() for v in result.verdicts]) == {
        "stream_exactness": "pass", "sse_ids": "pass", "availability": "pass", "migration_limit": "pass",
        "fault_verification": "pass"}, result.failures()
    assert result.exit_code == 0
    journal = json.loads((run / "journal.json").read_text())
    assert journal["steady_states"]["before"]["steady_state_met"] and journal["steady_states"]["after"][
        "steady_state_met"]
    assert sorted(a["activity"]["name"] for a in journal["run"]) == ["burst", "cancel", "hang", "retries"]
    assert all(a["status"] == "succeeded" and a["output"]["verified"] for a in journal["run"])
    assert journal["rollbacks"][0]["status"] == "succeeded"
    records = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    kinds = {r["type"] for r in records}
    assert {"invoke", "chunk", "ok", "fault", "event", "phase", "probe"} <= kinds
    phases = [r["phase"] for r in records if r["type"] == "fault" and r["activity"] == "hang"]
    assert phases == ["start", "verified", "recover", "recovered", "stop"]
    assert {r["kind"] for r in records if r["type"] == "event"} >= {"fault.start", "fault.stop"}
    chunks = [r for r in records if r["type"] == "chunk"]
    assert all(c["worker"] and c["attempt"] for c in chunks)
    burst = [r for r in records if r["type"] == "invoke" and r["client"] == "load.burst"]
    assert len(burst) == 12
    cancelled = [r for r in records if r["type"] == "fail" and r["stage"] == "cancelled"]
    assert cancelled and all(r["tokens"] >= 2 for r in cancelled)  # mid-stream, and exact prefixes (above)
    assert "<svg" in (run / "report.html").read_text()

    checked = chaos_here(capsys, "check", str(run), "--json")
    assert checked.returncode == 0, checked.stderr
    assert statuses(json.loads(checked.stdout)["verdicts"]) == statuses(journal["checks"]["verdicts"])


def test_a_run_that_corrupts_streams_exits_1_and_chaos_check_agrees(tmp_path: Path, etcd_endpoint: str,
                                                                   broker_endpoint: str, doubles_env: dict[str, str],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    exp = experiment(title="wrong tokens", method=[
        {"name": "sdc", "fault": "process.double_wrong_tokens", "at": 0.5, "duration": 2.0, "params": {"after": 3},
         "target": {"kind": "worker", "ids": ["node-w0"]}}], checkers=["stream_exactness", "fault_verification"])
    exp["workload"]["duration_s"] = 3
    path = tmp_path / "wrong.yaml"
    path.write_text(yaml.safe_dump(exp))
    run = tmp_path / "run"
    done = chaos("run", str(path), "--out", str(run), "--etcd", etcd_endpoint, "--mqtt", broker_endpoint,
                 env=doubles_env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "stream_exactness" in done.stdout and "corrupted" in done.stdout
    journal = json.loads((run / "journal.json").read_text())
    assert journal["status"] == "completed" and journal["exit_code"] == 1
    exactness = next(v for v in journal["checks"]["verdicts"] if v["checker"] == "stream_exactness")
    assert exactness["status"] == "fail"
    assert {d["kind"] for d in exactness["details"]} == {"corrupted"}
    assert {d["worker"] for d in exactness["details"]} == {"node-w0"}
    assert all(d["index"] == 3 and d["faults"] == ["sdc"] for d in exactness["details"])

    checked = chaos_here(capsys, "check", str(run))
    assert checked.returncode == 1
    assert check_run(run).journal["checks"]["verdicts"] == journal["checks"]["verdicts"]


async def test_an_attached_run_uses_the_fleet_that_is_already_running(fleetward_fleet: Any, tmp_path: Path) -> None:
    from fleetward.fleet.config import SimConfig

    async with fleetward_fleet(workers=2, backend=SimBackend(SimConfig(**SIM)), node="node") as fleet:
        await attachable(fleet, tmp_path / "state")
        exp = experiment(title="attached", method=[
            {"name": "hang", "fault": "process.double_hang", "at": 0.5, "duration": 1.0,
             "target": {"kind": "worker", "ids": ["node-w1"]}}],
            checkers=["stream_exactness", "fault_verification", "availability"])
        exp["workload"]["duration_s"] = 2.5
        exp["reference"] = "run"  # what greedy vLLM uses: every request again, fault-free, after the method
        exp["blast_radius"] = {"workers": ["node-w1"]}  # a fleet the run did not start: declared, and confirmed
        opts = RunOptions(out=tmp_path / "run", attach=True, live_fleet=True, cluster=fleet.cluster,
                          run_dir=tmp_path / "state")
        result = await Runner(validate_experiment(exp), opts).run()
        assert result.ok, result.failures()
        j = result.journal
        assert j["fleet"]["attached"] and j["fleet"]["workers"] == ["node-w0", "node-w1"]
        assert j["rollbacks"][0]["output"] == {"cleared": ["node-w0", "node-w1"], "routable": True}
        assert j["reference"]["kind"] == "recorded" and j["reference"]["answered"] == j["reference"]["requests"] > 0
        exactness = next(v for v in result.verdicts if v.checker == "stream_exactness")
        assert exactness.status == "pass" and exactness.metrics["reference"] == "recorded"


def test_a_bad_experiment_file_exits_2_naming_file_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("title: bad\nworkload:\n  duration_s: 5\n  arrivl: {rate: 3}\n")
    done = chaos("run", str(path), "--out", str(tmp_path / "run"))
    assert done.returncode == 2
    assert f"{path}:4: workload.arrivl: unknown field" in done.stderr
    assert not (tmp_path / "run").exists()


def test_chaos_faults_lists_the_catalogue_by_family_with_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    done = chaos("faults", "--json")
    assert done.returncode == 0, done.stderr
    faults = {f["name"]: f for f in json.loads(done.stdout)["faults"]}
    burst = faults["load.burst"]
    assert burst["family"] == "load" and burst["targets"] == ["fleet"]
    assert {p["name"]: p["default"] for p in burst["params"]}["count"] == 50
    text = chaos_here(capsys, "faults", "--family", "load")
    assert text.returncode == 0 and "load.mass_cancel" in text.stdout and "load (5)" in text.stdout
    every = chaos_here(capsys, "faults")  # every family's table, each fault's needs said in words
    assert every.returncode == 0, every.stderr
    assert "partition (4)" in every.stdout and "needs fleet.hosts: 3 or more" in " ".join(every.stdout.split())


def test_the_safety_rule_is_enforced_again_on_the_targets_a_run_resolves() -> None:
    exp = validate_experiment(experiment())
    runner = Runner(exp)
    runner._declared = {"worker": ["node-w0", "node-w1", "node-w2"], "fleet": ["fleet"]}
    spec = runner.catalogue["process.double_hang"]
    picked = runner.resolve(Target(kind="worker", pick="random"), rng=__import__("random").Random(1))
    runner.active["first"] = ("worker", picked)
    second = runner.resolve(Target(kind="worker", pick="first"), rng=__import__("random").Random(1))
    assert second != picked  # a second fault picks among the workers not yet faulted
    with pytest.raises(SafetyAbort, match="would fault 2 of 3 worker"):
        runner._check_share(spec, Target(kind="worker"), second, "second")
    with pytest.raises(SafetyAbort, match="node-w9 not in the fleet"):
        runner.resolve(Target(kind="worker", ids=("node-w9",)), rng=__import__("random").Random(1))
    runner._check_share(runner.catalogue["load.burst"], Target(kind="fleet"), ["fleet"], "burst")  # load: exempt


async def test_an_attached_run_names_the_fleets_workers_for_the_experiments_and_checks_the_fleets_own_model(
        fleetward_fleet: Any, tmp_path: Path) -> None:
    # As `fleetward up` runs it: its node is the host's name, its simulated model has seed 0. The experiment,
    # as the library's are, declares node-w0, node-w1 and another seed; it attaches unchanged.
    from fleetward.fleet.config import SimConfig

    async with fleetward_fleet(workers=2, backend=SimBackend(SimConfig(**{**SIM, "seed": 0})), node="edge1") as fleet:
        run_dir = await attachable(fleet, tmp_path / "state", node="edge1", backend="sim")
        exp = experiment(title="attached as shipped", method=[
            {"name": "hang", "fault": "process.double_hang", "at": 0.5, "duration": 1.0,
             "target": {"kind": "worker", "ids": ["node-w1"]}}],
            checkers=["stream_exactness", "fault_verification", "availability"])
        exp["workload"]["duration_s"] = 2.5
        exp["blast_radius"] = {"workers": ["node-w1"], "nodes": []}  # renamed too: edge1-w1
        assert exp["fleet"]["sim"]["seed"] == 11 and "node" not in exp["fleet"]
        opts = RunOptions(out=tmp_path / "run", attach=True, live_fleet=True, cluster=fleet.cluster, run_dir=run_dir)
        result = await Runner(validate_experiment(exp), opts).run()
        assert result.ok, result.failures()
        j = result.journal
        assert j["fleet"]["workers"] == ["edge1-w0", "edge1-w1"] and j["experiment"]["fleet"]["node"] == "edge1"
        assert j["run"][0]["output"]["targets"] == ["edge1-w1"]
        assert j["experiment"]["blast_radius"]["workers"] == ["edge1-w1"]
        assert j["reference"] == {"kind": "model", "seed": 0, "eos_probability": 0.0}  # the fleet's, not 11
        exactness = next(v for v in result.verdicts if v.checker == "stream_exactness")
        assert exactness.status == "pass" and exactness.metrics["reference"] == "model"


async def test_attaching_to_a_fleet_that_is_not_the_declared_one_exits_2_before_anything_runs(
        fleetward_fleet: Any, tmp_path: Path, doubles_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from fleetward.chaos.attached import AttachedFleet
    from fleetward.fleet.config import SimConfig

    async with fleetward_fleet(workers=2, backend=SimBackend(SimConfig(**{**SIM, "seed": 0})), node="node") as fleet:
        run_dir = await attachable(fleet, tmp_path / "state")
        path = tmp_path / "three.yaml"
        path.write_text(yaml.safe_dump(experiment(method=[], fleet={"workers": 3, "sim": SIM})))
        done = await asyncio.to_thread(chaos, "run", str(path), "--attach", "--cluster", fleet.cluster, "--run-dir",
                                       str(run_dir), "--out", str(tmp_path / "run"), env=doubles_env)
        assert done.returncode == 2, done.stdout + done.stderr
        assert ("fleet.workers: the attached fleet's workers are node-w0, node-w1; the experiment declares "
                "node-w0, node-w1, node-w2") in " ".join(done.stderr.split())
        assert "CHECKER" not in done.stdout and not (tmp_path / "run").exists()

        def attach(**fleet_spec: Any) -> Runner:
            exp = experiment(method=[], fleet={"workers": 2, "sim": SIM, **fleet_spec})
            exp["workload"]["duration_s"] = 1.0
            return Runner(validate_experiment(exp), RunOptions(out=tmp_path / "run", attach=True, cluster=fleet.cluster,
                                                               run_dir=run_dir))

        with pytest.raises(ConfigError, match=r"fleet.routers: the attached fleet has 1 router\(s\); the experiment "
                           "declares 2"):
            await attach(routers=2).run()
        # Where the workers' command lines cannot be read, the experiment's model must be what they run.
        monkeypatch.setattr(AttachedFleet, "command_line", lambda self, worker: None)
        with pytest.raises(ConfigError, match=re.escape(
                "fleet.sim: worker node-w0 does not generate what the simulated model with seed 11, "
                "eos_probability 0, tokenizer byte (the experiment's fleet.sim) does")):
            await attach().run()
        assert not (tmp_path / "run").exists()
        assert (await attach(sim={**SIM, "seed": 0}).run()).ok  # and when it is, the run goes on


def test_attaching_without_a_running_fleet_exits_2_with_the_error_alone(tmp_path: Path) -> None:
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(experiment(method=[])))
    done = chaos("run", str(path), "--attach", "--cluster", "nothere", "--run-dir", str(tmp_path / "state"),
                 "--out", str(tmp_path / "run"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "attach: no running local fleet found" in done.stderr
    assert "CHECKER" not in done.stdout and "run failed" not in done.stdout
    assert not (tmp_path / "run").exists()


def test_a_run_folder_that_is_not_empty_is_refused(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "x").write_text("")
    with pytest.raises(ConfigError, match="not empty"):
        Runner(validate_experiment(experiment()), RunOptions(out=tmp_path / "run"))._run_dir()


async def test_a_run_stopped_while_the_fleet_starts_is_interrupted_and_leaves_nothing(
        tmp_path: Path, etcd_endpoint: str, broker_endpoint: str) -> None:
    import asyncio

    stop = asyncio.Event()
    stop.set()  # as if Ctrl-C came at once
    opts = RunOptions(out=tmp_path / "run", etcd=etcd_endpoint, mqtt=broker_endpoint, stop=stop)
    result = await Runner(validate_experiment(experiment()), opts).run()
    assert result.status == "interrupted" and "while starting the fleet" in result.journal["reason"]
    assert result.exit_code == 1 and result.journal["steady_states"]["before"] is None


async def test_a_runtime_safety_breach_aborts_the_method_and_faults_in_recovery_still_recover(
        fleetward_experiment: Any) -> None:
    # Statically the two hangs do not overlap; at run time the first is still recovering (slowly) when the
    # second would start: 2 of 2 workers. The second is refused, the method aborts, the first recovers.
    exp = experiment(title="abort", method=[
        {"name": "slow", "fault": "process.double_hang", "at": 0.3, "duration": 0.2, "params": {"recover_delay_s": 1.5},
         "target": {"kind": "worker", "ids": ["node-w0"]}},
        {"name": "second", "fault": "process.double_hang", "at": 1.0, "duration": 0.5,
         "target": {"kind": "worker", "ids": ["node-w1"]}},
    ], checkers=["fault_verification"])
    result = await fleetward_experiment(exp)
    assert result.status == "aborted" and "second would fault 2 of 2 worker(s)" in result.journal["reason"]
    assert result.exit_code == 1
    slow, second = result.journal["run"]
    assert slow["output"]["recovered"] is True and slow["status"] == "succeeded"
    assert second["status"] == "refused"
    verdict = next(v for v in result.verdicts if v.checker == "fault_verification")
    assert verdict.status == "fail" and "second refused" in verdict.summary
