"""The prefill step of prefill/decode (P/D): a prompt's KV computed on a prefill worker, decoded on another.

When the model of a request has routable ``prefill`` workers, every attempt of a stream goes in two steps, as
vLLM's disaggregated-serving proxy does (docs/pd.md): :meth:`Prefill.run` asks the least-loaded prefill worker
for one token, unstreamed, and hands the attempt loop the decode request, which carries the
``kv_transfer_params`` the prefill worker answered with (a connector that finds KV by prompt, like vLLM's
ExampleConnector, answers with none and needs none), plus whether the decode worker must check the transfer
(``verify``) and what it does when a check fails (``kv_load_failure_policy``).

A prefill that fails costs time, not tokens: the decode worker then computes the prompt itself, as an
aggregated worker would. A decode worker that refuses the KV it was given (:meth:`Prefill.refused`) is fine
itself: the attempt is tried again, not as a migration, under ``routing.kv_failure_policy``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from fleetward.fleet.clock import Clock
from fleetward.fleet.config import RouterConfig
from fleetward.fleet.kv import KV_ERROR_TYPE
from fleetward.fleet.registry import FleetView
from fleetward.migration.journal import Journal
from fleetward.migration.metrics import RouterMetrics
from fleetward.migration.upstream import Upstream, UpstreamError
from fleetward.migration.wire import RouterError

__all__ = ["KvTries", "Prefill", "kv_refusal"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class KvTries:
    """One request's P/D state across its attempts."""

    excluded: set[str] = field(default_factory=set)  # prefill workers whose KV a decode worker refused
    retries: int = 0
    retry: bool = False  # the attempt about to start repeats one whose KV was refused (not a migration)
    use_prefill: bool = True


class Prefill:
    def __init__(self, config: RouterConfig, *, view: FleetView, upstream: Upstream, metrics: RouterMetrics,
                 clock: Clock) -> None:
        self.config = config
        self.view = view
        self.upstream = upstream
        self.metrics = metrics
        self.clock = clock

    async def run(self, j: Journal, path: str, body: dict[str, Any], load: dict[str, int],
                  exclude: set[str]) -> tuple[dict[str, Any], str | None]:
        """The decode request for ``body`` and the prefill worker it carries KV from (None: no KV, the decode
        worker computes the prompt: the model has no routable prefill worker outside ``exclude``, or the
        prefill failed). A resumed stream is prefilled again, prompt and emitted tokens."""
        fleet = self.view.fleet
        prefill = sorted(wid for wid, rec in fleet.workers.items()
                         if rec.role == "prefill" and rec.model == j.model and wid not in exclude
                         and (h := fleet.health.get(wid)) is not None and h.state.is_routable)
        if not prefill:
            return body, None
        worker = min(prefill, key=lambda w: load.get(w, 0))
        started = self.clock.monotonic()
        try:
            kv = await self.ask(fleet.workers[worker].url, path, body, timeout=self.config.prefill_timeout_s)
        except UpstreamError as exc:
            self.metrics.prefills.labels("failed").inc()
            log.warning("%s: prefill on %s failed (%s); the decode worker computes the prompt itself", j.id,
                        worker, exc)
            return body, None
        self.metrics.prefills.labels("ok").inc()
        self.metrics.prefill_seconds.observe(self.clock.monotonic() - started)
        if kv is None:
            return body, worker
        policy = "recompute" if self.config.kv_failure_policy == "recompute" else "fail"
        return {**body, "kv_transfer_params": {**kv, "verify": self.config.kv_verify,
                                               "kv_load_failure_policy": policy}}, worker

    async def ask(self, url: str, path: str, body: dict[str, Any], *, timeout: float) -> dict[str, Any] | None:
        """Have the worker at ``url`` compute (or find) the KV of ``body``'s prompt and keep it for a decode
        worker: one token, unstreamed, ``do_remote_decode``. Its answer's ``kv_transfer_params`` (None: a
        connector that finds KV by prompt answers with none). Raises :class:`UpstreamError`."""
        ask = {**body, "stream": False, "max_tokens": 1, "min_tokens": 0,
               "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
        ask.pop("stream_options", None)
        answer = await self.upstream.call(url, path, ask, timeout=timeout)
        kv = answer.get("kv_transfer_params")
        return kv if isinstance(kv, dict) else None

    def refused(self, j: Journal, exc: UpstreamError, prefilled_on: str | None, worker: str, kv: KvTries) -> bool:
        """Whether the attempt failed because ``worker`` refused the KV from ``prefilled_on``; if so ``kv`` says
        how the next attempt goes (prefilled again, on another prefill worker, or without prefill) and
        ``j.attempts`` no longer counts this one. Raises :class:`RouterError` under ``kv_failure_policy: fail``."""
        if prefilled_on is None:
            return False
        kind = kv_refusal(exc)
        if kind is None:
            return False
        kv.excluded.add(prefilled_on)
        kv.use_prefill = self._retry(j, exc, kind, prefilled_on, worker, kv.retries)
        kv.retries += kv.use_prefill
        j.attempts -= 1
        kv.retry = True
        return True

    def _retry(self, j: Journal, exc: UpstreamError, kind: str, prefilled_on: str, worker: str,
               retries: int) -> bool:
        """Whether to prefill again (else the next try goes without prefill); raises :class:`RouterError` under
        ``kv_failure_policy: fail``."""
        self.metrics.kv_failures.labels(kind).inc()
        policy = self.config.kv_failure_policy
        log.warning("request %s: the KV transfer %s -> %s failed (%s: %s); kv_failure_policy %s", j.id,
                    prefilled_on, worker, kind, exc.message, policy)
        if policy == "fail":
            raise RouterError(502, f"the KV transfer from prefill worker {prefilled_on} to decode worker {worker} "
                              f"failed ({kind}: {exc.message}) and routing.kv_failure_policy is fail")
        return policy == "retry" and retries < self.config.kv_retries


def kv_refusal(exc: UpstreamError) -> str | None:
    """The kind of KV failure when a decode worker refused the KV it was given (a 502 of error type
    ``KVTransferError``, the kind in ``param``), else None."""
    err = exc.body.get("error") if exc.status == 502 and isinstance(exc.body, dict) else None
    if not isinstance(err, dict) or err.get("type") != KV_ERROR_TYPE:
        return None
    return str(err.get("param"))
