"""The data plane rides through a control-plane outage (issue 65): ``chaos/experiments/control-store-outage.yaml``
as a user runs it. The fleet's one etcd member is frozen for 15 s under streaming load and a worker is killed
while it is away: no request fails, every stream is exact, the killed worker's streams move, and the router says
it kept the workers whose records lapsed with the store (without that, requests failed in the seconds after the
store came back: docs/chaos.md)."""

from __future__ import annotations

import json
from pathlib import Path

from testkit import run_experiment


def test_a_store_outage_costs_no_request(tmp_path: Path) -> None:
    out = tmp_path / "run"
    journal = run_experiment("control-store-outage.yaml", out)
    assert journal["workload"]["failed"] == 0 and journal["workload"]["ok"] > 100
    with (out / "history.jsonl").open() as f:
        kinds = [r.get("kind") for line in f if (r := json.loads(line))["type"] == "event"]
    assert kinds.count("migration") > 0, "the worker killed while the store was away had streams that moved"
    router_log = (out / "fleet" / "logs" / "router-0.log").read_text()
    assert "vanished while the store was unreachable" in router_log
