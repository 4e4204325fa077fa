"""``fleetward``: the command line.

    fleetward up [--workers N] [--backend sim|vllm] [--config FILE] ...   start a local fleet
    fleetward status [--json]                                             the fleet as etcd sees it
    fleetward events [KIND ...]                                           follow the event bus
    fleetward model tiny --out DIR [--seed N] [--tokenizer bpe|sp|byte]   write the tiny local model
    fleetward supervisor --role agent ...                                 one node's agent (multi-host)
    fleetward autoscaler [--policy P] [--interval S] [--min N] [--max N]   the leader-elected autoscaler daemon
    fleetward bench router|migration|restart|checkpoints ...             benchmarks (docs/benchmarks.md)
    fleetward profile [--backend sim|vllm | --url URL] [--out FILE]      one worker's capacity (autoscaler model)
    fleetward gpu [--self-test] [--json]                                  this host's GPUs, their health and workers
    fleetward replay TRACE [--simulate] [--json] ...                     a trace live, or every policy simulated
    fleetward chaos run|check|faults|validate ...                        chaos experiments (docs/chaos.md)
    fleetward deploy kubernetes --config FILE --out DIR ...              Kubernetes manifests (docs/deploy.md)

Errors fleetward raises on purpose (:class:`FleetwardError`) print as one clear line and exit 2 (bad
input) or 1 (anything else); a traceback means a bug.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.markup import escape
from rich.table import Table

from fleetward.cli.common import admin_token, err, local_access, local_endpoint, operator_token, out, state_file
from fleetward.fleet.backends import BACKENDS
from fleetward.fleet.config import (
    FleetConfig,
    RouterConfig,
    load_fleet_config,
    resolve_access,
    validation_error,
)
from fleetward.fleet.errors import ConfigError, FleetwardError
from fleetward.fleet.shutdown import install_stop_handlers

__all__ = ["main"]

log = logging.getLogger("fleetward")

# Flags of `up` that map 1:1 to FleetConfig fields (flag dest -> field).
_UP_FIELDS = ("cluster", "workers", "prefill_workers", "backend", "host", "run_dir", "etcd", "etcd_port", "mqtt",
              "mqtt_port", "worker_base_port", "lease_ttl_s", "node", "admin_token_file", "etcd_host", "mqtt_host",
              "tls", "advertise_host")


# Flags of `autoscaler` (and `up --autoscale`) that map to the fleet file's autoscale: section.
_AUTOSCALE_FLAGS = (("autoscale_enabled", "autoscale.enabled"), ("policy", "autoscale.policy"),
                    ("interval_s", "autoscale.interval_s"), ("min_workers", "autoscale.min_workers"),
                    ("max_workers", "autoscale.max_workers"), ("ttft_s", "autoscale.ttft_s"),
                    ("itl_s", "autoscale.itl_s"), ("ttft_per_1k_s", "autoscale.ttft_per_1k_s"),
                    ("capacity", "autoscale.capacity"),
                    ("per_worker_rps", "autoscale.per_worker_rps"), ("autoscaler_port", "autoscale.port"),
                    ("prometheus_enabled", "prometheus.enabled"), ("gpu_source", "gpu.source"))


# What each command that reads a fleet file takes as flags: only what it uses (`up` runs everything). The
# daemons of a production install attach to the cluster's etcd and broker; they start neither.
_DAEMON = ("config", "cluster", "run_dir", "etcd", "mqtt", "admin_token_file")
_AGENT = (*_DAEMON, "workers", "prefill_workers", "backend", "model", "host", "worker_base_port", "lease_ttl_s",
          "node", "advertise_host", "gpu_source")
_CONTROLLER = (*_DAEMON, "host")
_FLAGS_OF = {"agent": _AGENT, "controller": _CONTROLLER, "supervisor": tuple(dict.fromkeys(_AGENT + _CONTROLLER)),
             "autoscaler": (*_DAEMON, "host", "backend")}


def _add_fleet_flags(p: argparse.ArgumentParser, command: str = "up") -> None:
    wanted = _FLAGS_OF.get(command)
    host = {"up": "address the router, the controller and the workers bind to; default 127.0.0.1 (not etcd and the "
                  "broker: --etcd-host, --mqtt-host)",
            "agent": "address this node's workers bind to; default 127.0.0.1",
            "controller": "address the control API binds to (supervisor.host); default 127.0.0.1",
            "autoscaler": "address its /health and /metrics bind to (autoscale.host); default 127.0.0.1"}
    daemon = command != "up"
    flags: list[tuple[str, tuple[str, ...], dict[str, Any]]] = [
        ("config", ("--config",), {"type": Path, "help": "YAML file with any of the settings below (flags win)"}),
        ("cluster", ("--cluster",), {"help": "cluster name (etcd prefix /fleetward/<cluster>/); default local"}),
        ("workers", ("--workers",), {"type": int, "help": "number of workers to start; default 3"}),
        ("prefill_workers", ("--prefill-workers",), {"type": int, "help": "of those, how many prefill (the rest "
                                                     "decode; docs/pd.md); default 0: all aggregated"}),
        ("backend", ("--backend",), {"choices": list(BACKENDS), "help": "simulated workers (default) or real vLLM"}),
        ("model", ("--model",), {"help": "vllm backend: model folder (default: the tiny local model, made on "
                                 "demand)"}),
        ("host", ("--host",), {"help": host.get(command, host["agent"])}),
        ("run_dir", ("--run-dir",), {"type": Path, "help": "where logs and data go; default .fleetward"}),
        ("etcd", ("--etcd",), {"help": "the cluster's etcd (host:port)" if daemon
                               else "use this etcd (host:port) instead of starting one"}),
        ("etcd_port", ("--etcd-port",), {"type": int, "help": "port for the embedded etcd"}),
        ("mqtt", ("--mqtt",), {"help": "the cluster's MQTT broker (host:port)" if daemon
                               else "use this MQTT broker (host:port) instead of starting one"}),
        ("mqtt_port", ("--mqtt-port",), {"type": int, "help": "port for the embedded broker"}),
        ("etcd_host", ("--etcd-host",), {"help": "address the embedded etcd binds; default 127.0.0.1 (--host does "
                                         "not expose it)"}),
        ("mqtt_host", ("--mqtt-host",), {"help": "address the embedded broker binds; default 127.0.0.1"}),
        ("tls", ("--tls",), {"action": "store_true", "default": None, "help": "the embedded etcd and broker speak "
                             "only TLS with client certificates and passwords (all generated in the run dir)"}),
        ("worker_base_port", ("--worker-base-port",), {"type": int, "help": "first worker port"}),
        ("router_port", ("--router-port",), {"type": int, "help": "the router's port (routing.port); default a free "
                                             "one"}),
        ("lease_ttl_s", ("--lease-ttl",), {"type": int, "help": "registration lease TTL in seconds"}),
        ("node", ("--node",), {"help": "this node's name; default the host name"}),
        ("advertise_host", ("--advertise-host",), {"help": "the address other hosts reach this node's workers and "
                                                   "adopted servers at, where they listen on loopback or every "
                                                   "address; default this host's address on its route to etcd"}),
        ("admin_token_file", ("--admin-token-file",), {"type": Path, "help": "a file holding the admin token (mode "
                                                       "0600); FLEETWARD_ADMIN_TOKEN wins over it"}),
        ("gpu_source", ("--gpu",), {"choices": ("auto", "nvml", "dcgm", "off"), "help": "where the agent reads GPU "
                                    "health (gpu.source): auto (default: NVML when it sees a GPU, else off), nvml, "
                                    "dcgm (gpu.dcgm_url) or off"}),
    ]
    for dest, names, kw in flags:
        if wanted is None or dest in wanted:
            p.add_argument(*names, dest=dest, **kw)


def _add_access_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=None, help="the cluster's fleet file: its etcd, broker, cluster, "
                   "TLS and passwords, admin token (default: $FLEETWARD_CONFIG, else the local fleet's, else "
                   "/etc/fleetward/fleet.yaml)")


def _fleet_config(args: argparse.Namespace) -> FleetConfig:
    overrides: dict[str, Any] = {f: getattr(args, f) for f in _UP_FIELDS if getattr(args, f, None) is not None}
    for flag, key in (("model", "vllm.model"), ("router_port", "routing.port"), *_AUTOSCALE_FLAGS):
        if getattr(args, flag, None) is not None:
            overrides[key] = getattr(args, flag)
    return load_fleet_config(args.config, overrides)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fleetward", description="Reliability layer and chaos testbed for LLM "
                                "inference fleets.")
    p.add_argument("--log-level", default=os.environ.get("FLEETWARD_LOG_LEVEL", "WARNING"),
                   help="DEBUG, INFO, WARNING (default) or ERROR")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="start a local fleet and keep it running until Ctrl-C / SIGTERM")
    _add_fleet_flags(up)
    up.add_argument("--autoscale", dest="autoscale_enabled", action="store_true", default=None,
                    help="start the autoscaler too (its settings: the fleet file's autoscale: section)")
    up.add_argument("--hosts", type=int, default=1, help="(root) spread the fleet over N hosts, each a network "
                    "namespace of this machine: a 3-member etcd, --workers simulated workers on each host, two "
                    "controllers and two routers; the partition faults act between them (docs/chaos.md)")
    up.add_argument("--prometheus", dest="prometheus_enabled", action="store_true", default=None,
                    help="start a local Prometheus that scrapes the fleet and runs the alert rules")

    st = sub.add_parser("status", help="show the fleet as etcd sees it")
    st.add_argument("--cluster", default=None)
    st.add_argument("--etcd", help="etcd host:port (default: the local fleet started by `fleetward up`)")
    st.add_argument("--run-dir", dest="run_dir", type=Path, default=None)
    st.add_argument("--json", action="store_true", help="print JSON (stable shape, for scripts)")
    _add_access_flag(st)

    ev = sub.add_parser("events", help="print events from the bus as they arrive")
    ev.add_argument("kinds", nargs="*", default=["#"], help="event kinds (e.g. worker.down); default all")
    ev.add_argument("--cluster", default=None)
    ev.add_argument("--mqtt", help="broker host:port (default: the local fleet's)")
    ev.add_argument("--run-dir", dest="run_dir", type=Path, default=None)
    ev.add_argument("--count", type=int, default=0, help="exit after this many events")
    _add_access_flag(ev)

    model = sub.add_parser("model", help="local models")
    msub = model.add_subparsers(dest="model_command", required=True, metavar="KIND")
    tiny = msub.add_parser("tiny", help="write the tiny Llama that real vLLM serves on a CPU")
    tiny.add_argument("--out", type=Path, required=True, help="folder to write")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--tokenizer", choices=("bpe", "sp", "byte"), default="bpe",
                      help="the vocabulary: bpe (byte-level BPE, 4,096 ids; default), sp (SentencePiece-style, "
                           "byte fallback) or byte (259 ids, one per byte)")

    rt = sub.add_parser("router", help="run a router (OpenAI-compatible front door with stream migration)")
    rt.add_argument("--config", type=Path, help="fleet YAML file; its `routing:` section configures the router")
    rt.add_argument("--cluster", default=None)
    rt.add_argument("--etcd", help="etcd host:port (default: the local fleet's)")
    rt.add_argument("--mqtt", help="broker host:port (default: the local fleet's)")
    rt.add_argument("--run-dir", dest="run_dir", type=Path, default=None)
    rt.add_argument("--host", help="address to bind; default 127.0.0.1")
    rt.add_argument("--port", type=int, help="port to bind; default a free one")
    rt.add_argument("--id", dest="router_id", help="router id (default: random)")
    rt.add_argument("--migration-limit", dest="migration_limit", type=int)
    rt.add_argument("--no-checkpoints", dest="checkpoints", action="store_false", default=None,
                    help="do not checkpoint to etcd (only to measure what checkpoints cost)")
    rt.add_argument("--processes", type=int, help="router processes on the one port (default: routing.processes, 1)")
    rt.add_argument("--reuse-port", dest="reuse_port", action="store_true", help=argparse.SUPPRESS)

    sup = sub.add_parser("supervisor", help="run supervisor parts alone (for multi-host fleets)")
    sup.add_argument("--role", choices=["agent", "controller"], required=True,
                     help="agent: start and watch this node's workers; controller: campaign to lead health decisions")
    sup.add_argument("--id", dest="controller_id", help="controller id (default: random)")
    sup.add_argument("--port", dest="supervisor_port", type=int, help="controller: control API port")
    _add_fleet_flags(sup, "supervisor")

    # The long-running daemons of a production install (deploy/systemd/): one YAML file each.
    ag = sub.add_parser("agent", help="daemon: this node's agent (its workers, and the servers it adopts)")
    _add_fleet_flags(ag, "agent")
    ct = sub.add_parser("controller", help="daemon: a supervisor controller (leader-elected; health, remediation)")
    ct.add_argument("--id", dest="controller_id", help="controller id (default: random)")
    ct.add_argument("--port", dest="supervisor_port", type=int, help="control API port")
    _add_fleet_flags(ct, "controller")

    asc = sub.add_parser("autoscaler", help="daemon: the autoscaler (leader-elected; SLA-driven scaling of each "
                         "pool, drains on scale-down)")
    asc.add_argument("--id", dest="autoscaler_id", help="autoscaler id (default: random)")
    asc.add_argument("--port", dest="autoscaler_port", type=int, help="its /health and /metrics port")
    asc.add_argument("--policy", choices=["fleetward", "reactive", "dynamo-style", "static-peak"])
    asc.add_argument("--interval", dest="interval_s", type=float, help="seconds between decisions; default 30")
    asc.add_argument("--min", dest="min_workers", type=int, help="fewest workers per pool; default 1")
    asc.add_argument("--max", dest="max_workers", type=int, help="most workers per pool; default 8")
    asc.add_argument("--ttft", dest="ttft_s", type=float, help="SLA: p99 TTFT in seconds; default 2")
    asc.add_argument("--itl", dest="itl_s", type=float, help="SLA: p99 mean ITL in seconds; default 0.05")
    asc.add_argument("--ttft-per-1k", dest="ttft_per_1k_s", type=float,
                     help="SLA: TTFT allowed per 1,000 prompt tokens on top of --ttft, s; default 0")
    asc.add_argument("--capacity", type=Path, help="capacity model file (fleetward profile, replay)")
    asc.add_argument("--per-worker-rps", dest="per_worker_rps", type=float,
                     help="a flat capacity instead: requests/s one worker carries within the SLA")
    _add_fleet_flags(asc, "autoscaler")

    cf = sub.add_parser("config", help="fleet files: check one without starting anything")
    cfsub = cf.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    check = cfsub.add_parser("check", help="validate a fleet file as the daemons read it (schema, secret files, "
                             "TLS files, API keys), naming file, line and field")
    check.add_argument("file", type=Path)

    wk = sub.add_parser("worker", help="servers fleetward did not start: adopt one (add), give one up (remove)")
    wsub = wk.add_subparsers(dest="worker_command", required=True, metavar="ACTION")
    add = wsub.add_parser("add", help="protect a running vLLM (OpenAI-compatible) server given by URL")
    add.add_argument("url", help="http://host:port of the server")
    add.add_argument("--id", dest="worker_id", help="worker id (default <node>-<host>-<port>)")
    add.add_argument("--model", help="served model name (default: what its /v1/models lists)")
    add.add_argument("--role", choices=["aggregated", "prefill", "decode"], default="aggregated")
    add.add_argument("--node", help="the node whose agent watches it (default: the local fleet's node)")
    where = add.add_mutually_exclusive_group()
    where.add_argument("--pidfile", type=Path, help="watch its process too: the API server's pidfile")
    where.add_argument("--systemd-unit", dest="systemd_unit", help="... or its systemd unit")
    where.add_argument("--container", help="... or its (docker) container")
    add.add_argument("--restart-command", dest="restart_command",
                     help="how to restart it (e.g. 'systemctl restart vllm@0'); none: drained and left for an "
                          "operator when it fails")
    add.add_argument("--wait", type=float, default=60.0, help="seconds to wait until an agent adopted it (0: no)")
    add.add_argument("--admin-token-file", dest="admin_token_file", type=Path, default=None,
                     help="the admin token, which signs the record: agents run a restart command only when signed "
                          "(default: FLEETWARD_ADMIN_TOKEN, or the local fleet's)")
    rm = wsub.add_parser("remove", help="stop protecting a worker fleetward adopted (the server keeps running)")
    rm.add_argument("worker")
    rm.add_argument("--wait", type=float, default=30.0, help="seconds to wait until it is given up (0: no)")
    for w in (add, rm):
        w.add_argument("--cluster", default=None)
        w.add_argument("--etcd", help="etcd host:port (default: the local fleet's)")
        w.add_argument("--run-dir", dest="run_dir", type=Path, default=None)
        _add_access_flag(w)

    for verb, what in (("drain", "cordon a worker: no new work goes to it, its streams finish (or migrate after "
                                 "--deadline); it then stays out of routing until undrained (--then stop|restart "
                                 "stops or restarts it instead)"),
                       ("undrain", "take a drained worker back into routing (a stopped one is started again)"),
                       ("restart", "restart a worker gracefully: its streams migrate first (a stopped one is "
                                   "simply started)"),
                       ("unquarantine", "clear a worker's quarantine (a self-test runs first)"),
                       ("move", "move a stream (its request id), or every stream off a worker (--from), to another "
                                "worker with its KV; the client sees one stream")):
        op = sub.add_parser(verb, help=what)
        if verb == "move":
            op.add_argument("request", nargs="?", default=None, help="the request to move (its response id)")
            op.add_argument("--from", dest="source", default=None, help="move every stream on this worker")
            op.add_argument("--to", default=None, help="the worker to move to (default: where the router would "
                            "place it)")
        else:
            op.add_argument("worker")
        op.add_argument("--cluster", default=None)
        op.add_argument("--etcd", help="etcd host:port (default: the local fleet's)")
        op.add_argument("--run-dir", dest="run_dir", type=Path, default=None)
        _add_access_flag(op)
        op.add_argument("--admin-token-file", dest="admin_token_file", type=Path, default=None,
                        help="the admin token (default: FLEETWARD_ADMIN_TOKEN, or the local fleet's)")
        if verb == "drain":
            op.add_argument("--deadline", type=float, default=None, help="seconds before remaining streams migrate")
            op.add_argument("--then", choices=["cordon", "stop", "restart"], default="cordon",
                            help="after the drain: stay cordoned (default), stop the worker, or restart it")

    from fleetward.cli.gpu import add_parser as add_gpu
    from fleetward.cli.kubernetes import add_parser as add_deploy
    from fleetward.cli.profile import add_parser as add_profile
    from fleetward.cli.replay import add_parser as add_replay

    add_replay(sub)
    add_profile(sub)
    add_gpu(sub)
    add_deploy(sub)

    # Parsed by fleetward.chaos.bench itself, imported only when asked for.
    bench = sub.add_parser("bench", add_help=False, help="benchmarks: router, migration, restart, checkpoints "
                           "(needs the bench extra)")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)

    # Parsed by fleetward.chaos.cli itself, imported only when asked for.
    chaos = sub.add_parser("chaos", add_help=False, help="chaos experiments: run, check, faults, validate")
    chaos.add_argument("chaos_args", nargs=argparse.REMAINDER)
    return p


# -- helpers --------------------------------------------------------------------------------------------


def _mark_this_run() -> None:
    """Mark this process's environment: every process the run starts inherits it (see LocalFleet)."""
    import uuid

    from fleetward.fleet.procs import KEEP_ENVIRON, RUN_MARK

    os.environ[RUN_MARK] = uuid.uuid4().hex
    os.environ.update(KEEP_ENVIRON)


