"""The fault catalogue: importing this package registers every fault in
:data:`fleetward.chaos.fault.CATALOGUE`.

Families and modules: ``process`` (:mod:`.process`), ``gpu`` (:mod:`.gpu`, through the fleet's GPU health
source), ``network`` (:mod:`.network`, through :mod:`fleetward.chaos.net`), ``control`` (:mod:`.control`),
``kv`` (:mod:`.kv`), ``partition`` (:mod:`.partition`, between the hosts of a
multi-host fleet), ``load`` (:mod:`.load`, through the run's workload). Build a fault from the
catalogue::

    spec = CATALOGUE["process.kill_worker"]
    fault = spec.factory(spec.params(scope="tree"), Target(kind="worker", ids=("node-w0",)))
    await fault.inject(ctx); assert await fault.verify(ctx)
    await fault.recover(ctx); assert await fault.verify_recovered(ctx)

or all of that in one call, which raises :class:`FaultCheckFailed` when a verification fails::

    fault = await cycle(ctx, "process.kill_worker", Target(kind="worker", ids=("node-w0",)), scope="tree")

``ctx`` is a :class:`~fleetward.chaos.fault.FaultContext`; ``TestFleet.fault_context()`` makes one.
"""

from __future__ import annotations

from fleetward.chaos.faults import control, gpu, kv, load, network, partition, process
from fleetward.chaos.faults._base import BaseFault, FaultCheckFailed, FaultParams, FaultUnavailable, cycle
from fleetward.chaos.faults.network import probe_link

__all__ = [
    "BaseFault",
    "FaultCheckFailed",
    "FaultParams",
    "FaultUnavailable",
    "control",
    "cycle",
    "gpu",
    "kv",
    "load",
    "network",
    "partition",
    "probe_link",
    "process",
]
