"""What one worker can carry: measured latency against load, and how long a new worker takes to serve.

A :class:`CapacityModel` is a table of points (requests/s offered to one worker → p99 TTFT, p99 of the
requests' mean ITL), measured by driving a worker at rising load, plus the worker's measured start-up
time and, when known, the request mix it was measured at (mean prompt and output tokens). The planner
reads two things off it: the highest load that meets the SLA (interpolated between points) and how far
ahead to scale (the start-up time).

A :class:`PoolCapacity` is what one worker of a pool carries in the pool's own unit of work, judged on the
SLOs that apply to the pool (:data:`SLOS`):

- ``aggregated``: requests/s, against TTFT and ITL (the capacity model as measured);
- ``prefill``: prompt tokens/s, against TTFT (the worker only computes prompts; ITL is not its business);
- ``decode``: output tokens/s, against ITL (the prefill pool makes the TTFT; a decode worker adds its first
  step to it).

It is either measured on a worker of that role (:meth:`PoolCapacity.measured`: the points' requests/s times
the mix's tokens per request) or derived from an aggregated model (:meth:`PoolCapacity.derived`):

- **decode**: the aggregated points' ITL, ignoring TTFT, at ``rate x mean_output`` output tokens/s. An
  aggregated worker's ITL includes the stalls its prompts' prefill chunks add to every step, which a
  decode-only worker does not have, so this is a lower bound on what a decode worker carries: close when
  prompts are short next to outputs, low (safe) when they are long.
- **prefill**: the aggregated worker's prefill share. At its lowest measured load its p99 TTFT ``s`` is about
  one prompt's prefill (plus a decode step and the network), so at rate ``r`` prefill takes ``r x s`` of its
  time; a worker that only prefills computes prompts at up to ``mean_input / s`` tokens/s. Queueing bounds
  how close to that it may run within the TTFT target: the curve is an M/D/1 queue's, p99 TTFT
  ``s x (1 + ln(100) x rho / (2 (1 - rho)))`` at utilisation ``rho`` (an exponential tail on the mean wait).
  It ignores that an engine batches several short prompts into one step (it then carries more) and that
  attention cost grows faster than linearly with prompt length (longer prompts than the profile's are
  dearer than this says).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from fleetward.fleet.errors import ConfigError
from fleetward.fleet.worker import Role

__all__ = ["SLOS", "UNITS", "CapacityModel", "CapacityPoint", "PoolCapacity", "Sla"]

SLOS: dict[str, tuple[str, ...]] = {"aggregated": ("ttft", "itl"), "prefill": ("ttft",), "decode": ("itl",)}
"""The SLOs each pool (by role) is judged on."""
UNITS: dict[str, str] = {"aggregated": "req/s", "prefill": "prompt tok/s", "decode": "output tok/s"}
"""Each pool's unit of work, per second."""


@dataclass(frozen=True, slots=True)
class Sla:
    """A request meets the SLA when its TTFT and its mean inter-token latency are both within target."""

    ttft_s: float = 2.0
    itl_s: float = 0.05

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.itl_s <= 0:
            raise ConfigError(f"SLA targets must be positive: ttft {self.ttft_s} s, itl {self.itl_s} s")

    def only(self, slos: Sequence[str]) -> Sla:
        """The same targets for ``slos``; the others never missed (an infinite target)."""
        return Sla(self.ttft_s if "ttft" in slos else math.inf, self.itl_s if "itl" in slos else math.inf)


@dataclass(frozen=True, slots=True)
class CapacityPoint:
    rate: float  # requests/s offered to one worker
    ttft_p99: float
    itl_p99: float


