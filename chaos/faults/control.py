"""Control-plane faults: etcd members, the etcd leader, leases, the broker, routers, the supervisor leader.

etcd faults need the fleet's own cluster (``TestFleet(etcd_members=3)``: members ``etcd-0``..``etcd-2``,
every component gets every endpoint); the broker fault needs ``own_broker=True``; lease expiry needs the
component's etcd link (``proxy_control=True``).

==================================  =============================================================================
fault                               what happens
==================================  =============================================================================
``control.etcd_member_kill``        SIGKILL a member; recovery starts it again on its data (it rejoins)
``control.etcd_member_pause``       SIGSTOP a member (its port still accepts, nothing answers); recovery SIGCONTs
``control.etcd_member_restart``     stop (SIGTERM or SIGKILL) and start a member at once; verify sees a new process
``control.etcd_leader_loss``        find the leader (maintenance status of each member) and SIGKILL it; verify sees a
                                    new leader elected among the others; recovery restarts the old one
``control.lease_expiry``            partition a component (the node agent, or a router) from etcd until its lease
                                    expires (its keys vanish); recovery heals the link; recovered = its keys are back
``control.broker_restart``          kill (or stop) the broker; recovery starts it again (same port, persistence)
``control.router_restart``          SIGKILL a router; recovery starts it again (same id, port and links)
``control.supervisor_leader_kill``  SIGKILL the supervisor's leader (the ``supervisor`` service,
                                    :class:`SupervisorControl`: two or more controllers); verify sees a standby
                                    lead and nothing done twice; recovery starts the old one again (a standby)
==================================  =============================================================================
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import signal
import time
from typing import Any, Literal, Protocol

import httpx
import orjson
import psutil
from pydantic import Field

from fleetward.chaos.fault import EtcdCluster, FaultContext, OwnBroker
from fleetward.chaos.faults._base import (
    BaseFault,
    FaultParams,
    FaultUnavailable,
    ParamsT,
    catalogued,
    eventually,
    fleet_of,
    quietly,
    service_of,
)
from fleetward.chaos.net import Link, Partition
from fleetward.fleet.bus import MqttBus
from fleetward.fleet.handle import Fleet, RouterRef
from fleetward.fleet.infra import LocalBroker, LocalEtcd

__all__ = ["SupervisorControl", "etcd_leader", "etcd_status"]


async def etcd_status(endpoint: str, *, timeout: float = 1.0) -> dict[str, Any] | None:
    """A member's maintenance status (``member_id``, ``leader``, ``raft_term``), or None if it does not answer."""
    try:
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            r = await client.post(f"http://{endpoint}/v3/maintenance/status", json={})
            body = r.json()
    except (httpx.HTTPError, OSError, ValueError):
        return None
    if r.status_code != 200 or "header" not in body:
        return None
    return {"member_id": str(body["header"].get("member_id", "")), "leader": str(body.get("leader", "")),
            "raft_term": int(body.get("raftTerm", 0) or 0)}


async def etcd_leader(members: list[LocalEtcd]) -> LocalEtcd | None:
    """The member that is the leader, as the live members report it (None when they have none)."""
    statuses = {}
    for m in members:
        if m.process is not None and m.process.is_running:
            s = await etcd_status(m.endpoint)
            if s is not None:
                statuses[m.name] = s
    for m in members:
        s = statuses.get(m.name)
        if s is not None and s["leader"] not in ("", "0") and s["leader"] == s["member_id"]:
            return m
    return None


_NO_CLUSTER = "etcd faults need the fleet's own etcd cluster (TestFleet(etcd_members=3))"


def _cluster(ctx: FaultContext) -> EtcdCluster:
    cluster: EtcdCluster = service_of(ctx, "etcd-cluster", _NO_CLUSTER)
    if not cluster.etcd_cluster:
        raise FaultUnavailable(_NO_CLUSTER)
    return cluster


def _members(ctx: FaultContext) -> list[LocalEtcd]:
    return list(_cluster(ctx).etcd_cluster)


class _EtcdFault(BaseFault[ParamsT]):
    family = "control"

    async def _start(self, fleet: EtcdCluster, m: LocalEtcd) -> None:
        if m.process is not None:
            await m.process.stop(grace=1)  # reap the old one (and SIGCONT it first, if it was paused)
        m.start(fleet.log_dir)
        await m.wait_ready(timeout=self.params.recover_timeout_s)

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        members = _members(ctx)

        async def whole() -> bool:
            return all([await m.healthy() for m in members]) and await etcd_leader(members) is not None

        return await eventually(whole, self.params.recover_timeout_s, 0.1)