def _install_signal_handlers(stop: asyncio.Event) -> None:
    install_stop_handlers(stop, say=lambda text: err.print(escape(text)))


def _age(since: float | None) -> str:
    if not since:
        return "-"
    s = max(0, int(time.time() - since))
    return f"{s}s" if s < 120 else f"{s // 60}m" if s < 7200 else f"{s // 3600}h"


_HEALTH_STYLE = {"ready": "green", "starting": "cyan", "suspect": "yellow", "draining": "yellow",
                 "restarting": "yellow", "unhealthy": "red", "quarantined": "magenta", "dead": "red"}


def _print_status(status: dict[str, Any]) -> None:
    table = Table(title=f"fleet {status['cluster']}", title_justify="left")
    for col in ("WORKER", "ROLE", "URL", "MODEL", "NODE", "PIDS", "HEALTH", "AGE"):
        table.add_column(col)
    for w in status["workers"]:
        style = _HEALTH_STYLE.get(w["health"], "")
        health = f"[{style}]{w['health']}[/]" if style else w["health"]
        why = w.get("phase") or w.get("reason")  # a start's phase says more than "launched"
        if why and w["health"] != "ready":
            health += f" ({escape(why[:80])})"
        pids = " ".join(str(p) for p in w["pids"]) or "-"
        table.add_row(w["id"], w["role"] or "-", w["url"] or "-", w["model"] or "-", w["node"] or "-", pids,
                      health, _age(w["since"]))
    out.print(table)
    controller = status["controller"]
    out.print(f"supervisor: {controller['id']} {controller['url'] or '(no control API)'}" if controller
              else "supervisor: [red]no controller leads this cluster[/] (drain/restart need one)")
    if status["routers"]:
        out.print("routers: " + ", ".join(f"{r['id']} {r['url']}" for r in status["routers"]))
    for agent in status.get("agents", []):
        gpu = agent.get("gpu") or {}
        if gpu:
            style = "green" if gpu.get("source") not in ("off", None) else "yellow"
            detail = escape(str(gpu.get("detail")))
            out.print(f"GPU health on {agent['node']}: [{style}]{gpu.get('source')}[/] ({detail})")
    if status.get("dashboard"):
        out.print(f"fleet page: {status['dashboard']}")
    if status.get("prometheus"):
        out.print(f"prometheus: {status['prometheus']} (alerts: {status['prometheus']}/alerts)")
    if not status["workers"]:
        out.print("(no workers registered)")


