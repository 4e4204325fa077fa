"""The autoscaler daemon: one leader per cluster observes the live fleet and scales each pool.

Any number of autoscalers campaign in an etcd election (``leader/autoscaler/``); one leads, the others
wait. Every ``interval_s`` the leader, for each pool:

1. observes it (:class:`~fleetward.autoscale.observe.Observer`: etcd's ``workers/`` and ``health/``, the
   routers' and workers' ``/metrics``);
2. asks its policy (:mod:`fleetward.autoscale.planner`) for the number of serving workers it wants;
3. chooses which workers: a shortfall is made up by workers it retired earlier (``parked``), then new ids
   ``<node>-w<k>`` on the node with the fewest workers of the pool; a surplus retires the least-loaded
   serving workers (drained: their streams finish or migrate, then they stop);
4. writes ``scale/<pool>`` (the decision, its reason, and what it asked for) with the election's fence,
   **before** it acts, then acts through the :class:`~fleetward.autoscale.actuate.Actuator` and publishes a
   ``scale`` event when the desired count changed or something was started or retired.

Failover loses nothing and doubles nothing: a new leader reads ``scale/<pool>``, resumes the planner at the
last desired count, counts the workers its predecessor asked for as on their way, and asks again for those
not seen yet (the actuator's calls are idempotent per worker id), so a step cut off between the write and
the act is finished, once. A deposed leader's write fails on the fence, so it never acts after losing.

On Kubernetes (``autoscale.actuator: kubernetes``) the ReplicaSet names new workers: the ids asked for are
placeholders, each fulfilled by a worker of the pool registered since the last decision (``members`` in the
record), a retiree is asked again every interval until its pod is gone (its replicas are lowered only once its
drain has ended), and a retired worker is not brought back (:mod:`fleetward.autoscale.kubernetes`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from fleetward.autoscale.actuate import ActuationError, Actuator, NewWorker
from fleetward.autoscale.capacity import SLOS, CapacityModel, CapacityPoint, PoolCapacity, Sla
from fleetward.autoscale.observe import Observer, PoolView, fraction_within
from fleetward.autoscale.planner import DynamoStyle, Observation, Planner, Policy, Reactive, StaticPeak
from fleetward.fleet.backends import backend_class
from fleetward.fleet.bus import EventBus
from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.config import Access, AutoscaleConfig, SimConfig
from fleetward.fleet.election import Election, LeaderElected, Leadership, LeadershipLost, lead_forever
from fleetward.fleet.errors import ConfigError
from fleetward.fleet.etcd import Put, StateStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.lease import LeaseKeeper
from fleetward.fleet.registry import FleetSnapshot, read_fleet
from fleetward.fleet.telemetry import link_gauges
from fleetward.fleet.worker import HealthState, Role

__all__ = ["Autoscaler", "PoolRecord", "capacity_for", "make_policy", "pool_capacity", "serve_autoscaler"]

log = logging.getLogger(__name__)


@dataclass
class PoolRecord:
    """``scale/<pool>``: the last decision, and the workers it is waiting for."""

    pool: str
    desired: int = 0
    serving: int = 0
    starting: int = 0
    unhealthy: int = 0
    reason: str = ""
    policy: str = ""
    leader: str = ""
    term: int = 0  # the leader's election revision (its fence): a history shows whose term each write was
    ts: float = 0.0
    seq: int = 0
    asked: dict[str, str] = field(default_factory=dict)  # worker -> node: asked to start, not seen on its way yet
    retiring: list[str] = field(default_factory=list)  # drained by us, not stopped yet
    parked: list[str] = field(default_factory=list)  # retired and stopped: brought back first
    # An actuator that names its workers (Kubernetes): the pool's registered workers when this was decided. One
    # registered since fulfils an asked placeholder.
    members: list[str] = field(default_factory=list)
    observed: dict[str, float | None] = field(default_factory=dict)  # what the decision saw (Observation)

    def to_json(self) -> bytes:
        return orjson.dumps(self.__dict__)

    @classmethod
    def from_json(cls, raw: bytes) -> PoolRecord:
        body = orjson.loads(raw)
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in body.items() if k in known})


def make_policy(config: AutoscaleConfig, capacity: CapacityModel, pool: Role = "aggregated") -> Policy:
    """``pool``'s policy; ``capacity`` is the aggregated model (:func:`capacity_for`), which a prefill or decode
    pool without a capacity file of its own derives its capacity from (:func:`pool_capacity`)."""
    sla = Sla(config.ttft_s, config.itl_s, config.ttft_per_1k_s)
    lo, hi = config.min_workers, config.max_workers
    if config.policy == "fleetward":
        return Planner(pool_capacity(config, capacity, pool), sla, min_workers=lo, max_workers=hi,
                       predictor=config.predictor, headroom=config.headroom, down_stable=config.down_stable,
                       margin_quantile=config.margin_quantile, trust_max=config.capacity_trust_max)
    if config.policy == "reactive":
        return Reactive(min_workers=lo, max_workers=hi)
    if config.policy == "dynamo-style":
        return DynamoStyle(pool_capacity(config, capacity, pool), sla, min_workers=lo, max_workers=hi)
    return StaticPeak(hi)


def _pool_file(config: AutoscaleConfig, pool: Role) -> Path | None:
    return config.prefill_capacity if pool == "prefill" else config.decode_capacity if pool == "decode" else None


def pool_capacity(config: AutoscaleConfig, capacity: CapacityModel, pool: Role) -> PoolCapacity:
    """What one worker of ``pool`` carries: the aggregated model ``capacity`` for an aggregated pool; for a
    prefill or decode pool, its own file (``autoscale.prefill_capacity``, ``decode_capacity``: measured on a
    worker of that role), else derived from ``capacity``. ``startup_s`` overrides the file's."""
    path = _pool_file(config, pool)
    if path is None:
        return PoolCapacity.derived(capacity, pool)
    model = CapacityModel.load(Path(path))
    if config.startup_s is not None:
        model = dataclasses.replace(model, startup_s=config.startup_s)
    return PoolCapacity.measured(model, pool)


