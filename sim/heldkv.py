"""The KV a simulated worker still holds for a stream: what a planned move hands over instead of recomputing.

When a stream moves for a plan (a drain, a scale-down, ``fleetward move``, a rebalance), the router stops
it here and asks this worker for the KV of the stream's prompt and emitted tokens, in one step (the
prefill/decode ask, ``kv_transfer_params.do_remote_decode``, with the prompt plus the emitted tokens). vLLM
answers that from its prefix cache: an aborted request's blocks stay there until they are evicted, and a
running request's full blocks are shared. This worker answers from :class:`StreamKv`: the KV of a running
stream, or of one stopped (cancelled by its client) within ``kv_lease_s``, covers every whole block of a
prompt that continues it (the stream's prompt, then its tokens), so that prompt costs only its tail.

Only continuations count: a prompt that goes beyond a stream's own prompt into its generated tokens. Two
requests with the same prompt do not share KV here, as the simulated worker never modelled prefix caching,
and the timings of everything else stay as they were.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

__all__ = ["StreamKv"]

_MOST = 256  # stopped streams held at once (the oldest is evicted first)


class _Stream(Protocol):
    prompt_ids: list[int]
    output_ids: list[int]


class StreamKv:
    """The streams whose KV a worker holds, by their first block, for :meth:`covered` to look up."""

    def __init__(self, block_size: int, lease_s: float) -> None:
        self.block_size = block_size
        self.lease_s = lease_s
        self._by_head: dict[tuple[int, ...], list[_Stream]] = {}
        self._held: deque[tuple[float, _Stream]] = deque()  # stopped streams, oldest first

    def _head(self, ids: list[int]) -> tuple[int, ...] | None:
        return tuple(ids[:self.block_size]) if len(ids) > self.block_size else None

    def running(self, req: _Stream) -> None:
        """``req`` runs here: its KV is in the cache."""
        head = self._head(req.prompt_ids)
        if head is not None:
            self._by_head.setdefault(head, []).append(req)

    def finished(self, req: _Stream, *, hold: bool, now: float) -> None:
        """``req`` ended; with ``hold`` (stopped by its client mid-stream) its KV stays for ``lease_s``."""
        if hold and req.output_ids and self._head(req.prompt_ids) is not None:
            self._held.append((now + self.lease_s, req))
            if len(self._held) > _MOST:
                self._forget(self._held.popleft()[1])
            return
        self._forget(req)

    def _forget(self, req: _Stream) -> None:
        head = self._head(req.prompt_ids)
        streams = self._by_head.get(head) if head is not None else None
        if streams is None:
            return
        try:
            streams.remove(req)
        except ValueError:
            return
        if not streams:
            del self._by_head[head]  # type: ignore[arg-type]

    def covered(self, prompt_ids: list[int], now: float) -> int:
        """Tokens of ``prompt_ids`` whose KV is here: the whole blocks of all but its last token, when it
        continues a stream held here; else 0."""
        while self._held and self._held[0][0] <= now:
            self._forget(self._held.popleft()[1])
        head = self._head(prompt_ids)
        if head is None:
            return 0
        covered = (len(prompt_ids) - 1) // self.block_size * self.block_size
        for s in self._by_head.get(head, ()):
            n = len(s.prompt_ids)
            if not s.output_ids or len(prompt_ids) <= n or n + len(s.output_ids) < covered:
                continue
            if covered <= n:
                if prompt_ids[:covered] == s.prompt_ids[:covered]:
                    return covered
            elif prompt_ids[:n] == s.prompt_ids and prompt_ids[n:covered] == s.output_ids[:covered - n]:
                return covered
        return 0
