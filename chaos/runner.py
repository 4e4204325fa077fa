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
   ``fault.start`` / ``fault.stop`` events on the bus). Before each injection the safety rule is checked
   again against the resolved targets; a breach aborts the method (faults in effect are recovered);
5. the steady-state hypothesis again (*after*): if it does not hold, the run ``deviated``;
6. the rollbacks; then, for greedy vLLM, a fault-free reference run of every request the clients made;
7. the checkers, on the history; then ``journal.json`` and ``report.html``.

The run folder holds ``journal.json``, ``history.jsonl``, ``report.html``, ``reference.jsonl`` (when
recorded) and ``logs/``. :func:`check_run` re-runs the checkers on a saved folder. The exit code is 1 when
the run did not complete, the hypothesis deviated or a checker failed; else 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import platform
import random
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx

from fleetward.chaos.checkers import (
    CheckContext,
    ModelReference,
    NoReference,
    RecordedReference,
    Reference,
    RunView,
    Verdict,
    combine,
    reference_key,
    run_checkers,
)
from fleetward.chaos.experiment import (
    Activity,
    Experiment,
    Probe,
    RequestsProbeArgs,
    counts_toward_share,
    declared_ids,
    default_target,
    fault_catalogue,
    load_experiment,
    match_ids,
    validate_experiment,
)
from fleetward.chaos.fault import Fault, FaultSpec, Target
from fleetward.chaos.history import History, Record, read_history
from fleetward.chaos.workload import Live, Planned, Workload, make_prompt
from fleetward.fleet.errors import ConfigError, FleetwardError

__all__ = ["AttachedFleet", "RunOptions", "RunResult", "Runner", "check_run", "run_experiment"]

log = logging.getLogger(__name__)

T = TypeVar("T")
Progress = Callable[[str, str], None]  # (kind, text): phase, activity, note


class SafetyAbort(FleetwardError):
    """A fault would breach the safety rule: the method stops."""


class Stopped(FleetwardError):
    """The operator stopped the run before its method began."""


@dataclass
class RunOptions:
    out: Path | None = None  # the run folder (default runs/chaos/<time>-<title>)
    attach: bool = False  # use the running local fleet instead of bringing one up
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
    fleet: Any = None


@dataclass
class RunResult:
    run_dir: Path
    journal: dict[str, Any]
    verdicts: list[Verdict]

    @property
    def status(self) -> str:
        return str(self.journal["status"])

    @property
    def deviated(self) -> bool:
        return bool(self.journal["deviated"])

    @property
    def check_status(self) -> str:
        return str(self.journal["checks"]["status"])

    @property
    def exit_code(self) -> int:
        return int(self.journal["exit_code"])

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def failures(self) -> list[str]:
        """One line per reason the run is not ok (for test failure messages)."""
        out = []
        if self.status != "completed":
            out.append(f"run {self.status}: {self.journal.get('reason') or ''}".rstrip(": "))
        if self.deviated:
            out.append("the steady-state hypothesis deviated after the method")
        out += [f"{v.checker}: {v.status}: {v.summary}" for v in self.verdicts if v.status == "fail"]
        return out


def exit_code(status: str, deviated: bool, checks: str) -> int:
    return 0 if status == "completed" and not deviated and checks != "fail" else 1


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat()


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40] or "experiment"


# -- an attached fleet --------------------------------------------------------------------------------------


@dataclass
class RouterRef:
    id: str
    url: str
    is_running: bool = True


