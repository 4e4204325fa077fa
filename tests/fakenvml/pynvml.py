"""A fault-injectable stand-in for NVML's Python bindings (the ``pynvml`` module of nvidia-ml-py), for hosts
without a GPU: the boundary fleetward may fake. Tests put this folder first on ``PYTHONPATH`` of a process
(``fleetward up``, ``fleetward agent``, ``fleetward gpu``), so the product's own
:class:`~fleetward.supervisor.gpu.NvmlSource` runs over it unchanged.

What the GPUs report lives in a JSON file named by ``FLEETWARD_FAKE_NVML``, written by the test through
``nvmlfake.FakeNvml`` (tests/nvmlfake.py) and read again on every call, so a fault injected by the test
reaches the process at its next poll. It keeps NVML's rules as the product meets them:

- ``nvmlInit`` fails with ``init_error`` (e.g. ``NVML_ERROR_DRIVER_NOT_LOADED``) when the file says so;
- an event set reports only the Xids logged after it was created, each once, for the devices registered
  with it; ``nvmlEventSetWait`` raises ``NVML_ERROR_TIMEOUT`` when none is queued;
- every query about a lost GPU raises ``NVML_ERROR_GPU_IS_LOST``; a GPU without ECC raises
  ``NVML_ERROR_NOT_SUPPORTED`` for its ECC counts;
- a device handle is a pointer whose address is the same for every call about that GPU.
"""

from __future__ import annotations

import ctypes
import json
import os
from dataclasses import dataclass
from typing import Any

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
nvmlEventTypeXidCriticalError = 0x8

_NAMES = {v: k for k, v in dict(globals()).items() if k.startswith("NVML_ERROR_")}


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return f"{_NAMES.get(self.value, 'NVML error')} (fake NVML)"


def _state() -> dict[str, Any]:
    path = os.environ.get("FLEETWARD_FAKE_NVML")
    if not path:
        raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
    with open(path) as f:
        state: dict[str, Any] = json.load(f)
    return state


_initialised = 0
_handles: dict[int, ctypes.c_void_p] = {}


def _gpu(handle: Any) -> dict[str, Any]:
    if not _initialised:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    index = int(ctypes.cast(handle, ctypes.c_void_p).value or 0) - 0x1000
    gpus = _state()["gpus"]
    if not 0 <= index < len(gpus):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    gpu: dict[str, Any] = gpus[index]
    if gpu.get("lost"):
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    return gpu


def nvmlInit() -> None:
    global _initialised
    error = _state().get("init_error")
    if error:
        raise NVMLError(int(globals()[error]))
    _initialised += 1


def nvmlShutdown() -> None:
    global _initialised
    if not _initialised:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    _initialised -= 1


def nvmlDeviceGetCount() -> int:
    if not _initialised:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    return len(_state()["gpus"])


def nvmlDeviceGetHandleByIndex(index: int) -> ctypes.c_void_p:
    if not 0 <= index < nvmlDeviceGetCount():
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    if _state()["gpus"][index].get("lost"):
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)  # as NVML answers for a GPU that fell off the bus
    return _handles.setdefault(index, ctypes.c_void_p(0x1000 + index))


def nvmlDeviceGetUUID(handle: Any) -> str:
    return str(_gpu(handle)["uuid"])


def nvmlDeviceGetName(handle: Any) -> str:
    return str(_gpu(handle)["name"])


def nvmlDeviceGetTotalEccErrors(handle: Any, error_type: int, counter_type: int) -> int:
    gpu = _gpu(handle)
    if not gpu.get("ecc", True):
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return int(gpu["dbe" if error_type == NVML_MEMORY_ERROR_TYPE_UNCORRECTED else "sbe"])


def nvmlDeviceGetCurrentClocksEventReasons(handle: Any) -> int:
    return int(_gpu(handle)["clocks_event_reasons"])


def nvmlDeviceGetRetiredPagesPendingStatus(handle: Any) -> int:
    return int(_gpu(handle)["retired_pending"])


def nvmlDeviceGetRemappedRows(handle: Any) -> tuple[int, int, int, int]:
    gpu = _gpu(handle)
    return 0, 0, int(gpu["remap_pending"]), 0


@dataclass
class c_nvmlProcessInfo_t:
    pid: int
    usedGpuMemory: int


def nvmlDeviceGetComputeRunningProcesses(handle: Any) -> list[c_nvmlProcessInfo_t]:
    gpu = _gpu(handle)
    pids = list(gpu["processes"])
    for marker in gpu.get("processes_matching", ()):  # processes the test cannot know the pid of in advance
        pids += [pid for pid in _pids() if marker in _cmdline(pid)]
    return [c_nvmlProcessInfo_t(pid, 1 << 30) for pid in pids]


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass
class _EventSet:
    seen: int  # Xids up to this sequence number were logged before the set existed
    devices: set[int]


@dataclass
class c_nvmlEventData_t:
    device: ctypes.c_void_p
    eventType: int
    eventData: int


def nvmlEventSetCreate() -> _EventSet:
    if not _initialised:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    return _EventSet(max((x["seq"] for x in _state()["xids"]), default=0), set())


def nvmlDeviceRegisterEvents(handle: Any, types: int, event_set: _EventSet) -> None:
    _gpu(handle)
    event_set.devices.add(int(ctypes.cast(handle, ctypes.c_void_p).value or 0) - 0x1000)


def nvmlEventSetWait(event_set: _EventSet, timeout_ms: int) -> c_nvmlEventData_t:
    for xid in sorted(_state()["xids"], key=lambda x: x["seq"]):
        if xid["seq"] > event_set.seen and xid["gpu"] in event_set.devices:
            event_set.seen = xid["seq"]
            return c_nvmlEventData_t(_handles.setdefault(xid["gpu"], ctypes.c_void_p(0x1000 + xid["gpu"])),
                                     nvmlEventTypeXidCriticalError, int(xid["code"]))
    raise NVMLError(NVML_ERROR_TIMEOUT)


def nvmlEventSetFree(event_set: _EventSet) -> None:
    event_set.devices.clear()
