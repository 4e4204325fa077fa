"""The composition root: the ``fleetward`` command line (:mod:`.main`) and the local fleet that
``fleetward up`` runs (:mod:`.compose`).

This is the one package that wires every other together (core, sim, migration, supervisor, autoscale,
and chaos for ``fleetward chaos`` and ``fleetward bench``). Nothing imports it: services are started
from it as processes (``python -m fleetward.cli router ...``), never imported from it.
"""

from fleetward.cli.main import main

__all__ = ["main"]
