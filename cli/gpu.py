"""``fleetward gpu``: this host's GPUs at a glance, as its node agent sees them.

It opens the GPU health source the fleet file names (``gpu:``; ``--source`` and ``--dcgm-url`` override it),
reads each GPU once, and judges what it reports by the same policy the agent acts on (``gpu.policy``):
``ok``, ``degraded`` (slow), ``restart_worker`` or ``drain_and_quarantine``. Where a fleet is reachable (the
same places ``fleetward status`` looks) it names the workers on each GPU (by the GPUs the agent gave or
found for them, and by NVML's compute processes against their process trees) and any quarantine.
``--self-test`` runs the deterministic matmul check on each GPU (``--gpu N`` for some), with its time.

Exit status: 0 when every GPU is fine, 1 when one needs action or fails its self-test, or when this host has
no GPU source (the message says why: no bindings, no GPU, the exporter unreachable), 2 for a bad fleet file.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fleetward.cli.common import fleet_file, local_access, local_endpoint, state_file
from fleetward.fleet.config import FleetConfig, GpuConfig
from fleetward.fleet.errors import ConfigError, FleetwardError, StoreError
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.registry import read_fleet

if TYPE_CHECKING:
    from fleetward.supervisor.gpu import GpuHealthSource, GpuPolicy
    from fleetward.supervisor.gpuhost import GpuChoice

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("gpu", help="this host's GPUs: health by the policy, the workers on each, a self-test")
    p.add_argument("--config", type=Path, help="fleet file: its gpu: section and cluster (default: "
                   "$FLEETWARD_CONFIG, else /etc/fleetward/fleet.yaml where it exists)")
    p.add_argument("--source", choices=("auto", "nvml", "dcgm"), help="where to read GPU health (default: the "
                   "file's gpu.source, else auto)")
    p.add_argument("--dcgm-url", dest="dcgm_url", help="dcgm-exporter's /metrics (default: the file's gpu.dcgm_url)")
    p.add_argument("--self-test", dest="self_test", action="store_true", help="run the matmul self-test on each GPU")
    p.add_argument("--gpu", dest="gpus", type=int, action="append", help="only this GPU (NVML index); repeatable")
    p.add_argument("--json", action="store_true", help="print JSON (stable shape, for scripts)")
    p.add_argument("--node", help="this host's node name in the fleet (default: the file's node, the host name)")
    p.add_argument("--cluster", default=None)
    p.add_argument("--etcd", help="the fleet's etcd, to name the workers on each GPU (default: as `fleetward "
                   "status` finds it; none found: workers are not shown)")
    p.add_argument("--run-dir", dest="run_dir", type=Path, default=None)


def run(args: argparse.Namespace, out: Console, err: Console) -> int:
    # The supervisor's GPU parts are imported here, not with the parser: every fleetward process builds the
    # parser, and they cost a router or an agent half a second of start-up.
    from fleetward.supervisor.gpu import Action
    from fleetward.supervisor.gpuhost import open_source, policy_of

    given = fleet_file(args, system=True)
    config = given or FleetConfig()
    gpu = _gpu_config(config.gpu, args)
    source, choice = open_source(gpu)
    node = args.node or (config.node if given is not None else _local_node(args) or config.node)
    if source is None:
        report: dict[str, Any] = {"node": node, "source": choice.to_json(), "gpus": [], "fleet": None}
        if args.json:
            print(json.dumps(report, indent=2))
        err.print(f"no GPU health on this host: {escape(choice.detail)}")
        return 1
    try:
        report = _report(source, choice, policy_of(gpu), node, args)
    finally:
        source.close()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report, out)
    bad = [g for g in report["gpus"] if g["health"] in (Action.RESTART_WORKER, Action.DRAIN_AND_QUARANTINE)
           or (g["selftest"] is not None and not g["selftest"]["passed"])]
    return 1 if bad else 0


def _gpu_config(base: GpuConfig, args: argparse.Namespace) -> GpuConfig:
    changes = {k: v for k, v in (("source", args.source), ("dcgm_url", args.dcgm_url)) if v is not None}
    if not changes:
        return base
    try:
        return GpuConfig.model_validate({**base.model_dump(exclude={"policy"}), **changes, "policy": base.policy})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(first["msg"].removeprefix("Value error, "),
                          field="--dcgm-url" if "dcgm_url" in first["loc"] else "--source") from None


def _report(source: GpuHealthSource, choice: GpuChoice, policy: GpuPolicy, node: str,
            args: argparse.Namespace) -> dict[str, Any]:
    from fleetward.supervisor.gpu import Action, GpuEventKind, run_selftest

    events = source.poll()  # the first poll reports what is wrong now (ECC since reset, throttling, loss)
    processes = source.processes()
    fleet = asyncio.run(_fleet(args, node))
    wanted = set(args.gpus or [])
    known = {g.index for g in source.gpus()}
    if unknown := sorted(wanted - known):
        raise ConfigError(f"no GPU {unknown[0]} on this host (GPUs: {sorted(known)})", field="--gpu")
    gpus = []
    for info in source.gpus():
        if wanted and info.index not in wanted:
            continue
        health, reasons = Action.IGNORE, []
        for e in events:
            if e.gpu != info.index or e.kind is GpuEventKind.THROTTLE_STOPPED:
                continue
            action, reason = policy.classify(e)
            if action is not Action.IGNORE:
                reasons.append(f"{e.detail}: {reason}")
                health = max(health, action, key=lambda a: a.rank)
        pids = processes.get(info.index, frozenset())
        workers = sorted({w for w, (gs, tree) in fleet["workers"].items() if info.index in gs or pids & set(tree)})
        selftest = None
        if args.self_test:
            started = time.monotonic()
            try:
                result = dataclasses.asdict(run_selftest(source, info.index))
            except FleetwardError as exc:  # it cannot run at all here (no torch): a failed test, said why
                result = {"device": info.uuid, "passed": False, "reason": str(exc), "gpu": info.index}
            selftest = {**result, "seconds": round(time.monotonic() - started, 3)}
        gpus.append({"index": info.index, "uuid": info.uuid, "name": info.name,
                     "health": "ok" if health is Action.IGNORE else health.value, "reasons": reasons,
                     "processes": sorted(pids), "workers": workers,
                     "quarantined": fleet["quarantine"].get(info.index), "selftest": selftest})
    return {"node": node, "source": choice.to_json(), "gpus": gpus, "fleet": fleet["etcd"]}


def _local_node(args: argparse.Namespace) -> str | None:
    """The node of the local fleet `fleetward up` runs here (its state file), if one runs."""
    path = state_file(args.run_dir, args.cluster)
    try:
        node = json.loads(path.read_text()).get("node")
    except (OSError, ValueError, AttributeError):
        return None
    return str(node) if node else None


async def _fleet(args: argparse.Namespace, node: str) -> dict[str, Any]:
    """This node's workers (their GPUs and process trees) and quarantines, from the fleet's etcd if one is found."""
    none: dict[str, Any] = {"etcd": None, "workers": {}, "quarantine": {}}
    try:
        endpoint, cluster = local_endpoint(args, "etcd")
        access = local_access(args, "etcd", endpoint)
    except ConfigError:
        return none  # no fleet here: the GPUs are still worth showing
    keys = Keys(cluster)
    store = EtcdStore(endpoint, attempts=2, retry_budget_s=3.0, timeout_s=2.0, access=access)
    try:
        fleet = await read_fleet(store, keys)
        quarantined = await store.get_prefix(keys.quarantine + node + "/")
    except (StoreError, FleetwardError):
        return none
    finally:
        await store.aclose()
    workers = {w: (set(r.gpus), list(r.pids)) for w, r in fleet.workers.items() if r.node == node}
    quarantine = {}
    for kv in quarantined.items:
        gpu = kv.key.rsplit("/", 1)[-1]
        if gpu.isdigit():
            quarantine[int(gpu)] = json.loads(kv.value)
    return {"etcd": endpoint, "workers": workers, "quarantine": quarantine}


_STYLE = {"ok": "green", "degraded": "yellow", "restart_worker": "red", "drain_and_quarantine": "red"}


def _print(report: dict[str, Any], out: Console) -> None:
    src = report["source"]
    out.print(f"node {report['node']}: GPU health from {src['source']} ({escape(src['detail'])})")
    table = Table(title_justify="left")
    for col in ("GPU", "NAME", "UUID", "HEALTH", "WORKERS", "SELF-TEST"):
        table.add_column(col)
    for g in report["gpus"]:
        health = f"[{_STYLE[g['health']]}]{g['health']}[/]"
        if g["quarantined"]:
            health += f" [magenta](quarantined: {escape(str(g['quarantined'].get('reason', '')))[:60]})[/]"
        st = g["selftest"]
        selftest = "-" if st is None else (f"[green]passed[/] {st['seconds']:.2f} s" if st["passed"]
                                           else f"[red]failed[/] {st['seconds']:.2f} s: {escape(st['reason'])}")
        workers = ", ".join(g["workers"]) or ("-" if report["fleet"] else "(no fleet reachable)")
        table.add_row(str(g["index"]), escape(g["name"]), g["uuid"], health, workers, selftest)
    out.print(table)
    for g in report["gpus"]:
        for reason in g["reasons"]:
            out.print(f"  GPU {g['index']}: {escape(reason)}")
