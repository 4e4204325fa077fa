"""A fault-injectable GPU health source for hosts without GPUs (testbed code, not product).

:class:`FakeGpuSource` implements :class:`~fleetward.supervisor.gpu.GpuHealthSource` and keeps its rules
(events are edges, ``LOST`` is a level, an Xid 79 loses the GPU, ...). A GPU is the one hardware
boundary fleetward may fake; the ``gpu`` fault family acts through this source
(:mod:`fleetward.chaos.faults.gpu`), and the node agent of a test fleet watches it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.errors import FleetwardError
from fleetward.supervisor.gpu import (
    THROTTLE_REASONS,
    XID_DOUBLE_BIT_ECC,
    XID_FALLEN_OFF_THE_BUS,
    GpuEvent,
    GpuEventKind,
    GpuInfo,
    SelftestResult,
    selftest,
    throttle_events,
)

__all__ = ["FakeGpuSource"]


@dataclass
class _FakeGpu:
    info: GpuInfo
    lost: bool = False
    dbe: int = 0
    sbe: int = 0
    throttle: frozenset[str] = frozenset()
    selftest_failure: str | None = None
    pids: set[int] = field(default_factory=set)


class FakeGpuSource:
    """GPUs that fail on command, for hosts without GPUs. Same rules as :class:`NvmlSource`.

    Each fault is stamped with the clock's wall time when injected and returned by the next ``poll``.
    Faithful to the hardware: an Xid 79 also loses the GPU; a lost GPU reports ``LOST`` on every poll,
    ignores further injected faults and fails its self-test until :meth:`clear`; a double-bit ECC error
    logs Xid 48 and raises the DBE count, whichever way it is injected. The self-test of a healthy GPU
    really runs (:func:`selftest` on ``selftest_device``) unless :meth:`fail_selftest` forced a failure.
    """

    def __init__(self, count: int = 1, *, clock: Clock = SYSTEM_CLOCK, selftest_device: str = "cpu",
                 name: str = "Fake GPU") -> None:
        if count < 1:
            raise ValueError(f"a fake GPU host needs at least one GPU, not {count}")
        self._clock = clock
        self._selftest_device = selftest_device
        self._gpus = [_FakeGpu(GpuInfo(i, f"GPU-fa4e0000-0000-4000-8000-{i:012d}", name)) for i in range(count)]
        self._pending: list[GpuEvent] = []
        self._closed = False

    # --- GpuHealthSource

    def gpus(self) -> list[GpuInfo]:
        return [g.info for g in self._gpus]

    def poll(self) -> list[GpuEvent]:
        if self._closed:
            raise FleetwardError("poll() on a closed FakeGpuSource")
        out, self._pending = self._pending, []
        now = self._clock.wall()
        reported = {e.gpu for e in out if e.kind is GpuEventKind.LOST}
        out += [GpuEvent(g.info.index, GpuEventKind.LOST, now, detail="GPU is lost")
                for g in self._gpus if g.lost and g.info.index not in reported]
        return out

    def selftest(self, gpu: int, *, size: int = 256, seed: int = 0) -> SelftestResult:
        g = self._gpu(gpu)
        if g.lost:
            return SelftestResult(f"fake:{gpu}", False, size, seed, 0, None, size * size,
                                  f"GPU {gpu} is lost: nothing to run on")
        if g.selftest_failure is not None:
            return SelftestResult(f"fake:{gpu}", False, size, seed, 0, None, size * size, g.selftest_failure)
        return selftest(self._selftest_device, size=size, seed=seed)

    def processes(self) -> dict[int, frozenset[int]]:
        return {g.info.index: frozenset(g.pids) for g in self._gpus}

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> FakeGpuSource:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # --- faults

    def inject_xid(self, gpu: int, code: int, detail: str = "") -> None:
        g = self._gpu(gpu)
        if g.lost:
            return
        self._emit(GpuEvent(gpu, GpuEventKind.XID, self._clock.wall(), code=code, detail=detail or f"Xid {code}"))
        if code == XID_DOUBLE_BIT_ECC:
            self._raise_dbe(g, 1)
        elif code == XID_FALLEN_OFF_THE_BUS:
            self._lose(g, "fallen off the bus (Xid 79)")

    def inject_ecc_dbe(self, gpu: int, n: int = 1) -> None:
        g = self._gpu(gpu)
        if g.lost:
            return
        self._emit(GpuEvent(gpu, GpuEventKind.XID, self._clock.wall(), code=XID_DOUBLE_BIT_ECC,
                            detail="Double Bit ECC Error"))
        self._raise_dbe(g, n)

    def inject_ecc_sbe(self, gpu: int, n: int = 1) -> None:
        g = self._gpu(gpu)
        if g.lost:
            return
        g.sbe += n
        self._emit(GpuEvent(gpu, GpuEventKind.ECC_SBE, self._clock.wall(), count=n,
                            detail=f"volatile corrected ECC count {g.sbe}"))

    def inject_retirement_pending(self, gpu: int) -> None:
        g = self._gpu(gpu)
        if g.lost:
            return
        self._emit(GpuEvent(gpu, GpuEventKind.RETIREMENT_PENDING, self._clock.wall(),
                            detail="memory retirement pending until the next GPU reset"))

    def lose(self, gpu: int) -> None:
        g = self._gpu(gpu)
        if not g.lost:
            self._lose(g, "GPU is lost")

    def throttle(self, gpu: int, reason: str) -> None:
        if reason not in THROTTLE_REASONS:
            raise ValueError(f"unknown throttle reason {reason!r}; one of {sorted(THROTTLE_REASONS)}")
        g = self._gpu(gpu)
        if not g.lost:
            self._set_throttle(g, g.throttle | {reason})

    def unthrottle(self, gpu: int, reason: str | None = None) -> None:
        """Clear one throttle reason, or all of them."""
        g = self._gpu(gpu)
        if not g.lost:
            self._set_throttle(g, frozenset() if reason is None else g.throttle - {reason})

    def run_process(self, gpu: int, pid: int) -> None:
        """``pid`` holds a compute context on ``gpu`` (what NVML lists as its compute processes)."""
        self._gpu(gpu).pids.add(pid)

    def fail_selftest(self, gpu: int, reason: str = "forced self-test failure") -> None:
        self._gpu(gpu).selftest_failure = reason

    def pass_selftest(self, gpu: int) -> None:
        self._gpu(gpu).selftest_failure = None

    def clear(self, gpu: int) -> None:
        """The GPU was reset or replaced: healthy again, counters at zero; active throttling reports stopped."""
        g = self._gpu(gpu)
        g.lost = False
        self._set_throttle(g, frozenset())
        g.dbe = g.sbe = 0
        g.selftest_failure = None

    # --- internals

    def _gpu(self, gpu: int) -> _FakeGpu:
        if not 0 <= gpu < len(self._gpus):
            raise ValueError(f"no fake GPU {gpu} (this source has {len(self._gpus)})")
        return self._gpus[gpu]

    def _emit(self, event: GpuEvent) -> None:
        self._pending.append(event)

    def _raise_dbe(self, g: _FakeGpu, n: int) -> None:
        g.dbe += n
        self._emit(GpuEvent(g.info.index, GpuEventKind.ECC_DBE, self._clock.wall(), count=n,
                            detail=f"volatile uncorrectable ECC count {g.dbe}"))

    def _lose(self, g: _FakeGpu, detail: str) -> None:
        g.lost = True
        g.throttle = frozenset()  # nothing more is read from a lost GPU
        self._emit(GpuEvent(g.info.index, GpuEventKind.LOST, self._clock.wall(), detail=detail))

    def _set_throttle(self, g: _FakeGpu, after: frozenset[str]) -> None:
        for event in throttle_events(g.info.index, self._clock.wall(), g.throttle, after):
            self._emit(event)
        g.throttle = after
