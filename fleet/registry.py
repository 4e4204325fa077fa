"""The fleet as etcd describes it: workers, their health, routers, the supervisor's leader.

:func:`read_fleet` takes one consistent snapshot (one revision). :class:`FleetView` keeps a live copy:
it reads at revision R and watches from R+1, so it misses nothing (what a restarted router needs).
:func:`read_leader` says who leads the supervisor and where its control API is.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.config import AttachConfig
from fleetward.fleet.election import election_leader
from fleetward.fleet.etcd import StateStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.signing import AttachSigner
from fleetward.fleet.worker import HealthRecord, HealthState, WorkerRecord

__all__ = ["FleetSnapshot", "FleetView", "Leader", "publish_attachments", "read_fleet", "read_leader",
           "wait_registered"]

log = logging.getLogger(__name__)


@dataclass
class FleetSnapshot:
    cluster: str
    revision: int = 0
    workers: dict[str, WorkerRecord] = field(default_factory=dict)
    health: dict[str, HealthRecord] = field(default_factory=dict)
    routers: dict[str, dict[str, Any]] = field(default_factory=dict)
    controller: Leader | None = None  # the supervisor's leader (read by ``read_fleet(leader=True)``)
    phases: dict[str, str] = field(default_factory=dict)  # starting workers: what they are at (``phases=True``)

    def health_of(self, worker_id: str) -> HealthRecord | None:
        return self.health.get(worker_id)

    def routable(self) -> list[WorkerRecord]:
        """Registered workers whose health says new work may go to them."""
        out = []
        for wid, rec in self.workers.items():
            h = self.health.get(wid)
            if h is not None and h.state.is_routable:
                out.append(rec)
        return out

    def apply(self, keys: Keys, kind: str, key: str, value: bytes) -> str | None:
        """Fold one change into the snapshot; returns which section changed (or None)."""
        for prefix, section in ((keys.workers, "workers"), (keys.health, "health"), (keys.routers, "routers")):
            if not key.startswith(prefix):
                continue
            ident = key[len(prefix):]
            table: dict[str, Any] = getattr(self, section)
            if kind == "delete":
                table.pop(ident, None)
                return section
            try:
                if section == "workers":
                    table[ident] = WorkerRecord.from_json(value)
                elif section == "health":
                    table[ident] = HealthRecord.from_json(value)
                else:
                    table[ident] = json.loads(value)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring malformed value at %s: %s", key, exc)
                return None
            return section
        return None

    def to_status(self) -> dict[str, Any]:
        """The stable shape of ``fleetward status --json``."""
        workers = []
        for wid in sorted(set(self.workers) | set(self.health)):
            rec = self.workers.get(wid)
            h = self.health.get(wid)
            workers.append({
                "id": wid,
                "url": rec.url if rec else None,
                "role": rec.role if rec else None,
                "model": rec.model if rec else None,
                "node": rec.node if rec else None,
                "pid": rec.pid if rec else None,
                "pids": list(rec.pids or ([rec.pid] if rec.pid is not None else [])) if rec else [],
                "started_at": rec.started_at if rec else None,  # with pid: which process it is (a pid is reused)
                "health": h.state.value if h else ("unknown" if rec else HealthState.DEAD.value),
                "since": h.since if h else (rec.started_at if rec else None),
                "reason": h.reason if h else "",
                "phase": self.phases.get(wid, ""),
            })
        routers = [{"id": rid, "url": r.get("url")} for rid, r in sorted(self.routers.items())]
        return {"cluster": self.cluster, "controller": self.controller.to_json() if self.controller else None,
                "routers": routers, "workers": workers}


async def read_fleet(store: StateStore, keys: Keys, *, revision: int | None = None,
                     leader: bool = False, phases: bool = False) -> FleetSnapshot:
    """Workers, health and routers as of one revision (the current one unless ``revision`` is given);
    with ``leader``, also who leads the supervisor now (elections are read at the current revision); with
    ``phases``, what each starting or restarting worker is at (its agent's ``start`` signal).

    Reads the three sections, not the whole cluster prefix: ``requests/`` holds one checkpoint per
    in-flight request (10,000 of them are some 65 MB), more than one gRPC response may carry.
    """
    first = await store.get_prefix(keys.workers, revision=revision)
    at = revision or first.revision
    fleet = FleetSnapshot(keys.cluster, revision=at)
    for snap in (first, await store.get_prefix(keys.health, revision=at),
                 await store.get_prefix(keys.routers, revision=at)):
        for kv in snap.items:
            fleet.apply(keys, "put", kv.key, kv.value)
    if leader:
        fleet.controller = await read_leader(store, keys)
    if phases:
        await _read_phases(store, keys, fleet)
    return fleet


async def _read_phases(store: StateStore, keys: Keys, fleet: FleetSnapshot) -> None:
    """The agent's ``ok`` ``start`` signal of each worker starting now (said since its health record)."""
    for wid, h in fleet.health.items():
        if h.state not in (HealthState.STARTING, HealthState.RESTARTING):
            continue
        kv = await store.get(keys.signal(wid, "start"))
        try:
            said = json.loads(kv.value) if kv is not None else {}
        except ValueError:
            continue
        if said.get("severity") == "ok" and float(said.get("ts", 0)) >= h.since:
            fleet.phases[wid] = str(said.get("reason", ""))


@dataclass(frozen=True)
class Leader:
    """Who leads an election: the candidate's id and its control API (``url``; empty if it has none)."""

    id: str
    url: str = ""

    def to_json(self) -> dict[str, str]:
        return {"id": self.id, "url": self.url}


async def read_leader(store: StateStore, keys: Keys, election: str = "supervisor") -> Leader | None:
    """The leader of ``leader/<election>/`` (the supervisor's controllers campaign there), or None."""
    candidate = await election_leader(store, keys.leader(election))
    if candidate is None:
        return None
    body = json.loads(candidate)
    return Leader(str(body["id"]), str(body.get("url") or ""))


async def publish_attachments(store: StateStore, keys: Keys, entries: Iterable[AttachConfig], node: str, *,
                              signer: AttachSigner | None) -> list[str]:
    """Write each entry to ``attach/<id>`` (its node filled in) for the node agents to adopt; the worker ids.

    Signed with ``signer`` (the admin token's): an agent that holds the token runs no restart command from an
    unsigned record. None only where no agent checks (a fleet without a token)."""
    ids = []
    for entry in entries:
        entry = entry.model_copy(update={"node": entry.node or node})
        wid = entry.worker_id(node)
        body = entry.model_dump(mode="json")
        await store.put(keys.attached(wid), json.dumps(signer.sign(wid, body) if signer else body).encode())
        ids.append(wid)
    return ids


async def wait_registered(store: StateStore, keys: Keys, workers: Iterable[str], *, timeout: float,
                          interval: float = 0.1) -> None:
    """Until every one of ``workers`` is registered (``workers/<id>``), or :class:`TimeoutError`."""
    wanted = set(workers)
    async with asyncio.timeout(timeout):
        while True:
            if not wanted - {kv.key[len(keys.workers):] for kv in (await store.get_prefix(keys.workers)).items}:
                return
            await asyncio.sleep(interval)


class FleetView:
    """A live :class:`FleetSnapshot`: read once at R, then every change from R+1 on.

    ``on_change(section, id)`` is called after each change is applied (section is workers, health or
    routers). :meth:`ready` is set once the first snapshot is loaded.

    With ``hold`` (the router's: whether its own contact with the store failed lately), a worker or health
    record that vanishes while ``hold()`` says so is kept for up to ``hold_s``: a store that was away let every
    lease lapse at once, the workers' with the rest, and the workers serve on. It goes when its key comes back
    (the record written again), when ``hold_s`` passes, or when :meth:`forget` is told the worker failed.
    ``held`` says which are kept and until when.
    """

    def __init__(self, store: StateStore, keys: Keys,
                 on_change: Callable[[str, str], None] | None = None, *,
                 hold: Callable[[], bool] | None = None, hold_s: float = 30.0,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.store = store
        self.keys = keys
        self.fleet = FleetSnapshot(keys.cluster)
        self.loaded = asyncio.Event()
        self._on_change = on_change
        self._hold = hold
        self._hold_s = hold_s
        self._clock = clock
        self.held: dict[tuple[str, str], float] = {}  # (section, id) -> until (monotonic)

    async def run(self) -> None:
        from fleetward.fleet.errors import StoreError

        while True:
            fresh = await read_fleet(self.store, self.keys)
            if self.loaded.is_set():
                self._carry_over(self.fleet, fresh)
            self.fleet = fresh
            self.loaded.set()
            if self._on_change is not None:
                self._on_change("*", "")
            try:
                async with asyncio.TaskGroup() as tg:
                    for section in ("workers", "health", "routers"):
                        tg.create_task(self._follow(section, self.fleet.revision + 1))
                    if self._hold is not None:
                        tg.create_task(self._expire())
            except* StoreError as group:  # compacted or broken for good: re-read and watch again
                log.warning("fleet watch lost (%s); re-reading the key space", group.exceptions[0])

    async def _follow(self, section: str, start_revision: int) -> None:
        prefix: str = getattr(self.keys, section)
        async for ev in self.store.watch_prefix(prefix, start_revision=start_revision):
            ident = ev.key[len(prefix):]
            if ev.kind == "delete" and self._holds(section, ident):
                continue
            self.held.pop((section, ident), None)  # written again (or gone for good): nothing is kept for it
            if self.fleet.apply(self.keys, ev.kind, ev.key, ev.value) is not None:
                self.fleet.revision = max(self.fleet.revision, ev.revision)
                if self._on_change is not None:
                    self._on_change(section, ident)

    def _holds(self, section: str, ident: str) -> bool:
        """Keep a vanished record (class docstring)? Only a worker's or its health's, only while ``hold()``."""
        if self._hold is None or section not in ("workers", "health") or not self._hold():
            return False
        table: dict[str, Any] = getattr(self.fleet, section)
        if ident not in table:
            return False
        if (section, ident) not in self.held:
            log.warning("%s: its %s record vanished while the store was unreachable; kept for %.0f s or until it "
                        "is written again or the worker fails", ident, section.rstrip("s"), self._hold_s)
        self.held[(section, ident)] = self._clock.monotonic() + self._hold_s
        return True

    def _carry_over(self, old: FleetSnapshot, fresh: FleetSnapshot) -> None:
        """A re-read after the watch broke: what vanished meanwhile is held, as a deletion seen would be."""
        for section in ("workers", "health"):
            before: dict[str, Any] = getattr(old, section)
            now: dict[str, Any] = getattr(fresh, section)
            for ident, value in before.items():
                if ident not in now and ((section, ident) in self.held or self._holds(section, ident)):
                    now[ident] = value

    def forget(self, worker: str) -> None:
        """The worker failed where it serves (refused, cut, found dead): what is held of it goes now."""
        for section in ("workers", "health"):
            if (section, worker) in self.held:
                self._drop(section, worker)

    async def _expire(self) -> None:
        while True:
            await self._clock.sleep(1.0)
            now = self._clock.monotonic()
            for (section, ident), until in list(self.held.items()):
                if until <= now:
                    log.warning("%s: its %s record did not come back within %.0f s; dropped", ident,
                                section.rstrip("s"), self._hold_s)
                    self._drop(section, ident)

    def _drop(self, section: str, ident: str) -> None:
        """A held record goes, as its deletion would have gone when it came."""
        del self.held[(section, ident)]
        getattr(self.fleet, section).pop(ident, None)
        if self._on_change is not None:
            self._on_change(section, ident)
