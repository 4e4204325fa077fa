"""Process faults on real vLLM (CPU): the engine kill and vLLM's silent hang (SIGSTOP of EngineCore)."""

from __future__ import annotations

import httpx
import pytest

from fleetward.chaos import faults
from fleetward.chaos.fault import CATALOGUE, Target
from fleetward.chaos.harness import TestFleet

pytestmark = pytest.mark.asyncio(loop_scope="session")
assert faults.process  # importing the package fills the catalogue


async def test_a_silent_hang_stops_the_engine_while_health_stays_200_and_sigcont_resumes_it(
        vllm_fleet: TestFleet) -> None:
    ctx = vllm_fleet.fault_context()
    worker = vllm_fleet.worker_ids[0]
    spec = CATALOGUE["hang-worker"]
    fault = spec.factory(spec.params(mode="silent", recover_timeout_s=120), Target(kind="worker", ids=(worker,)))
    try:
        await fault.inject(ctx)
        assert await fault.verify(ctx), fault.describe()
        stopped = fault.detail["stopped_pids"][worker]
        assert vllm_fleet.handle(worker).process.pid not in stopped, "the API server itself keeps running"
    finally:
        await fault.recover(ctx)
    assert await fault.verify_recovered(ctx), fault.describe()


async def test_killing_the_engine_core_is_seen_and_the_worker_serves_again(vllm_fleet: TestFleet) -> None:
    ctx = vllm_fleet.fault_context()
    worker = vllm_fleet.worker_ids[1]
    api_server = vllm_fleet.handle(worker).process.pid
    spec = CATALOGUE["kill-engine"]
    fault = spec.factory(spec.params(recover_timeout_s=240), Target(kind="worker", ids=(worker,)))
    try:
        await fault.inject(ctx)
        assert await fault.verify(ctx), fault.describe()
        assert api_server not in fault.detail["engine_pids"][worker], "only the engine was killed"
        async with httpx.AsyncClient(timeout=10) as client:
            try:
                r = await client.post(vllm_fleet.bind_url(worker) + "/v1/completions",
                                      json={"model": "tiny", "prompt": [40], "max_tokens": 1})
                assert r.status_code >= 500, "an API server without its engine cannot complete"
            except httpx.HTTPError:
                pass  # or the API server noticed and went away
    finally:
        await fault.recover(ctx)
    assert await fault.verify_recovered(ctx), fault.describe()
    assert vllm_fleet.handle(worker).process.pid != api_server