class EtcdKillParams(FaultParams):
    restart: bool = Field(True, description="recovery starts the member again")


@catalogued("SIGKILL an etcd member; recovery starts it again (it rejoins with its data)", target="etcd")
class EtcdMemberKill(_EtcdFault[EtcdKillParams]):
    name = "control.etcd_member_kill"

    def setup(self) -> None:
        self._killed: list[LocalEtcd] = []

    async def inject(self, ctx: FaultContext) -> None:
        cluster = _cluster(ctx)
        self.targets = ctx.resolve(self.target)
        for name in self.targets:
            m = cluster.etcd_member(name)
            self._killed.append(m)
            assert m.process is not None
            m.process.kill()

    async def verify(self, ctx: FaultContext) -> bool:
        async def down() -> bool:
            for m in self._killed:
                if m.process is not None and m.process.is_running:
                    return False
                try:
                    await asyncio.wait_for(asyncio.open_connection(m.host, m.client_port), 0.5)
                    return False
                except (OSError, TimeoutError):
                    pass
            return True

        return bool(self._killed) and await eventually(down, self.params.verify_timeout_s)

    async def recover(self, ctx: FaultContext) -> None:
        cluster = _cluster(ctx)
        params = self.params
        if params.restart:
            for m in self._killed:
                await quietly(f"start {m.name}", self._start(cluster, m))


@catalogued("SIGSTOP an etcd member (it accepts connections, answers nothing); recovery SIGCONTs it", target="etcd")
class EtcdMemberPause(_EtcdFault[FaultParams]):
    name = "control.etcd_member_pause"

    def setup(self) -> None:
        self._paused: list[LocalEtcd] = []

    async def inject(self, ctx: FaultContext) -> None:
        cluster = _cluster(ctx)
        self.targets = ctx.resolve(self.target)
        for name in self.targets:
            m = cluster.etcd_member(name)
            self._paused.append(m)
            assert m.process is not None
            m.process.signal(signal.SIGSTOP)

    async def verify(self, ctx: FaultContext) -> bool:
        async def paused() -> bool:
            for m in self._paused:
                assert m.process is not None
                if psutil.Process(m.process.pid).status() != psutil.STATUS_STOPPED:
                    return False
                if await etcd_status(m.endpoint, timeout=0.5) is not None:
                    return False
            return True

        return bool(self._paused) and await eventually(paused, self.params.verify_timeout_s)

    async def recover(self, ctx: FaultContext) -> None:
        for m in self._paused:
            if m.process is not None:
                m.process.signal(signal.SIGCONT)


class EtcdRestartParams(FaultParams):
    signal: Literal["SIGTERM", "SIGKILL"] = "SIGTERM"


@catalogued("stop an etcd member (SIGTERM or SIGKILL) and start it again at once", target="etcd")
class EtcdMemberRestart(_EtcdFault[EtcdRestartParams]):
    name = "control.etcd_member_restart"

    def setup(self) -> None:
        self._old: dict[str, int] = {}
        self._members: list[LocalEtcd] = []

    async def inject(self, ctx: FaultContext) -> None:
        cluster = _cluster(ctx)
        self.targets = ctx.resolve(self.target)
        params = self.params
        for name in self.targets:
            m = cluster.etcd_member(name)
            assert m.process is not None
            self._old[name] = m.process.pid
            self._members.append(m)
            if params.signal == "SIGKILL":
                m.process.kill()
            await m.process.stop(grace=5)
            m.start(cluster.log_dir)

    async def verify(self, ctx: FaultContext) -> bool:
        def restarted() -> bool:
            return all(m.process is not None and m.process.is_running and m.process.pid != self._old[m.name]
                       for m in self._members)

        return bool(self._members) and await eventually(restarted, self.params.verify_timeout_s)

    async def recover(self, ctx: FaultContext) -> None:
        cluster = _cluster(ctx)
        for m in self._members:
            if m.process is None or not m.process.is_running:
                await quietly(f"start {m.name}", self._start(cluster, m))
            else:
                await quietly(f"wait for {m.name}", m.wait_ready(timeout=self.params.recover_timeout_s))


