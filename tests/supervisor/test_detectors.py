"""Detectors, fed observations with a manual clock: each says something only when its verdict changes."""

from __future__ import annotations

from fleetward.fleet.clock import ManualClock
from fleetward.migration.progress import ProgressModel
from fleetward.supervisor.detectors import (
    EngineActivity,
    EngineFrozenDetector,
    EngineProgress,
    EngineSample,
    GoldenBook,
    MetricsDetector,
    StreamProgressDetector,
    golden_key,
    parse_prometheus,
    weigh_computing,
)
from fleetward.supervisor.signals import Severity


def test_stream_progress_follows_the_routers_adaptive_allowance() -> None:
    clock = ManualClock()
    router = ProgressModel(clock=clock, floor_s=1.0, prefill_s_per_token=0.001)
    detector = StreamProgressDetector(clock=clock)
    router.dispatched("w1", "r1", prompt_tokens=10)
    router.token("w1", "r1")
    clock.advance(0.9)
    detector.observe("router-a", router.view())
    assert detector.check() == []
    clock.advance(0.2)  # 1.1 s silent, allowed 1.0
    detector.observe("router-a", router.view())
    (sig,) = detector.check()
    assert (sig.worker, sig.severity) == ("w1", Severity.SUSPECT) and sig.extra["silent_for_s"] > 1.0
    assert detector.silent("w1") is True
    router.token("w1", "r1")
    detector.observe("router-a", router.view())
    (sig,) = detector.check()
    assert sig.severity is Severity.OK


def test_a_worker_whose_streams_moved_away_for_silence_is_shunned_until_it_shows_life() -> None:
    clock = ManualClock()
    router = ProgressModel(clock=clock, floor_s=1.0)
    router.dispatched("w1", "r1", prompt_tokens=5)
    clock.advance(2.5)  # allowed: the floor, the first-token base and 5 prompt tokens' prefill
    assert [w for w, _, _ in router.stalled()] == ["w1"]
    router.stall_acted_on("w1")
    router.finished("w1", "r1")  # its stream moved on: nothing in flight, so it no longer looks silent
    assert router.silent_for("w1") == 0.0
    assert router.shunned("w1", hold_s=30), "idle only because its work was taken away"
    stalled_at = clock.wall()
    clock.advance(5)
    assert router.shunned("w1", hold_s=30, ready_since=stalled_at - 60), "a verdict older than the stall"
    assert not router.shunned("w1", hold_s=30, ready_since=clock.wall()), "found ready after the stall"
    router.stall_acted_on("w1")
    router.dispatched("w1", "r2", prompt_tokens=5)
    router.token("w1", "r2")
    assert not router.shunned("w1", hold_s=30), "a token is life"
    router.stall_acted_on("w1")
    clock.advance(30)
    assert not router.shunned("w1", hold_s=30), "the hold runs out"
    assert not router.shunned("w2", hold_s=30)


def test_a_long_prompt_gets_a_longer_allowance_than_a_short_one() -> None:
    clock = ManualClock()
    router = ProgressModel(clock=clock, floor_s=1.0, prefill_s_per_token=0.002, first_token_base_s=1.0)
    detector = StreamProgressDetector(clock=clock)
    router.dispatched("w1", "long", prompt_tokens=2000)  # allowance 1 + 1 + 2000 * 0.002 = 6 s
    clock.advance(5.0)
    detector.observe("r", router.view())
    assert detector.check() == [], "a legitimate long prefill is not a hang"
    clock.advance(1.5)
    detector.observe("r", router.view())
    assert detector.check()[0].severity is Severity.SUSPECT


def test_a_busy_worker_is_not_silent_even_if_one_request_waits() -> None:
    clock = ManualClock()
    router = ProgressModel(clock=clock, floor_s=1.0)
    detector = StreamProgressDetector(clock=clock)
    router.dispatched("w1", "queued", prompt_tokens=5)
    router.dispatched("w1", "busy", prompt_tokens=5)
    for _ in range(30):
        clock.advance(0.1)
        router.token("w1", "busy")  # the worker emits for others: the queued one just waits
    detector.observe("r", router.view())
    assert detector.check() == [] and detector.silent("w1") is False


