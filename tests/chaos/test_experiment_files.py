"""Experiment files: bad ones are refused with file, line and field; the library's all load."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from fleetward.chaos.experiment import Experiment
from fleetward.chaos.validation import load_experiment, validate_experiment
from fleetward.fleet.errors import ConfigError

LIBRARY = Path(__file__).resolve().parents[2] / "chaos" / "experiments"

GOOD = """\
title: two hangs, one after the other
seed: 3
fleet:
  workers: 3
  sim: {decode_step_ms: 2}
workload:
  duration_s: 10
  arrival: {kind: poisson, rate: 4}
  osl: {dist: uniform, min: 8, max: 32}
steady-state-hypothesis:
  probes:
    - {name: all routable, probe: workers_routable, tolerance: {min: 3}}
method:
  - name: first
    fault: process.double_hang
    at: 2
    duration: 1
    target: {kind: worker, ids: [node-w0]}
  - fault: process.double_hang
    after: first
    delay: 0.5
    duration: 1
    target: {kind: worker, pick: serving}
  - fault: load.burst
    at: 5
    params: {count: 10}
checkers: [stream_exactness, {name: availability, params: {fault_min_success: 0.9}}]
"""


def write(tmp_path: Path, text: str, name: str = "exp.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def refused(tmp_path: Path, text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_experiment(write(tmp_path, text))
    return info.value


def test_a_good_file_loads_with_defaults_filled_in(tmp_path: Path) -> None:
    exp = load_experiment(write(tmp_path, GOOD))
    assert exp.activity_names() == ["first", "process.double_hang#1", "load.burst#2"]
    assert exp.fleet.sim.decode_step_ms == 2 and exp.fleet.backend == "sim"
    assert exp.hypothesis().probes[0].accepts(3) and not exp.hypothesis().probes[0].accepts(2)
    assert exp.rollbacks[0].action == "restore_fleet"


def test_every_library_experiment_is_valid() -> None:
    files = sorted(LIBRARY.glob("*.yaml"))
    assert len(files) >= 3
    for f in files:
        assert isinstance(load_experiment(f), Experiment), f


def test_an_unknown_key_names_file_line_and_field(tmp_path: Path) -> None:
    err = refused(tmp_path, GOOD.replace("  arrival: {kind: poisson, rate: 4}", "  arrivl: {kind: poisson}"))
    assert (err.line, err.field, err.problem) == (8, "workload.arrivl", "unknown field")
    assert str(err).startswith(f"{tmp_path / 'exp.yaml'}:8: workload.arrivl: unknown field")


def test_a_bad_value_names_file_line_and_field(tmp_path: Path) -> None:
    err = refused(tmp_path, GOOD.replace("  workers: 3", "  workers: 0"))
    assert (err.line, err.field) == (4, "fleet.workers")
    assert "greater than or equal to 1" in err.problem


def test_a_misshapen_distribution_is_explained(tmp_path: Path) -> None:
    err = refused(tmp_path, GOOD.replace("{dist: uniform, min: 8, max: 32}", "{dist: uniform, min: 8}"))
    assert (err.line, err.field) == (9, "workload.osl")
    assert "needs `min` and `max`" in err.problem


def test_an_unknown_fault_lists_the_catalogue(tmp_path: Path) -> None:
    err = refused(tmp_path, GOOD.replace("fault: load.burst", "fault: load.brust"))
    assert (err.line, err.field) == (24, "method[2].fault")
    assert "unknown fault 'load.brust' (did you mean load.burst?)" in err.problem
    assert "load.mass_cancel" in err.problem and "process.double_hang" in err.problem


def test_bad_fault_params_are_checked_by_the_faults_own_model(tmp_path: Path) -> None:
    err = refused(tmp_path, GOOD.replace("params: {count: 10}", "params: {count: 0, colour: red}"))
    assert err.line == 26 and "2 problems" in err.problem
    assert "method[2].params.count" in err.problem and "method[2].params.colour: unknown field" in err.problem


def test_a_target_outside_the_declared_fleet_is_refused(tmp_path: Path) -> None:
    err = refused(tmp_path, GOOD.replace("ids: [node-w0]", "ids: [node-w7]"))
    assert (err.line, err.field) == (18, "method[0].target.ids")
    assert "node-w7 is not in the declared fleet (workers: node-w0, node-w1, node-w2)" in err.problem
    err = refused(tmp_path, GOOD.replace("pick: serving}", "pick: random, count: 4}"))
    assert err.field == "method[1].target.count" and "only 3 worker(s)" in err.problem


def test_a_schedule_over_the_safety_share_is_refused(tmp_path: Path) -> None:
    # The second hang now starts while the first holds: 2 of 3 workers at once, over the default 0.5.
    err = refused(tmp_path, GOOD.replace("    after: first\n    delay: 0.5\n", "    at: 2.5\n"))
    assert (err.line, err.field) == (22, "method[1].target")
    assert "would fault 2 of 3 worker(s) at once from t=2.5 s together with method[0]" in err.problem
    assert "over the safety limit 0.5" in err.problem
    allowed = GOOD.replace("    after: first\n    delay: 0.5\n", "    at: 2.5\n") + "safety: {max_fault_share: 0.7}\n"
    assert load_experiment(write(tmp_path, allowed, "ok.yaml")).safety.max_fault_share == 0.7


def test_a_load_fault_on_a_worker_target_is_refused(tmp_path: Path) -> None:
    err = refused(tmp_path, GOOD.replace("params: {count: 10}", "params: {count: 10}\n    target: {kind: worker}"))
    assert err.field == "method[2].target.kind" and "targets fleet, not worker" in err.problem


def test_a_partition_fault_needs_hosts_and_several_hosts_need_simulated_workers(tmp_path: Path) -> None:
    partition = "fault: partition.isolate\n    at: 5\n    duration: 1\n    target: {kind: host, ids: [h1]}"
    err = refused(tmp_path, GOOD.replace("fault: load.burst\n    at: 5\n    params: {count: 10}", partition))
    assert err.field == "method[2].fault" and "needs fleet.hosts: 3 or more" in str(err), str(err)
    err = refused(tmp_path, GOOD.replace("  workers: 3\n", "  workers: 1\n  hosts: 3\n  backend: vllm\n"))
    assert err.field == "fleet" and "simulated" in err.problem and "backend" in err.problem, str(err)
    library = Path(__file__).resolve().parents[2] / "chaos" / "experiments" / "partition-host-isolation.yaml"
    err = refused(tmp_path, library.read_text().replace("ids: [h2]}", "ids: [h1]}"))  # its radius: nodes [h2]
    assert err.field == "method[0].target.ids" and "outside the blast radius (nodes h2" in err.problem, str(err)


@pytest.mark.parametrize(("change", "field", "words"), [
    (("after: first", "after: nobody"), "method[1].after", "names no activity"),
    (("at: 5\n", "at: 12\n"), "method[2].at", "after the workload ends"),
    (("{dist: uniform, min: 8, max: 32}", "{dist: uniform, min: 8, max: 4090}"), "workload.osl", "context"),
    (("[stream_exactness, ", "[stream_exactnes, "), "checkers[0].name", "did you mean stream_exactness"),
    (("fault_min_success: 0.9", "fault_min_success: 2"), "checkers[1].params.fault_min_success", "less than"),
    (("arrival: {kind: poisson, rate: 4}", "arrival: {kind: trace, file: nowhere.csv}"), "workload.arrival.file",
     "not found"),
    (("probe: workers_routable", "probe: workers_routabel"), "steady-state-hypothesis.probes[0].probe",
     "did you mean workers_routable"),
    (("checkers: [", "rollbacks: [{action: restore_flet}]\ncheckers: ["), "rollbacks[0].action",
     "did you mean restore_fleet"),
])
def test_meaning_is_checked_too(tmp_path: Path, change: tuple[str, str], field: str, words: str) -> None:
    err = refused(tmp_path, GOOD.replace(*change))
    assert err.field == field and words in err.problem, str(err)


def test_not_yaml_and_not_a_mapping_are_reported(tmp_path: Path) -> None:
    assert "not valid YAML" in str(refused(tmp_path, "title: [unclosed\n"))
    assert "top level must be a mapping" in str(refused(tmp_path, "- a list\n"))


def test_experiments_built_in_python_are_validated_the_same_way() -> None:
    with pytest.raises(ConfigError, match=r"method\[0\]\.fault: unknown fault 'nope'"):
        validate_experiment({"title": "t", "method": [{"fault": "nope", "at": 1}]})
