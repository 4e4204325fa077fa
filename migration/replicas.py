"""Checkpoints replicated router to router (``routing.checkpoint_store: peers``): etcd holds none of them.

Why: at a fleet's size, checkpoints in etcd are the first resource past its limit (docs/scale.md): a delta per
stream per flush, and a base per request that holds its prompt. Here each router sends its checkpoints to one
*peer* instead, in one HTTP request per flush, and the peer keeps them in memory. etcd's load from
checkpoints then grows with nothing but claims (a client resuming on another router), and the bytes that
follow the token rate go from router to router.

- **What is sent** is what etcd would hold: the same bases and deltas (``Journal.checkpoint_bytes`` and
  ``delta_bytes``, chosen by :class:`~fleetward.migration.checkpoint.Checkpointer`), so a journal read back
  from a peer is the journal read back from etcd, exactly.
- **Who is the peer**: the next router by id among the registered routers (``routers/``) that keep their
  checkpoints with peers, after this one, wrapping around (:func:`pick_peer`). A router with no such other
  router checkpoints to etcd as before, so a lone router (or a group of one) is resumable after a restart.
  When the peer changes, every live journal is sent whole to the new one at the next flush.
- **Ownership**: the holder decides. A claim (:meth:`Replicas.claim`) makes the claiming router the
  request's owner there; the old owner's next write of that request is answered ``lost`` and it stops the
  stream (``on_lost``), as a failed compare does in etcd.
- **Life**: a copy lives while its owner writes to this holder at least every ``ttl / 3`` seconds (an empty
  write when nothing changed); ``ttl`` after the owner's last write it is dropped (a dead router's
  streams stay resumable that long, as with etcd's lease).
- **What it does not survive**: the owner and its peer dying within one flush of each other. etcd's copy
  survived that; a copy in a peer's memory does not.

The wire: ``POST /fleetward/v1/replicas`` (a JSON header line, ``{"owner", "ttl", "items": [{"id", "kind",
"n", "len"}]}``, then the items' values one after another: :func:`encode_batch`),
``GET /fleetward/v1/replicas/<id>`` (the tokens a copy holds), ``POST /fleetward/v1/replicas/<id>/claim``
(``{"by", "key"}``: the journal, now the claimant's). Each needs the fleet's admin token as a bearer token.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.errors import FleetwardError
from fleetward.migration.journal import Journal

__all__ = ["NotClaimable", "PeerLink", "Replicas", "authorized", "encode_batch", "holders", "pick_peer"]

log = logging.getLogger(__name__)

_TIMEOUT = aiohttp.ClientTimeout(total=5.0)


class NotClaimable(Exception):
    """A copy that exists but cannot be continued exactly (``Journal.resumable``): left as it was."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def holders(me: str, routers: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """The other registered routers that keep checkpoints with peers (``"replicas": true`` in
    ``routers/<id>``), by id: their URLs."""
    return {rid: str(rec["url"]) for rid, rec in routers.items()
            if rid != me and rec.get("replicas") and rec.get("url")}


def pick_peer(me: str, routers: Mapping[str, Mapping[str, Any]]) -> tuple[str, str] | None:
    """The router after ``me`` by id among :func:`holders`, wrapping around; None when there is no other."""
    others = holders(me, routers)
    if not others:
        return None
    after = min((rid for rid in others if rid > me), default=min(others))
    return after, others[after]


def encode_batch(owner: str, ttl_s: float, items: list[tuple[str, str, int, bytes]]) -> bytes:
    """One flush's body: ``items`` are (request id, kind: base, delta or delete, tokens after it, the value's
    JSON). A JSON header line (``{"owner", "ttl", "items": [{"id", "kind", "n", "len"}]}``), then the values
    one after another: the holder keeps them as the bytes they are, and parses one only for a claim."""
    header = orjson.dumps({"owner": owner, "ttl": ttl_s, "items": [
        {"id": rid, "kind": kind, "n": n, "len": len(value)} for rid, kind, n, value in items]})
    return b"".join([header, b"\n", *(value for *_, value in items)])


@dataclass(slots=True)
class _Copy:
    owner: str
    base: bytes  # Journal.checkpoint_bytes
    deltas: list[bytes] = field(default_factory=list)  # Journal.delta_bytes
    n: int = 0  # tokens it holds

    @property
    def size(self) -> int:
        return len(self.base) + sum(len(d) for d in self.deltas)


class Replicas:
    """The copies this router holds of other routers' journals (the holder's side)."""

    def __init__(self, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self.copies: dict[str, _Copy] = {}
        self._until: dict[str, float] = {}  # owner -> when its copies expire (monotonic)

    def _expire(self) -> None:
        now = self.clock.monotonic()
        gone = {o for o, t in self._until.items() if t <= now}
        if gone:
            for o in gone:
                del self._until[o]
            for rid in [rid for rid, c in self.copies.items() if c.owner in gone]:
                del self.copies[rid]

    def apply(self, body: bytes) -> dict[str, list[str]]:
        """An owner's write (:func:`encode_batch`): what it lost to a claim, and what it must send whole
        again (a delta this holder has no base for: it restarted, or the owner's peer changed meanwhile)."""
        header, _, values = body.partition(b"\n")
        data = orjson.loads(header)
        owner, ttl = str(data["owner"]), float(data["ttl"])
        self._expire()
        self._until[owner] = self.clock.monotonic() + ttl
        lost: list[str] = []
        rebase: list[str] = []
        at = 0
        for item in data["items"]:
            rid, kind = str(item["id"]), item["kind"]
            value, at = values[at:at + int(item["len"])], at + int(item["len"])
            c = self.copies.get(rid)
            if c is not None and c.owner != owner:
                if kind != "delete":
                    lost.append(rid)
                continue
            if kind == "delete":
                self.copies.pop(rid, None)
            elif kind == "base":
                self.copies[rid] = _Copy(owner, value, n=int(item["n"]))
            elif c is None:
                rebase.append(rid)
            else:
                c.deltas.append(value)
                c.n = int(item["n"])
        return {"lost": lost, "rebase": rebase}

    @property
    def held_bytes(self) -> int:
        """The bytes of every copy held (a router's memory for its peers' streams)."""
        return sum(c.size for c in self.copies.values())

    def tokens(self, rid: str) -> int | None:
        self._expire()
        c = self.copies.get(rid)
        return None if c is None else c.n

    def claim(self, rid: str, *, by: str, key: str | None) -> Journal | None:
        """The copy's journal, now ``by``'s (the old owner's next write of it is answered lost); None if
        there is none, or it belongs to another API key than ``key`` (left alone); :class:`NotClaimable`
        if it cannot be continued exactly."""
        self._expire()
        c = self.copies.get(rid)
        if c is None:
            return None
        journal = Journal.from_checkpoint(orjson.loads(c.base))
        for d in c.deltas:
            if not journal.apply_delta(orjson.loads(d)):
                log.warning("replica of %s: a delta does not follow what came before; the tokens after it are "
                            "regenerated", rid)
                break
        if journal.owner != key:
            return None
        why = journal.resumable()
        if why is not None:
            raise NotClaimable(why)
        c.owner = by
        self._until.setdefault(by, self.clock.monotonic() + 30.0)
        return journal


def authorized(header: str, token: str | None) -> bool:
    if not token:
        return False
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip(), token)


