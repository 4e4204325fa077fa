"""One attempt's tokens, relayed from its worker to its client in the upstream socket's own callback.

:class:`Relay` is the :class:`~fleetward.migration.upstream.Sink` of one attempt: for every chunk the worker's
connection parses (:mod:`.upstream`) it records the tokens in the journal (ids, the router's text, stop
strings), tells the progress model, and hands the client's side (an :class:`Output`) what to send, all within
the ``data_received`` call that brought the bytes. The client's side writes what one read produced as one
write (:mod:`.downstream`). Nothing here awaits: the attempt loop (:meth:`~fleetward.migration.router.Router.relay`)
awaits only the attempt's end.

Backpressure: when the client's socket is full, the client's side stops reading its worker's stream
(:meth:`Output.pause`); the progress model does not count a paused stream as silence, so a slow client never
makes a healthy worker look hung, and never holds up another stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from fleetward.fleet.clock import Clock
from fleetward.migration.journal import Journal, Kind
from fleetward.migration.metrics import RouterMetrics
from fleetward.migration.progress import ProgressModel
from fleetward.migration.upstream import Chunk, UpstreamStream

if TYPE_CHECKING:
    from fleetward.migration.router import Active, _Tries

__all__ = ["Output", "Relay", "Whole"]


class Output(Protocol):
    """The client's side of a request, fed by the relay's callbacks."""

    def opened(self) -> None:
        """A worker accepted the request (once per request): from here on failures are the stream's own."""

    def tokens(self, tokens: list[int], text: str, finish_reason: str | None, stop_reason: str | int | None,
               logprobs: Any, worker: str, n: int, attempt: int) -> None:
        """New tokens; ``n``: completion tokens the journal holds once they are in."""

    def flush(self) -> None:
        """The end of one read from the worker: send what came."""

    def reading(self, stream: UpstreamStream | None, worker: str) -> None:
        """The upstream stream now feeding it (None: none until the next attempt opens), to pause and
        resume for backpressure."""


class Whole:
    """The output of a request answered whole: the journal holds the answer, nothing is sent per token."""

    def opened(self) -> None:
        pass

    def tokens(self, tokens: list[int], text: str, finish_reason: str | None, stop_reason: str | int | None,
               logprobs: Any, worker: str, n: int, attempt: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def reading(self, stream: UpstreamStream | None, worker: str) -> None:
        pass


_COUNT_EVERY = 32  # tokens between updates of the tokens counter (it takes a lock)


class Relay:
    """The callbacks of one attempt on ``worker`` (see the module docstring). Its state is written back to
    the request's :class:`~fleetward.migration.router._Tries` by :meth:`close`."""

    __slots__ = ("_offsets", "active", "clock", "failed_at", "j", "last_token_at", "metrics", "on_moved", "out",
                 "progress", "t", "uncounted", "worker")

    def __init__(self, j: Journal, worker: str, out: Output, t: _Tries, active: Active, *, progress: ProgressModel,
                 metrics: RouterMetrics, clock: Clock, on_moved: Callable[[float], None]) -> None:
        self.j = j
        self.worker = worker
        self.out = out
        self.t = t
        self.active = active
        self.progress = progress
        self.metrics = metrics
        self.clock = clock
        self.on_moved = on_moved  # a planned move's first token on its destination (the stall, in seconds)
        self.failed_at, self.last_token_at = t.failed_at, t.last_token_at
        self.uncounted = 0  # tokens sent but not yet added to the tokens counter
        # a completion's logprobs carry text offsets, which the router's text shifts
        self._offsets = j.kind is Kind.COMPLETION and not j.body.get("echo")

    def opened(self, stream: UpstreamStream) -> None:
        self.active.stream = stream
        t = self.t
        t.kv.use_prefill = True  # a later resume of this stream is prefilled again
        if not t.opened:
            t.opened = True
            self.out.opened()
        self.out.reading(stream, self.worker)

    def chunk(self, chunk: Chunk) -> bool:
        j = self.j
        if chunk.prompt_token_ids is not None and j.prompt_ids is None:
            j.prompt_ids = list(chunk.prompt_token_ids)
        if chunk.fingerprint is not None:
            j.fingerprint = chunk.fingerprint
        ids = chunk.token_ids
        if not ids and chunk.finish_reason is None:
            return False
        self.progress.token(self.worker, j.id, len(ids))
        now = self.last_token_at = self.clock.monotonic()
        if self.failed_at is not None:
            self.metrics.stall.observe(now - self.failed_at)
            if self.t.move is not None:
                self.on_moved(now - self.failed_at)
            self.failed_at = None
        tokens, text, finish = j.record(ids, chunk.text, chunk.finish_reason, chunk.stop_reason)
        self.uncounted += len(tokens)
        if self.uncounted >= _COUNT_EVERY:
            self.metrics.tokens.inc(self.uncounted)
            self.uncounted = 0
        logprobs = chunk.logprobs
        if logprobs is not None and self._offsets:
            logprobs = j.logprobs_offsets(logprobs)
        self.out.tokens(tokens, text, finish, j.stop_reason, logprobs, self.worker, len(j.emitted), j.attempts)
        return finish is not None

    def flush(self) -> None:
        self.out.flush()

    def close(self) -> None:
        """The attempt is over, whichever way."""
        self.metrics.tokens.inc(self.uncounted)
        self.uncounted = 0
        t = self.t
        t.failed_at, t.last_token_at = self.failed_at, self.last_token_at
        self.active.stream = None
        self.out.reading(None, self.worker)
        self.progress.finished(self.worker, self.j.id)
