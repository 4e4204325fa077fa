"""The simulated worker's other vLLM endpoints, in vLLM 0.32's shapes (``tests/data/vllm-0.32``).

==============================================  ===================================================
``POST /tokenize``, ``POST /detokenize``        the API server's own: they answer while the engine hangs
``GET /version``                                ``{"version": "0.32.0"}`` (``sim.engine_version``)
``POST /v1/embeddings``, ``POST /pooling``      a unit vector per input, a function of its token ids
``POST /score``, ``/v1/score``                  the cosine of two inputs' vectors
``POST /rerank``, ``/v1/rerank``, ``/v2/rerank``  the same scores, best first, ``top_n`` of them
``POST /v1/audio/transcriptions``               text generated from the audio's digest (not streamed)
``POST /v1/responses``                          the Responses API over the engine, streamed or not
``GET /v1/responses/{id}``                      a stored response (``responses_store``)
==============================================  ===================================================

A real vLLM server serves either the generative endpoints or the pooling ones, by its model; the simulated
worker serves both, one model with both faces: what a router relaying them is tested against.

Work on the engine is a request of the engine like any generation: it waits behind ``max_num_seqs``, stalls
while the worker hangs, fails with the EngineCore error (``error_rate``, ``fail_inflight``), is cut
(``reset_inflight``: the connection drops), and dies with the process. Pooling and transcription are one
engine step (a one-token generation whose token is dropped). A Responses stream is vLLM's event sequence
(``response.created`` ... ``response.completed``) with one ``response.output_text.delta`` per engine step
that added text; the engine failing mid-stream ends it with the Responses API's ``error`` event.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import math
import secrets
import struct
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Literal, TypeVar

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fleetward.fleet.clock import Clock
from fleetward.fleet.config import SimConfig
from fleetward.fleet.errors import WorkerError
from fleetward.sim.engine import RequestCut, SamplingSpec, SimEngine, SimRequest
from fleetward.sim.protocol import ApiError, engine_dead, field_error, read_json, refused, schema_error
from fleetward.sim.responses import Cut, EventStream, enc, error_response, json_response
from fleetward.sim.servedmodel import ServedModel
from fleetward.sim.serving import await_or_abort
from fleetward.sim.tokenizer import render_chat

__all__ = ["mount"]

VLLM_VERSION = "0.32.0"
_DIMENSIONS = 128  # the tiny Llama's hidden size: what an embedding of it measures
_STORED_RESPONSES = 1024


class _Lax(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM takes unknown keys (and logs them)


_Body = TypeVar("_Body", bound=_Lax)


class _TokenizeText(_Lax):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class _TokenizeChat(_Lax):
    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


class _Detokenize(_Lax):
    model: str | None = None
    tokens: list[int]


_Input = str | list[str] | list[int] | list[list[int]]


class _Embed(_Lax):
    model: str | None = None
    input: _Input
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


class _Score(_Lax):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


class _Rerank(_Lax):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int = 0


class _Respond(_Lax):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    store: bool | None = True
    background: bool | None = False
    previous_response_id: str | None = None
    ignore_eos: bool = False
    tools: list[Any] = Field(default_factory=list)
    tool_choice: Any = "auto"


class _Endpoints:
    """The routes (module docstring), over one worker's model, engine and config."""

    def __init__(self, served: ServedModel, engine: SimEngine, config: SimConfig, clock: Clock) -> None:
        self.served = served
        self.engine = engine
        self.config = config
        self.clock = clock
        self.stored: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = OrderedDict()

    # -- shared -------------------------------------------------------------------------------------

    def _error(self, exc: Exception) -> Response:
        if isinstance(exc, ValidationError):
            return error_response(schema_error(exc.errors(include_url=False)))
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def _body(self, request: Request, schema: type[_Body]) -> _Body:
        return schema.model_validate(await read_json(request))

    def _ids(self, text: str, *, special: bool = True) -> list[int]:
        return self.served.encode(text, special=special)

    def _text(self, ids: list[int]) -> str:
        return self.served.decode(ids)

    def _prompts(self, value: Any) -> list[list[int]]:
        if isinstance(value, str):
            prompts = [self._ids(value)]
        elif value and all(isinstance(t, int) for t in value):
            prompts = [list(value)]
        else:
            prompts = [self._ids(v) if isinstance(v, str) else list(v) for v in value]
        if not prompts or any(not p for p in prompts):
            raise ApiError("You must pass at least one prompt")
        for p in prompts:
            if len(p) > self.config.max_model_len:
                raise ApiError(f"This model's maximum context length is {self.config.max_model_len} tokens. "
                               f"However, your request has {len(p)} input tokens. Please reduce the length of "
                               "the input messages.", param="input")
            if min(p) < 0 or max(p) >= self.served.vocab_size:
                raise ApiError(f"Token id {max(p)} is out of vocabulary", param="input")
        return prompts

    async def _step(self, request: Request, prompt_ids: list[int]) -> None:
        """One engine step for ``prompt_ids`` (a pooling pass): raises what the engine raises."""
        await self._generate(request, prompt_ids, 1)

    def _vector(self, ids: list[int]) -> list[float]:
        """A unit vector, float32 as vLLM computes it, a function of the token ids alone."""
        seed = hashlib.sha256(b"sim-embed:" + struct.pack(f"<{len(ids)}q", *ids)).digest()
        rng = np.random.default_rng(int.from_bytes(seed[:8], "little"))
        v = rng.standard_normal(_DIMENSIONS).astype(np.float32)
        v /= np.float32(np.linalg.norm(v))
        return [float(x) for x in v]

    @staticmethod
    def _usage(prompt: int) -> dict[str, Any]:
        return {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0,
                "prompt_tokens_details": None, "completion_tokens_details": None}

    def _json(self, body: dict[str, Any], status: int = 200) -> Response:
        return json_response(body, status)

    def _cut(self, exc: RequestCut) -> Response:
        return Cut(exc, lambda: None)

    def guarded(self, handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """``handler`` with what it raises answered as vLLM answers it: a cut connection, or the error body."""
        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestCut as exc:
                return self._cut(exc)
            except (ValidationError, WorkerError) as exc:
                return self._error(exc)

        return route

    # -- the API server's own -----------------------------------------------------------------------

    async def version(self, request: Request) -> Response:
        return self._json({"version": self.config.engine_version})

    async def tokenize(self, request: Request) -> Response:
        raw = await read_json(request)
        chat = isinstance(raw, dict) and "messages" in raw
        body = (_TokenizeChat if chat else _TokenizeText).model_validate(raw)
        self.served.check(body.model)
        if isinstance(body, _TokenizeChat):
            ids = self._ids(render_chat(body.messages, add_generation_prompt=body.add_generation_prompt),
                            special=body.add_special_tokens)
        else:
            assert isinstance(body, _TokenizeText)
            ids = self._ids(body.prompt, special=body.add_special_tokens)
        strs = [self._text([t]) for t in ids] if body.return_token_strs else None
        return self._json({"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids,
                           "token_strs": strs})

    async def detokenize(self, request: Request) -> Response:
        body = await self._body(request, _Detokenize)
        self.served.check(body.model)
        if body.tokens and (min(body.tokens) < 0 or max(body.tokens) >= self.served.vocab_size):
            raise ApiError(f"Token id {max(body.tokens)} is out of vocabulary", param="tokens")
        return self._json({"prompt": self._text(body.tokens)})

    # -- pooling ------------------------------------------------------------------------------------

    async def _pooled(self, request: Request, prompts: list[list[int]]) -> list[list[float]]:
        for p in prompts:
            await self._step(request, p)
        return [self._vector(p) for p in prompts]

    async def embeddings(self, request: Request) -> Response:
        body = await self._body(request, _Embed)
        self.served.check(body.model)
        if body.dimensions is not None:
            raise ApiError("Model does not support matryoshka representation, changing output "
                           "dimensions will lead to poor results.", param="dimensions")
        prompts = self._prompts(body.input)
        vectors = await self._pooled(request, prompts)
        items = []
        for i, v in enumerate(vectors):
            value = (enc(base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode())
                     if body.encoding_format == "base64" else _float32_json(v))
            items.append(f'{{"index":{i},"object":"embedding","embedding":{value}}}')
        text = enc({"id": f"embd-{secrets.token_hex(8)}", "object": "list", "created": int(self.clock.wall()),
                    "model": self.served.name, "data": _PLACEHOLDER, "usage": self._usage(sum(map(len, prompts)))})
        return Response(text.replace(enc(_PLACEHOLDER), "[" + ",".join(items) + "]", 1).encode(),
                        media_type="application/json")

    async def pooling(self, request: Request) -> Response:
        body = await self._body(request, _Embed)
        self.served.check(body.model)
        prompts = self._prompts(body.input)
        vectors = await self._pooled(request, prompts)
        data = [{"index": i, "object": "pooling", "data": v} for i, v in enumerate(vectors)]
        return self._json({"id": f"pooling-{secrets.token_hex(8)}", "object": "list",
                           "created": int(self.clock.wall()), "model": self.served.name, "data": data,
                           "usage": self._usage(sum(map(len, prompts)))})

    async def _scores(self, request: Request, query: list[str], docs: list[str]) -> tuple[list[float], int]:
        if not query or not docs:
            raise ApiError("You must pass at least one prompt")
        if len(query) not in (1, len(docs)):
            raise ApiError("text_1 must be one text or as many as text_2", param="text_1")
        texts = list(dict.fromkeys([*query, *docs]))
        prompts = self._prompts(texts)
        vectors = dict(zip(texts, await self._pooled(request, prompts), strict=True))
        pairs = zip(query * len(docs) if len(query) == 1 else query, docs, strict=True)
        return [float(np.dot(vectors[a], vectors[b])) for a, b in pairs], sum(map(len, prompts))

    async def score(self, request: Request) -> Response:
        body = await self._body(request, _Score)
        self.served.check(body.model)
        one = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        two = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        scores, used = await self._scores(request, one, two)
        return self._json({"id": f"score-{secrets.token_hex(8)}", "object": "list",
                           "created": int(self.clock.wall()), "model": self.served.name,
                           "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                           "usage": self._usage(used)})

    async def rerank(self, request: Request) -> Response:
        body = await self._body(request, _Rerank)
        self.served.check(body.model)
        scores, used = await self._scores(request, [body.query], body.documents)
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
        if body.top_n > 0:
            ranked = ranked[:body.top_n]
        results = [{"index": i, "document": {"text": body.documents[i], "multi_modal": None},
                    "relevance_score": scores[i]} for i in ranked]
        return self._json({"id": f"score-{secrets.token_hex(8)}", "model": self.served.name,
                           "usage": {"prompt_tokens": used, "total_tokens": used}, "results": results})

    # -- audio --------------------------------------------------------------------------------------

    async def transcriptions(self, request: Request) -> Response:
        try:
            form = await request.form()
        except Exception as exc:
            raise ApiError(f"the body is not a multipart form: {exc}") from None
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise schema_error([field_error("missing", ("file",), "Field required", None)])
        model = form.get("model")
        self.served.check(model if isinstance(model, str) and model else None)
        if str(form.get("stream", "false")).lower() == "true":
            raise ApiError("the simulated worker does not stream transcriptions", param="stream")
        audio = await upload.read()
        digest = hashlib.sha256(audio).hexdigest()[:16]
        req = await self._generate(request, self._ids(f"transcribe {digest}:"), 16)
        return self._json({"text": req.output_text, "usage": {"type": "duration",
                                                              "seconds": max(1, math.ceil(len(audio) / 32000))}})

    async def _generate(self, request: Request, prompt_ids: list[int], max_tokens: int) -> SimRequest:
        """``max_tokens`` tokens generated for ``prompt_ids`` on the engine, as any request (:meth:`_finish`)."""
        req = self._submit(prompt_ids, SamplingSpec(max_tokens=max_tokens, ignore_eos=True),
                           f"gen-{secrets.token_hex(8)}")
        return await self._finish(request, req)

    def _submit(self, prompt_ids: list[int], spec: SamplingSpec, rid: str) -> SimRequest:
        """A request of the engine, or the EngineCore error it draws (``error_rate``) as a 500."""
        if self.engine.draw_error():
            raise engine_dead()
        return self.engine.submit(prompt_ids, spec, rid)

    async def _finish(self, request: Request, req: SimRequest) -> SimRequest:
        """``req`` run to its end and released; its faults raise (the EngineCore error as a 500, a cut as
        :class:`RequestCut`)."""
        try:
            outcome = await await_or_abort(request, self.engine, req)
        finally:
            self.engine.release(req)
        if isinstance(outcome, RequestCut):
            raise outcome
        if outcome is not None or req.finish_reason == "abort":
            raise engine_dead()
        return req

    # -- the Responses API --------------------------------------------------------------------------

    def _messages(self, body: _Respond, before: list[dict[str, Any]]) -> list[dict[str, Any]]:
        messages = list(before)
        if body.instructions and not before:
            messages.append({"role": "system", "content": body.instructions})
        if isinstance(body.input, str):
            messages.append({"role": "user", "content": body.input})
        else:
            for item in body.input:
                content: Any = item.get("content")
                if isinstance(content, list):
                    content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
                messages.append({"role": str(item.get("role", "user")), "content": content or ""})
        return messages

    def _response(self, body: _Respond, rid: str, created: int, max_tokens: int, *, status: str,
                  output: list[dict[str, Any]], usage: dict[str, Any] | None, incomplete: bool) -> dict[str, Any]:
        return {"id": rid, "created_at": created,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": body.instructions, "metadata": None, "model": self.served.name,
                "object": "response", "output": output, "parallel_tool_calls": True,
                "temperature": 1.0 if body.temperature is None else float(body.temperature),
                "tool_choice": body.tool_choice if body.tools else "none", "tools": body.tools,
                "top_p": 1.0 if body.top_p is None else float(body.top_p), "background": False,
                "max_output_tokens": max_tokens, "max_tool_calls": None,
                "previous_response_id": body.previous_response_id, "prompt": None, "reasoning": None,
                "service_tier": "auto", "status": status, "text": None, "top_logprobs": None,
                "truncation": "disabled", "usage": usage, "user": None, "presence_penalty": 0.0,
                "frequency_penalty": 0.0, "kv_transfer_params": None, "ec_transfer_params": None,
                "input_messages": None, "output_messages": None}

    @staticmethod
    def _message(mid: str, text: str | None, status: str) -> dict[str, Any]:
        content: list[dict[str, Any]] = [] if text is None else [
            {"annotations": [], "text": text, "type": "output_text", "logprobs": None}]
        return {"id": mid, "content": content, "role": "assistant", "status": status, "type": "message",
                "phase": None}

    @staticmethod
    def _response_usage(prompt: int, output: int) -> dict[str, Any]:
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0,
                                                                 "input_tokens_per_turn": [],
                                                                 "cached_tokens_per_turn": []},
                "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                                                   "output_tokens_per_turn": [],
                                                                   "tool_output_tokens_per_turn": []},
                "total_tokens": prompt + output}

    async def responses(self, request: Request) -> Response:
        body = await self._body(request, _Respond)
        self.served.check(body.model)
        before: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            stored = self.stored.get(body.previous_response_id)
            if stored is None:
                raise self._not_found(body.previous_response_id)
            before = stored[0]
        messages = self._messages(body, before)
        prompt_ids = self._ids(render_chat(messages, add_generation_prompt=True), special=False)
        max_len = self.config.max_model_len
        budget = max_len - len(prompt_ids)
        if budget < 1:
            raise ApiError(f"This model's maximum context length is {max_len} tokens. However, your "
                           f"request has {len(prompt_ids)} input tokens.", param="input")
        max_tokens = budget if body.max_output_tokens is None else body.max_output_tokens
        if max_tokens < 1:
            raise refused(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens",
                          value=max_tokens)
        max_tokens = min(max_tokens, budget)
        rid, mid = f"resp_{secrets.token_hex(8)}", f"msg_{secrets.token_hex(8)}"
        created = int(self.clock.wall())
        req = self._submit(prompt_ids, SamplingSpec(max_tokens=max_tokens, ignore_eos=body.ignore_eos), rid)
        make = functools.partial(self._response, body, rid, created, max_tokens)
        if body.stream:
            return EventStream(self._response_events(req, make, mid, len(prompt_ids)),
                               functools.partial(self.engine.release, req))
        answer = self._finished(await self._finish(request, req), make, mid, len(prompt_ids))
        self._store(body, rid, messages, answer)
        return self._json(answer)

    def _finished(self, req: SimRequest, make: Callable[..., dict[str, Any]], mid: str, prompt: int) -> dict[str, Any]:
        incomplete = req.finish_reason == "length"
        return make(status="incomplete" if incomplete else "completed",
                    output=[self._message(mid, req.output_text, "completed")],
                    usage=self._response_usage(prompt, len(req.output_ids)), incomplete=incomplete)

    def _store(self, body: _Respond, rid: str, messages: list[dict[str, Any]], answer: dict[str, Any]) -> None:
        if not (self.config.responses_store and body.store):
            return
        text = answer["output"][0]["content"][0]["text"]
        self.stored[rid] = ([*messages, {"role": "assistant", "content": text}], answer)
        while len(self.stored) > _STORED_RESPONSES:
            self.stored.popitem(last=False)

    def _not_found(self, rid: str) -> ApiError:
        return ApiError(f"Response with id '{rid}' not found.", status=404,
                        err_type="invalid_request_error", param="response_id")

    async def stored_response(self, request: Request) -> Response:
        rid = request.path_params["response_id"]
        stored = self.stored.get(rid)
        if stored is None:
            raise self._not_found(rid)
        return self._json(stored[1])

    async def _response_events(self, req: SimRequest, make: Callable[..., dict[str, Any]], mid: str,
                               prompt: int) -> AsyncGenerator[bytes, None]:
        seq = 0

        def event(kind: str, fields: dict[str, Any], tail: dict[str, Any] | None = None) -> bytes:
            nonlocal seq
            data = {**fields, "sequence_number": seq, **(tail or {}), "type": kind}  # vLLM's key order
            seq += 1
            return f"event: {kind}\ndata: {enc(data)}\n\n".encode()

        opening = make(status="in_progress", output=[], usage=None, incomplete=False)
        yield event("response.created", {"response": opening})
        yield event("response.in_progress", {"response": opening})
        text = ""
        try:
            opened = False
            while True:
                d = await req.next_output()
                if d.text:
                    if not opened:
                        opened = True
                        yield event("response.output_item.added",
                                    {"item": self._message(mid, None, "in_progress"), "output_index": 0})
                        yield event("response.content_part.added",
                                    {"content_index": 0, "item_id": mid, "output_index": 0,
                                     "part": {"annotations": [], "text": "", "type": "output_text", "logprobs": []}})
                    text += d.text
                    yield event("response.output_text.delta", {"content_index": 0, "delta": d.text, "item_id": mid,
                                                               "logprobs": [], "output_index": 0})
                if d.finish_reason is not None:
                    break
        except WorkerError as exc:
            yield event("error", {"code": "engine_error", "message": exc.message, "param": None})
            return
        if opened:
            yield event("response.output_text.done", {"content_index": 0, "item_id": mid, "logprobs": [],
                                                      "output_index": 0}, {"text": text})
            yield event("response.content_part.done",
                        {"content_index": 0, "item_id": mid, "output_index": 0,
                         "part": {"annotations": [], "text": text, "type": "output_text", "logprobs": None}})
            yield event("response.output_item.done", {"item": self._message(mid, text, "completed"),
                                                      "output_index": 0})
        yield event("response.completed", {"response": self._finished(req, make, mid, prompt)})


