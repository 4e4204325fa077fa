"""The health state machine, driven directly with a manual clock: every transition, no sleeping."""

from __future__ import annotations

from typing import Any

import pytest

from fleetward.fleet.clock import ManualClock
from fleetward.fleet.worker import HealthState as S
from fleetward.supervisor.health import (
    ActionDone,
    AgentAction,
    CanaryDone,
    Deregistered,
    DrainRequested,
    HealthMachine,
    HealthPolicy,
    LiftQuarantine,
    Load,
    MoveStreams,
    Publish,
    Quarantine,
    QuarantineCleared,
    Registered,
    RestartRequested,
    RunCanary,
    SetHealth,
    SignalSeen,
    Tick,
    Undrain,
)
from fleetward.supervisor.signals import Severity, Signal


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def machine(clock: ManualClock) -> HealthMachine:
    return HealthMachine(HealthPolicy(restart_budget=2, restart_window_s=100, suspect_timeout_s=10), clock=clock)


def ready(m: HealthMachine, worker: str = "w", gpus: tuple[int, ...] = ()) -> None:
    m.observe(Registered(worker, "n1", gpus))
    m.observe(CanaryDone(worker, ok=True))
    assert m.workers[worker].state is S.READY


def states(actions: list[Any]) -> list[S]:
    return [a.record.state for a in actions if isinstance(a, SetHealth)]


def of(actions: list[Any], kind: type) -> list[Any]:
    return [a for a in actions if isinstance(a, kind)]


def sig(detector: str, severity: Severity, worker: str = "w", **extra: Any) -> SignalSeen:
    return SignalSeen(Signal(worker, detector, severity, f"{detector} says {severity}", 0.0, extra))


def test_a_registered_worker_is_ready_only_after_a_canary(machine: HealthMachine) -> None:
    out = machine.observe(Registered("w", "n1"))
    assert states(out) == [S.STARTING] and of(out, RunCanary) == [RunCanary("w", urgent=True)]
    out = machine.observe(CanaryDone("w", ok=True))
    assert states(out) == [S.READY]


def test_a_stall_is_suspect_until_a_canary_confirms_the_hang(machine: HealthMachine) -> None:
    ready(machine)
    out = machine.observe(sig("stream-progress", Severity.SUSPECT))
    assert states(out) == [S.SUSPECT] and of(out, RunCanary)
    out = machine.observe(CanaryDone("w", ok=False, reason="no answer within 1.00s", silent=True))
    assert states(out) == [S.UNHEALTHY, S.RESTARTING]
    hang = [p for p in of(out, Publish) if p.kind == "hang.detected"]
    assert hang and hang[0].data["detector"] == "stream-progress+canary"
    (restart,) = of(out, AgentAction)
    assert (restart.kind, restart.action_id, restart.delay_s) == ("restart", "w.restart.1", 0.0)


def test_a_busy_worker_that_still_emits_tokens_is_not_declared_hung(machine: HealthMachine) -> None:
    ready(machine)
    machine.observe(sig("stream-progress", Severity.SUSPECT))
    out = machine.observe(CanaryDone("w", ok=False, reason="queued behind others", silent=False))
    assert states(out) == [] and of(out, RunCanary), "inconclusive: ask again"
    machine.observe(sig("stream-progress", Severity.OK))
    machine.observe(CanaryDone("w", ok=True))
    out = machine.observe(CanaryDone("w", ok=True))
    assert states(out) == [S.READY]


def test_a_canary_that_waited_behind_the_engines_work_is_no_evidence(machine: HealthMachine) -> None:
    """Unanswered in time while the worker's own counters moved (long steps of clients the routers do not see):
    a ready worker stays ready, a starting one is not counted down, a suspect one is asked again; a canary
    unanswered while they stood still still confirms a hang, and the verdict says what stood still."""
    busy = CanaryDone("w", ok=False, reason="no answer within 2.00s", busy=True,
                      evidence="its engine computed 3000 token(s) in the last 2.1s (2 request(s) running, 1 waiting)")
    machine.observe(Registered("w", "n1"))
    for _ in range(10):
        assert of(machine.observe(busy), RunCanary) and machine.workers["w"].state is S.STARTING
    machine.observe(CanaryDone("w", ok=True))
    assert machine.observe(busy) == [], "ready, and stays so"
    machine.observe(sig("metrics", Severity.SUSPECT))
    out = machine.observe(busy)
    assert states(out) == [] and of(out, RunCanary) and not of(out, AgentAction), "ask again, decide nothing"
    still = CanaryDone("w", ok=False, reason="no answer within 4.00s",
                       evidence="its token counters stood still for 4.2s (2 request(s) running, 1 waiting)")
    out = machine.observe(still)
    assert states(out) == [S.UNHEALTHY, S.RESTARTING]
    (hang,) = [p for p in of(out, Publish) if p.kind == "hang.detected"]
    assert hang.data["detector"] == "metrics+canary" and "stood still for 4.2s" in hang.data["reason"]