def test_stale_router_views_age_out() -> None:
    clock = ManualClock()
    detector = StreamProgressDetector(clock=clock, stale_after_s=5)
    detector.observe("r", {"workers": {"w1": {"in_flight": 1, "silent_for_s": 9, "allowed_silence_s": 1}}})
    assert detector.check()[0].severity is Severity.SUSPECT
    clock.advance(6)
    assert detector.check()[0].severity is Severity.OK


def test_in_flight_now_sums_the_routers_latest_views_without_waiting_for_a_check() -> None:
    """What a drain asks at the moment it is ordered (a worker with nothing in flight ends its drain at once)."""
    clock = ManualClock()
    detector = StreamProgressDetector(clock=clock, stale_after_s=5)
    detector.observe("r1", {"workers": {"w1": {"in_flight": 2}}})
    clock.advance(3)
    detector.observe("r2", {"workers": {"w1": {"in_flight": 1}, "w2": {"in_flight": 4}}})
    assert detector.in_flight("w1") == 0, "check() has not merged them yet"
    assert (detector.in_flight_now("w1"), detector.in_flight_now("w2"), detector.in_flight_now("w3")) == (3, 4, 0)
    assert detector.answered(["r1", "r2"], since=0) and not detector.answered(["r1", "r2", "r3"], since=0)
    assert detector.answered(["r2"], since=3) and not detector.answered(["r1", "r2"], since=3), "r1's is older"
    clock.advance(3)
    assert detector.in_flight_now("w1") == 1, "r1's view is stale"
    assert detector.answered([], since=6), "no router: nothing in flight"


def test_metrics_counters_that_freeze_while_requests_run_are_suspect() -> None:
    clock = ManualClock()
    d = MetricsDetector(clock=clock, frozen_after_s=10)
    assert d.scraped("w", {"vllm:num_requests_running": 2, "vllm:generation_tokens_total": 100}) == []
    clock.advance(11)
    (sig,) = d.scraped("w", {"vllm:num_requests_running": 2, "vllm:generation_tokens_total": 100})
    assert sig.severity is Severity.SUSPECT and "frozen" in sig.reason
    (sig,) = d.scraped("w", {"vllm:num_requests_running": 2, "vllm:generation_tokens_total": 150})
    assert sig.severity is Severity.OK
    clock.advance(60)
    assert d.scraped("w", {"vllm:num_requests_running": 0, "vllm:generation_tokens_total": 150}) == [], "idle"
    assert d.failed("w", "refused") == []
    assert d.failed("w", "refused")[0].severity is Severity.SUSPECT


def test_counters_still_while_the_engine_computes_are_one_long_step_up_to_a_bound() -> None:
    clock = ManualClock()
    d = MetricsDetector(clock=clock, frozen_after_s=10)
    running = {"vllm:num_requests_running": 1, "vllm:generation_tokens_total": 100}
    assert d.scraped("w", running, computing_s=30) == []
    clock.advance(20)
    assert d.scraped("w", running, computing_s=30) == [], "computing (node agent): one long step"
    clock.advance(11)
    (sig,) = d.scraped("w", running, computing_s=30)
    assert sig.severity is Severity.SUSPECT and "frozen for 31.0s" in sig.reason


