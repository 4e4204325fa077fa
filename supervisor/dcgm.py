"""GPU health from dcgm-exporter: the GPU metrics most SRE teams already run, read as a GPU health source.

:class:`DcgmExporterSource` is a :class:`~fleetward.supervisor.gpu.GpuHealthSource` over one host's
dcgm-exporter ``/metrics`` (Prometheus text format, parsed by prometheus-client's parser). It keeps the
source's rules (events are edges, ``LOST`` is a level, an Xid 79 loses the GPU) with the metrics
dcgm-exporter documents (its ``etc/default-counters.csv``; GPUs by the ``gpu`` label, with ``UUID`` and
``modelName``):

- **Xid**: ``DCGM_FI_DEV_XID_ERRORS`` is a gauge holding the *last* Xid of a GPU; a change to a new
  non-zero value is an Xid event. ``DCGM_EXP_XID_ERRORS_COUNT{xid=...}`` (dcgm-exporter 3.3+, counted over
  a sliding window) rising is one too, so the same Xid twice is seen where that counter is enabled. The
  value present when the source opens is the past (it stays until the exporter restarts) and is not
  reported, as NVML reports only Xids after its event set was registered.
- **ECC**: ``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL`` / ``..._SBE_VOL_TOTAL`` (volatile: since the last GPU reset) as
  NVML's volatile counts, reported at open when non-zero; where only the aggregate (lifetime) counters
  ``..._AGG_TOTAL`` are exported, their rise after open.
- **Throttling**: ``DCGM_FI_DEV_CLOCKS_EVENT_REASONS``, or its older name
  ``DCGM_FI_DEV_CLOCK_THROTTLE_REASONS``: the same bit mask as NVML's.
- **Retirement pending**: ``DCGM_FI_DEV_RETIRED_PENDING`` > 0, ``DCGM_FI_DEV_ROW_REMAP_PENDING`` > 0 or
  ``DCGM_FI_DEV_ROW_REMAP_FAILURE`` > 0.
- **Lost**: a GPU listed when the source opened and missing from a later scrape that lists others (or a
  Xid 79); NVML cannot answer for it, so dcgm-exporter drops its rows.

A scrape that fails (exporter down, timeout, not its format) raises
:class:`~fleetward.supervisor.gpu.GpuSourceError` from ``poll``; opening the source retries a few times
(tenacity) and then says what the exporter answered. dcgm-exporter knows no processes: ``processes()`` is
empty, so adopted servers name their GPUs (``gpus:`` in ``attach:``). The self-test runs on the GPU
through CUDA as :class:`~fleetward.supervisor.gpu.NvmlSource` does, by the GPU's UUID. MIG instances are not
told apart: a GPU's device-level fields are read from its first series.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tenacity import RetryError, Retrying, stop_after_attempt, wait_exponential

from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.errors import FleetwardError
from fleetward.supervisor.gpu import (
    XID_FALLEN_OFF_THE_BUS,
    GpuEvent,
    GpuEventKind,
    GpuInfo,
    GpuSourceError,
    SelftestResult,
    selftest_in_child,
    throttle_events,
    throttle_reasons,
)

__all__ = ["DcgmExporterSource", "parse_metrics"]

log = logging.getLogger(__name__)

XID = "DCGM_FI_DEV_XID_ERRORS"
XID_COUNT = "DCGM_EXP_XID_ERRORS_COUNT"
DBE_VOL, SBE_VOL = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"
DBE_AGG, SBE_AGG = "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL"
CLOCK_REASONS = ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS")
PENDING = ("DCGM_FI_DEV_RETIRED_PENDING", "DCGM_FI_DEV_ROW_REMAP_PENDING", "DCGM_FI_DEV_ROW_REMAP_FAILURE")


@dataclass
class Sample:
    """What one scrape says about one GPU."""

    info: GpuInfo
    values: dict[str, float] = dataclasses.field(default_factory=dict)  # device-level fields by metric name
    xid_counts: dict[int, float] = dataclasses.field(default_factory=dict)  # DCGM_EXP_XID_ERRORS_COUNT by xid


def parse_metrics(text: str) -> dict[int, Sample]:
    """dcgm-exporter's ``/metrics`` text, by GPU index (its ``gpu`` label). Raises ``ValueError`` on text that is
    not the Prometheus format, and on a page with no GPU in it."""
    gpus: dict[int, Sample] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            index = s.labels.get("gpu")
            if index is None or not index.isdigit():
                continue
            sample = gpus.get(int(index))
            if sample is None:
                info = GpuInfo(int(index), s.labels.get("UUID", ""), s.labels.get("modelName", "NVIDIA GPU"))
                sample = gpus[int(index)] = Sample(info)
            # By the family's name: the parser names a counter's samples <name>_total, and dcgm-exporter's
            # counters are named without that suffix (DCGM_FI_DEV_ECC_DBE_VOL_TOTAL).
            if family.name == XID_COUNT and s.labels.get("xid", "").isdigit():
                sample.xid_counts[int(s.labels["xid"])] = s.value
            else:
                sample.values.setdefault(family.name, s.value)  # MIG: the first series of a GPU
    if not gpus:
        raise ValueError("no GPU in it (no series with a gpu label): is this dcgm-exporter's /metrics?")
    return gpus


@dataclass
class _Gpu:
    info: GpuInfo
    lost: bool = False
    xid: int = 0
    xid_counts: dict[int, float] = dataclasses.field(default_factory=dict)
    dbe: float = 0.0
    sbe: float = 0.0
    throttle: frozenset[str] = frozenset()
    pending: bool = False


class DcgmExporterSource:
    """The GPUs of this host as its dcgm-exporter reports them (see the module docstring)."""

    def __init__(self, url: str, *, clock: Clock = SYSTEM_CLOCK, timeout: float = 2.0, attempts: int = 5) -> None:
        self.url = url
        self._clock = clock
        self._http = httpx.Client(timeout=timeout, trust_env=False)
        self._closed = False
        try:
            first = self._open(attempts)
        except BaseException:
            self.close()
            raise
        self._gpus = {i: _Gpu(s.info) for i, s in sorted(first.items())}
        self._volatile = any(DBE_VOL in s.values or SBE_VOL in s.values for s in first.values())
        self._first: dict[int, Sample] | None = first  # reported by the first poll

    def _open(self, attempts: int) -> dict[int, Sample]:
        try:
            for attempt in Retrying(stop=stop_after_attempt(attempts), wait=wait_exponential(multiplier=0.5, max=4),
                                    reraise=True):
                with attempt:
                    return self._scrape()
        except (GpuSourceError, RetryError) as exc:
            raise FleetwardError(f"no GPU metrics after {attempts} tries: {exc} (is dcgm-exporter running on this "
                                 "host, and is gpu.dcgm_url its /metrics?)") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _scrape(self) -> dict[int, Sample]:
        try:
            r = self._http.get(self.url)
        except httpx.HTTPError as exc:
            raise GpuSourceError(f"dcgm-exporter at {self.url} did not answer: {type(exc).__name__}: {exc}") from exc
        if r.status_code != 200:
            raise GpuSourceError(f"dcgm-exporter at {self.url} answered HTTP {r.status_code}")
        try:
            return parse_metrics(r.text)
        except ValueError as exc:
            raise GpuSourceError(f"dcgm-exporter at {self.url}: {exc}") from exc

    # --- GpuHealthSource

    def gpus(self) -> list[GpuInfo]:
        return [g.info for g in self._gpus.values()]

    def poll(self) -> list[GpuEvent]:
        if self._closed:
            raise FleetwardError("poll() on a closed DcgmExporterSource")
        first, self._first = self._first, None
        scraped = first if first is not None else self._scrape()
        now = self._clock.wall()
        events: list[GpuEvent] = []
        for index, g in self._gpus.items():
            sample = scraped.get(index)
            if not g.lost:
                if sample is None:
                    g.lost = True  # dcgm-exporter drops the rows of a GPU NVML cannot reach
                else:
                    events += self._sample(g, sample, now, opening=first is not None)
            if g.lost:
                events.append(GpuEvent(index, GpuEventKind.LOST, now, detail="dcgm-exporter: GPU is lost"))
        return events

    def processes(self) -> dict[int, frozenset[int]]:
        return {}

    def selftest(self, gpu: int, *, size: int = 256, seed: int = 0) -> SelftestResult:
        g = self._gpus.get(gpu)
        if g is None:
            raise ValueError(f"no GPU {gpu} in dcgm-exporter's metrics (GPUs: {sorted(self._gpus)})")
        if g.lost:
            return SelftestResult(g.info.uuid, False, size, seed, 0, None, size * size,
                                  f"GPU {gpu} is lost: nothing to run on")
        env = {"CUDA_VISIBLE_DEVICES": g.info.uuid} if g.info.uuid else {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                                                                         "CUDA_VISIBLE_DEVICES": str(gpu)}
        result = selftest_in_child("cuda:0", size=size, seed=seed, env=env)
        return dataclasses.replace(result, device=g.info.uuid or f"cuda:{gpu}")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._http.close()

    def __enter__(self) -> DcgmExporterSource:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # --- one GPU's scrape against what was known

    def _sample(self, g: _Gpu, s: Sample, now: float, *, opening: bool) -> list[GpuEvent]:
        i = g.info.index
        out: list[GpuEvent] = []
        xid = int(s.values.get(XID, 0))
        codes = [] if opening else _risen(g.xid_counts, s.xid_counts)
        if not opening and xid and xid != g.xid and xid not in codes:
            codes.insert(0, xid)
        g.xid, g.xid_counts = xid, dict(s.xid_counts)
        for code in codes:
            out.append(GpuEvent(i, GpuEventKind.XID, now, code=code, detail=f"Xid {code} (dcgm-exporter)"))
        if XID_FALLEN_OFF_THE_BUS in codes:
            g.lost = True
            return out
        dbe_name, sbe_name = (DBE_VOL, SBE_VOL) if self._volatile else (DBE_AGG, SBE_AGG)
        for kind, name, attr in ((GpuEventKind.ECC_DBE, dbe_name, "dbe"), (GpuEventKind.ECC_SBE, sbe_name, "sbe")):
            if name not in s.values:
                continue
            total, before = s.values[name], getattr(g, attr)
            if opening and not self._volatile:
                before = total  # lifetime counts: only what happens from now on
            if total > before:
                out.append(GpuEvent(i, kind, now, count=int(total - before), detail=f"{name} {total:g}"))
            setattr(g, attr, total)  # a GPU reset zeroes volatile counts: follow it down silently
        mask = next((s.values[n] for n in CLOCK_REASONS if n in s.values), None)
        if mask is not None:
            after = throttle_reasons(int(mask))
            out += throttle_events(i, now, g.throttle, after)
            g.throttle = after
        pending = any(s.values.get(n, 0) > 0 for n in PENDING)
        if pending and not g.pending:
            which = ", ".join(n for n in PENDING if s.values.get(n, 0) > 0)
            out.append(GpuEvent(i, GpuEventKind.RETIREMENT_PENDING, now, detail=f"{which} (until the next GPU reset)"))
        g.pending = pending
        return out


def _risen(before: dict[int, float], after: dict[int, float]) -> list[int]:
    """The Xids whose windowed count rose since the last scrape, in code order."""
    return sorted(code for code, n in after.items() if n > before.get(code, 0))