class AttachedFleet:
    """The levers of :class:`~fleetward.chaos.harness.TestFleet` that work on a fleet someone else runs:
    simulated workers' fault switches, the fleet's state; process control is not ours to take."""

    def __init__(self, state: Mapping[str, Any], admin_token: str) -> None:
        from fleetward.fleet.etcd import EtcdStore
        from fleetward.fleet.keys import Keys

        self.cluster = str(state["cluster"])
        self.etcd = str(state["etcd"])
        self.mqtt = str(state["mqtt"])
        self.workers_urls: dict[str, str] = dict(state.get("workers") or {})
        self.keys = Keys(self.cluster)
        self.store = EtcdStore(self.etcd)
        self.admin_token = admin_token
        self.routers: list[RouterRef] = []
        self.bus: Any = None
        self._http = httpx.AsyncClient(timeout=10.0, trust_env=False)

    async def start(self) -> None:
        from fleetward.fleet.bus import MqttBus
        from fleetward.fleet.registry import read_fleet

        self.bus = await MqttBus(self.mqtt, self.cluster).start()
        fleet = await read_fleet(self.store, self.keys)
        self.routers = [RouterRef(rid, str(r.get("url"))) for rid, r in sorted(fleet.routers.items())]
        for wid, rec in fleet.workers.items():
            self.workers_urls.setdefault(wid, rec.url)

    async def aclose(self) -> None:
        if self.bus is not None:
            await self.bus.aclose()
        await self.store.aclose()
        await self._http.aclose()

    @property
    def worker_ids(self) -> list[str]:
        return sorted(self.workers_urls)

    def url(self, worker: str) -> str:
        return self.workers_urls[worker]

    bind_url = url

    async def fault(self, worker: str, **switches: Any) -> dict[str, Any]:
        r = await self._http.post(f"{self.url(worker)}/admin/faults", json=switches,
                                  headers={"Authorization": f"Bearer {self.admin_token}"})
        r.raise_for_status()
        return dict(r.json())

    async def state(self, worker: str) -> dict[str, Any]:
        r = await self._http.get(f"{self.url(worker)}/admin/state",
                                 headers={"Authorization": f"Bearer {self.admin_token}"})
        r.raise_for_status()
        return dict(r.json())

    async def fleet_status(self) -> dict[str, Any]:
        from fleetward.fleet.registry import read_fleet

        return (await read_fleet(self.store, self.keys)).to_status()

    async def wait_workers_routable(self, n: int, timeout: float = 30.0) -> None:
        from fleetward.fleet.registry import read_fleet

        async with asyncio.timeout(timeout):
            while True:
                if len((await read_fleet(self.store, self.keys)).routable()) >= n:
                    return
                await asyncio.sleep(0.1)

    def _not_here(self, what: str) -> FleetwardError:
        return FleetwardError(f"{what} is not available on an attached fleet (its processes are not ours)")

    def kill(self, worker: str) -> None:
        raise self._not_here("killing a worker")

    async def restart(self, worker: str) -> None:
        raise self._not_here("restarting a worker")

    def signal_engine(self, worker: str, sig: int) -> None:
        raise self._not_here("signalling a worker")


# -- the fault context --------------------------------------------------------------------------------------


