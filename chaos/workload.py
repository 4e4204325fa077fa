"""The workload: open-loop clients that record every operation into the run's history.

Arrivals follow a plan made up front from the experiment's seed (Poisson, constant, or a replayed trace
with its input and output lengths), and an arrival never waits for earlier requests to finish (open loop).
Prompts are token ids drawn from the seed, so a run is repeatable and every prompt is known to the
checkers. Each request is one streamed call through a router with ``X-Fleetward-Trace: 1``; the client
records into the history:

- ``invoke`` before sending (``req``, ``client`` = the source, ``api``, ``prompt`` ids, ``params``,
  ``router``, ``t_sched`` = the planned arrival on the run clock, ``retry_of`` for retries);
- ``chunk`` for every event carrying tokens or a finish reason (``rid`` and ``n`` from the SSE id
  ``<rid>:<n>``, ``tokens``, ``text``, ``worker`` and ``attempt`` from the trace header,
  ``finish_reason``);
- ``resume`` when a broken stream is resumed on another router with ``Last-Event-ID``;
- ``ok`` (``finish_reason``, ``usage``, ``tokens``) after ``[DONE]``, or ``fail`` (``stage``, ``error``,
  ``status``, ``tokens``). Stages: ``connect``, ``status`` (HTTP error), ``error_event`` (vLLM's in-band
  error), ``transport`` (the connection broke mid-body), ``eof`` (the body ended cleanly without
  ``[DONE]``: a silent truncation), ``timeout``, ``cancelled`` (the client disconnected on purpose),
  ``abandoned`` (still open when the drain ended), ``aborted`` (the run was stopped).

Load shapes (bursts, storms, cancellations, retries) are faults of the ``load`` family
(:mod:`fleetward.chaos.faults.load`); they reach the workload through ``FaultContext.service("workload")``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import csv
import dataclasses
import itertools
import math
import random
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import httpx
import orjson

from fleetward.chaos.experiment import Lengths, WorkloadSpec, resolve_trace
from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.errors import ConfigError
from fleetward.fleet.sse import sse_data, sse_lines
from fleetward.sim.tokenizer import BYTE_OFFSET, decode, encode, render_chat

__all__ = [
    "Live",
    "Outcome",
    "Planned",
    "Recorder",
    "SlowRead",
    "StreamClient",
    "Workload",
    "make_prompt",
    "plan_arrivals",
    "read_trace",
    "sample_length",
    "sse_data",
    "sse_lines",
]

# Every chunk says which worker made it, and every event carries its SSE id (the point a resume starts from).
TRACE_HEADER = {"X-Fleetward-Trace": "1", "X-Fleetward-Event-Ids": "1"}


class Recorder(Protocol):
    """Where records go: :class:`~fleetward.chaos.history.History`, or an in-memory twin."""

    def now(self) -> float: ...

    def add(self, type_: str, **data: Any) -> Any: ...


# -- what is sent -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """One request: when (seconds into the workload), what prompt, how many tokens, sent by whom."""

    index: int
    t: float
    prompt: tuple[int, ...]
    max_tokens: int
    source: str = "workload"
    retry_of: str | None = None
    retries: int = 0  # how many failed attempts of the same request came before (retry storms)


def sample_length(dist: Lengths, rng: random.Random) -> int:
    if dist.dist == "fixed":
        assert dist.value is not None
        return dist.value
    hi = dist.upper
    if dist.dist == "uniform":
        return rng.randint(dist.min, hi)
    assert dist.median is not None
    return max(dist.min, min(hi, round(rng.lognormvariate(math.log(dist.median), dist.sigma))))


def make_prompt(seed: int, stream: str, index: int, length: int) -> tuple[int, ...]:
    """Printable-byte token ids, a pure function of (seed, stream, index, length)."""
    rng = random.Random(f"{seed}:prompt:{stream}:{index}")
    return tuple(BYTE_OFFSET + 32 + rng.randrange(95) for _ in range(length))


def _clock_seconds(stamp: str) -> float:
    """``2023-11-16 18:15:46.6805900`` as seconds since the epoch (UTC; only differences matter)."""
    head, _, frac = stamp.strip().partition(".")
    base = datetime.strptime(head, "%Y-%m-%d %H:%M:%S")
    return base.timestamp() + (float("0." + frac) if frac else 0.0)


def read_trace(path: Path, *, start_s: float, span_s: float) -> list[tuple[float, int, int]]:
    """(seconds since the trace's first request, input tokens, output tokens) of the requests in
    ``[start_s, start_s + span_s)``. Columns: ``arrival_s,input_tokens,output_tokens`` (ServeGen) or
    ``TIMESTAMP,ContextTokens,GeneratedTokens`` (Azure); the rows are in time order."""
    out: list[tuple[float, int, int]] = []
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        cols = {h.lower(): i for i, h in enumerate(header)}
        try:
            if "arrival_s" in cols:
                t_col, stamp = cols["arrival_s"], False
            else:
                t_col, stamp = cols["timestamp"], True
            in_col = cols["input_tokens"] if "input_tokens" in cols else cols["contexttokens"]
            out_col = cols["output_tokens"] if "output_tokens" in cols else cols["generatedtokens"]
        except KeyError:
            raise ConfigError(f"unknown trace columns {header}: expected arrival_s,input_tokens,output_tokens or "
                              "TIMESTAMP,ContextTokens,GeneratedTokens", file=str(path), line=1) from None
        origin: float | None = None
        for line, row in enumerate(reader, start=2):
            if not row:
                continue
            try:
                t = _clock_seconds(row[t_col]) if stamp else float(row[t_col])
                isl, osl = int(row[in_col]), int(row[out_col])
            except (ValueError, IndexError) as exc:
                raise ConfigError(f"bad trace row: {exc}", file=str(path), line=line) from None
            origin = t if origin is None else origin
            rel = t - origin
            if rel < start_s:
                continue
            if rel >= start_s + span_s:
                break
            out.append((rel - start_s, isl, osl))
    return out


def plan_arrivals(spec: WorkloadSpec, *, seed: int, base: Path | None = None) -> list[Planned]:
    """Every request of the workload's arrival process, in time order (a pure function of the seed)."""
    a = spec.arrival
    times: list[tuple[float, int | None, int | None]] = []
    if a.kind == "trace":
        assert a.file is not None
        path = resolve_trace(a.file, base=base)
        if path is None:
            raise ConfigError(f"trace file {a.file!r} not found", field="workload.arrival.file")
        for t, isl, osl in read_trace(path, start_s=a.start_s, span_s=spec.duration_s / a.time_scale):
            times.append((t * a.time_scale,
                          max(1, min(a.max_input_tokens, round(isl * a.token_scale))),
                          max(1, min(a.max_output_tokens, round(osl * a.token_scale)))))
    else:
        assert a.rate is not None
        rng = random.Random(f"{seed}:arrivals")
        t = 0.0 if a.kind == "constant" else rng.expovariate(a.rate)
        while t < spec.duration_s:
            times.append((t, None, None))
            t += 1.0 / a.rate if a.kind == "constant" else rng.expovariate(a.rate)
    plan = []
    for i, (t, given_in, given_out) in enumerate(times):
        rng = random.Random(f"{seed}:lengths:{i}")
        n_in = given_in if given_in is not None else sample_length(spec.isl, rng)
        n_out = given_out if given_out is not None else sample_length(spec.osl, rng)
        plan.append(Planned(i, t, make_prompt(seed, "workload", i, n_in), n_out))
    return plan


# -- one client request -------------------------------------------------------------------------------------

@dataclass
class SlowRead:
    """A slow client (``load.slow_clients``): it waits ``delay_s`` after each event it reads and, once it holds
    ``stall_after`` tokens, stops reading for ``stall_s`` (the router's writes then back up on its socket)."""

    tag: str
    delay_s: float
    stall_after: int | None
    stall_s: float
    clock: Clock = SYSTEM_CLOCK
    stalled: bool = False

    async def pause(self, tokens: int) -> None:
        """After an event: the time this client takes before it reads the next one."""
        wait = self.delay_s
        if self.stall_after is not None and not self.stalled and tokens >= self.stall_after:
            self.stalled = True
            wait += self.stall_s
        if wait > 0:
            await self.clock.sleep(wait)


@dataclass
class Live:
    """A request in flight, as the workload sees it."""

    req: str
    source: str
    planned: Planned
    worker: str | None = None
    tokens: int = 0
    cancel_after: int | None = None  # disconnect once this many tokens arrived
    cancel_stage: str | None = None  # set before the workload cancels the request's task
    cancel_tag: str = ""  # the load fault that disconnects it
    slow: SlowRead | None = None  # the client reads slowly or stalls (load.slow_clients)
    task: asyncio.Task[Any] | None = None


@dataclass(frozen=True)
class Outcome:
    req: str
    ok: bool
    stage: str | None
    tokens: tuple[int, ...]
    finish_reason: str | None = None


class StreamClient:
    """Sends one streamed request through a router and records it (see the module docstring)."""

    def __init__(self, recorder: Recorder, routers: Sequence[str], *, model: str, spec: WorkloadSpec,
                 http: httpx.AsyncClient) -> None:
        self.recorder = recorder
        self.routers = list(routers)
        self.model = model
        self.spec = spec
        self.http = http

    def body(self, p: Planned) -> tuple[str, dict[str, Any]]:
        s = self.spec
        common: dict[str, Any] = {"model": self.model, "max_tokens": p.max_tokens, "stream": True,
                                  "return_token_ids": True, "temperature": s.temperature,
                                  "ignore_eos": s.ignore_eos, "stream_options": {"include_usage": True}}
        if s.api == "chat":
            return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": decode(p.prompt)}]}
        return "/v1/completions", {**common, "prompt": list(p.prompt)}

    def reference_prompt(self, p: Planned) -> list[int]:
        """The prompt ids the engine sees (chat: the rendered template)."""
        if self.spec.api == "chat":
            return encode(render_chat([{"role": "user", "content": decode(p.prompt)}]))
        return list(p.prompt)

    async def run(self, p: Planned, live: Live, *, router_index: int) -> Outcome:
        rec = self.recorder
        path, body = self.body(p)
        router = self.routers[router_index % len(self.routers)]
        rec.add("invoke", req=live.req, client=p.source, api=self.spec.api, prompt=self.reference_prompt(p),
                params={"max_tokens": p.max_tokens, "temperature": self.spec.temperature,
                        "ignore_eos": self.spec.ignore_eos}, router=router, t_sched=round(p.t, 6),
                **({"retry_of": p.retry_of} if p.retry_of else {}), **({"slow": live.slow.tag} if live.slow else {}))
        got: list[int] = []
        state: dict[str, Any] = {"finish": None, "usage": None, "last_id": None}
        try:
            async with asyncio.timeout(self.spec.timeout_s):
                resumes = 0
                headers = dict(TRACE_HEADER)
                while True:
                    stage, error, status = await self._attempt(router, path, body, headers, live, got, state)
                    # A resuming client holds every router's address: refused, it tries the next one; cut
                    # off mid-stream, it resumes there from the last event id it got.
                    if (stage in ("connect", "transport", "eof") and self.spec.resume and len(self.routers) > 1
                            and resumes < self.spec.max_resumes and (state["last_id"] or not got)):
                        resumes += 1
                        router_index += 1
                        router = self.routers[router_index % len(self.routers)]
                        headers = {**TRACE_HEADER, **({"Last-Event-ID": state["last_id"]} if state["last_id"]
                                                      else {})}
                        rec.add("resume", req=live.req, router=router, last_event_id=state["last_id"],
                                after=stage, error=error)
                        continue
                    break
        except TimeoutError:
            stage, error, status = "timeout", f"no answer within {self.spec.timeout_s:g} s", None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if live.cancel_stage is None or task is None:
                rec.add("fail", req=live.req, stage="aborted", error="the run was stopped", tokens=len(got))
                raise
            # The workload cancelled this request on purpose (a client disconnect): that cancel ends here.
            if task.uncancel() > 0:
                rec.add("fail", req=live.req, stage="aborted", error="the run was stopped", tokens=len(got))
                raise
            stage, error, status = live.cancel_stage, "the client disconnected", None
        if stage is None:
            rec.add("ok", req=live.req, finish_reason=state["finish"], usage=state["usage"], tokens=len(got))
            return Outcome(live.req, True, None, tuple(got), state["finish"])
        rec.add("fail", req=live.req, stage=stage, error=error, tokens=len(got),
                **({"status": status} if status is not None else {}))
        return Outcome(live.req, False, stage, tuple(got), state["finish"])

    async def _attempt(self, router: str, path: str, body: dict[str, Any], headers: dict[str, str], live: Live,
                       got: list[int], state: dict[str, Any]) -> tuple[str | None, str | None, int | None]:
        """One HTTP exchange; returns (fail stage or None, error, status)."""
        rec = self.recorder
        opened = False
        error: str | None = None
        try:
            async with self.http.stream("POST", router + path, json=body, headers=headers) as r:
                opened = True
                if r.status_code != 200:
                    raw = await r.aread()
                    try:
                        message = orjson.loads(raw)["error"]["message"]
                    except (orjson.JSONDecodeError, KeyError, TypeError):
                        message = raw[:300].decode(errors="replace")
                    return "status", message, r.status_code
                event_id: str | None = None
                async for line in sse_lines(r.aiter_bytes()):
                    if line.startswith("id:"):
                        event_id = line[3:].strip()
                        continue
                    if not line.startswith("data:"):
                        if not line:
                            event_id = None
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        return ("error_event", error, None) if error is not None else (None, None, None)
                    try:
                        obj = orjson.loads(payload)
                    except orjson.JSONDecodeError as exc:
                        return "protocol", f"malformed event {payload[:80]!r}: {exc}", None
                    if event_id:
                        state["last_id"] = event_id
                    if "error" in obj:
                        err = obj["error"]
                        error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                        continue
                    choices = obj.get("choices") or []
                    if not choices:
                        state["usage"] = obj.get("usage") or state["usage"]
                        continue
                    c = choices[0]
                    ids = c.get("token_ids") or []
                    finish = c.get("finish_reason")
                    if not ids and finish is None:
                        continue
                    text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    trace = obj.get("fleetward") or {}
                    rid, _, n = (event_id or "").rpartition(":")
                    rec.add("chunk", req=live.req, rid=rid or None, n=int(n) if n.isdigit() else None,
                            tokens=ids, text=text, worker=trace.get("worker"), attempt=trace.get("attempt"),
                            finish_reason=finish, event_id=event_id)
                    got.extend(ids)
                    live.tokens = len(got)
                    live.worker = trace.get("worker") or live.worker
                    if finish is not None:
                        state["finish"] = finish
                    if live.cancel_after is not None and len(got) >= live.cancel_after:
                        return "cancelled", "the client disconnected mid-stream", None
                    if live.slow is not None:
                        await live.slow.pause(len(got))
        except httpx.HTTPError as exc:
            kind = "connect" if not opened and isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)) \
                else "transport"
            return kind, f"{type(exc).__name__}: {exc}", None
        if error is not None:
            return "error_event", error, None
        return "eof", "the stream ended without [DONE]", None


