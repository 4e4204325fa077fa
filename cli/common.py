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

__all__ = ["admin_token", "err", "local_access", "local_endpoint", "out", "state_file"]

out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def state_file(run_dir: Path | None, cluster: str | None) -> Path:
    defaults = FleetConfig()
    return state_path(run_dir or defaults.run_dir, cluster or defaults.cluster)


def local_endpoint(args: argparse.Namespace, kind: str) -> tuple[str, str]:
    """(endpoint, cluster) from the flag, the environment, or the local fleet's state file."""
    flag = getattr(args, kind, None)
    cluster = args.cluster or os.environ.get("FLEETWARD_CLUSTER") or FleetConfig().cluster
    if flag:
        return flag, cluster
    env = os.environ.get(f"FLEETWARD_{kind.upper()}")
    if env:
        return env, cluster
    data = read_state(state_file(args.run_dir, args.cluster), hint=f", or pass --{kind} host:port", field=kind)
    return data[kind], data.get("cluster", cluster)


def local_access(args: argparse.Namespace, kind: str, endpoint: str) -> Access:
    """TLS and credentials for ``endpoint`` (``kind``: etcd or mqtt): the ``<kind>_access`` of the fleet file
    given (``--config``), else the local fleet's when ``endpoint`` is its (its state file names the files,
    never a password), else none."""
    field = f"{kind}_access"
    config = getattr(args, "config", None)
    if config is not None:
        return resolve_access(getattr(load_fleet_config(config), field), field=field)
    path = state_file(getattr(args, "run_dir", None), getattr(args, "cluster", None))
    data = json.loads(path.read_text()) if path.exists() else {}
    if data.get(field) and data.get(kind) == endpoint:
        return resolve_access(AccessConfig.model_validate(data[field]), field=field)
    return Access()


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
