"""Signals: what a detector says about a worker, the one vocabulary every detector speaks.

A detector never changes a worker's health itself: it emits :class:`Signal` values, and the health state
machine (:mod:`fleetward.supervisor.health`) turns them into verdicts and actions with hysteresis.
Detectors that run on a worker's host (process exit, engine frozen, GPU health) publish their signals to
etcd under ``signals/<worker>/<detector>`` so the supervisor leader (on any host) sees them. Detectors
that run in the controller (stream progress, canary, metrics) feed it directly.

Severities:

- ``ok``: the detector sees nothing wrong (clears an earlier signal of the same detector);
- ``degraded``: slow but working (e.g. thermal throttling): the worker becomes suspect, not restarted;
- ``suspect``: maybe broken; the controller confirms (a canary) before acting;
- ``fatal``: certainly broken (process exited, engine stopped, fatal GPU error): acted on at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

__all__ = ["Severity", "Signal"]


class Severity(StrEnum):
    OK = "ok"
    DEGRADED = "degraded"
    SUSPECT = "suspect"
    FATAL = "fatal"


@dataclass(frozen=True)
class Signal:
    worker: str
    detector: str
    severity: Severity
    reason: str = ""
    ts: float = 0.0  # wall clock, when the detector saw it
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps({"worker": self.worker, "detector": self.detector, "severity": self.severity.value,
                           "reason": self.reason, "ts": self.ts, **self.extra}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Signal:
        body: dict[str, Any] = json.loads(raw)
        return cls(worker=body.pop("worker"), detector=body.pop("detector"),
                   severity=Severity(body.pop("severity")), reason=body.pop("reason", ""),
                   ts=float(body.pop("ts", 0.0)), extra=body)
