"""The simulated worker's ``GET /metrics``: vLLM's engine metrics (names, labels, buckets) over :class:`EngineStats`.

The names and help texts are vLLM 0.32's, labelled ``model_name`` and ``engine`` as its are, so the
supervisor's detectors, the router and dashboards read a simulated worker as they read a real one. The
catalogue in docs/metrics.md is generated from :class:`EngineMetrics` (``cli/metricsref.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from starlette.requests import Request
from starlette.responses import Response

from fleetward.sim.engine import EngineStats, Histogram

__all__ = ["EngineMetrics", "metrics_endpoint"]


def metrics_endpoint(stats: EngineStats, model_name: str) -> Callable[[Request], Awaitable[Response]]:
    """The ``GET /metrics`` route: ``stats`` read at each scrape, in Prometheus' text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineMetrics(stats, model_name))

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return metrics


class EngineMetrics(Collector):
    """vLLM's engine metrics (names, labels, buckets) read from :class:`EngineStats` at scrape time."""

    def __init__(self, stats: EngineStats, model_name: str) -> None:
        self._stats = stats
        self._labels = ["model_name", "engine"]
        self._values = [model_name, "0"]

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        g = GaugeMetricFamily(name, doc, labels=self._labels)
        g.add_metric(self._values, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        c = CounterMetricFamily(name, doc, labels=self._labels)
        c.add_metric(self._values, value)
        return c

    def _histogram(self, name: str, doc: str, h: Histogram) -> Metric:
        m = HistogramMetricFamily(name, doc, labels=self._labels)
        m.add_metric(self._values, [(floatToGoString(b), c) for b, c in h.cumulative()], h.sum)
        return m

    def collect(self) -> Iterable[Metric]:
        s = self._stats
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                          s.running)
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                          s.waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                          s.kv_usage)
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                            s.preemptions)
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.",
                            s.generation_tokens)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*self._labels, "finished_reason"])
        for reason, n in s.finished.items():
            success.add_metric([*self._values, reason], n)
        yield success
        yield self._histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", s.ttft)
        yield self._histogram("vllm:inter_token_latency_seconds",
                              "Histogram of inter-token latency in seconds.", s.itl)
        yield self._histogram("vllm:e2e_request_latency_seconds",
                              "Histogram of e2e request latency in seconds.", s.e2e)
        yield self._histogram("vllm:request_queue_time_seconds",
                              "Histogram of time spent in WAITING phase for request.", s.queue)