@dataclass(frozen=True)
class CapacityModel:
    points: tuple[CapacityPoint, ...]  # by rising rate
    startup_s: float
    mean_input: float | None = None  # the request mix the points were measured at (tokens), when known
    mean_output: float | None = None

    def __post_init__(self) -> None:
        if not self.points:
            raise ConfigError("a capacity model needs at least one measured point")
        if any(b.rate <= a.rate for a, b in itertools.pairwise(self.points)):
            raise ConfigError("capacity points must be at strictly rising rates")

    def _meets(self, p: CapacityPoint, sla: Sla) -> bool:
        return p.ttft_p99 <= sla.ttft_s and p.itl_p99 <= sla.itl_s

    def max_rate(self, sla: Sla) -> float:
        """The highest per-worker load that meets ``sla``, interpolated where the latency crosses the target."""
        best = 0.0
        prev: CapacityPoint | None = None
        for p in self.points:
            if not self._meets(p, sla):
                if prev is not None:
                    best = prev.rate + (p.rate - prev.rate) * min(
                        _fraction(prev.ttft_p99, p.ttft_p99, sla.ttft_s), _fraction(prev.itl_p99, p.itl_p99, sla.itl_s))
                break
            best, prev = p.rate, p
        if best <= 0:
            low = self.points[0]
            if math.isinf(sla.itl_s) or math.isinf(sla.ttft_s):  # a pool judged on one SLO (PoolCapacity)
                raise ConfigError(f"no load meets the SLA ({_targets(sla)}): at {low.rate:g}/s one worker gives "
                                  f"{_latencies(low, sla)}; relax the target")
            raise ConfigError(f"no measured load meets the SLA (TTFT {sla.ttft_s} s, ITL {sla.itl_s * 1000:g} ms): "
                              f"at {low.rate:g} req/s one worker gives p99 TTFT {low.ttft_p99:.3f} s and ITL "
                              f"{low.itl_p99 * 1000:.1f} ms; relax the targets")
        return best

    def itl_at(self, rate: float) -> float:
        """The p99 ITL one worker gives at ``rate`` (linear between points, flat beyond them)."""
        return self._at(rate, lambda p: p.itl_p99)

    def ttft_at(self, rate: float) -> float:
        """The p99 TTFT one worker gives at ``rate`` (linear between points, flat beyond them)."""
        return self._at(rate, lambda p: p.ttft_p99)

    def _at(self, rate: float, value: Callable[[CapacityPoint], float]) -> float:
        pts = self.points
        if rate <= pts[0].rate:
            return value(pts[0])
        for a, b in itertools.pairwise(pts):
            if rate <= b.rate:
                return value(a) + (value(b) - value(a)) * (rate - a.rate) / (b.rate - a.rate)
        return value(pts[-1])

    def to_json(self) -> str:
        body: dict[str, object] = {"startup_s": self.startup_s, "points": [asdict(p) for p in self.points]}
        if self.mean_input is not None:
            body["mean_input"] = self.mean_input
        if self.mean_output is not None:
            body["mean_output"] = self.mean_output
        return json.dumps(body, indent=1)

    @classmethod
    def from_points(cls, points: Sequence[CapacityPoint], startup_s: float) -> CapacityModel:
        return cls(tuple(sorted(points, key=lambda p: p.rate)), startup_s)

    @classmethod
    def load(cls, path: Path) -> CapacityModel:
        """A model from its JSON: ``startup_s``, ``points`` and, optionally, the request mix the points were
        measured at (``mean_input``, ``mean_output``: tokens per request)."""
        try:
            data = json.loads(path.read_text())
            model = cls.from_points([CapacityPoint(**p) for p in data["points"]], float(data["startup_s"]))
            mix = [None if data.get(k) is None else float(data[k]) for k in ("mean_input", "mean_output")]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}: not a capacity model ({exc})") from exc
        if any(v is not None and v <= 0 for v in mix):
            raise ConfigError(f"{path}: mean_input and mean_output are tokens per request: positive")
        return dataclasses.replace(model, mean_input=mix[0], mean_output=mix[1])