# -- commands -------------------------------------------------------------------------------------------


async def _cmd_up(args: argparse.Namespace) -> int:
    from fleetward.cli.compose import LocalFleet
    from fleetward.fleet.registry import wait_registered

    config = _fleet_config(args)
    _mark_this_run()
    stop = asyncio.Event()
    _install_signal_handlers(stop)
    ready: set[str] = set()
    failed: set[str] = set()

    def progress(step: str, what: str) -> None:
        if what == "ready":
            ready.add(step)
            err.print(f"  worker {step} [green]ready[/] ({len(ready)}/{config.workers})")
        elif what == "failed":
            failed.add(step)
            err.print(f"  worker {step} [red]failed to start[/] (see `fleetward status`)")
        elif what == "retrying":
            err.print(f"  worker {step} [yellow]did not start; starting it again[/] (with backoff)")
        elif what == "launched":
            pass
        else:
            err.print(f"  {what}")

    err.print(f"[bold]fleetward up[/]: cluster {config.cluster}, {config.workers} {config.backend} worker(s)")
    fleet = LocalFleet(config, progress=progress)
    starting = asyncio.create_task(fleet.start())
    waiter = asyncio.create_task(stop.wait())
    with err.status("starting the fleet…", spinner="dots"):
        await asyncio.wait({starting, waiter}, return_when=asyncio.FIRST_COMPLETED)
    try:
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, FleetwardError):
                await starting
            return 130
        starting.result()
        if fleet.adopted:
            with err.status(f"waiting until {len(fleet.adopted)} adopted server(s) answer…"):
                try:
                    await wait_registered(fleet.store, fleet.keys, fleet.adopted, timeout=120)
                    err.print(f"  adopted [green]{', '.join(fleet.adopted)}[/] (a canary makes each ready)")
                except TimeoutError:
                    err.print("[yellow]not every adopted server answers yet[/]: they are registered once they do "
                              "(see `fleetward status`)")
        _print_where_to_look(fleet, len(ready), config)
        if config.workers and not ready:
            err.print("[red]no worker came up[/]; see the logs above")
            return 1
        await waiter
        return 0
    finally:
        waiter.cancel()
        claimed = fleet.claimed
        with err.status("stopping…"):
            await fleet.aclose()
        if not claimed:
            pass  # refused before starting anything (another fleet runs there): the error says so
        elif fleet.left_behind:
            err.print(f"[yellow]stopped; {len(fleet.left_behind)} process(es) had outlived their parents and were "
                      f"killed:[/] {escape('; '.join(fleet.left_behind))}")
        else:
            err.print("stopped; no process left behind (checked)")


