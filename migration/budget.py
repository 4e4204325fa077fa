"""The retry budget: a sick fleet is not made sicker by its own front door.

A request that fails on a worker that answered it (an engine error, a 5xx, an error event) may fail the same
way on the next: retrying it everywhere multiplies a failing fleet's load by ``migration_limit + 1`` (the
retry storm of a metastable failure; Bronson et al., HotOS 2021). So those retries draw on a budget, a
bucket of ``retry_budget_tokens`` in the spirit of gRPC's retry throttling (gRFC A6): such a retry goes ahead
only while the bucket is over half full, and takes a token. A retry that is served gives its token back
(another worker could do what the first could not: retrying was right), and every request served adds
``retry_budget_ratio``.

What it never throttles:

- a mid-stream resume: tokens already reached the client, and resuming them on a healthy worker is what
  fleetward exists for (the work lost with a dead worker is computed once more, no more);
- a worker that could not be reached, cut the connection or died (its process, its lease): it did not serve
  the request, so trying another costs the fleet no more than the request itself;
- planned moves.

So one failing worker among healthy ones is retried around as before (its requests' retries are served and
give their tokens back), while a fleet where every worker fails is sent each request about once: half the
bucket's retries, then none until requests are served again.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RetryBudget", "throttled_kind"]

# Failures of a worker that answered the request: the ones a retry storm is made of.
_ANSWERED = frozenset({"status", "error_event"})


def throttled_kind(kind: str, emitted: int) -> bool:
    """Whether a retry after a failure of ``kind`` (:class:`~fleetward.migration.upstream.UpstreamError`)
    with ``emitted`` tokens already sent to the client draws on the budget."""
    return emitted == 0 and kind in _ANSWERED


@dataclass
class RetryBudget:
    tokens_max: float = 20.0
    ratio: float = 0.1
    tokens: float = -1.0  # -1: full

    def __post_init__(self) -> None:
        if self.tokens < 0:
            self.tokens = self.tokens_max

    @property
    def enabled(self) -> bool:
        return self.tokens_max > 0

    def admit(self) -> bool:
        """Whether a throttled retry may go ahead now; if so, it takes a token (given back if it is served)."""
        if not self.enabled:
            return True
        if self.tokens <= self.tokens_max / 2:
            return False
        self.tokens -= 1.0
        return True

    def served(self, refund: int = 0) -> None:
        """A request was served; ``refund``: its throttled retries (they were right)."""
        if self.enabled:
            self.tokens = min(self.tokens_max, self.tokens + self.ratio + refund)
