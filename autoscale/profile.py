"""Measuring what one live worker carries: the capacity model the planner interpolates.

:func:`profile_worker` drives a worker's OpenAI-compatible ``/v1/completions`` (streamed, token-id prompts,
``ignore_eos`` so every answer has the asked length) with Poisson arrivals at rising rates, one step per
rate, and records each step's p99 TTFT and p99 of the requests' mean inter-token latency. It stops once the
SLA is broken by ``give_up_factor`` (past that point the queue only grows) or the rates run out.
:func:`measure_work` measures what the work costs the worker in its own units: prompt tokens/s (long prompts
one at a time, one token of answer each) and seconds of a step per output token at a full batch (``batch``
streams at once, short prompts: their mean ITL over the batch). ``fleetward profile`` adds the worker's
start-up time (launch to serving) when it starts the worker itself, and writes the
:class:`~fleetward.autoscale.capacity.CapacityModel` as JSON, with the mix it was measured at and the work.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Sequence

import httpx

from fleetward.autoscale.capacity import CapacityPoint, Sla
from fleetward.autoscale.live import ClientRecord, fixed_length_body, stream_request
from fleetward.autoscale.simulate import p99
from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.errors import FleetwardError

__all__ = ["ProfileStep", "measure_work", "profile_worker", "rising_rates"]

log = logging.getLogger(__name__)

ProfileStep = Callable[[float, CapacityPoint | None, int], None]  # (rate, its point or None, failed requests)


def rising_rates(first: float = 0.25, factor: float = 1.5, steps: int = 24) -> list[float]:
    return [round(first * factor ** i, 4) for i in range(steps)]


async def profile_worker(url: str, *, model: str, sla: Sla, rates: Sequence[float] | None = None, step_s: float = 20.0,
                         prompt_tokens: int = 128, max_tokens: int = 64, seed: int = 0, give_up_factor: float = 4.0,
                         on_step: ProfileStep | None = None, clock: Clock = SYSTEM_CLOCK) -> list[CapacityPoint]:
    """One :class:`CapacityPoint` per rate (requests/s), rising, until the SLA is broken ``give_up_factor``
    times over. Raises :class:`FleetwardError` when the worker answers nothing at the first rate."""
    rng = random.Random(seed)
    points: list[CapacityPoint] = []
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0), limits=limits, trust_env=False) as client:
        for rate in rates or rising_rates():
            tasks: list[asyncio.Task[ClientRecord]] = []
            t0 = clock.monotonic()
            t = 0.0
            while True:
                t += rng.expovariate(rate)
                if t > step_s:
                    break
                wait = t0 + t - clock.monotonic()
                if wait > 0:
                    await clock.sleep(wait)  # the arrival process, not a synchronisation
                body = fixed_length_body(model, [rng.randrange(10, 200) for _ in range(prompt_tokens)], max_tokens)
                tasks.append(asyncio.create_task(stream_request(client, url, body, ClientRecord(t, max_tokens),
                                                                clock=clock)))
            results = await asyncio.gather(*tasks)
            done = [(r.ttft_s, r.itl_s or 0.0) for r in results if r.ttft_s is not None and r.error is None]
            failed = len(results) - len(done)
            if not done:
                if not points:
                    raise FleetwardError(f"the worker at {url} answered none of {len(results)} request(s) at "
                                         f"{rate:g} req/s")
                if on_step is not None:
                    on_step(rate, None, failed)
                break
            point = CapacityPoint(rate, p99([a for a, _ in done]) or 0.0, p99([b for _, b in done]) or 0.0)
            points.append(point)
            if on_step is not None:
                on_step(rate, point, failed)
            if point.ttft_p99 > give_up_factor * sla.ttft_s or point.itl_p99 > give_up_factor * sla.itl_s:
                break
    return points


async def measure_work(url: str, *, model: str, prompt_tokens: int = 2048, batch: int = 16, output_tokens: int = 64,
                       repeats: int = 3, seed: int = 0, clock: Clock = SYSTEM_CLOCK) -> tuple[float, float]:
    """(prompt tokens/s, seconds per output token at a batch of ``batch``) of the worker at ``url``; raises
    :class:`FleetwardError` when it answers neither measurement."""
    rng = random.Random(seed)

    def body(prompt: int, tokens: int) -> dict[str, object]:
        return fixed_length_body(model, [rng.randrange(10, 200) for _ in range(prompt)], tokens)

    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0), trust_env=False) as client:
        firsts = []
        for _ in range(repeats):  # one at a time: nothing else shares the prefill
            rec = await stream_request(client, url, body(prompt_tokens, 1), ClientRecord(0.0, 1), clock=clock)
            if rec.ttft_s is not None and rec.error is None:
                firsts.append(rec.ttft_s)
        recs = await asyncio.gather(*(stream_request(client, url, body(8, output_tokens),
                                                     ClientRecord(0.0, output_tokens), clock=clock)
                                      for _ in range(batch)))
    itls = [r.itl_s for r in recs if r.itl_s and r.error is None]
    if not firsts or not itls:
        raise FleetwardError(f"the worker at {url} answered too little to measure its prefill and decode cost")
    firsts.sort()
    return prompt_tokens / firsts[len(firsts) // 2], sum(itls) / len(itls) / batch