def _print_where_to_look(fleet: Any, n_ready: int, config: FleetConfig) -> None:
    cluster = config.cluster
    first = fleet.worker_ids[0] if fleet.worker_ids else None
    model = fleet.spec(first).model if first else fleet.backend.model_name
    entry = fleet.router_url or (fleet.url(first) if first else "")
    out.print(f"\n[bold green]fleet {cluster} is up[/]: {n_ready}/{config.workers} worker(s) ready\n")
    out.print(f"  etcd    {fleet.etcd_endpoint}   (keys under /fleetward/{cluster}/)")
    out.print(f"  mqtt    {fleet.mqtt_endpoint}   (events on fleetward/{cluster}/events/#)")
    out.print(f"  logs    {fleet.log_dir}/")
    out.print("  status  fleetward status          events  fleetward events")
    if fleet.router_url:
        out.print(f"  router  {fleet.router_url}   (OpenAI-compatible; streams survive worker failures)")
    if getattr(fleet, "controller_url", ""):
        out.print(f"  page    {fleet.controller_url}/   (live: workers, detections, migrations, faults, alerts)")
    if getattr(fleet, "prometheus", None) is not None:
        out.print(f"  prom    {fleet.prometheus.url}   (alerts: {fleet.prometheus.url}/alerts; rules in "
                  "runbooks/alerts/)")
    if getattr(fleet, "autoscaler", None) is not None:
        a = config.autoscale
        out.print(f"  scale   {a.policy} policy, {a.min_workers}-{a.max_workers} workers: decisions in etcd "
                  f"scale/<pool> and `fleetward events scale`; metrics {fleet.autoscaler.url}/metrics")
    if entry:
        out.print(f"  try     curl -N {entry}/v1/completions -H 'content-type: application/json' "
                  f"-d '{{\"model\":\"{model}\",\"prompt\":\"Hello\",\"max_tokens\":16,\"stream\":true}}'")
    out.print("\nCtrl-C (or SIGTERM) stops everything.")