@catalogued("SIGKILL the current etcd leader; a new one is elected; recovery restarts the old one", target="etcd")
class EtcdLeaderLoss(_EtcdFault[EtcdKillParams]):
    name = "control.etcd_leader_loss"

    def setup(self) -> None:
        self._killed: LocalEtcd | None = None
        self._old_id = ""

    async def inject(self, ctx: FaultContext) -> None:
        members = _members(ctx)
        leader = None
        if await eventually(lambda: self._find(members), self.params.verify_timeout_s):
            leader = self._leader
        if leader is None:
            raise FaultUnavailable("the etcd cluster has no leader to kill")
        status = await etcd_status(leader.endpoint)
        self._old_id = status["member_id"] if status else ""
        self.targets = [leader.name]
        self._killed = leader
        assert leader.process is not None
        leader.process.kill()

    _leader: LocalEtcd | None = None

    async def _find(self, members: list[LocalEtcd]) -> bool:
        self._leader = await etcd_leader(members)
        return self._leader is not None

    async def verify(self, ctx: FaultContext) -> bool:
        members = [m for m in _members(ctx) if m is not self._killed]

        async def new_leader() -> bool:
            m = await etcd_leader(members)
            if m is None:
                return False
            s = await etcd_status(m.endpoint)
            self.detail["new_leader"] = m.name
            return s is not None and s["member_id"] != self._old_id

        return self._killed is not None and await eventually(new_leader, self.params.verify_timeout_s, 0.1)

    async def recover(self, ctx: FaultContext) -> None:
        params = self.params
        if self._killed is not None and params.restart:
            await quietly(f"start {self._killed.name}", self._start(_cluster(ctx), self._killed))


class LeaseParams(FaultParams):
    verify_timeout_s: float = Field(30.0, gt=0, description="how long to wait for the lease to expire")


@catalogued("partition the node agent or a router from etcd until its lease expires (its keys vanish)",
            target="link")
class LeaseExpiry(BaseFault[LeaseParams]):
    """Targets: ``Target(kind="link", ids=("agent->etcd",))`` or ``Target(kind="router", ids=("r0",))``."""

    name = "control.lease_expiry"
    family = "control"

    def setup(self) -> None:
        self._added: list[tuple[Link, Partition]] = []
        self._keys: list[str] = []

    async def inject(self, ctx: FaultContext) -> None:
        fleet = fleet_of(ctx)
        if self.target.kind == "router":
            names = [f"{r}->etcd" for r in ctx.resolve(self.target)]
        elif self.target.kind == "link":
            names = ctx.resolve(self.target)
        else:
            raise FaultUnavailable("control.lease_expiry targets an etcd link (agent->etcd, <router>->etcd) or a "
                                   "router")
        self.targets = names
        for n in names:
            component = n.removesuffix("->etcd")
            if component == "agent":
                self._keys += [fleet.keys.worker(w) for w in fleet.worker_ids]
            else:
                self._keys.append(fleet.keys.router(component))
        for n in names:
            link: Link = ctx.service(f"proxy:{n}")
            toxic = Partition(direction="both")
            link.add(toxic)
            self._added.append((link, toxic))
        self.detail["keys"] = list(self._keys)

    async def _present(self, ctx: FaultContext) -> list[bool]:
        store = fleet_of(ctx).store
        return [await store.get(k) is not None for k in self._keys]

    async def verify(self, ctx: FaultContext) -> bool:
        async def expired() -> bool:
            return not any(await self._present(ctx))

        return bool(self._keys) and await eventually(expired, self.params.verify_timeout_s, 0.1)

    async def recover(self, ctx: FaultContext) -> None:
        for link, toxic in self._added:
            link.remove(toxic)

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        async def back() -> bool:
            return all(await self._present(ctx))

        return await eventually(back, self.params.recover_timeout_s, 0.1)


class BrokerParams(FaultParams):
    kill: bool = Field(True, description="SIGKILL (a crash); false: an orderly stop")


