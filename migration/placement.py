"""Which workers may take a request now, and which one does: the router's view of where requests go.

A candidate is routable (health), serves the request's model, is not a prefill worker (those take the P/D
prefill step only, :mod:`.prefill`), is not silent right now with work in flight and not shunned (its streams
were moved away for silence and it has shown no life since), unless every such worker is. The routing policy
(:mod:`.policy`) picks among candidates by their load: streams plus passed-through requests in flight.
"""

from __future__ import annotations

from collections.abc import Callable

from fleetward.fleet.config import RouterConfig
from fleetward.fleet.registry import FleetView
from fleetward.fleet.worker import HealthState
from fleetward.migration.adapters import Adapters
from fleetward.migration.policy import RoutingPolicy
from fleetward.migration.progress import ProgressModel

__all__ = ["Placement"]


class Placement:
    """Candidates and load for the attempt loop; a worker for a passed-through request
    (:class:`~fleetward.migration.passthrough.Picker`). ``relayed``: passed-through requests in flight per
    worker."""

    def __init__(self, config: RouterConfig, *, view: FleetView, progress: ProgressModel, policy: RoutingPolicy,
                 relayed: Callable[[], dict[str, int]]) -> None:
        self.config = config
        self.view = view
        self.progress = progress
        self.policy = policy
        self._relayed = relayed
        self.seen_models: set[str] = set()  # a model whose workers all died is unavailable (503), not unknown
        self.adapters: Adapters | None = None  # the LoRA adapters workers serve (.adapters)

    def candidates(self, model: str, failed: list[str]) -> tuple[list[str], bool]:
        """Workers a request may go to next, and whether any registered worker serves ``model`` at all.

        Candidates (module docstring), preferably one this request has not failed on yet, else any but the
        one it failed on last (a worker that reset one stream may serve the next), else whatever is left.
        """
        fleet = self.view.fleet
        known = False
        ok: list[str] = []
        shunned: list[str] = []
        # A LoRA adapter: its base model's workers that serve it (.adapters).
        adapters = self.adapters if model not in self.seen_models else None
        base = adapters.base_of(model) if adapters is not None else None
        serving = adapters.workers_of(model) if adapters is not None and base is not None else set()
        for wid, rec in fleet.workers.items():
            if rec.model != (base or model) or (base is not None and wid not in serving):
                continue
            known = True
            h = fleet.health.get(wid)
            if h is None or not h.state.is_routable or rec.role == "prefill":
                continue
            if self.progress.silent_for(wid) > self.progress.allowed_silence(wid):
                continue
            ready_since = h.since if h.state is HealthState.READY else None
            if self.progress.shunned(wid, hold_s=self.config.stall_hold_s, ready_since=ready_since):
                shunned.append(wid)
                continue
            ok.append(wid)
        ok = ok or shunned
        fresh = [w for w in ok if w not in failed]
        if fresh:
            return fresh, known
        not_last = [w for w in ok if not failed or w != failed[-1]]
        return (not_last or ok), known

    def load(self) -> dict[str, int]:
        """Requests in flight per worker: streams and passed-through requests."""
        load = {w: p.in_flight for w, p in self.progress.workers.items()}
        for w, k in self._relayed().items():
            load[w] = load.get(w, 0) + k
        return load

    def models(self) -> list[str]:
        """Models some registered worker serves."""
        models = {rec.model for rec in self.view.fleet.workers.values()}
        self.seen_models |= models
        return sorted(models)

    def pick(self, model: str | None, tried: list[str]) -> tuple[str, str] | None:
        """A worker (id, base URL) for a passed-through request: a candidate for ``model`` (None: any model)
        that is none of ``tried``, or None."""
        models = [model] if model is not None else self.models()
        candidates = [w for m in models for w in self.candidates(m, tried)[0] if w not in tried]
        if not candidates:
            return None
        worker = self.policy.choose(candidates, self.load(), None)
        return worker, self.view.fleet.workers[worker].url

    def is_adapter(self, name: str) -> bool:
        """A LoRA adapter some routable worker serves."""
        return self.adapters is not None and self.adapters.base_of(name) is not None

    def routable(self) -> list[tuple[str, str]]:
        """Every worker (id, base URL) a request may go to now, of any model."""
        fleet = self.view.fleet
        return [(w, fleet.workers[w].url) for m in self.models() for w in self.candidates(m, [])[0]]