async def _cmd_status(args: argparse.Namespace) -> int:
    from fleetward.fleet.etcd import EtcdStore
    from fleetward.fleet.keys import Keys
    from fleetward.fleet.registry import read_fleet

    endpoint, cluster = local_endpoint(args, "etcd")
    store = EtcdStore(endpoint, attempts=3, retry_budget_s=5.0, timeout_s=3.0,
                      access=local_access(args, "etcd", endpoint))
    keys = Keys(cluster)
    try:
        fleet = await read_fleet(store, keys, leader=True, phases=True)
        agents = await store.get_prefix(keys.agents)
    finally:
        await store.aclose()
    status = fleet.to_status()
    status["agents"] = []
    for kv in agents.items:
        with contextlib.suppress(ValueError, AttributeError):
            body = json.loads(kv.value)
            status["agents"].append({"node": body.get("node"), "url": body.get("url") or None,
                                     "gpu": body.get("gpu")})
    path = state_file(args.run_dir, cluster)  # what a local fleet started beside the key space (Prometheus)
    local: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    status["prometheus"] = local.get("prometheus") if local.get("cluster") == cluster else None
    # The fleet page is the leading controller's (any fleet, started by fleetward or not).
    leader = status.get("controller") or {}
    status["dashboard"] = f"{str(leader['url']).rstrip('/')}/" if leader.get("url") else None
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        _print_status(status)
    return 0