class _Context:
    """:class:`~fleetward.chaos.fault.FaultContext` for one activity: targets resolved once, up front."""

    def __init__(self, runner: Runner, target: Target, ids: list[str]) -> None:
        self._runner = runner
        self._target = target
        self._ids = ids

    @property
    def fleet(self) -> Any:
        return self._runner.fleet

    def resolve(self, target: Target) -> list[str]:
        if target == self._target:
            return list(self._ids)
        return self._runner.resolve(target, rng=random.Random(f"{self._runner.exp.seed}:{target}"))

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
        self.fleet: Any = None
        self.services: dict[str, Any] = {}
        self.history: History
        self.workload: Workload | None = None
        self.phase = "starting"
        self.active: dict[str, tuple[str, list[str]]] = {}  # activity -> (kind, ids), for the safety share
        self.in_effect: set[str] = set()  # every activity between its start and its stop (for displays)
        self.activities: list[dict[str, Any]] = []
        self.supervised: bool | None = None
        self.method_started: float | None = None
        self.fleet_ctx: Any = None  # the harness's FaultContext (proxies, etcd cluster, ...), when it has one
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

    async def run(self) -> RunResult:
        exp = self.exp
        self._refuse_root_faults()
        run_dir = self._run_dir()
        self.history = History(run_dir / "history.jsonl")
        started = time.time()
        journal: dict[str, Any] = {
            "fleetward-version": _version(), "platform": platform.platform(), "node": platform.node(),
            "experiment": exp.to_json(), "start": _iso(started), "status": "failed", "deviated": False,
            "steady_states": {"before": None, "after": None}, "run": self.activities, "rollbacks": [],
        }
        reason = ""
        self._say("phase", f"run folder {run_dir}")
        try:
            async with self._fleet(run_dir) as fleet:
                self.fleet = fleet
                journal["fleet"] = await self._describe_fleet()
                async with self._recording(), Workload(
                        exp.workload, seed=exp.seed, recorder=self.history, routers=self._router_urls(),
                        model=journal["fleet"]["model"], max_model_len=exp.fleet.max_model_len,
                        base=self.opts.base) as workload:
                    self.workload = workload
                    self.services.update(workload=workload, history=self.history, bus=getattr(fleet, "bus", None))
                    if self.fleet_ctx is None:  # an attached fleet: a KV hook of the run's own (hook-level faults)
                        from fleetward.chaos.faults.kv import FaultyKvTransfer

                        self.services["kv"] = FaultyKvTransfer()
                    self.services.update(self.opts.services)
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
                    journal["status"] = status
                    journal["workload"] = {"planned": len(workload.plan), "sent": workload.sent, "ok": workload.ok,
                                           "failed": workload.failed, "cancelled": workload.cancelled,
                                           "shed": workload.shed, "tokens": workload.tokens,
                                           "by_source": dict(workload.by_source)}
                    journal["reference"] = await self._reference(run_dir)
        except Stopped as exc:
            journal["status"], reason = "interrupted", str(exc)
            self.history.add("note", text=reason)
            journal.setdefault("reference", {"kind": "none", "reason": "the run was stopped"})
        except (FleetwardError, OSError, httpx.HTTPError) as exc:
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
        _finish_journal(journal, verdicts)
        (run_dir / "journal.json").write_text(json.dumps(journal, indent=2, default=str) + "\n")
        if self.opts.report:
            from fleetward.chaos.report import write_report

            write_report(run_dir, journal, records, verdicts)
        return RunResult(run_dir, journal, verdicts)

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
    async def _fleet(self, run_dir: Path) -> AsyncIterator[Any]:
        if self.opts.attach:
            async with self._attached() as fleet:
                yield fleet
            return
        if self.opts.fleet is not None:
            async with self._given(self.opts.fleet) as fleet:
                yield fleet
            return
        from fleetward.chaos.harness import TestFleet

        spec = self.exp.fleet
        known = {f.name for f in dataclasses.fields(TestFleet)}
        gpu = None
        if spec.gpus_per_worker:
            from fleetward.supervisor.gpu import FakeGpuSource

            gpu = FakeGpuSource(spec.workers * spec.gpus_per_worker)
        kw: dict[str, Any] = dict(
            etcd=self.opts.etcd or "", mqtt=self.opts.mqtt or "", run_dir=run_dir / "fleet",
            cluster=spec.cluster or f"chaos-{uuid.uuid4().hex[:6]}", workers=spec.workers, backend=spec.backend,
            sim=spec.sim, vllm=spec.vllm, routing=spec.routing, supervisor=spec.supervisor, node=spec.node,
            lease_ttl=spec.lease_ttl_s,
            model_path=self._model_path(),
            # One controller runs in this process; more run as processes (a leader and standbys).
            controller=spec.controllers == 1, controller_processes=spec.controllers if spec.controllers > 1 else 0,
            gpu=gpu, gpus_per_worker=spec.gpus_per_worker,
            # The fleet owns what was not given: a private etcd (cluster) and broker, so faults may stop them.
            etcd_members=0 if self.opts.etcd else spec.etcd_members, own_broker=not self.opts.mqtt,
            proxy_workers=spec.proxies.workers, proxy_clients=spec.proxies.clients,
            proxy_control=spec.proxies.control)
        lacking = [k for k, v in kw.items() if k not in known and v not in (False, 0, None, "")]
        if lacking:
            raise ConfigError(f"this harness cannot do {', '.join(lacking)}; give --etcd and --mqtt, or leave "
                              "those fleet settings out", field="fleet")
        self.supervised = True  # the harness runs the supervisor (it makes workers ready)
        self._say("phase", f"starting {spec.workers} {spec.backend} worker(s) and {spec.routers} router(s)")
        async with contextlib.AsyncExitStack() as stack:
            fleet = TestFleet(**{k: v for k, v in kw.items() if k in known})
            await self._unless_stopped(stack.enter_async_context(fleet), "starting the fleet")
            for i in range(spec.routers):
                await self._unless_stopped(fleet.start_router(f"router-{i}"), "starting the routers")
            await self._unless_stopped(fleet.wait_workers_routable(
                spec.workers, timeout=max(60.0, spec.vllm.start_timeout_s)), "waiting for the workers")
            self._harness(fleet)
            yield fleet

    def _harness(self, fleet: Any) -> None:
        """The fault context and the declared ids of a harness fleet (its own, or one given to the run)."""
        self.fleet_ctx = fleet.fault_context(history=self.history, seed=self.exp.seed,
                                             services=dict(self.opts.services))
        self._declared = {"worker": fleet.worker_ids, "router": [r.id for r in fleet.routers],
                          "supervisor": fleet.supervisor_control().ids if fleet.supervised else [],
                          "kv": ["kv"], "fleet": ["fleet"]}

    @contextlib.asynccontextmanager
    async def _given(self, fleet: Any) -> AsyncIterator[Any]:
        """A running harness fleet: check it is the declared one, add the routers it lacks for this run."""
        spec = self.exp.fleet
        declared = declared_ids(spec, "worker") or []
        missing = [w for w in declared if w not in fleet.worker_ids]
        if missing or fleet.backend != spec.backend:
            raise ConfigError(f"the given fleet has {fleet.backend} workers {', '.join(fleet.worker_ids) or 'none'}; "
                              f"the experiment declares {spec.backend} workers {', '.join(declared)} (set "
                              "fleet.backend, fleet.node and fleet.workers to match)", field="fleet.workers")
        self.supervised = fleet.supervised
        started = []
        try:
            for i in range(len(fleet.routers), spec.routers):
                started.append(await fleet.start_router(f"router-{i}"))
            await fleet.wait_workers_routable(spec.workers, timeout=max(60.0, spec.vllm.start_timeout_s))
            self._say("phase", f"using the given fleet {fleet.cluster} ({len(fleet.worker_ids)} workers)")
            self._harness(fleet)
            self._declared["worker"] = declared
            self._declared["router"] = [r.id for r in fleet.routers][:spec.routers]
            yield fleet
        finally:
            for r in started:
                await fleet.stop_router(r)

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

    def _model_path(self) -> Path | None:
        spec = self.exp.fleet
        if spec.backend != "vllm":
            return None
        # Absolute: workers run in their own folders, and vLLM takes a relative path it cannot find for a
        # model id on the hub.
        if spec.model:
            beside = self.opts.base / spec.model if self.opts.base is not None else None
            return (beside if beside is not None and beside.exists() else Path(spec.model)).resolve()
        from fleetward.fleet.compose import default_model_path

        path = default_model_path(self.opts.run_dir).resolve()
        if not (path / "model.safetensors").exists():
            from fleetward.fleet.tinymodel import write_tiny_model

            self._say("phase", f"writing the tiny local model to {path}")
            write_tiny_model(path)
        return path

    @contextlib.asynccontextmanager
    async def _attached(self) -> AsyncIterator[AttachedFleet]:
        cluster = self.opts.cluster or self.exp.fleet.cluster or "local"
        state, token = _local_fleet(self.opts.run_dir / cluster / "fleet.json")
        fleet = AttachedFleet(state, token)
        try:
            await fleet.start()
            declared = declared_ids(self.exp.fleet, "worker") or []
            missing = [w for w in declared if w not in fleet.worker_ids]
            if missing:
                raise ConfigError(f"the attached fleet's workers are {', '.join(fleet.worker_ids) or 'none'}; the "
                                  f"experiment declares {', '.join(declared)} (set fleet.node and fleet.workers to "
                                  "match)", field="fleet.workers")
            if len(fleet.routers) < self.exp.fleet.routers:
                raise ConfigError(f"the attached fleet has {len(fleet.routers)} router(s); the experiment declares "
                                  f"{self.exp.fleet.routers}", field="fleet.routers")
            self._declared = {"worker": declared, "router": [r.id for r in fleet.routers][:self.exp.fleet.routers],
                              "kv": ["kv"], "fleet": ["fleet"]}
            self._say("phase", f"attached to fleet {fleet.cluster} ({len(fleet.worker_ids)} workers)")
            yield fleet
        finally:
            await fleet.aclose()

    def _router_urls(self) -> list[str]:
        """Where clients connect: each router's client proxy when there is one."""
        ids = set(self._declared.get("router", []))
        return [getattr(r, "client_url", "") or r.url for r in self.fleet.routers if r.id in ids]

    async def _describe_fleet(self) -> dict[str, Any]:
        status = await self.fleet.fleet_status()
        models = sorted({w["model"] for w in status["workers"] if w.get("model")})
        return {"cluster": status["cluster"], "backend": self.exp.fleet.backend, "attached": self.opts.attach,
                "workers": self._declared.get("worker", []),
                "routers": [{"id": r.id, "url": r.url} for r in self.fleet.routers],
                "model": models[0] if models else self.exp.fleet.sim.model_name, "supervisor": self.supervised}

    @contextlib.asynccontextmanager
    async def _recording(self) -> AsyncIterator[None]:
        """Record every event of the cluster into the history while the block runs."""
        from fleetward.fleet.bus import MqttBus

        endpoint = self.fleet.mqtt
        subscriber = MqttBus(endpoint, self.fleet.cluster)
        subscribed = asyncio.Event()

        async def record() -> None:
            async for ev in subscriber.subscribe(("#",), subscribed=subscribed):
                data = {(f"event_{k}" if k in ("type", "t", "wall", "type_") else k): v for k, v in ev.data.items()}
                self.history.add("event", kind=ev.kind, id=ev.id, ts=ev.ts, **data)

        async with _background(record()):
            async with asyncio.timeout(15):
                await subscribed.wait()
            yield
            bus = getattr(self.fleet, "bus", None)
            if bus is not None:
                await bus.flush(2.0)
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
        if probe.probe == "workers_routable":
            from fleetward.fleet.registry import read_fleet

            fleet = await read_fleet(self.fleet.store, self.fleet.keys)
            return sum(1 for w in fleet.routable() if w.id in self._declared.get("worker", []))
        if probe.probe == "routers_healthy":
            async with httpx.AsyncClient(timeout=3.0, trust_env=False) as http:
                n = 0
                for url in self._router_urls():
                    with contextlib.suppress(httpx.HTTPError):
                        n += (await http.get(f"{url}/health")).status_code == 200
                return n
        args = RequestsProbeArgs.model_validate(probe.args)
        assert self.workload is not None
        w = self.workload
        reference = self._model_reference()
        results: list[bool] = []

        async def one(k: int) -> None:
            p = w.new_request("probe", prompt=make_prompt(self.exp.seed, f"probe-{when}-{probe.name}", k,
                                                           args.prompt_tokens), max_tokens=args.max_tokens)
            live = Live(f"p-{when}-{p.index:04d}", "probe", p)
            async with asyncio.timeout(args.timeout_s):
                out = await w.client.run(p, live, router_index=k)
            exact = True
            if reference is not None and out.ok:
                prompt = w.client.reference_prompt(p)
                exact = list(out.tokens) == reference.continuation(prompt, p.max_tokens,
                                                                   ignore_eos=self.exp.workload.ignore_eos)
            results.append(out.ok and exact)

        async with asyncio.TaskGroup() as tg:
            for k in range(args.count):
                tg.create_task(one(k))
        return round(sum(results) / len(results), 4)

    def _model_reference(self) -> Any:
        if self.exp.fleet.backend != "sim":
            return None
        from fleetward.fleet.simmodel import SimModel

        sim = self.exp.fleet.sim
        return SimModel(sim.seed, sim.eos_probability)

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
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.workload.run(), name="workload")
                for i, act in enumerate(self.exp.method):
                    tg.create_task(self._activity(i, act, done), name=self.names[i])

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
            status, reason = "aborted", str(group.exceptions[0])
        finally:
            stopper.cancel()
            main.cancel()
            self.history.add("phase", name="method", state="end", status=status)
            self.phase = "after the method"
        self._say("phase", f"method {status}" + (f": {reason}" if reason else ""))
        return status, reason

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
            await self._drive(i, act, name)
        finally:
            done[name].set()

    async def _drive(self, i: int, act: Activity, name: str) -> None:
        h = self.history
        spec: FaultSpec = self.catalogue[act.fault]
        params = spec.params.model_validate(act.params)
        target = act.target or default_target(spec) or Target(kind="fleet", pick="all")
        entry: dict[str, Any] = {"activity": {**act.model_dump(mode="json"), "type": "fault", "name": name},
                                 "status": "running", "start": _iso(time.time()), "t_start": round(h.now(), 3)}
        self.activities.append(entry)
        base = {"activity": name, "fault": act.fault, "family": spec.family, "target": target.model_dump(mode="json"),
                "params": params.model_dump(mode="json")}
        try:
            ids = self.resolve(target, rng=random.Random(f"{self.exp.seed}:target:{i}"))
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
        verify_s = act.verify_timeout_s or float(getattr(params, "verify_timeout_s", 25.0)) + 5.0
        recover_s = act.verify_timeout_s or float(getattr(params, "recover_timeout_s", 25.0)) + 5.0
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
        bus = getattr(self.fleet, "bus", None)
        if bus is None:
            return
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
        """Concrete ids for ``target`` within the fleet; :class:`SafetyAbort` when outside it."""
        known = self.universe(target.kind)
        if known is None:
            if target.ids:
                return list(target.ids)  # e.g. kv hooks: the fault family knows its ids
            raise SafetyAbort(f"cannot pick {target.kind}s here: name them in target.ids")
        if target.ids:
            found, outside = match_ids(target.ids, known)
            if outside:
                raise SafetyAbort(f"{', '.join(outside)} not in the fleet ({target.kind}s: "
                                  f"{', '.join(known) or 'none'})")
            return found
        if target.pick == "all":
            return list(known)
        if target.count > len(known):
            raise SafetyAbort(f"the fleet has {len(known)} {target.kind}(s), not {target.count}")
        free = [k for k in sorted(known) if k not in self._busy_ids(target.kind)] or sorted(known)
        if target.pick == "first":
            return free[:target.count]
        if target.pick == "serving" and target.kind == "worker" and self.workload is not None:
            load = self.workload.in_flight_by_worker()
            return sorted(free, key=lambda w: (-load.get(w, 0), w))[:target.count]
        return sorted(rng.sample(free, min(target.count, len(free))))

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
        done: dict[str, Any] = {}
        if action in ("restore_fleet", "restart_dead") and not self.opts.attach:
            restarted = []
            quarantined = await self._unquarantine()
            if quarantined:
                done["unquarantined"] = quarantined
            for wid in self._declared.get("worker", []):
                if wid in quarantined:
                    continue  # the supervisor restarts it after the self-test
                h = self.fleet.agent.handles.get(wid)
                if h is None or not h.process.is_running:
                    await self.fleet.restart(wid)
                    restarted.append(wid)
            for r in list(self.fleet.routers):
                if not r.is_running:
                    if hasattr(self.fleet, "restart_router"):  # same port, same links
                        await self.fleet.restart_router(r)
                    else:
                        await self.fleet.stop_router(r)
                        await self.fleet.start_router(r.id)
                    restarted.append(r.id)
            if self.workload is not None:
                self.workload.routers[:] = self._router_urls()
            done["restarted"] = restarted
        if action in ("restore_fleet", "clear_sim_faults") and self.exp.fleet.backend == "sim":
            cleared = []
            for wid in self._declared.get("worker", []):
                with contextlib.suppress(httpx.HTTPError, KeyError):
                    await self.fleet.fault(wid, clear=True)
                    cleared.append(wid)
            done["cleared"] = cleared
        if action in ("restore_fleet", "wait_routable"):
            await self.fleet.wait_workers_routable(len(self._declared.get("worker", [])), timeout=timeout)
            done["routable"] = True
        return done

    async def _unquarantine(self) -> list[str]:
        """Reset the fake GPUs and clear every quarantine through the supervisor leader (a self-test, then a
        restart, as an operator would); returns the workers that were quarantined."""
        fleet = self.fleet
        gpu = getattr(fleet, "gpu", None)
        if gpu is not None:
            for info in gpu.gpus():
                gpu.clear(info.index)
        if not getattr(fleet, "supervised", False):
            return []
        from fleetward.fleet.registry import read_fleet

        health = (await read_fleet(fleet.store, fleet.keys)).health
        out = [w for w in self._declared.get("worker", []) if w in health and health[w].state.value == "quarantined"]
        for w in out:
            (await fleet.supervisor_command(w, "quarantine/clear")).raise_for_status()
        return out

    async def _reference(self, run_dir: Path) -> dict[str, Any]:
        exp = self.exp
        mode = exp.reference
        if mode == "none":
            return {"kind": "none", "reason": "the experiment asks for no reference"}
        if exp.fleet.backend == "sim" and mode in ("auto", "model"):
            return {"kind": "model", "seed": exp.fleet.sim.seed, "eos_probability": exp.fleet.sim.eos_probability}
        if mode == "model":
            return {"kind": "none", "reason": "only the simulated worker's model is known without a run"}
        if exp.workload.temperature > 0:
            return {"kind": "none", "reason": "the workload samples (temperature > 0): streams are not determined"}
        return await self._record_reference(run_dir)

    async def _record_reference(self, run_dir: Path) -> dict[str, Any]:
        """Run every distinct request again, fault-free, and keep what it returns."""
        assert self.workload is not None
        self.phase = "reference run"
        wanted: dict[str, tuple[list[int], int]] = {}
        for rec in self.history.records:
            if rec.type == "invoke" and isinstance(rec.get("prompt"), list):
                p = rec.get("params") or {}
                key = reference_key(rec["prompt"], int(p.get("max_tokens", 16)), bool(p.get("ignore_eos")))
                wanted.setdefault(key, (rec["prompt"], int(p.get("max_tokens", 16))))
        self._say("phase", f"recording the fault-free reference ({len(wanted)} requests)")
        client = self.workload.client_for(_Memory(), self.exp.workload.model_copy(update={"api": "completion"}))
        got: dict[str, list[int]] = {}
        sem = asyncio.Semaphore(4)

        async def one(key: str, prompt: list[int], max_tokens: int, k: int) -> None:
            async with sem:
                p = Planned(k, 0.0, tuple(prompt), max_tokens, source="reference")
                out = await client.run(p, Live(f"ref-{k}", "reference", p), router_index=k)
                if out.ok:
                    got[key] = list(out.tokens)

        async with asyncio.TaskGroup() as tg:
            for k, (key, (prompt, n)) in enumerate(wanted.items()):
                tg.create_task(one(key, prompt, n, k))
        with (run_dir / "reference.jsonl").open("w") as f:
            for key, tokens in got.items():
                f.write(json.dumps({"key": key, "tokens": tokens}, separators=(",", ":")) + "\n")
        return {"kind": "recorded", "file": "reference.jsonl", "requests": len(wanted), "answered": len(got)}


