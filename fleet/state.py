"""Where a running local fleet can be reached: ``<run dir>/<cluster>/fleet.json`` and its admin token.

``fleetward up`` writes the state file when its fleet is up and removes it when the fleet stops; commands
run beside it (``fleetward status``, ``drain``, ``chaos run --attach``, ...) read it to find the fleet's
etcd, broker, router and control API. The admin token is in a file of its own (mode 0600) that the state
file names, never in the state file or on a command line.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetward.fleet.config import admin_token_given
from fleetward.fleet.errors import ConfigError

__all__ = ["StateFile", "read_admin_token", "read_state", "state_path"]


def state_path(run_dir: Path, cluster: str) -> Path:
    return run_dir / cluster / "fleet.json"


@dataclass
class StateFile:
    """``<run dir>/<cluster>/fleet.json``: where a running local fleet can be reached."""

    path: Path
    data: dict[str, Any] = field(default_factory=dict)

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2) + "\n")
        tmp.replace(self.path)

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def read_state(path: Path, *, hint: str = "", field: str = "run_dir") -> dict[str, Any]:
    """The state file of a running local fleet; :class:`ConfigError` naming ``field`` when there is none."""
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no running local fleet found ({path} does not exist): start one with `fleetward up`{hint}",
                          field=field) from None
    return data


def read_admin_token(state: dict[str, Any], path: Path) -> str:
    """The fleet's admin token: ``FLEETWARD_ADMIN_TOKEN`` if set, else the file the state names ("" if none)."""
    given = admin_token_given()
    if given is not None:
        return given.get_secret_value()
    token_file = Path(state.get("admin_token_file") or path.parent / "admin-token")
    return token_file.read_text().strip() if token_file.exists() else ""


def write_admin_token(path: Path, token: str) -> None:
    """The admin token written where ``read_admin_token`` finds it, readable by its owner only from the start."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
