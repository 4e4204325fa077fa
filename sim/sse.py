"""Server-sent events as the simulated worker writes them: one writer for completion and chat streams.

:func:`events` is the stream of one request: a chunk per engine step (the chat stream opens with the role
chunk when the first output arrives, as vLLM's does), the usage chunk when ``stream_options.include_usage``
asks, vLLM's in-band error event if the engine fails, then ``data: [DONE]``. The chunks are byte for byte
vLLM 0.32's (key order and separators included; see ``tests/data/vllm-0.32``), written by hand because
vLLM writes ``null`` for some absent fields and leaves others out. :class:`CompletionChunks` and
:class:`ChatChunks` are the two endpoints' shapes; how clients read the events is ``fleet/sse.py``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Iterable
from typing import ClassVar

from fleetward.fleet.errors import WorkerError
from fleetward.sim.engine import OutputDelta, SimRequest
from fleetward.sim.responses import enc
from fleetward.sim.sampling import ParsedRequest

__all__ = ["DONE", "ChatChunks", "Chunks", "CompletionChunks", "events"]

DONE = b"data: [DONE]\n\n"


async def events(req: SimRequest, chunks: Chunks) -> AsyncGenerator[bytes, None]:
    """``req``'s stream, in ``chunks``' shape, until its finish (or the engine's error) and ``[DONE]``.

    Each chunk is yielded as soon as it is written, and the next step is awaited only once the server has
    sent it: a stream parked on the engine is how the engine knows its tokens were handed over
    (``crash_after_tokens``).
    """
    try:
        while True:
            d = await req.next_output()
            for chunk in chunks.step(d):
                yield chunk
            if d.finish_reason is not None:
                break
        if chunks.parsed.include_usage:
            yield chunks.usage(len(req.output_ids))
    except WorkerError as exc:
        yield _error_event(exc)
    yield DONE


class Chunks:
    """One stream's chunks in one endpoint's shape: :meth:`step` writes an engine step's."""

    object: ClassVar[str]
    _chat_usage: ClassVar[bool] = False  # continuous usage also says "completion_tokens_details":null

    def __init__(self, parsed: ParsedRequest, rid: str, created: int, model: str, fingerprint: str) -> None:
        self.parsed = parsed
        self._prefix = f'data: {{"id":{enc(rid)},"object":"{self.object}","created":{created},"model":{enc(model)},'
        self._head = self._prefix + '"choices":[{"index":0,'
        fingerprint_json = enc(fingerprint)
        # The last chunk names the fingerprint, unless a usage chunk follows it (then that one does).
        self._last = f',"system_fingerprint":{fingerprint_json}' if not parsed.include_usage else ""
        self._usage_end = f',"system_fingerprint":{fingerprint_json}}}\n\n'

    def step(self, d: OutputDelta) -> list[bytes]:
        raise NotImplementedError

    def usage(self, completion: int) -> bytes:
        """The closing usage chunk (no choices)."""
        usage = _usage_json(len(self.parsed.prompt_ids), completion)
        return f'{self._prefix}"choices":[],{usage}{self._usage_end}'.encode()

    def _ended(self, parts: list[str], d: OutputDelta) -> bytes:
        """A step's chunk: ``parts`` (up to its choices), then the running usage, the fingerprint on the last."""
        if self.parsed.continuous_usage:
            usage = _usage_json(len(self.parsed.prompt_ids), d.num_output_tokens, chat_chunk=self._chat_usage)
            parts += [",", usage]
        if d.finish_reason is not None:
            parts.append(self._last)
        parts.append("}\n\n")
        return "".join(parts).encode()

    def _token_ids(self, d: OutputDelta) -> str:
        return _ids_json(d.token_ids) if self.parsed.return_token_ids else "null"


class CompletionChunks(Chunks):
    """``text_completion`` chunks: the first also carries the prompt's ids (``return_token_ids``)."""

    object = "text_completion"

    def __init__(self, parsed: ParsedRequest, rid: str, created: int, model: str, fingerprint: str) -> None:
        super().__init__(parsed, rid, created, model, fingerprint)
        self._prompt_json = _ids_json(parsed.prompt_ids) if parsed.return_token_ids else "null"

    def step(self, d: OutputDelta) -> list[bytes]:
        fin = d.finish_reason
        parts = [self._head, '"text":', enc(d.text), ',"logprobs":null,"finish_reason":',
                 "null" if fin is None else f'"{fin}"', ',"stop_reason":',
                 "null" if d.stop_reason is None else enc(d.stop_reason), ',"prompt_token_ids":',
                 self._prompt_json, ',"token_ids":', self._token_ids(d), "}]"]
        self._prompt_json = "null"
        return [self._ended(parts, d)]


class ChatChunks(Chunks):
    """``chat.completion.chunk`` chunks: the role chunk first (with the prompt's ids), then the content's."""

    object = "chat.completion.chunk"
    _chat_usage = True

    def __init__(self, parsed: ParsedRequest, rid: str, created: int, model: str, fingerprint: str) -> None:
        super().__init__(parsed, rid, created, model, fingerprint)
        self._opened = False

    def step(self, d: OutputDelta) -> list[bytes]:
        p = self.parsed
        out = []
        if not self._opened:  # vLLM sends the role chunk when the first output arrives
            self._opened = True
            usage = "," + _usage_json(len(p.prompt_ids), 0, chat_chunk=True) if p.continuous_usage else ""
            out.append((f'{self._head}"delta":{{"role":{enc(p.role)},"content":""}},"logprobs":null,'
                        f'"finish_reason":null}}]{usage},'
                        f'"prompt_token_ids":{_ids_json(p.prompt_ids) if p.return_token_ids else "null"},'
                        f'"prompt_text":null}}\n\n').encode())
        fin = d.finish_reason
        parts = [self._head, '"delta":{"content":', enc(d.text), '},"logprobs":null,"finish_reason":']
        if fin is None:
            parts.append("null")
        else:
            parts += [f'"{fin}","stop_reason":', "null" if d.stop_reason is None else enc(d.stop_reason)]
        parts += [',"token_ids":', self._token_ids(d), "}]"]
        out.append(self._ended(parts, d))
        return out


def _error_event(err: WorkerError) -> bytes:
    # vLLM writes this one with json.dumps' default separators.
    body = {"error": {"message": err.message, "type": "InternalServerError", "param": None, "code": 500}}
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()


def _ids_json(ids: Iterable[int]) -> str:
    return "[" + ",".join(map(str, ids)) + "]"


def _usage_json(prompt: int, completion: int, *, chat_chunk: bool = False) -> str:
    """Usage as vLLM writes it in a stream: a chat chunk's (continuous_usage_stats) also says
    ``"completion_tokens_details":null``; a completion chunk's and the closing usage chunk's do not."""
    details = ',"completion_tokens_details":null' if chat_chunk else ""
    return (f'"usage":{{"prompt_tokens":{prompt},"total_tokens":{prompt + completion},'
            f'"completion_tokens":{completion}{details}}}')
