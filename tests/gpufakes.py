"""Stand-ins for the GPU boundaries a host without GPUs lacks: NVML's bindings and dcgm-exporter.

The NVML fake's test side (tests/fakenvml/pynvml.py): the GPUs a process sees, and faults injected
into them while it runs.

``FakeNvml(path, gpus=2)`` writes the state file; :attr:`FakeNvml.env` is what a process needs to load the
fake bindings instead of nvidia-ml-py (its folder first on ``PYTHONPATH``, the file in
``FLEETWARD_FAKE_NVML``). Each change is written atomically (a new file renamed over the old one), so a
process never reads half a state. The faults keep the hardware's rules: an Xid 79 loses the GPU, a
double-bit ECC error logs Xid 48 and raises the count.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

FAKE_BINDINGS = Path(__file__).resolve().parent / "fakenvml"

XID_DOUBLE_BIT_ECC = 48
XID_FALLEN_OFF_THE_BUS = 79


class FakeNvml:
    def __init__(self, path: Path, *, gpus: int = 2, name: str = "NVIDIA H100 80GB HBM3 (fake)",
                 init_error: str | None = None) -> None:
        self.path = path
        self.state: dict[str, Any] = {
            "init_error": init_error, "xids": [],
            "gpus": [{"uuid": f"GPU-fa4e{i:04x}-0000-4000-8000-000000000000", "name": name, "lost": False,
                      "dbe": 0, "sbe": 0, "clocks_event_reasons": 0, "retired_pending": 0, "remap_pending": 0,
                      "processes": []} for i in range(gpus)]}
        self._write()

    @property
    def env(self) -> dict[str, str]:
        path = os.pathsep.join([str(FAKE_BINDINGS), *filter(None, [os.environ.get("PYTHONPATH")])])
        return {"PYTHONPATH": path, "FLEETWARD_FAKE_NVML": str(self.path)}

    def uuid(self, gpu: int) -> str:
        return str(self.state["gpus"][gpu]["uuid"])

    def xid(self, gpu: int, code: int) -> None:
        self.state["xids"].append({"seq": len(self.state["xids"]) + 1, "gpu": gpu, "code": code})
        if code == XID_DOUBLE_BIT_ECC:
            self.state["gpus"][gpu]["dbe"] += 1
        if code == XID_FALLEN_OFF_THE_BUS:
            self.state["gpus"][gpu]["lost"] = True
        self._write()

    def throttle(self, gpu: int, mask: int) -> None:
        self.state["gpus"][gpu]["clocks_event_reasons"] = mask
        self._write()

    def run_process(self, gpu: int, pid: int) -> None:
        self.state["gpus"][gpu]["processes"].append(pid)
        self._write()

    def run_processes_matching(self, gpu: int, marker: str) -> None:
        """Every process whose command line contains ``marker`` holds a context on ``gpu`` (started later)."""
        self.state["gpus"][gpu].setdefault("processes_matching", []).append(marker)
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.path)


# -- dcgm-exporter -----------------------------------------------------------------------------------

HEALTHY = {"DCGM_FI_DEV_XID_ERRORS": 0, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 0, "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": 0,
           "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": 0, "DCGM_FI_DEV_RETIRED_PENDING": 0, "DCGM_FI_DEV_GPU_TEMP": 41}


def page(gpus: Mapping[int, Mapping[str, float]], xid_counts: Mapping[int, Mapping[int, float]] | None = None) -> str:
    """dcgm-exporter's /metrics for these GPUs: its documented names, labels and HELP/TYPE lines."""
    types = {"DCGM_FI_DEV_XID_ERRORS": "gauge", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "counter",
             "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": "counter", "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": "counter",
             "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": "counter", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": "gauge",
             "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": "gauge", "DCGM_FI_DEV_RETIRED_PENDING": "counter",
             "DCGM_FI_DEV_ROW_REMAP_PENDING": "gauge", "DCGM_FI_DEV_ROW_REMAP_FAILURE": "gauge",
             "DCGM_FI_DEV_GPU_TEMP": "gauge"}
    lines = []
    for name, kind in types.items():
        rows = [(i, v[name]) for i, v in sorted(gpus.items()) if name in v]
        if not rows:
            continue
        lines += [f"# HELP {name} {name}.", f"# TYPE {name} {kind}"]
        for i, value in rows:
            lines.append(f'{name}{{gpu="{i}",UUID="GPU-dc9m{i:04x}-0000-4000-8000-000000000000",device="nvidia{i}",'
                         f'modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-node-7",DCGM_FI_DRIVER_VERSION="550.54.15"}}'
                         f' {value:g}')
    if xid_counts:
        lines += ["# HELP DCGM_EXP_XID_ERRORS_COUNT reported XIDs during last window",
                  "# TYPE DCGM_EXP_XID_ERRORS_COUNT counter"]
        for i, counts in sorted(xid_counts.items()):
            for code, n in sorted(counts.items()):
                lines.append(f'DCGM_EXP_XID_ERRORS_COUNT{{gpu="{i}",UUID="GPU-dc9m{i:04x}-0000-4000-8000-'
                             f'000000000000",device="nvidia{i}",modelName="NVIDIA H100 80GB HBM3",'
                             f'Hostname="gpu-node-7",window_size_in_ms="300000",xid="{code}"}} {n:g}')
    return "\n".join(lines) + "\n"


class FakeDcgmExporter:
    """A test HTTP server in the place of dcgm-exporter: it serves whatever page the test sets (``set``), with
    ``status`` as its HTTP status."""

    def __init__(self) -> None:
        self.text = ""
        self.status = 200
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = exporter.text.encode()
                self.send_response(exporter.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def __enter__(self) -> FakeDcgmExporter:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def set(self, gpus: Mapping[int, Mapping[str, float]],
            xid_counts: Mapping[int, Mapping[int, float]] | None = None) -> None:
        self.text = page(gpus, xid_counts)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

