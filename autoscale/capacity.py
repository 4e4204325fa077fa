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
    """A request meets the SLA when its TTFT and its mean inter-token latency are both within target. The TTFT
    target may grow with the prompt (``ttft_per_1k_s`` per 1,000 prompt tokens on top of ``ttft_s``), as
    long-context SLOs are written: a 32k-token prompt cannot have its first token as soon as a 200-token one."""

    ttft_s: float = 2.0
    itl_s: float = 0.05
    ttft_per_1k_s: float = 0.0

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.itl_s <= 0 or self.ttft_per_1k_s < 0:
            raise ConfigError(f"SLA targets must be positive: ttft {self.ttft_s} s, itl {self.itl_s} s, ttft per "
                              f"1k prompt tokens {self.ttft_per_1k_s} s")

    def ttft_for(self, prompt_tokens: float) -> float:
        """The TTFT target of a request with ``prompt_tokens``."""
        return self.ttft_s + self.ttft_per_1k_s * prompt_tokens / 1000.0

    def base_ttft(self, ttft: float, prompt_tokens: float) -> float:
        """``ttft`` of a request with ``prompt_tokens``, scaled to the base target ``ttft_s``: what a capacity point
        records, so that it compares with ``ttft_s`` whatever the prompt (itself without a per-token target)."""
        return ttft * self.ttft_s / self.ttft_for(prompt_tokens)

    def only(self, slos: Sequence[str]) -> Sla:
        """The same targets for ``slos``; the others never missed (an infinite target)."""
        return Sla(self.ttft_s if "ttft" in slos else math.inf, self.itl_s if "itl" in slos else math.inf,
                   self.ttft_per_1k_s if "ttft" in slos else 0.0)

    def describe(self) -> str:
        per = f" + {self.ttft_per_1k_s:g} s per 1k prompt tokens" if self.ttft_per_1k_s else ""
        return f"TTFT {self.ttft_s:g} s{per}, ITL {self.itl_s * 1000:g} ms"


@dataclass(frozen=True, slots=True)
class CapacityPoint:
    rate: float  # requests/s offered to one worker
    # p99 TTFT; measured against an SLA per prompt token (Sla.ttft_per_1k_s), each request's TTFT is first
    # scaled to the base target (x ttft_s / its own target), so the point compares with ttft_s either way
    ttft_p99: float
    itl_p99: float


