"""What an agent acts on, signed by whoever holds the admin token, and checked by the agent: actions issued by
the controller, and the restart commands of servers it adopts.

Anyone who can write to etcd could otherwise queue ``actions/<node>/<id>`` with ``"status": "pending"`` and
have a node's agent restart or stop a worker, around the control API's bearer token. The leader signs each
action it issues with a key derived from the admin token (HMAC-SHA256 over the action as issued: every field
but ``status`` and the signature itself), and an agent that holds the token carries out only actions whose
signature checks, addressed to its node, issued within ``max_age_s`` and not carried out before (a copy of an
old signed action put back as pending is a replay). docs/operations.md ("Signed actions") says what this guards.

An adopted server's ``attach/<id>`` record carries a ``restart_command`` that its node's agent runs (as root
on most hosts). :class:`AttachSigner` signs the record, bound to its worker id, when it is written
(``fleetward up`` from the fleet file, ``fleetward worker add``); an agent that holds the token runs the command
of a signed record only, and adopts a server whose record is unsigned or forged without its command (it is
drained and left for an operator when it fails), counted and logged.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
from typing import Any

import orjson

__all__ = ["ActionSigner", "AttachSigner"]

_CONTEXT = b"fleetward agent action v1"
_ATTACH_CONTEXT = b"fleetward attach record v1"
_UNSIGNED = ("status", "signature")


class ActionSigner:
    """Signs and checks agent actions with a key derived from ``token`` (the admin token)."""

    def __init__(self, token: str, *, max_age_s: float = 600.0, remember: int = 4096) -> None:
        if not token:
            raise ValueError("signing actions needs the admin token")
        self._key = hmac.new(token.encode(), _CONTEXT, hashlib.sha256).digest()
        self.max_age_s = max_age_s
        self._seen: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._remember = remember

    def _mac(self, body: dict[str, Any]) -> str:
        issued = {k: v for k, v in body.items() if k not in _UNSIGNED}
        return hmac.new(self._key, orjson.dumps(issued, option=orjson.OPT_SORT_KEYS), hashlib.sha256).hexdigest()

    def sign(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with its signature."""
        return {**body, "signature": self._mac(body)}

    def refusal(self, body: dict[str, Any], *, node: str, now: float) -> str | None:
        """Why ``body`` must not be carried out on ``node`` at wall time ``now``, or None when it may.

        A body that passes is remembered, so the same action (id and issue time) passes once.
        """
        signature = body.get("signature")
        if not isinstance(signature, str) or not hmac.compare_digest(signature.encode(), self._mac(body).encode()):
            return "not signed by a controller that holds the admin token"
        if body.get("node") != node:
            return f"addressed to node {body.get('node')!r}, not {node!r}"
        issued_at = body.get("issued_at")
        if not isinstance(issued_at, int | float) or now - issued_at > self.max_age_s:
            return f"issued more than {self.max_age_s:.0f}s ago"
        seen = (str(body.get("id")), repr(issued_at))
        if seen in self._seen:
            return "carried out before (a replay of an action already run)"
        self._seen[seen] = None
        while len(self._seen) > self._remember:
            self._seen.popitem(last=False)
        return None


class AttachSigner:
    """Signs and checks ``attach/<id>`` records with a key derived from ``token`` (the admin token)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("signing attach records needs the admin token")
        self._key = hmac.new(token.encode(), _ATTACH_CONTEXT, hashlib.sha256).digest()

    def _mac(self, worker_id: str, body: dict[str, Any]) -> str:
        record = {k: v for k, v in body.items() if k != "signature"}
        signed = orjson.dumps({"worker": worker_id, "record": record}, option=orjson.OPT_SORT_KEYS)
        return hmac.new(self._key, signed, hashlib.sha256).hexdigest()

    def sign(self, worker_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` (the record of ``attach/<worker_id>``) with its signature."""
        return {**body, "signature": self._mac(worker_id, body)}

    def signed(self, worker_id: str, body: dict[str, Any]) -> bool:
        """Whether ``body`` was signed, as the record of ``attach/<worker_id>``, with this token."""
        signature = body.get("signature")
        return isinstance(signature, str) and hmac.compare_digest(signature.encode(),
                                                                   self._mac(worker_id, body).encode())