async def _cmd_events(args: argparse.Namespace) -> int:
    from fleetward.fleet.bus import MqttBus

    endpoint, cluster = local_endpoint(args, "mqtt")
    bus = MqttBus(endpoint, cluster, access=local_access(args, "mqtt", endpoint))
    await bus._probe()
    stop = asyncio.Event()
    _install_signal_handlers(stop)
    seen = 0

    async def follow() -> None:
        nonlocal seen
        async for event in bus.subscribe(args.kinds):
            stamp = time.strftime("%H:%M:%S", time.localtime(event.ts))
            fields = " ".join(f"{k}={v}" for k, v in event.data.items())
            out.print(f"{stamp} [bold]{event.kind}[/] {fields}")
            seen += 1
            if args.count and seen >= args.count:
                stop.set()
                return

    task = asyncio.create_task(follow())
    await stop.wait()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return 0


def _cmd_model(args: argparse.Namespace) -> int:
    from fleetward.sim.tinymodel import write_tiny_model

    with err.status(f"writing the tiny model to {args.out}…"):
        path = write_tiny_model(args.out, seed=args.seed, tokenizer=args.tokenizer)
    out.print(f"wrote {path} (seed {args.seed}, {args.tokenizer} vocabulary).\n"
              "Serve it: python -m vllm.entrypoints.openai.api_server "
              f"--model {path} --dtype float32 --max-model-len 2048 --enforce-eager")
    return 0


