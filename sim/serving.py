"""The serving of ``POST /v1/completions`` and ``POST /v1/chat/completions`` over the simulated engine.

Both stream and non-stream, byte for byte in vLLM's shapes (key order included; see ``tests/data/vllm-0.32``).
``prompt`` is text, a list of token ids, or a list of either (several prompts: one choice each). Honoured:
``max_tokens`` (chat: ``max_completion_tokens`` too; clamped to the context left, as vLLM does),
``ignore_eos``, ``stop`` (str or list), ``stop_token_ids``, ``include_stop_str_in_output``, ``return_token_ids``,
``stream_options.include_usage`` and ``continuous_usage_stats``, ``min_tokens``, ``add_generation_prompt``
(chat), the ``X-Request-Id`` header, ``kv_transfer_params`` (prefill/decode: :mod:`.kvtransfer`). Accepted
and ignored, because the simulated model is deterministic: ``top_p``, ``top_k``, ``min_p``, the penalties,
``logit_bias``, ``bad_words``, ``allowed_token_ids``, ``priority``, ``user`` (and any other key vLLM would
accept), though checked as vLLM checks them. ``temperature`` and ``seed`` choose a sample only as far as vLLM
makes them repeatable: a sampled (temperature above 0) request with a ``seed`` continues from the prompt's
state mixed with a salt of its seed (``SamplingSpec.salt``), anything else is the model's own continuation.
``n`` > 1 (not greedy, as in vLLM) is answered whole: choice ``k`` of a seeded request is the request with
seed ``seed + k``, as vLLM's child requests are; unseeded, choice 0 is the model's own continuation and each
other one is mixed with its own salt; the same on every worker. ``logprobs`` (chat: with ``top_logprobs``),
``prompt_logprobs`` and ``echo`` (a completion's prompt, a chat's last message, before the answer; with
``max_tokens`` 0, the prompt alone) are answered as vLLM answers them, streamed or not, the logprobs read off
the model's own distribution (:mod:`.logprobs`). Refused with a 400 naming the parameter, although vLLM serves
them: beam search. Several choices (``n``, a list of prompts) stream side by side, each chunk naming its
choice, as vLLM's do.

Every request vLLM 0.32 refuses for the tiny model is refused at the same stage, with vLLM's status, type,
``param`` and message (the stages and the vLLM files they come from are listed in :mod:`.protocol`): wrong
types as its lax schema sees them (``"5"`` is a valid ``max_tokens``), a malformed chat message (any role is
fine, and so is a message without content), a prompt over the context, sampling parameters out of range,
token ids outside the vocabulary, ``suffix``. One difference: for a malformed chat message vLLM lists the
complaint of every message type it knows; the sim gives the first, which carries the ``param``.

While ``error_rate`` hits, new requests get the 500 a dead EngineCore gives. A client that disconnects
(stream or not) aborts its request in the engine, freeing its batch slot and KV blocks. The request's
parsing is :mod:`.protocol` and :mod:`.sampling`, its stream :mod:`.sse`, its responses :mod:`.responses`.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from fleetward.fleet.clock import Clock
from fleetward.fleet.errors import WorkerError
from fleetward.fleet.kv import KV_ERROR_TYPE, KvOffer, KvTransferError
from fleetward.sim.engine import RequestCut, SimEngine, SimRequest
from fleetward.sim.kvtransfer import KvTransfer
from fleetward.sim.logprobs import (
    Scorer,
    Shown,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
    prompt_positions,
    shown,
)
from fleetward.sim.protocol import ApiError, engine_dead, read_json
from fleetward.sim.responses import Cut, EventStream, Released, error_response
from fleetward.sim.sampling import ParsedRequest, parse_request
from fleetward.sim.servedmodel import ServedModel
from fleetward.sim.sse import ChatChunks, CompletionChunks, Echo, events, fanned_events

__all__ = ["CompletionServing", "await_or_abort"]


class CompletionServing:
    """The two generation endpoints (module docstring) over one engine: :meth:`completions` and :meth:`chat`."""

    def __init__(self, served: ServedModel, engine: SimEngine, kv: KvTransfer, clock: Clock) -> None:
        self._served = served
        self._engine = engine
        self._kv = kv
        self._clock = clock
        self._token_text = TokenText(functools.partial(served.decode, skip_special=False))

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, *, chat: bool) -> Response:
        try:
            body = await read_json(request)
            parsed = parse_request(body, chat=chat, served=self._served)
            assert isinstance(body, dict)
            if self._engine.draw_error():
                raise engine_dead()
        except ApiError as exc:
            return error_response(exc)
        rid = _request_id(request, body, "chatcmpl-" if chat else "cmpl-")
        created = int(self._clock.wall())
        kv_params = body.get("kv_transfer_params")
        kv: tuple[int, int] | None = None
        if isinstance(kv_params, dict) and (offer := KvOffer.of(kv_params)) is not None:
            try:
                kv = await self._kv.load(kv_params, offer, parsed.prompt_ids)
            except KvTransferError as exc:
                return error_response(ApiError(str(exc), status=502, err_type=KV_ERROR_TYPE, param=exc.kind))
        req = self._engine.submit(parsed.prompt_ids, parsed.spec, rid, kv=kv)
        # A list of prompts, ``n`` choices: one engine request per choice, run side by side (in vLLM's order).
        reqs = [req, *(self._engine.submit(ids, spec, f"{rid}-{k}")
                       for k, (ids, spec) in enumerate(parsed.choices()[1:], 1))]

        def release() -> None:
            for r in reqs:
                self._engine.release(r)

        if parsed.stream:
            shape = ChatChunks if chat else CompletionChunks
            streams = [(r, shape(parsed, rid, created, parsed.adapter or self._served.name,
                                 self._served.system_fingerprint, scorer=self._scorer(r, parsed),
                                 echo=self._echo(r, parsed, chat=chat), index=k, prompt_ids=r.prompt_ids))
                       for k, r in enumerate(reqs)]
            if len(streams) == 1:
                return EventStream(events(*streams[0]), release)
            prompts = sum(len(r.prompt_ids) for r in reqs[::parsed.n])  # each prompt once, as vLLM counts it
            return EventStream(fanned_events(streams, prompts), release)

        outcome: WorkerError | RequestCut | None = None
        try:
            for r in reqs:
                outcome = await await_or_abort(request, self._engine, r)
                if outcome is not None or r.finish_reason == "abort":
                    break
        except BaseException:
            release()
            raise
        if isinstance(outcome, RequestCut):
            return Cut(outcome, release)
        if outcome is not None:
            err = engine_dead() if outcome.status >= 500 else ApiError(outcome.message)
        elif any(r.finish_reason == "abort" for r in reqs):
            err = ApiError("Client disconnected")
        else:
            answer = self._chat_body(reqs, parsed, rid, created) if chat else self._completion_body(
                reqs, parsed, rid, created)
            if isinstance(kv_params, dict) and kv_params.get("do_remote_decode"):
                offer = self._kv.offer(str(request.base_url).rstrip("/"), parsed.prompt_ids)
                answer["kv_transfer_params"] = None if offer is None else offer.params()
            return Released(answer, 200, release)
        return Released(err.body(), err.status, release)

    # -- logprobs and echo (.logprobs) --------------------------------------------------------------------

    def _scorer(self, req: SimRequest, p: ParsedRequest) -> Scorer | None:
        """The logprobs of ``req``'s generated tokens, where ``p`` asks for them."""
        if p.logprobs is None:
            return None
        spec = req.params
        return Scorer(self._engine.scheduler.model, req.prompt_ids, p.logprobs, self._token_text, start=spec.start,
                      salt=spec.salt, ignore_eos=spec.ignore_eos)

    def _prompt_shown(self, req: SimRequest, p: ParsedRequest) -> list[Shown] | None:
        """``req``'s prompt tokens with their logprobs, where ``p`` asks for them."""
        if p.prompt_logprobs is None:
            return None
        positions = prompt_positions(self._engine.scheduler.model, req.prompt_ids, p.prompt_logprobs,
                                     start=req.params.start)
        return shown(req.prompt_ids, positions, self._token_text)

    def _output_shown(self, req: SimRequest, p: ParsedRequest) -> list[Shown] | None:
        """``req``'s generated tokens with their logprobs (an answer made whole), where ``p`` asks for them."""
        scorer = self._scorer(req, p)
        return None if scorer is None else scorer.next([] if p.echo_only else req.output_ids)

    def _echo(self, req: SimRequest, p: ParsedRequest, *, chat: bool) -> Echo | None:
        """What a completion stream with ``echo`` opens with (a chat stream's echo is its own chunk)."""
        if not p.echo or chat:
            return None
        return Echo(self._echo_text(req, p), self._prompt_shown(req, p) or [])

    def _echo_text(self, req: SimRequest, p: ParsedRequest) -> str:
        """What ``echo`` puts before the answer: a completion's prompt (special tokens written out; nothing
        when token ids are returned, as in vLLM), a chat's last message (:attr:`ParsedRequest.echo_text`)."""
        if not p.echo or p.return_token_ids:
            return p.echo_text
        return p.echo_text or self._served.decode(req.prompt_ids, skip_special=False)

    # -- non-stream bodies --------------------------------------------------------------------------

    def _completion_body(self, reqs: list[SimRequest], p: ParsedRequest, rid: str,
                         created: int) -> dict[str, Any]:
        """One choice per prompt, in the order sent; the usage of them all, as vLLM sums it. With ``echo`` the
        prompt comes first, in the text and in the logprobs."""
        rt = p.return_token_ids
        choices = []
        for k, req in enumerate(reqs):
            prompt, output = self._prompt_shown(req, p), self._output_shown(req, p)
            tokens = [*(prompt or [] if p.echo else []), *(output or [])]
            choices.append({
                "index": k, "text": self._echo_text(req, p) + ("" if p.echo_only else req.output_text),
                "logprobs": None if p.logprobs is None else completion_logprobs(tokens, p.logprobs),
                "finish_reason": req.finish_reason, "stop_reason": req.stop_reason,
                "token_ids": list(req.output_ids) if rt else None,
                "prompt_logprobs": None if prompt is None else prompt_logprobs(prompt),
                "prompt_token_ids": list(req.prompt_ids) if rt else None, "routed_experts": None})
        return {"id": rid, "object": "text_completion", "created": created, "model": p.adapter or self._served.name,
                "choices": choices, "service_tier": None, "system_fingerprint": self._served.system_fingerprint,
                "usage": _usage(*reqs, n=p.n), "kv_transfer_params": None, "ec_transfer_params": None,
                "metrics": None}

    def _chat_body(self, reqs: list[SimRequest], p: ParsedRequest, rid: str, created: int) -> dict[str, Any]:
        rt = p.return_token_ids
        choices = []
        for k, req in enumerate(reqs):
            output = self._output_shown(req, p)
            choices.append({
                "index": k, "message": {"role": p.role, "content": p.echo_text + req.output_text, "refusal": None,
                                        "annotations": None, "audio": None, "function_call": None,
                                        "reasoning": None},
                "logprobs": None if output is None else chat_logprobs(output, p.logprobs or 0),
                "finish_reason": req.finish_reason, "stop_reason": req.stop_reason,
                "token_ids": list(req.output_ids) if rt else None, "routed_experts": None})
        prompt = self._prompt_shown(reqs[0], p)
        return {"id": rid, "object": "chat.completion", "created": created, "model": p.adapter or self._served.name,
                "choices": choices, "service_tier": None, "system_fingerprint": self._served.system_fingerprint,
                "usage": _usage(*reqs, n=p.n), "prompt_logprobs": None if prompt is None else prompt_logprobs(prompt),
                "prompt_token_ids": p.prompt_ids if rt else None, "prompt_text": None,
                "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


async def await_or_abort(request: Request, engine: SimEngine, req: SimRequest) -> WorkerError | RequestCut | None:
    """Wait for ``req`` to finish; abort it in the engine if the client disconnects first."""

    async def watch_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        engine.abort(req)

    async with asyncio.TaskGroup() as tg:
        watcher = tg.create_task(watch_disconnect())
        try:
            await req.wait_finished()
        except (WorkerError, RequestCut) as exc:
            return exc
        finally:
            watcher.cancel()
    return None


def _request_id(request: Request, body: dict[str, Any], prefix: str) -> str:
    rid = request.headers.get("x-request-id") or body.get("request_id")
    return f"{prefix}{rid if isinstance(rid, str) and rid else secrets.token_hex(8)}"


def _usage(*reqs: SimRequest, n: int = 1) -> dict[str, Any]:
    """vLLM's usage of a request's choices: each prompt counted once (not once per choice), every output."""
    p, c = sum(len(r.prompt_ids) for r in reqs[::n]), sum(len(r.output_ids) for r in reqs)
    return {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c,
            "prompt_tokens_details": None, "completion_tokens_details": None}