def test_a_worker_the_controller_cannot_reach_is_never_declared_dead_by_a_canary(machine: HealthMachine) -> None:
    """No TCP handshake (a partition between the controller and the worker) says nothing of the worker: not even
    with the routers' silence (they may be cut off too), and not from ready; its lease decides."""
    ready(machine)
    unreachable = CanaryDone("w", ok=False, reason="no TCP connection within 1.00s", silent=None, unreachable=True)
    assert machine.observe(unreachable) == [], "a routine canary that could not connect changes nothing"
    machine.observe(sig("stream-progress", Severity.SUSPECT))
    out = machine.observe(CanaryDone("w", ok=False, reason="no TCP connection within 1.00s", silent=True,
                                     unreachable=True))
    assert states(out) == [] and of(out, RunCanary) and not of(out, AgentAction), "ask again, decide nothing"
    out = machine.observe(CanaryDone("w", ok=False, reason="no answer within 1.00s", silent=True))
    assert states(out) == [S.UNHEALTHY, S.RESTARTING], "a worker that accepts and does not answer is hung"


def test_a_canary_the_controllers_late_loop_spoilt_decides_nothing(machine: HealthMachine) -> None:
    """A timeout that fired late because the controller itself was starved measures the controller."""
    ready(machine)
    late = CanaryDone("w", ok=False, reason="no answer within 1.00s, but the controller's own loop ran 6.00s late",
                      silent=None, inconclusive=True)
    assert machine.observe(late) == [], "a routine canary the controller spoilt changes nothing"
    machine.observe(sig("stream-progress", Severity.SUSPECT))
    out = machine.observe(CanaryDone("w", ok=False, reason=late.reason, silent=True, inconclusive=True))
    assert states(out) == [] and of(out, RunCanary) and not of(out, AgentAction), "ask again, decide nothing"
    out = machine.observe(CanaryDone("w", ok=False, reason="no answer within 1.00s", silent=True))
    assert states(out) == [S.UNHEALTHY, S.RESTARTING], "a canary measured in time still decides"


def test_leaving_suspect_takes_several_good_canaries_and_no_active_suspicion(machine: HealthMachine) -> None:
    ready(machine)
    machine.observe(sig("metrics", Severity.SUSPECT))
    assert states(machine.observe(CanaryDone("w", ok=True))) == []
    assert states(machine.observe(CanaryDone("w", ok=True))) == [], "metrics still suspect"
    machine.observe(sig("metrics", Severity.OK))
    machine.observe(CanaryDone("w", ok=True))
    assert machine.workers["w"].state is S.READY


def test_unresolved_suspicion_becomes_unhealthy_but_a_slow_gpu_is_never_restarted(
        machine: HealthMachine, clock: ManualClock) -> None:
    ready(machine, "slow")
    machine.observe(sig("gpu", Severity.DEGRADED, worker="slow"))
    clock.advance(1000)
    assert machine.observe(Tick()) == [] and machine.workers["slow"].state is S.SUSPECT
    ready(machine)
    machine.observe(sig("metrics", Severity.SUSPECT))
    clock.advance(9)
    assert states(machine.observe(Tick())) == []
    clock.advance(2)
    assert states(machine.observe(Tick()))[0] is S.UNHEALTHY


