"""The partition experiments of the library, run as a user runs them (`fleetward chaos run`, as root): hosts in
network namespaces, real drops between them. Each must pass every checker it names, and leave no namespace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from testkit import run_experiment

from fleetward.chaos.hostnet import HostNetwork, leftover_namespaces

pytestmark = pytest.mark.skipif(HostNetwork.unavailable_reason() is not None,
                                reason=str(HostNetwork.unavailable_reason()))

# partition-host-isolation.yaml runs in test_library.py (one experiment of each family).
EXPERIMENTS = ["partition-etcd-leader-minority", "partition-router-host-cut", "partition-controller-host-cut",
               "partition-agent-etcd-cut", "partition-heal-inflight-actions"]


def _run(name: str, out: Path) -> dict[str, Any]:
    before = set(leftover_namespaces())
    journal = run_experiment(f"{name}.yaml", out, timeout=400)
    assert set(leftover_namespaces()) <= before  # its hosts are gone
    assert all(a["status"] == "succeeded" and a["output"]["verified"] and a["output"]["recovered"]
               for a in journal["run"]), journal["run"]
    return journal


def _records(out: Path, type_: str) -> list[dict[str, Any]]:
    with (out / "history.jsonl").open() as f:
        return [r for line in f if (r := json.loads(line))["type"] == type_]


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_partition_experiment_passes(name: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    journal = _run(name, out)
    if name == "partition-etcd-leader-minority":
        (split,) = [a for a in journal["run"] if a["activity"]["fault"] == "partition.split"]
        detail = split["output"]["fault"]["detail"]
        assert detail["etcd_leader_was"] in detail["minority"]  # the leader really was on the small side
        scale = [w for w in _records(out, "write") if w["key"].startswith("scale/")]
        assert scale, "the autoscaler wrote no decision: minority_quiet had nothing to check"
    if name == "partition-controller-host-cut":  # the controllers could not reach h0-w0; router-0 could
        assert not [w for w in _records(out, "write") if w["key"].startswith("actions/h0/")], "a serving worker " \
            "that only the controllers could not reach was acted on"
    if name == "partition-heal-inflight-actions":  # the hung worker was restarted, once
        restarts = {w["key"] for w in _records(out, "write") if w["key"].startswith("actions/h0/h0-w0.restart")
                    and (w["value"] or {}).get("status") == "done"}
        assert len(restarts) == 1, restarts
