"""EtcdStore, LeaseKeeper and Election against a real etcd."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import aetcd
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge

from fleetward.fleet.election import Election, Leadership, LeadershipLost, lead_forever
from fleetward.fleet.errors import StoreError, StoreUnavailable
from fleetward.fleet.etcd import Compare, Delete, EtcdStore, Put, WatchEvent
from fleetward.fleet.infra import LocalEtcd
from fleetward.fleet.keys import Keys
from fleetward.fleet.lease import LeaseKeeper
from fleetward.fleet.procs import free_port

# A lease holder in its own process: registers keys bound to its lease, says READY, then runs until killed.
LEASE_HOLDER = """
import asyncio, sys
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.lease import LeaseKeeper

async def main(endpoint, prefix, ttl, n):
    store = EtcdStore(endpoint)
    lease = await LeaseKeeper(store, int(ttl)).start()
    for i in range(int(n)):
        await store.put(f"{prefix}{i}", b"alive", lease=lease.id)
    print("READY", flush=True)
    await asyncio.Event().wait()

asyncio.run(main(*sys.argv[1:]))
"""

# A candidate in its own process: campaigns, says LEADER once it leads, then runs until killed.
CANDIDATE = """
import asyncio, sys
from fleetward.fleet.election import Election
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.lease import LeaseKeeper

async def main(endpoint, prefix, ttl, name):
    store = EtcdStore(endpoint)
    lease = await LeaseKeeper(store, int(ttl)).start()
    await Election(store, prefix, candidate=name, lease=lease).campaign()
    print("LEADER", flush=True)
    await asyncio.Event().wait()