@catalogued("kill (or stop) the MQTT broker; recovery starts it again on the same port", target="broker")
class BrokerRestart(BaseFault[BrokerParams]):
    name = "control.broker_restart"
    family = "control"

    def setup(self) -> None:
        self._broker: LocalBroker | None = None

    async def inject(self, ctx: FaultContext) -> None:
        why = "broker faults need the fleet's own broker (TestFleet(own_broker=True))"
        own: OwnBroker = service_of(ctx, "broker", why)
        broker = own.broker_impl
        if broker is None or broker.process is None:
            raise FaultUnavailable(why)
        self.targets = ["broker"]
        self._broker = broker
        params = self.params
        if params.kill:
            broker.process.kill()
        await broker.process.stop(grace=5)

    async def verify(self, ctx: FaultContext) -> bool:
        return self._broker is not None and await eventually(
            lambda: self._refusing(), self.params.verify_timeout_s)

    async def _refusing(self) -> bool:
        return self._broker is not None and not await self._broker.accepting()

    async def recover(self, ctx: FaultContext) -> None:
        if self._broker is not None and not await self._broker.accepting():
            own: OwnBroker = ctx.service("broker")
            await quietly("start the broker", own.restart_broker())

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        return self._broker is not None and await eventually(self._broker.accepting, self.params.recover_timeout_s)


@catalogued("SIGKILL a router; recovery starts it again (same id, port and links)", target="router")
class RouterRestart(BaseFault[FaultParams]):
    name = "control.router_restart"
    family = "control"

    def setup(self) -> None:
        self._routers: list[RouterRef] = []

    async def inject(self, ctx: FaultContext) -> None:
        fleet = fleet_of(ctx)
        self.targets = ctx.resolve(self.target)
        by_id = {r.id: r for r in fleet.routers}
        for rid in self.targets:
            r = by_id[rid]
            self._routers.append(r)
            fleet.kill_router(r)

    async def verify(self, ctx: FaultContext) -> bool:
        return bool(self._routers) and await eventually(
            lambda: not any(r.is_running for r in self._routers), self.params.verify_timeout_s)

    async def recover(self, ctx: FaultContext) -> None:
        fleet = fleet_of(ctx)
        for r in self._routers:
            await quietly(f"restart {r.id}", fleet.restart_router(r, timeout=self.params.recover_timeout_s))

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        async def serving() -> bool:
            async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
                return all([(await client.get(f"{r.url}/health")).status_code == 200 for r in self._routers])

        return await eventually(serving, self.params.recover_timeout_s, 0.1)


class SupervisorControl(Protocol):
    """What ``control.supervisor_leader_kill`` needs from the supervisor (``ctx.service("supervisor")``;
    :class:`~fleetward.chaos.harness.HarnessSupervisor` on a test fleet)."""

    async def leader(self) -> str | None:
        """The id of the controller that leads now."""
        ...

    async def kill(self, controller: str) -> None:
        """Kill that controller abruptly (no resignation: its lease must expire)."""
        ...

    async def restart(self, controller: str) -> None:
        """Start that controller again (it campaigns as a follower)."""
        ...

    def is_running(self, controller: str) -> bool:
        """Whether that controller runs (a killed one does not until :meth:`restart`)."""
        ...


class LeaderKillParams(FaultParams):
    verify_timeout_s: float = Field(30.0, gt=0, description="how long a standby may take to lead (the dead "
                                    "leader's lease must expire first: supervisor.lease_ttl_s)")


@catalogued("SIGKILL the supervisor's leader; a standby takes over, and nothing is done twice", target="supervisor",
            requires=("standby",), picks_target=True)