class PeerLink:
    """The owner's side: writes to its peer, and finds a request's copy on any router to claim it."""

    def __init__(self, session: Callable[[], aiohttp.ClientSession], token: str, me: str,
                 routers: Callable[[], Mapping[str, Mapping[str, Any]]], *, shun_s: float = 5.0,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self._session = session
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self.me = me
        self.routers = routers
        self.shun_s = shun_s
        self.clock = clock
        self._shunned: dict[str, float] = {}  # peers that failed a write: passed over until then

    def peer(self) -> tuple[str, str] | None:
        """This router's peer now: a peer that failed a write is passed over for ``shun_s`` (a dead router's
        record outlives it by up to its lease), so the next one takes the copies at the next flush."""
        now = self.clock.monotonic()
        routers = self.routers()
        if self._shunned:
            self._shunned = {r: t for r, t in self._shunned.items() if t > now}
            routers = {r: rec for r, rec in routers.items() if r not in self._shunned}
        return pick_peer(self.me, routers)

    async def send(self, peer: tuple[str, str], body: bytes) -> dict[str, list[str]]:
        try:
            return await self._send(peer[1], body)
        except FleetwardError:
            self._shunned[peer[0]] = self.clock.monotonic() + self.shun_s
            raise

    async def _send(self, url: str, body: bytes) -> dict[str, list[str]]:
        try:
            async with self._session().post(url + "/fleetward/v1/replicas", data=body, headers=self._headers,
                                            timeout=_TIMEOUT) as r:
                if r.status != 200:
                    raise FleetwardError(f"peer {url} refused the checkpoints: HTTP {r.status} "
                                         f"{(await r.text())[:200]}")
                answer: dict[str, list[str]] = orjson.loads(await r.read())
                return answer
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise FleetwardError(f"peer {url} unreachable: {exc!r}") from exc

    async def claim(self, rid: str, *, key: str | None) -> Journal | None:
        """The copy of ``rid`` with the most tokens among the other routers, claimed; None if none has one."""
        others = holders(self.me, self.routers())

        async def tokens(url: str) -> tuple[int, str] | None:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError):
                async with self._session().get(f"{url}/fleetward/v1/replicas/{rid}", headers=self._headers,
                                               timeout=_TIMEOUT) as r:
                    if r.status == 200:
                        return int(orjson.loads(await r.read())["tokens"]), url
            return None

        found = [f for f in await asyncio.gather(*(tokens(u) for u in others.values())) if f is not None]
        for _, url in sorted(found, reverse=True):
            try:
                async with self._session().post(f"{url}/fleetward/v1/replicas/{rid}/claim", headers=self._headers,
                                                data=orjson.dumps({"by": self.me, "key": key}),
                                                timeout=_TIMEOUT) as r:
                    if r.status == 409:
                        raise NotClaimable(str(orjson.loads(await r.read()).get("why", "not resumable")))
                    if r.status == 200:
                        return Journal.from_checkpoint(orjson.loads(await r.read()))
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                log.info("claim of %s at %s failed (%r); trying the next copy", rid, url, exc)
        return None
