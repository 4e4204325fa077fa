"""Checkpoints kept by peer routers (migration/replicas.py, ``routing.checkpoint_store: peers``): the copy a
peer holds reads back as the owner's journal, whatever the flushes and peer changes in between; a claim there
takes the request from its owner; copies of a silent owner expire. The router-to-router HTTP path and a
resume after the owner is killed are in test_router.py."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetward.fleet.clock import ManualClock
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.keys import Keys
from fleetward.migration.checkpoint import Checkpointer, read_checkpoint
from fleetward.migration.journal import Journal, Kind
from fleetward.migration.replicas import NotClaimable, PeerLink, Replicas, encode_batch, pick_peer

BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 100_000}


def journal(rid: str = "cmpl-fwreplicatest", owner: str | None = None) -> Journal:
    j = Journal(id=rid, kind=Kind.COMPLETION, body=dict(BODY))
    j.prompt_ids = [1, 2, 3]
    j.owner = owner
    return j


def state(j: Journal) -> dict[str, Any]:
    return {k: v for k, v in j.checkpoint("r").items() if k not in ("created", "router")}


def test_the_peer_is_the_next_router_by_id_that_keeps_copies() -> None:
    routers: dict[str, dict[str, Any]] = {
        "b": {"url": "http://b", "replicas": True}, "d": {"url": "http://d", "replicas": True},
        "c": {"url": "http://c"}, "a": {"url": "http://a", "replicas": True}}
    assert pick_peer("a", routers) == ("b", "http://b")
    assert pick_peer("b", routers) == ("d", "http://d")  # c keeps its checkpoints in etcd: not a peer
    assert pick_peer("d", routers) == ("a", "http://a")  # wraps around
    assert pick_peer("c", routers) == ("d", "http://d")
    assert pick_peer("a", {"a": routers["a"]}) is None


def test_a_claim_takes_the_request_from_its_owner_and_a_key_guards_it() -> None:
    holder = Replicas()
    j = journal(owner="team-a")
    j.record([5, 6], "ab", None, None)
    holder.apply(encode_batch("r-owner", 30, [(j.id, "base", 2, j.checkpoint_bytes("r-owner"))]))
    assert holder.claim(j.id, by="r-other", key="team-b") is None, "another API key's request is unknown"
    claimed = holder.claim(j.id, by="r-other", key="team-a")
    assert claimed is not None and state(claimed) == state(j)
    j.record([7], "c", None, None)
    answer = holder.apply(encode_batch("r-owner", 30, [(j.id, "delta", 3, j.delta_bytes(2, 2))]))
    assert answer == {"lost": [j.id], "rebase": []}, "the old owner's next write is refused"


def test_a_delta_without_a_base_asks_for_the_whole_journal() -> None:
    holder = Replicas()
    j = journal()
    j.record([5], "a", None, None)
    assert holder.apply(encode_batch("r-owner", 30, [(j.id, "delta", 1, j.delta_bytes(0, 0))])) == \
        {"lost": [], "rebase": [j.id]}
    assert holder.tokens(j.id) is None


def test_a_request_that_cannot_be_continued_exactly_is_left_as_it_was() -> None:
    holder = Replicas()
    j = Journal(id="cmpl-fwconstrained", kind=Kind.COMPLETION, body={**BODY, "guided_regex": "[a-z]+"})
    j.prompt_ids = [1, 2, 3]
    j.record([5], "a", None, None)
    holder.apply(encode_batch("r-owner", 30, [(j.id, "base", 1, j.checkpoint_bytes("r-owner"))]))
    with pytest.raises(NotClaimable):
        holder.claim(j.id, by="r-other", key=None)
    assert holder.tokens(j.id) == 1


def test_the_copies_of_a_silent_owner_expire_after_its_ttl() -> None:
    clock = ManualClock()
    holder = Replicas(clock=clock)
    j = journal()
    j.record([5], "a", None, None)
    holder.apply(encode_batch("r-owner", 10, [(j.id, "base", 1, j.checkpoint_bytes("r-owner"))]))
    clock.advance(9)
    holder.apply(encode_batch("r-owner", 10, []))  # an empty write keeps them
    clock.advance(9)
    assert holder.tokens(j.id) == 1
    clock.advance(2)
    assert holder.tokens(j.id) is None


class _Direct(PeerLink):
    """The owner's link with the HTTP hop taken out: its writes go straight to the holders' real code."""

    def __init__(self, me: str, holders: Mapping[str, Replicas]) -> None:
        self.me, self.holders = me, holders
        self.current: str | None = None

    def peer(self) -> tuple[str, str] | None:
        return None if self.current is None else (self.current, self.current)

    async def send(self, peer: tuple[str, str], body: bytes) -> dict[str, list[str]]:
        return self.holders[peer[1]].apply(body)


chunks = st.lists(st.tuples(st.lists(st.integers(0, 50_000), min_size=1, max_size=4), st.text("az é", max_size=4),
                            st.sampled_from(["flush", "grow", "grow", "p1", "p2", "etcd"])), min_size=1, max_size=30)


@settings(max_examples=40, deadline=None)
@given(chunks)
def test_the_newest_copy_reads_back_as_the_journal_whatever_the_flushes_and_peer_changes(
        etcd_endpoint: str, chunks: list[tuple[list[int], str, str]]) -> None:
    """Tokens arrive; flushes happen; the peer changes (p1, p2) or there is none (etcd). After a last flush,
    the copy a resume would pick (the most tokens among the holders, or etcd's) is the journal, exactly,
    and etcd keeps nothing of a request written to a peer."""

    async def run() -> None:
        keys = Keys(f"replicas-{uuid.uuid4().hex[:8]}")
        async with EtcdStore(etcd_endpoint) as store:
            holders = {"p1": Replicas(), "p2": Replicas()}
            link = _Direct("r-owner", holders)
            cp = Checkpointer(store, keys, "r-owner")
            cp.peers = link
            await cp.start()
            try:
                j = journal()
                cp.track(j)
                for ids, text, step in chunks:
                    j.record(ids, text, None, None)
                    if step in ("p1", "p2"):
                        link.current = step
                    elif step == "etcd":
                        link.current = None
                    if step != "grow":
                        await cp.flush()
                    if j.is_done:
                        break
                await cp.flush()
                in_etcd = await read_checkpoint(store, keys, j.id)
                if link.current is None:
                    assert in_etcd is not None and state(in_etcd[0]) == state(j)
                else:
                    assert in_etcd is None, "written to a peer: etcd holds none of it"
                    best = max(holders.values(), key=lambda h: h.tokens(j.id) or -1)
                    copy = best.claim(j.id, by="r-rescue", key=None)
                    assert copy is not None and state(copy) == state(j)
            finally:
                await cp.aclose()
                await store.delete(keys.root, prefix=True)

    asyncio.run(run())


async def test_a_router_asked_to_keep_checkpoints_with_peers_without_the_admin_token_refuses_and_names_the_field(
        store: EtcdStore, bus: Any, keys: Keys) -> None:
    from fleetward.fleet.config import RouterConfig
    from fleetward.fleet.errors import ConfigError
    from fleetward.migration.router import Router

    with pytest.raises(ConfigError, match="FLEETWARD_ADMIN_TOKEN") as err:
        Router(RouterConfig(checkpoint_store="peers"), store=store, bus=bus, keys=keys, router_id="no-token")
    assert err.value.field == "routing.checkpoint_store"
    kept = Router(RouterConfig(checkpoint_store="peers"), store=store, bus=bus, keys=keys, router_id="token",
                  admin_token="s3cret")
    assert kept.replicas is not None and kept.checkpointer.peers is not None
    assert Router(RouterConfig(), store=store, bus=bus, keys=keys, router_id="etcd").replicas is None
