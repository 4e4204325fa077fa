"""What one worker can carry: measured latency against load, and how long a new worker takes to serve.

A :class:`CapacityModel` is a table of points (requests/s offered to one worker → p99 TTFT, p99 of the
requests' mean ITL), measured by driving a worker at rising load, plus the worker's measured start-up
time. The planner reads two things off it: the highest load that meets the SLA (interpolated between
points) and how far ahead to scale (the start-up time).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from fleetward.fleet.errors import ConfigError

__all__ = ["CapacityModel", "CapacityPoint", "Sla"]


@dataclass(frozen=True, slots=True)
class Sla:
    """A request meets the SLA when its TTFT and its mean inter-token latency are both within target."""

    ttft_s: float = 2.0
    itl_s: float = 0.05

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.itl_s <= 0:
            raise ConfigError(f"SLA targets must be positive: ttft {self.ttft_s} s, itl {self.itl_s} s")


@dataclass(frozen=True, slots=True)
class CapacityPoint:
    rate: float  # requests/s offered to one worker
    ttft_p99: float
    itl_p99: float


@dataclass(frozen=True)
class CapacityModel:
    points: tuple[CapacityPoint, ...]  # by rising rate
    startup_s: float

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
            raise ConfigError(f"no measured load meets the SLA (TTFT {sla.ttft_s} s, ITL {sla.itl_s * 1000:g} ms): "
                              f"at {low.rate:g} req/s one worker gives p99 TTFT {low.ttft_p99:.3f} s and ITL "
                              f"{low.itl_p99 * 1000:.1f} ms; relax the targets")
        return best

    def itl_at(self, rate: float) -> float:
        """The p99 ITL one worker gives at ``rate`` (linear between points, flat beyond them)."""
        pts = self.points
        if rate <= pts[0].rate:
            return pts[0].itl_p99
        for a, b in itertools.pairwise(pts):
            if rate <= b.rate:
                return a.itl_p99 + (b.itl_p99 - a.itl_p99) * (rate - a.rate) / (b.rate - a.rate)
        return pts[-1].itl_p99

    def to_json(self) -> str:
        return json.dumps({"startup_s": self.startup_s, "points": [asdict(p) for p in self.points]}, indent=1)

    @classmethod
    def from_points(cls, points: Sequence[CapacityPoint], startup_s: float) -> CapacityModel:
        return cls(tuple(sorted(points, key=lambda p: p.rate)), startup_s)

    @classmethod
    def load(cls, path: Path) -> CapacityModel:
        try:
            data = json.loads(path.read_text())
            return cls.from_points([CapacityPoint(**p) for p in data["points"]], float(data["startup_s"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}: not a capacity model ({exc})") from exc


def _fraction(a: float, b: float, target: float) -> float:
    """Where between a (at fraction 0) and b (at 1) a rising latency crosses ``target`` (1 if it does not)."""
    if b <= target or b <= a:
        return 1.0
    return max(0.0, min(1.0, (target - a) / (b - a)))