def test_a_fatal_signal_restarts_at_once_and_a_crash_loop_quarantines(machine: HealthMachine,
                                                                     clock: ManualClock) -> None:
    ready(machine, gpus=(3,))
    delays = []
    for n in (1, 2):
        out = machine.observe(sig("process", Severity.FATAL))
        assert states(out) == [S.UNHEALTHY, S.RESTARTING]
        (action,) = of(out, AgentAction)
        assert action.action_id == f"w.restart.{n}"
        delays.append(action.delay_s)
        machine.observe(ActionDone("w", action.action_id, "restart", ok=True))
        ready(machine, gpus=(3,))
        clock.advance(1)
    assert delays[0] == 0 and delays[1] > 0, "exponential backoff after the first restart"
    out = machine.observe(sig("process", Severity.FATAL))
    assert states(out) == [S.UNHEALTHY, S.QUARANTINED]
    (q,) = of(out, Quarantine)
    assert q.gpus == (3,) and "crash loop" in q.reason
    assert [p.kind for p in of(out, Publish)] == ["quarantine"]
    assert [a.kind for a in of(out, AgentAction)] == ["stop"]


def test_restarts_outside_the_window_do_not_count(machine: HealthMachine, clock: ManualClock) -> None:
    ready(machine)
    for _ in range(4):
        out = machine.observe(sig("process", Severity.FATAL))
        assert S.RESTARTING in states(out)
        (action,) = of(out, AgentAction)
        machine.observe(ActionDone("w", action.action_id, "restart", ok=True))
        ready(machine)
        clock.advance(101)


def test_a_gpu_that_must_be_retired_is_quarantined_then_tested_before_it_returns(machine: HealthMachine) -> None:
    ready(machine, gpus=(0,))
    out = machine.observe(sig("gpu", Severity.FATAL, action="quarantine"))
    assert states(out) == [S.QUARANTINED] and of(out, Quarantine)
    assert machine.observe(Registered("w", "n1", (0,))) == [], "a quarantined worker stays out"
    out = machine.observe(QuarantineCleared("w"))
    (selftest,) = of(out, AgentAction)
    assert selftest.kind == "selftest"
    out = machine.observe(ActionDone("w", selftest.action_id, "selftest", ok=False, reason="3 wrong entries"))
    assert states(out) == [S.QUARANTINED] and "self-test failed" in machine.workers["w"].reason
    assert not of(out, LiftQuarantine), "a GPU that failed its self-test stays quarantined"
    out = machine.observe(QuarantineCleared("w"))
    (selftest,) = of(out, AgentAction)
    out = machine.observe(ActionDone("w", selftest.action_id, "selftest", ok=True))
    assert states(out) == [S.RESTARTING] and of(out, AgentAction)[0].kind == "restart"
    assert of(out, LiftQuarantine) == [LiftQuarantine("w", "n1", (0,))]


def test_wrong_tokens_make_a_worker_unhealthy_at_once(machine: HealthMachine) -> None:
    ready(machine)
    out = machine.observe(CanaryDone("w", ok=False, reason="wrong tokens", wrong_tokens=True))
    assert states(out) == [S.UNHEALTHY, S.RESTARTING]


def test_a_worker_that_never_passes_a_canary_is_unhealthy(machine: HealthMachine) -> None:
    machine.observe(Registered("w", "n1"))
    for _ in range(4):
        assert states(machine.observe(CanaryDone("w", ok=False, reason="500"))) == []
    assert states(machine.observe(CanaryDone("w", ok=False, reason="500")))[0] is S.UNHEALTHY


def test_a_backend_that_fails_to_start_is_dead_with_the_reason(machine: HealthMachine) -> None:
    out = machine.observe(sig("start", Severity.FATAL, action="dead"))
    assert states(out) == [S.DEAD]
    assert not of(out, AgentAction), "restarting would fail the same way"


