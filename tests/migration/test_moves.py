"""Planned moves carry a stream's KV (fleetward.migration.moves): simulated workers, real processes.

Two simulated workers behind two routers: ``kv`` (as shipped) and ``recompute`` (``routing.moves.kv: false``,
the re-prefill every move used to be). A stream moved for a plan (a drain past its deadline, an operator's
``POST /v1/moves``) is stopped on its worker, which hands over the KV of its prompt and emitted tokens
over the checked wire; the destination loads it and continues. The simulated worker generates from the KV
it loaded, so a wrong byte would give wrong tokens: every stream is compared with the model's own
continuation (ids) and with the same stream unmoved (text, on a BPE vocabulary). KV faults on the worker a
stream leaves (its send hook, as the chaos ``kv`` family sets it) must end in the re-prefill fallback,
exact.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testkit import PATIENT_SUPERVISOR, metric

from fleetward.chaos.harness import TestFleet
from fleetward.chaos.workload import sse_lines
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.config import MovesConfig, RouterConfig, SimConfig
from fleetward.sim.model import SimModel

SIM = SimConfig(decode_step_ms=6.0, decode_ms_per_seq=0.05, prefill_ms_per_token=0.05, seed=29, tokenizer="bpe",
                max_model_len=8192, kv_capacity_tokens=131072, kv_timeout_s=2.0)
MODEL = SimModel(seed=SIM.seed, eos_probability=SIM.eos_probability)


class MoveFleet:
    """Two workers, a controller, two routers, on their own event loop (hypothesis drives it synchronously)."""

    def __init__(self, etcd: str, mqtt: str, run_dir: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.fleet = TestFleet(etcd=etcd, mqtt=mqtt, cluster="moves", run_dir=run_dir, workers=2,
                               backend=SimBackend(SIM), routing=RouterConfig(stall_floor_s=1.0, affinity_tokens=0),
                               supervisor=PATIENT_SUPERVISOR.model_copy(update={"drain_move_s": 10.0}))
        self.run(self.fleet.start())
        self.kv = self.run(self.fleet.start_router("kv")).url
        self.recompute = self.run(self.fleet.start_router("recompute", moves=MovesConfig(kv=False))).url

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.run(self.fleet.aclose())
        self.loop.close()

    async def kv_stats(self) -> dict[str, dict[str, Any]]:
        return {w: dict((await self.fleet.state(w))["kv"]) for w in self.fleet.worker_ids}

    async def restore(self) -> None:
        for w in self.fleet.worker_ids:
            try:
                await self.fleet.fault(w, kv={"clear": True})
            except httpx.HTTPError:
                pass
        await self.fleet.restore(timeout=60)


@pytest.fixture(scope="module")
def mf(etcd_endpoint: str, broker_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MoveFleet]:
    h = MoveFleet(etcd_endpoint, broker_endpoint, tmp_path_factory.mktemp("moves"))
    try:
        h.run(h.fleet.restore(timeout=60))
        yield h
    finally:
        h.close()


@dataclass
class Read:
    """A stream as its client read it: ids, text, the worker of each token, its request id."""

    rid: str = ""
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    workers: list[str] = field(default_factory=list)
    error: str | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)


async def read(router: str, prompt: list[int], n: int, got: Read, *, started_after: int = 10) -> Read:
    body = {"model": SIM.model_name, "prompt": prompt, "max_tokens": n, "stream": True, "return_token_ids": True}
    async with httpx.AsyncClient(timeout=60) as client, client.stream(
            "POST", router + "/v1/completions", json=body, headers={"X-Fleetward-Trace": "1"}) as r:
        assert r.status_code == 200, await r.aread()
        got.rid = r.headers["x-request-id"]
        async for line in sse_lines(r.aiter_bytes()):
            if not line.startswith("data: {"):
                continue
            data = orjson.loads(line[6:])
            if "error" in data:
                got.error = data["error"]["message"]
                continue
            for c in data.get("choices") or []:
                ids = c.get("token_ids") or []
                got.tokens += ids
                got.text += c.get("text") or ""
                got.workers += [data["fleetward"]["worker"]] * len(ids)
            if len(got.tokens) >= started_after:
                got.started.set()
    got.started.set()
    return got


def prompt_of(seed: int, length: int) -> list[int]:
    return [300 + (seed * 131 + i * 17) % 700 for i in range(length)]


async def moves(router: str) -> dict[tuple[str, str], float]:
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(router + "/metrics")).text
    return {(t, o): metric(text, "fleetward_router_moves_total", trigger=t, outcome=o)
            for t in ("drain", "operator") for o in ("kv", "reprefill", "failed")}


async def reference(router: str, prompt: list[int], n: int) -> Read:
    return await read(router, prompt, n, Read())


def test_a_drained_workers_streams_move_with_their_kv_exactly(mf: MoveFleet) -> None:
    """A drain past its deadline: the streams still on the drained worker move with their KV, longest first;
    each is the model's continuation, ids and text, and the destination loaded KV for each."""
    async def go() -> None:
        prompts = [prompt_of(s, 300 + 200 * s) for s in range(4)]
        refs = [await reference(mf.kv, p, 400) for p in prompts]
        before, stats = await moves(mf.kv), await mf.kv_stats()
        reads = [Read() for _ in prompts]
        tasks = [asyncio.ensure_future(read(mf.kv, p, 400, g)) for p, g in zip(prompts, reads, strict=True)]
        for g in reads:
            await g.started.wait()
        source = max(set(mf.fleet.worker_ids), key=lambda w: sum(g.workers[-1] == w for g in reads if g.workers))
        on_source = sum(1 for g in reads if g.workers[-1] == source)
        r = await mf.fleet.supervisor_command(source, "drain", {"deadline_s": 0, "then": "cordon"})
        assert r.status_code == 200, r.text
        got = await asyncio.gather(*tasks)
        try:
            for g, want in zip(got, refs, strict=True):
                assert g.error is None, g.error
                assert g.tokens == want.tokens and g.text == want.text, "one exact stream, ids and text"
            moved = [g for g in got if g.workers[0] == source and g.workers[-1] != source]
            paths = [(g.workers[0], g.workers[-1]) for g in got]
            # Each stream on the drained worker moved, or finished there before its move came.
            assert moved and all(g in moved or g.workers[0] == g.workers[-1] for g in got), paths
            assert len(moved) <= on_source
            after, kv = await moves(mf.kv), await mf.kv_stats()
            assert after[("drain", "kv")] - before[("drain", "kv")] == len(moved)
            dest = next(w for w in mf.fleet.worker_ids if w != source)
            assert kv[dest]["loaded"] - stats[dest]["loaded"] == len(moved), "the destination loaded each one's KV"
        finally:
            await mf.fleet.supervisor_command(source, "undrain")
            await mf.restore()

    mf.run(go())


