"""The worker model: what a worker is (spec), what etcd says about it (record, health)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Literal

__all__ = ["ROLES", "HealthRecord", "HealthState", "Role", "WorkerRecord", "WorkerSpec"]

Role = Literal["aggregated", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("aggregated", "prefill", "decode")


class HealthState(StrEnum):
    """The supervisor's verdict on a worker (``health/<id>`` in etcd)."""

    STARTING = "starting"
    READY = "ready"
    SUSPECT = "suspect"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
    RESTARTING = "restarting"
    QUARANTINED = "quarantined"
    DEAD = "dead"

    @property
    def is_routable(self) -> bool:
        """Whether a router may send new work to a worker in this state."""
        return self in (HealthState.READY, HealthState.SUSPECT)


@dataclass(frozen=True)
class WorkerSpec:
    """What to start: one worker process (its backend decides how)."""

    id: str
    host: str
    port: int
    model: str
    role: Role = "aggregated"
    node: str = "local"
    gpus: tuple[int, ...] = ()
    cpus: tuple[int, ...] = ()  # cores its compute threads are bound to (CPU backends; see fleet.procs.spread_cores)
    advertise_url: str | None = None  # what others use (e.g. a fault proxy in front); default: bind_url
    # The address other hosts reach it at, when it listens on loopback or on every address (advertise_host):
    # the URL is then that host and its port (which a restart may change).
    advertise_host: str | None = None

    @property
    def bind_url(self) -> str:
        """Where the worker process itself listens."""
        return f"http://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """Where routers and the supervisor reach the worker (registered in etcd)."""
        if self.advertise_url:
            return self.advertise_url
        return f"http://{self.advertise_host}:{self.port}" if self.advertise_host else self.bind_url


@dataclass(frozen=True)
class WorkerRecord:
    """``workers/<id>``: written by the node agent, bound to its lease."""

    id: str
    url: str
    role: Role
    model: str
    node: str
    backend: str
    gpus: tuple[int, ...] = ()
    started_at: float = 0.0
    pid: int | None = None  # the server process (None: known by URL only)
    pids: tuple[int, ...] = ()  # its whole process tree when registered (vLLM: API server, EngineCore, ...)
    tokenizer: str | None = None  # its vocabulary (a built-in name or a model folder), for routers to detokenize
    # What decides its greedy numerics besides the model, so canaries compare it with its like only: the
    # engine ("vllm 0.32.0", from GET /version) and the device ("NVIDIA H100 80GB HBM3"); None: not known.
    engine: str | None = None
    device: str | None = None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> WorkerRecord:
        body: dict[str, Any] = json.loads(raw)
        body["gpus"] = tuple(body.get("gpus", ()))
        body["pids"] = tuple(body.get("pids", ()))
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in body.items() if k in known})


@dataclass(frozen=True)
class HealthRecord:
    """``health/<id>``: the supervisor's verdict, with why and which detector said so."""

    state: HealthState
    reason: str = ""
    detector: str = ""
    since: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        body = {"state": self.state.value, "reason": self.reason, "detector": self.detector,
                "since": self.since, **self.extra}
        return json.dumps(body, separators=(",", ":")).encode()

    @property
    def retired(self) -> bool:
        """Retired by the autoscaler and its drain over: ``draining``, ``cordoned``, its ``drain`` (``by``
        autoscaler) past its deadline and moves. Its streams finished or moved; on Kubernetes its sidecar's
        readiness fails (so the ReplicaSet deletes its pod first) and the actuator lowers the replicas for it."""
        if self.state is not HealthState.DRAINING or not self.extra.get("cordoned"):
            return False
        drain = self.extra.get("drain") or {}
        return drain.get("by") == "autoscaler" and drain.get("deadline") is None and drain.get("moving_until") is None

    @classmethod
    def from_json(cls, raw: bytes) -> HealthRecord:
        body: dict[str, Any] = json.loads(raw)
        state = HealthState(body.pop("state"))
        return cls(state=state, reason=body.pop("reason", ""), detector=body.pop("detector", ""),
                   since=float(body.pop("since", 0.0)), extra=body)
