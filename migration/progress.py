"""Token progress per worker, and how long a worker may stay silent before it counts as stalled.

A sans-IO model, fed by whoever sees the streams (the router): ``dispatched``, ``token``, ``finished``.
It answers one question, :meth:`ProgressModel.stalled`: which workers have work in flight and have not
produced a token for longer than their allowed silence. The allowed silence adapts to the work:

    allowed = max(floor, itl_multiplier * p99 inter-token gap seen on the fleet)
              + pending prefill tokens on that worker * learned prefill seconds per token

- Silence is per *worker*, not per stream: a request that waits in a busy worker's queue (or was
  preempted) while the worker keeps emitting tokens for others is not a hang. Only a worker that emits
  nothing at all while it has work is suspect, which is exactly vLLM's silent hang (EngineCore stopped).
- Long prompts get longer: prefill cost is learned from first-token latencies of long prompts, and the
  prompts that have not produced their first token yet extend the worker's allowance.

The same model runs in the router (to migrate streams off a stalled worker) and its :meth:`view` is what
the supervisor's stream-progress detector reads.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any

from fleetward.fleet.clock import SYSTEM_CLOCK, Clock

__all__ = ["ProgressModel", "WorkerProgress"]


@dataclass
class WorkerProgress:
    in_flight: int = 0
    pending_prefill_tokens: int = 0  # prompt tokens of in-flight streams that have no first token yet
    last_token: float = 0.0  # monotonic time of the last token (or of the first dispatch after idle)
    tokens: int = 0
    stalls: int = 0  # times the router moved this worker's streams away for silence
    shunned_at: float | None = None  # monotonic: its streams were moved away for silence, no token since
    shunned_wall: float = 0.0  # the same moment on the wall clock (health records' ``since`` are wall times)
    streams: dict[str, int] = field(default_factory=dict)  # stream id -> prompt length while awaiting 1st token
    paused: set[str] = field(default_factory=set)  # streams whose reading waits for their client (not silent)

    @property
    def waiting(self) -> int:
        """Streams it owes tokens to now: in flight, less those the router stopped reading."""
        return self.in_flight - len(self.paused)


class _Window:
    """A sliding window of the last ``size`` samples with cheap percentiles.

    Samples are kept as log-spaced buckets (each ``ratio`` wide, from ``low`` up), so adding one is a
    logarithm and two counter updates, not a sorted insert; a quantile is the upper bound of its bucket,
    at most ``ratio`` above the exact value (the allowance it feeds is a multiple of it anyway).
    """

    def __init__(self, size: int, *, low: float = 1e-5, ratio: float = 1.05, buckets: int = 512) -> None:
        self._fifo: collections.deque[int] = collections.deque()
        self._counts = [0] * buckets
        self._size = size
        self._low = low
        self._ratio = ratio
        self._scale = 1 / math.log(ratio)
        self._last = buckets - 1

    def add(self, x: float) -> None:
        b = 0 if x <= self._low else min(self._last, 1 + int(math.log(x / self._low) * self._scale))
        self._fifo.append(b)
        self._counts[b] += 1
        if len(self._fifo) > self._size:
            self._counts[self._fifo.popleft()] -= 1

    def quantile(self, q: float) -> float | None:
        n = len(self._fifo)
        if not n:
            return None
        want = min(n - 1, int(q * n)) + 1  # the rank of the sample asked for, counted from 1
        seen = 0
        for b, c in enumerate(self._counts):
            seen += c
            if seen >= want:
                return self._low * self._ratio ** b
        return None  # not reached: the counts add up to n

    def __len__(self) -> int:
        return len(self._fifo)


class ProgressModel:
    def __init__(self, *, clock: Clock = SYSTEM_CLOCK, floor_s: float = 1.0, itl_multiplier: float = 8.0,
                 prefill_s_per_token: float = 0.002, first_token_base_s: float = 1.0,
                 window: int = 2048) -> None:
        self.clock = clock
        self.floor_s = floor_s
        self.itl_multiplier = itl_multiplier
        self.first_token_base_s = first_token_base_s
        self.prefill_s_per_token = prefill_s_per_token
        self.workers: dict[str, WorkerProgress] = {}
        self._gaps = _Window(window)
        self._dispatched_at: dict[str, float] = {}
        self._last_token_of: dict[str, float] = {}

    def _worker(self, worker: str) -> WorkerProgress:
        w = self.workers.get(worker)
        if w is None:
            w = self.workers[worker] = WorkerProgress(last_token=self.clock.monotonic())
        return w

    # -- observations -----------------------------------------------------------------------------------

    def dispatched(self, worker: str, stream: str, prompt_tokens: int) -> None:
        w = self._worker(worker)
        now = self.clock.monotonic()
        if w.waiting == 0:
            w.last_token = now  # silence is counted from when there is work
        w.in_flight += 1
        w.streams[stream] = prompt_tokens
        w.pending_prefill_tokens += prompt_tokens
        self._dispatched_at[stream] = now

    def token(self, worker: str, stream: str, n: int = 1) -> None:
        w = self._worker(worker)
        now = self.clock.monotonic()
        w.last_token = now
        w.tokens += n
        w.shunned_at = None  # it produces again
        prompt = w.streams.pop(stream, None)
        if prompt is not None:
            w.pending_prefill_tokens -= prompt
            started = self._dispatched_at.pop(stream, now)
            if prompt >= 256:  # long prompts teach the prefill rate
                rate = max(0.0, (now - started)) / prompt
                self.prefill_s_per_token = 0.8 * self.prefill_s_per_token + 0.2 * rate
        else:
            last = self._last_token_of.get(stream)
            if last is not None and n == 1:
                self._gaps.add(now - last)
        self._last_token_of[stream] = now

    def paused(self, worker: str, stream: str) -> None:
        """The router stopped reading this stream (its client reads slower than the worker writes): the
        worker's silence on it is the router's doing, not a hang, so it does not count until :meth:`resumed`."""
        w = self.workers.get(worker)
        if w is not None:
            w.paused.add(stream)

    def resumed(self, worker: str, stream: str) -> None:
        w = self.workers.get(worker)
        if w is not None and stream in w.paused:
            if w.waiting == 0:
                w.last_token = self.clock.monotonic()  # silence is counted from when there is work again
            w.paused.discard(stream)

    def finished(self, worker: str, stream: str) -> None:
        w = self.workers.get(worker)
        self._dispatched_at.pop(stream, None)
        self._last_token_of.pop(stream, None)
        if w is None:
            return
        w.paused.discard(stream)
        prompt = w.streams.pop(stream, None)
        if prompt is not None:
            w.pending_prefill_tokens -= prompt
        w.in_flight = max(0, w.in_flight - 1)

    def forget(self, worker: str) -> None:
        self.workers.pop(worker, None)

    def stall_acted_on(self, worker: str) -> None:
        """The router moved this worker's streams away for silence (kept in :meth:`view` as ``stalls``).

        Once its streams are gone a worker has nothing in flight, so it no longer *looks* silent; this
        counter keeps the evidence for the supervisor; and the worker is *shunned* (see :meth:`shunned`).
        """
        w = self._worker(worker)
        w.stalls += 1
        w.shunned_at, w.shunned_wall = self.clock.monotonic(), self.clock.wall()

    def shunned(self, worker: str, *, hold_s: float, ready_since: float | None = None) -> bool:
        """Whether new work should avoid this worker: its streams were moved away for silence less than
        ``hold_s`` ago and it has not produced a token since. Without this, a hung worker that just lost its
        streams looks idle (nothing in flight, so not silent), and the least-loaded choice sends it the next
        request, which stalls in turn. ``ready_since``: when the supervisor last found it ready (a canary
        passed, or it was restarted); a verdict after the stall lifts the shunning at once."""
        w = self.workers.get(worker)
        if w is None or w.shunned_at is None:
            return False
        if self.clock.monotonic() - w.shunned_at >= hold_s or (ready_since is not None and
                                                                ready_since > w.shunned_wall):
            w.shunned_at = None
            return False
        return True

    # -- verdicts ---------------------------------------------------------------------------------------

    def allowed_silence(self, worker: str) -> float:
        """Seconds this worker may go without emitting a token, given the work it has now."""
        w = self.workers.get(worker)
        p99 = self._gaps.quantile(0.99)
        decode = max(self.floor_s, self.itl_multiplier * p99) if p99 is not None else self.floor_s
        if w is None or not w.pending_prefill_tokens:
            return decode
        return decode + self.first_token_base_s + w.pending_prefill_tokens * self.prefill_s_per_token

    def silent_for(self, worker: str) -> float:
        w = self.workers.get(worker)
        if w is None or w.waiting <= 0:
            return 0.0
        return self.clock.monotonic() - w.last_token

    def stalled(self) -> list[tuple[str, float, float]]:
        """``(worker, silent for, allowed)`` for every worker with work in flight past its allowance."""
        out = []
        for worker, w in self.workers.items():
            if w.waiting <= 0:
                continue
            silent = self.clock.monotonic() - w.last_token
            allowed = self.allowed_silence(worker)
            if silent > allowed:
                out.append((worker, silent, allowed))
        return out

    def view(self) -> dict[str, Any]:
        """What the router publishes for the supervisor: per worker in-flight work and silence."""
        return {
            "itl_p99_s": self._gaps.quantile(0.99),
            "prefill_s_per_token": self.prefill_s_per_token,
            "workers": {
                worker: {
                    "in_flight": w.in_flight,
                    "paused": len(w.paused),
                    "pending_prefill_tokens": w.pending_prefill_tokens,
                    "silent_for_s": self.silent_for(worker),
                    "allowed_silence_s": self.allowed_silence(worker),
                    "tokens": w.tokens,
                    "stalls": w.stalls,
                }
                for worker, w in self.workers.items()
            },
        }
