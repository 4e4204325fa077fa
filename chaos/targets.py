"""Which components a fault hits: the one resolver of :class:`~fleetward.chaos.fault.Target` selectors.

:func:`resolve` turns a selector into concrete ids within a universe (every id of the target's kind in
the fleet). Ids may be globs (``*->etcd``). A selector naming anything outside the universe, or asking for
more than it holds, raises :class:`TargetError`: never touching what is not the fleet's is a safety rule.
Picks: ``all``; ``first`` (the lowest ids); ``random`` (from ``rng``: the experiment's seed);
``serving`` (the most requests in flight, from ``load``; ``first`` without it). ``busy`` ids (faulted by
another activity right now) are passed over while enough others remain.
"""

from __future__ import annotations

import fnmatch
import random
from collections.abc import Collection, Iterable, Mapping, Sequence

from fleetward.chaos.fault import Target
from fleetward.fleet.errors import FleetwardError

__all__ = ["TargetError", "match_ids", "resolve"]


class TargetError(FleetwardError, ValueError):
    """A target outside the fleet, or a pick the fleet cannot satisfy."""


def match_ids(ids: Iterable[str], universe: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the ids of ``universe`` that ``ids`` name, globs such as ``*->etcd`` allowed; the ids naming none)."""
    found: list[str] = []
    missing: list[str] = []
    for i in ids:
        hits = fnmatch.filter(universe, i) if any(c in i for c in "*?[") else [i] if i in universe else []
        if not hits:
            missing.append(i)
        found += [h for h in hits if h not in found]
    return found, missing


def resolve(target: Target, universe: Sequence[str] | None, *, rng: random.Random,
            busy: Collection[str] = (), load: Mapping[str, int] | None = None) -> list[str]:
    """Concrete ids for ``target`` (see the module docstring). ``universe`` None: the kind cannot be
    enumerated here, so only ids named in the target are taken (as they are)."""
    kind = target.kind
    if universe is None:
        if target.ids:
            return list(target.ids)
        raise TargetError(f"cannot pick {kind}s here: name them in target.ids")
    if target.ids:
        found, outside = match_ids(target.ids, universe)
        if outside:
            raise TargetError(f"{', '.join(outside)} not in the fleet ({kind}s: {', '.join(universe) or 'none'})")
        return found
    if not universe:
        raise TargetError(f"the fleet has no {kind} to target")
    if target.pick == "all":
        return list(universe)
    if target.count > len(universe):
        raise TargetError(f"the fleet has {len(universe)} {kind}(s), not {target.count}")
    free = [k for k in sorted(universe) if k not in busy] or sorted(universe)
    if target.pick == "serving" and load is not None:
        return sorted(free, key=lambda w: (-load.get(w, 0), w))[:target.count]
    if target.pick in ("first", "serving"):
        return free[:target.count]
    return sorted(rng.sample(free, min(target.count, len(free))))
