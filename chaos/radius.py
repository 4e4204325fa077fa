"""The blast radius at run time: capacity out of service, and the consent a fleet the runner did not start needs.

The radius itself is declared and checked against the schedule in :mod:`.experiment`
(:class:`~fleetward.chaos.experiment.BlastRadius`); the runner resolves targets inside it. This module holds
the two decisions the runner adds, both sans IO:

- :func:`out_of_service` and :func:`capacity_breach`: which of the fleet's workers are out of service in one
  etcd snapshot (not registered, or a health state that takes no new work), and whether that is more than
  the radius's ``max_capacity_share``. The runner looks while the method runs and aborts on a breach, whatever
  caused it (a fault's collateral damage, an unrelated failure): the faults in effect are recovered and the
  rollbacks run, as for any abort.
- :func:`live_fleet_refusal`: injecting into a fleet the runner did not start (``--attach``) needs the
  operator's explicit ``--live-fleet``, a declared blast radius (the default, "the whole declared fleet",
  is only safe for a fleet brought up for the run) and the fleet's admin token.
"""

from __future__ import annotations

from collections.abc import Sequence

from fleetward.chaos.experiment import Experiment
from fleetward.fleet.errors import ConfigError
from fleetward.fleet.registry import FleetSnapshot

__all__ = ["LIVE_FLEET_FLAG", "capacity_breach", "live_fleet_refusal", "out_of_service"]

LIVE_FLEET_FLAG = "--live-fleet"


def out_of_service(snapshot: FleetSnapshot, workers: Sequence[str]) -> dict[str, str]:
    """The workers of ``workers`` that take no new work, each with why: not registered (dead, or its agent's
    lease gone), or a health state that is not routable. A worker without a health record counts as serving:
    a fleet without a supervisor has none."""
    down: dict[str, str] = {}
    for w in workers:
        health = snapshot.health.get(w)
        if w not in snapshot.workers:
            down[w] = "not registered"
        elif health is not None and not health.state.is_routable:
            down[w] = health.state.value
    return down


def capacity_breach(down: dict[str, str], workers: Sequence[str], max_share: float) -> str | None:
    """Why the fleet is beyond the radius's ``max_capacity_share`` (None while it is not)."""
    if not workers:
        return None
    share = len(down) / len(workers)
    if share <= max_share + 1e-9:
        return None
    which = ", ".join(f"{w} ({why})" for w, why in sorted(down.items()))
    return (f"the steady state broke beyond the blast radius: {len(down)} of {len(workers)} worker(s) out of "
            f"service ({which}): share {share:.2f} over blast_radius.max_capacity_share {max_share:g}")


def live_fleet_refusal(exp: Experiment, *, fleet: str, confirmed: bool, token: str) -> ConfigError | None:
    """Why faults may not be injected into ``fleet``, a fleet the runner did not start (None: they may).

    An experiment without faults only sends requests, and needs nothing more than attaching does.
    """
    if not exp.method:
        return None
    names = ", ".join(exp.activity_names())
    if not confirmed:
        return ConfigError(f"{fleet} was not started by this run: injecting {len(exp.method)} fault(s) ({names}) "
                           f"into it needs {LIVE_FLEET_FLAG} to confirm, and the fleet's admin token "
                           "(FLEETWARD_ADMIN_TOKEN, or the admin-token file beside its fleet.json); nothing was "
                           "injected (see `fleetward chaos run --dry-run` for what would be)", field=LIVE_FLEET_FLAG)
    if exp.blast_radius is None:
        return ConfigError(f"{fleet} was not started by this run: the experiment must declare its blast_radius "
                           "(which workers, nodes, links ... it may break, and max_capacity_share); the default, the "
                           "whole declared fleet, is only for a fleet the run brings up", field="blast_radius")
    if not token:
        return ConfigError(f"no admin token for {fleet}: set FLEETWARD_ADMIN_TOKEN, or keep the admin-token file "
                           "beside its fleet.json (fleetward up writes it); nothing was injected",
                           field="FLEETWARD_ADMIN_TOKEN")
    return None