@dataclass(frozen=True)
class PoolCapacity:
    """What one worker of a pool carries, in the pool's unit of work (:data:`UNITS`), judged on the SLOs that
    apply to it (:data:`SLOS`); see the module docstring for how it is obtained."""

    role: Role
    curve: CapacityModel  # rates in the pool's unit; only the applicable SLOs' columns matter
    source: str  # how it was obtained, for logs and reasons
    tokens_per_request: float | None = None  # the mix it was measured at: prompt (prefill) or output (decode)

    @property
    def unit(self) -> str:
        return UNITS[self.role]

    @property
    def startup_s(self) -> float:
        return self.curve.startup_s

    def sla(self, sla: Sla) -> Sla:
        return sla.only(SLOS[self.role])

    def max_rate(self, sla: Sla) -> float:
        """The most work (in :attr:`unit`) one worker carries within the SLOs that apply to the pool."""
        if self.role == "aggregated":
            return self.curve.max_rate(sla)
        try:
            return self.curve.max_rate(self.sla(sla))
        except ConfigError as exc:
            raise ConfigError(f"{self.role} pool ({self.source}): {exc}") from exc

    def latency_at(self, rate: float) -> float:
        """The p99 latency of the pool's own SLO one worker gives at ``rate``: TTFT for a prefill pool, ITL
        otherwise (for an aggregated pool, ITL: what the Dynamo-style correction compares)."""
        return self.curve.ttft_at(rate) if self.role == "prefill" else self.curve.itl_at(rate)

    @classmethod
    def measured(cls, model: CapacityModel, role: Role) -> PoolCapacity:
        """``model`` was measured on a worker of ``role``: a prefill worker driven with ``max_tokens`` 1 at
        prompts of ``mean_input`` tokens; a decode worker behind a prefill pool at answers of ``mean_output``."""
        if role == "aggregated":
            return cls(role, model, "measured")
        tokens = _mix(model, role)
        return cls(role, _scaled(model, tokens), f"measured on a {role} worker at {tokens:g} tokens per request",
                   tokens)

    @classmethod
    def derived(cls, model: CapacityModel, role: Role) -> PoolCapacity:
        """From an aggregated worker's ``model`` (module docstring: how, and what it leaves out)."""
        if role == "aggregated":
            return cls(role, model, "measured")
        tokens = _mix(model, role)
        if role == "decode":
            return cls(role, _scaled(model, tokens), "derived from the aggregated model's ITL", tokens)
        s = model.points[0].ttft_p99
        if s <= 0:
            raise ConfigError("a prefill pool's capacity cannot be derived from this aggregated model: its lowest "
                              "load shows no TTFT (a flat per_worker_rps model?); give autoscale.prefill_capacity",
                              field="autoscale.prefill_capacity")
        full = tokens / s  # prompt tokens/s of a worker that does nothing but compute prompts, back to back
        points = [CapacityPoint(rho * full, s * (1 + _P99_WAIT * rho / (2 * (1 - rho))), 0.0)
                  for rho in (k / 100 for k in range(2, 100, 2))]
        return cls(role, CapacityModel(tuple(points), model.startup_s),
                   f"derived from the aggregated model's prefill share: {full:.0f} prompt tok/s at most", tokens)


_P99_WAIT = math.log(100)  # p99 over mean of an exponentially distributed wait


def _mix(model: CapacityModel, role: Role) -> float:
    tokens = model.mean_input if role == "prefill" else model.mean_output
    if tokens is None:
        key = "mean_input" if role == "prefill" else "mean_output"
        raise ConfigError(f"a {role} pool's capacity is in {UNITS[role]}, and this capacity model does not say "
                          f"the request mix it was measured at: add \"{key}\" (tokens per request) to its file, "
                          f"or give autoscale.{role}_capacity", field=f"autoscale.{role}_capacity")
    return tokens


def _scaled(model: CapacityModel, tokens: float) -> CapacityModel:
    """``model`` with its requests/s turned into tokens/s at ``tokens`` per request."""
    return CapacityModel(tuple(dataclasses.replace(p, rate=p.rate * tokens) for p in model.points), model.startup_s)


def _targets(sla: Sla) -> str:
    return ", ".join(x for x in (f"TTFT {sla.ttft_s} s" if math.isfinite(sla.ttft_s) else "",
                                 f"ITL {sla.itl_s * 1000:g} ms" if math.isfinite(sla.itl_s) else "") if x)


def _latencies(p: CapacityPoint, sla: Sla) -> str:
    return " and ".join(x for x in (f"p99 TTFT {p.ttft_p99:.3f} s" if math.isfinite(sla.ttft_s) else "",
                                    f"ITL {p.itl_p99 * 1000:.1f} ms" if math.isfinite(sla.itl_s) else "") if x)


def _fraction(a: float, b: float, target: float) -> float:
    """Where between a (at fraction 0) and b (at 1) a rising latency crosses ``target`` (1 if it does not)."""
    if b <= target or b <= a:
        return 1.0
    return max(0.0, min(1.0, (target - a) / (b - a)))