def capacity_for(config: AutoscaleConfig, *, backend: str, sim: SimConfig | None = None) -> CapacityModel:
    """The capacity model the planner uses: the config's file, else its flat ``per_worker_rps``, else (sim
    backend) the simulated worker profiled in the fleet simulator. ``startup_s`` overrides the model's.

    It is an aggregated worker's: prefill and decode pools without a capacity file of their own derive theirs
    from it (:func:`pool_capacity`). When every pool has its own file, none is needed: the first pool's
    model is returned. Every pool's capacity is checked here, so a bad one is refused at start-up."""
    sla = Sla(config.ttft_s, config.itl_s, config.ttft_per_1k_s)
    worker = backend_class(backend)
    default_startup = worker.default_startup_s
    own = [_pool_file(config, pool) for pool in config.pools]
    if config.capacity is not None:
        model = CapacityModel.load(Path(config.capacity))
    elif config.per_worker_rps is not None:
        r = config.per_worker_rps
        # Within the SLA up to r, far beyond it just above: max_rate() interpolates to r.
        model = CapacityModel((CapacityPoint(r, 0.0, 0.0), CapacityPoint(r * 1.001, 1e9, 1e9)), default_startup)
    elif all(path is not None for path in own):
        model = CapacityModel.load(Path(next(path for path in own if path is not None)))
    elif worker.simulated:
        from fleetward.autoscale.simulate import profile_capacity
        from fleetward.autoscale.traces import TraceRequest

        sample = [TraceRequest(0.0, 64 * (1 + i % 8), 32 * (1 + i % 5)) for i in range(40)]
        model = profile_capacity(sample, startup_s=default_startup, config=sim or SimConfig(), duration_s=120.0,
                                 sla=sla)
    else:
        raise ConfigError("the autoscaler needs a capacity model for vLLM workers: `fleetward profile` (or "
                          "`fleetward profile --url` on a running server) writes one for autoscale.capacity; or set "
                          "autoscale.per_worker_rps", field="autoscale.capacity")
    if config.startup_s is not None:
        model = dataclasses.replace(model, startup_s=config.startup_s)
    for pool in config.pools:  # a clear error now if a pool's capacity is missing or no load meets the SLA
        pool_capacity(config, model, pool).max_rate(sla)
    return model


