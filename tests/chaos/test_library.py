"""The experiment library end to end, one experiment per fault family, on simulated workers.

Each runs as a user runs it (``fleetward chaos run FILE``: its own etcd and broker, real processes) and
must complete with every checker passing. The vLLM one runs in tests/vllm; the 3-member etcd one is left
to ``test_faults_control`` (same faults, shared fleet), which keeps this module to about two minutes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit import LIBRARY, run_experiment

from fleetward.chaos.hostnet import HostNetwork

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
    journal = run_experiment(FAMILIES[family], tmp_path / "run")
    families = {a["activity"]["fault"].split(".")[0] for a in journal["run"]}
    assert family in families
    assert all(a["status"] == "succeeded" and a["output"]["verified"] for a in journal["run"]), journal["run"]
