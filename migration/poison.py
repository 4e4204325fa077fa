"""Poison requests: a request that several workers failed while serving it is not sent to another.

Some inputs kill the engine that serves them (vLLM has had such bugs: a prompt that crashes a kernel, a
grammar that never compiles). Migration would carry such a request from worker to worker and take the fleet
down one worker at a time. So once ``routing.poison_workers`` distinct workers failed *while serving* a
request, it is answered with an error that says so instead of being sent to another
(:func:`poison_error`): counted in ``fleetward_router_migration_failures_total{reason="poison"}``, logged
and published (the ``poison`` event) with the request's id, a hash of its body and the workers.

What counts as failing while serving it (:func:`broke_under`): the connection broke or the stream ended
without a finish, an in-band or HTTP 5xx error (not 503, a worker's load), a chunk that makes no sense, and
the router's own abort of a worker that stalled or was judged unhealthy, dead or restarting under it. What
does not: a worker that could not be reached (it never took the request), a refusal of the request itself
(a 4xx, the client's answer), a planned move, a worker taken away by its lease (a partition lapses leases)
or quarantined for its GPU.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

from fleetward.migration.upstream import UpstreamError
from fleetward.migration.wire import RouterError

__all__ = ["body_digest", "broke_under", "named", "poison_error"]

# The router's own aborts that are a worker failing under the request (router._abort_stalled, _evacuate).
_FAILED_UNDER = ("stalled:", "worker unhealthy", "worker dead", "worker restarting")


def broke_under(exc: UpstreamError) -> bool:
    """Whether the worker failed while it was serving the request (see the module docstring)."""
    if exc.kind in ("reset", "eof", "bad_chunk"):
        return True
    if exc.kind in ("status", "error_event"):
        return exc.status is None or (exc.status >= 500 and exc.status != 503)
    if exc.kind == "aborted":
        return exc.message.startswith(_FAILED_UNDER)
    return False


def body_digest(body: Mapping[str, Any] | bytes) -> str:
    """What identifies a request's body in logs and events without showing it: the SHA-256 of its JSON with
    sorted keys, 16 hex digits. A body as bytes (a request passed through) is read as JSON first; one that is
    not a JSON object is hashed as it came."""
    if isinstance(body, bytes):
        try:
            parsed = orjson.loads(body) if body else {}
        except orjson.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            return hashlib.sha256(body).hexdigest()[:16]
        body = parsed
    return hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def named(broke: Mapping[str, str]) -> str:
    """The workers that failed under a request and why, as the log and the answer say them."""
    return "; ".join(f"{w}: {why}" for w, why in broke.items())


def poison_error(request_id: str, digest: str, broke: Mapping[str, str]) -> RouterError:
    """The answer to a poison request: 500 (no Retry-After: trying it again would do the same harm), naming
    the workers that failed under it and why."""
    return RouterError(500, f"{len(broke)} workers failed while serving this request ({named(broke)}); it is not "
                       "sent to another, as it may be what breaks them (a poison request). Request "
                       f"{request_id}, body sha256 {digest}.")
