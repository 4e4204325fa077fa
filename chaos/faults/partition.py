"""Partition faults: real packet drops between hosts (network namespaces, nftables), on a fleet of several hosts
(the experiment's ``fleet.hosts``; the ``hosts`` service is its :class:`~fleetward.chaos.hosts.HostsFleet`).

=========================  ===============================================================================
fault                      what happens
=========================  ===============================================================================
``partition.isolate``      the target hosts hear no one and no one hears them (other hosts, clients)
``partition.split``        the hosts in two sides that do not hear each other: ``minority`` hosts on one
                           side, chosen with the etcd leader among them or not (``etcd_leader``); the
                           clients stay with the majority unless told
``partition.cut``          the target hosts and their ``peers`` stop hearing each other, for one
                           ``service`` (etcd, broker, workers, router, controller) or everything: one
                           link (router↔host, agent↔etcd, host↔broker), both directions
``partition.one_way``      packets from the target hosts to ``to`` are dropped, the other way flows
                           (TCP then breaks both ways: a connection needs answers; UDP would not)
=========================  ===============================================================================

Each records a ``partition`` history record when it starts (``minority``: the hosts cut off from a majority,
for the ``minority_quiet`` checker; ``drops``: who stops hearing whom) and when it heals. ``verify`` checks
the drops took effect by connecting across them from the namespaces themselves (a dropped SYN times out; a
port nobody listens on still answers with a reset where packets flow), ``verify_recovered`` that they all
flow again.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from fleetward.chaos.fault import FaultContext
from fleetward.chaos.faults._base import BaseFault, FaultParams, FaultUnavailable, catalogued, eventually, service_of
from fleetward.chaos.hostnet import Drop, HostNetwork

if TYPE_CHECKING:
    from fleetward.chaos.hosts import HostsFleet

__all__ = ["Cut", "Isolate", "OneWay", "Split"]

_NO_HOSTS = "partition faults need a fleet of several hosts (fleet.hosts: 3 or more, as root)"
_PROBE_PORT = 9  # discard: nothing listens, so a flowing path answers with a reset at once


def _hosts(ctx: FaultContext) -> HostsFleet:
    fleet: HostsFleet = service_of(ctx, "hosts", _NO_HOSTS)
    return fleet


class PartitionParams(FaultParams):
    verify_timeout_s: float = Field(5.0, gt=0, le=60, description="how long verify waits for the drops to bite")
    recover_timeout_s: float = Field(10.0, gt=0, le=120)


class _PartitionFault(BaseFault[Any]):
    family = "partition"

    def setup(self) -> None:
        self.drops: list[Drop] = []
        self.minority: list[str] = []
        self._name = ""

    def _drops(self, ctx: FaultContext, fleet: HostsFleet) -> list[Drop]:
        raise NotImplementedError

    async def inject(self, ctx: FaultContext) -> None:
        fleet = _hosts(ctx)
        self.targets = ctx.resolve(self.target) if self.target is not None else []
        self.drops = await self._plan(ctx, fleet)
        if not self.drops:
            raise FaultUnavailable(f"{self.name}: nothing to cut between {self.targets} and the rest")
        self._name = f"{self.name}#{id(self)}"
        fleet.net.partition(self._name, self.drops)
        self.detail.update(drops=[[d.src, d.dst, d.port] for d in self.drops], minority=list(self.minority))
        ctx.record("partition", phase="start", activity=self._name, fault=self.name, minority=list(self.minority),
                   drops=self.detail["drops"])

    async def _plan(self, ctx: FaultContext, fleet: HostsFleet) -> list[Drop]:
        return self._drops(ctx, fleet)

    async def _flowing(self, net: HostNetwork, timeout: float) -> list[bool]:
        """For each drop, whether its path answers at all (accepted or refused) within ``timeout``."""
        return list(await asyncio.gather(*(
            asyncio.to_thread(net.connects, d.src, d.dst, d.port or _PROBE_PORT, timeout=timeout, refused_counts=True)
            for d in self.drops)))

    async def verify(self, ctx: FaultContext) -> bool:
        net = _hosts(ctx).net

        async def all_cut() -> bool:
            return not any(await self._flowing(net, 0.5))

        return bool(self.drops) and await eventually(all_cut, self.params.verify_timeout_s)

    async def recover(self, ctx: FaultContext) -> None:
        fleet = _hosts(ctx)
        if self._name:
            fleet.net.heal(self._name)
            ctx.record("partition", phase="heal", activity=self._name, fault=self.name)

    async def verify_recovered(self, ctx: FaultContext) -> bool:
        net = _hosts(ctx).net

        async def all_flow() -> bool:
            return all(await self._flowing(net, 1.0))

        return await eventually(all_flow, self.params.recover_timeout_s)


def _between(side: list[str], other: list[str]) -> list[Drop]:
    """Every packet between the two sides dropped, both ways."""
    return [d for a in side for b in other for d in (Drop(a, b), Drop(b, a))]


class IsolateParams(PartitionParams):
    leader: Literal["none", "supervisor", "etcd"] = Field(
        "none", description="isolate the host where that leader runs when the fault begins, instead of the target")


@catalogued("the target hosts hear no one and no one hears them (other hosts and the clients)", target="host",
            needs_root=True, requires=("hosts",))
class Isolate(_PartitionFault):
    name = "partition.isolate"
    Params = IsolateParams

    async def _plan(self, ctx: FaultContext, fleet: HostsFleet) -> list[Drop]:
        p: IsolateParams = self.params
        if p.leader != "none":
            host = await (fleet.supervisor_leader_host() if p.leader == "supervisor" else fleet.etcd_leader_host())
            if host is None:
                raise FaultUnavailable(f"{self.name}: no {p.leader} leader to isolate")
            self.targets = [host]
            self.detail["leader_host"] = host
        return self._drops(ctx, fleet)

    def _drops(self, ctx: FaultContext, fleet: HostsFleet) -> list[Drop]:
        others = [h.name for h in fleet.net.nodes if h.name not in self.targets]
        self.minority = list(self.targets)
        return _between(self.targets, others)


class SplitParams(PartitionParams):
    minority: int = Field(1, ge=1, description="how many hosts the smaller side has")
    etcd_leader: Literal["minority", "majority", "any"] = Field(
        "minority", description="where the etcd leader is when the split begins: the side chosen so")
    clients: Literal["majority", "minority"] = Field("majority", description="the side the clients stay with")


@catalogued("the hosts in two sides that do not hear each other; the etcd leader on the side chosen", target="fleet",
            needs_root=True, requires=("hosts",))
class Split(_PartitionFault):
    name = "partition.split"
    Params = SplitParams

    async def _plan(self, ctx: FaultContext, fleet: HostsFleet) -> list[Drop]:
        p: SplitParams = self.params
        hosts = fleet.hosts
        if p.minority * 2 >= len(hosts):
            raise FaultUnavailable(f"{self.name}: a minority of {p.minority} of {len(hosts)} hosts is not a minority")
        leader = await fleet.etcd_leader_host()
        if p.etcd_leader != "any" and leader is None:
            raise FaultUnavailable(f"{self.name}: the etcd cluster has no leader to place")
        order = sorted(hosts, key=lambda h: (h != leader) if p.etcd_leader == "minority" else (h == leader))
        self.minority = order[:p.minority]  # the hosts cut off from the majority (the clients do not count)
        majority = [h for h in hosts if h not in self.minority]
        self.detail["etcd_leader_was"] = leader
        sides = ([*self.minority, *(["clients"] if p.clients == "minority" else [])],
                 [*majority, *(["clients"] if p.clients == "majority" else [])])
        return _between(*sides)


class CutParams(PartitionParams):
    peers: list[str] = Field(default_factory=list, description="the hosts on the other end (default: every other "
                             "host; `clients` names the clients' namespace)")
    service: Literal["any", "etcd", "broker", "workers", "router", "controller"] = Field(
        "any", description="only the traffic to this service (on whichever end serves it), or all of it")


@catalogued("the target hosts and their peers stop hearing each other, for one service or all: one link",
            target="host", needs_root=True, requires=("hosts",))
class Cut(_PartitionFault):
    name = "partition.cut"
    Params = CutParams

    async def _plan(self, ctx: FaultContext, fleet: HostsFleet) -> list[Drop]:
        p: CutParams = self.params
        peers = p.peers or [h for h in fleet.hosts if h not in self.targets]
        for peer in peers:
            fleet.net.host(peer)  # a KeyError names the hosts
        if p.service == "any":
            return _between(self.targets, peers)
        serving = await fleet.service_ports(p.service)
        drops = []
        for t in self.targets:
            for peer in peers:
                drops += [Drop(peer, t, port) for port in serving.get(t, [])]  # the peer's requests to the target
                drops += [Drop(t, peer, port) for port in serving.get(peer, [])]  # the target's to the peer
        return drops


class OneWayParams(PartitionParams):
    to: list[str] = Field(default_factory=list, description="whom the target hosts' packets no longer reach "
                          "(default: every other host and the clients)")


@catalogued("packets from the target hosts to others are dropped; the other way flows", target="host",
            needs_root=True, requires=("hosts",))
class OneWay(_PartitionFault):
    name = "partition.one_way"
    Params = OneWayParams

    def _drops(self, ctx: FaultContext, fleet: HostsFleet) -> list[Drop]:
        p: OneWayParams = self.params
        to = p.to or [h.name for h in fleet.net.nodes if h.name not in self.targets]
        return [Drop(t, o) for t in self.targets for o in to]
