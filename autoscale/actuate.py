"""Actuators: how a scaling decision becomes workers started and workers retired.

The autoscaler decides *which* workers (ids, a node hint for new ones, which serving ones to retire) and
when; an :class:`Actuator` carries it out. Two calls, both idempotent (a planner that takes over after a
failover may ask again for what its predecessor asked):

- :meth:`Actuator.add`: bring these workers up (new ones, or ones this autoscaler retired earlier);
- :meth:`Actuator.retire`: stop routing new work to these workers, let their streams finish or migrate
  within ``deadline_s``, then stop them.

:class:`LocalActuator` does both through the supervisor leader's control API (HTTP, the admin token): a
new worker is ``POST /v1/workers`` (the node's agent starts it from its backend), a retired one comes back
with ``undrain``, a retirement is ``drain`` with ``then: stop``. The supervisor then owns the worker's
life as for any other: canaries make it ready, its drain ends when its last stream ended or moved.
:class:`~fleetward.autoscale.kubernetes.KubernetesActuator` does both on a Deployment's scale subresource,
with the same drain (:class:`ControlApi`, which both share) first.

An actuator whose platform names and places new workers itself (Kubernetes: a new replica is a pod the
ReplicaSet names) says so with ``names_workers``: the ids the autoscaler asks for are then placeholders, each
one fulfilled by any new worker of the pool, and a retired worker never comes back under its id.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import httpx

from fleetward.fleet.errors import FleetwardError
from fleetward.fleet.etcd import StateStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.registry import read_leader

__all__ = ["ActuationError", "Actuator", "ControlApi", "LocalActuator", "NewWorker"]

log = logging.getLogger(__name__)


class ActuationError(FleetwardError):
    """A scaling step could not be carried out now (the autoscaler tries again next interval)."""


@dataclass(frozen=True, slots=True)
class NewWorker:
    id: str
    node: str  # where it should run (a hint: an actuator with a scheduler may place it elsewhere)
    revive: bool = False  # a worker this autoscaler retired earlier (stopped, its record kept)


class Actuator(Protocol):
    names_workers: bool  # the platform names new workers: asked ids are placeholders (module docstring)

    async def add(self, pool: str, workers: Sequence[NewWorker], reason: str) -> None: ...

    async def retire(self, pool: str, workers: Sequence[str], deadline_s: float, reason: str) -> None: ...

    async def aclose(self) -> None: ...


class ControlApi:
    """The supervisor leader's control API as the actuators call it: the leader found in etcd
    (``leader/supervisor/``) at each call, every request signed with the admin token, and what it refuses
    turned into :class:`ActuationError`."""

    def __init__(self, store: StateStore, keys: Keys, admin_token: str, *, timeout_s: float = 10.0) -> None:
        self.store, self.keys = store, keys
        self._token = admin_token
        self._http = httpx.AsyncClient(timeout=timeout_s, trust_env=False)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def post(self, path: str, body: dict[str, object]) -> httpx.Response:
        leader = await read_leader(self.store, self.keys)
        if leader is None or not leader.url:
            raise ActuationError("no supervisor controller leads (or it has no control API): nothing can start "
                                 "or stop workers now")
        try:
            return await self._http.post(leader.url + path, json=body,
                                         headers={"Authorization": f"Bearer {self._token}"})
        except httpx.HTTPError as exc:
            raise ActuationError(f"the supervisor's control API at {leader.url} did not answer: {exc!r}") from exc

    @staticmethod
    def check(r: httpx.Response, what: str, *, fine: tuple[int, ...] = ()) -> None:
        """Raise :class:`ActuationError` unless ``r`` is a 200 or one of the ``fine`` statuses."""
        if r.status_code == 200 or r.status_code in fine:
            return
        try:
            why = r.json().get("error", r.text)
        except ValueError:
            why = r.text
        raise ActuationError(f"{what}: HTTP {r.status_code}: {why}")

    async def drain(self, worker: str, deadline_s: float, then: Literal["stop", "cordon"]) -> None:
        """The autoscaler's drain of ``worker`` (a scale-down): no new work, its streams finish or move within
        ``deadline_s``, then ``then``. Asking again is harmless (409: being drained already, or not running)."""
        r = await self.post(f"/v1/workers/{worker}/drain", {"deadline_s": deadline_s, "then": then,
                                                            "by": "autoscaler"})
        self.check(r, f"retiring {worker}", fine=(409,))


class LocalActuator:
    """Through the supervisor leader's control API (found in etcd, ``leader/supervisor/``)."""

    names_workers = False

    def __init__(self, store: StateStore, keys: Keys, admin_token: str, *, timeout_s: float = 10.0) -> None:
        self.store, self.keys = store, keys
        self.control = ControlApi(store, keys, admin_token, timeout_s=timeout_s)

    async def aclose(self) -> None:
        await self.control.aclose()

    async def add(self, pool: str, workers: Sequence[NewWorker], reason: str) -> None:
        for w in workers:
            if w.revive:
                r = await self.control.post(f"/v1/workers/{w.id}/undrain", {})
                # 409: it is not drained any more (already coming back): what was asked holds.
                self.control.check(r, f"bringing {w.id} back", fine=(409,))
            else:
                r = await self.control.post("/v1/workers", {"id": w.id, "node": w.node, "role": pool,
                                                            "reason": reason})
                self.control.check(r, f"starting {w.id} on {w.node}", fine=(409,))
            log.info("%s: %s %s (%s)", pool, "reviving" if w.revive else "starting", w.id, reason)

    async def retire(self, pool: str, workers: Sequence[str], deadline_s: float, reason: str) -> None:
        for wid in workers:
            await self.control.drain(wid, deadline_s, "stop")
            log.info("%s: retiring %s within %.0f s (%s)", pool, wid, deadline_s, reason)