async def _operator_move(mf: MoveFleet, router: str, prompt: list[int], *, after: int, fault: str | None = None,
                         n: int = 100) -> tuple[Read, Read, dict[tuple[str, str], float]]:
    want = await reference(router, prompt, n)
    before = await moves(router)
    g = Read()
    task = asyncio.ensure_future(read(router, prompt, n, g, started_after=after))
    await g.started.wait()
    source = g.workers[-1]
    if fault is not None:
        await mf.fleet.fault(source, kv={"add": {"id": f"t-{fault}", "kind": fault}})
    r = await mf.fleet.supervisor_post("/v1/moves", {"request": g.rid})
    assert r.status_code == 200, r.text
    await task
    after_ = await moves(router)
    return g, want, {k: after_[k] - before[k] for k in after_}


def test_an_operator_moves_one_stream_with_its_kv(mf: MoveFleet) -> None:
    async def go() -> None:
        g, want, delta = await _operator_move(mf, mf.kv, prompt_of(7, 900), after=15, n=400)
        assert g.error is None and g.tokens == want.tokens and g.text == want.text
        assert len(set(g.workers)) == 2, "it moved"
        assert delta[("operator", "kv")] == 1 and sum(delta.values()) == 1

    mf.run(go())


@pytest.mark.parametrize("fault", ["corrupt", "truncate", "stale"])
def test_a_kv_handover_that_fails_its_check_falls_back_to_computing_the_stream_again(mf: MoveFleet,
                                                                                     fault: str) -> None:
    async def go() -> None:
        try:
            # A prompt of its own: ``stale`` sends the previous transfer's blocks, right if they were this one's.
            g, want, delta = await _operator_move(mf, mf.kv, prompt_of(11 + len(fault), 700), after=12, fault=fault,
                                                  n=400)
            assert g.error is None and g.tokens == want.tokens and g.text == want.text, "later, never wrong"
            assert delta[("operator", "reprefill")] == 1 and sum(delta.values()) == 1
        finally:
            await mf.restore()

    mf.run(go())


