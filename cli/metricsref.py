"""The metrics catalogue (docs/metrics.md), generated from the services' own metric definitions.

Every metric each fleetward process exposes on ``/metrics``, with its type, labels, unit and meaning, as the
code declares it: the router's, the supervisor controller's and the autoscaler's registries (with the link
gauges every one of them adds), and the simulated worker's vLLM-named metrics (real vLLM exposes these and
more under the same names). ``python -m fleetward.cli.metricsref`` prints the page; ``--write`` rewrites
docs/metrics.md; a test fails when the page and the code disagree, and checks Prometheus' naming rules.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

__all__ = ["PAGE", "MetricRow", "catalogue", "render"]

PAGE = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"

_INTRO = """\
# Metrics

<!-- Generated from the services' metric definitions by `python -m fleetward.cli.metricsref --write`; a test
     fails when this page and the code disagree. Edit the metrics' help texts in the code, not this page. -->

Every fleetward process serves Prometheus metrics on `GET /metrics`: the router on its port, the supervisor
controller on its control API port, the autoscaler on its own port, each node agent on its own port (beside
its workers; `agents/<node>` in etcd says where). Names follow Prometheus' conventions
(`fleetward_` prefix, counters end in `_total`, times in `_seconds`); no label carries a request id, so the
number of series stays bounded (each label takes a small fixed set of values). Workers keep vLLM's own names
(`vllm:`); the simulated worker serves the ones listed here, real vLLM these and more.
"""


@dataclass(frozen=True)
class MetricRow:
    process: str
    name: str  # as exposed (counters with ``_total``)
    type: str
    labels: tuple[str, ...]
    unit: str
    help: str


def _unit(name: str, kind: str) -> str:
    if name.endswith("_seconds") or "_seconds_" in name or name.endswith("_seconds_total"):
        return "seconds"
    if name.endswith("_perc") or name.endswith("_usage"):
        return "ratio (0-1)"
    if kind in ("counter",):
        return "count"
    return ""


def _wrapped(process: str, metrics: object) -> list[MetricRow]:
    rows = []
    for m in vars(metrics).values():
        if not isinstance(m, MetricWrapperBase):
            continue
        kind = str(m._type)  # prometheus_client keeps the definition on the wrapper
        name = m._name + ("_total" if kind == "counter" else "")
        rows.append(MetricRow(process, name, kind, tuple(m._labelnames), _unit(name, kind), m._documentation))
    return rows


def _collected(process: str, registry: CollectorRegistry, skip: Iterable[str] = ()) -> list[MetricRow]:
    """Families a collector yields (the link gauges, the simulated worker's vLLM metrics)."""
    rows = []
    done = set(skip)
    for family in registry.collect():
        if family.name in done:
            continue
        labels: list[str] = []
        for s in family.samples:
            labels += [k for k in s.labels if k not in labels and k != "le"]
        name = family.name + ("_total" if family.type == "counter" else "")
        rows.append(MetricRow(process, name, family.type, tuple(labels), _unit(name, family.type),
                              family.documentation))
    return rows


def catalogue() -> list[MetricRow]:
    from fleetward.autoscale.daemon import _Metrics as AutoscalerMetrics
    from fleetward.fleet.loops import LoopMetrics
    from fleetward.fleet.telemetry import link_gauges
    from fleetward.migration.metrics import RouterMetrics
    from fleetward.sim.engine import EngineStats
    from fleetward.sim.metrics import EngineMetrics as WorkerMetrics
    from fleetward.supervisor.agent import _Metrics as AgentMetrics
    from fleetward.supervisor.controller import _Metrics as ControllerMetrics

    links = CollectorRegistry()
    link_gauges(links, store=object(), bus=object())
    shared = _collected("router, controller, autoscaler, agent", links)
    workers = CollectorRegistry()
    workers.register(WorkerMetrics(EngineStats(), "sim-tiny"))
    rows = [*_wrapped("router", RouterMetrics()), *_wrapped("controller", ControllerMetrics()),
            *_wrapped("autoscaler", AutoscalerMetrics()), *_wrapped("agent", AgentMetrics()), *shared,
            *_wrapped("router, controller, agent", LoopMetrics()),
            *_collected("worker", workers)]
    return sorted(rows, key=lambda r: (r.name.startswith("vllm:"), r.name))


def render() -> str:
    out = [_INTRO, "| metric | type | labels | unit | exposed by | meaning |", "|---|---|---|---|---|---|"]
    for r in catalogue():
        labels = ", ".join(f"`{label}`" for label in r.labels) or "-"
        out.append(f"| `{r.name}` | {r.type} | {labels} | {r.unit or '-'} | {r.process} | "
                   f"{r.help.replace('|', '/')} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fleetward.cli.metricsref", description=__doc__)
    p.add_argument("--write", action="store_true", help=f"rewrite {PAGE}")
    args = p.parse_args(argv)
    text = render()
    if args.write:
        PAGE.write_text(text)
        print(f"wrote {PAGE}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
