"""SLA-driven autoscaling (TTFT/ITL targets), evaluated on real request traces.

Built: the sans-IO planner and the baseline policies, load predictors, the capacity model, a
discrete-event fleet simulator that drives them over a trace (``fleetward replay TRACE --simulate``), the
leader-elected daemon and its actuators (local, through the supervisor; Kubernetes, a Deployment's scale).
"""

__all__: list[str] = []