def _cmd_router(args: argparse.Namespace) -> int:
    import uvloop

    from fleetward.migration.server import serve_router

    base = load_fleet_config(args.config) if args.config else FleetConfig()
    updates = {k: getattr(args, k) for k in ("host", "port", "migration_limit", "checkpoints", "processes")
               if getattr(args, k, None) is not None}
    try:
        config = RouterConfig.model_validate({**base.routing.model_dump(), **updates})
    except ValidationError as exc:
        raise validation_error(exc, file="<command line>", lines={}) from None
    if args.cluster is None and base.cluster != FleetConfig().cluster:
        args.cluster = base.cluster
    args.etcd, args.mqtt = args.etcd or base.etcd, args.mqtt or base.mqtt  # the fleet file's, below flags
    etcd, cluster = local_endpoint(args, "etcd")
    mqtt, _ = local_endpoint(args, "mqtt")

    def ready(router: Any) -> None:
        print(f"READY {router.id} {router.url}", flush=True)

    if config.processes > 1 and not args.reuse_port:
        from fleetward.fleet.launch import fleetward_argv
        from fleetward.migration.server import serve_router_group

        def child(rid: str, port: int) -> list[str]:
            return fleetward_argv(
                "--log-level", args.log_level, "router", "--etcd", etcd, "--mqtt", mqtt, "--cluster", cluster,
                *(["--config", str(args.config)] if args.config else []), "--host", config.host, "--port", str(port),
                *(["--migration-limit", str(args.migration_limit)] if args.migration_limit is not None else []),
                *(["--no-checkpoints"] if args.checkpoints is False else []),
                "--id", rid, "--processes", "1", "--reuse-port")

        def group_ready(base: str, url: str) -> None:
            print(f"READY {base} {url}", flush=True)

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(serve_router_group(config, child, router_id=args.router_id, on_ready=group_ready))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve_router(config, etcd=etcd, mqtt=mqtt, cluster=cluster, router_id=args.router_id,
                                on_ready=ready, reuse_port=args.reuse_port,
                                etcd_access=local_access(args, "etcd", etcd),
                                mqtt_access=local_access(args, "mqtt", mqtt)))
    return 0


async def _cmd_operate(args: argparse.Namespace) -> int:
    """drain / undrain / restart / unquarantine: through the supervisor leader's control API."""
    import httpx

    from fleetward.fleet.etcd import EtcdStore
    from fleetward.fleet.keys import Keys
    from fleetward.fleet.registry import read_leader

    if args.command == "move" and (args.request is None) == (args.source is None):
        raise ConfigError("move: name a request, or --from WORKER to move every stream off it", field="request")
    endpoint, cluster = local_endpoint(args, "etcd")
    token = operator_token(args)
    access = local_access(args, "etcd", endpoint)
    async with EtcdStore(endpoint, attempts=3, retry_budget_s=5.0, access=access) as store:
        leader = await read_leader(store, Keys(cluster))
    if leader is None:
        raise FleetwardError("no supervisor controller leads this cluster (is `fleetward up` running?)")
    path = {"drain": "drain", "undrain": "undrain", "restart": "restart", "unquarantine": "quarantine/clear"}
    body: dict[str, Any] = {}
    if args.command == "drain":
        body = {"then": args.then, **({"deadline_s": args.deadline} if args.deadline is not None else {})}
    if args.command == "move":
        body = {k: v for k, v in (("request", args.request), ("from", args.source), ("to", args.to)) if v}
        args.worker = args.request or args.source
    url = f"{leader.url}/v1/moves" if args.command == "move" else \
        f"{leader.url}/v1/workers/{args.worker}/{path[args.command]}"
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(url, json=body, headers={"Authorization": f"Bearer {token}"})
    try:
        answer: dict[str, Any] = r.json()
    except ValueError:
        answer = {"error": r.text}
    if r.status_code != 200:
        raise FleetwardError(f"{args.command} {args.worker}: {answer.get('error') or r.text} (HTTP {r.status_code})")
    if args.command == "move":
        out.print(f"move: {escape(str(answer.get('what', 'accepted')))}.\nOrder {answer.get('order')} accepted by "
                  f"{leader.id}; each move shows on the fleet page and in `fleetward events`.")
        return 0
    out.print(f"{args.command} {escape(args.worker)} (was {answer.get('state', '?')}): "
              f"{escape(str(answer.get('what', 'accepted')))}.\nAccepted by {leader.id}; watch it with "
              f"`fleetward status`.")
    return 0