def _local_fleet(path: Path) -> tuple[dict[str, Any], str]:
    """The state file of a fleet that ``fleetward up`` runs, and its admin token."""
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no running local fleet at {path}: start one with `fleetward up` (or run without "
                          "--attach)", field="attach") from None
    token_file = Path(state.get("admin_token_file") or path.parent / "admin-token")
    token = os.environ.get("FLEETWARD_ADMIN_TOKEN") or (token_file.read_text().strip() if token_file.exists()
                                                        else "")
    return state, token


def _describe(fault: Fault) -> dict[str, Any]:
    with contextlib.suppress(Exception):
        return dict(fault.describe())
    return {}


def _tolerance(p: Probe) -> Any:
    t = p.tolerance
    return t.model_dump() if hasattr(t, "model_dump") else t


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


class _Memory:
    """A recorder that keeps nothing on disk (the reference run)."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self._t0

    def add(self, type_: str, **data: Any) -> None:
        return None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fleetward")
    except PackageNotFoundError:
        return "unknown"


# -- judging ------------------------------------------------------------------------------------------------


def _reference_of(info: Mapping[str, Any], run_dir: Path) -> Reference:
    kind = info.get("kind")
    if kind == "model":
        return ModelReference(int(info.get("seed", 0)), float(info.get("eos_probability", 0.0)))
    if kind == "recorded":
        entries: dict[str, list[int]] = {}
        path = run_dir / str(info.get("file", "reference.jsonl"))
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    body = json.loads(line)
                    entries[body["key"]] = body["tokens"]
        return RecordedReference(entries)
    return NoReference(str(info.get("reason") or "no fault-free reference for this run"))


def judge(journal: Mapping[str, Any], records: list[Record], run_dir: Path) -> list[Verdict]:
    """Run the experiment's checkers on ``records`` (pure but for reading ``reference.jsonl``)."""
    ctxinfo = journal.get("context") or {}
    ctx = CheckContext(_reference_of(journal.get("reference") or {}, run_dir),
                       migration_limit=ctxinfo.get("migration_limit"), supervisor=ctxinfo.get("supervisor"))
    specs = journal.get("experiment", {}).get("checkers")
    chosen = None if specs is None else [(c["name"], c.get("params") or {}) for c in specs]
    return run_checkers(RunView.of(records), ctx, chosen)


def _finish_journal(journal: dict[str, Any], verdicts: list[Verdict]) -> None:
    checks = combine(v.status for v in verdicts)
    journal["checks"] = {"status": checks, "verdicts": [v.to_json() for v in verdicts]}
    journal["exit_code"] = exit_code(str(journal["status"]), bool(journal["deviated"]), checks)


def check_run(run_dir: Path) -> RunResult:
    """Re-run the checkers on a saved run folder; the result's exit code follows the same rules."""
    try:
        journal = json.loads((run_dir / "journal.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"{run_dir} has no journal.json: not a run folder", field="run") from None
    records = list(read_history(run_dir / "history.jsonl"))
    verdicts = judge(journal, records, run_dir)
    _finish_journal(journal, verdicts)
    return RunResult(run_dir, journal, verdicts)


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
