"""A router's record in etcd (``routers/<id>``), kept under a lease for as long as the router lives.

The record says where the router is (its own ``url``, the ``public_url`` clients reach) and which lease its
request checkpoints are bound to (``checkpoint_lease``): a replica tells a dead router's checkpoints from a
live one's by that lease alone. :meth:`Registration.run` registers again under new leases when etcd let one
expire (e.g. a partition longer than its TTL); a lost checkpoint lease took every checkpoint with it, so they
are all written again at the next flush.
"""

from __future__ import annotations

import asyncio
import logging
import os

import orjson

from fleetward.fleet.clock import Clock
from fleetward.fleet.etcd import StateStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.lease import LeaseKeeper
from fleetward.migration.checkpoint import Checkpointer

__all__ = ["Registration"]

log = logging.getLogger(__name__)


class Registration:
    def __init__(self, store: StateStore, keys: Keys, router_id: str, *, url: str, public_url: str,
                 ttl_s: int, checkpointer: Checkpointer, clock: Clock) -> None:
        self.store = store
        self.keys = keys
        self.id = router_id
        self.url = url
        self.public_url = public_url
        self.ttl_s = ttl_s
        self.checkpointer = checkpointer
        self.clock = clock
        self.started_at = 0.0
        self._lease: LeaseKeeper | None = None
        self._troubled_at: float | None = None  # of the leases before this one

    @property
    def troubled_at(self) -> float | None:
        """When this router last failed to keep its lease alive, or found it expired (monotonic; None: never):
        the last time it could not reach the store."""
        now = self._lease.troubled_at if self._lease is not None else None
        return max((t for t in (now, self._troubled_at) if t is not None), default=None)

    async def start(self) -> None:
        """Register now (``started_at`` is the record's start time)."""
        self.started_at = self.clock.wall()
        await self._register()

    async def _register(self) -> None:
        lease = await LeaseKeeper(self.store, self.ttl_s, clock=self.clock).start()
        info = {"id": self.id, "url": self.url, "public_url": self.public_url, "started_at": self.started_at,
                "pid": os.getpid(),
                "checkpoint_lease": self.checkpointer.lease.id if self.checkpointer.lease is not None else None,
                "replicas": self.checkpointer.replicas is not None}
        try:
            await self.store.put(self.keys.router(self.id), orjson.dumps(info), lease=lease.id)
        except BaseException:
            await lease.aclose()  # no record under it: not kept alive for nothing
            raise
        self._lease = lease

    async def run(self) -> None:
        """Register again whenever the registration or the checkpoint lease expired (module docstring). Run
        again after it raised (its owner restarts it), it first registers if the last try failed."""
        while True:
            if self._lease is None:
                await self._register()
            assert self._lease is not None
            lease, cp = self._lease, self.checkpointer.lease
            waits = [asyncio.ensure_future(lease.lost.wait())]
            if cp is not None:
                waits.append(asyncio.ensure_future(cp.lost.wait()))
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            if cp is not None and cp.lost.is_set():
                log.warning("router %s: checkpoint lease expired; checkpointing everything again", self.id)
                await self.checkpointer.renew()
            log.warning("router %s: registration lease %s; registering again", self.id,
                        "expired" if lease.lost.is_set() else "kept, checkpoint lease renewed")
            self._troubled_at = self.troubled_at  # kept past the lease it was seen on
            self._lease = None
            await lease.aclose(revoke=not lease.lost.is_set())
            await self._register()

    async def aclose(self) -> None:
        """Deregister: the lease is revoked, and the record goes with it."""
        if self._lease is not None:
            await self._lease.aclose()
            self._lease = None
