"""Where a request goes: a small interface, and the policies a router can be configured with.

:class:`RoutingPolicy` picks one worker among candidates the router already filtered (healthy, ready,
serving the model, not excluded for this request). :data:`POLICIES` holds them by the name the config
uses (``routing.policy``):

- ``least_loaded_affinity`` (the default, :class:`LeastLoadedAffinity`): a prompt goes to the worker
  its prefix hashes to (:func:`rendezvous` hashing over the candidates, so the same prefix keeps landing
  on the same worker and its KV prefix cache) unless that worker carries more than ``slack`` requests
  above the least loaded candidate; then the least loaded one wins;
- ``least_loaded`` (:class:`LeastLoaded`): the candidate with the fewest requests in flight.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Protocol

__all__ = ["POLICIES", "LeastLoaded", "LeastLoadedAffinity", "RoutingPolicy", "make_policy", "prefix_key",
           "rendezvous"]


def prefix_key(prompt: Sequence[int] | str, tokens: int = 64) -> bytes:
    """A stable key for a prompt's first ``tokens`` token ids (or characters of a text prompt)."""
    if isinstance(prompt, str):
        return prompt[: tokens * 4].encode()
    return b",".join(str(t).encode() for t in prompt[:tokens])


def rendezvous(candidates: Sequence[str], key: bytes) -> str:
    """The candidate ``key`` hashes to (highest random weight): stable while the candidates stay, and only the
    keys of a worker that leaves move."""
    return max(candidates, key=lambda w: hashlib.blake2b(key + w.encode(), digest_size=8).digest())


class RoutingPolicy(Protocol):
    def choose(self, candidates: Sequence[str], load: Mapping[str, int], key: bytes | None) -> str:
        """One of ``candidates`` (non-empty). ``load`` is in-flight requests per worker."""
        ...


class LeastLoaded:
    def __init__(self, slack: int = 0) -> None:
        self.slack = slack

    def choose(self, candidates: Sequence[str], load: Mapping[str, int], key: bytes | None) -> str:
        return min(candidates, key=lambda w: (load.get(w, 0), w))


class LeastLoadedAffinity(LeastLoaded):
    def __init__(self, slack: int = 4) -> None:
        super().__init__(slack)

    def choose(self, candidates: Sequence[str], load: Mapping[str, int], key: bytes | None) -> str:
        least = super().choose(candidates, load, key)
        if key is None:
            return least
        preferred = rendezvous(candidates, key)
        if load.get(preferred, 0) <= load.get(least, 0) + self.slack:
            return preferred
        return least


POLICIES: dict[str, type[LeastLoaded]] = {"least_loaded_affinity": LeastLoadedAffinity, "least_loaded": LeastLoaded}


def make_policy(name: str, *, slack: int) -> RoutingPolicy:
    """The policy ``routing.policy`` names (the config accepts only names listed in :data:`POLICIES`)."""
    return POLICIES[name](slack)
