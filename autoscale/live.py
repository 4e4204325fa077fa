"""Replaying a request trace against a live fleet: what ``fleetward replay TRACE`` (without ``--simulate``) runs.

:func:`replay_live` sends each request of the (time-compressed) trace at its arrival time to a router, as a
streamed completion with a token-id prompt of the request's input length and ``max_tokens``/``min_tokens``
of its output length (``ignore_eos``, so the load is what the trace says), and records what each client
saw: TTFT, mean inter-token latency, errors, and which workers served it (the router's trace header). Meanwhile
it samples the fleet in etcd (processes alive, the autoscaler's ``scale/<pool>`` record) to integrate
worker-hours and to rebuild the planner's decisions over time. The result is a
:class:`~fleetward.autoscale.simulate.FleetResult`, the same shape the simulator returns, so a live run and
a simulated one compare field by field.

A request *meets* the SLA when its TTFT and its mean ITL are within the targets. A stream is *cut* when it
delivered tokens and then ended short of its length or with an error (a scale-down must never do that); a
request that got no token is *failed*.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import orjson

from fleetward.autoscale.capacity import Sla
from fleetward.autoscale.simulate import FleetResult, IntervalRecord, p99
from fleetward.autoscale.traces import Trace
from fleetward.fleet.bus import EventBus
from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.etcd import StateStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.registry import read_fleet
from fleetward.fleet.sse import sse_lines
from fleetward.fleet.worker import HealthState

__all__ = ["ClientRecord", "replay_live", "stream_request"]

_ALIVE = {HealthState.STARTING, HealthState.READY, HealthState.SUSPECT, HealthState.DRAINING,
          HealthState.RESTARTING, HealthState.UNHEALTHY}


@dataclass
class ClientRecord:
    """What one client saw."""

    arrival_s: float  # trace time it was sent at
    asked: int  # output tokens asked for
    tokens: int = 0
    ttft_s: float | None = None
    itl_s: float | None = None  # mean inter-token latency after the first token
    error: str | None = None
    workers: int = 0  # distinct workers that produced its tokens (> 1: it migrated)
    prompt_tokens: int = 0  # the prompt sent (its TTFT target, when the SLA is per prompt token)

    @property
    def failed(self) -> bool:
        return self.tokens == 0

    @property
    def cut(self) -> bool:
        return self.tokens > 0 and (self.error is not None or self.tokens < self.asked)

    def meets(self, sla: Sla) -> bool:
        return (not self.failed and not self.cut and self.ttft_s is not None
                and self.ttft_s <= sla.ttft_for(self.prompt_tokens)
                and (self.itl_s or 0.0) <= sla.itl_s)


def fixed_length_body(model: str, prompt: list[int], tokens: int) -> dict[str, object]:
    """A streamed completion of token-id ``prompt`` whose answer is exactly ``tokens`` long (``ignore_eos``)."""
    return {"model": model, "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "temperature": 0}


async def stream_request(client: httpx.AsyncClient, url: str, body: dict[str, object], rec: ClientRecord, *,
                         clock: Clock = SYSTEM_CLOCK, headers: dict[str, str] | None = None) -> ClientRecord:
    """POST ``body`` (a streamed completion) to ``url`` and record in ``rec`` what the client saw: TTFT, mean
    ITL, tokens, an error, and the workers that produced them (the router's trace header, when asked for)."""
    started = clock.monotonic()
    first = last = 0.0
    workers: set[str] = set()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}"
                return rec
            async for line in sse_lines(r.aiter_bytes()):
                if not line.startswith("data: {"):
                    continue
                data = orjson.loads(line[6:])
                if "error" in data:
                    rec.error = str(data["error"].get("message", data["error"]))[:200]
                    continue
                choice = data["choices"][0]
                n = len(choice.get("token_ids") or []) or (1 if choice.get("text") else 0)
                if n:
                    last = clock.monotonic()
                    if rec.tokens == 0:
                        first = last
                        rec.ttft_s = first - started
                    rec.tokens += n
                    workers.add(str((data.get("fleetward") or {}).get("worker", "")))
    except (httpx.HTTPError, ValueError) as exc:  # a broken connection, or an event that is not JSON
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        rec.workers = len(workers)
        if rec.tokens > 1:
            rec.itl_s = (last - first) / (rec.tokens - 1)
    return rec