class SupervisorLeaderKill(BaseFault[LeaderKillParams]):
    """The leader is killed without a chance to resign. ``verify`` passes once another controller leads
    and the takeover did nothing twice:

    - no agent carried out an action id twice (the agents' ``action`` events, watched from the injection on);
    - the new leader issued no action that replays old news: an action for a worker whose reason is that
      of a non-ok signal still in etcd from *before* the kill (the old leader saw it and acted; the new
      one read it again when it took over).

    Recovery starts the killed controller again (a standby now). ``verify_recovered`` waits until it runs
    and every action pending at the kill has finished, and checks the above again. The target says how
    many controllers the fault takes (one); which one is the leader at injection.
    """

    name = "control.supervisor_leader_kill"
    family = "control"

    def setup(self) -> None:
        self._sup: SupervisorControl | None = None
        self._old: str | None = None
        self._new: str | None = None
        self._killed_at = 0.0
        self._pending: list[str] = []
        self._carried_out: dict[str, set[str]] = collections.defaultdict(set)  # action id -> event ids
        self._watch: asyncio.Task[None] | None = None

    async def _follow_actions(self, fleet: Fleet, subscribed: asyncio.Event) -> None:
        bus = MqttBus(fleet.mqtt_endpoint, fleet.cluster)
        async for ev in bus.subscribe(("action",), subscribed=subscribed):
            self._carried_out[str(ev.data.get("action"))].add(ev.id)

    async def inject(self, ctx: FaultContext) -> None:
        try:
            sup: SupervisorControl = ctx.service("supervisor")
        except KeyError:
            raise FaultUnavailable("control.supervisor_leader_kill needs the `supervisor` service "
                                   "(SupervisorControl): run two or more controllers (fleet.controllers: 2)") from None
        self._sup = sup
        if not await eventually(sup.leader, self.params.verify_timeout_s, 0.1):
            raise FaultUnavailable("the supervisor has no leader to kill")
        self._old = await sup.leader()
        assert self._old is not None
        actions = await self._actions(ctx)
        self._pending = sorted(a["id"] for a in actions.values() if a.get("status") in ("pending", "running"))
        self.detail.update(killed=self._old, pending_at_kill=self._pending)
        self.targets = [self._old]
        subscribed = asyncio.Event()
        self._watch = asyncio.create_task(self._follow_actions(fleet_of(ctx), subscribed), name="action-events")
        async with asyncio.timeout(15):
            await subscribed.wait()
        self._killed_at = time.time()
        await sup.kill(self._old)

    async def _actions(self, ctx: FaultContext) -> dict[str, dict[str, Any]]:
        fleet = fleet_of(ctx)
        snap = await fleet.store.get_prefix(fleet.keys.actions)
        return {kv.key: orjson.loads(kv.value) for kv in snap.items}

    async def _twice(self, ctx: FaultContext) -> list[str]:
        """What the takeover did twice (see the class docstring), one line each."""
        fleet = fleet_of(ctx)
        out = [f"action {a} carried out {len(events)} times" for a, events in self._carried_out.items()
               if len(events) > 1]
        old_news: dict[str, set[str]] = collections.defaultdict(set)
        for kv in (await fleet.store.get_prefix(fleet.keys.signals)).items:
            with contextlib.suppress(ValueError, KeyError):
                sig = orjson.loads(kv.value)
                if sig.get("severity") != "ok" and float(sig.get("ts", 0)) < self._killed_at:
                    old_news[str(sig["worker"])].add(str(sig.get("reason", "")))
        for a in (await self._actions(ctx)).values():
            if self._new is not None and a.get("issued_by") == self._new and a.get("reason") in old_news[
                    str(a.get("worker"))]:
                out.append(f"{self._new} issued {a['id']} ({a['kind']}) for old news: {a['reason']}")
        return out

    async def verify(self, ctx: FaultContext) -> bool:
        sup = self._sup

        async def replaced() -> bool:
            assert sup is not None
            self._new = await sup.leader()
            return self._new is not None and self._new != self._old

        if sup is None or not await eventually(replaced, self.params.verify_timeout_s, 0.1):
            return False
        self.detail.update(new_leader=self._new, takeover_s=round(time.time() - self._killed_at, 3))
        twice = await self._twice(ctx)
        self.detail["twice"] = twice
        return not twice

    async def recover(self, ctx: FaultContext) -> None:
        if self._sup is not None and self._old is not None:
            await quietly(f"restart {self._old}", self._sup.restart(self._old))

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        try:
            return await self._verify_recovered(ctx)
        finally:
            if self._watch is not None:
                self._watch.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self._watch
                self._watch = None

    async def _verify_recovered(self, ctx: FaultContext) -> bool:
        sup = self._sup
        if sup is None or not await eventually(sup.leader, self.params.recover_timeout_s, 0.1):
            return False
        if self._old is not None and not sup.is_running(self._old):
            return False

        async def finished() -> bool:
            actions = {a["id"]: a for a in (await self._actions(ctx)).values()}
            return all(actions.get(i, {}).get("status") in ("done", "failed") for i in self._pending)

        if not await eventually(finished, self.params.recover_timeout_s, 0.1):
            self.detail["unfinished"] = self._pending
            return False
        twice = await self._twice(ctx)
        self.detail["twice"] = twice
        return not twice
