"""What the client sees: vLLM's chunks and responses, byte for byte, and the SSE framing around them.

The router is a drop-in front door for vLLM, so what a client reads from it equals what it would read from
a vLLM 0.32 server for the same request (``tests/data/vllm-0.32``, ``tests/migration/test_wire.py``,
``tests/migration/test_router_dropin.py``): the same keys in the same order, ``null`` where vLLM writes ``null``
(``token_ids`` without ``return_token_ids``), the opening chat chunk with the assistant's role, usage in every
chunk with ``stream_options.continuous_usage_stats``, the worker's ``system_fingerprint`` on the last chunk,
vLLM's in-band error, ``data: [DONE]``. Only the response's ``id`` and ``created`` are the router's own.

SSE event ids are opt-in (a request header ``X-Fleetward-Event-Ids: 1``, or ``routing.event_ids``): then
each event also carries ``id: <request id>:<n>``, where ``n`` is the number of completion tokens the client
has after that event; a client that reconnects with ``Last-Event-ID: <request id>:<n>`` gets everything
after token ``n``. vLLM sends no ``id:`` lines, and clients that strip ``data: `` from every line (vLLM's
benchmark) break on them, so they are off by default. Without them a client resumes from the request's id
(each chunk's ``id``, and the ``X-Request-Id`` header) and the tokens it counted (docs/operations.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import orjson
from fastapi.responses import JSONResponse

from fleetward.migration.journal import Journal, Kind

__all__ = ["DONE", "RouterError", "StreamEncoder", "chat_role", "chunk_usage", "error_body", "error_event", "event",
           "final_response", "role_chunk", "stream_chunk", "usage", "usage_chunk"]

DONE = b"data: [DONE]\n\n"

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 408: "RequestTimeout", 409: "ConflictError", 410: "GoneError",
                429: "RateLimitError", 500: "InternalServerError", 502: "BadGatewayError",
                503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}


def error_body(status: int, message: str, *, param: str | None = None,
               etype: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": etype or _ERROR_TYPES.get(status, "Error"), "param": param,
                      "code": status}}


class RouterError(Exception):
    """A request ends with this status and message (before streaming: an HTTP error, :meth:`response`; after:
    an in-band one), whether the router or the relay of a passed-through request refuses it."""

    def __init__(self, status: int, message: str, *, param: str | None = None, body: dict[str, Any] | None = None,
                 retry_after: int | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.body = body
        self.retry_after = retry_after
        self.headers = headers

    def response(self) -> JSONResponse:
        headers = dict(self.headers or {})
        if self.retry_after:
            headers["Retry-After"] = str(self.retry_after)
        body = self.body or error_body(self.status, self.message, param=self.param)
        return JSONResponse(body, status_code=self.status, headers=headers or None)


def event(data: dict[str, Any] | bytes, event_id: str | None = None) -> bytes:
    payload = data if isinstance(data, bytes) else orjson.dumps(data)
    head = b"id: " + event_id.encode() + b"\n" if event_id else b""
    return head + b"data: " + payload + b"\n\n"


def error_event(status: int, message: str, event_id: str | None = None, *,
                body: dict[str, Any] | None = None) -> bytes:
    """The in-band error of a stream that cannot go on, as vLLM writes its own (``json.dumps``' separators);
    ``body``: a worker's own error, passed on as it wrote it."""
    return event(json.dumps(body or error_body(status, message), ensure_ascii=False).encode(), event_id)


def _object(j: Journal) -> str:
    return "text_completion" if j.kind is Kind.COMPLETION else "chat.completion.chunk"


def usage(j: Journal, completion: int) -> dict[str, int]:
    """A stream's usage after ``completion`` generated tokens, as vLLM writes it in its closing usage chunk."""
    prompt = len(j.prompt_ids) if j.prompt_ids is not None else 0
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}


