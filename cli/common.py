"""What the commands share: the consoles, and finding the local fleet (its state file, its endpoints)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from fleetward.fleet.config import (
    Access,
    AccessConfig,
    FleetConfig,
    admin_token_from_file,
    admin_token_given,
    load_fleet_config,
    resolve_access,
)
from fleetward.fleet.errors import ConfigError
from fleetward.fleet.state import read_admin_token, read_state, state_path

__all__ = ["SYSTEM_FLEET_FILE", "admin_token", "err", "fleet_file", "local_access", "local_endpoint", "operator_token",
           "out", "state_file"]

out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def state_file(run_dir: Path | None, cluster: str | None) -> Path:
    defaults = FleetConfig()
    return state_path(run_dir or defaults.run_dir, cluster or defaults.cluster)


SYSTEM_FLEET_FILE = Path("/etc/fleetward/fleet.yaml")


def fleet_file(args: argparse.Namespace, *, system: bool = False) -> FleetConfig | None:
    """The fleet file an operator command reads its cluster from: ``--config``, else ``$FLEETWARD_CONFIG``;
    with ``system``, else /etc/fleetward/fleet.yaml where it exists (a fleet host); None when there is none."""
    given = getattr(args, "config", None) or os.environ.get("FLEETWARD_CONFIG")
    path = Path(given) if given else SYSTEM_FLEET_FILE if system and SYSTEM_FLEET_FILE.is_file() else None
    return load_fleet_config(path) if path is not None else None


def _state_path(args: argparse.Namespace, config: FleetConfig | None) -> Path:
    """The local fleet's state file: ``--run-dir`` and ``--cluster``, else the fleet file's (the one ``up`` ran)."""
    run_dir = getattr(args, "run_dir", None) or (config.run_dir if config is not None else None)
    cluster = getattr(args, "cluster", None) or (config.cluster if config is not None else None)
    return state_file(run_dir, cluster)


def local_endpoint(args: argparse.Namespace, kind: str) -> tuple[str, str]:
    """(endpoint, cluster) of ``kind`` (etcd or mqtt), first found: the flag (``--etcd``), the environment
    (``FLEETWARD_ETCD``), the fleet file (``--config``, ``$FLEETWARD_CONFIG``), the local fleet's state file,
    /etc/fleetward/fleet.yaml. The cluster likewise: ``--cluster``, ``FLEETWARD_CLUSTER``, then where the
    endpoint came from."""
    given_cluster = getattr(args, "cluster", None) or os.environ.get("FLEETWARD_CLUSTER")
    cluster = given_cluster or FleetConfig().cluster
    flag = getattr(args, kind, None) or os.environ.get(f"FLEETWARD_{kind.upper()}")
    if flag:
        return flag, cluster
    config = fleet_file(args)
    if config is not None and getattr(config, kind):
        return str(getattr(config, kind)), given_cluster or config.cluster
    path = _state_path(args, config)
    if not path.exists():
        system = fleet_file(args, system=True)
        if system is not None and getattr(system, kind):
            return str(getattr(system, kind)), given_cluster or system.cluster
    data = read_state(path, hint=f", or pass --{kind} host:port (or FLEETWARD_{kind.upper()}, or --config / "
                      "FLEETWARD_CONFIG naming the cluster's fleet file)", field=kind)
    return data[kind], data.get("cluster", cluster)


def local_access(args: argparse.Namespace, kind: str, endpoint: str) -> Access:
    """TLS and credentials for ``endpoint`` (``kind``: etcd or mqtt): the ``<kind>_access`` of the fleet file
    (``--config``, ``$FLEETWARD_CONFIG``), else the local fleet's when ``endpoint`` is its (its state file
    names the files, never a password), else /etc/fleetward/fleet.yaml's when ``endpoint`` is its, else none."""
    field = f"{kind}_access"
    config = fleet_file(args)
    path = _state_path(args, config)
    data = json.loads(path.read_text()) if path.exists() else {}
    # A fleet file that names the endpoint says how to reach it; one that `up` ran (no endpoint: it started
    # its own) leaves that to the state file, which names what `up` made (--tls).
    if config is not None and (getattr(config, kind) or data.get(kind) != endpoint):
        return resolve_access(getattr(config, field), field=field)
    if data.get(field) and data.get(kind) == endpoint:
        return resolve_access(AccessConfig.model_validate(data[field]), field=field)
    system = fleet_file(args, system=True) if not data else None
    if system is not None and getattr(system, kind) == endpoint:
        return resolve_access(getattr(system, field), field=field)
    return Access()


def operator_token(args: argparse.Namespace) -> str:
    """The admin token of an operator command: ``FLEETWARD_ADMIN_TOKEN``, ``--admin-token-file``, the fleet
    file's ``admin_token_file``, or the local fleet's."""
    token_file = getattr(args, "admin_token_file", None)
    if token_file is None:
        config = fleet_file(args) or (fleet_file(args, system=True)
                                      if not state_file(args.run_dir, args.cluster).exists() else None)
        token_file = config.admin_token_file if config is not None else None
    return admin_token(args.run_dir, args.cluster, token_file)


def admin_token(run_dir: Path | None, cluster: str | None, token_file: Path | None = None) -> str:
    """``FLEETWARD_ADMIN_TOKEN``, else the token file given (flag or fleet file), else the local fleet's."""
    if token_file is not None and admin_token_given() is None:
        return admin_token_from_file(token_file).get_secret_value()
    path = state_file(run_dir, cluster)
    state: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    token = read_admin_token(state, path)
    if not token:
        raise ConfigError(f"no admin token: set FLEETWARD_ADMIN_TOKEN, pass --admin-token-file, or run next to a "
                          f"local fleet ({path.with_name('admin-token')})", field="FLEETWARD_ADMIN_TOKEN")
    return token
