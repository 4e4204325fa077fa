"""The simulated worker's scheduler and engine: batching, queueing, KV, preemption, stop rules (sans IO),
and the engine in manual time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from testkit import (
    eventually,
    instant_sim,
    pump,
)

from fleetward.fleet.clock import ManualClock
from fleetward.fleet.config import SimConfig
from fleetward.sim.engine import (
    Faults,
    SamplingSpec,
    SimEngine,
    SimRequest,
    SimScheduler,
)
from fleetward.sim.model import SimModel
from fleetward.sim.tokenizer import encode

DATA = Path(__file__).parents[1] / "data" / "vllm-0.32"
MODEL = "sim-test"
FAST = instant_sim(model_name=MODEL)
SIM = SimModel(FAST.seed, FAST.eos_probability)


# -- batching and queueing (sans IO) ------------------------------------------------------------------------


def _config(**kw: Any) -> SimConfig:
    base = {"decode_step_ms": 10.0, "decode_ms_per_seq": 1.0, "prefill_ms_per_token": 0.5}
    return SimConfig(**{**base, **kw})


def _run_to_end(s: SimScheduler) -> int:
    now, steps = 0.0, 0
    while (step := s.schedule(now)) is not None:
        now += step.duration
        s.complete(step, now)
        steps += 1
    return steps


def test_max_num_seqs_makes_the_rest_wait() -> None:
    s = SimScheduler(_config(max_num_seqs=2))
    reqs = [s.new_request(f"r{i}", encode("ab"), SamplingSpec(max_tokens=1 + i), now=0.0) for i in range(3)]
    for r in reqs:
        s.add(r)
    step = s.schedule(0.0)
    assert step is not None and step.batch == reqs[:2] and list(s.waiting) == [reqs[2]]
    s.complete(step, step.duration)  # r0 is done after one token: its slot frees
    step = s.schedule(step.duration)
    assert step is not None and step.batch == [reqs[1], reqs[2]] and step.admitted == [reqs[2]]
    assert reqs[2].admitted_at == pytest.approx(0.0 + (10 + 2 * 1 + 0.5 * 4) / 1000)


def test_kv_capacity_makes_requests_wait_until_blocks_free() -> None:
    s = SimScheduler(_config(kv_capacity_tokens=64, max_model_len=48, kv_block_size=16))
    a = s.new_request("a", [10] * 40, SamplingSpec(max_tokens=2), now=0.0)
    b = s.new_request("b", [11] * 40, SamplingSpec(max_tokens=2), now=0.0)
    s.add(a)
    s.add(b)
    step = s.schedule(0.0)
    assert step is not None and step.batch == [a] and list(s.waiting) == [b]
    assert s.kv_usage == 0.75
    _run_to_end(s)
    assert a.output_ids == SIM.continuation([10] * 40, 2) and b.output_ids == SIM.continuation([11] * 40, 2)
    assert s.kv_usage == 0.0 and b.admitted_at is not None and b.admitted_at > 0


def test_step_time_grows_with_the_batch_and_with_prefill() -> None:
    s = SimScheduler(_config())
    for i in range(4):
        s.add(s.new_request(f"r{i}", [5] * 10, SamplingSpec(max_tokens=5), now=0.0))
    prefill = s.schedule(0.0)
    assert prefill is not None and prefill.prefill_tokens == 40
    assert prefill.duration == pytest.approx((10 + 4 * 1 + 0.5 * 40) / 1000)
    s.complete(prefill, prefill.duration)
    decode_step = s.schedule(prefill.duration)
    assert decode_step is not None and decode_step.duration == pytest.approx((10 + 4) / 1000)
    single = SimScheduler(_config())
    single.add(single.new_request("x", [5] * 10, SamplingSpec(max_tokens=5), now=0.0))
    first = single.schedule(0.0)
    assert first is not None
    single.complete(first, first.duration)
    lone = single.schedule(first.duration)
    assert lone is not None and lone.duration < decode_step.duration


def test_chunked_prefill_keeps_the_batch_decoding_while_a_long_prompt_is_computed() -> None:
    """A 1,000-token prompt arrives while a short sequence decodes: without chunking its prefill is one step
    that holds the batch (one token for the short one in 520 ms); with chunks of 100 the short sequence gets a
    token every step meanwhile, and the long one its first token after ten chunks; tokens stay exact."""
    for chunk, short_tokens_during, long_first_step in ((0, 1, 2), (100, 10, 11)):
        s = SimScheduler(_config(chunked_prefill_tokens=chunk, max_model_len=2048))
        short = s.new_request("short", [5] * 4, SamplingSpec(max_tokens=40), now=0.0)
        long = s.new_request("long", [6] * 1000, SamplingSpec(max_tokens=3), now=0.0)
        s.add(short)
        first = s.schedule(0.0)
        assert first is not None
        now = first.duration
        s.complete(first, now)
        s.add(long)
        durations = []
        while long.first_token_at is None:
            step = s.schedule(now)
            assert step is not None
            now += step.duration
            durations.append(step.duration)
            s.complete(step, now)
        assert len(durations) == long_first_step - 1
        assert len(short.output_ids) - 1 == short_tokens_during
        if chunk:
            assert max(durations) == pytest.approx((10 + 2 * 1 + 0.5 * 100) / 1000), "a chunk's cost per step"
        else:
            assert durations == [pytest.approx((10 + 2 * 1 + 0.5 * 1000) / 1000)], "the whole prompt at once"
        _run_to_end(s)
        assert short.output_ids == SIM.continuation([5] * 4, 40) and long.output_ids == SIM.continuation([6] * 1000, 3)


def test_preempted_sequences_resume_exactly_where_they_were() -> None:
    s = SimScheduler(_config(kv_capacity_tokens=64, max_model_len=64, kv_block_size=16))
    prompts = [[20] * 24, [21] * 24]
    reqs = [s.new_request(f"r{i}", p, SamplingSpec(max_tokens=30), now=0.0) for i, p in enumerate(prompts)]
    for r in reqs:
        s.add(r)
    _run_to_end(s)
    assert s.stats.preemptions >= 1
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output_ids == SIM.continuation(p, 30) and r.finish_reason == "length"


def test_min_tokens_masks_stop_token_ids_too() -> None:
    prompt = encode("mask")
    masked = frozenset(SIM.continuation(prompt, 3))
    s = SimScheduler(_config())
    req = s.new_request("r", prompt, SamplingSpec(max_tokens=20, stop_token_ids=masked, min_tokens=6), now=0.0)
    s.add(req)
    _run_to_end(s)
    assert len(req.output_ids) >= 6 and not masked & set(req.output_ids[:6])
    assert req.finish_reason == "length" or req.output_ids[-1] in masked


def test_slowdown_multiplies_step_time() -> None:
    normal = SimScheduler(_config())
    slow = SimScheduler(_config(), faults=Faults(slowdown=3.0))
    for s in (normal, slow):
        s.add(s.new_request("r", [5] * 8, SamplingSpec(max_tokens=3), now=0.0))
    a, b = normal.schedule(0.0), slow.schedule(0.0)
    assert a is not None and b is not None and b.duration == pytest.approx(3 * a.duration)


def test_reset_after_tokens_cuts_a_sequence_at_its_kth_token_and_frees_it() -> None:
    faults = Faults(reset_after_tokens=3)
    s = SimScheduler(_config(), faults=faults)
    long = s.new_request("long", encode("a"), SamplingSpec(max_tokens=10), now=0.0)
    short = s.new_request("short", encode("b"), SamplingSpec(max_tokens=2), now=0.0)
    for r in (long, short):
        s.add(r)
    _run_to_end(s)
    assert long.output_ids == SIM.continuation(encode("a"), 3)
    assert (long.finish_reason, long.cut_at) == ("abort", 3)
    assert (short.finish_reason, short.cut_at) == ("length", None)  # ended on its own before k
    assert s.free_blocks == s.total_blocks and s.stats.finished["abort"] == 1

    # Switched on when a sequence is already past k: cut at its next step, without a further token.
    faults.reset_after_tokens = None
    late = s.new_request("late", encode("c"), SamplingSpec(max_tokens=10), now=0.0)
    s.add(late)
    for _ in range(5):
        step = s.schedule(0.0)
        assert step is not None
        s.complete(step, 0.0)
    faults.reset_after_tokens = 3
    _run_to_end(s)
    assert (late.output_ids, late.cut_at) == (SIM.continuation(encode("c"), 5), 5)


def test_scheduler_refuses_a_kv_cache_smaller_than_one_sequence() -> None:
    from fleetward.fleet.errors import ConfigError

    with pytest.raises(ConfigError, match="kv_capacity_tokens"):
        SimScheduler(SimConfig(kv_capacity_tokens=64, max_model_len=128))


# -- the engine in (manual) time ------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def running(engine: SimEngine) -> AsyncIterator[SimEngine]:
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(engine.run())
        try:
            yield engine
        finally:
            task.cancel()


async def test_ttft_includes_the_prefill_step_and_then_tokens_come_every_decode_step() -> None:
    clock = ManualClock()
    async with running(SimEngine(_config(), clock=clock)) as engine:
        req = engine.submit([7] * 100, SamplingSpec(max_tokens=3))
        await eventually(lambda: clock.sleepers == 1)
        clock.advance(0.0605)  # the prefill step takes (10 + 1 + 0.5 * 100) ms = 61 ms
        assert req.output_ids == [] and clock.sleepers == 1
        clock.advance(0.001)
        await eventually(lambda: len(req.output_ids) == 1)
        assert req.first_token_at is not None and 0.0605 < req.first_token_at - req.arrival <= 0.0615
        await eventually(lambda: clock.sleepers == 1)
        # A decode step takes (10 + 1) ms, counted from where the prefill step was due to end (61 ms).
        clock.advance(0.0715 - clock.monotonic())
        assert len(req.output_ids) == 1 and clock.sleepers == 1
        clock.advance(0.001)
        await eventually(lambda: len(req.output_ids) == 2)
    assert req.output_ids == SIM.continuation([7] * 100, 2)


async def test_a_request_queued_behind_max_num_seqs_waits_for_the_slot_then_prefills() -> None:
    clock = ManualClock()
    config = _config(decode_ms_per_seq=0.0, prefill_ms_per_token=0.0, max_num_seqs=1)
    async with running(SimEngine(config, clock=clock)) as engine:
        a = engine.submit([7] * 4, SamplingSpec(max_tokens=2))
        b = engine.submit([8] * 4, SamplingSpec(max_tokens=1))
        for _ in range(3):  # every step takes 10 ms: a's prefill, a's decode, then b's prefill
            await eventually(lambda: clock.sleepers == 1)
            assert engine.state()["running"] == 1
            assert engine.state()["waiting"] == (0 if a.is_finished else 1)
            clock.advance(0.0101)
        await b.wait_finished()
    assert a.first_token_at is not None and b.first_token_at is not None
    assert 0.010 <= a.first_token_at - a.arrival < 0.011
    assert 0.030 <= b.first_token_at - b.arrival < 0.031


async def test_slowdown_switch_stretches_steps_in_time() -> None:
    clock = ManualClock()
    async with running(SimEngine(_config(prefill_ms_per_token=0.0), clock=clock)) as engine:
        engine.update_faults(Faults(slowdown=3.0))
        req = engine.submit([7] * 4, SamplingSpec(max_tokens=1))
        await eventually(lambda: clock.sleepers == 1)
        clock.advance(0.011 * 3 - 0.001)  # one step is 11 ms, three times slower
        assert req.output_ids == []
        clock.advance(0.002)
        await req.wait_finished()


async def test_crash_budget_emits_exactly_k_tokens_and_crashes_once_consumers_passed_them_on() -> None:
    clock = ManualClock()
    delivered: list[int] = []
    crashes: list[int] = []
    engine = SimEngine(_config(decode_ms_per_seq=0.0, prefill_ms_per_token=0.0), clock=clock,
                       faults=Faults(crash_after_tokens=5), crash=lambda: crashes.append(len(delivered)))
    gate = asyncio.Event()

    async def consume(req: SimRequest, *, holds_first_chunk: bool) -> None:
        try:
            while True:
                delta = await req.next_output()
                delivered.extend(delta.token_ids)
                if holds_first_chunk:  # still "sending" its first chunk: it has not passed the rest on
                    holds_first_chunk = False
                    await gate.wait()
        finally:
            engine.release(req)

    async with running(engine), asyncio.TaskGroup() as tg:
        a = engine.submit(encode("a"), SamplingSpec(max_tokens=100))
        b = engine.submit(encode("b"), SamplingSpec(max_tokens=100))
        consumers = [tg.create_task(consume(a, holds_first_chunk=False)),
                     tg.create_task(consume(b, holds_first_chunk=True))]
        await pump(clock, lambda: engine.faults.crash_after_tokens != 5)
        assert engine.faults.to_json()["crash_after_tokens"] == 3  # one step, two tokens: it counts down
        await pump(clock, lambda: engine.faults.crash_after_tokens == 0)
        # The step that spent the budget had one token left: the first sequence of the batch got it.
        assert (len(a.output_ids), len(b.output_ids)) == (3, 2)
        await eventually(lambda: a.is_parked)
        assert crashes == [] and clock.sleepers == 0  # b's consumer still holds tokens; no step is planned
        gate.set()
        await eventually(lambda: crashes != [])
        assert crashes == [5] and engine.stats.generation_tokens == 5

        engine.update_faults(Faults())  # cleared (only an in-process crash returns): the engine goes on
        await pump(clock, lambda: len(a.output_ids) > 3)
        assert crashes == [5]
        for task in consumers:
            task.cancel()
    assert a.output_ids == SIM.continuation(encode("a"), len(a.output_ids))