asyncio.run(main(*sys.argv[1:]))
"""


def _brief(events: list[WatchEvent]) -> list[tuple[str, str, bytes, int]]:
    return [(e.kind, e.key, e.value, e.revision) for e in events]


async def _collect(store: EtcdStore, prefix: str, start: int, into: list[WatchEvent]) -> None:
    async with contextlib.aclosing(store.watch_prefix(prefix, start_revision=start)) as changes:
        async for ev in changes:
            into.append(ev)


# -- reads, writes, transactions -------------------------------------------------------------------------


async def test_put_get_delete_round_trip(store: EtcdStore, keys: Keys) -> None:
    rev = await store.put(keys.worker("w1"), b'{"url":"http://w1"}')
    kv = await store.get(keys.worker("w1"))
    assert kv is not None
    assert kv.json() == {"url": "http://w1"}
    assert kv.create_revision == kv.mod_revision == rev and kv.version == 1 and kv.lease == 0

    assert await store.delete(keys.worker("w1")) == 1
    assert await store.get(keys.worker("w1")) is None
    assert await store.delete(keys.worker("w1")) == 0


async def test_get_prefix_at_a_revision_reads_history(store: EtcdStore, keys: Keys) -> None:
    await store.put(keys.worker("a"), b"a1")
    then = await store.put(keys.worker("b"), b"b1")
    await store.put(keys.worker("a"), b"a2")
    await store.delete(keys.worker("b"))
    await store.put(keys.router("r"), b"not under workers/")

    past = await store.get_prefix(keys.workers, revision=then)
    now = await store.get_prefix(keys.workers)

    assert past.revision >= then  # the header names the store's current revision
    assert [(kv.key, kv.value) for kv in past.items] == [(keys.worker("a"), b"a1"), (keys.worker("b"), b"b1")]
    assert [(kv.key, kv.value) for kv in now.items] == [(keys.worker("a"), b"a2")]


async def test_compare_and_swap_applies_one_branch_only(store: EtcdStore, keys: Keys) -> None:
    k = keys.scale_of("decode")
    absent = Compare(k, "create", "==", 0)

    created = await store.txn([absent], [Put(k, b"1")], [Put(keys.scale_of("lost"), b"x")])
    assert created.succeeded
    again = await store.txn([absent], [Put(k, b"2")], [Put(keys.scale_of("lost"), b"x")])
    assert not again.succeeded
    assert (kv := await store.get(k)) is not None and kv.value == b"1"
    # the failure branch ran instead
    assert (kv := await store.get(keys.scale_of("lost"))) is not None and kv.value == b"x"

    swapped = await store.txn([Compare(k, "value", "==", b"1")], [Put(k, b"3")])
    stale = await store.txn([Compare(k, "mod", "==", created.revision)], [Put(k, b"4")])
    assert swapped.succeeded and not stale.succeeded
    assert (kv := await store.get(k)) is not None and kv.value == b"3"

    assert (await store.txn([Compare(k, "version", "==", 2)], [Delete(k)])).succeeded
    assert await store.get(k) is None


async def test_unreachable_etcd_raises_store_unavailable_naming_the_endpoint() -> None:
    endpoint = f"127.0.0.1:{free_port()}"  # nobody listens there
    async with EtcdStore(endpoint, timeout_s=1.0, attempts=2, retry_budget_s=5.0) as store:
        with pytest.raises(StoreUnavailable) as err:
            await store.get("/fleetward/nowhere/x")
    assert endpoint in str(err.value) and "etcd unreachable" in str(err.value)
    assert err.value.endpoint == endpoint
    assert err.value.attempts == 2
    assert err.value.retryable


async def test_a_closed_store_refuses_calls_and_ends_its_watches(etcd_endpoint: str, keys: Keys) -> None:
    store = EtcdStore(etcd_endpoint)
    rev = await store.put(keys.worker("x"), b"1")
    seen: list[WatchEvent] = []
    async with asyncio.TaskGroup() as tg:
        watcher = tg.create_task(_collect(store, keys.root, rev, seen))
        await store.aclose()
        async with asyncio.timeout(10):
            await watcher  # ends quietly
    with pytest.raises(StoreError, match="closed"):
        await store.get(keys.worker("x"))


async def test_a_call_in_flight_when_the_store_moves_to_the_next_endpoint_is_retried_not_cancelled(
        etcd_endpoint: str, keys: Keys) -> None:
    # The first endpoint is a black hole (it accepts and never answers, as a member cut off or stopped). When
    # one call gives up on it, the store closes its client and moves on; gRPC then cancels the other calls in
    # flight on that channel. Such a call must be retried on the next endpoint: a CancelledError out of it
    # ended the agent's lease keepalive loop as if cancelled, and its workers vanished with the lease.
    connected = asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connected.set()
        await reader.read()  # until the client hangs up
        writer.close()

    hole = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = hole.sockets[0].getsockname()[1]
    async with hole, EtcdStore([f"127.0.0.1:{port}", etcd_endpoint], timeout_s=30.0) as store:
        put = asyncio.create_task(store.put(keys.worker("x"), b"1"))
        async with asyncio.timeout(10):
            await connected.wait()
        assert not put.done()
        # What the first failed call of several does (EtcdStore._call): give up on this client.
        await store._rotate(store._client)
        async with asyncio.timeout(10):
            await put
        assert (await store.get(keys.worker("x"))).value == b"1"  # type: ignore[union-attr]
        assert store.endpoint == etcd_endpoint


# -- watches ---------------------------------------------------------------------------------------------


async def test_watch_from_a_revision_sees_exactly_the_later_changes_in_order(
        store: EtcdStore, keys: Keys, wait_until) -> None:
    w = keys.worker
    for i in range(4):
        await store.put(w(f"early{i}"), b"e")
    middle = await store.put(w("early0"), b"e2")
    expected: list[tuple[str, str, bytes, int]] = []
    for i in range(3):
        expected.append(("put", w(f"late{i}"), b"l", await store.put(w(f"late{i}"), b"l")))
    expected.append(("delete", w("early1"), b"", (await store.txn([], [Delete(w("early1"))])).revision))
    # One transaction, three events with the same revision, in the order of its operations.
    txn = await store.txn([], [Put(w("late0"), b"l2"), Delete(w("early2")), Put(w("late3"), b"l")])
    expected += [("put", w("late0"), b"l2", txn.revision), ("delete", w("early2"), b"", txn.revision),
                 ("put", w("late3"), b"l", txn.revision)]
    await store.put(keys.router("elsewhere"), b"not under workers/")

    seen: list[WatchEvent] = []
    async with asyncio.TaskGroup() as tg:
        watcher = tg.create_task(_collect(store, keys.workers, middle + 1, seen))
        await wait_until(lambda: len(seen) >= len(expected), message="all later changes seen")
        watcher.cancel()
    assert _brief(seen) == expected


async def test_watch_survives_an_etcd_restart_without_loss_or_duplicates(make_etcd, keys: Keys,
                                                                        wait_until) -> None:
    etcd = await make_etcd()
    w = keys.worker
    async with EtcdStore(etcd.endpoint) as store:  # the default retries must ride out a restart
        start = await store.put(w("before"), b"0")
        seen: list[WatchEvent] = []
        async with asyncio.TaskGroup() as tg:
            watcher = tg.create_task(_collect(store, keys.workers, start + 1, seen))
            expected = [("put", w(f"a{i}"), b"1", await store.put(w(f"a{i}"), b"1")) for i in range(3)]
            await wait_until(lambda: len(seen) == 3, message="changes before the restart seen")

            await etcd.stop()
            etcd.start(etcd.data_dir.parent / "logs")
            await etcd.wait_ready()

            expected += [("put", w(f"b{i}"), b"2", await store.put(w(f"b{i}"), b"2")) for i in range(3)]
            expected.append(("delete", w("a0"), b"", (await store.txn([], [Delete(w("a0"))])).revision))
            await wait_until(lambda: len(seen) >= len(expected), timeout=30,
                             message="changes after the restart seen")
            watcher.cancel()
    assert _brief(seen) == expected


async def test_watch_from_a_compacted_revision_raises_store_error(store: EtcdStore, keys: Keys,
                                                                 etcd_endpoint: str) -> None:
    old = await store.put(keys.worker("c"), b"1")
    latest = await store.put(keys.worker("c"), b"2")
    host, _, port = etcd_endpoint.rpartition(":")
    async with aetcd.Client(host=host, port=int(port)) as raw:
        await raw.compact(latest)

    with pytest.raises(StoreError, match="compacted"):
        await store.get_prefix(keys.workers, revision=old)
    with pytest.raises(StoreError, match="compacted"):
        async with asyncio.timeout(10):
            async for _ in store.watch_prefix(keys.workers, start_revision=old):
                pass


# -- leases ----------------------------------------------------------------------------------------------


async def test_keys_of_a_kill_9ed_lease_holder_vanish_within_the_ttl(store: EtcdStore, keys: Keys,
                                                                    etcd_endpoint: str, spawn_python) -> None:
    ttl, n = 2, 3
    holder = await spawn_python(LEASE_HOLDER, etcd_endpoint, keys.workers, str(ttl), str(n))
    snap = await store.get_prefix(keys.workers)
    assert sorted(kv.key for kv in snap.items) == [keys.worker(str(i)) for i in range(n)]
    assert len({kv.lease for kv in snap.items}) == 1 and snap.items[0].lease != 0

    holder.kill()  # SIGKILL: no revoke, no goodbye; only the TTL can remove the keys

    deleted: set[str] = set()
    async with asyncio.timeout(ttl + 8), contextlib.aclosing(
            store.watch_prefix(keys.workers, start_revision=snap.revision + 1)) as changes:
        async for ev in changes:
            assert ev.kind == "delete"
            deleted.add(ev.key)
            if len(deleted) == n:
                break
    assert (await store.get_prefix(keys.workers)).items == ()


async def test_closing_a_lease_keeper_revokes_its_keys_at_once(store: EtcdStore, keys: Keys) -> None:
    lease = await LeaseKeeper(store, ttl=60).start()
    await store.put(keys.router("r1"), b"up", lease=lease.id)
    await store.put(keys.router("r2"), b"up", lease=lease.id)
    assert len((await store.get_prefix(keys.routers)).items) == 2

    await lease.aclose()

    assert (await store.get_prefix(keys.routers)).items == ()
    assert await store.keepalive(lease.id) == 0


async def _no_change_for(store: EtcdStore, prefix: str, start: int, seconds: float, why: str) -> None:
    """Fail on any change under ``prefix`` from revision ``start`` for ``seconds`` (a lease that lapsed shows as
    its keys' deletion)."""
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(seconds), contextlib.aclosing(
                store.watch_prefix(prefix, start_revision=start)) as changes:
            async for ev in changes:
                pytest.fail(f"{why}: {ev}")


async def test_lease_keeper_keeps_keys_past_the_ttl(store: EtcdStore, keys: Keys) -> None:
    ttl = 2
    async with LeaseKeeper(store, ttl=ttl) as lease:
        rev = await store.put(keys.router("r"), b"up", lease=lease.id)
        # Without keepalives etcd would delete the key about one TTL from now: watch well past that.
        await _no_change_for(store, keys.routers, rev + 1, ttl + 1.5, "unexpected change while the lease was kept "
                             "alive")
        assert not lease.lost.is_set()
    assert await store.get(keys.router("r")) is None


class _FirstKeepaliveUnanswered:
    """The real store, except that its first keepalive never gets an answer: what a member whose leader was cut
    off does (etcd answers only after its own request timeout, seconds past a short TTL)."""

    def __init__(self, store: EtcdStore) -> None:
        self.store = store
        self.stuck = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)

    async def keepalive(self, lease: int, *, attempt_timeout: float | None = None) -> int:
        if not self.stuck:
            self.stuck += 1
            await asyncio.Event().wait()
        return await self.store.keepalive(lease, attempt_timeout=attempt_timeout)


