"""A request of several choices: one journal per choice, one response as vLLM writes it.

vLLM answers a completion with a list of prompts, or ``n`` sampled choices (completions and chat), with one
response holding a choice per prompt and per sample, in that order (prompt by prompt, ``n`` each). The router
splits such a request into one request per choice (:func:`choices`), and each is journaled and migrated on
its own (:meth:`~fleetward.migration.router.Router.relay`): a failed worker costs the choices it held, and
of those only their tails.

- Answered whole, :func:`answer` assembles vLLM's response from the choices' journals: their indexes in
  vLLM's order, each choice's own ``finish_reason``, ``stop_reason``, ``logprobs`` and token ids, and the
  usage as vLLM sums it (each prompt's tokens once, every choice's completion tokens).
- Streamed, each choice's events (its own index, the response's id) go to the client as its tokens come,
  interleaved as vLLM's are (:class:`FanOut`): every choice's role chunk first (chat), the usage of them all
  and ``[DONE]`` once at the end. Such a stream has no event ids and is not resumed with ``Last-Event-ID``:
  its choices are resumed by the router that holds them.

What makes the split the same request:

- vLLM itself runs choice ``k`` of a request with ``seed`` s as a child request with seed ``s + k``
  (``vllm/v1/engine/parallel_sampling.py``), so each split choice is the sample vLLM would draw. Unseeded
  choices are independent samples either way.
- ``n > 1`` is split only when ``temperature`` is given and above 0: vLLM refuses greedy ``n > 1``, and
  without a temperature the model's default decides (its generation config), which the router does not
  know. Such a request, ``best_of``, and a whole answer whose choices the journal cannot make
  (:func:`~fleetward.migration.journal.whole_reason`: ``echo``, ``prompt_logprobs``, ...) are relayed whole
  instead (:mod:`.passthrough`).

After a failure a choice continues as every journaled request does (docs/architecture.md, "What is
exact"): token for token where it is greedy, a fresh sample from the failure on where it is sampled, seed or
not.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from fleetward.migration import wire
from fleetward.migration.downstream import SseOutput
from fleetward.migration.journal import (
    Journal,
    Kind,
    RequestRefused,
    batched,
    fanout,
    validate_body,
    whole_reason,
)
from fleetward.migration.metrics import RouterMetrics
from fleetward.migration.wire import RouterError

__all__ = ["Choices", "FanOut", "answer", "choices"]

_SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class Choices(NamedTuple):
    """A split request: each choice's body in vLLM's order, ``n`` per prompt."""

    bodies: list[dict[str, Any]]
    n: int


def choices(body: dict[str, Any], kind: Kind) -> Choices | None:
    """Each choice's request of a request of several choices, or None when it is not split (one choice, or a
    request relayed whole; see the module docstring). ``body`` was validated."""
    if fanout(body, kind) is None:
        return None
    if (_number(body.get("best_of")) or 1) > 1:
        return None
    n = int(_number(body.get("n")) or 1)
    temperature = _number(body.get("temperature"))
    if n > 1 and (temperature is None or temperature < _SAMPLING_EPS):
        return None
    seed = body.get("seed")
    seed = seed if isinstance(seed, int) and not isinstance(seed, bool) else None
    prompt = body.get("prompt")
    prompts: list[Any] = list(prompt) if kind is Kind.COMPLETION and isinstance(prompt, list) and batched(prompt) \
        else [prompt]
    common = {key: value for key, value in body.items() if key not in ("n", "best_of")}
    out = []
    for p in prompts:
        for k in range(n):
            one = dict(common)
            if kind is Kind.COMPLETION:
                one["prompt"] = p
            if seed is not None and n > 1:
                one["seed"] = seed + k
            try:
                validate_body(one, kind)
            except RequestRefused:
                return None
            if whole_reason(one, kind) is not None:
                return None
            out.append(one)
    return Choices(out, n)


def answer(rid: str, created: float, parts: Sequence[tuple[Journal, Any]], per_prompt: int) -> dict[str, Any]:
    """The whole response vLLM writes for the choices' journals (each with its joined ``logprobs``), in
    order; ``per_prompt``: choices per prompt (``n``), so that each prompt's tokens count once."""
    answers = [wire.final_response(j, logprobs) for j, logprobs in parts]
    out = dict(answers[0])
    out["id"], out["created"] = rid, int(created)
    out["choices"] = [{**a["choices"][0], "index": i} for i, a in enumerate(answers)]
    js = [j for j, _ in parts]
    out["usage"] = {**out["usage"], **_usage(js, per_prompt)}
    out["system_fingerprint"] = _fingerprint(js)
    return out