def test_a_reading_against_the_one_as_a_canary_left_says_whether_the_engine_computed() -> None:
    clock = ManualClock()
    d = MetricsDetector(clock=clock)
    reading = {"vllm:num_requests_running": 2, "vllm:num_requests_waiting": 1, "vllm:prompt_tokens_total": 3000,
               "vllm:generation_tokens_total": 2}
    assert d.last("w") is None
    left = d.record("w", reading)
    assert left is not None and left == (3002, clock.monotonic()) == d.last("w")
    clock.advance(2)
    moved = d.progress("w", {**reading, "vllm:prompt_tokens_total": 4500, "vllm:generation_tokens_total": 3}, left)
    assert moved is not None and moved.busy and (moved.tokens, moved.over_s) == (1501, 2)
    assert moved.describe() == "its engine computed 1501 token(s) in the last 2.0s (2 request(s) running, 1 waiting)"
    left = d.last("w")
    assert left is not None
    clock.advance(1.5)
    # A scrape in between is not what the canary is compared with: the reading as it left is.
    assert d.scraped("w", {**reading, "vllm:prompt_tokens_total": 4500, "vllm:generation_tokens_total": 3}) == []
    clock.advance(0.5)
    still = d.progress("w", {**reading, "vllm:prompt_tokens_total": 4500, "vllm:generation_tokens_total": 3}, left)
    assert still is not None and not still.busy
    assert still.describe().startswith("its token counters stood still for 2.0s")
    assert d.record("x", {"vllm:num_requests_running": 1}) is None, "no token counters exported"
    assert d.progress("x", {"vllm:num_requests_running": 1}, (0.0, 0.0)) is None


def test_engine_activity_is_said_only_when_it_changes_with_hysteresis() -> None:
    clock = ManualClock()
    a = EngineActivity(clock=clock, busy_cpu=0.5, on_s=1.0, off_s=3.0)
    cpu = 10.0
    assert a.observe("w", cpu) == [], "the first look measures nothing"
    said = []
    for _ in range(3):  # 0.8 of a core, 0.25 s a look: computing once a second of it is seen
        clock.advance(0.25)
        cpu += 0.2
        said += a.observe("w", cpu)
    assert said == []
    clock.advance(0.25)
    cpu += 0.2
    (on,) = a.observe("w", cpu)
    assert on.detector == "engine-busy" and on.severity is Severity.OK and on.extra["computing"] is True
    assert on.extra["since"] == clock.wall() - 1.0
    for _ in range(8):  # idle for 2 s, then busy again: not said (under off_s)
        clock.advance(0.25)
        said += a.observe("w", cpu)
    clock.advance(0.25)
    cpu += 0.2
    said += a.observe("w", cpu)
    assert said == [], "a pause shorter than off_s is not said"
    for _ in range(12):
        clock.advance(0.25)
        said += a.observe("w", cpu)
    (off,) = said
    assert off.extra == {"computing": False}
    assert a.observe("w", 1.0) == [], "a new process tree (less CPU time): measured from there"
    clock.advance(0.25)
    for _ in range(5):
        clock.advance(0.25)
        a.observe("w", 1.0 + 0.25 * _)
    (gone,) = a.forget("w")
    assert gone.extra == {"computing": False} and a.forget("w") == []


def test_cpu_alone_is_one_long_step_until_the_bound() -> None:
    still = EngineProgress(0.0, 4.0, running=1.0, waiting=1.0)
    busy, why = weigh_computing(still, computing_for_s=6.0, still_for_s=7.0, bound_s=30.0)
    assert busy and "its engine processes have computed for 6.0s (node agent): one long step" in why
    busy, why = weigh_computing(still, computing_for_s=40.0, still_for_s=31.0, bound_s=30.0)
    assert not busy and "no token for 31.0s" in why and "a step that does not return" in why


def test_a_stopped_engine_is_fatal_and_cpu_without_progress_is_suspect() -> None:
    clock = ManualClock()
    d = EngineFrozenDetector(clock=clock, no_progress_s=5)
    running = EngineSample(((10, "VLLM::EngineCore", "running", 1.0),), running_requests=3)
    assert d.observe("w", running) == []
    stopped = EngineSample(((10, "VLLM::EngineCore", "stopped", 1.0),), running_requests=3)
    (sig,) = d.observe("w", stopped)
    assert sig.severity is Severity.FATAL and sig.extra["hang"] is True and "SIGSTOP" in sig.reason
    assert d.observe("w", running)[0].severity is Severity.OK
    clock.advance(6)
    assert d.observe("w", running)[0].severity is Severity.SUSPECT, "no CPU used for 6 s with 3 running"
    idle = EngineSample(((10, "VLLM::EngineCore", "sleeping", 1.0),), running_requests=0)
    assert d.observe("w", idle)[0].severity is Severity.OK