def test_a_drain_cordons_by_default_and_undrain_takes_it_back(machine: HealthMachine) -> None:
    """`fleetward drain` without --then: no new work, streams finish, and the worker stays up, out of
    routing, until undrained; nothing is stopped. A crash meanwhile restarts it, still cordoned."""
    ready(machine)
    machine.observe(Load("w", 2))
    assert states(machine.observe(DrainRequested("w", deadline_s=30))) == [S.DRAINING]
    out = machine.observe(Load("w", 0))
    assert states(out) == [S.DRAINING] and "cordoned" in machine.workers["w"].reason
    assert not of(out, AgentAction), "a cordon stops nothing"
    assert machine.observe(Load("w", 0)) == [], "cordoned once"
    assert machine.admit(DrainRequested("w")) == "it is cordoned already (`fleetward undrain` takes it back)"
    assert machine.admit(DrainRequested("w", then="stop")) is None, "a cordoned worker may still be stopped"
    out = machine.observe(sig("process", Severity.FATAL))
    (restart,) = of(out, AgentAction)
    machine.observe(ActionDone("w", restart.action_id, "restart", ok=True))
    assert states(machine.observe(Registered("w", "n1", pid=7))) == [S.DRAINING], "restarted, still cordoned"
    out = machine.observe(Undrain("w"))
    assert states(out) == [S.STARTING] and of(out, RunCanary)
    assert states(machine.observe(CanaryDone("w", ok=True))) == [S.READY]


def test_commands_that_cannot_apply_say_why(machine: HealthMachine) -> None:
    ready(machine)
    assert machine.admit(Undrain("w")) == "it is not drained: it is ready"
    assert machine.admit(QuarantineCleared("w")) == "it is not quarantined: it is ready"
    assert machine.admit(RestartRequested("w")) is None
    machine.observe(RestartRequested("w"))
    assert machine.admit(RestartRequested("w")).startswith("it is being restarted already")  # type: ignore[union-attr]
    assert machine.admit(DrainRequested("w")).startswith("a restart is under way")  # type: ignore[union-attr]


@pytest.mark.parametrize("command", [Undrain, RestartRequested])
def test_undrain_or_restart_starts_a_stopped_worker_again(machine: HealthMachine, command: type) -> None:
    """What an operator means by undrain or restart of a worker a drain stopped: bring it back."""
    ready(machine)
    (stop,) = of(machine.observe(DrainRequested("w", deadline_s=30, then="stop")), AgentAction)
    machine.observe(ActionDone("w", stop.action_id, "stop", ok=True))
    assert machine.workers["w"].state is S.DEAD
    assert machine.admit(command("w")) is None
    out = machine.observe(command("w"))
    assert states(out) == [S.RESTARTING] and [a.kind for a in of(out, AgentAction)] == ["restart"]
    out = machine.observe(Registered("w", "n1", pid=8))
    assert states(out) == [S.STARTING] and of(out, RunCanary)


def test_a_drain_then_stop_waits_for_streams_then_stops(machine: HealthMachine) -> None:
    ready(machine)
    machine.observe(Load("w", 3))
    out = machine.observe(DrainRequested("w", deadline_s=30, then="stop"))
    assert states(out) == [S.DRAINING] and not of(out, AgentAction)
    assert machine.observe(Load("w", 1)) == []
    (stop,) = of(machine.observe(Load("w", 0)), AgentAction)
    assert stop.kind == "stop"
    assert states(machine.observe(ActionDone("w", stop.action_id, "stop", ok=True))) == [S.DEAD]
    assert machine.observe(Deregistered("w")) == []


def test_a_drain_past_its_deadline_moves_what_is_left_with_its_kv_then_migrates_the_rest(
        machine: HealthMachine, clock: ManualClock) -> None:
    ready(machine)
    machine.observe(Load("w", 2))
    machine.observe(DrainRequested("w", deadline_s=5, then="restart"))
    clock.advance(6)
    out = machine.observe(Tick())
    assert of(out, MoveStreams) == [MoveStreams("w", "drain")], "the routers move its streams with their KV"
    assert states(out) == [S.DRAINING] and not of(out, AgentAction), "still serving them while they move"
    assert of(out, SetHealth)[0].record.extra["drain"]["moving_until"] == clock.wall() + machine.policy.drain_move_s
    clock.advance(machine.policy.drain_move_s / 2)
    assert machine.observe(Tick()) == []
    clock.advance(machine.policy.drain_move_s)
    out = machine.observe(Tick())
    assert states(out) == [S.UNHEALTHY, S.RESTARTING], "what did not move: unhealthy first, routers migrate it"
    assert of(out, AgentAction)[0].kind == "restart"


