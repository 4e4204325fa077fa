"""The simulated worker's engine: continuous batching over :class:`~fleetward.sim.model.SimModel`.

Two layers, split the way vLLM splits its scheduler from its engine loop:

- :class:`SimScheduler` is sans-IO. ``add`` / ``abort`` / ``schedule(now)`` / ``complete(step, now)``: it
  never awaits and never reads a clock (times are passed in), so batching, queueing, KV pressure and
  preemption are tested by calling it directly.
- :class:`SimEngine` is the one async loop that drives it: plan a step, sleep the step's duration on an
  injected :class:`~fleetward.fleet.clock.Clock`, complete the step, wake the consumers. Tests hand it a
  :class:`~fleetward.fleet.clock.ManualClock` and jump time instead of sleeping.

Consumers (the HTTP layer) hold a :class:`SimRequest` and ``await request.next_output()``: each call
returns everything produced since the previous call (several tokens when the consumer fell behind, as
vLLM's output collector coalesces them), with the incremental text already detokenised and stop strings
applied exactly as vLLM 0.32 applies them.

The latency model
-----------------
Every step, every running sequence gets one token. A step takes::

    (decode_step_ms + decode_ms_per_seq * batch + prefill_ms_per_token * prompt tokens admitted) * slowdown

where ``batch`` counts every sequence computed in the step, the newly admitted ones included. A newly
admitted sequence gets its first token at the end of its prefill step, so TTFT = queueing + that step.

Capacity
--------
The KV cache is ``kv_capacity_tokens // kv_block_size`` blocks. A sequence holds blocks for every token
fed to the model (its prompt, then each generated token fed back). Admission is FIFO: the head of the
waiting queue is admitted when there is a free batch slot (``max_num_seqs``), blocks for its prompt, and
room in the step's token budget (``max_num_batched_tokens``; the first prompt of a step is admitted even
when longer, as if chunked prefill were off). With ``chunked_prefill_tokens`` (vLLM's chunked prefill), a
prompt is admitted without the budget check and computed in chunks: each step computes at most that many
prompt tokens, oldest prompts first, alongside the decode of every running sequence; a sequence gets its
first token at the end of the step that computed its last chunk. When a running sequence cannot grow, the most recently
admitted sequence is preempted (vLLM's recompute preemption): its blocks are freed and it goes back to
the front of the queue; when readmitted it re-prefills prompt + generated tokens and continues. Tokens
already emitted are never emitted again.

Faults
------
:class:`Faults` holds the switches: ``hang`` (the loop stops stepping, mid-step if need be, exactly like a
SIGSTOPped EngineCore: streams stall, new requests queue, aborts are not processed, metrics freeze),
``slowdown`` (step time factor), ``error_rate`` (share of new requests the HTTP layer fails with vLLM's
EngineCore error, see :meth:`SimEngine.draw_error`), ``wrong_tokens_probability`` and
``wrong_tokens_after`` (emit a printable token different from the model's; the corrupted token is what
the sequence conditions on afterwards, as a real model would). :meth:`SimEngine.fail_inflight` fails
every open request with the EngineCore error.

Two switches end connections rather than requests; the HTTP layer acts them out:

- ``crash_after_tokens`` (k) is a budget: the engine emits exactly k more tokens (across all requests;
  in the step that spends it, the sequences earlier in the batch get theirs), then emits nothing (new
  requests queue, as with ``hang``). It counts down, so it always reads how many tokens are left. Once it
  is 0 and every consumer has passed on all it was given (see *Delivery*), the engine calls its ``crash``
  callable, once.
- ``reset_after_tokens`` (k): a request that reaches k output tokens without finishing is *cut*: it ends
  with reason ``abort`` (slot and blocks freed), its consumer gets those k tokens and then
  :class:`RequestCut`. A request already past k when the switch is set is cut at its next step, without
  a further token. :meth:`SimEngine.reset_inflight` cuts every open request at once: its consumer gets
  :class:`RequestCut` on its next call, even if tokens were waiting for it.

Delivery
--------
Consumers acknowledge output implicitly: calling :meth:`SimRequest.next_output` (or
:meth:`~SimRequest.wait_finished`) again and parking in it means everything returned before has been
passed on (for the HTTP layer: the ASGI ``send`` of the chunk returned, since a streaming response pulls
the next chunk only after sending the previous one). :meth:`SimEngine.release` says the consumer is done
with a request (its response is sent, or its connection is gone). The ``crash`` callable runs only when
every request submitted and not yet released has its consumer parked, i.e. nothing the engine produced
is still on its way out.

One module (over 600 lines) because the sans-IO scheduler and the thin engine that drives it are the
two halves of one model (see above), tested together.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.config import SimConfig
from fleetward.fleet.errors import ConfigError, FleetwardError, WorkerError
from fleetward.fleet.vocab import Detokenizer, Vocabulary, load_vocabulary
from fleetward.sim.heldkv import StreamKv
from fleetward.sim.model import SimModel
from fleetward.sim.tokenizer import EOS_ID, IncrementalDecoder

__all__ = [
    "ENGINE_DEAD_MESSAGE",
    "EngineStats",
    "Faults",
    "Histogram",
    "OutputDelta",
    "RequestCut",
    "SamplingSpec",
    "SimEngine",
    "SimRequest",
    "SimScheduler",
    "Step",
]

ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."

# vLLM 0.32's bucket boundaries (vllm/v1/metrics/buckets.py), so dashboards read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

_WAITING, _RUNNING, _FINISHED = 0, 1, 2


class RequestCut(FleetwardError):
    """A request's connection is to be cut (``reset_inflight``, ``reset_after_tokens``).

    Not a :class:`WorkerError`: the consumer must not answer it in band, only drop the connection.
    """

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request {request_id}: connection cut by a reset fault")
        self.request_id = request_id


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """What a request asks of the engine (already validated by the HTTP layer).

    ``max_tokens`` is the output budget after vLLM's clamp to the context left after the prompt.
    ``min_tokens`` masks EOS and ``stop_token_ids`` for the first tokens, as vLLM's logits processor does:
    where the model's token is masked, the sequence takes the model's ``ignore_eos`` token instead (for
    EOS) or the next printable token not in ``stop_token_ids``, a pure function of the prefix again, so a
    resumed request (``min_tokens`` reduced by the tokens already emitted) continues exactly. Stop
    strings are only looked for once more than ``min_tokens`` tokens exist.
    """

    max_tokens: int
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Which of a request's ``n`` sampled choices this is: 0 is the model's own (greedy) continuation; another
    # continues from the prompt's state mixed with this salt, so each choice reads differently, and the same
    # request (seed included) gives the same choices on every worker.
    salt: int = 0
    # A LoRA adapter's seed of the model's state (.lora): the model as the adapter changes it; None: the base.
    start: int | None = None


@dataclass(slots=True)
class OutputDelta:
    """What :meth:`SimRequest.next_output` returns: the output since the previous call.

    ``finish_reason`` is ``"stop"`` (EOS, a stop token id, a stop string), ``"length"`` (max_tokens) or
    ``None`` while running; ``stop_reason`` is the stop string or stop token id that ended it (``None``
    for EOS and length), as in vLLM.
    """

    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    num_output_tokens: int


@dataclass
class Faults:
    """The engine's fault switches (see the module docstring). Mutated only through the engine."""

    hang: bool = False
    slowdown: float = 1.0
    error_rate: float = 0.0
    wrong_tokens_probability: float = 0.0
    wrong_tokens_after: int | None = None
    crash_after_tokens: int | None = None  # tokens left to emit before the crash; counts down to 0
    reset_after_tokens: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The shape ``GET /admin/faults`` returns (and ``POST /admin/faults`` accepts)."""
        return {"hang": self.hang, "slowdown": self.slowdown, "error_rate": self.error_rate,
                "wrong_tokens": {"probability": self.wrong_tokens_probability},
                "wrong_tokens_after": self.wrong_tokens_after, "crash_after_tokens": self.crash_after_tokens,
                "reset_after_tokens": self.reset_after_tokens}

    @property
    def corrupts(self) -> bool:
        return self.wrong_tokens_probability > 0 or self.wrong_tokens_after is not None


class Histogram:
    """A Prometheus-style histogram without locks (the engine is one task), with weighted observations."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n
        self.count += n

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, cumulative count)`` pairs, ending with ``(inf, count)``."""
        out, acc = [], 0
        for bound, c in zip((*self.bounds, float("inf")), self.counts, strict=True):
            acc += c
            out.append((bound, acc))
        return out


@dataclass
class EngineStats:
    """Counters, histograms and the gauge snapshot behind ``/metrics`` (vLLM's names, see simworker).

    Gauges (``running``, ``waiting``, ``kv_usage``) are a snapshot the engine loop publishes at step
    boundaries, so a hung engine's metrics freeze like vLLM's do when its EngineCore is stopped.
    """

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    finished: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("stop", "length", "abort", "error"), 0))
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))


class SimRequest:
    """One generation in the engine, and the consumer's handle on it.

    The scheduler writes the output fields; the consumer reads them through :meth:`next_output` and
    :meth:`wait_finished`. Timestamps are on the engine's monotonic clock.
    """

    __slots__ = (
        "_decoder",
        "_final_sent",
        "_on_park",
        "_sent_ids",
        "_sent_text",
        "_stop_buffer",
        "_waiter",
        "admitted_at",
        "arrival",
        "blocks",
        "cut_at",
        "error",
        "finish_reason",
        "first_token_at",
        "kv_cached",
        "last_token_at",
        "output_ids",
        "output_text",
        "params",
        "prefill_left",
        "prompt_ids",
        "request_id",
        "state",
        "status",
        "stop_reason",
    )

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingSpec, *, arrival: float,
                 state: int, vocab: Vocabulary | None = None) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.arrival = arrival
        self.state = state
        self.status = _WAITING
        self.blocks = 0
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.output_ids: list[int] = []
        self.output_text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.cut_at: int | None = None  # set when cut: the consumer gets this many tokens, then RequestCut
        self.prefill_left = 0  # chunked prefill: prompt tokens not computed yet (no token until 0)
        self.kv_cached = 0  # prompt tokens whose KV was loaded from a prefill worker: not computed here
        # The worker's own text, as vLLM makes it: a detokenizer primed with this attempt's prompt.
        self._decoder: IncrementalDecoder | Detokenizer = IncrementalDecoder() if vocab is None else \
            vocab.detokenizer(prompt_ids, skip_special_tokens=params.skip_special_tokens,
                              spaces_between_special_tokens=params.spaces_between_special_tokens)
        self._stop_buffer = (max(len(s) for s in params.stop) - 1
                             if params.stop and not params.include_stop_str_in_output else 0)
        self._sent_ids = 0
        self._sent_text = 0
        self._final_sent = False
        self._waiter: asyncio.Future[None] | None = None
        self._on_park: Callable[[], None] | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what a (re-)prefill has to compute."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == _FINISHED

    @property
    def is_parked(self) -> bool:
        """Whether the consumer waits in :meth:`next_output`/:meth:`wait_finished` with nothing to take."""
        w = self._waiter
        return w is not None and not w.done()

    def _notify(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        if self._on_park is not None:
            self._on_park()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def next_output(self) -> OutputDelta:
        """Wait for output not returned yet; return all of it.

        Text is held back by ``len(longest stop string) - 1`` characters until the request finishes (as
        vLLM does), so a stop string is never streamed. Raises :class:`WorkerError` (status 500, vLLM's
        EngineCore message) when the request failed in the engine, and when called after the final delta;
        :class:`RequestCut` once a cut request has returned the tokens it had when it was cut.
        """
        while True:
            cut = self.cut_at
            if cut is not None and self._sent_ids >= cut:
                raise RequestCut(self.request_id)
            if self.error is not None:
                raise WorkerError(self.error, status=500)
            if self._final_sent:
                raise WorkerError("the request already finished", status=500)
            finished = self.status == _FINISHED and cut is None
            if finished or len(self.output_ids) > self._sent_ids:
                break
            await self._wait()
        upto = len(self.output_ids) if cut is None else min(cut, len(self.output_ids))
        ids = self.output_ids[self._sent_ids:upto]
        self._sent_ids = upto
        end = len(self.output_text) - (0 if finished else self._stop_buffer)
        text = ""
        if end > self._sent_text:
            text = self.output_text[self._sent_text:end]
            self._sent_text = end
        if finished:
            self._final_sent = True
            return OutputDelta(ids, text, self.finish_reason, self.stop_reason, self._sent_ids)
        return OutputDelta(ids, text, None, None, self._sent_ids)

    async def wait_finished(self) -> None:
        """Wait until the request finished; raise :class:`WorkerError` if it failed in the engine,
        :class:`RequestCut` if it was cut."""
        while self.status != _FINISHED and self.cut_at is None:
            await self._wait()
        if self.cut_at is not None:
            raise RequestCut(self.request_id)
        if self.error is not None:
            raise WorkerError(self.error, status=500)


@dataclass(slots=True)
class Step:
    """One planned engine step: the batch, the newly admitted sequences, and how long it takes (s)."""

    batch: list[SimRequest]
    admitted: list[SimRequest]
    prefill_tokens: int
    duration: float


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class SimScheduler:
    """Continuous batching with a KV-block budget, sans IO (see the module docstring for the rules)."""

    def __init__(self, config: SimConfig, *, faults: Faults | None = None, stats: EngineStats | None = None,
                 rng: random.Random | None = None) -> None:
        self.config = config
        self.vocab = None if config.tokenizer == "byte" else load_vocabulary(config.tokenizer)
        self.model = SimModel(config.seed, config.eos_probability, None if self.vocab is None else self.vocab.size)
        self.faults = faults if faults is not None else Faults()
        self.stats = stats if stats is not None else EngineStats()
        self.rng = rng if rng is not None else random.Random(config.seed)
        self.block_size = config.kv_block_size
        self.total_blocks = config.kv_capacity_tokens // config.kv_block_size
        if self.total_blocks < _blocks_for(config.max_model_len, self.block_size):
            raise ConfigError(f"the KV cache ({self.total_blocks} blocks of {self.block_size} tokens) cannot "
                              f"hold one sequence of max_model_len={config.max_model_len} tokens",
                              field="sim.kv_capacity_tokens")
        self.free_blocks = self.total_blocks
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.steps = 0
        self.streams = StreamKv(config.kv_block_size, config.kv_lease_s)  # the KV a planned move hands over

    # -- requests in and out ----------------------------------------------------------------------------

    def new_request(self, request_id: str, prompt_ids: list[int], params: SamplingSpec, *,
                    now: float, kv: tuple[int, int] | None = None) -> SimRequest:
        """A request for ``prompt_ids`` (not yet queued; see :meth:`add`).

        ``kv``: ``(tokens, state)`` when the prompt's first ``tokens`` come with KV loaded from a prefill
        worker: they cost no prefill here, and generation starts from ``state`` (what that KV gives, right
        or wrong; see :meth:`fleetward.sim.model.SimModel.state_from_kv`).
        """
        state = self.model.state(prompt_ids, start=params.start) if kv is None else kv[1]
        if params.salt:
            state = SimModel.advance(state, params.salt)
        req = SimRequest(request_id, prompt_ids, params, arrival=now, state=state, vocab=self.vocab)
        # KV loaded from another worker, or the KV of a stream held here that this prompt continues (.heldkv).
        req.kv_cached = kv[0] if kv is not None else self.streams.covered(prompt_ids, now)
        return req

    def add(self, req: SimRequest) -> None:
        self.waiting.append(req)
        self.streams.running(req)

    def abort(self, req: SimRequest, *, now: float, reason: str = "abort", error: str | None = None) -> bool:
        """Finish ``req`` early (``reason`` abort or error) and free its slot and blocks; False if done."""
        if req.status == _FINISHED:
            return False
        if req.status == _RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.error = error
        self._finish(req, reason, None, now)
        return True

    def abort_all(self, *, now: float, reason: str = "error", error: str | None = ENGINE_DEAD_MESSAGE
                  ) -> list[SimRequest]:
        """Fail every request in the engine (running and waiting); return them."""
        reqs = [*self.running, *self.waiting]
        self.running.clear()
        self.waiting.clear()
        for r in reqs:
            r.error = error
            self._finish(r, reason, None, now)
        return reqs

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks

    def publish(self) -> None:
        """Copy the live gauges into :attr:`stats` (the loop calls this at step boundaries)."""
        s = self.stats
        s.running, s.waiting, s.kv_usage = len(self.running), len(self.waiting), self.kv_usage

    # -- stepping ---------------------------------------------------------------------------------------

    def step_duration(self, batch: int, prefill_tokens: int) -> float:
        """Seconds one step takes with ``batch`` sequences and ``prefill_tokens`` prompt tokens."""
        return self.config.step_seconds(batch, prefill_tokens) * self.faults.slowdown

    def schedule(self, now: float) -> Step | None:
        """Grow the running sequences (preempting if the KV cache is full), admit waiting ones, plan a step.

        ``None`` when there is nothing to run.
        """
        bs = self.block_size
        running = self.running
        i = 0
        while i < len(running):
            req = running[i]
            need = _blocks_for(req.num_tokens, bs) - req.blocks
            while need > self.free_blocks:
                victim = running.pop()
                self._preempt(victim)
                if victim is req:
                    break
            else:
                self.free_blocks -= need
                req.blocks += need
                i += 1
        admitted: list[SimRequest] = []
        prefill_tokens = 0
        budget = self.config.max_num_batched_tokens - len(running)
        chunk = self.config.chunked_prefill_tokens
        while self.waiting and len(running) < self.config.max_num_seqs:
            req = self.waiting[0]
            tokens = req.num_tokens
            need = _blocks_for(tokens, bs)
            if need > self.free_blocks or (not chunk and admitted and tokens > budget):
                break
            self.waiting.popleft()
            self.free_blocks -= need
            req.blocks = need
            req.status = _RUNNING
            if req.admitted_at is None:
                req.admitted_at = now
                self.stats.queue.observe(now - req.arrival)
            running.append(req)
            admitted.append(req)
            computed = tokens - req.kv_cached
            if chunk:
                req.prefill_left = computed
            else:
                prefill_tokens += computed
                budget -= computed
        if chunk:  # this step computes up to ``chunk`` prompt tokens, oldest prompts first
            left = chunk
            for req in running:
                if req.prefill_left and left:
                    take = min(req.prefill_left, left)
                    req.prefill_left -= take
                    prefill_tokens += take
                    left -= take
        if not running:
            return None
        return Step(list(running), admitted, prefill_tokens, self.step_duration(len(running), prefill_tokens))

    def _preempt(self, req: SimRequest) -> None:
        self.free_blocks += req.blocks
        req.blocks = 0
        req.kv_cached = 0  # its loaded KV is freed with its blocks: recomputed on readmission
        req.status = _WAITING
        self.waiting.appendleft(req)
        self.stats.preemptions += 1

    def complete(self, step: Step, now: float) -> list[SimRequest]:
        """Give every sequence of ``step`` still running its next token; return the requests that changed.

        Within the ``crash_after_tokens`` budget (which this spends) and up to ``reset_after_tokens``
        (where a sequence is cut instead; see the module docstring).
        """
        self.steps += 1
        model, faults, stats = self.model, self.faults, self.stats
        corrupts = faults.corrupts
        budget, reset_after = faults.crash_after_tokens, faults.reset_after_tokens
        out: list[SimRequest] = []
        finished: list[SimRequest] = []
        for req in step.batch:
            if req.status != _RUNNING:
                continue  # aborted or preempted meanwhile
            if req.prefill_left:
                continue  # chunked prefill: its prompt is not all computed yet
            p = req.params
            n_out = len(req.output_ids)
            if reset_after is not None and n_out >= reset_after:  # the switch came after it passed k
                self._cut(req, now)
                finished.append(req)
                out.append(req)
                continue
            if budget is not None:
                if budget == 0:
                    continue  # no token this step (the engine stops stepping until the switch changes)
                budget -= 1
            if n_out < p.min_tokens:
                tok = _unmasked(model, model.token_for(req.state, ignore_eos=True), p.stop_token_ids)
            else:
                tok = model.token_for(req.state, ignore_eos=p.ignore_eos)
            if corrupts and self._corrupt_now(n_out):
                tok = self._wrong_token(tok)
            req.state = SimModel.advance(req.state, tok)
            req.output_ids.append(tok)
            n_out += 1
            if req.first_token_at is None:
                req.first_token_at = now
                stats.ttft.observe(now - req.arrival)
                stats.prompt_tokens += len(req.prompt_ids)
            elif req.last_token_at is not None:
                stats.itl.observe(now - req.last_token_at)
            req.last_token_at = now
            reason: str | None = None
            stop_reason: int | str | None = None
            stop_terminated = False
            if tok == EOS_ID and not p.ignore_eos:
                reason, stop_terminated = "stop", True
            elif tok in p.stop_token_ids:
                reason, stop_reason, stop_terminated = "stop", tok, True
            elif n_out >= p.max_tokens:
                reason = "length"
            if not stop_terminated or p.include_stop_str_in_output:
                text = req._decoder.step(tok)
                if text:
                    req.output_text += text
                    if p.stop and n_out > p.min_tokens:
                        hit = _check_stop_strings(req.output_text, len(text), p.stop,
                                                  p.include_stop_str_in_output)
                        if hit is not None:
                            stop_reason, cut = hit
                            reason = "stop"
                            if cut != -1:
                                req.output_text = req.output_text[:cut]
            if reason is not None:
                req.stop_reason = stop_reason
                finished.append(req)
                self._finish(req, reason, stop_reason, now)
            elif reset_after is not None and n_out >= reset_after:
                self._cut(req, now)
                finished.append(req)
            out.append(req)
            stats.generation_tokens += 1
        if budget is not None:
            faults.crash_after_tokens = budget
        if finished:
            done = set(map(id, finished))
            self.running = [r for r in self.running if id(r) not in done]
        return out

    def _finish(self, req: SimRequest, reason: str, stop_reason: int | str | None, now: float) -> None:
        """Mark ``req`` finished and free its blocks (the caller takes it out of running/waiting)."""
        self.free_blocks += req.blocks
        req.blocks = 0
        req.status = _FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        self.stats.finished[reason] += 1
        self.stats.e2e.observe(now - req.arrival)
        # Stopped by its client mid-stream: its KV stays (a planned move asks for it next).
        self.streams.finished(req, hold=reason == "abort" and req.error is None and req.cut_at is None, now=now)

    def _cut(self, req: SimRequest, now: float) -> None:
        """End ``req`` as cut by ``reset_after_tokens``: its consumer gets what it has, then RequestCut."""
        req.cut_at = len(req.output_ids)
        self._finish(req, "abort", None, now)

    def _corrupt_now(self, index: int) -> bool:
        f = self.faults
        if f.wrong_tokens_after is not None and index >= f.wrong_tokens_after:
            return True
        return f.wrong_tokens_probability > 0 and self.rng.random() < f.wrong_tokens_probability

    def _wrong_token(self, tok: int) -> int:
        """A token the model could generate that is not ``tok`` (never EOS, so the corrupted stream goes on)."""
        first, count = self.model.span
        offset = tok - first
        if 0 <= offset < count:
            return first + (offset + 1 + self.rng.randrange(count - 1)) % count
        return first + self.rng.randrange(count)


def _unmasked(model: SimModel, tok: int, masked: frozenset[int]) -> int:
    """``tok``, or the next token the model could generate (cyclically) that is not ``masked``."""
    if tok not in masked:
        return tok
    base, count = model.span
    for k in range(1, count):
        alt = base + (tok - base + k) % count
        if alt not in masked:
            return alt
    return tok


def _check_stop_strings(text: str, new_chars: int, stop: Iterable[str], include: bool
                        ) -> tuple[str, int] | None:
    """vLLM's ``check_stop_strings``: the stop string completing earliest, and where to cut (-1: no cut)."""
    best: str | None = None
    best_index, best_end = 0, sys.maxsize
    for s in stop:
        index = text.find(s, 1 - new_chars - len(s))
        if index == -1:
            continue
        end = index + len(s)
        if end < best_end:
            best, best_index, best_end = s, index, end
    if best is None:
        return None
    if include:
        return best, (-1 if best_end >= len(text) else best_end)
    return best, best_index


class SimEngine:
    """The async loop that steps a :class:`SimScheduler` in (injected) time.

    Run :meth:`run` in a task you own (it runs until cancelled; on the way out it fails every open
    request so no consumer waits forever). :meth:`submit`, :meth:`abort` and :meth:`release` are
    synchronous and safe to call from any coroutine on the engine's event loop. A consumer releases every
    request it submitted once it is done with it (see *Delivery* in the module docstring).

    ``crash`` is called (from the loop, once per spent budget) when a ``crash_after_tokens`` budget is
    spent and delivered; without one, a spent budget just stops the engine.
    """

    def __init__(self, config: SimConfig, *, clock: Clock = SYSTEM_CLOCK, faults: Faults | None = None,
                 crash: Callable[[], None] | None = None) -> None:
        self.config = config
        self.clock = clock
        self.stats = EngineStats()
        self.faults = faults if faults is not None else Faults()
        self.scheduler = SimScheduler(config, faults=self.faults, stats=self.stats)
        self._crash = crash
        self._open: set[SimRequest] = set()
        self._holds = 0
        self._delivery = asyncio.Event()  # set when a consumer parks or releases, or the faults change
        self._rng = random.Random(config.seed ^ 0x5EED)
        self._work = asyncio.Event()
        self._running_again = asyncio.Event()
        if not self.faults.hang:
            self._running_again.set()
        self._deferred_aborts: list[SimRequest] = []
        self._ids = 0
        self._stalled = False

    # -- requests ---------------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingSpec,
               request_id: str | None = None, *, kv: tuple[int, int] | None = None) -> SimRequest:
        """Queue a generation; the returned handle streams its output (``kv``: see ``Scheduler.new_request``)."""
        if request_id is None:
            self._ids += 1
            request_id = f"sim-{self._ids}"
        req = self.scheduler.new_request(request_id, prompt_ids, params, now=self.clock.monotonic(), kv=kv)
        poison = self.config.poison_token
        if poison is not None and poison in prompt_ids and self._crash is not None:
            # A poison request (SimConfig.poison_token): the engine dies while it is being served.
            budget = self.faults.crash_after_tokens
            self.faults.crash_after_tokens = 2 if budget is None else min(budget, 2)
        req._on_park = self._delivery.set
        self._open.add(req)
        self.scheduler.add(req)
        self._work.set()
        return req

    def release(self, req: SimRequest) -> None:
        """The consumer is done with ``req`` (response sent, or connection gone): abort it if still open."""
        self._open.discard(req)
        req._on_park = None
        self.abort(req)
        self._delivery.set()

    def abort(self, req: SimRequest) -> None:
        """Cancel ``req`` (client went away): frees its batch slot and KV. No-op when it already finished.

        A hung engine processes the abort only once it runs again (it cannot do anything before).
        """
        if req.is_finished:
            return
        if self.faults.hang:
            self._deferred_aborts.append(req)
            return
        self.scheduler.abort(req, now=self.clock.monotonic())
        req._notify()

    def fail_inflight(self) -> int:
        """Fail every open request with the EngineCore error (streams get it in band); return how many."""
        reqs = self.scheduler.abort_all(now=self.clock.monotonic())
        for r in reqs:
            r._notify()
        return len(reqs)

    def hold_crash(self) -> Callable[[], None]:
        """Keep a spent budget from crashing until the returned callable is called (it is idempotent).

        The HTTP layer holds while it answers the ``POST /admin/faults`` that set the switch.
        """
        self._holds += 1
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self._holds -= 1
                self._delivery.set()

        return release

    def reset_inflight(self) -> int:
        """Cut every open request (running or waiting): its consumer gets :class:`RequestCut` on its next
        call, whatever output was waiting for it, and the request is aborted (once the engine runs again,
        if hung). Return how many were cut."""
        s = self.scheduler
        reqs = [r for r in (*s.running, *s.waiting) if r.cut_at is None]
        for r in reqs:
            r.cut_at = r._sent_ids
            self.abort(r)
            r._notify()
        return len(reqs)

    def draw_error(self) -> bool:
        """Whether the next new request should fail (a draw against ``faults.error_rate``)."""
        rate = self.faults.error_rate
        return rate > 0 and (rate >= 1 or self._rng.random() < rate)

    # -- faults -----------------------------------------------------------------------------------------

    def update_faults(self, new: Faults) -> Faults:
        """Set every switch to ``new``'s value (``Faults()`` clears them all); return the live switches."""
        f = self.faults
        f.hang, f.slowdown, f.error_rate = new.hang, new.slowdown, new.error_rate
        f.wrong_tokens_probability = new.wrong_tokens_probability
        f.wrong_tokens_after = new.wrong_tokens_after
        f.crash_after_tokens, f.reset_after_tokens = new.crash_after_tokens, new.reset_after_tokens
        if f.hang:
            self._running_again.clear()
        else:
            self._running_again.set()
            self._work.set()
        self._delivery.set()
        return f

    # -- introspection ----------------------------------------------------------------------------------

    @property
    def is_stalled(self) -> bool:
        """Whether the loop is parked by ``hang`` (it noticed the switch and does nothing until cleared)."""
        return self._stalled

    def state(self) -> dict[str, Any]:
        """Live scheduler state (``GET /admin/state``): not frozen by a hang, unlike the metrics."""
        s = self.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting), "kv_usage": s.kv_usage,
                "kv_blocks_used": s.total_blocks - s.free_blocks, "kv_blocks_total": s.total_blocks,
                "steps": s.steps, "hung": self.faults.hang, "stalled": self._stalled,
                "preemptions": self.stats.preemptions, "generation_tokens": self.stats.generation_tokens,
                "faults": self.faults.to_json()}

    # -- the loop ---------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Step until cancelled."""
        sched, clock = self.scheduler, self.clock
        prev_deadline: float | None = None
        try:
            while True:
                if self.faults.hang or self._deferred_aborts:
                    await self._stall()
                    prev_deadline = None
                if self.faults.crash_after_tokens == 0:
                    await self._spent()
                    prev_deadline = None
                    continue
                now = clock.monotonic()
                step = sched.schedule(now)
                sched.publish()
                if step is None:
                    prev_deadline = None
                    self._work.clear()
                    await self._work.wait()
                    continue
                # A step starts where the previous one ended, so the time spent delivering tokens is
                # part of the step rather than added to it (unless we are already a whole step behind).
                start = prev_deadline if prev_deadline is not None and now - prev_deadline < step.duration \
                    else now
                deadline = start + step.duration
                await self._spend(deadline - now)
                if self.faults.hang:  # stopped mid-step: the step finishes only when the engine runs again
                    await self._stall()
                    deadline = clock.monotonic()
                for req in sched.complete(step, clock.monotonic()):
                    req._notify()
                prev_deadline = deadline
        finally:
            for req in sched.abort_all(now=clock.monotonic(), error="the simulated engine shut down"):
                req._notify()

    async def _spend(self, seconds: float) -> None:
        """A step's time: slept, or with ``SimConfig.compute_steps`` spent on a CPU, as an engine's process does."""
        if self.config.compute_steps and self.clock is SYSTEM_CLOCK and seconds > 0:
            await asyncio.to_thread(_compute, seconds)
        else:
            await self.clock.sleep(seconds)

    async def _spent(self) -> None:
        """The crash budget is spent: emit nothing; once every consumer is parked or has released its
        request (all output is on its way to the client), crash once. Return when the switch changes."""
        crashed = False
        while self.faults.crash_after_tokens == 0:
            self.scheduler.publish()
            self._delivery.clear()
            if not crashed and not self._holds and all(r.is_parked for r in self._open):
                crashed = True
                if self._crash is not None:
                    self._crash()
            await self._delivery.wait()

    async def _stall(self) -> None:
        """Wait until the engine is not hung, then process the aborts that arrived meanwhile."""
        self._stalled = self.faults.hang
        try:
            await self._running_again.wait()
        finally:
            self._stalled = False
        aborts, self._deferred_aborts = self._deferred_aborts, []
        for req in aborts:
            self.scheduler.abort(req, now=self.clock.monotonic())
            req._notify()


_BLOCK = bytes(1 << 16)


def _compute(seconds: float) -> None:
    """Keep one core busy for ``seconds`` (hashing releases the GIL: the server's loop runs beside it)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        hashlib.sha256(_BLOCK).digest()