async def replay_live(trace: Trace, *, router: str, model: str, store: StateStore, keys: Keys, bus: EventBus,
                      sla: Sla, pool: str = "aggregated", max_prompt_tokens: int = 1024,
                      max_output_tokens: int = 256, seed: int = 0, sample_s: float = 0.25,
                      on_progress: Callable[[int, int], None] | None = None,
                      clock: Clock = SYSTEM_CLOCK) -> tuple[FleetResult, list[ClientRecord]]:
    """Replay ``trace`` through ``router``; the result (see the module docstring) and every client's record.
    ``on_progress(sent, finished)`` is called as requests go out and end."""
    rng = random.Random(seed)
    records: list[ClientRecord] = []
    timeline: list[IntervalRecord] = []
    reasons: list[str] = []
    scale_events = 0
    worker_seconds = 0.0
    finished = 0
    t0 = clock.monotonic()  # trace time 0

    async def sample() -> None:
        nonlocal worker_seconds
        last_seq, last_t = -1, 0.0
        while True:
            fleet = await read_fleet(store, keys)
            now = clock.monotonic() - t0
            alive = sum(1 for h in fleet.health.values() if h.state in _ALIVE)
            worker_seconds += alive * (now - last_t)
            last_t = now
            kv = await store.get(keys.scale_of(pool))
            if kv is not None:
                body = orjson.loads(kv.value)
                if body.get("seq", 0) != last_seq:
                    last_seq = body.get("seq", 0)
                    rate = sum(1 for r in trace.requests if now - 1.0 < r.arrival_s <= now)  # over the last second
                    timeline.append(IntervalRecord(now, float(rate), int(body.get("desired", 0)),
                                                   int(body.get("serving", 0)), int(body.get("starting", 0)), None,
                                                   None))
                    reasons.append(f"{now:.1f}s {body.get('desired')}: {body.get('reason', '')}")
            await clock.sleep(sample_s)

    async def follow_scale(ready: asyncio.Event) -> None:
        nonlocal scale_events
        async for event in bus.subscribe(["scale"], subscribed=ready):
            if event.data.get("pool") == pool and (event.data.get("started") or event.data.get("retired")):
                scale_events += 1

    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
    subscribed = asyncio.Event()
    watcher = asyncio.create_task(follow_scale(subscribed))
    await subscribed.wait()
    sampler = asyncio.create_task(sample())
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits,
                                     trust_env=False) as client, asyncio.TaskGroup() as tg:
            def done(_: object) -> None:
                nonlocal finished
                finished += 1
                if on_progress is not None:
                    on_progress(len(records), finished)

            for req in trace.requests:
                wait = t0 + req.arrival_s - clock.monotonic()
                if wait > 0:
                    await clock.sleep(wait)  # the trace's arrival time, not a synchronisation
                prompt = [rng.randrange(10, 200) for _ in range(max(1, min(req.input_tokens, max_prompt_tokens)))]
                rec = ClientRecord(req.arrival_s, max(1, min(req.output_tokens, max_output_tokens)),
                                   prompt_tokens=len(prompt))
                records.append(rec)
                task = tg.create_task(stream_request(client, router, fixed_length_body(model, prompt, rec.asked), rec,
                                                     clock=clock,
                                                     headers={"X-Fleetward-Trace": "1"}))
                task.add_done_callback(done)
                if on_progress is not None:
                    on_progress(len(records), finished)
    finally:
        for t in (sampler, watcher):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
    served = [r for r in records if not r.failed and not r.cut]
    result = FleetResult(
        policy="live", requests=len(records), met=sum(1 for r in records if r.meets(sla)),
        failed=sum(1 for r in records if r.failed), cut_streams=sum(1 for r in records if r.cut),
        migrated=sum(1 for r in records if r.workers > 1), worker_hours=worker_seconds / 3600.0,
        scale_events=scale_events, ttft_p99=p99([r.ttft_s for r in served if r.ttft_s is not None]),
        itl_p99=p99([r.itl_s for r in served if r.itl_s is not None]), timeline=timeline, reasons=reasons)
    return result, records

