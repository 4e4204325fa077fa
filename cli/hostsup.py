"""``fleetward up --hosts N``: the local fleet spread over N hosts, each a network namespace of this machine (root).

The hosts are a :class:`~fleetward.chaos.hostnet.HostNetwork` and the fleet a
:class:`~fleetward.chaos.hosts.HostsFleet` (a 3-member etcd over the first hosts, the broker on ``h0``, an agent
with ``--workers`` simulated workers on each host, two controllers and two routers spread over them). This
process moves onto the clients' namespace before anything starts and stays there; it writes the fleet's
``fleet.json`` as ``fleetward up`` does, so the operator commands work from that namespace
(``ip netns exec <clients> fleetward status``) and ``fleetward chaos run --attach`` too. Ctrl-C stops it all and
removes the namespaces; a ``kill -9`` of this process leaves it to the reaper.
"""

from __future__ import annotations

import asyncio
import os
import threading

from rich.console import Console

from fleetward.chaos.hostnet import HostNetwork
from fleetward.chaos.hosts import HostsFleet
from fleetward.fleet.backends import make_backend
from fleetward.fleet.config import FleetConfig
from fleetward.fleet.errors import ConfigError
from fleetward.fleet.shutdown import install_stop_handlers
from fleetward.fleet.state import StateFile, state_path, write_admin_token

__all__ = ["hosts_up"]

err = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False, soft_wrap=True)


def hosts_up(config: FleetConfig, hosts: int) -> int:
    """Make the hosts, enter the clients' namespace, run the fleet until Ctrl-C, remove the hosts."""
    reason = HostNetwork.unavailable_reason()
    if reason:
        raise ConfigError(f"--hosts {hosts}: {reason}", field="--hosts")
    if config.backend != "sim":
        raise ConfigError(f"--hosts runs simulated workers, not {config.backend}", field="backend")
    if config.etcd or config.mqtt:
        raise ConfigError("--hosts starts its own etcd cluster and broker on its hosts: leave etcd and mqtt unset",
                          field="etcd")
    if threading.active_count() > 1:
        raise RuntimeError("the hosts must be made before any thread starts")
    net = HostNetwork(hosts).create()
    try:
        net.enter("clients")
        return asyncio.run(_serve(config, net))
    finally:
        net.destroy()


async def _serve(config: FleetConfig, net: HostNetwork) -> int:
    stop = asyncio.Event()
    install_stop_handlers(stop)
    root = config.run_dir / config.cluster
    backend = make_backend(config.backend, sim=config.sim, vllm=config.vllm, run_dir=config.run_dir)
    err.print(f"[bold]fleetward up[/]: cluster {config.cluster} on {len(net.hosts)} hosts (network namespaces "
              f"{net.prefix}h0..), {config.workers} simulated worker(s) on each")
    state = StateFile(state_path(config.run_dir, config.cluster))
    fleet = HostsFleet(net, cluster=config.cluster, run_dir=root, backend=backend, workers_per_host=config.workers,
                       routing=config.routing, supervisor=config.supervisor, lease_ttl_s=config.lease_ttl_s,
                       autoscale=config.autoscale, say=lambda what: err.print(f"  {what}"))
    async with fleet:
        with err.status("waiting for the workers…"):
            await fleet.wait_routable()
        token = root / "admin-token"
        write_admin_token(token, fleet.admin_token)
        state.data = {**fleet.state(), "pid": os.getpid(), "admin_token_file": str(token)}
        state.write()
        enter = f"ip netns exec {net.clients.ns}"
        out.print(f"\n[bold green]fleet {config.cluster} is up[/] on {len(net.hosts)} hosts")
        for h in net.hosts:
            runs = ", ".join(s for s, where in fleet.placement.items() if where == h.name)
            out.print(f"  {h.name}  {h.address}  ({h.ns}): {runs}")
        out.print(f"  clients  {net.clients.address}  ({net.clients.ns}): reach the fleet from there")
        out.print(f"  etcd    {fleet.etcd_endpoint}")
        out.print(f"  status  {enter} fleetward status --run-dir {config.run_dir} --cluster {config.cluster}")
        router = fleet.services["router-0"].url
        out.print(f"  try     {enter} curl -N {router}/v1/completions -H 'content-type: application/json' "
                  f"-d '{{\"model\":\"{backend.model_name}\",\"prompt\":\"Hello\",\"max_tokens\":16,\"stream\":true}}'")
        out.print("\nCtrl-C (or SIGTERM) stops everything and removes the hosts.")
        try:
            await stop.wait()
        finally:
            state.remove()
    err.print("stopped; the hosts are removed")
    return 0