def test_a_drain_whose_streams_all_moved_ends_at_once_and_an_autoscalers_is_a_scale_down(
        machine: HealthMachine, clock: ManualClock) -> None:
    ready(machine)
    machine.observe(Load("w", 3))
    machine.observe(DrainRequested("w", deadline_s=1, then="stop", by="autoscaler"))
    clock.advance(2)
    assert of(machine.observe(Tick()), MoveStreams) == [MoveStreams("w", "scale-down")]
    out = machine.observe(Load("w", 0))
    assert of(out, AgentAction)[0].kind == "stop" and S.UNHEALTHY not in states(out), "moved: stopped, not failed"


def test_with_drain_move_s_0_a_drain_past_its_deadline_migrates_at_once(clock: ManualClock) -> None:
    machine = HealthMachine(HealthPolicy(drain_move_s=0), clock=clock)
    ready(machine)
    machine.observe(Load("w", 2))
    machine.observe(DrainRequested("w", deadline_s=5, then="restart"))
    clock.advance(6)
    out = machine.observe(Tick())
    assert states(out) == [S.UNHEALTHY, S.RESTARTING] and not of(out, MoveStreams)


def test_a_new_leader_replays_into_the_same_actions(clock: ManualClock) -> None:
    """Deterministic action ids: what an old leader wrote and a new one re-derives is the same key."""
    first = HealthMachine(HealthPolicy(), clock=clock)
    ready(first)
    out = first.observe(sig("process", Severity.FATAL))
    record = of(out, SetHealth)[0].record  # the leader dies after persisting `unhealthy`, before acting
    second = HealthMachine(HealthPolicy(), clock=clock)
    second.load("w", record)
    replay = second.observe(sig("process", Severity.FATAL))
    assert [a.action_id for a in of(replay, AgentAction)] == [a.action_id for a in of(out, AgentAction)]
    persisted = of(out, SetHealth)[-1].record  # ...or after persisting `restarting` with the pending action
    third = HealthMachine(HealthPolicy(), clock=clock)
    third.load("w", persisted)
    assert third.observe(sig("process", Severity.FATAL)) == [], "the pending restart is not issued again"


def test_a_new_leader_confirms_or_clears_a_suspicion_its_predecessor_left(clock: ManualClock) -> None:
    """A leader cut off after a worker turned suspect: its successor's detectors start from nothing (the routers'
    streams have moved away), so it sends the canary that decides, instead of waiting for the suspect timeout."""
    first = HealthMachine(HealthPolicy(), clock=clock)
    ready(first)
    out = first.observe(sig("stream-progress", Severity.SUSPECT))
    second = HealthMachine(HealthPolicy(), clock=clock)
    second.load("w", of(out, SetHealth)[-1].record)
    assert second.workers["w"].state is S.SUSPECT
    (canary,) = of(second.observe(Registered("w", "n1")), RunCanary)
    assert canary.urgent
    out = second.observe(CanaryDone("w", ok=False, reason="no answer within 1.00s", silent=None))
    assert states(out) == [S.UNHEALTHY, S.RESTARTING]
    ready(second, "v")
    assert second.observe(Registered("v", "n1")) == [], "a ready worker's lease renewal changes nothing"


def test_a_registration_read_again_while_its_restart_is_pending_changes_nothing(clock: ManualClock) -> None:
    """A new leader (or an agent renewing a lost lease) reads the registration of the process that a pending
    restart is replacing. That is not the fresh process: the restart stays pending, no canary goes to a
    process on its way out. Taken for a fresh one, the canaries fail against the restart, which restarts
    the worker again, and again (a vLLM worker restarting on a starved CPU never came back)."""
    first = HealthMachine(HealthPolicy(), clock=clock)
    first.observe(Registered("w", "n1", pid=100))
    first.observe(CanaryDone("w", ok=True))
    out = first.observe(sig("process", Severity.FATAL))
    (restart,) = of(out, AgentAction)
    takeover = HealthMachine(HealthPolicy(), clock=clock)
    takeover.load("w", of(out, SetHealth)[-1].record)
    assert takeover.observe(Registered("w", "n1", pid=100)) == []
    assert takeover.workers["w"].pending == restart.action_id
    out = takeover.observe(Registered("w", "n1", pid=200))
    assert states(out) == [S.STARTING] and of(out, RunCanary) == [RunCanary("w", urgent=True)]
    assert takeover.workers["w"].pending is None
