"""What the autoscaler sees of a live fleet, through the fleet's shared channels only.

- **etcd** (one read of ``workers/``, ``health/`` and ``routers/`` per interval): each pool's members by
  role, and their health. Ready and suspect workers serve; ``starting`` and ``restarting`` ones are on
  their way; draining, unhealthy, quarantined and dead ones do not count (the planner then replaces them).
- **The routers' /metrics**: new requests (``fleetward_router_requests_received_total``), TTFT and per-request
  ITL histograms. Counters are turned into rates over the interval, histograms into the interval's p99
  (bucket deltas, interpolated as Prometheus' ``histogram_quantile`` does).
- **The workers' /metrics** (vLLM's names): requests waiting and running, KV-cache use, and the mean prompt
  and output length of the requests they finished (``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``
  over ``vllm:request_success_total``; re-prefills after a migration count as prompt tokens), each pool from its
  own workers. In a prefill/decode fleet the router sends every prompt to a prefill worker with ``max_tokens``
  1 and streams the answer from a decode worker: a prefill pool's workers show the prompts (its mean prompt
  length is right, and its work) but one output token each, so its mean output length is not observed (0); a
  decode pool's workers show the whole answers. The arrival rate is the routers' new requests, the same for
  every pool: each new request is one prefill and one decode.

Nothing here imports another service: a router or a worker is a URL.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fleetward.autoscale.planner import Observation
from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.etcd import StateStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.registry import FleetSnapshot, read_fleet
from fleetward.fleet.worker import HealthState

__all__ = ["Member", "Observer", "PoolView", "RouterSample", "WorkerSample", "histogram_quantile", "parse_metrics"]

log = logging.getLogger(__name__)

RECEIVED = "fleetward_router_requests_received"
TTFT = "fleetward_router_time_to_first_token_seconds"
ITL = "fleetward_router_time_per_output_token_seconds"
TOKENS = "fleetward_router_tokens"
_STARTING = (HealthState.STARTING, HealthState.RESTARTING)
_TRAILING_NUMBER = re.compile(r"\d+$")


@dataclass(frozen=True)
class Member:
    """One worker of a pool as etcd shows it (``registered``: it has a ``workers/`` record now)."""

    id: str
    node: str | None
    url: str | None
    state: HealthState | None
    registered: bool

    @property
    def serving(self) -> bool:
        return self.registered and self.state is not None and self.state.is_routable

    @property
    def starting(self) -> bool:
        return self.state in _STARTING


@dataclass
class PoolView:
    """A pool's members at one revision, with the load each serving one carries (from its /metrics)."""

    pool: str
    members: dict[str, Member] = field(default_factory=dict)
    running: dict[str, float] = field(default_factory=dict)  # worker -> requests running + waiting

    def serving(self) -> list[str]:
        return sorted(w for w, m in self.members.items() if m.serving)

    def starting(self) -> list[str]:
        return sorted(w for w, m in self.members.items() if m.starting)

    def state_of(self, worker: str) -> HealthState | None:
        m = self.members.get(worker)
        return m.state if m is not None else None

    def least_loaded(self, n: int) -> list[str]:
        """The ``n`` serving workers with the least work on them (ties: the newest id first)."""
        return sorted(self.serving(), key=lambda w: (self.running.get(w, 0.0), _neg_id(w)))[:n]


def _neg_id(worker: str) -> tuple[int, ...]:
    # Newest first among equals: a higher trailing number (``node-w7`` over ``node-w2``) sorts earlier.
    trailing = _TRAILING_NUMBER.search(worker)
    return (-int(trailing.group()),) if trailing else (0,)


Buckets = dict[float, float]  # upper bound -> cumulative count