async def test_a_keepalive_with_no_answer_is_sent_again_before_the_lease_runs_out(store: EtcdStore,
                                                                               keys: Keys) -> None:
    ttl = 2
    slow = _FirstKeepaliveUnanswered(store)
    async with LeaseKeeper(slow, ttl=ttl) as lease:  # type: ignore[arg-type]
        rev = await store.put(keys.router("r"), b"up", lease=lease.id)
        await _no_change_for(store, keys.routers, rev + 1, ttl + 1.5, "the lease lapsed behind a keepalive that got "
                             "no answer")
        assert slow.stuck == 1 and not lease.lost.is_set()


async def test_a_keepalive_moves_on_from_a_member_that_answers_nothing(tmp_path: Path, keys: Keys) -> None:
    """The member the store talks to stops answering (SIGSTOP: its connections stay open, nothing comes back, as
    when a partition cuts it off): the keepalive gives up on it within a third of the interval and goes to the
    next member, so the lease outlives it. Without that, the call waits for the store's own timeout (5 s),
    past the TTL."""
    members = [LocalEtcd(tmp_path / f"etcd-{i}", name=f"etcd-{i}", cluster_token=keys.cluster) for i in range(3)]
    initial = ",".join(f"{m.name}={m.peer_url}" for m in members)
    try:
        for m in members:
            m.initial_cluster = initial
            m.start(tmp_path / "logs")
        await asyncio.gather(*(m.wait_ready() for m in members))
        ttl = 2
        async with EtcdStore([m.endpoint for m in members]) as store, \
                EtcdStore([m.endpoint for m in members[1:]]) as observer, LeaseKeeper(store, ttl=ttl) as lease:
            rev = await store.put(keys.router("r"), b"up", lease=lease.id)
            assert store.endpoint == members[0].endpoint
            assert members[0].process is not None
            members[0].process.signal(signal.SIGSTOP)
            await _no_change_for(observer, keys.routers, rev + 1, 2 * ttl + 1, "the lease lapsed on a member that "
                                 "answers nothing")
            assert not lease.lost.is_set() and store.endpoint != members[0].endpoint
            assert await observer.get(keys.router("r")) is not None
    finally:
        for m in members:
            if m.process is not None:
                m.process.signal(signal.SIGCONT)
            await m.stop()


