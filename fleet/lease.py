"""A lease kept alive in the background: :class:`LeaseKeeper`, over any :class:`~fleetward.fleet.etcd.StateStore`.

Keys put with the lease (a registration, an election candidate) live as long as it does; the keeper says
when etcd let it expire, so the owner can register again under a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.errors import StoreError, UnavailableError
from fleetward.fleet.etcd import StateStore

__all__ = ["LeaseKeeper"]

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Grants a lease and keeps it alive until :meth:`aclose` revokes it.

    Use as ``async with LeaseKeeper(store, ttl) as lease:`` or ``lease = await LeaseKeeper(...).start()``.
    A keepalive goes out every ``ttl / 3`` seconds; one that fails, or gets no answer within that interval, is
    logged and tried again 0.1 s later. ``lost`` is set when etcd says the lease expired (e.g. after a partition
    longer than the TTL): keys bound to it are gone, and the owner must register again under a new lease.
    ``troubled_at`` is when a keepalive last failed or the lease was found expired: when the store was last
    out of reach from here.
    """

    def __init__(self, store: StateStore, ttl: int, *, clock: Clock = SYSTEM_CLOCK) -> None:
        if ttl < 1:
            raise ValueError("lease ttl must be at least 1 second")
        self.store = store
        self.ttl = ttl
        self.id = 0
        self.lost = asyncio.Event()
        self.troubled_at: float | None = None  # when a keepalive last failed, or the lease was found expired
        self._clock = clock
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> LeaseKeeper:
        """Grant the lease and start keeping it alive (:class:`StoreUnavailable` if etcd is away)."""
        if self._task is not None:
            raise StoreError(f"lease {self.id:x} is already being kept alive")
        self.id = await self.store.grant(self.ttl)
        self.lost.clear()
        self._task = asyncio.create_task(self._run(), name=f"lease-keepalive-{self.id:x}")
        return self

    async def __aenter__(self) -> LeaseKeeper:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _run(self) -> None:
        interval = max(0.3, self.ttl / 3)
        last_ok = self._clock.monotonic()
        failed = False  # since the last keepalive that got through
        delay = interval
        while True:
            await self._clock.sleep(delay)
            try:
                # A keepalive the member cannot answer (it is cut off, or its leader is: etcd gives up on it only
                # after its own request timeout, seconds past a short TTL) moves to the next member after a third
                # of the interval, is given up after one, and sent again at once.
                async with asyncio.timeout(interval):
                    remaining = await self.store.keepalive(self.id, attempt_timeout=interval / 3)
            except (UnavailableError, StoreError, TimeoutError) as exc:
                log.warning("lease %x keepalive failed: %s", self.id, exc or f"no answer within {interval:.1f}s")
                self.troubled_at = self._clock.monotonic()
                failed = True
                delay = min(0.1, interval)
                continue
            delay = interval
            now = self._clock.monotonic()
            if now - last_ok > 2 * interval + 0.5 and not failed:  # no failure said why: the loop was not running
                log.warning("lease %x: %.2fs between successful keepalives (TTL %ds); is the event loop blocked?",
                            self.id, now - last_ok, self.ttl)
            last_ok, failed = now, False
            if remaining <= 0:
                log.warning("lease %x expired; its keys are gone", self.id)
                self.troubled_at = now
                self.lost.set()
                return

    async def aclose(self, *, revoke: bool = True) -> None:
        """Stop keeping the lease alive and revoke it unless ``revoke`` is false.

        When this returns after a successful revoke, the keys bound to the lease are gone. If etcd cannot
        be reached the revoke is given up (logged) and the keys vanish when the TTL runs out.
        """
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if revoke and self.id and not self.lost.is_set():
            try:
                await self.store.revoke(self.id)
            except (UnavailableError, StoreError) as exc:
                log.warning("lease %x not revoked (%s); its keys expire within %ds", self.id, exc, self.ttl)