def test_with_moves_kv_off_a_planned_move_computes_the_stream_again(mf: MoveFleet) -> None:
    async def go() -> None:
        stats = await mf.kv_stats()
        g, want, delta = await _operator_move(mf, mf.recompute, prompt_of(13, 600), after=12, n=400)
        assert g.error is None and g.tokens == want.tokens and g.text == want.text
        assert delta[("operator", "reprefill")] == 1 and sum(delta.values()) == 1
        kv = await mf.kv_stats()
        assert all(kv[w]["loaded"] == stats[w]["loaded"] for w in kv), "no KV moved"

    mf.run(go())


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(after=st.integers(1, 60), length=st.integers(20, 1200),
       fault=st.sampled_from([None, None, "corrupt", "drop", "duplicate", "stale", "truncate", "prefill_dies"]))
def test_property_any_move_at_any_point_under_any_kv_fault_is_exact(mf: MoveFleet, after: int, length: int,
                                                                     fault: str | None) -> None:
    """Whatever the point of the move, the context, and the fault on the handover (the worker it leaves dies
    mid-transfer included): the stream is the model's continuation, ids and text."""
    async def go() -> None:
        try:
            g, want, delta = await _operator_move(mf, mf.kv, prompt_of(length, length), after=after, fault=fault, n=80)
            assert g.error is None and g.tokens == want.tokens and g.text == want.text
            assert sum(delta.values()) <= 1, delta  # 0: it finished before the move could stop it
            if fault is None and delta[("operator", "kv")] == 0:
                assert len(set(g.workers)) == 1, "not moved: it ended first"
        finally:
            await mf.restore()

    mf.run(go())


def test_a_router_rebalances_a_crowded_worker_by_moving_its_longest_streams_with_their_kv(mf: MoveFleet) -> None:
    """Every stream lands on one worker while the other is cordoned; once it is back, a router with
    ``moves.rebalance`` moves the longest of them over, with their KV, until both carry about as many."""
    async def go() -> None:
        rebalancer = await mf.fleet.start_router("rebalancer", moves=MovesConfig(
            rebalance=True, rebalance_ratio=1.5, rebalance_min_streams=3, rebalance_interval_s=0.2))
        url = rebalancer.url
        crowded, empty = mf.fleet.worker_ids
        try:
            r = await mf.fleet.supervisor_command(empty, "drain", {"deadline_s": 60, "then": "cordon"})
            assert r.status_code == 200, r.text
            await mf.fleet.wait_workers_routable(1)
            prompts = [prompt_of(50 + i, 200 + 250 * i) for i in range(4)]
            refs = [await reference(url, p, 800) for p in prompts]
            reads = [Read() for _ in prompts]
            tasks = [asyncio.ensure_future(read(url, p, 800, g)) for p, g in zip(prompts, reads, strict=True)]
            for g in reads:
                await g.started.wait()
            before = await moves_of(url, "rebalance")
            assert (await mf.fleet.supervisor_command(empty, "undrain")).status_code == 200
            got = await asyncio.gather(*tasks)
            for g, want in zip(got, refs, strict=True):
                assert g.error is None and g.tokens == want.tokens and g.text == want.text
            moved = [i for i, g in enumerate(got) if g.workers[0] == crowded and g.workers[-1] == empty]
            paths = [[w for k, w in enumerate(g.workers) if k == 0 or g.workers[k - 1] != w] for g in got]
            # (rebalance_min_streams 3: once the short streams end on one worker, the 2 on the other stay put)
            assert moved == [2, 3], ("the longest two, to even the load: 4 against 0 becomes 2 and 2", paths)
            after = await moves_of(url, "rebalance")
            assert after["kv"] - before["kv"] == 2 and after["reprefill"] == before["reprefill"]
        finally:
            await mf.fleet.supervisor_command(empty, "undrain")
            await mf.fleet.stop_router(rebalancer)
            await mf.restore()

    mf.run(go())


async def moves_of(router: str, trigger: str) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(router + "/metrics")).text
    return {o: metric(text, "fleetward_router_moves_total", trigger=trigger, outcome=o)
            for o in ("kv", "reprefill", "failed")}