def _engine(cpu: float, switches: int, **load: object) -> EngineSample:
    return EngineSample(((10, "VLLM::EngineCore", "disk-sleep", cpu),), switches=switches, **load)  # type: ignore[arg-type]


def test_an_engine_not_scheduled_while_requests_run_is_a_fatal_hang_after_the_stall_time() -> None:
    clock = ManualClock()
    d = EngineFrozenDetector(clock=clock, stall_s=1.0, no_progress_s=5.0)
    assert d.observe("w", _engine(1.0, 100, running_requests=2, running_read_at=0.0)) == []
    clock.advance(0.25)  # frozen from here on: no CPU time, no context switch
    assert d.observe("w", _engine(1.0, 100, running_requests=2, running_read_at=0.25)) == []
    assert not d.ran_last("w")
    clock.advance(0.5)
    assert d.observe("w", _engine(1.0, 100, running_requests=2, running_read_at=0.7)) == [], "0.5 s of waiting work"
    clock.advance(0.5)  # work seen waiting since 0.25: 1.0 s without being scheduled
    (sig,) = d.observe("w", _engine(1.0, 100, running_requests=2, running_read_at=1.2))
    assert sig.severity is Severity.FATAL and sig.extra["hang"] is True and "not scheduled" in sig.reason
    clock.advance(1.0)
    assert d.observe("w", _engine(1.0, 100, running_requests=2, running_read_at=2.2)) == [], "said once"
    clock.advance(0.25)
    assert d.observe("w", _engine(1.0, 101, running_requests=2, running_read_at=2.4))[0].severity is Severity.OK


def test_an_engine_that_keeps_running_or_has_no_work_is_never_a_stall() -> None:
    clock = ManualClock()
    d = EngineFrozenDetector(clock=clock, stall_s=1.0)
    for i in range(40):  # busy: a context switch (or CPU time) between every two looks
        assert d.observe("w", _engine(1.0 + (i % 2) * 0.01, 100 + i // 2, running_requests=4,
                                      running_read_at=clock.monotonic())) == []
        clock.advance(0.25)
    for _ in range(40):  # idle, not scheduled at all, nothing running and no probe: nothing waits
        assert d.observe("w", _engine(2.0, 500, running_requests=0, running_read_at=clock.monotonic())) == []
        clock.advance(0.25)
    # Requests counted before the engine last ran are no evidence that work waits now.
    d.observe("w", _engine(3.0, 600, running_requests=3, running_read_at=clock.monotonic()))
    clock.advance(3)  # (below no_progress_s, whose suspicion is another rule)
    assert d.observe("w", _engine(3.0, 600, running_requests=3, running_read_at=clock.monotonic() - 3.1)) == []


def test_an_idle_engine_that_shows_no_progress_is_probed_and_a_frozen_one_leaves_the_probe_waiting() -> None:
    clock = ManualClock()
    d = EngineFrozenDetector(clock=clock, stall_s=1.0, probe_interval_s=2.0)
    d.observe("w", _engine(1.0, 100))
    assert not d.probe_due("w"), "it ran since the last look"
    clock.advance(0.25)
    d.observe("w", _engine(1.0, 100))
    assert d.probe_due("w")
    sent = clock.monotonic()
    clock.advance(0.25)  # a live engine takes the probe: it runs, the probe is answered
    d.observe("w", _engine(1.01, 104, probe_sent_at=sent))
    d.probe_done("w")
    clock.advance(0.25)
    d.observe("w", _engine(1.01, 104))
    assert not d.probe_due("w"), "probes are spaced by probe_interval_s"
    clock.advance(2.0)
    d.observe("w", _engine(1.01, 104))
    assert d.probe_due("w")
    sent = clock.monotonic()  # now frozen: the probe waits (twice stall_s: the server may hold it a while)
    for _ in range(7):
        clock.advance(0.25)
        assert d.observe("w", _engine(1.01, 104, probe_sent_at=sent)) == []
    clock.advance(0.25)
    (sig,) = d.observe("w", _engine(1.01, 104, probe_sent_at=sent))
    assert sig.severity is Severity.FATAL and "probe" in sig.reason
    assert not d.probe_due("w"), "no probes once named"