def test_a_comma_separated_endpoint_is_a_cluster_s_members() -> None:
    assert EtcdStore("10.0.0.1:2379, 10.0.0.2:2379,10.0.0.3:2379").endpoints == (
        "10.0.0.1:2379", "10.0.0.2:2379", "10.0.0.3:2379")
    with pytest.raises(ValueError, match="not host:port"):
        EtcdStore("10.0.0.1:2379,10.0.0.2")


async def test_lease_keeper_reports_a_lease_revoked_behind_its_back(store: EtcdStore, wait_until) -> None:
    async with LeaseKeeper(store, ttl=1) as lease:
        await store.revoke(lease.id)
        await wait_until(lease.lost.is_set, message="lease reported lost")


# -- elections -------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _candidate(store: EtcdStore, prefix: str, name: str, ttl: int = 10) -> AsyncIterator[Election]:
    async with LeaseKeeper(store, ttl) as lease:
        yield Election(store, prefix, candidate=name, lease=lease)


async def test_one_of_two_candidates_leads_and_the_standby_takes_over_on_revoke(
        store: EtcdStore, keys: Keys, wait_until) -> None:
    prefix = keys.leader("supervisor")
    async with _candidate(store, prefix, "a") as a, _candidate(store, prefix, "b") as b:
        await a.campaign()
        async with asyncio.TaskGroup() as tg:
            b_campaign = tg.create_task(b.campaign())
            await wait_until(lambda: b.create_revision, message="b stands in line")
            assert await a.leader() == "a"
            assert await a.is_leader()
            assert (await store.txn([a.fence], [Put(keys.scale_of("p"), b"by a")])).succeeded

            await a.lease.aclose()  # the leader's lease is revoked: its key goes, the standby follows

            async with asyncio.timeout(10):
                await b_campaign
        assert await b.leader() == "b"
        assert await b.is_leader()
        assert not await a.is_leader()
        fenced = await store.txn([a.fence], [Put(keys.scale_of("p"), b"by the old leader")])
        assert not fenced.succeeded
        assert (kv := await store.get(keys.scale_of("p"))) is not None and kv.value == b"by a"