class _Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.leader = Gauge("fleetward_autoscaler_is_leader", "1 while this autoscaler leads.", registry=r)
        self.leaderships = Counter("fleetward_autoscaler_leadership_changes",
                                   "Times this autoscaler became the leader.", registry=r)
        self.desired = Gauge("fleetward_autoscaler_desired_workers", "Serving workers the planner wants.",
                             ["pool"], registry=r)
        self.workers = Gauge("fleetward_autoscaler_workers", "Workers of a pool by what the planner counts them as.",
                             ["pool", "state"], registry=r)
        self.arrivals = Gauge("fleetward_autoscaler_arrival_rate", "Requests/s over the last interval.", ["pool"],
                              registry=r)
        self.scaled = Counter("fleetward_autoscaler_scale_events", "Workers started or retired.",
                              ["pool", "direction"], registry=r)
        self.errors = Counter("fleetward_autoscaler_actuation_errors", "Scaling steps that could not be carried out.",
                              ["pool"], registry=r)
        self.attainment = Gauge("fleetward_autoscaler_sla_attainment_ratio",
                                "Share of the last interval's requests within the SLA (slo: ttft or itl; a prefill "
                                "pool reports ttft only, a decode pool itl only), from the routers' histograms, "
                                "interpolated within a bucket.", ["pool", "slo"], registry=r)


