"""The live fleet the autoscaler tests scale: one simulated worker to start with (the agent starts more when
asked), a supervisor controller as a process (its control API is the local actuator's way in) and a router.

A test module sets ``SIM`` (its simulated worker) by defining the ``sim_config`` fixture; the supervisor
settings make new workers ready within a second or two.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from fleetward.chaos.harness import TestFleet
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.config import SimConfig, SupervisorConfig

SUPERVISOR = SupervisorConfig(canary_interval_s=2.0, canary_timeout_s=2.0, backoff_initial_s=0.05,
                              backoff_max_s=0.2, lease_ttl_s=2, progress_interval_s=0.1)


@pytest_asyncio.fixture
async def fleet(etcd_endpoint: str, broker_endpoint: str, cluster: str, tmp_path: Path,
                sim_config: SimConfig) -> AsyncIterator[TestFleet]:
    async with TestFleet(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster=cluster, run_dir=tmp_path, workers=1,
                         backend=SimBackend(sim_config), supervisor=SUPERVISOR, controller_processes=1) as f:
        await f.start_router("r0")
        yield f