def chunk_usage(j: Journal, completion: int) -> dict[str, Any]:
    """The usage every chunk carries with ``continuous_usage_stats``: a chat chunk's also says
    ``"completion_tokens_details": null`` (vLLM sets it there and nowhere else)."""
    used: dict[str, Any] = dict(usage(j, completion))
    if j.kind is Kind.CHAT:
        used["completion_tokens_details"] = None
    return used


def chat_role(j: Journal) -> str:
    """The role of the answer, as vLLM chooses it: the assistant's, or the last message's without a
    generation prompt (the model continues that message)."""
    messages = j.body.get("messages")
    if j.body.get("add_generation_prompt", True) is False and isinstance(messages, list) and messages \
            and isinstance(messages[-1], dict) and isinstance(messages[-1].get("role"), str):
        return str(messages[-1]["role"])
    return "assistant"


def _choice(j: Journal, tokens: list[int], text: str, finish_reason: str | None, stop_reason: str | int | None,
            logprobs: Any, first: bool, wants_token_ids: bool, index: int = 0) -> dict[str, Any]:
    if j.kind is Kind.COMPLETION:  # vLLM sends the prompt's ids first when asked for ids, and with echo
        prompt_ids = j.prompt_ids if first and (wants_token_ids or j.body.get("echo")) else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason, "prompt_token_ids": prompt_ids,
                "token_ids": tokens if wants_token_ids else None}
    choice: dict[str, Any] = {"index": index, "delta": {"content": text}, "logprobs": logprobs,
                              "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    choice["token_ids"] = tokens if wants_token_ids else None
    return choice


def _head(j: Journal, rid: str | None = None) -> dict[str, Any]:
    """A chunk's first keys; ``rid``: the response's id where it is not the journal's (one choice of several)."""
    return {"id": rid or j.id, "object": _object(j), "created": int(j.created), "model": j.model}


def _tail(j: Journal, n: int, finish_reason: str | None) -> dict[str, Any]:
    """What follows a stream chunk's choices, as the request asked: usage after ``n`` tokens with
    ``continuous_usage_stats``; the worker's fingerprint on the last chunk when no usage chunk follows it."""
    tail: dict[str, Any] = {}
    if j.wants_continuous_usage:
        tail["usage"] = chunk_usage(j, n)
    if finish_reason is not None and not j.wants_usage and j.fingerprint is not None:  # a stream: include_usage
        tail["system_fingerprint"] = j.fingerprint
    return tail


def stream_chunk(j: Journal, n: int, *, tokens: list[int], text: str, finish_reason: str | None,
                 stop_reason: str | int | None, logprobs: Any = None, first: bool = False) -> dict[str, Any]:
    """One chunk of tokens, after which the client holds ``n``. ``first``: the first of a completion (it
    carries the prompt's ids)."""
    return {**_head(j), "choices": [_choice(j, tokens, text, finish_reason, stop_reason, logprobs, first,
                                            j.wants_token_ids)], **_tail(j, n, finish_reason)}


def role_chunk(j: Journal, index: int = 0, rid: str | None = None) -> dict[str, Any]:
    """The chunk a chat stream opens with (each choice's, ``index``): the role, no content yet, the prompt's
    ids."""
    return {**_head(j, rid), "choices": [{"index": index, "delta": {"role": chat_role(j), "content": ""},
                                          "logprobs": None, "finish_reason": None}],
            **_tail(j, 0, None), "prompt_token_ids": j.prompt_ids if j.wants_token_ids else None,
            "prompt_text": None}


class StreamEncoder:
    """The SSE events of one streamed response, byte for byte ``event(stream_chunk(j, n, ...), id)``.

    What never changes within a response (id, object, created, model) is encoded once, not per token.
    ``extra`` keys are appended to the chunk after the standard ones (e.g. the router's trace).
    ``ids``: whether events carry ``id:`` lines (opt-in, see the module docstring). One choice of several
    (:mod:`.fanout`) is choice ``index`` of the response ``rid``.
    """

    def __init__(self, j: Journal, *, ids: bool = False, rid: str | None = None, index: int = 0) -> None:
        self.j = j
        self.ids = ids
        self.rid = rid
        self.index = index
        self._wants = j.wants_token_ids
        head = orjson.dumps(_head(j, rid))
        self._head = head[:-1] + b',"choices":['
        self._id = b"id: " + j.id.encode() + b":"

    def event(self, n: int, *, tokens: list[int], text: str, finish_reason: str | None,
              stop_reason: str | int | None, logprobs: Any = None, first: bool = False,
              extra: dict[str, Any] | None = None) -> bytes:
        """The event for a chunk after which the client holds ``n`` tokens."""
        j = self.j
        parts = [self._id, str(n).encode(), b"\n"] if self.ids else []
        parts += [b"data: ", self._head,
                  orjson.dumps(_choice(j, tokens, text, finish_reason, stop_reason, logprobs, first, self._wants,
                                       self.index)),
                  b"]"]
        for key, value in (*_tail(j, n, finish_reason).items(), *(extra or {}).items()):
            parts += (b"," + orjson.dumps(key) + b":", orjson.dumps(value))
        parts.append(b"}\n\n")
        return b"".join(parts)

    def opening(self) -> bytes:
        """What a stream opens with before its first tokens: a chat stream's role chunk (as vLLM's), else
        nothing."""
        return self.wrap(0, role_chunk(self.j, self.index, self.rid)) if self.j.kind is Kind.CHAT else b""

    def wrap(self, n: int, chunk: dict[str, Any]) -> bytes:
        """Any other event of this stream (the role chunk, usage, an error): with its id when ids are on."""
        return event(chunk, f"{self.j.id}:{n}" if self.ids else None)

    def error(self, n: int, status: int, message: str, body: dict[str, Any] | None = None) -> bytes:
        return error_event(status, message, f"{self.j.id}:{n}" if self.ids else None, body=body)


def usage_chunk(j: Journal) -> dict[str, Any]:
    """The chunk a stream closes with under ``include_usage``: the usage, the worker's fingerprint."""
    chunk: dict[str, Any] = {**_head(j), "choices": [], "usage": usage(j, len(j.emitted))}
    if j.fingerprint is not None:
        chunk["system_fingerprint"] = j.fingerprint
    return chunk


def _full_usage(j: Journal) -> dict[str, Any]:
    return {**usage(j, len(j.emitted)), "prompt_tokens_details": None, "completion_tokens_details": None}


def final_response(j: Journal, logprobs: Any = None) -> dict[str, Any]:
    """The non-streamed response, assembled from the journal (and the chunks' ``logprobs``, joined), as vLLM
    0.32 writes it."""
    wants = j.wants_token_ids
    tail = {"service_tier": None, "system_fingerprint": j.fingerprint, "usage": _full_usage(j)}
    if j.kind is Kind.COMPLETION:
        choice: dict[str, Any] = {"index": 0, "text": j.text, "logprobs": logprobs, "finish_reason": j.finish_reason,
                                  "stop_reason": j.stop_reason, "token_ids": j.emitted if wants else None,
                                  "prompt_logprobs": None, "prompt_token_ids": j.prompt_ids if wants else None,
                                  "routed_experts": None}
        return {"id": j.id, "object": "text_completion", "created": int(j.created), "model": j.model,
                "choices": [choice], **tail, "kv_transfer_params": None, "ec_transfer_params": None,
                "metrics": None}
    message = {"role": chat_role(j), "content": j.text, "refusal": None, "annotations": None, "audio": None,
               "function_call": None, "reasoning": None}
    choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": j.finish_reason,
              "stop_reason": j.stop_reason, "token_ids": j.emitted if wants else None, "routed_experts": None}
    return {"id": j.id, "object": "chat.completion", "created": int(j.created), "model": j.model,
            "choices": [choice], **tail, "prompt_logprobs": None, "prompt_token_ids": j.prompt_ids if wants else None,
            "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