class Autoscaler(LeaderElected):
    def __init__(self, config: AutoscaleConfig, *, store: StateStore, bus: EventBus, keys: Keys,
                 capacity: CapacityModel, actuator: Actuator, autoscaler_id: str | None = None, url: str = "",
                 clock: Clock = SYSTEM_CLOCK, observer: Observer | None = None,
                 policy_factory: Callable[[], Policy] | None = None) -> None:
        self.config, self.store, self.bus, self.keys = config, store, bus, keys
        self.capacity, self.actuator, self.clock = capacity, actuator, clock
        # Kubernetes: new workers are pods the ReplicaSet names, so asked ids are placeholders (actuate.py).
        self.names_workers = bool(getattr(actuator, "names_workers", False))
        self.id = autoscaler_id or f"autoscaler-{uuid.uuid4().hex[:8]}"
        self.url = url
        self.observer = observer or Observer(store, keys, clock=clock)
        self._policy_factory: Callable[[Role], Policy] = (
            (lambda pool: policy_factory()) if policy_factory is not None
            else (lambda pool: make_policy(config, capacity, pool)))
        self.policies: dict[str, Policy] = {}
        self.records: dict[str, PoolRecord] = {}
        self.metrics = _Metrics()
        self.leadership = Leadership(is_leader=self.metrics.leader, changes=self.metrics.leaderships)
        link_gauges(self.metrics.registry, store=store, bus=bus)
        self.steps = 0  # intervals planned while leading (tests wait on it)
        self.on_step: Callable[[dict[str, PoolRecord]], None] | None = None

    async def run(self) -> None:
        """Campaign, lead until leadership is lost, campaign again; until cancelled."""

        def leading(election: Election) -> None:
            log.info("autoscaler %s leads cluster %s", self.id, self.keys.cluster)

        try:
            await lead_forever(self.store, self.keys.leader("autoscaler"), name=f"autoscaler {self.id}",
                               candidate=json.dumps({"id": self.id, "url": self.url}), ttl_s=self.config.lease_ttl_s,
                               lead=self._lead, leadership=self.leadership, on_leading=leading, clock=self.clock)
        finally:
            await self.observer.aclose()

    async def _lead(self, lease: LeaseKeeper) -> None:
        await self._resume()
        lost = asyncio.create_task(lease.lost.wait())
        try:
            while True:
                try:
                    await self.step()
                except ActuationError as exc:
                    log.warning("scaling step not carried out: %s (tried again next interval)", exc)
                if lost.done():
                    raise LeadershipLost("the leadership lease expired")
                sleep = asyncio.create_task(self.clock.sleep(self.config.interval_s))
                await asyncio.wait({sleep, lost}, return_when=asyncio.FIRST_COMPLETED)
                sleep.cancel()
                if lost.done():
                    raise LeadershipLost("the leadership lease expired")
        finally:
            lost.cancel()

    async def _resume(self) -> None:
        """Pick up where the last leader stopped: its records, and each planner at its last decision."""
        self.policies = {pool: self._policy_factory(pool) for pool in self.config.pools}
        self.records = {pool: PoolRecord(pool) for pool in self.config.pools}
        for pool in self.config.pools:
            kv = await self.store.get(self.keys.scale_of(pool))
            if kv is None:
                continue
            try:
                rec = PoolRecord.from_json(kv.value)
            except (ValueError, TypeError) as exc:
                log.warning("ignoring malformed %s: %s", self.keys.scale_of(pool), exc)
                continue
            self.records[pool] = rec
            resume = getattr(self.policies[pool], "resume", None)
            if resume is not None:
                resume(rec.desired)
            log.info("%s: resuming at %d worker(s) (asked for %s, retiring %s)", pool, rec.desired,
                     sorted(rec.asked) or "none", rec.retiring or "none")

    # -- one interval -----------------------------------------------------------------------------------

    def _known(self) -> dict[str, str]:
        return {w: r.pool for r in self.records.values() for w in [*r.asked, *r.retiring, *r.parked]}

    async def step(self) -> dict[str, PoolRecord]:
        """Observe, decide and act once for every pool; the records written."""
        fleet = await read_fleet(self.store, self.keys)
        seen = await self.observer.observe(self.config.pools, self.config.interval_s, self._known(), fleet)
        for pool, (obs, view) in seen.items():
            await self._step_pool(pool, obs, view, fleet)
        self.steps += 1
        if self.on_step is not None:
            self.on_step(dict(self.records))
        return self.records

    async def _step_pool(self, pool: str, obs: Observation, view: PoolView, fleet: FleetSnapshot) -> None:
        rec = self.records[pool]
        self._settle(rec, view)
        waiting_for = [w for w in rec.asked if w not in view.members or view.state_of(w) is HealthState.DEAD]
        obs = dataclasses.replace(obs, starting=obs.starting + len(waiting_for))
        decision = self.policies[pool].decide(obs)
        have = obs.healthy + obs.starting
        add: list[NewWorker] = []
        retire: list[str] = []
        if decision.desired > have:
            add = self._choose_new(pool, decision.desired - have, rec, view, fleet)
        elif decision.desired < have:
            retire = view.least_loaded(min(obs.healthy, have - decision.desired))
        changed = decision.desired != rec.desired
        rec.desired, rec.reason, rec.policy = decision.desired, decision.reason, self.policies[pool].name
        rec.serving, rec.starting, rec.unhealthy = obs.healthy, obs.starting, obs.unhealthy
        rec.observed = {"arrival_rate": round(obs.arrival_rate, 4), "ttft_p99": obs.ttft_p99, "itl_p99": obs.itl_p99,
                        "queue_depth": obs.queue_depth, "kv_usage": round(obs.kv_usage, 4),
                        "mean_input": round(obs.mean_input, 1), "mean_output": round(obs.mean_output, 1)}
        rec.leader, rec.ts, rec.seq = self.id, self.clock.wall(), rec.seq + 1
        for w in add:
            rec.asked[w.id] = w.node
            if w.id in rec.parked:
                rec.parked.remove(w.id)
        rec.retiring += [w for w in retire if w not in rec.retiring]
        await self._write(rec)  # the decision and what it asks for, before acting on it
        self._gauges(pool, rec, obs)
        again = [NewWorker(w, rec.asked[w], revive=view.state_of(w) is HealthState.DEAD)
                 for w in waiting_for if w not in {a.id for a in add}]
        try:
            if add or again:
                await self.actuator.add(pool, [*add, *again], decision.reason)
            # Retiring, and not draining or stopped yet: the drain was never asked (a leader cut off) or failed.
            # An actuator that names its workers is also asked again while they drain: it removes a retiree's
            # pod only once its drain has ended.
            pending_retire = [w for w in rec.retiring if view.state_of(w) not in (None, HealthState.DEAD)
                              and (self.names_workers or view.state_of(w) is not HealthState.DRAINING)]
            if pending_retire:
                await self.actuator.retire(pool, pending_retire, self.config.drain_deadline_s, decision.reason)
        except ActuationError:
            self.metrics.errors.labels(pool).inc()
            raise
        finally:
            if add:
                self.metrics.scaled.labels(pool, "up").inc(len(add))
            if retire:
                self.metrics.scaled.labels(pool, "down").inc(len(retire))
            if changed or add or retire:
                await self.bus.publish("scale", pool=pool, desired=rec.desired, serving=rec.serving,
                                       starting=rec.starting, unhealthy=rec.unhealthy, reason=rec.reason,
                                       policy=rec.policy, started=[w.id for w in add] or None,
                                       retired=retire or None, leader=self.id)
                log.info("%s: %d serving, %d starting -> want %d (%s)%s%s", pool, obs.healthy, obs.starting,
                         rec.desired, rec.reason, f"; starting {[w.id for w in add]}" if add else "",
                         f"; retiring {retire}" if retire else "")

    def _settle(self, rec: PoolRecord, view: PoolView) -> None:
        """Fold what happened since the last interval into the record."""
        if self.names_workers:
            # Each worker of the pool registered since the last decision fulfils the oldest placeholder.
            registered = sorted(w for w, m in view.members.items() if m.registered)
            fresh = [w for w in registered if w not in rec.members and view.state_of(w) is not HealthState.DEAD]
            for _ in fresh[:len(rec.asked)]:
                del rec.asked[next(iter(rec.asked))]
            rec.members = registered
        for w in list(rec.asked):
            state = view.state_of(w)
            if state is not None and state is not HealthState.DEAD:
                del rec.asked[w]  # on its way (starting) or serving: counted by the observation now
        for w in list(rec.retiring):
            state = view.state_of(w)
            if state is HealthState.DEAD or state is None:
                rec.retiring.remove(w)
                # A retired pod is gone for good: its replacement is a new pod with a name of its own.
                if state is HealthState.DEAD and w not in rec.parked and not self.names_workers:
                    rec.parked.append(w)
        rec.parked = [w for w in rec.parked if view.state_of(w) is HealthState.DEAD]

    def _choose_new(self, pool: str, n: int, rec: PoolRecord, view: PoolView, fleet: FleetSnapshot) -> list[NewWorker]:
        out: list[NewWorker] = []
        for w in rec.parked[:n]:
            m = view.members.get(w)
            out.append(NewWorker(w, (m.node if m is not None else None) or self._nodes(view, rec)[0], revive=True))
        taken = set(fleet.workers) | set(fleet.health) | set(self._known())
        load = {node: 0 for node in self._nodes(view, rec)}
        for m in view.members.values():
            if m.node in load and (m.serving or m.starting):
                load[m.node] += 1
        for node in rec.asked.values():
            if node in load:
                load[node] += 1
        while len(out) < n:
            node = min(load, key=lambda x: (load[x], x))
            k = 0
            while f"{node}-w{k}" in taken:
                k += 1
            wid = f"{node}-w{k}"
            taken.add(wid)
            load[node] += 1
            out.append(NewWorker(wid, node))
        return out

    def _nodes(self, view: PoolView, rec: PoolRecord) -> list[str]:
        nodes = list(self.config.nodes) or sorted({m.node for m in view.members.values() if m.node}
                                                  | set(rec.asked.values()))
        if not nodes and self.names_workers:
            return [view.pool]  # only a hint: the ReplicaSet names and places new pods
        if not nodes:
            raise ActuationError(f"{view.pool}: no node is known to start a worker on (no worker of the pool runs): "
                                 "set autoscale.nodes")
        return nodes

    async def _write(self, rec: PoolRecord) -> None:
        assert self.election is not None
        rec.term = self.election.create_revision
        result = await self.store.txn([self.election.fence], [Put(self.keys.scale_of(rec.pool), rec.to_json())])
        if not result.succeeded:
            raise LeadershipLost("a fenced write failed: another autoscaler leads")

    def _gauges(self, pool: str, rec: PoolRecord, obs: Observation) -> None:
        m = self.metrics
        m.desired.labels(pool).set(rec.desired)
        m.arrivals.labels(pool).set(obs.arrival_rate)
        for state, n in (("serving", obs.healthy), ("starting", obs.starting), ("unhealthy", obs.unhealthy),
                         ("retiring", len(rec.retiring)), ("parked", len(rec.parked))):
            m.workers.labels(pool, state).set(n)
        for slo, bound, buckets in (("ttft", self.config.ttft_s, self.observer.ttft),
                                    ("itl", self.config.itl_s, self.observer.itl)):
            if slo not in SLOS[pool]:  # a prefill pool is judged on TTFT only, a decode pool on ITL only
                continue
            share = fraction_within(bound, buckets)
            if share is not None:  # an interval without requests says nothing either way
                m.attainment.labels(pool, slo).set(share)

    # -- HTTP -------------------------------------------------------------------------------------------

    def app(self) -> FastAPI:
        app = FastAPI(title="fleetward autoscaler", docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        return app



async def serve_autoscaler(config: AutoscaleConfig, *, etcd: str, mqtt: str, cluster: str, admin_token: str,
                           capacity: CapacityModel, autoscaler_id: str | None = None,
                           on_ready: Callable[[Autoscaler], None] | None = None,
                           etcd_access: Access | None = None, mqtt_access: Access | None = None) -> None:
    """Run an autoscaler process: campaign and lead, /health and /metrics on ``config.port``, until SIGTERM."""
    from fleetward.autoscale.actuate import LocalActuator
    from fleetward.fleet.bus import MqttBus
    from fleetward.fleet.etcd import EtcdStore
    from fleetward.fleet.launch import serve_app
    from fleetward.fleet.procs import listening_socket

    sock = listening_socket(config.host, config.port, name="autoscaler")  # before it is advertised
    port = sock.getsockname()[1]
    keys = Keys(cluster)
    store = EtcdStore(etcd, access=etcd_access)
    await store.get(keys.root)
    bus = await MqttBus(mqtt, cluster, access=mqtt_access).start()
    actuator: Actuator
    try:
        if config.actuator == "kubernetes":
            from fleetward.autoscale.kubernetes import Limits, open_kubernetes_actuator  # the kubernetes extra

            actuator = await open_kubernetes_actuator(config.kubernetes, store=store, keys=keys,
                                                      admin_token=admin_token,
                                                      limits=Limits(config.min_workers, config.max_workers))
        else:
            actuator = LocalActuator(store, keys, admin_token)
    except BaseException:
        await bus.aclose()
        await store.aclose()
        raise
    scaler = Autoscaler(config, store=store, bus=bus, keys=keys, capacity=capacity, actuator=actuator,
                        autoscaler_id=autoscaler_id, url=f"http://{config.host}:{port}")

    try:
        await serve_app(scaler.app(), sock=sock, main=scaler.run, name="autoscaler",
                        on_ready=None if on_ready is None else lambda: on_ready(scaler))
    finally:
        await actuator.aclose()
        await bus.aclose()
        await store.aclose()