_PLACEHOLDER = "\x00embeddings\x00"


def _float32_json(values: list[float]) -> str:
    """Values as float32 digits (the shortest that read back as the same float32), as vLLM's embeddings
    endpoint writes them; exponents as JSON writers in Rust and C write them (``1e-5``, not ``1e-05``)."""
    return "[" + ",".join(str(np.float32(x)).replace("e-0", "e-").replace("e+0", "e+").replace("e+", "e")
                          for x in values) + "]"


def mount(router: APIRouter, served: ServedModel, engine: SimEngine, config: SimConfig, clock: Clock) -> None:
    """Add the routes (module docstring) to ``router``."""
    e = _Endpoints(served, engine, config, clock)
    r = router
    for path, handler, method in (
            ("/version", e.version, "GET"), ("/tokenize", e.tokenize, "POST"), ("/detokenize", e.detokenize, "POST"),
            ("/v1/embeddings", e.embeddings, "POST"), ("/pooling", e.pooling, "POST"), ("/score", e.score, "POST"),
            ("/v1/score", e.score, "POST"), ("/rerank", e.rerank, "POST"), ("/v1/rerank", e.rerank, "POST"),
            ("/v2/rerank", e.rerank, "POST"), ("/v1/audio/transcriptions", e.transcriptions, "POST"),
            ("/v1/responses", e.responses, "POST"), ("/v1/responses/{response_id}", e.stored_response, "GET")):
        r.add_route(path, e.guarded(handler), methods=[method])
