"""Leader election over any :class:`~fleetward.fleet.etcd.StateStore`, and the loop services lead by.

- :class:`Election` is the usual etcd recipe (lowest create-revision under a prefix wins) and gives the
  leader a fencing comparison to put in every transaction it makes as leader; :func:`election_leader` reads
  who leads without campaigning.
- :func:`lead_forever` campaigns with a fresh lease, leads until leadership is lost (:class:`LeadershipLost`
  or a :class:`~fleetward.fleet.errors.StoreError`), steps down and campaigns again, until cancelled.
  It keeps a :class:`Leadership` up to date (the "leading" event, the current election, the is-leader gauge
  and the leadership-changes counter), so every service that leads reports it the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from prometheus_client import Counter, Gauge

from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.errors import FleetwardError, StoreError
from fleetward.fleet.etcd import Compare, Delete, Put, StateStore, dumps
from fleetward.fleet.lease import LeaseKeeper

__all__ = ["Election", "LeaderElected", "Leadership", "LeadershipLost", "election_leader", "lead_forever"]

log = logging.getLogger(__name__)


class LeadershipLost(FleetwardError):
    """This candidate no longer leads (its lease expired, or a fenced write failed): stop acting, campaign again."""


class Election:
    """Leader election under ``prefix`` (e.g. ``/fleetward/c/leader/supervisor/``).

    Each candidate puts ``prefix + <lease id>`` bound to its (started) lease; the key with the lowest create
    revision is the leader. :meth:`campaign` returns once this candidate leads; if it is cancelled, the
    candidate's key stays until :meth:`resign` or the lease ends. Every action the leader takes should
    include :attr:`fence` in its transaction: it fails as soon as leadership is lost (the key was deleted,
    e.g. because the lease expired or was revoked), so two leaders never both act.
    """

    def __init__(self, store: StateStore, prefix: str, *, candidate: str, lease: LeaseKeeper) -> None:
        self.store = store
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.candidate = candidate
        self.lease = lease
        self.key = ""
        self.create_revision = 0

    @property
    def fence(self) -> Compare:
        """A comparison that holds only while this candidate's key still stands (it is the leader)."""
        if not self.create_revision:
            raise StoreError("not campaigning")
        return Compare(self.key, "create", "==", self.create_revision)

    async def campaign(self) -> None:
        """Become the leader: wait until every candidate that came earlier is gone.

        Raises :class:`StoreError` if this candidate's own key disappears meanwhile (its lease ended).
        """
        if not self.lease.id:
            raise StoreError("campaign needs a started lease (LeaseKeeper.start)")
        self.key = f"{self.prefix}{self.lease.id:x}"
        value = dumps({"candidate": self.candidate})
        # Create only if absent: campaigning again with the same lease keeps the original place in line.
        await self.store.txn([Compare(self.key, "create", "==", 0)], [Put(self.key, value, self.lease.id)])
        kv = await self.store.get(self.key)
        if kv is None:
            raise StoreError(f"election key {self.key} vanished right after it was created (lease expired?)")
        self.create_revision = kv.create_revision
        while True:
            snap = await self.store.get_prefix(self.prefix)
            if not any(kv.key == self.key for kv in snap.items):
                self.create_revision = 0
                raise StoreError(f"election key {self.key} was deleted while campaigning")
            older = [kv for kv in snap.items if kv.create_revision < self.create_revision]
            if not older:
                return
            # Wait for the candidate right before us (or our own key) to go away, then look again.
            watched = {max(older, key=lambda kv: kv.create_revision).key, self.key}
            async with contextlib.aclosing(
                    self.store.watch_prefix(self.prefix, start_revision=snap.revision + 1)) as changes:
                async for ev in changes:
                    if ev.kind == "delete" and ev.key in watched:
                        break

    async def leader(self) -> str | None:
        """The current leader's candidate name, or None."""
        return await election_leader(self.store, self.prefix)

    async def is_leader(self) -> bool:
        """Whether this candidate still leads (its key stands; nobody older can appear later)."""
        if not self.create_revision:
            return False
        res = await self.store.txn([self.fence], ())
        return res.succeeded

    async def resign(self) -> None:
        """Step down (or leave the line): delete this candidate's key if it is still ours."""
        if self.key and self.create_revision:
            await self.store.txn([self.fence], [Delete(self.key)])
        self.create_revision = 0


async def election_leader(store: StateStore, prefix: str) -> str | None:
    """The candidate name of whoever leads the election under ``prefix`` (see :class:`Election`), or None."""
    snap = await store.get_prefix(prefix if prefix.endswith("/") else prefix + "/")
    if not snap.items:
        return None
    first = min(snap.items, key=lambda kv: kv.create_revision)
    candidate: str = first.json()["candidate"]
    return candidate


class Leadership:
    """What a service knows of its own leadership, kept up to date by :func:`lead_forever`.

    ``leading`` is set while this candidate leads. ``election`` is the :class:`Election` of the current (or
    the last) term: its :attr:`~Election.fence` goes into every transaction the leader makes. ``is_leader``,
    if given, reads 1 while leading and 0 otherwise; ``changes``, if given, counts the terms won.
    """

    def __init__(self, *, is_leader: Gauge | None = None, changes: Counter | None = None) -> None:
        self.leading = asyncio.Event()
        self.election: Election | None = None
        self._is_leader = is_leader
        self._changes = changes

    def won(self, election: Election) -> None:
        self.election = election
        self.leading.set()
        if self._is_leader is not None:
            self._is_leader.set(1)
        if self._changes is not None:
            self._changes.inc()

    def stepped_down(self) -> None:
        self.leading.clear()
        if self._is_leader is not None:
            self._is_leader.set(0)


class LeaderElected:
    """A service that campaigns with :func:`lead_forever` and keeps its :class:`Leadership` in ``leadership``."""

    leadership: Leadership

    @property
    def leading(self) -> asyncio.Event:
        """Set while this service leads."""
        return self.leadership.leading

    @property
    def election(self) -> Election | None:
        """The election of the current (or last) term; its fence goes into every write made as leader."""
        return self.leadership.election


async def lead_forever(store: StateStore, prefix: str, *, candidate: str, ttl_s: int, name: str,
                       lead: Callable[[LeaseKeeper], Awaitable[None]], leadership: Leadership,
                       on_leading: Callable[[Election], None] | None = None,
                       on_stepped_down: Callable[[], None] | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
    """Campaign under ``prefix`` with a fresh lease, lead (``await lead(lease)``) until leadership is lost (a
    :class:`LeadershipLost` or a :class:`StoreError` out of it), step down (resign, revoke the lease), and
    campaign again; until cancelled. Once this candidate leads, ``leadership.won(election)`` and then
    ``on_leading(election)`` run, before ``lead``; whenever a term (or a campaign) ends,
    ``leadership.stepped_down()`` and then ``on_stepped_down()``. The supervisor's controllers and the
    autoscalers both run this way."""
    while True:
        lease = await LeaseKeeper(store, ttl_s, clock=clock).start()
        election = Election(store, prefix, candidate=candidate, lease=lease)
        try:
            await election.campaign()
            leadership.won(election)
            if on_leading is not None:
                on_leading(election)
            await lead(lease)
        except (LeadershipLost, StoreError) as exc:
            log.warning("%s lost leadership: %s", name, exc)
        finally:
            leadership.stepped_down()
            if on_stepped_down is not None:
                on_stepped_down()
            with contextlib.suppress(FleetwardError):
                await election.resign()
            await lease.aclose()
