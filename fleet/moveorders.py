"""``moves/<id>`` in etcd: planned moves of streams, ordered by the controller, carried out by the routers.

The controller writes an order when a drain's deadline passes with streams open (trigger ``drain``, or
``scale-down`` for an autoscaler's drain) and for ``POST /v1/moves`` (``operator``); every router watches
``moves/`` and moves the streams it holds that match, with their KV (:mod:`fleetward.migration.moves`).
An order lives on a lease of a minute: it is an instruction for now, not a record.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import orjson

__all__ = ["TRIGGERS", "MoveOrderRecord"]

TRIGGERS = ("drain", "scale-down", "operator", "rebalance")


@dataclass(frozen=True, slots=True)
class MoveOrderRecord:
    """Move ``request``, or every stream on ``source``; to ``to`` when it can take them."""

    trigger: str
    request: str | None = None
    source: str | None = None
    to: str | None = None
    issued_by: str = ""
    issued_at: float = 0.0

    def new_id(self) -> str:
        return f"{self.trigger}-{uuid.uuid4().hex[:12]}"

    def to_json(self) -> bytes:
        return orjson.dumps({"trigger": self.trigger, "request": self.request, "from": self.source, "to": self.to,
                             "issued_by": self.issued_by, "issued_at": self.issued_at})

    @classmethod
    def from_json(cls, raw: bytes) -> MoveOrderRecord:
        """Raises ValueError for a malformed order; an unknown trigger reads as ``operator``."""
        body = orjson.loads(raw)
        if not isinstance(body, dict) or not isinstance(body.get("trigger"), str):
            raise ValueError("not a move order")
        trigger = body["trigger"] if body["trigger"] in TRIGGERS else "operator"

        def name(key: str) -> str | None:
            v = body.get(key)
            return v if isinstance(v, str) and v else None

        return cls(trigger, name("request"), name("from"), name("to"), str(body.get("issued_by") or ""),
                   float(body.get("issued_at") or 0.0))
