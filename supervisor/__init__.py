"""The supervisor: node agents that start, watch and remediate workers on their host, and a leader-elected
controller that turns detector signals into health verdicts and actions.

See :mod:`fleetward.supervisor.health` for the state machine, :mod:`fleetward.supervisor.detectors` for
what each detector says, :mod:`fleetward.supervisor.gpu` for GPU health.
"""

from fleetward.supervisor.agent import NodeAgent
from fleetward.supervisor.controller import Controller
from fleetward.supervisor.health import HealthMachine, HealthPolicy
from fleetward.supervisor.signals import Severity, Signal

__all__ = ["Controller", "HealthMachine", "HealthPolicy", "NodeAgent", "Severity", "Signal"]
