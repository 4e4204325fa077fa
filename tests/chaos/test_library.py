"""The experiment library end to end, one experiment per fault family, on simulated workers.

Each runs as a user runs it (``fleetward chaos run FILE``: its own etcd and broker, real processes) and
must complete with every checker passing. The vLLM one runs in tests/vllm; the 3-member etcd one is left
to ``test_faults_control`` (same faults, shared fleet), which keeps this module to about two minutes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleetward.chaos.hostnet import HostNetwork

LIBRARY = Path(__file__).resolve().parents[2] / "chaos" / "experiments"

FAMILIES = {
    "process": "process-kill-worker.yaml",
    "gpu": "gpu-xid-ecc-throttle.yaml",
    "network": "network-worker-link.yaml",
    "kv": "kv-transfer.yaml",
    "control": "control-supervisor-leader-kill.yaml",
    "load": "load-burst.yaml",
    "partition": "partition-host-isolation.yaml",
}


def test_the_chosen_files_cover_every_family_and_exist() -> None:
    from fleetward.chaos.fault import FAMILIES as ALL

    assert set(FAMILIES) == set(ALL)
    assert all((LIBRARY / f).is_file() for f in FAMILIES.values())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_library_experiment_of_each_family_passes(family: str, tmp_path: Path) -> None:
    if family == "partition" and (why := HostNetwork.unavailable_reason()):
        pytest.skip(why)
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "fleetward.cli", "chaos", "run", str(LIBRARY / FAMILIES[family]),
                           "--out", str(out), "--no-report"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    journal = json.loads((out / "journal.json").read_text())
    verdicts = {v["checker"]: v["status"] for v in journal["checks"]["verdicts"]}
    assert verdicts and set(verdicts.values()) == {"pass"}, verdicts
    families = {a["activity"]["fault"].split(".")[0] for a in journal["run"]}
    assert family in families
    assert all(a["status"] == "succeeded" and a["output"]["verified"] for a in journal["run"]), journal["run"]
