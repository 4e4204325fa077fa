"""LoRA adapters: which worker serves which, as each worker's own ``GET /v1/models`` says, and loading or
unloading one on the whole fleet.

vLLM serves LoRA adapters beside its base model (``--enable-lora``, ``--lora-modules``, or at runtime with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): its ``/v1/models`` lists each adapter as a card whose ``parent`` is the
base model, and a request naming the adapter as its ``model`` is generated with it. Workers may serve
different adapters (one loaded on some workers only; a restarted worker has lost what was loaded at runtime),
so the router asks every routable worker which adapters it serves, every ``interval_s`` and at once after a
load or unload it passed on, and a request naming an adapter goes only to workers that serve it
(:class:`~fleetward.migration.placement.Placement`). Its text is the base model's (same tokenizer). A request
naming an adapter no worker serves gets vLLM's 404.

``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` go to every routable worker: the answer is the
first worker's success, or, when none succeeded, the first worker's refusal (a 4xx), else the first failure,
as it wrote them (a worker that could not be reached does not speak for the request).

An adapter loaded through the router is the fleet's until it is unloaded through the router: a worker that
lacks it (restarted by the supervisor, which loses what vLLM loaded at runtime, or added since) is sent the
same load request when the router next asks it what it serves. A worker that refuses it (a 4xx: another base
model, a path its host does not have) is not asked again. The router keeps these requests in memory: another
router, or this one restarted, knows only the loads it passed on itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
from fastapi import Request
from fastapi.responses import Response

from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.migration.wire import RouterError, error_body

__all__ = ["ADAPTER_ROUTES", "Adapters", "fleet_answer"]

log = logging.getLogger(__name__)

ADAPTER_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
_ASK_TIMEOUT_S = 2.0
_CHANGE_TIMEOUT_S = 120.0  # loading reads the adapter's weights from disk


class Adapters:
    """Each worker's adapters (module docstring). ``workers``: the routable workers (id, base URL) to ask."""

    def __init__(self, session: Callable[[], aiohttp.ClientSession], workers: Callable[[], list[tuple[str, str]]],
                 *, interval_s: float = 5.0, clock: Clock = SYSTEM_CLOCK) -> None:
        self._session = session
        self._workers = workers
        self.interval_s = interval_s
        self.clock = clock
        self.served: dict[str, dict[str, dict[str, Any]]] = {}  # worker -> adapter name -> its card
        # adapters loaded through this router: name -> (the load request's body, its content type)
        self.loads: dict[str, tuple[bytes, str]] = {}
        self.refused: dict[str, set[str]] = {}  # adapter name -> workers that refused to load it (4xx)
        self._changing = asyncio.Lock()  # a load or unload passed on, or a re-load: one at a time

    # -- what is served where -----------------------------------------------------------------------------

    def card(self, name: str) -> dict[str, Any] | None:
        """Adapter ``name``'s card, as a worker that serves it lists it (None: no worker serves it)."""
        return next((cards[name] for cards in self.served.values() if name in cards), None)

    def base_of(self, name: str) -> str | None:
        """The base model of adapter ``name`` (None: no worker serves an adapter of that name)."""
        card = self.card(name)
        return None if card is None else str(card["parent"])

    def workers_of(self, name: str) -> set[str]:
        return {w for w, cards in self.served.items() if name in cards}

    def cards(self) -> list[dict[str, Any]]:
        """Every adapter some worker serves, its card as one of them lists it, by name."""
        merged: dict[str, dict[str, Any]] = {}
        for cards in self.served.values():
            for name, card in cards.items():
                merged.setdefault(name, card)
        return [merged[name] for name in sorted(merged)]

    # -- asking the workers ---------------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            await self.refresh()
            await self.clock.sleep(self.interval_s)

    async def refresh(self) -> None:
        """Ask every routable worker which adapters it serves; forget workers no longer routable. A worker that
        does not answer keeps what it said last (a slow answer is not an unload)."""
        workers = self._workers()
        answers = await asyncio.gather(*(self._ask(url) for _, url in workers))
        routable = {w for w, _ in workers}
        for (worker, _), cards in zip(workers, answers, strict=True):
            if cards is not None:
                self.served[worker] = cards
        for gone in set(self.served) - routable:
            del self.served[gone]
        lacking = [(w, url, name) for (w, url), cards in zip(workers, answers, strict=True) if cards is not None
                   for name in self.loads if name not in cards and w not in self.refused.get(name, ())]
        if lacking:
            await self._reload(lacking)

    async def _reload(self, lacking: list[tuple[str, str, str]]) -> None:
        """Load again, on each worker that lacks it, an adapter loaded through the router (module docstring)."""
        async with self._changing:
            todo = [(w, url, name, self.loads[name]) for w, url, name in lacking if name in self.loads]

            async def one(worker: str, url: str, name: str, body: bytes, ctype: str) -> None:
                status, raw, _ = await self._post(worker, url + "/v1/load_lora_adapter", body, ctype)
                if status == 200:
                    log.info("LoRA adapter %s loaded again on worker %s, which had lost it", name, worker)
                    if (cards := await self._ask(url)) is not None:
                        self.served[worker] = cards
                elif 400 <= status < 500:
                    log.warning("worker %s refused LoRA adapter %s (%d %s); it is not asked again", worker, name,
                                status, raw[:200])
                    self.refused.setdefault(name, set()).add(worker)

            await asyncio.gather(*(one(w, url, name, body, ctype) for w, url, name, (body, ctype) in todo))

    async def _ask(self, url: str) -> dict[str, dict[str, Any]] | None:
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError, TypeError,
                                 KeyError, AttributeError):
            async with self._session().get(url + "/v1/models",
                                           timeout=aiohttp.ClientTimeout(total=_ASK_TIMEOUT_S)) as r:
                if r.status != 200:
                    return None
                cards = orjson.loads(await r.read())["data"]
                return {c["id"]: c for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str)
                        and isinstance(c.get("parent"), str) and c["parent"] != c["id"]}
        return None

    # -- loading and unloading on the fleet ---------------------------------------------------------------

    async def change(self, request: Request) -> Response:
        """``POST /v1/load_lora_adapter`` or ``/v1/unload_lora_adapter``, on every routable worker."""
        body = await request.body()
        workers = self._workers()
        if not workers:
            return RouterError(503, "no healthy worker to load or unload the adapter on").response()
        ctype = request.headers.get("content-type", "application/json")
        path = request.url.path
        async with self._changing:
            answers = await asyncio.gather(*(self._post(w, u + path, body, ctype) for w, u in workers))
            for (worker, _), (status, raw, _) in zip(workers, answers, strict=True):
                if status != 200:
                    log.info("%s on worker %s: %d %s", path, worker, status, raw[:200])
            name = _adapter_name(body)
            if name is not None and any(a[0] == 200 for a in answers):
                if path == "/v1/load_lora_adapter":
                    self.loads[name] = (body, ctype)
                    self.refused.pop(name, None)
                else:
                    self.loads.pop(name, None)
        await self.refresh()  # the next request goes where the adapter is now
        status, raw, answered = fleet_answer(answers)
        return Response(raw, status_code=status, headers={"content-type": answered} if answered else None)

    async def _post(self, worker: str, url: str, body: bytes, ctype: str) -> tuple[int, bytes, str | None]:
        try:
            async with self._session().post(url, data=body, headers={"content-type": ctype},
                                            timeout=aiohttp.ClientTimeout(total=_CHANGE_TIMEOUT_S)) as r:
                return r.status, await r.read(), r.headers.get("content-type")
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.warning("%s on worker %s failed: %s", url, worker, exc)
            return 502, orjson.dumps(error_body(502, f"worker {worker}: {exc}")), "application/json"


def fleet_answer(answers: list[tuple[int, bytes, str | None]]) -> tuple[int, bytes, str | None]:
    """The answer to a load or unload that went to every worker: a worker's success, else a worker's refusal
    (a 4xx: the request's own fault), else the first failure. A worker that could not be reached (502) says
    nothing about the request."""
    return next((a for a in answers if a[0] == 200), None) or next(
        (a for a in answers if 400 <= a[0] < 500), answers[0])


def _adapter_name(body: bytes) -> str | None:
    """The ``lora_name`` of a load or unload request's body (None: not one the workers took)."""
    with contextlib.suppress(orjson.JSONDecodeError):
        parsed = orjson.loads(body)
        if isinstance(parsed, dict) and isinstance(parsed.get("lora_name"), str):
            return str(parsed["lora_name"])
    return None
