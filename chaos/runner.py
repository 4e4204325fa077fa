"""The experiment runner: bring up (or attach to) a fleet, check, break, check again, judge.

One run, in order (Chaos Toolkit's life of an experiment, with a workload and timed faults):

1. the fleet: its own etcd (1 or 3 members) and MQTT broker unless given, then a
   :class:`~fleetward.chaos.harness.TestFleet` (real workers under a real node agent, router processes);
   or, with ``attach``, the local fleet that ``fleetward up`` runs (``.fleetward/<cluster>/fleet.json``);
2. every MQTT event of the cluster is recorded into the history from here on;
3. the steady-state hypothesis is checked (*before*); if it does not hold, the method is skipped and the
   run ``failed``;
4. the method: the workload runs open-loop while each scheduled fault is driven through
   inject → verify → hold → recover → verify recovered, every step a ``fault`` record (and
   ``fault.start`` / ``fault.stop`` events on the bus). Targets are resolved inside the experiment's blast
   radius, and before each injection the safety rule is checked again against them; a breach aborts the
   method (faults in effect are recovered). So does the fleet seen with more workers out of service than
   the radius's ``max_capacity_share`` (:mod:`.radius`), whatever the cause;
5. the steady-state hypothesis again (*after*): if it does not hold, the run ``deviated``;
6. the rollbacks; then, for greedy vLLM, a fault-free reference run of every request the clients made;
7. the checkers, on the history; then ``journal.json`` and ``report.html``.

The run folder holds ``journal.json``, ``history.jsonl``, ``report.html``, ``reference.jsonl`` (when
recorded) and ``logs/``. :func:`~fleetward.chaos.judge.check_run` re-runs the checkers on a saved folder.
The exit code is 1 when the run did not complete, the hypothesis deviated or a checker failed; else 0. A
run that cannot begin because its input is wrong (the experiment, or a fleet that is not the declared one:
other workers, fewer routers, no running fleet to attach to; faults for a fleet the run did not start without
``live_fleet``, a declared blast radius and the fleet's admin token) raises
:class:`~fleetward.fleet.errors.ConfigError` instead, and leaves no run folder: nothing is injected.

The stages live in their own modules: the fleet (:mod:`.provision`), targets (:mod:`.targets`), probes
(:mod:`.probes`), rollbacks (:mod:`.rollbacks`) and judging (:mod:`.judge`); this module drives them.

One module (over 600 lines) because driving a fault shares the run's live state (history, activities
in effect, the safety share) with the rest of the orchestration.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import platform
import random
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from fleetward.chaos.catalogue import counts_toward_share, default_target, fault_catalogue
from fleetward.chaos.experiment import Activity, Experiment, Probe
from fleetward.chaos.fault import Fault, FaultSpec, Target
from fleetward.chaos.harness import FleetContext, TestFleet
from fleetward.chaos.history import History, read_history
from fleetward.chaos.hostnet import HostNetwork
from fleetward.chaos.judge import RunResult, check_run, finish_journal, judge
from fleetward.chaos.probes import PROBES, ProbeContext
from fleetward.chaos.provision import (
    HostsContext,
    Provisioned,
    attached_fleet,
    given_fleet,
    hosts_fleet,
    own_fleet,
    worker_backend,
)
from fleetward.chaos.radius import capacity_breach, live_fleet_refusal, out_of_service
from fleetward.chaos.reference import record_reference
from fleetward.chaos.resources import ResourceSampler, existing, left_over, sample
from fleetward.chaos.rollbacks import ROLLBACKS, RollbackContext
from fleetward.chaos.targets import TargetError, resolve
from fleetward.chaos.validation import load_experiment, validate_experiment
from fleetward.chaos.workload import Workload
from fleetward.chaos.writes import record_writes
from fleetward.fleet.errors import ConfigError, FleetwardError
from fleetward.fleet.handle import Fleet
from fleetward.fleet.registry import read_fleet
from fleetward.fleet.state import read_admin_token, read_state, state_path

__all__ = ["RunOptions", "RunResult", "Runner", "check_run", "experiment_of", "run_experiment"]

log = logging.getLogger(__name__)

T = TypeVar("T")
CAPACITY_LOOK_S = 0.2  # how often the method looks at the fleet's capacity against the blast radius
Progress = Callable[[str, str], None]  # (kind, text): phase, activity, note


class SafetyAbort(FleetwardError):
    """A fault would breach the safety rule: the method stops."""


class Stopped(FleetwardError):
    """The operator stopped the run before its method began."""


@dataclass
class RunOptions:
    out: Path | None = None  # the run folder (default runs/chaos/<time>-<title>)
    attach: bool = False  # use the running local fleet instead of bringing one up
    live_fleet: bool = False  # with attach: the operator confirms faults may be injected into it
    cluster: str | None = None  # with attach: which local fleet
    run_dir: Path = Path(".fleetward")  # with attach: where `fleetward up` keeps its state
    etcd: str | None = None  # bring the fleet up on this etcd (host:port) instead of starting one
    mqtt: str | None = None  # ... and this broker
    base: Path | None = None  # where relative paths in the experiment are resolved (trace files)
    progress: Progress | None = None
    stop: asyncio.Event | None = None  # set it to interrupt the run (faults are recovered, rollbacks run)
    services: Mapping[str, Any] = field(default_factory=dict)  # extra collaborators for faults
    report: bool = True
    # A running TestFleet to use as it is (neither started nor stopped here; missing routers are started for
    # the run and stopped after it): e.g. a test session's vLLM workers, which take a minute to start.
    fleet: TestFleet | None = None
    # The hosts of a fleet of several hosts (``fleet.hosts``), made and entered before the event loop started:
    # `fleetward chaos run` does it (:func:`fleetward.chaos.cli.main`).
    network: HostNetwork | None = None


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat()


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40] or "experiment"


# -- the fault context --------------------------------------------------------------------------------------


class _Context:
    """:class:`~fleetward.chaos.fault.FaultContext` for one activity: targets resolved once, up front."""

    def __init__(self, runner: Runner, target: Target, ids: list[str]) -> None:
        self._runner = runner
        self._target = target
        self._ids = ids

    @property
    def fleet(self) -> Fleet:
        return self._runner.fleet

    def resolve(self, target: Target) -> list[str]:
        if target == self._target:
            return list(self._ids)
        try:
            return self._runner.resolve(target, rng=random.Random(f"{self._runner.exp.seed}:{target}"))
        except SafetyAbort as exc:
            raise TargetError(str(exc)) from None

    def record(self, kind: str, **data: Any) -> None:
        self._runner.history.add(kind, **data)

    def service(self, name: str) -> Any:
        return self._runner.service(name)


# -- the runner ---------------------------------------------------------------------------------------------


class Runner:
    def __init__(self, exp: Experiment, options: RunOptions | None = None) -> None:
        self.exp = exp
        self.opts = options or RunOptions()
        self.names = exp.activity_names()
        self.catalogue, _ = fault_catalogue()
        self.fleet: Fleet
        self.services: dict[str, Any] = {}
        self.history: History
        self.workload: Workload | None = None
        self.phase = "starting"
        self.active: dict[str, tuple[str, list[str]]] = {}  # activity -> (kind, ids), for the safety share
        self.in_effect: set[str] = set()  # every activity between its start and its stop (for displays)
        self.activities: list[dict[str, Any]] = []
        self.supervised: bool | None = None
        self.method_started: float | None = None
        self.fleet_ctx: FleetContext | HostsContext | None = None  # the fleet's fault context (proxies, etcd, ...)
        self._declared: dict[str, list[str]] = {}

    def _say(self, kind: str, text: str) -> None:
        log.info("%s: %s", kind, text)
        if self.opts.progress is not None:
            self.opts.progress(kind, text)

    def snapshot(self) -> dict[str, Any]:
        """Live progress for displays."""
        w = self.workload
        out: dict[str, Any] = {"phase": self.phase, "active": sorted(self.in_effect)}
        if w is not None and self.method_started is not None:
            out.update(elapsed=w.elapsed(), duration=self.exp.workload.duration_s, sent=w.sent, ok=w.ok,
                       failed=w.failed, cancelled=w.cancelled, in_flight=len(w.live), tokens=w.tokens,
                       tokens_per_s=w.throughput())
        return out

    # -- the whole run ----------------------------------------------------------------------------------

    def preflight(self) -> None:
        """Refuse, before anything starts, what this run may not do: root-only faults without root, faults for a
        fleet the run did not start without the operator's consent (:func:`~.radius.live_fleet_refusal`)."""
        self._refuse_root_faults()
        if self.opts.attach:
            path = state_path(self.opts.run_dir, self.opts.cluster or self.exp.fleet.cluster or "local")
            state = read_state(path, hint=" (or run without --attach)", field="attach")
            refusal = live_fleet_refusal(self.exp, fleet=f"the fleet of cluster {state.get('cluster', '?')} ({path})",
                                         confirmed=self.opts.live_fleet, token=read_admin_token(state, path))
            if refusal is not None:
                raise refusal

    async def run(self) -> RunResult:
        exp = self.exp
        self.preflight()
        run_dir = self._run_dir()
        self.history = History(run_dir / "history.jsonl")
        started = time.time()
        journal: dict[str, Any] = {
            "fleetward-version": _version(), "platform": platform.platform(), "node": platform.node(),
            "experiment": exp.to_json(), "start": _iso(started), "status": "failed", "deviated": False,
            "blast_radius": {"declared": exp.blast_radius is not None, **exp.radius().model_dump(mode="json")},
            "steady_states": {"before": None, "after": None}, "run": self.activities, "rollbacks": [],
        }
        reason = ""
        ran = False  # the steady-state hypothesis was checked: from here on, a run with a journal
        started_with = existing()  # processes that are not the run's (a test session's etcd, ...)
        self._say("phase", f"run folder {run_dir}")
        try:
            async with self._fleet(run_dir) as provisioned:
                self.fleet = fleet = provisioned.fleet
                self.fleet_ctx, self.supervised = provisioned.context, provisioned.supervised
                self._declared = provisioned.declared
                if provisioned.experiment is not None:  # renamed for the attached fleet: what runs
                    self.exp = exp = provisioned.experiment
                    journal["experiment"] = exp.to_json()
                journal["fleet"] = await self._describe_fleet()
                async with self._recording(), Workload(
                        exp.workload, seed=exp.seed, recorder=self.history, routers=self._router_urls(),
                        model=journal["fleet"]["model"], max_model_len=exp.fleet.max_model_len,
                        base=self.opts.base) as workload:
                    self.workload = workload
                    self.services.update(workload=workload, history=self.history, bus=fleet.bus)
                    self.services.update(self.opts.services)
                    ran = True
                    sampler = ResourceSampler(self.history)
                    async with _background(sampler.run()):
                        before = await self._hypothesis("before")
                        journal["steady_states"]["before"] = before
                        if not before["steady_state_met"]:
                            reason = "the steady-state hypothesis did not hold before the method"
                            status = "failed"
                        else:
                            status, reason = await self._method()
                            if status != "interrupted":
                                after = await self._hypothesis("after")
                                journal["steady_states"]["after"] = after
                                journal["deviated"] = not after["steady_state_met"]
                        journal["rollbacks"] = await self._rollbacks()
                    sampler.record("end")  # the fleet at rest, as the rollbacks left it
                    journal["status"] = status
                    journal["workload"] = {"planned": len(workload.plan), "sent": workload.sent, "ok": workload.ok,
                                           "failed": workload.failed, "cancelled": workload.cancelled,
                                           "shed": workload.shed, "tokens": workload.tokens,
                                           "by_source": dict(workload.by_source)}
                    journal["reference"] = await self._reference(run_dir)
            await self._left_over(started_with)
        except Stopped as exc:
            journal["status"], reason = "interrupted", str(exc)
            self.history.add("note", text=reason)
            journal.setdefault("reference", {"kind": "none", "reason": "the run was stopped"})
        except (FleetwardError, OSError, httpx.HTTPError) as exc:
            if isinstance(exc, ConfigError) and not ran:  # not the fleet declared: nothing ran, nothing to judge
                self.history.close()
                _discard(run_dir)
                raise
            journal["status"] = "failed"
            reason = reason or f"{type(exc).__name__}: {exc}"
            log.error("run failed: %s", reason)
            self.history.add("note", text=f"run failed: {reason}")
            journal.setdefault("reference", {"kind": "none", "reason": "the run failed"})
        finally:
            self.history.close()
        journal["reason"] = reason
        journal.setdefault("fleet", {})
        journal["context"] = {"migration_limit": exp.fleet.routing.migration_limit, "supervisor": self.supervised,
                              "backend": exp.fleet.backend}
        end = time.time()
        journal.update(end=_iso(end), duration=round(end - started, 3))
        self._say("phase", "checking the history")
        records = list(read_history(run_dir / "history.jsonl"))
        verdicts = judge(journal, records, run_dir)
        finish_journal(journal, verdicts)
        (run_dir / "journal.json").write_text(json.dumps(journal, indent=2, default=str) + "\n")
        if self.opts.report:
            from fleetward.chaos.report import write_report

            write_report(run_dir, journal, records, verdicts)
        return RunResult(run_dir, journal, verdicts)

    async def _left_over(self, before: set[tuple[int, float]], *, patience_s: float = 10.0) -> None:
        """Record the processes the run started that outlive its fleet (given ``patience_s`` to finish exiting)."""
        deadline = time.monotonic() + patience_s
        left = left_over(before)
        while left and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            left = left_over(before)
        runner = [s.as_json() for s in sample() if s.role == "runner"]
        self.history.add("resources", phase="after", procs=runner, left=left)
        if left:
            self._say("note", f"{len(left)} process(es) of the run outlived it: "
                      + ", ".join(f"{p['role']} {p['id']} (pid {p['pid']})" for p in left))

    def _refuse_root_faults(self) -> None:
        if os.geteuid() == 0:
            return
        for i, act in enumerate(self.exp.method):
            spec = self.catalogue.get(act.fault)
            if spec is not None and spec.needs_root:
                raise ConfigError(f"{act.fault} needs root (this process is not)", field=f"method[{i}].fault")

    def _run_dir(self) -> Path:
        out = self.opts.out
        if out is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            out = Path("runs") / "chaos" / f"{stamp}-{_slug(self.exp.title)}"
        if out.exists() and any(out.iterdir()):
            raise ConfigError(f"the run folder {out} is not empty; pick another --out", field="out")
        out.mkdir(parents=True, exist_ok=True)
        return out

    # -- the fleet --------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _fleet(self, run_dir: Path) -> AsyncIterator[Provisioned]:
        def say(text: str) -> None:
            self._say("phase", text)

        if self.opts.fleet is not None:
            async with given_fleet(self.exp, self.opts.fleet, say=say, history=self.history,
                                   services=self.opts.services) as provisioned:
                yield provisioned
            return
        backend = worker_backend(self.exp, base=self.opts.base, run_dir=self.opts.run_dir, say=say)
        if self.exp.fleet.hosts > 1 and not self.opts.attach:
            if self.opts.network is None:
                raise ConfigError("a fleet of several hosts runs from `fleetward chaos run` (as root), which makes its "
                                  "hosts before it starts", field="fleet.hosts")
            async with hosts_fleet(self.exp, net=self.opts.network, run_dir=run_dir, backend=backend, say=say,
                                   guard=self._unless_stopped, history=self.history) as provisioned:
                yield provisioned
            return
        if self.opts.attach:
            async with attached_fleet(self.exp, run_dir=self.opts.run_dir, cluster=self.opts.cluster,
                                      backend=backend, say=say) as provisioned:
                yield provisioned
            return
        async with own_fleet(self.exp, run_dir=run_dir, backend=backend, etcd=self.opts.etcd, mqtt=self.opts.mqtt,
                             say=say, guard=self._unless_stopped, history=self.history,
                             services=self.opts.services) as provisioned:
            yield provisioned

    async def _unless_stopped(self, aw: Awaitable[T], what: str) -> T:
        """``aw``, unless the operator stops the run first (then it is cancelled: :class:`Stopped`)."""
        if self.opts.stop is None:
            return await aw
        task = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(self.opts.stop.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            raise Stopped(f"stopped by the operator while {what}")
        return task.result()

    def _router_urls(self) -> list[str]:
        """Where clients connect: each router's client proxy when there is one."""
        ids = set(self._declared.get("router", []))
        return [r.client_url or r.url for r in self.fleet.routers if r.id in ids]

    async def _describe_fleet(self) -> dict[str, Any]:
        status = await self.fleet.fleet_status()
        models = sorted({w["model"] for w in status["workers"] if w.get("model")})
        return {"cluster": status["cluster"], "backend": self.fleet.backend.name, "attached": self.opts.attach,
                "workers": self._declared.get("worker", []),
                "routers": [{"id": r.id, "url": r.url} for r in self.fleet.routers],
                "model": models[0] if models else self.fleet.backend.model_name, "supervisor": self.supervised}

    @contextlib.asynccontextmanager
    async def _recording(self) -> AsyncIterator[None]:
        """Record every event of the cluster, and what etcd commits of its decisions (:mod:`.writes`), into the
        history while the block runs."""
        from fleetward.fleet.bus import MqttBus

        endpoint = self.fleet.mqtt_endpoint
        subscriber = MqttBus(endpoint, self.fleet.cluster, access=getattr(self.fleet, "mqtt_access", None))
        subscribed = asyncio.Event()

        async def record() -> None:
            async for ev in subscriber.subscribe(("#",), subscribed=subscribed):
                data = {(f"event_{k}" if k in ("type", "t", "wall", "type_") else k): v for k, v in ev.data.items()}
                self.history.add("event", kind=ev.kind, id=ev.id, ts=ev.ts, **data)

        store = self.fleet.store
        start = (await store.get_prefix(self.fleet.keys.root + "leader/")).revision + 1
        async with _background(record()), _background(record_writes(store, self.fleet.keys, self.history,
                                                                    start_revision=start)):
            async with asyncio.timeout(15):
                await subscribed.wait()
            yield
            await self.fleet.bus.flush(2.0)
            await asyncio.sleep(0.2)  # let the last events (published by other processes) arrive

    # -- steady state -----------------------------------------------------------------------------------

    async def _hypothesis(self, when: str) -> dict[str, Any]:
        hyp = self.exp.hypothesis()
        self.phase = f"steady state {when}"
        self._say("phase", f"checking the steady-state hypothesis ({when})")
        self.history.add("phase", name=f"steady-state-{when}", state="start")
        probes = []
        for probe in hyp.probes:
            t0 = time.time()
            deadline = time.monotonic() + probe.within_s
            while True:
                try:
                    value = await self._probe(probe, when)
                    error = None
                except Exception as exc:
                    value, error = None, f"{type(exc).__name__}: {exc}"
                met = error is None and probe.accepts(value)
                if met or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(0.25)
            self.history.add("probe", name=probe.name, probe=probe.probe, when=when, value=value, ok=met, error=error)
            probes.append({"activity": {"type": "probe", "name": probe.name, "probe": probe.probe,
                                        "args": probe.args, "tolerance": _tolerance(probe)},
                           "output": value, "status": "succeeded" if error is None else "failed",
                           "tolerance_met": met, "exception": error, "start": _iso(t0), "end": _iso(time.time())})
            self._say("probe", f"{probe.name}: {value!r} {'ok' if met else 'NOT MET'}")
        self.history.add("phase", name=f"steady-state-{when}", state="end")
        return {"title": hyp.title, "steady_state_met": all(p["tolerance_met"] for p in probes), "probes": probes}

    async def _probe(self, probe: Probe, when: str) -> Any:
        spec = PROBES[probe.probe]
        ctx = ProbeContext(self.fleet, self._declared.get("worker", []), self._router_urls(), self.workload,
                           self.exp.seed, probe.name, when, ignore_eos=self.exp.workload.ignore_eos)
        return await spec.fn(ctx, spec.args.model_validate(probe.args))

    # -- the method -------------------------------------------------------------------------------------

    async def _method(self) -> tuple[str, str]:
        assert self.workload is not None
        self.phase = "method"
        self._say("phase", f"method: workload for {self.exp.workload.duration_s:g} s, {len(self.exp.method)} "
                  "fault(s)")
        self.history.add("phase", name="method", state="start")
        self.method_started = self.history.now()
        done = {name: asyncio.Event() for name in self.names}

        async def body() -> None:
            assert self.workload is not None
            async with asyncio.TaskGroup() as outer:
                watch = outer.create_task(self._watch_capacity(), name="blast radius")
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self.workload.run(), name="workload")
                    for i, act in enumerate(self.exp.method):
                        tg.create_task(self._activity(i, act, done), name=self.names[i])
                watch.cancel()

        main = asyncio.create_task(body(), name="method")
        stopper = asyncio.create_task((self.opts.stop or asyncio.Event()).wait(), name="stop")
        status, reason = "completed", ""
        try:
            await asyncio.wait({main, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if not main.done():
                status, reason = "interrupted", "stopped by the operator"
                main.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await main
        except* SafetyAbort as group:
            status, reason = "aborted", str(_first(group))
        finally:
            stopper.cancel()
            main.cancel()
            self.history.add("phase", name="method", state="end", status=status)
            self.phase = "after the method"
        self._say("phase", f"method {status}" + (f": {reason}" if reason else ""))
        return status, reason

    async def _watch_capacity(self) -> None:
        """Abort the method (:class:`SafetyAbort`) when more of the fleet's workers are out of service than the
        blast radius allows, whatever the cause; a look that cannot read etcd (an etcd fault) tells nothing."""
        share = self.exp.radius().max_capacity_share
        while True:
            await asyncio.sleep(CAPACITY_LOOK_S)
            workers = sorted(set(self.fleet.worker_ids))
            try:
                async with asyncio.timeout(5.0):
                    snapshot = await read_fleet(self.fleet.store, self.fleet.keys)
            except (FleetwardError, OSError, TimeoutError):
                continue
            down = out_of_service(snapshot, workers)
            breach = capacity_breach(down, workers, share)
            if breach is not None:
                self.history.add("note", text=breach, blast_radius=True, out_of_service=down)
                self._say("activity", f"ABORT: {breach}")
                raise SafetyAbort(breach)

    async def _sleep_until(self, t: float) -> None:
        assert self.method_started is not None
        delay = self.method_started + t - self.history.now()
        if delay > 0:
            await asyncio.sleep(delay)

    async def _activity(self, i: int, act: Activity, done: Mapping[str, asyncio.Event]) -> None:
        name = self.names[i]
        try:
            if act.at is not None:
                await self._sleep_until(act.at)
            else:
                assert act.after is not None
                await done[act.after].wait()
                await asyncio.sleep(act.delay)
            assert self.method_started is not None
            first = self.history.now() - self.method_started
            # A repeated fault: each occurrence at its planned time, or as soon as the one before has stopped.
            for k, t in enumerate(act.occurrences(first, self.exp.workload.duration_s)):
                if k:
                    late = self.history.now() - self.method_started - t
                    if late > 0:
                        self.history.add("note", text=f"{name}: occurrence {k} starts {late:.1f} s late (the one "
                                         "before took that long to recover)", activity=name)
                    await self._sleep_until(t)
                await self._drive(i, act, Experiment.occurrence_name(name, act, k), occurrence=k)
        finally:
            done[name].set()

    async def _drive(self, i: int, act: Activity, name: str, *, occurrence: int = 0) -> None:
        h = self.history
        spec: FaultSpec = self.catalogue[act.fault]
        params = spec.params.model_validate(act.params)
        target = act.target or default_target(spec) or Target(kind="fleet", pick="all")
        entry: dict[str, Any] = {"activity": {**act.model_dump(mode="json"), "type": "fault", "name": name},
                                 "status": "running", "start": _iso(time.time()), "t_start": round(h.now(), 3)}
        self.activities.append(entry)
        base = {"activity": name, "fault": act.fault, "family": spec.family, "target": target.model_dump(mode="json"),
                "params": params.model_dump(mode="json")}
        seed = f"{self.exp.seed}:target:{i}" + (f":{occurrence}" if occurrence else "")
        try:
            try:
                ids = self.resolve(target, rng=random.Random(seed))
            except SafetyAbort as exc:
                raise SafetyAbort(f"{name} ({act.fault}): {exc}") from None
            self._check_share(spec, target, ids, name)
        except SafetyAbort as exc:
            h.add("fault", phase="refused", detail=str(exc), **base)
            entry.update(status="refused", exception=str(exc), end=_iso(time.time()))
            self._say("activity", f"{name}: REFUSED: {exc}")
            raise
        fault: Fault = spec.factory(params, target)
        ctx = _Context(self, target, ids)
        if counts_toward_share(spec, target):
            self.active[name] = (target.kind, ids)
        steps: list[dict[str, Any]] = []

        def step(phase: str, **data: Any) -> None:
            rec = h.add("fault", phase=phase, targets=ids, **base, **data)
            steps.append({"phase": phase, "t": round(rec.t, 3), **data})

        step("start", at=act.at, duration=act.duration)
        self.in_effect.add(name)
        await self._publish("fault.start", name, act, spec, ids)
        self._say("activity", f"{name}: inject {act.fault} on {', '.join(ids)}")
        verified = recovered = None
        verify_s = act.verify_timeout_s or float(params.model_dump().get("verify_timeout_s", 25.0)) + 5.0
        recover_s = act.verify_timeout_s or float(params.model_dump().get("recover_timeout_s", 25.0)) + 5.0
        try:
            try:
                await fault.inject(ctx)
                if spec.extra.get("picks_target") and fault.targets and list(fault.targets) != ids:
                    # The fault picks its own (the supervisor's leader at injection): the records say which.
                    ids[:] = list(fault.targets)
                    self._say("activity", f"{name}: it hit {', '.join(ids)}")
                verified = await _bounded(fault.verify(ctx), verify_s)
                step("verified", ok=verified, detail=_describe(fault))
                self._say("activity", f"{name}: {'took effect' if verified else 'DID NOT take effect'}")
                await asyncio.sleep(act.duration)
            except Exception as exc:
                log.exception("fault %s failed", name)
                step("failed", detail=f"{type(exc).__name__}: {exc}", stage="inject")
                entry["exception"] = f"{type(exc).__name__}: {exc}"
        finally:
            # Recover whatever happened above. When the method is being cancelled (a safety abort, Ctrl-C),
            # the recovery still runs to its end (bounded by recover_s): no fault is left half undone.
            async def recover() -> bool | None:
                try:
                    step("recover")
                    async with asyncio.timeout(recover_s):
                        await fault.recover(ctx)
                    ok = await _bounded(fault.verify_recovered(ctx), recover_s)
                    step("recovered", ok=ok, detail=_describe(fault))
                    return ok
                except Exception as exc:
                    log.exception("recovering %s failed", name)
                    step("failed", detail=f"{type(exc).__name__}: {exc}", stage="recover")
                    entry["exception"] = entry.get("exception") or f"{type(exc).__name__}: {exc}"
                    return None

            recovery = asyncio.ensure_future(recover())
            try:
                try:
                    recovered = await asyncio.shield(recovery)
                except asyncio.CancelledError:
                    recovered = await recovery
                    raise
            finally:
                self.active.pop(name, None)
                self.in_effect.discard(name)
                step("stop")
                await self._publish("fault.stop", name, act, spec, ids)
                self._say("activity", f"{name}: recovered" if recovered else f"{name}: NOT recovered")
                status = "succeeded" if verified and recovered and "exception" not in entry else "failed"
                entry.update(status=status, end=_iso(time.time()), t_end=round(h.now(), 3),
                             output={"targets": ids, "verified": verified, "recovered": recovered,
                                     "fault": _describe(fault), "steps": steps})

    async def _publish(self, kind: str, name: str, act: Activity, spec: FaultSpec, ids: list[str]) -> None:
        bus = self.fleet.bus
        worker = ids[0] if len(ids) == 1 and (act.target is not None and act.target.kind == "worker") else None
        with contextlib.suppress(Exception):
            await bus.publish(kind, activity=name, fault=act.fault, family=spec.family, targets=ids, worker=worker)

    def service(self, name: str) -> Any:
        """A collaborator for faults: the run's own (``workload``, ``history``, ``bus``, and those given in
        the options), else the harness's (``proxies``, ``proxy:<link>``, ``etcd-cluster``, ...)."""
        if name in self.services:
            return self.services[name]
        if self.fleet_ctx is not None:
            return self.fleet_ctx.service(name)
        raise KeyError(f"no service {name!r} in this run (there are: {', '.join(sorted(self.services))})")

    def universe(self, kind: str) -> list[str] | None:
        """Every id of ``kind`` in the fleet (``None``: not enumerable here)."""
        if kind in self._declared:
            return list(self._declared[kind])
        if self.fleet_ctx is not None:
            return list(self.fleet_ctx.universe(kind))
        return None

    def resolve(self, target: Target, *, rng: random.Random) -> list[str]:
        """Concrete ids for ``target`` within the fleet and its blast radius (a pick chooses among the ids inside
        it); :class:`SafetyAbort` when outside either."""
        load = self.workload.in_flight_by_worker() if self.workload is not None and target.kind == "worker" else None
        radius = self.exp.radius()
        universe = self.universe(target.kind)
        if universe is not None and not target.ids:
            universe = [i for i in universe if radius.admits(target.kind, i, node=self._node_of(target.kind, i))]
            if not universe:
                raise SafetyAbort(f"no {target.kind} of the fleet is inside the blast radius ({radius.describe()})")
        try:
            ids = resolve(target, universe, rng=rng, busy=self._busy_ids(target.kind), load=load)
        except TargetError as exc:
            raise SafetyAbort(str(exc)) from None
        outside = [i for i in ids if not radius.admits(target.kind, i, node=self._node_of(target.kind, i))]
        if outside:
            raise SafetyAbort(f"{target.kind} {', '.join(outside)} outside the blast radius ({radius.describe()})")
        return ids

    def _node_of(self, kind: str, ident: str) -> str | None:
        """The host of a worker (workers, their GPUs and KV links); None for other kinds or one unknown here."""
        if kind not in ("worker", "gpu", "kv"):
            return None
        try:
            return self.fleet.spec(ident).node
        except (KeyError, AttributeError):
            return None

    def _busy_ids(self, kind: str) -> set[str]:
        return {i for k, ids in self.active.values() if k == kind for i in ids}

    def _check_share(self, spec: FaultSpec, target: Target, ids: list[str], name: str) -> None:
        if not counts_toward_share(spec, target):
            return
        known = self._declared.get(target.kind)
        if not known:
            return
        faulted = self._busy_ids(target.kind) | set(ids)
        limit = self.exp.safety.limit(target.kind)
        if target.kind == "worker":
            limit = min(limit, self.exp.radius().max_capacity_share)
        share = len(faulted) / len(known)
        if share > limit + 1e-9:
            raise SafetyAbort(f"{name} would fault {len(faulted)} of {len(known)} {target.kind}(s) at once "
                              f"({', '.join(sorted(faulted))}): share {share:.2f} over the limit {limit:g}")

    # -- rollbacks and the reference --------------------------------------------------------------------

    async def _rollbacks(self) -> list[dict[str, Any]]:
        self.phase = "rollbacks"
        out = []
        self.history.add("phase", name="rollbacks", state="start")
        for rb in self.exp.rollbacks:
            t0 = time.time()
            self._say("phase", f"rollback: {rb.action}")
            try:
                output = await self._rollback(rb.action, float(rb.args.get("timeout_s", 60.0)))
                status, error = "succeeded", None
            except Exception as exc:
                log.exception("rollback %s failed", rb.action)
                output, status, error = None, "failed", f"{type(exc).__name__}: {exc}"
            self.history.add("note", text=f"rollback {rb.action}: {status}", rollback=rb.action, ok=error is None)
            out.append({"activity": {"type": "action", "name": rb.name or rb.action, "action": rb.action,
                                     "args": rb.args}, "status": status, "output": output, "exception": error,
                        "start": _iso(t0), "end": _iso(time.time())})
        self.history.add("phase", name="rollbacks", state="end")
        return out

    async def _rollback(self, action: str, timeout: float) -> dict[str, Any]:
        def routers_changed() -> None:
            if self.workload is not None:
                self.workload.routers[:] = self._router_urls()

        ctx = RollbackContext(self.fleet, self._declared.get("worker", []), routers_changed)
        return await ROLLBACKS[action].fn(ctx, timeout)

    async def _reference(self, run_dir: Path) -> dict[str, Any]:
        exp = self.exp
        mode = exp.reference
        if mode == "none":
            return {"kind": "none", "reason": "the experiment asks for no reference"}
        known = self.fleet.backend.reference()
        if known is not None and mode in ("auto", "model"):
            return dict(known)
        if mode == "model":
            return {"kind": "none", "reason": f"the output of {self.fleet.backend.name} workers is not known without "
                    "a run"}
        if exp.workload.temperature > 0:
            return {"kind": "none", "reason": "the workload samples (temperature > 0): streams are not determined"}
        assert self.workload is not None
        self.phase = "reference run"
        self.history.flush()
        return await record_reference(read_history(self.history.path), self.workload, self.exp.workload, run_dir,
                                      say=lambda text: self._say("phase", text))


def _discard(run_dir: Path) -> None:
    """Remove the run folder of a run that never began (it was empty before; fleet logs, if any, stay)."""
    with contextlib.suppress(OSError):
        (run_dir / "history.jsonl").unlink()
        run_dir.rmdir()


def _first(group: BaseExceptionGroup[SafetyAbort]) -> BaseException:
    """The first abort in a (possibly nested) group: a refused fault, or the capacity watch."""
    first: BaseException = group
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first


def _describe(fault: Fault) -> dict[str, Any]:
    with contextlib.suppress(Exception):
        return dict(fault.describe())
    return {}


def _tolerance(p: Probe) -> Any:
    t = p.tolerance
    return t.model_dump() if isinstance(t, BaseModel) else t


async def _bounded(aw: Awaitable[bool], timeout: float) -> bool:
    """A verification with a deadline: not confirmed in time counts as False."""
    try:
        async with asyncio.timeout(timeout):
            return bool(await aw)
    except TimeoutError:
        return False


@contextlib.asynccontextmanager
async def _background(coro: Awaitable[None]) -> AsyncIterator[None]:
    task = asyncio.ensure_future(coro)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fleetward")
    except PackageNotFoundError:
        return "unknown"


async def run_experiment(experiment: Experiment | str | Path | Mapping[str, Any], *, out: str | Path | None = None,
                         **options: Any) -> RunResult:
    """Run an experiment (a file, a parsed mapping or a model) and return the result (see :class:`RunOptions`).

    >>> result = await run_experiment("chaos/experiments/baseline.yaml", out=tmp_path / "run")
    >>> assert result.ok, result.failures()
    """
    exp, base = experiment_of(experiment, options.pop("base", None))
    opts = RunOptions(out=Path(out) if out is not None else None, base=base, **options)
    return await Runner(exp, opts).run()


def experiment_of(experiment: Experiment | str | Path | Mapping[str, Any],
                  base: Path | None = None) -> tuple[Experiment, Path | None]:
    """A validated experiment and the folder its relative paths start from."""
    if isinstance(experiment, (str, Path)):
        return load_experiment(experiment), base or Path(experiment).resolve().parent
    if isinstance(experiment, Experiment):
        return validate_experiment(experiment, base=base), base
    return validate_experiment(dict(experiment), base=base), base