def test_a_probe_waits_on_the_engine_only_once_the_server_in_front_of_it_ran() -> None:
    """vLLM: the probe goes to the API server, which hands it to EngineCore. A server starved of CPU (a
    loaded host, a start-up) holds it without the engine being at fault (CI saw that verdict on an idle,
    healthy prefill server); once the server ran, an engine that stays unscheduled is named."""
    clock = ManualClock()
    d = EngineFrozenDetector(clock=clock, stall_s=1.0, probe_interval_s=2.0)
    d.observe("w", _engine(1.0, 100, server=(5.0, 50)))
    clock.advance(0.25)
    d.observe("w", _engine(1.0, 100, server=(5.0, 50)))
    assert d.probe_due("w")
    sent = clock.monotonic()
    for _ in range(20):  # the server does not run: five seconds, no verdict
        clock.advance(0.25)
        assert d.observe("w", _engine(1.0, 100, probe_sent_at=sent, server=(5.0, 50))) == []
    clock.advance(0.25)
    assert d.observe("w", _engine(1.0, 100, probe_sent_at=sent, server=(5.1, 58))) == [], "it runs now"
    for _ in range(7):
        clock.advance(0.25)
        assert d.observe("w", _engine(1.0, 100, probe_sent_at=sent, server=(5.1, 59))) == []
    clock.advance(0.25)
    (sig,) = d.observe("w", _engine(1.0, 100, probe_sent_at=sent, server=(5.1, 60)))
    assert sig.severity is Severity.FATAL and "probe" in sig.reason


def test_a_server_run_that_may_have_come_before_the_probe_was_sent_is_not_evidence() -> None:
    """The look after the probe's bytes were written shows the server ran since the look before; that run may
    have been before the write. Only a run between two looks that both follow the write is the server's
    chance to hand the probe on."""
    clock = ManualClock()
    d = EngineFrozenDetector(clock=clock, stall_s=1.0, probe_interval_s=2.0)
    d.observe("w", _engine(1.0, 100, server=(5.0, 50)))
    clock.advance(0.25)
    d.observe("w", _engine(1.0, 100, server=(5.0, 50)))
    clock.advance(0.1)
    sent = clock.monotonic()
    clock.advance(0.15)
    assert d.observe("w", _engine(1.0, 100, probe_sent_at=sent, server=(5.0, 51))) == []
    for _ in range(20):  # the server does not run again: no verdict
        clock.advance(0.25)
        assert d.observe("w", _engine(1.0, 100, probe_sent_at=sent, server=(5.0, 51))) == []
    clock.advance(0.25)
    assert d.observe("w", _engine(1.0, 100, probe_sent_at=sent, server=(5.0, 52))) == [], "it runs now"
    for _ in range(7):
        clock.advance(0.25)
        assert d.observe("w", _engine(1.0, 100, probe_sent_at=sent, server=(5.0, 52))) == []
    clock.advance(0.25)
    (sig,) = d.observe("w", _engine(1.0, 100, probe_sent_at=sent, server=(5.0, 52)))
    assert sig.severity is Severity.FATAL and "probe" in sig.reason


class _Server:
    """The server in front of an engine, look by look: scheduled or not, and the CPU it asked for."""

    def __init__(self) -> None:
        self.switches, self.demand = 50, 0

    def look(self, *, scheduled: bool = True, busy: float = 0.004) -> dict[str, object]:
        """``busy``: the share of one CPU it asked for over the last 250 ms (idle vLLM: 0.002)."""
        self.switches += scheduled
        self.demand += int(busy * 0.25e9)
        return {"server": (1.0, self.switches), "server_demand_ns": self.demand}


