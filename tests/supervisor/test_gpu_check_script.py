"""scripts/gpu-check.sh, the check meant for a machine with an NVIDIA GPU, run here over the NVML fake and
without CUDA: every step runs and reports, and the self-test, which needs CUDA, fails the run, as it must.
What it prints on a real GPU is in docs/operations.md."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gpufakes import FakeNvml

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check.sh"


def test_the_gpu_check_runs_every_step_and_fails_without_cuda(tmp_path: Path) -> None:
    nvml = FakeNvml(tmp_path / "nvml.json", gpus=1)
    nvml.run_processes_matching(0, str(tmp_path / "out" / "cuda-worker.pid"))  # the server the script starts
    r = subprocess.run([str(SCRIPT), "--out", str(tmp_path / "out"), "--", "--no-cuda-context"],
                       capture_output=True, text=True, timeout=400,
                       env={**os.environ, **nvml.env, "PYTHON": sys.executable})
    out = r.stdout
    assert r.returncode == 1 and "GPU CHECK FAILED" in out, out + r.stderr
    passed = [line.split("ok", 1)[1].strip() for line in out.splitlines() if line.startswith("  ok ")]
    assert passed == [
        "NVML lists the GPUs", "the fleet and the adopted CUDA server are ready",
        "the agent announced its GPU source: nvml", "fleetward gpu reports GPU 0", "GPU 0 is healthy by the policy",
        "NVML lists the adopted server's process on GPU 0", "GPU 0 maps to both workers",
        "gpucheck-w0 is registered on GPU 0", "the gpu detector watches gpucheck-w0",
        "cuda-worker is registered on GPU 0", "the gpu detector watches cuda-worker"], out
    failed = [line for line in out.splitlines() if line.startswith("  FAILED")]
    assert len(failed) == 1 and "self-test on GPU 0" in failed[0] and "CUDA" in failed[0], out
    assert "GPU health on gpucheck: nvml (1 GPU: NVIDIA H100 80GB HBM3 (fake))" in out
