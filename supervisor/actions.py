"""The node agent's side of the leader's remediations: ``actions/<node>/<id>`` followed and carried out.

Each pending action is checked first (signed by the leader, addressed here, not stale, not replayed:
:class:`~fleetward.fleet.signing.ActionSigner`; a refused one is marked ``refused`` with why). It is then
claimed with a compare-and-swap on its revision, so it is carried out once even if two leaders wrote it
or the agent read it twice, and carried out: ``restart``, ``start`` (a new worker), ``stop`` or
``selftest``. It always ends ``done`` or ``failed``, with why, and an ``action`` event on the bus.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import orjson

from fleetward.fleet.errors import FleetwardError, StoreError
from fleetward.fleet.etcd import Compare, Put

if TYPE_CHECKING:
    from fleetward.supervisor.agent import NodeAgent

__all__ = ["ActionFollower"]

log = logging.getLogger(__name__)

KINDS = ("restart", "start", "stop", "selftest")  # what an agent carries out


class ActionFollower:
    """Carries out the actions the leader addresses to one :class:`~fleetward.supervisor.agent.NodeAgent`."""

    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent

    async def follow(self) -> None:
        """Every pending action under ``actions/<node>/``, now and as they come, until cancelled."""
        agent = self.agent
        prefix = agent.keys.actions_of(agent.node)
        while True:
            snap = await agent.store.get_prefix(prefix)
            for kv in snap.items:
                self._maybe_run(kv.key, kv.value, kv.mod_revision)
            try:
                async for ev in agent.store.watch_prefix(prefix, start_revision=snap.revision + 1):
                    if ev.kind == "put":
                        self._maybe_run(ev.key, ev.value, ev.revision)
            except StoreError as exc:
                log.warning("action watch lost (%s); re-reading", exc)

    def _maybe_run(self, key: str, value: bytes, mod_revision: int) -> None:
        agent = self.agent
        try:
            body = orjson.loads(value)
        except orjson.JSONDecodeError:
            return
        if body.get("status") != "pending":
            return
        if agent.signer is not None:
            why = agent.signer.refusal(body, node=agent.node, now=agent.clock.wall())
            if why is not None:
                self._refuse(key, body, mod_revision, why)
                return
        agent.spawn(self._run(key, body, mod_revision), name=f"action-{body.get('id')}")

    def _refuse(self, key: str, body: dict[str, Any], mod_revision: int, why: str) -> None:
        """An action the leader did not issue: not carried out, and marked refused with why (a replay of one
        carried out before is left as it is: it may be the same action seen twice)."""
        agent = self.agent
        log.warning("refusing action %s at %s (%s of %s): %s", body.get("id"), key, body.get("kind"),
                    body.get("worker"), why)
        agent.metrics.refused.inc()
        if why.startswith("carried out before"):
            return

        async def mark() -> None:
            refused = {**body, "status": "refused", "reason_done": why, "done_at": agent.clock.wall()}
            await agent.store.txn([Compare(key, "mod", "==", mod_revision)], [Put(key, orjson.dumps(refused))])
            await agent.bus.publish("action", worker=str(body.get("worker")), node=agent.node,
                                    action=str(body.get("id")), action_kind=str(body.get("kind")), status="refused",
                                    reason=why)

        agent.spawn(mark(), name="action-refused")

    async def _run(self, key: str, body: dict[str, Any], mod_revision: int) -> None:
        agent = self.agent
        claimed = {**body, "status": "running", "claimed_at": agent.clock.wall()}
        result = await agent.store.txn([Compare(key, "mod", "==", mod_revision)], [Put(key, orjson.dumps(claimed))])
        if not result.succeeded:
            return  # someone (an earlier run of us) already took it
        worker, kind = body["worker"], body["kind"]
        log.info("carrying out %s of %s: %s", kind, worker, body.get("reason", ""))
        ok, reason = True, ""
        try:
            if kind == "restart":
                await agent.restart(worker, delay=float(body.get("delay_s", 0.0)))
            elif kind == "start":
                ok, reason = await agent.lifecycle.start_new(worker, role=body.get("role", "aggregated"))
            elif kind == "stop":
                await agent.stop(worker)
            elif kind == "selftest":
                ok, reason = await agent.lifecycle.selftest(worker)
            else:
                ok, reason = False, f"unknown action kind {kind!r}"
        except FleetwardError as exc:
            ok, reason = False, str(exc).splitlines()[0]
        except Exception as exc:  # an action must always end with a status
            log.exception("action %s failed", body.get("id"))
            ok, reason = False, f"{type(exc).__name__}: {exc}"
        done = {**claimed, "status": "done" if ok else "failed", "reason_done": reason, "done_at": agent.clock.wall()}
        if kind in KINDS:  # a bounded label set, whatever the key space holds
            agent.metrics.actions.labels(kind, done["status"]).inc()
        await agent.store.put(key, orjson.dumps(done))
        await agent.bus.publish("action", worker=worker, node=agent.node, action=body["id"], action_kind=kind,
                                status=done["status"], reason=reason)
