"""What the client sees: OpenAI/vLLM-shaped chunks and responses, SSE framing with resumable ids.

Each SSE event carries ``id: <request id>:<n>`` where ``n`` is the number of completion tokens the
client has after that event; a client that reconnects with ``Last-Event-ID: <request id>:<n>`` gets
everything after token ``n``.
"""

from __future__ import annotations

from typing import Any

import orjson

from fleetward.migration.journal import Journal, Kind

__all__ = ["DONE", "StreamEncoder", "error_body", "event", "final_response", "stream_chunk", "usage_chunk"]

DONE = b"data: [DONE]\n\n"

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 408: "RequestTimeout", 409: "ConflictError", 410: "GoneError",
                429: "RateLimitError", 500: "InternalServerError", 502: "BadGatewayError",
                503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}


def error_body(status: int, message: str, *, param: str | None = None,
               etype: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": etype or _ERROR_TYPES.get(status, "Error"), "param": param,
                      "code": status}}


def event(data: dict[str, Any] | bytes, event_id: str | None = None) -> bytes:
    payload = data if isinstance(data, bytes) else orjson.dumps(data)
    head = b"id: " + event_id.encode() + b"\n" if event_id else b""
    return head + b"data: " + payload + b"\n\n"


def _choice(j: Journal, tokens: list[int], text: str, finish_reason: str | None, stop_reason: str | int | None,
            logprobs: Any, first: bool, wants_token_ids: bool) -> dict[str, Any]:
    if j.kind is Kind.COMPLETION:
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                                  "stop_reason": stop_reason}
        if wants_token_ids:
            choice["prompt_token_ids"] = j.prompt_ids if first else None
            choice["token_ids"] = tokens
        return choice
    delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    if wants_token_ids:
        choice["token_ids"] = tokens
    return choice


def _object(j: Journal) -> str:
    return "text_completion" if j.kind is Kind.COMPLETION else "chat.completion.chunk"


def stream_chunk(j: Journal, *, tokens: list[int], text: str, finish_reason: str | None,
                 stop_reason: str | int | None, logprobs: Any = None, first: bool = False) -> dict[str, Any]:
    wants = j.wants_token_ids
    chunk = {"id": j.id, "object": _object(j), "created": int(j.created), "model": j.model,
             "choices": [_choice(j, tokens, text, finish_reason, stop_reason, logprobs, first, wants)]}
    if j.kind is Kind.CHAT and first and wants:
        chunk["prompt_token_ids"] = j.prompt_ids
    return chunk


class StreamEncoder:
    """The SSE events of one streamed response, byte for byte ``event(stream_chunk(...), id)``.

    What never changes within a response (id, object, created, model) is encoded once, not per token.
    ``extra`` keys are appended to the chunk after the standard ones (e.g. the router's trace).
    """

    def __init__(self, j: Journal) -> None:
        self.j = j
        self._wants = j.wants_token_ids
        self._chat = j.kind is Kind.CHAT
        head = orjson.dumps({"id": j.id, "object": _object(j), "created": int(j.created), "model": j.model})
        self._head = head[:-1] + b',"choices":['
        self._id = b"id: " + j.id.encode() + b":"

    def event(self, n: int, *, tokens: list[int], text: str, finish_reason: str | None,
              stop_reason: str | int | None, logprobs: Any = None, first: bool = False,
              extra: dict[str, Any] | None = None) -> bytes:
        """The event for a chunk after which the client holds ``n`` tokens."""
        j = self.j
        parts = [self._id, str(n).encode(), b"\ndata: ", self._head,
                 orjson.dumps(_choice(j, tokens, text, finish_reason, stop_reason, logprobs, first, self._wants)),
                 b"]"]
        if self._chat and first and self._wants:
            parts += (b',"prompt_token_ids":', orjson.dumps(j.prompt_ids))
        for key, value in (extra or {}).items():
            parts += (b"," + orjson.dumps(key) + b":", orjson.dumps(value))
        parts.append(b"}\n\n")
        return b"".join(parts)


def _usage(j: Journal) -> dict[str, int]:
    prompt = len(j.prompt_ids) if j.prompt_ids is not None else 0
    return {"prompt_tokens": prompt, "total_tokens": prompt + len(j.emitted), "completion_tokens": len(j.emitted)}


def usage_chunk(j: Journal) -> dict[str, Any]:
    obj = "text_completion" if j.kind is Kind.COMPLETION else "chat.completion.chunk"
    return {"id": j.id, "object": obj, "created": int(j.created), "model": j.model, "choices": [],
            "usage": _usage(j)}


def final_response(j: Journal) -> dict[str, Any]:
    """The non-streamed response, assembled from the journal."""
    if j.kind is Kind.COMPLETION:
        choice: dict[str, Any] = {"index": 0, "text": j.text, "logprobs": None, "finish_reason": j.finish_reason,
                                  "stop_reason": j.stop_reason}
        if j.wants_token_ids:
            choice["token_ids"] = j.emitted
            choice["prompt_token_ids"] = j.prompt_ids
        return {"id": j.id, "object": "text_completion", "created": int(j.created), "model": j.model,
                "choices": [choice], "usage": _usage(j)}
    message = {"role": "assistant", "content": j.text}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": j.finish_reason,
              "stop_reason": j.stop_reason}
    if j.wants_token_ids:
        choice["token_ids"] = j.emitted
    body: dict[str, Any] = {"id": j.id, "object": "chat.completion", "created": int(j.created), "model": j.model,
                            "choices": [choice], "usage": _usage(j)}
    if j.wants_token_ids:
        body["prompt_token_ids"] = j.prompt_ids
    return body
