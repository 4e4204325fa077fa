"""GPU health: what the GPUs of this host report, what each report means, and a self-test.

The source
----------
A :class:`GpuHealthSource` is the narrow interface to the GPU hardware of one host:

- ``gpus()`` lists the GPUs it watches (:class:`GpuInfo`: index, uuid, name); the list never changes.
- ``poll()`` returns the :class:`GpuEvent` values observed since the previous poll, oldest first, and
  never blocks. Events are edges (a new Xid, an ECC counter that went up, throttling that started or
  stopped, memory retirement that became pending) with one exception: ``LOST`` is a level, reported on
  every poll for as long as the GPU is lost, the way NVML answers every query about it with
  ``GPU_IS_LOST``; a controller that starts watching late still sees it. A lost GPU reports nothing else.
  An Xid 79 (fallen off the bus) is followed by ``LOST`` for the same GPU. The first poll reports
  conditions already present when the source was opened (volatile ECC counts since the last GPU reset,
  active throttling, pending retirement) as if they had just happened.
- ``selftest(gpu, size=, seed=)`` runs the deterministic matmul check (:func:`selftest`; in a child
  process with a deadline on real GPUs) and returns its :class:`SelftestResult`; a GPU that computes
  wrong, fails to compute, hangs or is lost gives ``passed=False``.
  It raises only when the test cannot run at all (torch missing). The supervisor calls it through
  :func:`run_selftest` before a quarantined or restarted GPU worker returns to service.
- ``processes()`` maps each GPU index to the pids of the processes that hold a compute context on it
  (NVML's compute processes, in the pid namespace of the host), for GPUs whose owner fleetward did not
  start; a source that cannot tell (dcgm-exporter) returns an empty mapping.
- ``close()`` releases the hardware interface; idempotent. ``poll`` after ``close`` raises.

A source that reads its GPUs from somewhere that can fail (dcgm-exporter over HTTP) raises
:class:`GpuSourceError` from ``poll`` while it cannot; the next ``poll`` tries again. NVML's does not.

Sources are synchronous and not thread-safe: one owner calls them (from a thread if its loop must not
wait on the driver). Timestamps (``GpuEvent.ts``) are wall seconds from the injected clock.

Implementations: :class:`NvmlSource` reads NVML (``pip install 'fleetward[gpu]'``) on GPU hosts;
:class:`~fleetward.supervisor.dcgm.DcgmExporterSource` reads the dcgm-exporter a fleet already runs; the
fleet file's ``gpu:`` picks one (:mod:`fleetward.supervisor.gpuhost`). A node without GPUs runs no source.
The fault-injectable stand-in for hosts without GPUs is testbed code, not product:
:class:`fleetward.chaos.fakegpu.FakeGpuSource` (it keeps the real source's rules above); the tests also run
:class:`NvmlSource` itself over a fake of NVML's bindings (``tests/fakenvml``).

The policy
----------
:class:`GpuPolicy` maps an event to a verdict (:class:`Action`) and a reason. The Xid table
(:data:`DEFAULT_XID_RULES`) follows NVIDIA's Xid catalogue: application faults (13, 31, 43, 45, ...)
restart the worker; hardware faults (48, 63, 64, 74, 79, 92, 94, 95, and the codes NVIDIA resolves by
resetting the GPU) drain the worker and quarantine the GPU; thermal throttling makes it ``DEGRADED``
(slow, not broken: suspect, not restarted). Unknown Xids get ``GpuPolicy.unknown_xid``. Every rule can
be overridden from config (:meth:`GpuPolicy.from_config`).

Errors: everything raised on purpose is a :class:`~fleetward.fleet.errors.FleetwardError` (NVML or torch
missing, NVML cannot initialise, a closed source, a bad policy entry as
:class:`~fleetward.fleet.errors.ConfigError`); NVML's own exceptions never leave this module. Misuse
(a GPU index the fake lacks, a self-test size outside 1..1024) is ``ValueError``.

One module (over 600 lines) because the source's rules, the policy that reads its events and the
self-test that clears a GPU are one contract about one piece of hardware.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Protocol

from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.errors import ConfigError, FleetwardError

__all__ = [
    "DEFAULT_THROTTLE_RULES",
    "DEFAULT_XID_RULES",
    "THROTTLE_REASONS",
    "XID_DOUBLE_BIT_ECC",
    "XID_FALLEN_OFF_THE_BUS",
    "Action",
    "GpuEvent",
    "GpuEventKind",
    "GpuHealthSource",
    "GpuInfo",
    "GpuPolicy",
    "GpuSourceError",
    "NvmlSource",
    "Rule",
    "SelftestResult",
    "run_selftest",
    "selftest",
    "selftest_in_child",
    "throttle_events",
    "throttle_reasons",
]

log = logging.getLogger(__name__)

XID_FALLEN_OFF_THE_BUS = 79
XID_DOUBLE_BIT_ECC = 48


class GpuSourceError(FleetwardError):
    """The source cannot read its GPUs right now (dcgm-exporter unreachable); the next poll tries again."""


# --------------------------------------------------------------------------------------------- events


class GpuEventKind(StrEnum):
    XID = "xid"  # code: the Xid
    ECC_DBE = "ecc_dbe"  # count: how much the volatile uncorrectable (double-bit) ECC count rose
    ECC_SBE = "ecc_sbe"  # count: how much the volatile corrected (single-bit) ECC count rose
    LOST = "lost"  # fallen off the bus or otherwise inaccessible (a level: see the module docstring)
    THROTTLE_STARTED = "throttle_started"  # reasons: the clock-slowdown reasons that became active
    THROTTLE_STOPPED = "throttle_stopped"  # reasons: the ones that cleared
    RETIREMENT_PENDING = "retirement_pending"  # retired pages / remapped rows wait for a GPU reset


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int
    uuid: str
    name: str


@dataclass(frozen=True, slots=True)
class GpuEvent:
    gpu: int
    kind: GpuEventKind
    ts: float
    code: int | None = None
    count: int = 0
    reasons: frozenset[str] = frozenset()
    detail: str = ""


# Clock-slowdown reasons (NVML ``nvmlClocksEventReason*`` bits) that mean the GPU runs slower than it
# could. Idle, application clock settings, sync boost and display clocks are not slowdowns.
_THROTTLE_BITS: Mapping[int, str] = MappingProxyType({
    0x04: "sw_power_cap",
    0x08: "hw_slowdown",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
})
THROTTLE_REASONS: frozenset[str] = frozenset(_THROTTLE_BITS.values())


def throttle_reasons(mask: int) -> frozenset[str]:
    """The slowdown reasons set in a clock-event mask (NVML's, which dcgm-exporter exports as it is)."""
    return frozenset(name for bit, name in _THROTTLE_BITS.items() if mask & bit)


def throttle_events(gpu: int, ts: float, before: frozenset[str], after: frozenset[str]) -> list[GpuEvent]:
    out: list[GpuEvent] = []
    if started := after - before:
        out.append(GpuEvent(gpu, GpuEventKind.THROTTLE_STARTED, ts, reasons=started,
                            detail="clocks slowed: " + ", ".join(sorted(started))))
    if stopped := before - after:
        out.append(GpuEvent(gpu, GpuEventKind.THROTTLE_STOPPED, ts, reasons=stopped,
                            detail="slowdown cleared: " + ", ".join(sorted(stopped))))
    return out


# ------------------------------------------------------------------------------------------- self-test


@dataclass(frozen=True, slots=True)
class SelftestResult:
    device: str
    passed: bool
    size: int
    seed: int
    expected: int  # position-weighted checksum of the exact product
    got: int | None  # the same checksum of what the device computed (None: nothing usable came back)
    mismatches: int  # entries of the product that differ from the exact one
    reason: str
    gpu: int | None = None  # set by run_selftest


# Entries are drawn from [-8, 8]: every product (<= 64) and every partial sum (<= size * 64 <= 2**16)
# is an integer that float32 represents exactly, whatever the summation order; so does TF32 on tensor
# cores (the inputs need 4 bits of mantissa, the sums accumulate in float32). Any difference from the
# int64 product is a fault.
_SELFTEST_RANGE = 8
_SELFTEST_MAX_SIZE = 1024  # keeps the int64 checksum far from overflow


_NO_TORCH = "the GPU self-test needs torch; install it (vLLM brings it; or pip install 'fleetward[model]')"


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise FleetwardError(_NO_TORCH) from exc
    return torch


def _checksum(torch: Any, matrix: Any) -> int:
    n = matrix.shape[0]
    weights = torch.arange(1, n * n + 1, dtype=torch.int64).reshape(n, n)
    return int((matrix * weights).sum())


def selftest(device: str = "cpu", *, size: int = 256, seed: int = 0) -> SelftestResult:
    """Multiply two seeded integer-valued float32 matrices on ``device`` and compare with the exact product.

    Deterministic for a given torch version, size and seed. A device that computes wrong, returns
    non-finite values or fails while computing gives ``passed=False`` with the reason. The whole product
    is compared, not only its checksum. Raises only for a missing torch (:class:`FleetwardError`) or a
    size outside 1..1024 (``ValueError``). Runs in this process: on a GPU that creates a CUDA context
    that lives as long as the process, so supervisors use :func:`selftest_in_child` for real GPUs.
    """
    if not 1 <= size <= _SELFTEST_MAX_SIZE:
        raise ValueError(f"selftest size must be in 1..{_SELFTEST_MAX_SIZE}, not {size}")
    torch = _import_torch()
    gen = torch.Generator().manual_seed(seed)
    a = torch.randint(-_SELFTEST_RANGE, _SELFTEST_RANGE + 1, (size, size), generator=gen, dtype=torch.int64)
    b = torch.randint(-_SELFTEST_RANGE, _SELFTEST_RANGE + 1, (size, size), generator=gen, dtype=torch.int64)
    exact = torch.matmul(a, b)  # int64 on the CPU: the reference
    expected = _checksum(torch, exact)

    def failed(reason: str, got: int | None = None, mismatches: int = size * size) -> SelftestResult:
        return SelftestResult(device, False, size, seed, expected, got, mismatches, reason)

    try:
        # A device that cannot compute (CUDA errors, a missing device) fails the test rather than the
        # caller: whatever the cause, it is not fit for service.
        product = torch.matmul(a.to(torch.float32).to(device), b.to(torch.float32).to(device)).to("cpu")
    except Exception as exc:
        return failed(f"the matmul failed on {device}: {type(exc).__name__}: {exc}")
    if tuple(product.shape) != (size, size):
        return failed(f"{device} returned a {tuple(product.shape)} product for {size}x{size} inputs")
    mismatches = int((product != exact.to(torch.float32)).sum())  # NaN never equals: counted
    got = _checksum(torch, product.round().to(torch.int64)) if bool(torch.isfinite(product).all()) else None
    if mismatches:
        return failed(f"{mismatches} of {size * size} entries of the product are wrong on {device}",
                      got, mismatches)
    return SelftestResult(device, True, size, seed, expected, got, 0, f"matmul checksum exact on {device}")


_CHILD_CODE = """
import dataclasses, json, sys
from fleetward.supervisor.gpu import selftest
result = selftest(sys.argv[1], size=int(sys.argv[2]), seed=int(sys.argv[3]))
print(json.dumps(dataclasses.asdict(result)))
"""


def selftest_in_child(device: str = "cpu", *, size: int = 256, seed: int = 0, timeout: float = 120.0,
                      env: Mapping[str, str] | None = None) -> SelftestResult:
    """:func:`selftest` in a short-lived child process with a deadline; ``env`` is added to its environment.

    The CUDA context (and its memory) dies with the child, and a GPU that hangs is killed at ``timeout``
    (counted as a failure). A child that crashes or prints no result also fails the test.
    """
    if not 1 <= size <= _SELFTEST_MAX_SIZE:
        raise ValueError(f"selftest size must be in 1..{_SELFTEST_MAX_SIZE}, not {size}")
    if importlib.util.find_spec("torch") is None:  # say so here, not as a child's crash
        raise FleetwardError(_NO_TORCH)

    def failed(reason: str) -> SelftestResult:
        return SelftestResult(device, False, size, seed, 0, None, size * size, reason)

    try:
        proc = subprocess.run([sys.executable, "-P", "-c", _CHILD_CODE, device, str(size), str(seed)],
                              capture_output=True, text=True, timeout=timeout, check=False,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return failed(f"the self-test on {device} did not finish within {timeout:g} s")
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        return failed(f"the self-test process on {device} exited {proc.returncode}: {tail[0]}")
    try:
        return SelftestResult(**json.loads(lines[-1]))
    except (ValueError, TypeError) as exc:
        return failed(f"the self-test process on {device} printed no result: {exc}")


def run_selftest(source: GpuHealthSource, gpu: int, *, size: int = 256, seed: int = 0) -> SelftestResult:
    """The supervisor's entry point: self-test ``gpu`` of ``source`` before its worker returns to service."""
    known = sorted(info.index for info in source.gpus())
    if gpu not in known:
        raise FleetwardError(f"no GPU {gpu} on this host (GPUs: {known})")
    return dataclasses.replace(source.selftest(gpu, size=size, seed=seed), gpu=gpu)


# ---------------------------------------------------------------------------------------- the protocol


class GpuHealthSource(Protocol):
    """The GPUs of one host: their events and their self-test. Contract in the module docstring."""

    def gpus(self) -> list[GpuInfo]:
        """The GPUs this source watches, by index."""
        ...

    def poll(self) -> list[GpuEvent]:
        """Events since the previous poll, oldest first; ``LOST`` repeats while a GPU is lost."""
        ...

    def selftest(self, gpu: int, *, size: int = 256, seed: int = 0) -> SelftestResult:
        """Run the deterministic matmul self-test on ``gpu``; ``passed=False`` when it computes wrong."""
        ...

    def processes(self) -> dict[int, frozenset[int]]:
        """GPU index -> pids holding a compute context on it (empty when the source cannot tell)."""
        ...

    def close(self) -> None:
        """Release the hardware interface (idempotent)."""
        ...


# ------------------------------------------------------------------------------------------------ NVML


def _import_pynvml() -> Any:
    try:
        import pynvml
    except ImportError as exc:
        raise FleetwardError("NvmlSource needs NVML's Python bindings (the nvidia-ml-py package): "
                             "pip install 'fleetward[gpu]'") from exc
    return pynvml


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _address(handle: Any) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value


@dataclass
class _NvmlGpu:
    info: GpuInfo
    handle: Any
    lost: bool = False
    dbe: int = 0
    sbe: int = 0
    throttle: frozenset[str] = frozenset()
    pending: bool = False
    unsupported: set[str] = field(default_factory=set)


class NvmlSource:
    """The GPUs of this host through NVML (nvidia-ml-py). Contract in the module docstring.

    Xid errors come from an NVML event set (drained with a zero timeout on each poll); ECC counts,
    clock-slowdown reasons and pending page retirement / row remapping are read on each poll and diffed.
    Queries a GPU does not support (ECC on consumer boards, retirement on newer ones) are skipped.
    """

    def __init__(self, *, clock: Clock = SYSTEM_CLOCK) -> None:
        nvml = _import_pynvml()
        self._nvml = nvml
        self._clock = clock
        self._closed = True
        self._event_set: Any = None
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise FleetwardError(f"NVML cannot initialise ({self._error_name(exc)}: {exc}): this host has no "
                                 "usable NVIDIA GPU or driver (does `nvidia-smi` work?)") from exc
        self._closed = False
        try:
            self._gpus = self._open_devices()
        except nvml.NVMLError as exc:
            self.close()
            raise FleetwardError(f"NVML failed while listing GPUs: {self._error_name(exc)}: {exc}") from exc
        except FleetwardError:
            self.close()
            raise
        self._by_address = {_address(g.handle): g for g in self._gpus if g.handle is not None}
        # Newer NVML renamed "throttle reasons" to "clocks event reasons"; same bits.
        self._clock_reasons: Callable[[Any], int] = getattr(
            nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or nvml.nvmlDeviceGetCurrentClocksThrottleReasons

    def _open_devices(self) -> list[_NvmlGpu]:
        nvml = self._nvml
        count = nvml.nvmlDeviceGetCount()
        if count == 0:
            raise FleetwardError("NVML initialised but found no GPUs on this host")
        self._event_set = nvml.nvmlEventSetCreate()
        out = []
        for index in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                info = GpuInfo(index, _text(nvml.nvmlDeviceGetUUID(handle)), _text(nvml.nvmlDeviceGetName(handle)))
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) != nvml.NVML_ERROR_GPU_IS_LOST:
                    raise
                # Lost before we looked (an agent restarted on a host whose GPU fell off the bus): watched as
                # lost, so its workers are still marked, rather than a host that watches nothing.
                log.error("GPU %d is lost (NVML: %s): reported lost until the host is repaired", index, exc)
                out.append(_NvmlGpu(GpuInfo(index, f"GPU-lost-{index}", "lost GPU"), None, lost=True))
                continue
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._event_set)
            except nvml.NVMLError as exc:
                log.warning("GPU %d (%s): Xid events unavailable (%s); ECC, throttling and loss are still read",
                            index, info.uuid, exc)
            out.append(_NvmlGpu(info, handle))
        return out

    def gpus(self) -> list[GpuInfo]:
        return [g.info for g in self._gpus]

    def poll(self) -> list[GpuEvent]:
        if self._closed:
            raise FleetwardError("poll() on a closed NvmlSource")
        now = self._clock.wall()
        events = self._drain_xids(now)
        for g in self._gpus:
            if not g.lost:
                events += self._sample(g, now)
            if g.lost:
                events.append(GpuEvent(g.info.index, GpuEventKind.LOST, now, detail="NVML: GPU is lost"))
        return events

    def processes(self) -> dict[int, frozenset[int]]:
        out: dict[int, frozenset[int]] = {}
        for g in self._gpus:
            running = self._query(g, "processes", self._nvml.nvmlDeviceGetComputeRunningProcesses)
            out[g.info.index] = frozenset(int(p.pid) for p in running or ())
        return out

    def selftest(self, gpu: int, *, size: int = 256, seed: int = 0) -> SelftestResult:
        g = self._gpus[gpu]
        if g.lost:
            return SelftestResult(g.info.uuid, False, size, seed, 0, None, size * size,
                                  f"GPU {gpu} is lost: nothing to run on")
        # CUDA's device numbers need not match NVML's (nor survive CUDA_VISIBLE_DEVICES): name it by UUID.
        result = selftest_in_child("cuda:0", size=size, seed=seed, env={"CUDA_VISIBLE_DEVICES": g.info.uuid})
        return dataclasses.replace(result, device=g.info.uuid)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        nvml = self._nvml
        try:
            if self._event_set is not None:
                nvml.nvmlEventSetFree(self._event_set)
            nvml.nvmlShutdown()
        except nvml.NVMLError as exc:
            log.warning("NVML shutdown: %s", exc)
        finally:
            self._event_set = None

    def __enter__(self) -> NvmlSource:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _drain_xids(self, now: float) -> list[GpuEvent]:
        nvml = self._nvml
        out: list[GpuEvent] = []
        for _ in range(10_000):  # bounded: a storm of Xids must not stall the poll forever
            try:
                data = nvml.nvmlEventSetWait(self._event_set, 0)
            except nvml.NVMLError as exc:
                # Timeout: nothing more queued. A lost GPU shows up in the per-GPU queries below.
                if getattr(exc, "value", None) not in (nvml.NVML_ERROR_TIMEOUT, nvml.NVML_ERROR_GPU_IS_LOST):
                    log.warning("NVML event wait: %s", exc)
                break
            if not data.eventType & nvml.nvmlEventTypeXidCriticalError:
                continue
            g = self._by_address.get(_address(data.device))
            if g is None or g.lost:
                continue
            xid = int(data.eventData)
            out.append(GpuEvent(g.info.index, GpuEventKind.XID, now, code=xid, detail=f"Xid {xid}"))
            if xid == XID_FALLEN_OFF_THE_BUS:
                g.lost = True
        return out

    def _sample(self, g: _NvmlGpu, now: float) -> list[GpuEvent]:
        nvml, i = self._nvml, g.info.index
        out: list[GpuEvent] = []
        for kind, error_type, attr in ((GpuEventKind.ECC_DBE, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, "dbe"),
                                       (GpuEventKind.ECC_SBE, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, "sbe")):
            total = self._query(g, kind.value, nvml.nvmlDeviceGetTotalEccErrors, error_type, nvml.NVML_VOLATILE_ECC)
            if total is None:
                continue
            before = getattr(g, attr)
            if total > before:
                out.append(GpuEvent(i, kind, now, count=total - before, detail=f"volatile ECC count {total}"))
            setattr(g, attr, total)  # a GPU reset zeroes volatile counts: follow it down silently
        mask = self._query(g, "clocks", self._clock_reasons)
        if mask is not None:
            after = throttle_reasons(mask)
            out += throttle_events(i, now, g.throttle, after)
            g.throttle = after
        retired = self._query(g, "retired_pages", nvml.nvmlDeviceGetRetiredPagesPendingStatus)
        rows = self._query(g, "remapped_rows", nvml.nvmlDeviceGetRemappedRows)  # (corr, unc, pending, failed)
        pending = bool(retired) or bool(rows is not None and rows[2])
        if pending and not g.pending:
            out.append(GpuEvent(i, GpuEventKind.RETIREMENT_PENDING, now,
                                detail="retired pages / remapped rows pending until the next GPU reset"))
        g.pending = pending
        return out

    def _query(self, g: _NvmlGpu, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """One NVML query on one GPU; None when unsupported, failed or lost (a loss is recorded on ``g``)."""
        if g.lost or what in g.unsupported:
            return None
        nvml = self._nvml
        try:
            return fn(g.handle, *args)
        except nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == nvml.NVML_ERROR_GPU_IS_LOST:
                g.lost = True
            elif code in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                g.unsupported.add(what)
            else:
                log.warning("GPU %d: NVML %s: %s", g.info.index, what, exc)
            return None

    def _error_name(self, exc: Exception) -> str:
        code = getattr(exc, "value", None)
        names = [n for n in dir(self._nvml) if n.startswith("NVML_ERROR_") and getattr(self._nvml, n) == code]
        return names[0] if names else f"NVML error {code}"


# ---------------------------------------------------------------------------------------------- policy


class Action(StrEnum):
    """What the supervisor does about a GPU event, mildest first."""

    IGNORE = "ignore"
    DEGRADED = "degraded"  # slow, not broken: mark the worker suspect, do not restart it
    RESTART_WORKER = "restart_worker"  # an application fault: the GPU is fine, the worker process is not
    DRAIN_AND_QUARANTINE = "drain_and_quarantine"  # a hardware fault: drain, keep the GPU out until it passes

    @property
    def rank(self) -> int:
        """Severity order, for picking the strongest of several verdicts."""
        return list(Action).index(self)


@dataclass(frozen=True, slots=True)
class Rule:
    action: Action
    reason: str


_A = Action
# NVIDIA's Xid catalogue (docs.nvidia.com/deploy/xid-errors), "immediate action" column in brackets where
# our choice differs from it. Codes NVIDIA resolves with RESET_GPU or RESTART_BM quarantine the GPU: it
# may only return after a reset and a passing self-test.
DEFAULT_XID_RULES: Mapping[int, Rule] = MappingProxyType({
    8: Rule(_A.RESTART_WORKER, "Xid 8: GPU stopped processing (channel idle timeout); NVIDIA: restart the app"),
    13: Rule(_A.RESTART_WORKER, "Xid 13: Graphics Engine Exception, an application fault (out-of-bounds access, "
                                "illegal instruction); NVIDIA: restart the app"),
    31: Rule(_A.RESTART_WORKER, "Xid 31: GPU memory page fault, an illegal address access reported by the MMU, "
                                "usually an application bug; NVIDIA: restart the app"),
    43: Rule(_A.RESTART_WORKER, "Xid 43: GPU stopped processing: the application hit a software-induced fault and "
                                "must terminate; the GPU stays healthy"),
    45: Rule(_A.RESTART_WORKER, "Xid 45: preemptive cleanup, due to previous errors: the driver tore the "
                                "application down (kill, reset, or after another Xid, which is classified too)"),
    69: Rule(_A.RESTART_WORKER, "Xid 69: Graphics Engine class error; NVIDIA: restart the app"),
    46: Rule(_A.DRAIN_AND_QUARANTINE, "Xid 46: GPU stopped processing (GPU timeout); NVIDIA: reset the GPU"),
    48: Rule(_A.DRAIN_AND_QUARANTINE, "Xid 48: Double Bit ECC Error, an uncorrectable memory error; a GPU reset "
                                      "or node reboot is needed to clear it"),
    62: Rule(_A.DRAIN_AND_QUARANTINE, "Xid 62: internal micro-controller halt; NVIDIA: reset the GPU"),
    63: Rule(_A.DRAIN_AND_QUARANTINE, "Xid 63: ECC page retirement or row remapping recording event: a faulty "
                                      "memory row awaits the next GPU reset [NVIDIA: no immediate action; we "
                                      "drain so the reset happens on our schedule]"),
    64: Rule(_A.DRAIN_AND_QUARANTINE, "Xid 64: ECC page retirement or row remapping recording failure; NVIDIA: "
                                      "reset the GPU, contact support if it recurs"),
    74: Rule(_A.DRAIN_AND_QUARANTINE, "Xid 74: NVLink error (this GPU or its peer); a GPU reset or node reboot is "
                                      "needed to clear it"),
    79: Rule(_A.DRAIN_AND_QUARANTINE, "Xid 79: GPU has fallen off the bus (inaccessible over PCIe); NVIDIA: "
                                      "restart the machine"),
    92: Rule(_A.DRAIN_AND_QUARANTINE, "Xid 92: high single-bit ECC error rate, memory degrading [NVIDIA: no "
                                      "immediate action; we drain before it turns uncorrectable]"),
    94: Rule(_A.DRAIN_AND_QUARANTINE, "Xid 94: contained ECC error: only the faulting application was hit "
                                      "[NVIDIA: restart the app, reset the GPU when convenient; we drain so "
                                      "the reset happens]"),
    95: Rule(_A.DRAIN_AND_QUARANTINE, "Xid 95: uncontained ECC error: several applications may have read "
                                      "corrupt data; the GPU must be reset before reuse"),
    109: Rule(_A.DRAIN_AND_QUARANTINE, "Xid 109: context switch timeout; NVIDIA: reset the GPU"),
    119: Rule(_A.DRAIN_AND_QUARANTINE, "Xid 119: GSP RPC timeout; NVIDIA: reset the GPU"),
    120: Rule(_A.DRAIN_AND_QUARANTINE, "Xid 120: GSP error; NVIDIA: reset the GPU"),
    140: Rule(_A.DRAIN_AND_QUARANTINE, "Xid 140: ECC unrecovered error, uncorrectable errors escaped page "
                                       "offlining/row remapping; NVIDIA: reset the GPU"),
    154: Rule(_A.IGNORE, "Xid 154: GPU recovery action changed: informational, it summarises another Xid "
                         "that is classified on its own"),
})

DEFAULT_THROTTLE_RULES: Mapping[str, Rule] = MappingProxyType({
    "sw_power_cap": Rule(_A.IGNORE, "clocks held at the power limit: normal under full load"),
    "hw_slowdown": Rule(_A.DEGRADED, "hardware slowdown (clocks halved or worse: heat or power brake)"),
    "sw_thermal": Rule(_A.DEGRADED, "thermal slowdown by the driver: the GPU runs hot"),
    "hw_thermal": Rule(_A.DEGRADED, "hardware thermal slowdown (clocks halved or worse): the GPU runs too hot"),
    "hw_power_brake": Rule(_A.DEGRADED, "hardware power brake slowdown (clocks halved or worse): external "
                                        "power brake asserted"),
})


def _rule(value: Any, default_reason: str, field_name: str) -> Rule:
    """A config entry: an action name, or ``{action: ..., reason: ...}``."""
    if isinstance(value, str):
        value = {"action": value}
    if not isinstance(value, Mapping) or set(value) - {"action", "reason"} or "action" not in value:
        raise ConfigError("expected an action name or {action: ..., reason: ...}", field=field_name)
    try:
        action = Action(value["action"])
    except ValueError:
        raise ConfigError(f"unknown action {value['action']!r}; one of {[a.value for a in Action]}",
                          field=f"{field_name}.action") from None
    reason = value.get("reason", default_reason)
    if not isinstance(reason, str) or not reason:
        raise ConfigError("a reason must be non-empty text", field=f"{field_name}.reason")
    return Rule(action, reason)


@dataclass(frozen=True)
class GpuPolicy:
    """Event → (action, reason). Data, not code: every rule can be replaced from config."""

    xid: Mapping[int, Rule] = field(default_factory=lambda: DEFAULT_XID_RULES)
    unknown_xid: Action = Action.RESTART_WORKER
    throttle: Mapping[str, Rule] = field(default_factory=lambda: DEFAULT_THROTTLE_RULES)
    ecc_dbe: Rule = Rule(_A.DRAIN_AND_QUARANTINE, "uncorrectable (double-bit) ECC error: a GPU reset is needed "
                                                  "to clear it")
    ecc_sbe: Rule = Rule(_A.IGNORE, "corrected (single-bit) ECC errors: data intact (a high rate raises Xid 92)")
    lost: Rule = Rule(_A.DRAIN_AND_QUARANTINE, "GPU lost: fallen off the bus or otherwise inaccessible; NVIDIA: "
                                               "restart the machine")
    retirement_pending: Rule = Rule(_A.DRAIN_AND_QUARANTINE, "memory page retirement / row remapping pending: "
                                                             "takes effect at the next GPU reset")

    @classmethod
    def from_config(cls, data: Mapping[str, Any], *, section: str = "gpu_policy") -> GpuPolicy:
        """Defaults overridden by a parsed config section. Unknown keys and actions are :class:`ConfigError`.

        ::

            unknown_xid: drain_and_quarantine
            xid:
              13: drain_and_quarantine                  # the catalogue reason is kept
              119: {action: ignore, reason: "GSP timeouts are noise on our driver"}
            throttle: {sw_power_cap: degraded}
            ecc_sbe: {action: ignore}
        """
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(data) - known):
            raise ConfigError(f"unknown key {unknown[0]!r}; one of {sorted(known)}", field=f"{section}.{unknown[0]}")
        base = cls()
        changes: dict[str, Any] = {}
        if "unknown_xid" in data:
            changes["unknown_xid"] = _rule(data["unknown_xid"], "-", f"{section}.unknown_xid").action
        if "xid" in data:
            xid = dict(base.xid)
            for key, value in _mapping(data["xid"], f"{section}.xid").items():
                try:
                    code = int(key)
                except (TypeError, ValueError):
                    raise ConfigError(f"an Xid must be an integer, not {key!r}", field=f"{section}.xid") from None
                default = xid[code].reason if code in xid else f"Xid {code}"
                xid[code] = _rule(value, default, f"{section}.xid.{code}")
            changes["xid"] = MappingProxyType(xid)
        if "throttle" in data:
            throttle = dict(base.throttle)
            for key, value in _mapping(data["throttle"], f"{section}.throttle").items():
                if key not in THROTTLE_REASONS:
                    raise ConfigError(f"unknown throttle reason {key!r}; one of {sorted(THROTTLE_REASONS)}",
                                      field=f"{section}.throttle.{key}")
                throttle[key] = _rule(value, throttle[key].reason, f"{section}.throttle.{key}")
            changes["throttle"] = MappingProxyType(throttle)
        for name in ("ecc_dbe", "ecc_sbe", "lost", "retirement_pending"):
            if name in data:
                changes[name] = _rule(data[name], getattr(base, name).reason, f"{section}.{name}")
        return dataclasses.replace(base, **changes)

    def classify(self, event: GpuEvent) -> tuple[Action, str]:
        """The verdict on one event and why. ``THROTTLE_STOPPED`` is ``IGNORE``: it clears ``DEGRADED``."""
        kind = event.kind
        if kind is GpuEventKind.XID:
            if event.code is None:
                raise ValueError("an Xid event without its code")
            rule = self.xid.get(event.code)
            if rule is None:
                return self.unknown_xid, f"Xid {event.code}: not in the policy table (default for unknown Xids)"
            return rule.action, rule.reason
        if kind is GpuEventKind.THROTTLE_STARTED:
            rules = [self.throttle[r] for r in sorted(event.reasons) if r in self.throttle]
            if not rules:
                return Action.IGNORE, "clock slowdown for a reason the policy does not track"
            worst = max(rules, key=lambda r: r.action.rank)
            return worst.action, worst.reason
        if kind is GpuEventKind.THROTTLE_STOPPED:
            return Action.IGNORE, "clock slowdown cleared: " + ", ".join(sorted(event.reasons))
        rule = {GpuEventKind.ECC_DBE: self.ecc_dbe, GpuEventKind.ECC_SBE: self.ecc_sbe,
                GpuEventKind.LOST: self.lost, GpuEventKind.RETIREMENT_PENDING: self.retirement_pending}[kind]
        return rule.action, rule.reason


def _mapping(value: Any, field_name: str) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError("expected a mapping", field=field_name)
    return value