def _usage(js: Sequence[Journal], per_prompt: int) -> dict[str, int]:
    """The choices' usage as vLLM sums it: each prompt's tokens once (``per_prompt`` choices each), every
    choice's completion tokens."""
    prompt = sum(len(j.prompt_ids or ()) for j in js[::per_prompt])
    completion = sum(len(j.emitted) for j in js)
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}


def _fingerprint(js: Sequence[Journal]) -> str | None:
    """The ``system_fingerprint`` of the first choice whose worker gave one."""
    return next((j.fingerprint for j in js if j.fingerprint is not None), None)


class FanOut:
    """The client's side of a stream of several choices: each choice's :class:`SseOutput` (choice ``k`` of the
    response ``rid``) writes its events here as they come, interleaved as the choices' tokens arrive, as
    vLLM's are. The stream opens with every choice's role chunk (chat: vLLM sends them all first) and ends
    once: the usage of all the choices (each prompt's tokens once), then ``[DONE]``; or vLLM's in-band error
    when one choice cannot go on. A :class:`~fleetward.migration.downstream.ClientStream`."""

    def __init__(self, rid: str, outs: list[SseOutput], per_prompt: int, metrics: RouterMetrics) -> None:
        self._rid = rid
        self.outs = outs
        self.per_prompt = per_prompt
        self.metrics = metrics
        self._pending: list[bytes] = []
        self.write: Callable[[bytes], None] = self._pending.append  # until the response is under way
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._opened = False
        for out in outs:
            out.write = self._write
            out.opening = functools.partial(self._opening, out)
            out.started.add_done_callback(self._start)

    @property
    def rid(self) -> str:
        return self._rid

    @property
    def signalled(self) -> bool:
        """The response is a stream: failures from here on are in-band."""
        return self.started.done()

    def _start(self, _: asyncio.Future[None]) -> None:
        # The response starts once every choice's worker took it, so that a choice refused (a prompt of the
        # list over the context) is the whole request's HTTP error, as vLLM checks every prompt first.
        if not self.started.done() and all(out.started.done() for out in self.outs):
            self.started.set_result(None)

    def _write(self, data: bytes) -> None:
        self.write(data)

    def _opening(self, first: SseOutput) -> bytes:
        """What the first event of any choice follows: every choice's role chunk (chat), with the prompt's ids
        of the choice that came first (they share it)."""
        if self._opened:
            return b""
        self._opened = True
        if first.j.kind is not Kind.CHAT:
            return b""
        return b"".join(first.encoder.wrap(0, wire.role_chunk(first.j, out.encoder.index, self._rid))
                        for out in self.outs)

    def pending(self) -> bytes:
        data, self._pending = b"".join(self._pending), []
        return data

    def pause(self) -> None:
        for out in self.outs:
            out.pause()

    def resume(self) -> None:
        for out in self.outs:
            out.resume()

    def finish(self) -> None:
        """Every choice ended whole: the usage of them all (when asked for) and ``[DONE]``."""
        js = [out.j for out in self.outs]
        for out in self.outs:
            out.observe_itl()
        parts = []
        if js[0].wants_usage:
            chunk = wire.usage_chunk(js[0])
            chunk["id"] = self._rid
            chunk["usage"] = _usage(js, self.per_prompt)
            fingerprint = _fingerprint(js)
            if fingerprint is not None:
                chunk["system_fingerprint"] = fingerprint
            parts.append(wire.event(chunk))
        self.metrics.requests.labels(js[0].kind.value, "ok").inc()
        self.write(b"".join([*parts, wire.DONE]))

    def fail(self, exc: RouterError) -> None:
        """A choice cannot go on, so neither does the response: vLLM's in-band error, then ``[DONE]``."""
        self.metrics.requests.labels(self.outs[0].j.kind.value, f"failed_{exc.status}").inc()
        self.write(wire.error_event(exc.status, exc.message, body=exc.body) + wire.DONE)