# -- the open-loop workload ---------------------------------------------------------------------------------


@dataclass
class _Modes:
    cancel_share: float = 0.0
    cancel_after: int = 1
    cancel_rng: random.Random = field(default_factory=random.Random)
    cancel_tag: str = ""
    retries: int = 0
    retry_tag: str = ""
    slow_share: float = 0.0
    slow_rng: random.Random = field(default_factory=random.Random)
    slow: SlowRead | None = None  # the pattern a new slow client follows (its tag names the fault)


class Workload:
    """Runs the plan open-loop against the routers and offers the levers load faults pull.

    Use as an async context manager (it owns the HTTP client). :meth:`run` sends the planned arrivals,
    then waits up to ``drain_s`` for open requests and cancels what is left (``abandoned``). Counters
    (``sent``, ``ok``, ``failed``, ``tokens``...) and :attr:`live` show progress while it runs.
    """

    def __init__(self, spec: WorkloadSpec, *, seed: int, recorder: Recorder, routers: Sequence[str], model: str,
                 max_model_len: int = 4096, base: Path | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        self.spec = spec
        self.seed = seed
        self.recorder = recorder
        self.routers = list(routers)
        self.model = model
        self.max_model_len = max_model_len
        self.base = base
        self.clock = clock
        self.plan = plan_arrivals(spec, seed=seed, base=base)
        self.live: dict[str, Live] = {}
        self.sent = self.ok = self.failed = self.cancelled = self.shed = self.tokens = 0
        self.by_source: collections.Counter[str] = collections.Counter()
        self.cancelled_by: collections.Counter[str] = collections.Counter()
        self.retried_by: collections.Counter[str] = collections.Counter()
        self.slowed_by: collections.Counter[str] = collections.Counter()
        self.recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=4096)
        self.modes = _Modes()
        self.running = False
        self.started_at: float | None = None
        self._ids = itertools.count()
        self._tg: asyncio.TaskGroup | None = None
        self._http: httpx.AsyncClient | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    async def __aenter__(self) -> Workload:
        limits = httpx.Limits(max_connections=self.spec.max_in_flight + 32, max_keepalive_connections=64)
        timeout = httpx.Timeout(self.spec.timeout_s, connect=10.0)
        self._http = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            await self._http.aclose()

    @property
    def client(self) -> StreamClient:
        return self.client_for(self.recorder, self.spec)

    def client_for(self, recorder: Recorder, spec: WorkloadSpec) -> StreamClient:
        """A client on this workload's connections that records into ``recorder`` and behaves as ``spec``."""
        assert self._http is not None, "use the workload as an async context manager"
        return StreamClient(recorder, self.routers, model=self.model, spec=spec, http=self._http)

    # -- running ----------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Send every planned arrival at its time, then drain (see the class docstring)."""
        self.started_at = self.recorder.now()
        self.running = True
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                for p in self.plan:
                    await self._sleep_until(p.t)
                    self.launch(p)
                await self._sleep_until(self.spec.duration_s)
                self.running = False
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.spec.drain_s):
                        await self._idle.wait()
                for live in list(self.live.values()):
                    if live.task is not None and not live.task.done():
                        live.cancel_stage = "abandoned"
                        live.task.cancel()
        finally:
            self.running = False
            self._tg = None

    async def _sleep_until(self, t: float) -> None:
        assert self.started_at is not None
        delay = self.started_at + t - self.recorder.now()
        if delay > 0:
            await self.clock.sleep(delay)

    def elapsed(self) -> float:
        return 0.0 if self.started_at is None else self.recorder.now() - self.started_at

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as part of the workload (it is cancelled when the workload ends)."""
        if self._tg is None:
            coro.close()
            raise RuntimeError("the workload is not running")
        return self._tg.create_task(coro)

    def new_request(self, source: str, *, isl: Lengths | None = None, osl: Lengths | None = None,
                    prompt: Sequence[int] | None = None, max_tokens: int | None = None) -> Planned:
        """A request made up now (load shapes): lengths from ``isl``/``osl`` or the workload's own."""
        index = len(self.plan) + next(self._ids)
        rng = random.Random(f"{self.seed}:lengths:{source}:{index}")
        n_out = max_tokens if max_tokens is not None else sample_length(osl or self.spec.osl, rng)
        if prompt is None:
            n_in = sample_length(isl or self.spec.isl, rng)
            n_in = max(1, min(n_in, self.max_model_len - n_out - 8))
            prompt = make_prompt(self.seed, source, index, n_in)
        return Planned(index, self.elapsed(), tuple(prompt), n_out, source=source)

    def launch(self, p: Planned) -> bool:
        """Send ``p`` now, without waiting for it (open loop); False when the client cap sheds it."""
        if self._tg is None:
            raise RuntimeError("the workload is not running")
        if len(self.live) >= self.spec.max_in_flight:
            self.shed += 1
            self.recorder.add("note", text=f"client cap ({self.spec.max_in_flight} in flight) reached: "
                              f"{p.source} request {p.index} not sent", shed=True)
            return False
        req = f"r{p.index:06d}" if p.source == "workload" else f"r{p.index:06d}-{p.source.split('.')[-1]}"
        live = Live(req, p.source, p)
        m = self.modes
        if m.cancel_share and m.cancel_rng.random() < m.cancel_share:
            live.cancel_after, live.cancel_tag = m.cancel_after, m.cancel_tag
        if m.slow is not None and p.source != "probe" and m.slow_rng.random() < m.slow_share:
            live.slow = dataclasses.replace(m.slow)
            self.slowed_by[m.slow.tag] += 1
        self.live[req] = live
        self._idle.clear()
        self.sent += 1
        self.by_source[p.source] += 1
        live.task = self._tg.create_task(self._one(live), name=f"request {req}")
        return True

    async def _one(self, live: Live) -> None:
        try:
            out = await self.client.run(live.planned, live, router_index=live.planned.index)
        finally:
            self.live.pop(live.req, None)
            if not self.live:
                self._idle.set()
        self.tokens += len(out.tokens)
        if out.tokens:
            self.recent.append((self.recorder.now(), len(out.tokens)))
        if out.ok:
            self.ok += 1
        elif out.stage == "cancelled":
            self.cancelled += 1
            self.cancelled_by[live.cancel_tag] += 1
        else:
            self.failed += 1
            m = self.modes
            p = live.planned
            if m.retries and out.stage != "abandoned" and p.retries < m.retries and self._tg is not None:
                again = self.new_request("load.retry_storm", prompt=p.prompt, max_tokens=p.max_tokens)
                self.retried_by[m.retry_tag] += 1
                self.launch(dataclasses.replace(again, retry_of=live.req, retries=p.retries + 1))

    # -- levers for load faults -------------------------------------------------------------------------

    def in_flight_by_worker(self) -> dict[str, int]:
        out: collections.Counter[str] = collections.Counter()
        for live in self.live.values():
            if live.worker:
                out[live.worker] += 1
        return dict(out)

    def cancel_in_flight(self, share: float, after_tokens: int, rng: random.Random, tag: str) -> int:
        """Disconnect ``share`` of the streams that already received ``after_tokens`` tokens."""
        eligible = sorted((lv for lv in self.live.values() if lv.tokens >= after_tokens and lv.cancel_stage is None
                           and lv.source != "probe"), key=lambda lv: lv.req)
        chosen = rng.sample(eligible, k=math.ceil(len(eligible) * share)) if eligible else []
        for live in chosen:
            live.cancel_stage, live.cancel_tag = "cancelled", tag
            if live.task is not None:
                live.task.cancel()
        return len(chosen)

    def throughput(self, window_s: float = 2.0) -> float:
        """Tokens per second over the last ``window_s`` seconds (finished requests, for progress displays)."""
        now = self.recorder.now()
        return sum(n for t, n in self.recent if t >= now - window_s) / window_s
