"""``fleetward worker add|remove``: adopt a server fleetward did not start, or give one up.

``add`` writes ``attach/<id>`` (an :class:`~fleetward.fleet.config.AttachConfig`) in the fleet's etcd and
waits until the agent of its node registered it; ``remove`` deletes it and waits until the agent gave the
server up (it keeps running). See :mod:`fleetward.supervisor.adoption`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json

from pydantic import ValidationError

from fleetward.cli.common import local_access, local_endpoint, operator_token, out, state_file
from fleetward.fleet.config import AttachConfig, FleetConfig, validation_error
from fleetward.fleet.errors import ConfigError, FleetwardError
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.registry import publish_attachments, read_fleet, wait_registered
from fleetward.fleet.signing import AttachSigner

__all__ = ["add_worker", "remove_worker"]


def _endpoint(args: argparse.Namespace) -> tuple[str, str, str]:
    """(etcd, cluster, node): the flags, else the local fleet's state file (its node too)."""
    etcd, cluster = local_endpoint(args, "etcd")
    node = FleetConfig().node
    path = state_file(args.run_dir, args.cluster)
    if path.exists():
        with contextlib.suppress(ValueError, OSError):
            node = str(json.loads(path.read_text()).get("node") or node)
    return etcd, cluster, node


def _signer(args: argparse.Namespace, *, required: bool) -> AttachSigner | None:
    """The admin token's signer for the record: agents run no restart command from an unsigned one."""
    try:
        return AttachSigner(operator_token(args))
    except ConfigError as exc:
        if not required:
            return None  # nothing in the record that an agent runs
        raise ConfigError(f"a --restart-command is run by the node's agent only when the admin token signed it: "
                          f"{exc}", field="admin_token_file") from None


async def add_worker(args: argparse.Namespace) -> int:
    etcd, cluster, local_node = _endpoint(args)
    process = ({"pidfile": args.pidfile} if args.pidfile else {"systemd_unit": args.systemd_unit}
               if args.systemd_unit else {"container": args.container} if args.container else None)
    try:
        entry = AttachConfig.model_validate({
            "url": args.url, "id": args.worker_id, "model": args.model, "role": args.role,
            "node": args.node or local_node, "process": process,
            "restart_command": args.restart_command or ()})
    except ValidationError as exc:
        raise validation_error(exc, file="<command line>", lines={}) from None
    keys = Keys(cluster)
    signer = _signer(args, required=bool(entry.restart_command))
    async with EtcdStore(etcd, attempts=3, retry_budget_s=5.0, access=local_access(args, "etcd", etcd)) as store:
        (worker,) = await publish_attachments(store, keys, [entry], local_node, signer=signer)
        assert entry.node is not None
        out.print(f"{worker}: {entry.url} is to be adopted by the agent of node {entry.node}")
        if args.wait <= 0:
            return 0
        try:
            await wait_registered(store, keys, [worker], timeout=args.wait)
        except TimeoutError:
            raise FleetwardError(f"{worker} was not adopted within {args.wait:g}s: is the server answering at "
                                 f"{entry.url}, and does an agent run on node {entry.node} (`fleetward agent`, or "
                                 "`fleetward up`)? The entry stays: it is adopted as soon as both hold.") from None
        fleet = await read_fleet(store, keys)
        health, record = fleet.health.get(worker), fleet.workers.get(worker)
    watched = "its process watched" if process else "known by URL only (no process watched)"
    restart = "restarted by its command when it fails" if entry.restart_command else \
        "drained and left for an operator when it fails"
    # A loopback URL is registered at the node's address (advertise_host): say where routers connect.
    where = f", registered as {record.url} for other hosts" if record is not None and record.url != entry.url else ""
    out.print(f"{worker}: adopted{where} ({health.state.value if health else 'starting'}); {watched}; {restart}")
    return 0


async def remove_worker(args: argparse.Namespace) -> int:
    etcd, cluster, _ = _endpoint(args)
    keys = Keys(cluster)
    async with EtcdStore(etcd, attempts=3, retry_budget_s=5.0, access=local_access(args, "etcd", etcd)) as store:
        if await store.get(keys.attached(args.worker)) is None:
            known = sorted((await read_fleet(store, keys)).workers)
            raise ConfigError(f"{args.worker} is not a server fleetward adopted (workers: {', '.join(known) or 'none'}"
                              "); fleetward's own workers are stopped with `fleetward drain`", field="worker")
        await store.delete(keys.attached(args.worker))
        if args.wait > 0:
            async with asyncio.timeout(args.wait):
                while True:
                    if await store.get(keys.worker(args.worker)) is None:
                        break
                    await asyncio.sleep(0.1)
    out.print(f"{args.worker}: given up; the server keeps running")
    return 0


