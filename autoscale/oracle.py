"""The SLA-aware oracle: with the whole trace known, the fewest workers that keep the SLA, found in the simulator.

An oracle is the best any policy could do, so it cannot plan by a capacity rule: a rule on the mean rate
misses bursts inside an interval, long prompts and a backlog carried over. It searches instead, in the same
simulator every policy runs in (:class:`~.simulate.FleetSim`), interval by interval:

1. **Search.** From the fleet's state at the start of interval *k* (what runs where, what waits at the
   router), for a candidate number of serving workers *n*: copy the state (:meth:`FleetSim.clone`), make the
   fleet *n* workers at once, run the interval and ``tail_s`` more of the trace, and judge the requests of the
   interval and those carried into it (:meth:`FleetSim.met_so_far`: finished within the SLA, or on the way to
   it). *n_k* is the smallest *n* whose share is at least ``target`` (the SLA's 99 %); where even
   ``max_workers`` falls short, the smallest *n* that does as well as ``max_workers``. The search gallops from
   *n_(k-1)* and bisects, so it tries a few candidates per interval. Then the fleet moves on through interval
   *k* with *n_k* workers, and *k+1* is searched from there.
2. **Schedule.** Workers take ``startup_s`` to serve. The oracle knows the future, so at each planning time it
   asks for the most any interval within the start-up lead needs: ``desired_k = max(n_k, ..., n_(k+L))`` with
   ``L = ceil(startup_s / interval_s)``; the run starts with ``desired_0`` workers.
3. **Run.** The schedule is replayed as a policy (:class:`OracleSchedule`) like every other one: its SLA
   attainment and worker-hours are measured, not assumed.

The search is greedy (interval by interval, each as cheap as it can be), so it is an upper bound on the true
minimum; the schedule's maximum over the lead only adds workers, so the run meets the SLA at least where the
search did. What it does not do: trade a missed interval for cheaper ones elsewhere (it keeps ``target`` in
every interval, a stricter goal than the trace's overall share).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fleetward.autoscale.capacity import Sla
from fleetward.autoscale.planner import Decision, Observation, check_bounds
from fleetward.autoscale.simulate import DEFAULT_WORKER, FleetSim
from fleetward.autoscale.traces import TraceRequest
from fleetward.fleet.config import SimConfig

__all__ = ["OracleSchedule", "SearchResult", "search"]


@dataclass(frozen=True)
class SearchResult:
    needed: list[int]  # n_k: serving workers interval k needs
    desired: list[int]  # the schedule: what to ask for at the start of interval k (start-up lead respected)
    trials: int  # simulated futures tried


class OracleSchedule:
    """Replays a searched schedule: at the planning time that starts interval *k*, ``desired[k]``."""

    name = "oracle"

    def __init__(self, schedule: SearchResult, interval_s: float) -> None:
        self.schedule, self.interval_s = schedule, interval_s

    def decide(self, obs: Observation) -> Decision:
        k = min(round(obs.now / self.interval_s), len(self.schedule.desired) - 1)
        want = self.schedule.desired[k]
        return Decision(want, f"searched: interval {k} needs {self.schedule.needed[k]}, {want} with the start-up lead")


def search(requests: Sequence[TraceRequest], *, sla: Sla, startup_s: float, interval_s: float,
           config: SimConfig = DEFAULT_WORKER, min_workers: int = 1, max_workers: int = 64, target: float = 0.99,
           tail_s: float | None = None, drain_deadline_s: float = 300.0,
           on_progress: Callable[[float], None] | None = None) -> SearchResult:
    """The oracle's schedule for ``requests`` (module docstring)."""
    check_bounds(min_workers, max_workers)
    tail = interval_s / 2 if tail_s is None else tail_s
    main = FleetSim(requests, sla=sla, startup_s=0.0, config=config, interval_s=interval_s,
                    initial_workers=max(1, min_workers), drain_deadline_s=drain_deadline_s)
    needed: list[int] = []
    trials = 0
    n = max(1, min_workers)
    k = 0
    while not main.done:
        start, end = k * interval_s, (k + 1) * interval_s
        cache: dict[int, float] = {}

        def share(m: int, start: float = start, end: float = end, cache: dict[int, float] = cache) -> float:
            nonlocal trials
            if m not in cache:
                trials += 1
                trial = main.clone()
                trial.actuate(start, m)
                trial.run(None, until=end + tail)
                judged = trial.carried + [r for r in trial.reqs if r.arrival < end]
                cache[m] = sum(trial.met_so_far(r) for r in judged) / len(judged) if judged else 1.0
            return cache[m]

        n = _smallest(share, n, max(min_workers, 0), max_workers, target)
        needed.append(n)
        main.actuate(start, n)
        main.run(None, until=end)
        k += 1
        if on_progress is not None:
            on_progress(min(end, requests[-1].arrival_s if requests else 0.0))
    lead = math.ceil(startup_s / interval_s)
    desired = [max(needed[k:k + lead + 1]) for k in range(len(needed))]
    return SearchResult(needed, desired, trials)


def _smallest(share: Callable[[int], float], guess: int, lo: int, hi: int, target: float) -> int:
    """The smallest n in [lo, hi] with share(n) >= target (share rising with n), starting near ``guess``;
    where share(hi) < target, the smallest n with share(n) >= share(hi)."""
    guess = max(lo, min(hi, guess))
    if share(guess) >= target:
        good, step = guess, 1  # gallop down to a failing n
        bad = lo - 1
        while good - step >= lo:
            if share(good - step) >= target:
                good -= step
                step *= 2
            else:
                bad = good - step
                break
    else:
        bad, step = guess, 1  # gallop up to a passing n
        good = hi + 1
        while bad + step <= hi:
            if share(bad + step) >= target:
                good = bad + step
                break
            bad += step
            step *= 2
        if good > hi:
            if bad < hi and share(hi) >= target:
                good = hi
            else:
                best = share(hi)
                return _smallest(share, guess, lo, hi, best - 1e-9) if best > 0 else hi
    while good - bad > 1:  # bisect between a failing and a passing n
        mid = (good + bad) // 2
        if share(mid) >= target:
            good = mid
        else:
            bad = mid
    return max(lo, good)
