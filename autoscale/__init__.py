"""SLA-driven autoscaling (TTFT/ITL targets), evaluated on real request traces.

Built so far: the sans-IO planner and the baseline policies, load predictors, the capacity model, and a
discrete-event fleet simulator that drives them over a trace (``fleetward replay TRACE --simulate``).
To come: the leader-elected daemon that observes the live fleet, and its actuator.
"""

__all__: list[str] = []
