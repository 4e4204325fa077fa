"""Which vocabulary turns each model's token ids into text at the router, loaded off the event loop.

A model's tokenizer comes from ``routing.tokenizers`` (the operator's word, on the router's host) or else
from what its workers advertise in ``workers/<id>`` (a built-in vocabulary name, or the model folder the
agent started vLLM with, or the folder an adopted vLLM names as its ``root``). Loading a production
tokenizer takes a noticeable fraction of a second, so it runs in a thread as soon as a worker of the model
appears, and requests wait for it only if they come first.

Where none can be loaded the router passes on the workers' own text, says so once in its log, and
``/v1/models`` shows it (``fleetward.detokenizer: worker`` with why): token ids stay exact, but the text
of a migrated stream may differ from the first character after the migration on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fleetward.fleet.errors import FleetwardError
from fleetward.fleet.loops import Loops
from fleetward.fleet.vocab import Vocabulary, load_vocabulary

__all__ = ["TextSources"]

log = logging.getLogger(__name__)


@dataclass
class _Source:
    source: str | None
    task: asyncio.Task[None] | None = None
    vocab: Vocabulary | None = None
    why: str = ""


class TextSources:
    """The vocabulary of each model. Loads run as one-off tasks of ``loops`` (the router's; by default loops of
    its own, closed by :meth:`aclose`)."""

    def __init__(self, overrides: Mapping[str, str] | None = None, *, loops: Loops | None = None) -> None:
        self.overrides = dict(overrides or {})
        self._models: dict[str, _Source] = {}
        self._own_loops = loops is None
        self._loops = loops if loops is not None else Loops(service="router-text").start()

    def want(self, model: str, advertised: str | None) -> None:
        """A worker of ``model`` appeared, advertising ``advertised``: start loading unless known already."""
        known = self._models.get(model)
        source = self.overrides.get(model) or advertised
        if known is not None:
            loading = known.task is not None and not known.task.done()
            if known.vocab is not None or loading or source is None or source == known.source:
                return  # another worker's word is tried only when the first one's could not be loaded
        entry = self._models[model] = _Source(source)
        if source is None:
            entry.why = "its workers advertise no tokenizer and routing.tokenizers names none"
            log.warning("model %s: %s; the workers' own text is passed on (a migrated stream's text may differ "
                        "after the migration)", model, entry.why)
            return
        entry.task = self._loops.spawn(f"tokenizer-{model}", self._load(model, entry))

    async def _load(self, model: str, entry: _Source) -> None:
        assert entry.source is not None
        try:
            entry.vocab = await asyncio.to_thread(load_vocabulary, entry.source)
        except FleetwardError as exc:
            entry.why = str(exc)
            log.warning("model %s: %s; the workers' own text is passed on (a migrated stream's text may differ "
                        "after the migration)", model, entry.why)
            return
        log.info("model %s: the router turns token ids into text with %r", model, entry.vocab)

    async def get(self, model: str) -> Vocabulary | None:
        """The model's vocabulary (waiting for a load under way), or None: pass the workers' text on."""
        entry = self._models.get(model)
        if entry is None and model in self.overrides:
            self.want(model, None)
            entry = self._models.get(model)
        if entry is None:
            return None
        if entry.task is not None and not entry.task.done():
            await asyncio.shield(entry.task)
        return entry.vocab

    def status(self, model: str) -> dict[str, Any]:
        """What ``/v1/models`` says about how the model's text is made."""
        entry = self._models.get(model)
        if entry is not None and entry.vocab is not None:
            return {"detokenizer": "router", "tokenizer": entry.source}
        if entry is not None and entry.task is not None and not entry.task.done():
            return {"detokenizer": "loading", "tokenizer": entry.source}
        return {"detokenizer": "worker", "why": entry.why if entry is not None else "no worker seen yet"}

    async def aclose(self) -> None:
        """Stop the loads under way (reaped here when the loops are this object's own, else by their owner)."""
        for entry in self._models.values():
            if entry.task is not None and not entry.task.done():
                entry.task.cancel()
        if self._own_loops:
            await self._loops.aclose()
