"""A host's GPUs as the node agent sees them: which health source the fleet file asks for, and which GPUs
each worker runs on.

- :func:`open_source` opens the source ``gpu.source`` names (``auto``: dcgm-exporter when ``gpu.dcgm_url``
  is set, else NVML when its bindings load and it sees a GPU, else none) and says in one line what it
  chose and why (:class:`GpuChoice`): the agent logs it once and publishes it in ``agents/<node>``, where
  ``fleetward status`` shows it. ``nvml`` or ``dcgm`` named explicitly and not available is an error:
  an operator who asked for GPU health must not get a host that silently watches nothing.
- :func:`assign` gives the workers an agent starts their GPUs (``gpu.per_worker`` each, in NVML's order,
  which is what ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` makes CUDA use).
- :func:`gpus_of` finds the GPUs of a server fleetward did not start: those whose compute processes are
  in the server's process tree.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.config import GpuConfig
from fleetward.fleet.errors import FleetwardError
from fleetward.supervisor.gpu import GpuHealthSource, GpuInfo, GpuPolicy

__all__ = ["GpuChoice", "assign", "gpus_of", "open_source", "policy_of"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuChoice:
    """What a host watches its GPUs with: ``source`` (``nvml``, ``dcgm`` or ``off``), and why, in words."""

    source: str
    detail: str
    gpus: tuple[GpuInfo, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "detail": self.detail, "gpus": len(self.gpus)}

    @property
    def line(self) -> str:
        return f"GPU health: {self.source} ({self.detail})"


def describe(gpus: Sequence[GpuInfo]) -> str:
    names = sorted({g.name for g in gpus})
    return f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''}: {', '.join(names)}"


def open_source(config: GpuConfig, *, clock: Clock = SYSTEM_CLOCK) -> tuple[GpuHealthSource | None, GpuChoice]:
    """The source ``config`` asks for, open, and what was chosen. Raises :class:`FleetwardError` when an
    explicitly named source cannot be opened (its message says what is missing)."""
    wanted = config.source
    if wanted == "off":
        return None, GpuChoice("off", "gpu: off in the fleet file")
    if wanted == "dcgm" or (wanted == "auto" and config.dcgm_url):
        from fleetward.supervisor.dcgm import DcgmExporterSource

        assert config.dcgm_url is not None
        dcgm = DcgmExporterSource(config.dcgm_url, clock=clock)
        gpus = tuple(dcgm.gpus())
        return dcgm, GpuChoice("dcgm", f"{describe(gpus)}, from {config.dcgm_url}", gpus)
    from fleetward.supervisor.gpu import NvmlSource

    if wanted == "auto":
        try:
            nvml = NvmlSource(clock=clock)
        except FleetwardError as exc:  # no bindings, no driver, no GPU: a host without GPUs
            return None, GpuChoice("off", str(exc))
    else:
        nvml = NvmlSource(clock=clock)
    gpus = tuple(nvml.gpus())
    return nvml, GpuChoice("nvml", describe(gpus), gpus)


def policy_of(config: GpuConfig) -> GpuPolicy:
    """The GPU policy with the fleet file's overrides (``gpu.policy``)."""
    return GpuPolicy.from_config(config.policy.overrides(), section="gpu.policy")


def assign(count: int, per_worker: int, *, gpus: int, taken: Iterable[int] = ()) -> list[tuple[int, ...]]:
    """GPUs for ``count`` new workers, ``per_worker`` each, from the ``gpus`` a host has, skipping ``taken``:
    in index order, as far as they go (a worker past them gets ``()``)."""
    free = [i for i in range(gpus) if i not in set(taken)]
    out: list[tuple[int, ...]] = []
    for _ in range(count):
        if per_worker and len(free) >= per_worker:
            out.append(tuple(free[:per_worker]))
            free = free[per_worker:]
        else:
            out.append(())
    return out


def gpus_of(pids: Iterable[int], processes: Mapping[int, frozenset[int]]) -> tuple[int, ...]:
    """The GPUs on which any of ``pids`` (a server's process tree) holds a compute context."""
    tree = set(pids)
    return tuple(sorted(gpu for gpu, running in processes.items() if running & tree))
