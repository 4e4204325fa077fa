"""``fleetward config check FILE``: a fleet file validated as the daemons would read it, without starting any.

Everything a daemon would refuse at start is refused here, naming the file, the line and the field: the schema,
the secret files it names (present, not readable by others, not empty), TLS files, the router's API keys. What
is valid but worth a look is said too (no etcd or broker for the daemons, loopback URLs registered elsewhere).
"""

from __future__ import annotations

from pathlib import Path

from fleetward.cli.common import out
from fleetward.fleet.config import admin_token_from_file, load_fleet_config, resolve_access
from fleetward.fleet.procs import is_local_only

__all__ = ["check_fleet_file"]


def check_fleet_file(path: Path) -> int:
    """0 when ``path`` is a fleet file the daemons accept (what it holds printed); a ConfigError otherwise."""
    config = load_fleet_config(path)
    lines = [f"cluster {config.cluster}, node {config.node}"]
    for kind in ("etcd", "mqtt"):
        access = resolve_access(getattr(config, f"{kind}_access"), field=f"{kind}_access")
        how = ", ".join(w for w, on in (("TLS", access.tls), ("client certificate", access.cert_file is not None),
                                        (f"user {access.username}", access.username is not None)) if on)
        endpoint = getattr(config, kind)
        lines.append(f"{kind}: {endpoint or 'none (fleetward up starts one; the daemons need one)'}"
                     + (f" ({how})" if how else ""))
    if config.admin_token_file is not None:
        admin_token_from_file(config.admin_token_file)
        lines.append(f"admin token: {config.admin_token_file} (private, read)")
    if config.routing.api_keys_file is not None:
        from fleetward.migration.apikeys import ApiKeys

        keys = ApiKeys.load(config.routing.api_keys_file)
        lines.append(f"router API keys: {len(keys.names)} ({', '.join(keys.names)})")
    for i, entry in enumerate(config.attach):
        host = entry.host_port[0]
        where = (" (loopback: registered at this node's advertise_host)" if is_local_only(host) else "")
        restart = "restart command" if entry.restart_command else "no restart command: left for an operator"
        lines.append(f"attach[{i}]: {entry.worker_id(config.node)} at {entry.url}{where}; {restart}")
    lines.append(f"workers of its own: {config.workers} ({config.backend})")
    out.print(f"{path}: valid")
    for line in lines:
        out.print(f"  {line}")
    return 0


