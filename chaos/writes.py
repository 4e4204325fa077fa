"""The fleet's decisions as etcd committed them, recorded into a run's history.

:func:`record_writes` watches the cluster's ``actions/``, ``scale/``, ``workers/`` and ``leader/`` keys from
the run's start and appends one ``write`` record per change: ``key`` (below ``/fleetward/<cluster>/``),
``op`` (put or delete), ``revision`` (etcd's: the order in which the cluster committed them, whatever the
clocks say) and ``value`` (the JSON, or null). Only what a quorum committed is there, so a checker reads
what the fleet *did*, not what a partitioned process believed it did: every supervisor action carries its
issuer and ``term`` (the election revision it was fenced with), every scale decision its leader and
``term``. The distributed checkers (:mod:`fleetward.chaos.distributed`) read them.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from fleetward.fleet.errors import StoreError
from fleetward.fleet.etcd import StateStore
from fleetward.fleet.keys import Keys

__all__ = ["RECORDED", "record_writes"]

RECORDED = ("actions/", "scale/", "workers/", "leader/")


async def record_writes(store: StateStore, keys: Keys, history: Any, *, start_revision: int) -> None:
    """Append a ``write`` record for every change under :data:`RECORDED` from ``start_revision``, until
    cancelled. A lost watch is resumed from the next revision (the store does it), so none is missed."""
    revision = start_revision
    while True:
        try:
            async for ev in store.watch_prefix(keys.root, start_revision=revision):
                revision = ev.revision + 1
                key = ev.key.removeprefix(keys.root)
                if not key.startswith(RECORDED):
                    continue
                value = None
                if ev.kind == "put":
                    with contextlib.suppress(ValueError):
                        value = json.loads(ev.value)
                history.add("write", key=key, op=ev.kind, revision=ev.revision, value=value)
        except StoreError:
            continue  # etcd was out of reach of the runner: resume where it stopped