def _cmd_controller(args: argparse.Namespace) -> int:
    import uvloop

    from fleetward.supervisor.controller import serve_controller

    config = _fleet_config(args)
    if not config.etcd or not config.mqtt:
        raise ConfigError("a controller needs --etcd and --mqtt, or etcd: and mqtt: in its fleet file (the "
                          "cluster's etcd and broker)", field="etcd" if not config.etcd else "mqtt")
    sup = config.supervisor
    if args.supervisor_port is not None:
        sup = sup.model_copy(update={"port": args.supervisor_port})
    if args.host is not None:
        sup = sup.model_copy(update={"host": args.host})
    token = admin_token(args.run_dir, args.cluster, config.admin_token_file)

    def ready(controller: Any) -> None:
        print(f"READY {controller.id} {controller.url}", flush=True)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve_controller(sup, etcd=config.etcd, mqtt=config.mqtt, cluster=config.cluster,
                                    admin_token=token, controller_id=args.controller_id, on_ready=ready,
                                    etcd_access=resolve_access(config.etcd_access, field="etcd_access"),
                                    mqtt_access=resolve_access(config.mqtt_access, field="mqtt_access")))
    return 0


def _cmd_autoscaler(args: argparse.Namespace) -> int:
    import uvloop

    from fleetward.autoscale.daemon import capacity_for, serve_autoscaler

    config = _fleet_config(args)
    if args.host is not None:
        config = config.model_copy(update={"autoscale": config.autoscale.model_copy(update={"host": args.host})})
    if not config.etcd or not config.mqtt:
        raise ConfigError("an autoscaler needs --etcd and --mqtt, or etcd: and mqtt: in its fleet file (the "
                          "cluster's etcd and broker)", field="etcd" if not config.etcd else "mqtt")
    # Servers fleetward adopted are real ones whatever `backend` says: never a simulated worker's capacity.
    capacity = capacity_for(config.autoscale, backend="vllm" if config.attach else config.backend, sim=config.sim)
    token = admin_token(args.run_dir, args.cluster, config.admin_token_file)

    def ready(scaler: Any) -> None:
        print(f"READY {scaler.id} {scaler.url}", flush=True)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve_autoscaler(config.autoscale, etcd=config.etcd, mqtt=config.mqtt, cluster=config.cluster,
                                    admin_token=token, capacity=capacity, autoscaler_id=args.autoscaler_id,
                                    on_ready=ready,
                                    etcd_access=resolve_access(config.etcd_access, field="etcd_access"),
                                    mqtt_access=resolve_access(config.mqtt_access, field="mqtt_access")))
    return 0


async def _cmd_agent(args: argparse.Namespace) -> int:
    """One node's agent against an existing etcd and broker (no embedded infrastructure)."""
    from fleetward.cli.compose import LocalFleet

    config = _fleet_config(args)
    if not config.etcd or not config.mqtt:
        raise ConfigError("an agent needs --etcd and --mqtt, or etcd: and mqtt: in its fleet file (the cluster's "
                          "etcd and broker)", field="etcd" if not config.etcd else "mqtt")
    config = config.model_copy(update={"router": False, "controller": False})
    _mark_this_run()
    stop = asyncio.Event()
    _install_signal_handlers(stop)
    async with LocalFleet(config, progress=lambda w, what: log.info("%s %s", w, what)):
        print("READY", flush=True)
        await stop.wait()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command not in ("bench", "chaos"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "up" and args.hosts > 1:
            from fleetward.cli.hostsup import hosts_up

            return hosts_up(_fleet_config(args), args.hosts)
        if args.command == "up":
            return asyncio.run(_cmd_up(args))
        if args.command == "status":
            return asyncio.run(_cmd_status(args))
        if args.command == "events":
            return asyncio.run(_cmd_events(args))
        if args.command == "model":
            return _cmd_model(args)
        if args.command == "router":
            return _cmd_router(args)
        if args.command == "supervisor":
            if args.role == "controller":
                return _cmd_controller(args)
            return asyncio.run(_cmd_agent(args))
        if args.command == "controller":
            return _cmd_controller(args)
        if args.command == "agent":
            return asyncio.run(_cmd_agent(args))
        if args.command == "autoscaler":
            return _cmd_autoscaler(args)
        if args.command == "config":
            from fleetward.cli.configcheck import check_fleet_file

            return check_fleet_file(args.file)
        if args.command == "worker":
            from fleetward.cli.workers import add_worker, remove_worker

            return asyncio.run(add_worker(args) if args.worker_command == "add" else remove_worker(args))
        if args.command in ("drain", "undrain", "restart", "unquarantine", "move"):
            return asyncio.run(_cmd_operate(args))
        if args.command == "profile":
            from fleetward.cli.profile import run as run_profile

            return run_profile(args, out, err)
        if args.command == "gpu":
            from fleetward.cli.gpu import run as run_gpu

            return run_gpu(args, out, err)
        if args.command == "deploy":
            from fleetward.cli.kubernetes import run as run_deploy

            return run_deploy(args, out, err)
        if args.command == "replay":
            from fleetward.cli.replay import run as run_replay

            return run_replay(args, out, err)
        if args.command == "bench":
            from fleetward.chaos.bench import main as bench_main

            return bench_main([*rest, *args.bench_args])
        if args.command == "chaos":
            from fleetward.chaos.cli import main as chaos_main

            return chaos_main([*rest, *args.chaos_args])
    except ConfigError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        return 2
    except FleetwardError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        return 1
    except KeyboardInterrupt:
        return 130
    raise AssertionError(f"unhandled command {args.command}")

