"""Control-plane faults: etcd members, the etcd leader, leases, the broker, routers, the supervisor leader.

etcd faults need the fleet's own cluster (``TestFleet(etcd_members=3)``: members ``etcd-0``..``etcd-2``,
every component gets every endpoint); the broker fault needs ``own_broker=True``; lease expiry needs the
component's etcd link (``proxy_control=True``).

==========================  =============================================================================
fault                       what happens
==========================  =============================================================================
``etcd-member-kill``        SIGKILL a member; recovery starts it again on its data (it rejoins)
``etcd-member-pause``       SIGSTOP a member (its port still accepts, nothing answers); recovery SIGCONTs
``etcd-member-restart``     stop (SIGTERM or SIGKILL) and start a member at once; verify sees a new process
``etcd-leader-loss``        find the leader (maintenance status of each member) and SIGKILL it; verify sees a
                            new leader elected among the others; recovery restarts the old one
``lease-expiry``            partition a component (the node agent, or a router) from etcd until its lease
                            expires (its keys vanish); recovery heals the link; recovered = its keys are back
``broker-restart``          kill (or stop) the broker; recovery starts it again (same port, persistence)
``router-restart``          SIGKILL a router; recovery starts it again (same id, port and links)
``supervisor-leader-kill``  placeholder: needs the ``supervisor`` service (:class:`SupervisorControl`), which
                            the supervisor provides; without it injection raises ``FaultUnavailable``
==========================  =============================================================================
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any, Literal, Protocol

import httpx
import psutil
from pydantic import Field

from fleetward.chaos.fault import FaultContext, Target
from fleetward.chaos.faults._base import (
    BaseFault,
    FaultParams,
    FaultUnavailable,
    catalogued,
    eventually,
    fleet_of,
    quietly,
)
from fleetward.chaos.proxy import Link, Partition
from fleetward.fleet.infra import LocalEtcd

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


def _members(ctx: FaultContext) -> list[LocalEtcd]:
    fleet = fleet_of(ctx)
    if not getattr(fleet, "etcd_cluster", None):
        raise FaultUnavailable("etcd faults need the fleet's own etcd cluster (TestFleet(etcd_members=3))")
    return list(fleet.etcd_cluster)


class _EtcdFault(BaseFault):
    family = "control"

    async def _start(self, fleet: Any, m: LocalEtcd) -> None:
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
class EtcdMemberKill(_EtcdFault):
    name = "etcd-member-kill"
    Params = EtcdKillParams

    def __init__(self, params: Any, target: Target) -> None:
        super().__init__(params, target)
        self._killed: list[LocalEtcd] = []

    async def inject(self, ctx: FaultContext) -> None:
        fleet = fleet_of(ctx)
        self.targets = ctx.resolve(self.target)
        for name in self.targets:
            m = fleet.etcd_member(name)
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
        fleet = fleet_of(ctx)
        params: Any = self.params
        if params.restart:
            for m in self._killed:
                await quietly(f"start {m.name}", self._start(fleet, m))


@catalogued("SIGSTOP an etcd member (it accepts connections, answers nothing); recovery SIGCONTs it", target="etcd")
class EtcdMemberPause(_EtcdFault):
    name = "etcd-member-pause"
    Params = FaultParams

    def __init__(self, params: Any, target: Target) -> None:
        super().__init__(params, target)
        self._paused: list[LocalEtcd] = []

    async def inject(self, ctx: FaultContext) -> None:
        fleet = fleet_of(ctx)
        self.targets = ctx.resolve(self.target)
        for name in self.targets:
            m = fleet.etcd_member(name)
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
class EtcdMemberRestart(_EtcdFault):
    name = "etcd-member-restart"
    Params = EtcdRestartParams

    def __init__(self, params: Any, target: Target) -> None:
        super().__init__(params, target)
        self._old: dict[str, int] = {}
        self._members: list[LocalEtcd] = []

    async def inject(self, ctx: FaultContext) -> None:
        fleet = fleet_of(ctx)
        self.targets = ctx.resolve(self.target)
        params: Any = self.params
        for name in self.targets:
            m = fleet.etcd_member(name)
            assert m.process is not None
            self._old[name] = m.process.pid
            self._members.append(m)
            if params.signal == "SIGKILL":
                m.process.kill()
            await m.process.stop(grace=5)
            m.start(fleet.log_dir)

    async def verify(self, ctx: FaultContext) -> bool:
        def restarted() -> bool:
            return all(m.process is not None and m.process.is_running and m.process.pid != self._old[m.name]
                       for m in self._members)

        return bool(self._members) and await eventually(restarted, self.params.verify_timeout_s)

    async def recover(self, ctx: FaultContext) -> None:
        fleet = fleet_of(ctx)
        for m in self._members:
            if m.process is None or not m.process.is_running:
                await quietly(f"start {m.name}", self._start(fleet, m))
            else:
                await quietly(f"wait for {m.name}", m.wait_ready(timeout=self.params.recover_timeout_s))


@catalogued("SIGKILL the current etcd leader; a new one is elected; recovery restarts the old one", target="etcd")
class EtcdLeaderLoss(_EtcdFault):
    name = "etcd-leader-loss"
    Params = EtcdKillParams

    def __init__(self, params: Any, target: Target) -> None:
        super().__init__(params, target)
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
        params: Any = self.params
        if self._killed is not None and params.restart:
            await quietly(f"start {self._killed.name}", self._start(fleet_of(ctx), self._killed))


class LeaseParams(FaultParams):
    verify_timeout_s: float = Field(30.0, gt=0, description="how long to wait for the lease to expire")


@catalogued("partition the node agent or a router from etcd until its lease expires (its keys vanish)",
            target="link")
class LeaseExpiry(BaseFault):
    """Targets: ``Target(kind="link", ids=("agent->etcd",))`` or ``Target(kind="router", ids=("r0",))``."""

    name = "lease-expiry"
    family = "control"
    Params = LeaseParams

    def __init__(self, params: Any, target: Target) -> None:
        super().__init__(params, target)
        self._added: list[tuple[Link, Partition]] = []
        self._keys: list[str] = []

    async def inject(self, ctx: FaultContext) -> None:
        fleet = fleet_of(ctx)
        if self.target.kind == "router":
            names = [f"{r}->etcd" for r in ctx.resolve(self.target)]
        elif self.target.kind == "link":
            names = ctx.resolve(self.target)
        else:
            raise FaultUnavailable("lease-expiry targets an etcd link (agent->etcd, <router>->etcd) or a router")
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
class BrokerRestart(BaseFault):
    name = "broker-restart"
    family = "control"
    Params = BrokerParams

    def __init__(self, params: Any, target: Target) -> None:
        super().__init__(params, target)
        self._broker: Any = None

    async def inject(self, ctx: FaultContext) -> None:
        fleet = fleet_of(ctx)
        if fleet.broker_impl is None:
            raise FaultUnavailable("broker faults need the fleet's own broker (TestFleet(own_broker=True))")
        self.targets = ["broker"]
        self._broker = fleet.broker_impl
        params: Any = self.params
        if params.kill:
            self._broker.process.kill()
        await self._broker.process.stop(grace=5)

    async def verify(self, ctx: FaultContext) -> bool:
        return self._broker is not None and await eventually(
            lambda: self._refusing(), self.params.verify_timeout_s)

    async def _refusing(self) -> bool:
        return not await self._broker.accepting()

    async def recover(self, ctx: FaultContext) -> None:
        if self._broker is not None and not await self._broker.accepting():
            await quietly("start the broker", fleet_of(ctx).restart_broker())

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        return self._broker is not None and await eventually(self._broker.accepting, self.params.recover_timeout_s)


@catalogued("SIGKILL a router; recovery starts it again (same id, port and links)", target="router")
class RouterRestart(BaseFault):
    name = "router-restart"
    family = "control"
    Params = FaultParams

    def __init__(self, params: Any, target: Target) -> None:
        super().__init__(params, target)
        self._routers: list[Any] = []

    async def inject(self, ctx: FaultContext) -> None:
        fleet = fleet_of(ctx)
        self.targets = ctx.resolve(self.target)
        for rid in self.targets:
            r = fleet.router(rid)
            self._routers.append(r)
            fleet.kill_router(r)

    async def verify(self, ctx: FaultContext) -> bool:
        return bool(self._routers) and await eventually(
            lambda: not any(r.process.is_running for r in self._routers), self.params.verify_timeout_s)

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
    """What ``supervisor-leader-kill`` needs from the supervisor (``ctx.service("supervisor")``)."""

    async def leader(self) -> str | None:
        """The id of the controller that leads now."""
        ...

    async def kill(self, controller: str) -> None:
        """Kill that controller abruptly (no resignation: its lease must expire)."""
        ...

    async def restart(self, controller: str) -> None:
        """Start that controller again (it campaigns as a follower)."""
        ...


@catalogued("kill the supervisor's leader; another controller takes over (needs the supervisor service)",
            target="supervisor", placeholder=True)
class SupervisorLeaderKill(BaseFault):
    name = "supervisor-leader-kill"
    family = "control"
    Params = FaultParams

    def __init__(self, params: Any, target: Target) -> None:
        super().__init__(params, target)
        self._sup: SupervisorControl | None = None
        self._old: str | None = None

    async def inject(self, ctx: FaultContext) -> None:
        try:
            self._sup = ctx.service("supervisor")
        except KeyError:
            raise FaultUnavailable("supervisor-leader-kill needs the `supervisor` service (SupervisorControl), "
                                   "which the supervisor provides") from None
        self._old = await self._sup.leader()
        if self._old is None:
            raise FaultUnavailable("the supervisor has no leader to kill")
        self.targets = [self._old]
        await self._sup.kill(self._old)

    async def verify(self, ctx: FaultContext) -> bool:
        async def replaced() -> bool:
            assert self._sup is not None
            now = await self._sup.leader()
            return now is not None and now != self._old

        return self._sup is not None and await eventually(replaced, self.params.verify_timeout_s, 0.1)

    async def recover(self, ctx: FaultContext) -> None:
        if self._sup is not None and self._old is not None:
            await quietly(f"restart {self._old}", self._sup.restart(self._old))

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        sup = self._sup
        return sup is not None and await eventually(lambda: sup.leader(), self.params.recover_timeout_s, 0.1)
