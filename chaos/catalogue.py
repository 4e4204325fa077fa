"""The fault catalogue as experiments see it: every fault module imported, and what each fault may target.

:func:`fault_catalogue` imports the families of :mod:`fleetward.chaos.faults` (and the modules named in
``FLEETWARD_FAULT_MODULES``) once, so every fault has registered itself, and says which modules failed to
import. The rest are facts about one catalogue entry that validation, the dry run and the runner share: the
backends it works on, the component kinds it targets, its default target, whether it counts towards the
safety share, and the message for a name the catalogue does not have (:data:`RENAMED`: the old names).
"""

from __future__ import annotations

import difflib
import importlib
import logging
import os
import pkgutil
from collections.abc import Mapping

from fleetward.chaos.fault import CATALOGUE, FaultSpec, Target
from fleetward.fleet.backends import BACKENDS

__all__ = [
    "RENAMED",
    "backends_for",
    "counts_toward_share",
    "default_target",
    "fault_catalogue",
    "target_kinds",
    "unknown_fault",
]

log = logging.getLogger(__name__)

_CATALOGUE_PROBLEMS: dict[str, str] = {}
_LOADED = False


def fault_catalogue() -> tuple[dict[str, FaultSpec], dict[str, str]]:
    """The fault catalogue with every fault module imported, and the modules that failed to import.

    Faults register themselves when their module is imported: every family from the modules of
    :mod:`fleetward.chaos.faults`, and your own from the modules named in ``FLEETWARD_FAULT_MODULES``
    (comma-separated import names).
    A module that fails to import is reported (``chaos faults`` shows it) rather than hiding the others.
    """
    global _LOADED
    if not _LOADED:
        _LOADED = True
        try:
            pkg = importlib.import_module("fleetward.chaos.faults")
        except ModuleNotFoundError as exc:
            if exc.name not in ("fleetward.chaos.faults",):
                _CATALOGUE_PROBLEMS["fleetward.chaos.faults"] = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # a broken fault module must not hide the rest of the catalogue
            _CATALOGUE_PROBLEMS["fleetward.chaos.faults"] = f"{type(exc).__name__}: {exc}"
        else:
            for info in pkgutil.iter_modules(getattr(pkg, "__path__", []), prefix=pkg.__name__ + "."):
                try:
                    importlib.import_module(info.name)
                except Exception as exc:
                    _CATALOGUE_PROBLEMS[info.name] = f"{type(exc).__name__}: {exc}"
        for name in filter(None, (m.strip() for m in os.environ.get("FLEETWARD_FAULT_MODULES", "").split(","))):
            try:
                importlib.import_module(name)
            except Exception as exc:
                _CATALOGUE_PROBLEMS[name] = f"{type(exc).__name__}: {exc}"
        for name, problem in _CATALOGUE_PROBLEMS.items():
            log.warning("fault module %s could not be imported: %s", name, problem)
    return CATALOGUE, dict(_CATALOGUE_PROBLEMS)


# Names before the catalogue took one convention (``<family>.<snake_case>``): an old file gets the new name.
RENAMED: Mapping[str, str] = {
    "kill-worker": "process.kill_worker", "kill-engine": "process.kill_engine", "hang-worker": "process.hang",
    "crash-loop": "process.crash_loop", "slow-start": "process.slow_start", "oom-kill": "process.oom_kill",
    "net-latency": "network.latency", "net-bandwidth": "network.bandwidth", "net-slicer": "network.slicer",
    "net-reset": "network.reset", "net-blackhole": "network.blackhole", "net-limit-data": "network.limit_data",
    "net-slow-close": "network.slow_close", "net-partition": "network.partition", "net-down": "network.down",
    "net-partition-kernel": "network.partition_kernel", "sse-cut": "network.sse_cut",
    "sse-stall": "network.sse_stall", "sse-corrupt": "network.sse_corrupt", "sse-drop-done": "network.sse_drop_done",
    "etcd-member-kill": "control.etcd_member_kill", "etcd-member-pause": "control.etcd_member_pause",
    "etcd-member-restart": "control.etcd_member_restart", "etcd-leader-loss": "control.etcd_leader_loss",
    "lease-expiry": "control.lease_expiry", "broker-restart": "control.broker_restart",
    "router-restart": "control.router_restart", "supervisor-leader-kill": "control.supervisor_leader_kill",
    "kv-drop": "kv.drop", "kv-delay": "kv.delay", "kv-corrupt": "kv.corrupt", "kv-truncate": "kv.truncate",
    "kv-stall": "kv.stall", "kv-prefill-dies": "kv.prefill_dies",
}


def unknown_fault(name: str, catalogue: Mapping[str, FaultSpec], problems: Mapping[str, str]) -> str:
    if name in RENAMED and RENAMED[name] in catalogue:
        return f"unknown fault {name!r}: it is called {RENAMED[name]} now (faults are named <family>.<name>)"
    near = difflib.get_close_matches(name, list(catalogue), n=1)
    hint = f" (did you mean {near[0]}?)" if near else ""
    listed = ", ".join(sorted(catalogue)) or "(empty)"
    broken = f"; could not load: {', '.join(sorted(problems))}" if problems else ""
    return f"unknown fault {name!r}{hint}; the catalogue has: {listed}{broken}"


def backends_for(spec: FaultSpec) -> list[str]:
    """The backends whose workers a fault works on."""
    return [name for name, cls in BACKENDS.items() if spec.works_on(cls.capabilities)]


def target_kinds(spec: FaultSpec) -> tuple[str, ...]:
    """The component kinds a fault may target (``extra["target_kinds"]``, or ``extra["target"]``)."""
    kinds = spec.extra.get("target_kinds") or ((spec.extra["target"],) if spec.extra.get("target") else ())
    return tuple(str(k) for k in kinds)


def default_target(spec: FaultSpec) -> Target | None:
    """The target of a fault that names none: the whole fleet (load), the fleet's KV hook (kv); else None."""
    kinds = set(target_kinds(spec))
    if kinds and kinds <= {"fleet"}:
        return Target(kind="fleet", pick="all")
    if kinds == {"kv"}:
        return Target(kind="kv", pick="all")
    return None


def counts_toward_share(spec: FaultSpec, target: Target) -> bool:
    """Whether faulting ``target`` takes a component out of service (load faults and ``fleet`` do not)."""
    return target.kind != "fleet" and bool(spec.extra.get("counts_toward_share", spec.family != "load"))
