"""SLA-driven autoscaling of prefill and decode pools (TTFT/ITL targets), evaluated on real request traces.

Not built yet: no issue has asked for it so far. The folder holds the place the architecture gives it.
"""

__all__: list[str] = []