@dataclass(frozen=True)
class CapacityModel:
    points: tuple[CapacityPoint, ...]  # by rising rate
    startup_s: float
    mean_input: float | None = None  # the request mix the points were measured at (tokens), when known
    mean_output: float | None = None
    # What the work costs one worker, in its units (``fleetward profile`` measures both): prompt tokens/s
    # computed alone, and seconds of a full batch's step per output token (the step over the batch size).
    prefill_tokens_per_s: float | None = None
    decode_s_per_token: float | None = None
    ttft_per_1k_s: float = 0.0  # the points' TTFT was scaled to the base target of an SLA per prompt token

    def __post_init__(self) -> None:
        if not self.points:
            raise ConfigError("a capacity model needs at least one measured point")
        if any(b.rate <= a.rate for a, b in itertools.pairwise(self.points)):
            raise ConfigError("capacity points must be at strictly rising rates")

    def _meets(self, p: CapacityPoint, sla: Sla) -> bool:
        return p.ttft_p99 <= sla.ttft_s and p.itl_p99 <= sla.itl_s

    def max_rate(self, sla: Sla) -> float:
        """The highest per-worker load that meets ``sla``, interpolated where the latency crosses the target."""
        if math.isfinite(sla.ttft_s) and sla.ttft_per_1k_s != self.ttft_per_1k_s:
            raise ConfigError(f"this capacity model's TTFT was measured against {self.ttft_per_1k_s:g} s per 1k prompt "
                              f"tokens, the SLA asks for {sla.ttft_per_1k_s:g}: profile again with --ttft-per-1k "
                              f"{sla.ttft_per_1k_s:g}", field="autoscale.ttft_per_1k_s")
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
            raise ConfigError(f"no measured load meets the SLA ({sla.describe()}): at {low.rate:g} req/s one worker "
                              f"gives p99 TTFT {low.ttft_p99:.3f} s and ITL {low.itl_p99 * 1000:.1f} ms"
                              f"{self._achievable(low, sla)}")
        return best

    def request_cost(self, mean_input: float, mean_output: float) -> float | None:
        """Seconds of one worker's time a request of this mix costs (its prompt's prefill plus its share of
        decode steps); None without the work model."""
        if not self.prefill_tokens_per_s or not self.decode_s_per_token:
            return None
        return mean_input / self.prefill_tokens_per_s + mean_output * self.decode_s_per_token

    def relative_cost(self, mean_input: float, mean_output: float) -> float:
        """What a request of this mix costs against one of the mix the points were measured at: the factor by
        which the requests/s one worker carries shrink (2.0: half as many). 1.0 when either mix or the work
        model is not known."""
        if mean_input <= 0 or self.mean_input is None or self.mean_output is None:
            return 1.0
        now, then = self.request_cost(mean_input, mean_output), self.request_cost(self.mean_input, self.mean_output)
        return now / then if now is not None and then else 1.0

    def _achievable(self, low: CapacityPoint, sla: Sla) -> str:
        """What to ask for instead, when the lowest load misses the SLA."""
        if low.itl_p99 > sla.itl_s:
            return f"; the ITL target is below what one worker gives: {low.itl_p99 * 1000:.0f} ms or more is achievable"
        mix = f" for prompts of {self.mean_input:.0f} tokens on average" if self.mean_input else ""
        text = f"; a TTFT target of {low.ttft_p99:.2f} s or more is achievable{mix}"
        if self.mean_input and self.mean_input >= 1000 and not sla.ttft_per_1k_s:
            per_1k = math.ceil(10 * low.ttft_p99 / (self.mean_input / 1000)) / 10
            text += (f", or a target per prompt token, as long-context SLOs are written: --ttft-per-1k {per_1k:g} "
                     f"(TTFT {sla.ttft_s:g} s + {per_1k:g} s per 1,000 prompt tokens; autoscale.ttft_per_1k_s)")
        return text

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
        if self.ttft_per_1k_s:
            body["ttft_per_1k_s"] = self.ttft_per_1k_s
        if self.prefill_tokens_per_s is not None and self.decode_s_per_token is not None:
            body["work"] = {"prefill_tokens_per_s": self.prefill_tokens_per_s,
                            "decode_s_per_token": self.decode_s_per_token}
        return json.dumps(body, indent=1)

    @classmethod
    def from_points(cls, points: Sequence[CapacityPoint], startup_s: float) -> CapacityModel:
        return cls(tuple(sorted(points, key=lambda p: p.rate)), startup_s)

    @classmethod
    def load(cls, path: Path) -> CapacityModel:
        """A model from its JSON: ``startup_s``, ``points`` and, optionally, the request mix the points were
        measured at (``mean_input``, ``mean_output``: tokens per request) and the work model (``work``:
        ``prefill_tokens_per_s``, ``decode_s_per_token``). A file without them (older ``fleetward profile``)
        plans in requests/s only."""
        try:
            data = json.loads(path.read_text())
            model = cls.from_points([CapacityPoint(**p) for p in data["points"]], float(data["startup_s"]))
            mix = [None if data.get(k) is None else float(data[k]) for k in ("mean_input", "mean_output")]
            work = data.get("work") or {}
            costs = [None if work.get(k) is None else float(work[k]) for k in ("prefill_tokens_per_s",
                                                                                "decode_s_per_token")]
            per_1k = float(data.get("ttft_per_1k_s") or 0.0)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{path}: not a capacity model ({exc})") from exc
        if any(v is not None and v <= 0 for v in mix):
            raise ConfigError(f"{path}: mean_input and mean_output are tokens per request: positive")
        if any(v is not None and v <= 0 for v in costs):
            raise ConfigError(f"{path}: work.prefill_tokens_per_s and work.decode_s_per_token must be positive")
        return dataclasses.replace(model, mean_input=mix[0], mean_output=mix[1], prefill_tokens_per_s=costs[0],
                                   decode_s_per_token=costs[1], ttft_per_1k_s=per_1k)


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
