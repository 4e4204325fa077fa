"""Incremental checkpoints (migration/checkpoint.py): a base, then deltas of what changed, compacted as they
grow; read back as one journal; claimed by another router. Against the session's real etcd."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.keys import Keys
from fleetward.migration.checkpoint import Checkpointer, NotResumable, read_checkpoint
from fleetward.migration.journal import Journal, Kind

BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 100_000, "stop": ["zz"]}

chunks = st.lists(st.tuples(st.lists(st.integers(0, 50_000), min_size=1, max_size=4), st.text("az é", max_size=4)),
                  min_size=1, max_size=40)


def journal(rid: str = "cmpl-fwcheckpointtest", prompt_len: int = 3) -> Journal:
    return Journal(id=rid, kind=Kind.COMPLETION, body={**BODY, "prompt": list(range(1, prompt_len + 1))})


def state(j: Journal) -> dict:
    return {k: v for k, v in j.checkpoint("r").items() if k != "created"}


@settings(max_examples=200, deadline=None)
@given(chunks, st.sets(st.integers(0, 40)), st.sets(st.integers(0, 40)))
def test_a_base_and_its_deltas_read_back_as_the_journal(chunks: list, flush_at: set[int], retried: set[int]) -> None:
    """Deltas taken at any points, some written twice (a write that timed out but committed), fold back into
    exactly what the journal holds; text held for a stop string and stop matches included."""
    j = journal()
    base = orjson.loads(j.checkpoint_bytes("r"))
    deltas: list[bytes] = []
    n = c = 0
    for i, (ids, text) in enumerate(chunks):
        j.record(ids, text, None, None)
        if i in flush_at or i == len(chunks) - 1 or j.is_done:
            d = j.delta_bytes(n, c)
            deltas += [d, d] if i in retried else [d]
            n, c = len(j.emitted), len(j.text)
        if j.is_done:
            break
    back = Journal.from_checkpoint(base)
    for d in deltas:
        assert back.apply_delta(orjson.loads(d))
    assert state(back) == state(j)
    assert back.text_after(len(back.emitted)) == ""


def test_a_delta_past_what_the_journal_holds_is_refused() -> None:
    j = journal()
    j.record([7, 8], "ab", None, None)
    gap = orjson.loads(j.delta_bytes(1, 1))
    fresh = journal()
    assert not fresh.apply_delta(gap) and fresh.emitted == []


async def test_checkpoint_bytes_follow_the_tokens_not_the_stream_length_and_read_back_exact(
        store: EtcdStore, keys: Keys) -> None:
    cp = Checkpointer(store, keys, "r1")
    full = Checkpointer(store, keys, "r-full", incremental=False)
    await cp.start()
    await full.start()
    try:
        j, other = journal("cmpl-fwincremental"), journal("cmpl-fwwholeeachtime")
        cp.track(j)
        full.track(other)
        per_flush: list[int] = []
        per_full_flush: list[int] = []
        for k in range(200):
            for jj in (j, other):
                jj.record([100 + k, 200 + k, 300 + k, 400 + k], f"t{k} ", None, None)
            before, before_full = cp.bytes_written, full.bytes_written
            await cp.flush()
            await full.flush()
            per_flush.append(cp.bytes_written - before)
            per_full_flush.append(full.bytes_written - before_full)
            if k % 50 == 49:
                found = await read_checkpoint(store, keys, j.id)
                assert found is not None and state(found[0]) == state(j)
        early, late = sum(per_flush[10:20]), sum(per_flush[190:200])
        assert late < 2 * early, f"bytes per flush grew with the stream: {early} -> {late}"
        assert sum(per_full_flush[190:200]) > 5 * sum(per_full_flush[10:20]), "the whole journal each time"
        assert cp.compactions > 0, "deltas are folded into a new base as they grow"
        deltas = (await store.get_prefix(keys.request(j.id) + "/")).items
        assert len(deltas) < 200, "compacted, not one key per flush forever"

        cp.done(j)
        await cp.flush()
        assert not (await store.get_prefix(keys.request(j.id))).items, "base and deltas go when it ends"
    finally:
        await cp.aclose()
        await full.aclose()


async def test_a_claim_compacts_and_the_old_owner_lets_go(store: EtcdStore, keys: Keys) -> None:
    lost: list[str] = []
    old = Checkpointer(store, keys, "r-old", on_lost=lost.append)
    new = Checkpointer(store, keys, "r-new")
    await old.start()
    await new.start()
    try:
        j = journal("cmpl-fwclaimedelsewhere", prompt_len=500)  # a base larger than the deltas: no compaction
        old.track(j)
        for k in range(5):
            j.record([k, k + 1], "xy", None, None)
            await old.flush()
        assert (await store.get_prefix(keys.request(j.id) + "/")).items, "deltas were written"
        claimed = await new.claim(j.id)
        assert claimed is not None and state(claimed) == state(j)
        assert not (await store.get_prefix(keys.request(j.id) + "/")).items, "compacted into the claim's base"
        kv = await store.get(keys.request(j.id))
        assert kv is not None and orjson.loads(kv.value)["router"] == "r-new"
        j.record([9], "z", None, None)
        await old.flush()
        assert lost == [j.id], "the old owner's next delta fails its compare"
        claimed.record([9], "z", None, None)
        await new.flush()
        found = await read_checkpoint(store, keys, j.id)
        assert found is not None and found[0].emitted == claimed.emitted
    finally:
        await old.aclose()
        await new.aclose()


async def test_a_request_this_router_finished_is_not_claimed_back_before_its_checkpoint_goes(
        store: EtcdStore, keys: Keys) -> None:
    """Between a request's end and the flush that deletes its checkpoint, a resume of it here is of a finished
    request (CI: a keyed fuzz run resumed one in that window and had it generated again)."""
    cp = Checkpointer(store, keys, "r1")
    await cp.start()
    try:
        j = journal("cmpl-fwfinishedhere")
        cp.track(j)
        j.record([4, 5], "ab", None, None)
        await cp.flush()
        cp.done(j)
        assert await read_checkpoint(store, keys, j.id) is not None, "the delete waits for the next flush"
        assert await cp.claim(j.id) is None
        await cp.flush()
        assert await read_checkpoint(store, keys, j.id) is None
    finally:
        await cp.aclose()


async def test_a_request_that_cannot_be_continued_exactly_is_not_claimed_and_its_checkpoint_stays(
        store: EtcdStore, keys: Keys) -> None:
    old = Checkpointer(store, keys, "r-old")
    new = Checkpointer(store, keys, "r-new")
    await old.start()
    await new.start()
    try:
        j = Journal(id="cmpl-fwconstrained", kind=Kind.COMPLETION, body={**BODY, "guided_regex": "[a-z]+"})
        j.prompt_ids = [1, 2, 3]
        old.track(j)
        await old.flush()
        assert await new.claim(j.id) is not None, "nothing sent yet: it may start over anywhere"
        await new.flush()
        k = Journal(id="cmpl-fwconstrainedsent", kind=Kind.COMPLETION, body={**BODY, "guided_regex": "[a-z]+"})
        k.prompt_ids = [1, 2, 3]
        old.track(k)
        k.record([7], "x", None, None)
        await old.flush()
        before = await store.get(keys.request(k.id))
        with pytest.raises(NotResumable, match="guided_regex"):
            await new.claim(k.id)
        after = await store.get(keys.request(k.id))
        assert before is not None and after is not None and after.mod_revision == before.mod_revision
        assert k.id not in new.live
    finally:
        await old.aclose()
        await new.aclose()


async def test_a_chat_requests_prompt_ids_learned_after_its_first_write_reach_the_checkpoint(
        store: EtcdStore, keys: Keys) -> None:
    """A chat request's base may be written before the worker reported the prompt's ids; deltas do not carry
    them, so learning them writes a new base (CI on vLLM: a resume on another router found none)."""
    cp = Checkpointer(store, keys, "r1")
    await cp.start()
    try:
        j = Journal(id="cmpl-fwchatpromptlater", kind=Kind.CHAT,
                    body={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50})
        cp.track(j)
        await cp.flush()
        j.prompt_ids = [5, 6, 7]
        j.record([40, 41], "ab", None, None)
        await cp.flush()
        j.deadline += 60  # a resume moves the deadline
        j.record([42], "c", None, None)
        await cp.flush()
        found = await read_checkpoint(store, keys, j.id)
        assert found is not None and state(found[0]) == state(j)
        assert found[0].prompt_ids == [5, 6, 7] and found[0].resumable() is None
    finally:
        await cp.aclose()
