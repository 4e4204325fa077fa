"""Process faults on real vLLM (CPU): an engine frozen by the cgroup freezer, and the library's vLLM experiment
(the whole tree killed, then frozen). The engine kill and vLLM's silent hang (SIGSTOP of EngineCore) are
injected by the same faults in test_supervisor_on_vllm, mid-stream, where the supervisor's verdict is checked
on the same restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from fleetward.chaos import faults
from fleetward.chaos.fault import CATALOGUE, Target
from fleetward.chaos.faults.process import FreezerGroup
from fleetward.chaos.harness import TestFleet
from fleetward.chaos.runner import Runner, RunOptions
from fleetward.chaos.validation import validate_experiment
from fleetward.supervisor.signals import Severity, Signal

pytestmark = pytest.mark.asyncio(loop_scope="session")
assert faults.process  # importing the package fills the catalogue
LIBRARY = Path(__file__).resolve().parents[2] / "chaos" / "experiments"


async def test_an_engine_frozen_by_the_cgroup_freezer_keeps_health_200_and_its_agent_names_the_hang(
        vllm_fleet: TestFleet, wait_until: Any) -> None:
    reason = FreezerGroup.unavailable_reason()
    if reason:
        pytest.skip(reason)
    ctx = vllm_fleet.fault_context()
    worker = vllm_fleet.worker_ids[0]
    api_server = vllm_fleet.handle(worker).process.pid  # read before the supervisor restarts the worker
    key = vllm_fleet.keys.signal(worker, "engine-frozen")
    spec = CATALOGUE["process.hang"]
    fault = spec.factory(spec.params(mode="cgroup_freeze", recover_timeout_s=240),
                         Target(kind="worker", ids=(worker,)))
    assert isinstance(fault, faults.BaseFault)

    async def named_hung() -> Signal | None:
        kv = await vllm_fleet.store.get(key)
        sig = Signal.from_json(kv.value) if kv is not None else None
        return sig if sig is not None and sig.severity is Severity.FATAL and "not scheduled" in sig.reason else None

    try:
        await fault.inject(ctx)
        assert await fault.verify(ctx), fault.describe()  # frozen, and /health still 200
        assert api_server not in fault.detail["stopped_pids"][worker], "the API server itself keeps running"
        sig = await wait_until(named_hung, timeout=60, message="the agent names the frozen engine")
        assert sig.extra.get("hang") is True
    finally:
        await fault.recover(ctx)
    assert await fault.verify_recovered(ctx), fault.describe()


async def test_the_vllm_kill_and_hang_experiment_passes_on_the_session_workers(vllm_fleet: TestFleet,
                                                                               tmp_path: Path) -> None:
    """The library's vLLM experiment end to end (kill, then freeze, the busiest worker), on this session's
    two workers instead of two more: a greedy reference run after the method, every checker passes."""
    data = yaml.safe_load((LIBRARY / "vllm-kill-and-hang.yaml").read_text())
    data["fleet"]["node"] = "cpu"  # the session fleet's node, and so its workers' names
    data["blast_radius"]["workers"] = ["cpu-w*"]
    # The freeze starts 5 s after the killed worker is back (a vLLM restart takes 30-60 s here) and lasts 10 s.
    data["workload"]["duration_s"] = 100
    result = await Runner(validate_experiment(data), RunOptions(out=tmp_path / "run", fleet=vllm_fleet,
                                                                report=False)).run()
    assert result.ok, result.failures()
    statuses = {v.checker: v.status for v in result.verdicts}
    named = ("stream_exactness", "sse_ids", "availability", "detection", "migration_limit", "fault_verification")
    assert {c: statuses.get(c) for c in named} == dict.fromkeys(named, "pass"), statuses
    assert [a["activity"]["name"] for a in result.journal["run"]] == ["kill", "freeze"]
