"""Where a request goes: a small interface, and the default policy.

:class:`RoutingPolicy` picks one worker among candidates the router already filtered (healthy, ready,
serving the model, not excluded for this request). The default, :class:`LeastLoadedAffinity`, sends a
prompt to the worker its prefix hashes to (rendezvous hashing over the candidates, so the same prefix
keeps landing on the same worker and its KV prefix cache) unless that worker carries more than
``slack`` requests above the least loaded candidate; then the least loaded one wins.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Protocol

__all__ = ["LeastLoadedAffinity", "RoutingPolicy", "prefix_key"]


def prefix_key(prompt: Sequence[int] | str, tokens: int = 64) -> bytes:
    """A stable key for a prompt's first ``tokens`` token ids (or characters of a text prompt)."""
    if isinstance(prompt, str):
        return prompt[: tokens * 4].encode()
    return b",".join(str(t).encode() for t in prompt[:tokens])


class RoutingPolicy(Protocol):
    def choose(self, candidates: Sequence[str], load: Mapping[str, int], key: bytes | None) -> str:
        """One of ``candidates`` (non-empty). ``load`` is in-flight requests per worker."""
        ...


class LeastLoadedAffinity:
    def __init__(self, slack: int = 4) -> None:
        self.slack = slack

    def choose(self, candidates: Sequence[str], load: Mapping[str, int], key: bytes | None) -> str:
        least = min(candidates, key=lambda w: (load.get(w, 0), w))
        if key is None:
            return least
        preferred = max(candidates, key=lambda w: hashlib.blake2b(key + w.encode(), digest_size=8).digest())
        if load.get(preferred, 0) <= load.get(least, 0) + self.slack:
            return preferred
        return least