def test_a_probe_waits_on_the_engine_only_while_the_server_in_front_of_it_is_settled() -> None:
    """vLLM's API server wakes every 100 ms, so "it ran since the probe was sent" is always true; CI saw an
    idle, healthy prefill server named hung on that rule while its server, on a host loaded by the other
    server starting, had not handed the probe on. A probe counts once every look after it shows the server
    scheduled and asking for little CPU (it waits on the engine), and stops counting when it works again."""
    clock = ManualClock()
    d = EngineFrozenDetector(clock=clock, stall_s=1.0, probe_interval_s=2.0)
    server = _Server()
    d.observe("w", _engine(1.0, 100, **server.look()))
    clock.advance(0.25)
    d.observe("w", _engine(1.0, 100, **server.look()))
    assert d.probe_due("w")
    sent = clock.monotonic()
    for _ in range(20):  # five seconds of the server working on it (or starved: running and waiting to run)
        clock.advance(0.25)
        assert d.observe("w", _engine(1.0, 100, probe_sent_at=sent, **server.look(busy=0.6))) == []
    for _ in range(4):  # settled for a while, then it works again: that evidence is taken back
        clock.advance(0.25)
        assert d.observe("w", _engine(1.0, 100, probe_sent_at=sent, **server.look())) == []
    clock.advance(0.25)
    assert d.observe("w", _engine(1.0, 100, probe_sent_at=sent, **server.look(busy=0.3))) == []
    for _ in range(8):  # not scheduled at all: it has not shown that it handed the probe on
        clock.advance(0.25)
        assert d.observe("w", _engine(1.0, 100, probe_sent_at=sent, **server.look(scheduled=False, busy=0))) == []
    for _ in range(4):  # settled: stall_s from its first settled look
        clock.advance(0.25)
        assert d.observe("w", _engine(1.0, 100, probe_sent_at=sent, **server.look(busy=0.03))) == []
    clock.advance(0.25)
    (sig,) = d.observe("w", _engine(1.0, 100, probe_sent_at=sent, **server.look(busy=0.03)))
    assert sig.severity is Severity.FATAL and "probe" in sig.reason


def test_a_frozen_engine_behind_a_settled_server_is_named_stall_s_after_the_first_look_that_shows_it() -> None:
    clock = ManualClock()
    d = EngineFrozenDetector(clock=clock, stall_s=1.0, probe_interval_s=2.0)
    server = _Server()
    d.observe("w", _engine(1.0, 100, **server.look()))
    clock.advance(0.25)
    d.observe("w", _engine(1.0, 100, **server.look()))
    clock.advance(0.1)
    sent = clock.monotonic()
    clock.advance(0.15)  # this look's interval began before the send: it shows nothing about the probe
    assert d.observe("w", _engine(1.0, 100, probe_sent_at=sent, **server.look(busy=0.014))) == []
    for _ in range(4):  # the first look after: settled; then stall_s of them
        clock.advance(0.25)
        assert d.observe("w", _engine(1.0, 100, probe_sent_at=sent, **server.look())) == []
    clock.advance(0.25)
    (sig,) = d.observe("w", _engine(1.0, 100, probe_sent_at=sent, **server.look()))
    assert sig.severity is Severity.FATAL and "probe" in sig.reason


