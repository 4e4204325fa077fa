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
    """The output of a request answered whole: the journal holds the answer, nothing is sent per token but
    the chunks' logprobs, kept to be joined into the answer's (:attr:`logprobs`)."""

    __slots__ = ("_logprobs",)

    def __init__(self) -> None:
        self._logprobs: list[Any] = []

    @property
    def logprobs(self) -> Any:
        """The answer's logprobs: every chunk's joined as vLLM joins them (each list field end to end; a
        completion's ``text_offset`` already counted from the first token by the relay), or None."""
        parts = [p for p in self._logprobs if isinstance(p, dict)]
        if not parts:
            return None
        return {key: [x for p in parts for x in (p.get(key) or [])] if isinstance(value, list) else value
                for key, value in parts[0].items()}

    def opened(self) -> None:
        pass

    def tokens(self, tokens: list[int], text: str, finish_reason: str | None, stop_reason: str | int | None,
               logprobs: Any, worker: str, n: int, attempt: int) -> None:
        if logprobs is not None:
            self._logprobs.append(logprobs)

    def flush(self) -> None:
        pass

    def reading(self, stream: UpstreamStream | None, worker: str) -> None:
        pass


_COUNT_EVERY = 32  # tokens between updates of the tokens counter (it takes a lock)


class Relay:
    """The callbacks of one attempt on ``worker`` (see the module docstring). Its state is written back to
    the request's :class:`~fleetward.migration.router._Tries` by :meth:`close`."""

    __slots__ = ("_echo", "_offsets", "active", "clock", "failed_at", "fingerprints", "j", "last_token_at", "metrics",
                 "on_moved", "out", "progress", "t", "uncounted", "worker")

    def __init__(self, j: Journal, worker: str, out: Output, t: _Tries, active: Active, *, progress: ProgressModel,
                 metrics: RouterMetrics, clock: Clock, on_moved: Callable[[float], None],
                 fingerprints: dict[str, str] | None = None) -> None:
        self.j = j
        self.worker = worker
        self.out = out
        self.t = t
        self.active = active
        self.progress = progress
        self.metrics = metrics
        self.clock = clock
        self.on_moved = on_moved  # a planned move's first token on its destination (the stall, in seconds)
        self.fingerprints = {} if fingerprints is None else fingerprints  # each worker's last system_fingerprint
        self.failed_at, self.last_token_at = t.failed_at, t.last_token_at
        self.uncounted = 0  # tokens sent but not yet added to the tokens counter
        # a completion's logprobs carry text offsets, which the router's text shifts
        self._offsets = j.kind is Kind.COMPLETION and not j.body.get("echo")
        # a streamed completion with echo opens with the prompt's text, unless the client asked for ids
        self._echo = j.kind is Kind.COMPLETION and bool(j.body.get("echo")) and not j.wants_token_ids

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
            j.fingerprint = self.fingerprints[self.worker] = chunk.fingerprint
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
        first = not j.emitted
        tokens, text, finish = j.record(ids, chunk.text, chunk.finish_reason, chunk.stop_reason)
        if finish is not None and chunk.fingerprint is None:
            # Ended by the router (a stop string, max_tokens) before the worker's last chunk, which carries
            # its fingerprint: the one it sent last time.
            j.fingerprint = self.fingerprints.get(self.worker, j.fingerprint)
        if first and self._echo:
            text = j.echo_text() + text
        self.uncounted += len(tokens)
        if self.uncounted >= _COUNT_EVERY:
            self.metrics.tokens.inc(self.uncounted)
            self.uncounted = 0
        logprobs = chunk.logprobs
        if logprobs is not None:
            if len(tokens) < len(ids):  # a stop string or max_tokens cut the chunk: so are its logprobs
                logprobs = _cut_logprobs(logprobs, len(ids) - len(tokens))
            if self._offsets:
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


def _cut_logprobs(logprobs: Any, drop: int) -> Any:
    """``logprobs`` without the entries of its last ``drop`` tokens: every list field (completions:
    ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``; chat: ``content``) loses its tail."""
    if not isinstance(logprobs, dict) or drop <= 0:
        return logprobs
    return {k: v[:max(0, len(v) - drop)] if isinstance(v, list) else v for k, v in logprobs.items()}