async def test_the_standby_takes_over_when_the_leader_process_is_killed(
        store: EtcdStore, keys: Keys, etcd_endpoint: str, spawn_python, wait_until) -> None:
    prefix = keys.leader("autoscaler")
    ttl = 2
    leader = await spawn_python(CANDIDATE, etcd_endpoint, prefix, str(ttl), "proc-a", ready="LEADER")
    async with _candidate(store, prefix, "b") as b, asyncio.TaskGroup() as tg:
        b_campaign = tg.create_task(b.campaign())
        await wait_until(lambda: b.create_revision, message="b stands in line")
        assert await b.leader() == "proc-a"
        assert not b_campaign.done()

        leader.kill()

        async with asyncio.timeout(ttl + 8):
            await b_campaign
        assert await b.leader() == "b"
        assert await b.is_leader()


async def test_resign_hands_leadership_to_the_next_candidate(store: EtcdStore, keys: Keys) -> None:
    prefix = keys.leader("controller")
    async with _candidate(store, prefix, "a") as a, _candidate(store, prefix, "b") as b:
        await a.campaign()
        async with asyncio.TaskGroup() as tg:
            b_campaign = tg.create_task(b.campaign())
            await a.resign()
            async with asyncio.timeout(10):
                await b_campaign
        assert await b.leader() == "b"
        with pytest.raises(StoreError, match="not campaigning"):
            _ = a.fence


async def test_lead_forever_keeps_the_leadership_gauge_counter_and_event(store: EtcdStore, keys: Keys) -> None:
    registry = CollectorRegistry()
    gauge = Gauge("t_is_leader", "1 while leading.", registry=registry)
    changes = Counter("t_leadership_changes", "Terms won.", registry=registry)
    leadership = Leadership(is_leader=gauge, changes=changes)
    terms: list[Election | None] = []
    lose_first = asyncio.Event()
    stepped_down = asyncio.Event()

    async def lead(lease: LeaseKeeper) -> None:
        terms.append(leadership.election)
        if len(terms) == 1:
            await lose_first.wait()
            raise LeadershipLost("told to")
        await asyncio.Event().wait()

    def count() -> tuple[float | None, float | None]:
        return (registry.get_sample_value("t_is_leader"), registry.get_sample_value("t_leadership_changes_total"))

    assert not leadership.leading.is_set() and leadership.election is None
    task = asyncio.create_task(lead_forever(store, keys.leader("autoscaler"), candidate="a", ttl_s=5, name="a",
                                            lead=lead, leadership=leadership, on_stepped_down=stepped_down.set))
    try:
        async with asyncio.timeout(10):
            await leadership.leading.wait()
        assert count() == (1.0, 1.0) and len(terms) == 1 and terms[0] is leadership.election
        lose_first.set()
        async with asyncio.timeout(10):
            await stepped_down.wait()
            while len(terms) < 2:
                await leadership.leading.wait()
                await asyncio.sleep(0)  # the next term's lead() runs right after leading is set
        assert count() == (1.0, 2.0) and leadership.leading.is_set() and terms[1] is not terms[0]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert count() == (0.0, 2.0) and not leadership.leading.is_set()
