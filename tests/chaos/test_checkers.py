"""Checkers on hand-made histories: each planted error is caught, classified and located; clean ones pass."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetward.chaos.alignment import align
from fleetward.chaos.checkers import CheckContext, Verdict, combine, run_checkers
from fleetward.chaos.history import Record
from fleetward.chaos.reference import ModelReference, NoReference, RecordedReference, reference_key
from fleetward.chaos.runview import RunView
from fleetward.sim.model import SimModel

SEED = 5
MODEL = SimModel(SEED)
CTX = CheckContext(ModelReference(SEED), migration_limit=3, supervisor=False)


class H:
    """A history under construction: records at explicit run times."""

    def __init__(self) -> None:
        self.records: list[Record] = []

    def add(self, type_: str, t: float, **data: Any) -> None:
        self.records.append(Record(type_, t, 1_700_000_000.0 + t, data))

    def method(self, start: float = 0.0, end: float = 10.0) -> H:
        self.add("phase", start, name="method", state="start")
        self._end = end
        return self

    def done(self) -> list[Record]:
        self.add("phase", self._end, name="method", state="end")
        return sorted(self.records, key=lambda r: r.t)

    def request(self, req: str, *, t: float, n: int = 20, tokens: Sequence[int] | None = None,
                prompt: Sequence[int] | None = None, outcome: str = "ok", counts: Sequence[int] | None = None,
                workers: Sequence[str] | None = None, attempts: Sequence[int] | None = None, dt: float = 0.01,
                temperature: float = 0.0, rid: str | None = None) -> list[int]:
        """One streamed request, one token per chunk; returns the reference continuation."""
        prompt = list(prompt if prompt is not None else [40 + (hash(req) % 50), 41, 42, 43])
        expected = MODEL.continuation(prompt, n, ignore_eos=True)
        got = list(expected if tokens is None else tokens)
        rid = rid or f"cmpl-{req}"
        self.add("invoke", t, req=req, client="workload", api="completion", prompt=prompt,
                 params={"max_tokens": n, "temperature": temperature, "ignore_eos": True}, router="r", t_sched=t)
        for i, tok in enumerate(got):
            c = counts[i] if counts is not None else i + 1
            self.add("chunk", t + 0.05 + i * dt, req=req, rid=rid, n=c, tokens=[tok], text="x",
                     worker=workers[i] if workers else "node-w0", attempt=attempts[i] if attempts else 1,
                     finish_reason="length" if i == len(got) - 1 and outcome == "ok" else None,
                     event_id=f"{rid}:{c}")
        end = t + 0.06 + len(got) * dt
        if outcome == "ok":
            self.add("ok", end, req=req, finish_reason="length", usage=None, tokens=len(got))
        elif outcome != "open":
            self.add("fail", end, req=req, stage=outcome, error="boom", tokens=len(got))
        return expected

    def fault(self, name: str, start: float, end: float, *, targets: Sequence[str] = ("node-w0",),
              family: str = "process", verified: bool = True, recovered: bool = True) -> None:
        base = {"activity": name, "fault": "process.kill_worker", "family": family, "targets": list(targets),
                "target": {"kind": "worker", "ids": [], "pick": "first", "count": 1}, "params": {}}
        self.add("fault", start, phase="start", **base)
        self.add("fault", start + 0.01, phase="verified", ok=verified, **base)
        self.add("fault", end, phase="recover", **base)
        self.add("fault", end + 0.01, phase="recovered", ok=recovered, **base)
        self.add("fault", end + 0.02, phase="stop", **base)

    def event(self, kind: str, t: float, **data: Any) -> None:
        self.add("event", t, kind=kind, id=f"{kind}-{t}", ts=1_700_000_000.0 + t, **data)


def check(records: list[Record], name: str, ctx: CheckContext = CTX, **params: Any) -> Verdict:
    (verdict,) = run_checkers(RunView.of(records), ctx, [(name, params)])
    return verdict


def only(verdict: Verdict) -> dict[str, Any]:
    assert verdict.status == "fail", verdict
    assert len(verdict.details) == 1, verdict.details
    return verdict.details[0]


def clean() -> H:
    h = H().method()
    for i in range(6):
        h.request(f"r{i}", t=0.2 + i * 0.3)
    for t in (0.0, 5.0, 10.0):  # what the runner samples of its processes (the resources checker)
        h.add("resources", t, phase="sample", procs=[{"role": "router", "id": "router-0", "pid": 2, "rss_mb": 50.0,
                                                      "fds": 20}])
    h.add("resources", 11.0, phase="after", procs=[], left=[])
    return h


# -- stream exactness ---------------------------------------------------------------------------------------


def test_a_clean_history_passes_every_checker() -> None:
    verdicts = run_checkers(RunView.of(clean().done()), CTX)
    assert {v.checker: v.status for v in verdicts} == {v.checker: "pass" for v in verdicts}, verdicts
    assert combine(v.status for v in verdicts) == "pass"


def test_a_duplicated_token_is_classified_and_located_at_its_migration_during_its_fault() -> None:
    h = H().method()
    ref = MODEL.continuation([50, 41, 42, 43], 20, ignore_eos=True)
    got = [*ref[:10], ref[9], *ref[10:]]  # token 9 delivered twice, right where the stream moved
    workers = ["node-w0"] * 10 + ["node-w1"] * 11
    h.request("dup", t=1.0, prompt=[50, 41, 42, 43], tokens=got, workers=workers, attempts=[1] * 10 + [2] * 11)
    h.fault("kill-w0", 1.0, 1.5)
    h.event("migration", 1.12, request="cmpl-dup", worker="node-w1", from_worker="node-w0", tokens=10, attempt=2,
            reason="reset")
    d = only(check(h.done(), "stream_exactness"))
    assert (d["request"], d["kind"], d["index"], d["count"]) == ("dup", "duplicated", 10, 1)
    assert d["faults"] == ["kill-w0"]
    assert d["migration"]["from"] == "node-w0" and d["migration"]["to"] == "node-w1"
    assert d["worker"] == "node-w1" and d["attempt"] == 2


def test_a_lost_token_is_classified_with_its_index() -> None:
    h = H().method()
    ref = MODEL.continuation([51, 41, 42, 43], 20, ignore_eos=True)
    h.request("lost", t=1.0, prompt=[51, 41, 42, 43], tokens=ref[:7] + ref[8:])
    d = only(check(h.done(), "stream_exactness"))
    assert (d["kind"], d["index"], d["count"], d["faults"]) == ("lost", 7, 1, [])


def test_a_corrupted_token_is_classified_with_its_index() -> None:
    h = H().method()
    ref = MODEL.continuation([52, 41, 42, 43], 20, ignore_eos=True)
    wrong = next(t for t in range(35, 130) if t not in (ref[12], ref[13]))
    h.request("bad", t=1.0, prompt=[52, 41, 42, 43], tokens=[*ref[:12], wrong, *ref[13:]])
    d = only(check(h.done(), "stream_exactness"))
    assert (d["kind"], d["index"], d["count"]) == ("corrupted", 12, 1)


def test_a_wrong_token_followed_by_the_models_continuation_of_it_is_one_corruption() -> None:
    h = H().method()
    prompt = [53, 41, 42, 43]
    ref = MODEL.continuation(prompt, 20, ignore_eos=True)
    wrong = next(t for t in range(35, 130) if t != ref[5])
    rest = MODEL.continuation([*prompt, *ref[:5], wrong], 14, ignore_eos=True)  # an engine that went on from it
    h.request("sdc", t=1.0, prompt=prompt, tokens=[*ref[:5], wrong, *rest])
    d = only(check(h.done(), "stream_exactness"))
    assert (d["kind"], d["index"], d["count"]) == ("corrupted", 5, 1)
    assert "continuation of the wrong token" in d["text"]


def test_a_reordered_pair_is_classified() -> None:
    h = H().method()
    prompt = [54, 41, 42, 43]
    ref = MODEL.continuation(prompt, 20, ignore_eos=True)
    i = next(k for k in range(6, 18) if ref[k] != ref[k + 1])
    h.request("swap", t=1.0, prompt=prompt, tokens=[*ref[:i], ref[i + 1], ref[i], *ref[i + 2:]])
    d = only(check(h.done(), "stream_exactness"))
    assert (d["kind"], d["index"], d["count"]) == ("reordered", i, 2)


@pytest.mark.parametrize("outcome", ["ok", "eof"])
def test_a_stream_that_ends_early_without_an_error_is_truncated(outcome: str) -> None:
    h = H().method()
    ref = MODEL.continuation([55, 41, 42, 43], 20, ignore_eos=True)
    h.request("short", t=1.0, prompt=[55, 41, 42, 43], n=20, tokens=ref[:15], outcome=outcome)
    d = only(check(h.done(), "stream_exactness"))
    assert (d["kind"], d["index"], d["count"], d["outcome"]) == ("truncated", 15, 5, outcome)


@pytest.mark.parametrize("stage", ["transport", "error_event", "cancelled", "timeout", "open"])
def test_an_honest_failure_that_delivered_an_exact_prefix_passes(stage: str) -> None:
    h = H().method()
    ref = MODEL.continuation([56, 41, 42, 43], 20, ignore_eos=True)
    h.request("cut", t=1.0, prompt=[56, 41, 42, 43], tokens=ref[:9], outcome=stage)
    v = check(h.done(), "stream_exactness")
    assert v.status == "pass" and v.metrics["requests_exact_prefix"] == 1


def test_streams_of_a_sampling_engine_are_unknown_not_passed() -> None:
    h = H().method()
    for i in range(3):
        h.request(f"s{i}", t=0.5 + i, temperature=0.8)
    records = h.done()
    recorded = RecordedReference({})
    assert check(records, "stream_exactness", CheckContext(recorded)).status == "unknown"
    v = check(records, "stream_exactness", CheckContext(NoReference("vLLM samples (temperature 0.8)")))
    assert v.status == "unknown" and "temperature 0.8" in v.summary


def test_a_recorded_reference_checks_greedy_requests() -> None:
    h = H().method()
    prompt = [57, 41, 42, 43]
    ref = h.request("g", t=1.0, prompt=prompt)
    recorded = RecordedReference({reference_key(prompt, 20, True): ref})
    assert check(h.done(), "stream_exactness", CheckContext(recorded)).status == "pass"
    wrong = RecordedReference({reference_key(prompt, 20, True): ref[:5] + ref[6:] + [ref[0]]})
    assert check(h.done(), "stream_exactness", CheckContext(wrong)).status == "fail"


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from(["lost", "duplicated", "corrupted", "reordered"]), st.data())
def test_align_names_any_single_planted_error(seed: int, kind: str, data: st.DataObject) -> None:
    ref = SimModel(seed).continuation([60, 61], 64, ignore_eos=True)
    i = data.draw(st.integers(4, 50))
    if kind in ("lost", "duplicated", "reordered"):
        i = next((k for k in range(i, 56) if ref[k] != ref[k + 1]), None)  # type: ignore[assignment]
        if i is None:
            return
    if kind == "lost":
        got, at = ref[:i] + ref[i + 1:], i
    elif kind == "duplicated":
        got, at = [*ref[:i + 1], ref[i], *ref[i + 1:]], i + 1
    elif kind == "reordered":
        got, at = [*ref[:i], ref[i + 1], ref[i], *ref[i + 2:]], i
    else:
        wrong = data.draw(st.integers(35, 130).filter(lambda t: t not in (ref[i], ref[i + 1])))
        got, at = [*ref[:i], wrong, *ref[i + 1:]], i
    anomalies, used_d, used_r = align(got, ref)
    assert [(a.kind, a.index) for a in anomalies] == [(kind, at)]
    assert (used_d, used_r) == (len(got), len(ref))


# -- the other checkers -------------------------------------------------------------------------------------


def test_an_sse_id_that_counts_more_tokens_than_delivered_fails_sse_ids() -> None:
    h = clean()
    counts = list(range(1, 21))
    counts[7] = 9  # the event with the 8th token claims 9: a resume from it would skip one
    h.request("ahead", t=2.0, counts=counts)
    d = only(check(h.done(), "sse_ids"))
    assert d["request"] == "ahead" and "skips 1" in d["text"]


def test_more_attempts_than_the_migration_limit_allows_fail() -> None:
    h = clean()
    h.request("many", t=2.0, attempts=[1] * 4 + [2] * 4 + [3] * 4 + [4] * 4 + [5] * 4)
    d = only(check(h.done(), "migration_limit"))
    assert (d["request"], d["attempts"], d["allowed"]) == ("many", 5, 4)


def test_availability_fails_a_fault_window_with_failed_requests_and_passes_the_baseline() -> None:
    h = H().method(end=8.0)
    for i in range(4):
        h.request(f"b{i}", t=0.2 + i * 0.3)
    h.fault("kill-w0", 3.0, 4.0)
    h.request("hit", t=3.2, tokens=[], outcome="status")
    h.request("fine", t=3.4)
    v = check(h.done(), "availability")
    assert v.status == "fail" and v.details[0]["window"] == "kill-w0" and v.details[0]["failed"] == ["hit"]
    assert v.metrics["baseline"]["success"] == 1.0


def test_recovery_is_the_time_until_throughput_is_back() -> None:
    h = H().method(end=12.0)
    for i in range(40):  # steady: one 20-token request every 0.25 s, except while the fault holds
        t = 0.1 + i * 0.25
        if not 4.0 <= t < 6.5:
            h.request(f"r{i}", t=t)
    h.fault("hang-w0", 4.0, 5.0)
    v = check(h.done(), "recovery", window_s=1.0, steady_share=0.5)
    assert v.status == "pass"
    assert 1.0 <= v.metrics["recovery_s"]["hang-w0"] <= 1.6
    assert check(h.done(), "recovery", window_s=1.0, max_recovery_s=0.5).status == "fail"


def test_throughput_that_never_comes_back_fails_recovery() -> None:
    h = H().method(end=12.0)
    for i in range(16):
        h.request(f"r{i}", t=0.1 + i * 0.25)
    h.fault("kill-all", 4.0, 5.0)
    assert check(h.done(), "recovery").status == "fail"


def test_detection_latency_is_measured_and_unknown_without_a_supervisor() -> None:
    h = clean()
    h.fault("hang-w0", 3.0, 5.0)
    undetected = h.done()
    assert check(undetected, "detection").status == "unknown"
    assert check(undetected, "detection", CheckContext(CTX.reference, supervisor=True)).status == "fail"
    h = clean()
    h.fault("hang-w0", 3.0, 5.0)
    h.event("health.changed", 3.0, worker="node-w0", state="ready")  # not a detection
    h.event("hang.detected", 3.7, worker="node-w0")
    v = check(h.done(), "detection")
    assert v.status == "pass" and v.metrics["latency_s"] == {"hang-w0": 0.7}
    assert check(h.done(), "detection", max_latency_s=0.5).status == "fail"


def test_a_detection_without_a_fault_fails_quiet_baseline() -> None:
    h = clean()
    h.fault("kill-w0", 3.0, 4.0)
    h.event("worker.down", 3.5, worker="node-w0")  # during the fault: expected
    h.event("migration", 8.0, request="cmpl-x", worker="node-w1", from_worker="node-w0", tokens=3, attempt=2)
    d = only(check(h.done(), "quiet_baseline"))
    assert (d["kind"], d["t"]) == ("migration", 8.0)


@pytest.mark.parametrize(("verified", "recovered", "word"), [(False, True, "did not take effect"),
                                                              (True, False, "was not recovered")])
def test_a_fault_that_did_nothing_or_did_not_recover_fails_the_run(verified: bool, recovered: bool,
                                                                   word: str) -> None:
    h = clean()
    h.fault("kill-w0", 3.0, 4.0, verified=verified, recovered=recovered)
    d = only(check(h.done(), "fault_verification"))
    assert word in d["problem"]


def test_verdicts_combine_fail_over_unknown_over_pass() -> None:
    assert combine(["pass", "unknown", "pass"]) == "unknown"
    assert combine(["unknown", "fail", "pass"]) == "fail"
    assert combine(["pass"]) == "pass"
    assert combine([]) == "pass"
