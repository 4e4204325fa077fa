"""The distributed checkers on planted histories: two leaders acting, an action carried out twice, the minority
side writing, a request answered twice; and `fleetward chaos check` catching a planted double leader."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from fleetward.chaos.checkers import CHECKERS, CheckContext, Verdict
from fleetward.chaos.history import Record
from fleetward.chaos.reference import NoReference
from fleetward.chaos.runview import RunView
from fleetward.chaos.validation import load_experiment

LIBRARY = Path(__file__).resolve().parents[2] / "chaos" / "experiments"


def _rec(type_: str, t: float, **data: Any) -> Record:
    return Record(type_, t, 1_000_000.0 + t, data)


def _action(t: float, revision: int, *, term: int, by: str, status: str = "pending",
            key: str = "actions/h1/h1-w0.restart.1") -> Record:
    return _rec("write", t, key=key, op="put", revision=revision,
                value={"id": key.rsplit("/", 1)[1], "status": status, "issued_by": by, "term": term})


def _check(name: str, records: list[Record], **params: Any) -> Verdict:
    checker = CHECKERS[name]
    ctx = CheckContext(reference=NoReference("planted"))
    return checker.fn(RunView.of(records), ctx, checker.params.model_validate(params))


def test_leader_writes_in_term_order_pass_and_a_deposed_leader_writing_after_its_successor_fails() -> None:
    handover = [_action(1, 10, term=5, by="controller-0", key="actions/h1/a"),
                _action(2, 20, term=9, by="controller-1", key="actions/h1/b"),
                _rec("write", 3, key="scale/aggregated", op="put", revision=21,
                     value={"leader": "autoscaler-0", "term": 7})]
    assert _check("single_leader", handover).status == "pass"
    overlap = [*handover, _action(4, 30, term=5, by="controller-0", key="actions/h2/c")]
    v = _check("single_leader", overlap)
    assert v.status == "fail" and v.details[0]["write"]["revision"] == 30 and v.details[0]["after"]["term"] == 9
    two_issuers = [_action(1, 10, term=5, by="controller-0", key="actions/h1/a"),
                   _action(2, 11, term=5, by="controller-1", key="actions/h1/b")]
    assert _check("single_leader", two_issuers).status == "fail"
    assert _check("single_leader", []).status == "pass"  # nobody wrote: nothing overlapped


def test_an_action_claimed_twice_fails() -> None:
    once = [_action(1, 10, term=5, by="c0"), _action(2, 11, term=5, by="c0", status="running"),
            _action(3, 12, term=5, by="c0", status="done")]
    assert _check("actions_once", once).status == "pass"
    twice = [*once, _action(4, 13, term=5, by="c0", status="running")]
    v = _check("actions_once", twice)
    assert v.status == "fail" and v.details[0]["claims"] == 2


def test_a_write_from_the_cut_off_side_fails_and_one_in_flight_at_the_cut_passes() -> None:
    hosts = _rec("hosts", 0, hosts={"h0": "10.77.0.10", "h2": "10.77.0.12"},
                 placement={"controller-1": "h2", "agent:h2": "h2", "autoscaler-0": "h2", "controller-0": "h0"})
    cut = [_rec("partition", 5, phase="start", activity="iso", minority=["h2"]),
           _rec("partition", 15, phase="heal", activity="iso")]
    quiet = [hosts, *cut, _action(5.2, 10, term=3, by="controller-1"),  # in flight as the cut began
             _action(8, 11, term=4, by="controller-0"),  # the majority's leader
             _rec("write", 16, key="workers/h2-w0", op="put", revision=12, value={"node": "h2"})]  # after the heal
    assert _check("minority_quiet", quiet).status == "pass"
    for loud in (_action(9, 13, term=3, by="controller-1"),
                 _rec("write", 9, key="workers/h2-w0", op="put", revision=13, value={"node": "h2"}),
                 _rec("write", 9, key="scale/aggregated", op="put", revision=13, value={"leader": "autoscaler-0"})):
        v = _check("minority_quiet", [*quiet, loud])
        assert v.status == "fail" and v.details[0]["host"] == "h2", loud
    assert _check("minority_quiet", [*cut, loud]).status == "unknown"  # who runs where is not in the history


def test_a_request_answered_twice_fails() -> None:
    invoke = _rec("invoke", 0, req="r1", client="workload", api="completion", prompt=[1], params={})
    chunk = _rec("chunk", 1, req="r1", tokens=[5], event_id="cmpl-1:1")
    ok = _rec("ok", 2, req="r1", finish_reason="length")
    assert _check("single_answer", [invoke, chunk, ok]).status == "pass"
    assert _check("single_answer", [invoke, chunk, ok, ok]).status == "fail"
    assert _check("single_answer", [invoke, chunk, chunk, ok]).status == "fail"


def test_chaos_check_catches_a_planted_double_acting_controller(tmp_path: Path) -> None:
    """A saved run whose history shows two controllers' fences overlapping: `fleetward chaos check` fails it."""
    run = tmp_path / "run"
    run.mkdir()
    experiment = load_experiment(LIBRARY / "partition-heal-inflight-actions.yaml").to_json()
    journal = {"experiment": experiment, "status": "completed", "deviated": False, "run": [],
               "steady_states": {"before": None, "after": None}}
    (run / "journal.json").write_text(json.dumps(journal))
    records = [_action(1, 10, term=5, by="controller-0", key="actions/h1/a"),
               _action(2, 20, term=9, by="controller-1", key="actions/h1/b"),
               _action(3, 30, term=5, by="controller-0", key="actions/h2/c")]  # the deposed one, still writing
    with (run / "history.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps({"type": r.type, "t": r.t, "wall": r.wall, **r.data}) + "\n")
    done = subprocess.run([sys.executable, "-m", "fleetward.cli", "chaos", "check", str(run), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    verdicts = {v["checker"]: v for v in json.loads(done.stdout)["verdicts"]}
    assert verdicts["single_leader"]["status"] == "fail"
    assert verdicts["single_leader"]["details"][0]["write"]["issuer"] == "controller-0"
    assert verdicts["actions_once"]["status"] == "pass"
