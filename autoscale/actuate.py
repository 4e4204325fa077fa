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
docs/autoscale.md maps the same two calls onto a Kubernetes Deployment's scale subresource.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx

from fleetward.fleet.errors import FleetwardError
from fleetward.fleet.etcd import StateStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.registry import read_leader

__all__ = ["ActuationError", "Actuator", "LocalActuator", "NewWorker"]

log = logging.getLogger(__name__)


class ActuationError(FleetwardError):
    """A scaling step could not be carried out now (the autoscaler tries again next interval)."""


@dataclass(frozen=True, slots=True)
class NewWorker:
    id: str
    node: str  # where it should run (a hint: an actuator with a scheduler may place it elsewhere)
    revive: bool = False  # a worker this autoscaler retired earlier (stopped, its record kept)


class Actuator(Protocol):
    async def add(self, pool: str, workers: Sequence[NewWorker], reason: str) -> None: ...

    async def retire(self, pool: str, workers: Sequence[str], deadline_s: float, reason: str) -> None: ...

    async def aclose(self) -> None: ...


class LocalActuator:
    """Through the supervisor leader's control API (found in etcd, ``leader/supervisor/``)."""

    def __init__(self, store: StateStore, keys: Keys, admin_token: str, *, timeout_s: float = 10.0) -> None:
        self.store, self.keys = store, keys
        self._token = admin_token
        self._http = httpx.AsyncClient(timeout=timeout_s, trust_env=False)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _post(self, path: str, body: dict[str, object]) -> httpx.Response:
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
    def _check(r: httpx.Response, what: str, *, fine: tuple[int, ...] = ()) -> None:
        if r.status_code == 200 or r.status_code in fine:
            return
        try:
            why = r.json().get("error", r.text)
        except ValueError:
            why = r.text
        raise ActuationError(f"{what}: HTTP {r.status_code}: {why}")

    async def add(self, pool: str, workers: Sequence[NewWorker], reason: str) -> None:
        for w in workers:
            if w.revive:
                r = await self._post(f"/v1/workers/{w.id}/undrain", {})
                # 409: it is not drained any more (already coming back): what was asked holds.
                self._check(r, f"bringing {w.id} back", fine=(409,))
            else:
                r = await self._post("/v1/workers", {"id": w.id, "node": w.node, "role": pool, "reason": reason})
                self._check(r, f"starting {w.id} on {w.node}", fine=(409,))
            log.info("%s: %s %s (%s)", pool, "reviving" if w.revive else "starting", w.id, reason)

    async def retire(self, pool: str, workers: Sequence[str], deadline_s: float, reason: str) -> None:
        for wid in workers:
            r = await self._post(f"/v1/workers/{wid}/drain", {"deadline_s": deadline_s, "then": "stop",
                                                              "by": "autoscaler"})
            # 409: being drained already, or not running: either way it is on its way out.
            self._check(r, f"retiring {wid}", fine=(409,))
            log.info("%s: retiring %s within %.0f s (%s)", pool, wid, deadline_s, reason)