@dataclass
class RouterSample:
    """One router's cumulative counters and histograms at one scrape."""

    received: float = 0.0
    tokens: float = 0.0
    ttft: Buckets = field(default_factory=dict)
    itl: Buckets = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class WorkerSample:
    """One worker's vLLM metrics at one scrape: gauges now, counters cumulative."""

    waiting: float
    running: float
    kv_usage: float
    prompt_tokens: float
    generation_tokens: float
    finished: float  # requests finished (vllm:request_success_total)


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text → sample name → [(labels, value)] (the ``_total``, ``_bucket`` suffixes kept)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def _sum(samples: Mapping[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(v for _, v in samples.get(name, ()))


def _buckets(samples: Mapping[str, list[tuple[dict[str, str], float]]], name: str) -> Buckets:
    out: Buckets = {}
    for labels, v in samples.get(name + "_bucket", ()):
        le = float(labels.get("le", "inf"))
        out[le] = out.get(le, 0.0) + v
    return out


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The q-quantile of cumulative ``buckets`` (upper bound → count), as Prometheus interpolates it: linearly
    within the bucket it falls in; the highest finite bound when it falls in ``+Inf``. None without samples."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    total = buckets[bounds[-1]]
    rank = q * total
    lower, below = 0.0, 0.0
    for b in bounds:
        count = buckets[b]
        if count >= rank:
            if math.isinf(b):
                return lower
            inside = count - below
            return lower + (b - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = b, count
    return lower


def fraction_within(bound: float, buckets: Mapping[float, float]) -> float | None:
    """The share of observations at or below ``bound``, interpolated linearly within the bucket it falls in (as
    :func:`histogram_quantile` does the other way round). None without samples."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    total = buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for b in bounds:
        if bound < b:
            if math.isinf(b):
                return below / total
            return (below + (buckets[b] - below) * (bound - lower) / (b - lower)) / total
        lower, below = b, buckets[b]
    return 1.0


def _delta(now: Buckets, before: Buckets) -> Buckets:
    return {b: max(0.0, c - before.get(b, 0.0)) for b, c in now.items()}


class Observer:
    """Turns the fleet's channels into one :class:`Observation` per pool per interval.

    Each :meth:`observe` compares the routers' counters with the previous call's: the first call (and a
    router seen for the first time) only sets the baseline. A counter that went down (the router restarted)
    counts from zero.
    """

    def __init__(self, store: StateStore, keys: Keys, *, clock: Clock = SYSTEM_CLOCK,
                 http: httpx.AsyncClient | None = None, timeout_s: float = 2.0) -> None:
        self.store, self.keys, self.clock = store, keys, clock
        self._http = http or httpx.AsyncClient(timeout=timeout_s, trust_env=False)
        self._own_http = http is None
        self._before: dict[str, RouterSample] = {}
        self._workers_before: dict[str, WorkerSample] = {}
        self._at: float | None = None
        self.ttft, self.itl = Buckets(), Buckets()  # the last interval's histograms, summed over the routers

    async def aclose(self) -> None:
        if self._own_http:
            await self._http.aclose()

    async def _get(self, url: str) -> str | None:
        try:
            r = await self._http.get(url + "/metrics")
            return r.text if r.status_code == 200 else None
        except httpx.HTTPError:
            return None

    async def _routers(self, fleet: FleetSnapshot) -> dict[str, RouterSample]:
        urls = {rid: str(r.get("url") or "") for rid, r in fleet.routers.items()}
        texts = await asyncio.gather(*(self._get(u) for u in urls.values() if u))
        out = {}
        for rid, text in zip([r for r, u in urls.items() if u], texts, strict=True):
            if text is None:
                continue
            try:
                m = parse_metrics(text)
            except ValueError as exc:
                log.warning("router %s: unreadable /metrics (%s)", rid, exc)
                continue
            out[rid] = RouterSample(received=_sum(m, RECEIVED + "_total"), tokens=_sum(m, TOKENS + "_total"),
                                    ttft=_buckets(m, TTFT), itl=_buckets(m, ITL))
        return out

    async def _worker_load(self, urls: Mapping[str, str]) -> dict[str, WorkerSample]:
        """worker -> what its vLLM metrics say now."""
        ids = list(urls)
        texts = await asyncio.gather(*(self._get(urls[w]) for w in ids))
        out = {}
        for wid, text in zip(ids, texts, strict=True):
            if text is None:
                continue
            try:
                m = parse_metrics(text)
            except ValueError:
                continue
            kv = m.get("vllm:kv_cache_usage_perc") or m.get("vllm:gpu_cache_usage_perc") or []
            out[wid] = WorkerSample(_sum(m, "vllm:num_requests_waiting"), _sum(m, "vllm:num_requests_running"),
                                    max((v for _, v in kv), default=0.0), _sum(m, "vllm:prompt_tokens_total"),
                                    _sum(m, "vllm:generation_tokens_total"), _sum(m, "vllm:request_success_total"))
        return out

    def _lengths(self, load: Mapping[str, WorkerSample]) -> tuple[float, float]:
        """Mean prompt and output tokens of the requests the workers finished since the last call (their
        counters' deltas; a worker seen for the first time or restarted only sets its baseline)."""
        prompt = generated = finished = 0.0
        for wid, now in load.items():
            before = self._workers_before.get(wid)
            self._workers_before[wid] = now
            if before is None or now.finished < before.finished:
                continue
            prompt += now.prompt_tokens - before.prompt_tokens
            generated += now.generation_tokens - before.generation_tokens
            finished += now.finished - before.finished
        return (prompt / finished, generated / finished) if finished > 0 else (0.0, 0.0)

    async def observe(self, pools: Sequence[str], interval_s: float, known: Mapping[str, str] | None = None,
                      fleet: FleetSnapshot | None = None) -> dict[str, tuple[Observation, PoolView]]:
        """One observation per pool (``interval_s`` is the planning interval the policy plans in; ``known``
        places unregistered workers in pools, see :meth:`view`; ``fleet``: the key space as just read, else
        it is read here)."""
        fleet = fleet if fleet is not None else await read_fleet(self.store, self.keys)
        now = self.clock.monotonic()
        elapsed = (now - self._at) if self._at is not None else None
        samples = await self._routers(fleet)
        received, ttft, itl = 0.0, Buckets(), Buckets()
        for rid, s in samples.items():
            before = self._before.get(rid)
            if before is None or elapsed is None:
                continue
            if s.received < before.received:  # the router restarted: its counters start again
                before = RouterSample()
            received += s.received - before.received
            ttft = _add(ttft, _delta(s.ttft, before.ttft))
            itl = _add(itl, _delta(s.itl, before.itl))
        self._before, self._at = samples, now
        self.ttft, self.itl = ttft, itl
        rate = received / elapsed if elapsed else 0.0
        out = {}
        for pool in pools:
            view = self.view(fleet, pool, known)
            serving = view.serving()
            load = await self._worker_load({w: fleet.workers[w].url for w in serving})
            view.running = {w: x.waiting + x.running for w, x in load.items()}
            kv = [x.kv_usage for x in load.values()]
            mean_input, mean_output = self._lengths(load)
            if pool == "prefill":
                mean_output = 0.0  # its workers answer one token per request: not the requests' output length
            obs = Observation(
                now=now, interval_s=interval_s, arrival_rate=rate, healthy=len(serving),
                starting=len(view.starting()), mean_input=mean_input, mean_output=mean_output,
                ttft_p99=histogram_quantile(0.99, ttft), itl_p99=histogram_quantile(0.99, itl),
                queue_depth=int(sum(x.waiting for x in load.values())), kv_usage=sum(kv) / len(kv) if kv else 0.0,
                unhealthy=sum(1 for m in view.members.values() if not m.serving and not m.starting))
            out[pool] = (obs, view)
        return out

    @staticmethod
    def view(fleet: FleetSnapshot, pool: str, known: Mapping[str, str] | None = None) -> PoolView:
        """A pool's members: registered workers of its role, and workers with a ``health/`` record only (not
        registered: starting, restarting or stopped). Those carry no role: ``known`` (worker → pool: what the
        autoscaler asked for or retired) places them, else they count as ``aggregated``."""
        known = known or {}
        view = PoolView(pool)
        for wid in set(fleet.workers) | set(fleet.health):
            rec, h = fleet.workers.get(wid), fleet.health.get(wid)
            role = rec.role if rec is not None else known.get(wid, "aggregated")
            if role != pool:
                continue
            node = rec.node if rec is not None else (str(h.extra["node"]) if h and h.extra.get("node") else None)
            view.members[wid] = Member(wid, node, rec.url if rec else None, h.state if h else None, rec is not None)
        return view


def _add(a: Buckets, b: Buckets) -> Buckets:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0.0) + v
    return out