def test_an_observer_that_was_held_up_has_not_watched_the_engine_meanwhile() -> None:
    """CI: the agent's event loop was blocked for seconds (its etcd lease expired meanwhile) while a probe and
    requests waited on an idle, healthy vLLM decode server; the first look after the gap named it hung. Looks
    that come after a gap longer than stall_s start the evidence again; a frozen engine is still named."""
    clock = ManualClock()
    d = EngineFrozenDetector(clock=clock, stall_s=1.0, probe_interval_s=2.0, no_progress_s=30.0)
    d.observe("w", _engine(1.0, 100, server=(5.0, 50)))
    clock.advance(0.25)
    sent = clock.monotonic()
    d.observe("w", _engine(1.0, 100, server=(5.0, 50), probe_sent_at=sent))
    clock.advance(5.0)  # the observer is held up; the server ran, the engine (not yet handed the probe) did not
    assert d.observe("w", _engine(1.0, 100, probe_sent_at=sent, server=(5.2, 70))) == []
    for _ in range(7):  # watched again: the probe counts from here, twice stall_s
        clock.advance(0.25)
        assert d.observe("w", _engine(1.0, 100, probe_sent_at=sent, server=(5.2, 70))) == []
    clock.advance(0.25)
    (sig,) = d.observe("w", _engine(1.0, 100, probe_sent_at=sent, server=(5.2, 70)))
    assert sig.severity is Severity.FATAL and "probe" in sig.reason
    # Requests running count from the first look after a gap too.
    d.forget("w")
    d.observe("w", _engine(1.0, 100, running_requests=2, running_read_at=clock.monotonic()))
    clock.advance(3.0)
    assert d.observe("w", _engine(1.0, 100, running_requests=2, running_read_at=clock.monotonic() - 2.5)) == []
    clock.advance(0.75)
    assert d.observe("w", _engine(1.0, 100, running_requests=2, running_read_at=clock.monotonic())) == []
    clock.advance(0.25)
    (sig,) = d.observe("w", _engine(1.0, 100, running_requests=2, running_read_at=clock.monotonic()))
    assert sig.severity is Severity.FATAL and "running" in sig.reason


def test_golden_outputs_are_learned_by_quorum_and_catch_wrong_tokens() -> None:
    book = GoldenBook(quorum=2)
    assert book.check("m", [1, 2, 3], worker="a") is None
    assert book.check("m", [1, 2, 3], worker="a") is None, "one worker twice is not a quorum"
    assert book.check("m", [9, 9, 9], worker="b") is None, "no quorum yet"
    assert book.check("m", [1, 2, 3], worker="c") is True
    assert book.check("m", [1, 2, 4], worker="b") is False
    assert book.check("other", [1, 2, 4], worker="b") is None
    book.forget("m")
    assert book.check("m", [1, 2, 4], worker="b") is None, "learned again"


def test_goldens_are_kept_per_model_engine_and_device() -> None:
    """A rolling vLLM upgrade or a second GPU type gives healthy workers other greedy tokens."""
    book = GoldenBook(quorum=2)
    old, new = golden_key("m", "vllm 0.32.0", "NVIDIA H100"), golden_key("m", "vllm 0.33.0", "NVIDIA H100")
    other_gpu = golden_key("m", "vllm 0.32.0", "NVIDIA A100")
    assert len({old, new, other_gpu, golden_key("m", None, None)}) == 4
    book.check(old, [1, 2], worker="a")
    assert book.check(old, [1, 2], worker="b") is True
    assert book.check(new, [7, 8], worker="c") is None, "another version: no verdict from the old golden"
    assert book.check(other_gpu, [5, 6], worker="d") is None


def test_prometheus_text_is_summed_across_labels() -> None:
    text = ('# HELP x\nvllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 1.0\nvllm:generation_tokens_total 17.0\n')
    got = parse_prometheus(text, ["vllm:num_requests_running", "vllm:generation_tokens_total"])
    assert got == {"vllm:num_requests_running": 3.0, "vllm:generation_tokens_total": 17.0}


def test_streams_a_router_moved_away_remain_evidence_after_the_worker_looks_idle() -> None:
    clock = ManualClock()
    router = ProgressModel(clock=clock, floor_s=1.0)
    detector = StreamProgressDetector(clock=clock)
    router.dispatched("w1", "r1", prompt_tokens=5)
    router.token("w1", "r1")
    detector.observe("router-a", router.view())
    assert detector.check() == []
    clock.advance(1.2)
    router.stall_acted_on("w1")  # the router aborted the stream (to migrate it) before we looked
    router.finished("w1", "r1")
    detector.observe("router-a", router.view())
    (sig,) = detector.check()
    assert sig.severity is Severity.SUSPECT and "moved its streams away" in sig.reason
    detector.observe("router-a", router.view())
    assert detector.check()[0].severity is Severity.OK, "one report per stall; a canary decides the rest"
