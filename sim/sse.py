"""Server-sent events as the simulated worker writes them: one writer for completion and chat streams.

:func:`events` is the stream of one request: a chunk per engine step (the chat stream opens with the role
chunk when the first output arrives, as vLLM's does), the usage chunk when ``stream_options.include_usage``
asks, vLLM's in-band error event if the engine fails, then ``data: [DONE]``. The chunks are byte for byte
vLLM 0.32's (key order and separators included; see ``tests/data/vllm-0.32``), written by hand because
vLLM writes ``null`` for some absent fields and leaves others out. :class:`CompletionChunks` and
:class:`ChatChunks` are the two endpoints' shapes; how clients read the events is ``fleet/sse.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from fleetward.fleet.errors import WorkerError
from fleetward.sim.engine import OutputDelta, SimRequest
from fleetward.sim.logprobs import Scorer, Shown, chat_logprobs, completion_logprobs, next_offset
from fleetward.sim.responses import enc
from fleetward.sim.sampling import ParsedRequest

__all__ = ["DONE", "ChatChunks", "Chunks", "CompletionChunks", "Echo", "events", "fanned_events"]

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


async def fanned_events(streams: Sequence[tuple[SimRequest, Chunks]], prompt_tokens: int
                        ) -> AsyncGenerator[bytes, None]:
    """A stream of several choices (``n``, a list of prompts): each choice's chunks as the engine gives its
    steps, interleaved, each chunk naming its choice; the usage of them all (``prompt_tokens``: each prompt
    counted once) and ``[DONE]`` once every choice finished. A choice's next step is awaited once its last
    was sent, as in :func:`events`."""
    waiting: dict[asyncio.Future[OutputDelta], int] = {}

    def wait_for(k: int) -> None:
        waiting[asyncio.ensure_future(streams[k][0].next_output())] = k

    try:
        for k in range(len(streams)):
            wait_for(k)
        opened = False
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if not opened:
                opened = True
                for _, chunks in streams:
                    for chunk in chunks.opening():
                        yield chunk
            for step in sorted(done, key=waiting.__getitem__):
                k = waiting.pop(step)
                d = step.result()
                for chunk in streams[k][1].step(d):
                    yield chunk
                if d.finish_reason is None:
                    wait_for(k)
        first = streams[0][1]
        if first.parsed.include_usage:
            yield first.usage(sum(len(req.output_ids) for req, _ in streams), prompt=prompt_tokens)
    except WorkerError as exc:
        yield _error_event(exc)
    finally:
        for step in waiting:
            step.cancel()
    yield DONE


@dataclass(frozen=True, slots=True)
class Echo:
    """What ``echo`` puts before a stream's answer: its text, and the prompt's tokens with their logprobs
    (a completion's, where the request asks for logprobs)."""

    text: str = ""
    prompt: list[Shown] = field(default_factory=list)


class Chunks:
    """One stream's chunks in one endpoint's shape: :meth:`step` writes an engine step's; ``scorer`` gives the
    logprobs of each step's tokens where the request asks for them."""

    object: ClassVar[str]
    _chat_usage: ClassVar[bool] = False  # continuous usage also says "completion_tokens_details":null

    def __init__(self, parsed: ParsedRequest, rid: str, created: int, model: str, fingerprint: str, *,
                 scorer: Scorer | None = None, echo: Echo | None = None, index: int = 0,
                 prompt_ids: list[int] | None = None) -> None:
        self.parsed = parsed
        self._scorer = scorer
        self._echo = echo
        self._prompt_ids = parsed.prompt_ids if prompt_ids is None else prompt_ids  # this choice's prompt
        self._prefix = f'data: {{"id":{enc(rid)},"object":"{self.object}","created":{created},"model":{enc(model)},'
        self._head = self._prefix + f'"choices":[{{"index":{index},'
        fingerprint_json = enc(fingerprint)
        # The last chunk names the fingerprint, unless a usage chunk follows it (then that one does).
        self._last = f',"system_fingerprint":{fingerprint_json}' if not parsed.include_usage else ""
        self._usage_end = f',"system_fingerprint":{fingerprint_json}}}\n\n'

    def opening(self) -> list[bytes]:
        """What a stream of several choices sends for each of them when the first output arrives."""
        return []

    def step(self, d: OutputDelta) -> list[bytes]:
        raise NotImplementedError

    def usage(self, completion: int, *, prompt: int | None = None) -> bytes:
        """The closing usage chunk (no choices); ``prompt``: the prompt tokens, where not this choice's."""
        usage = _usage_json(len(self._prompt_ids) if prompt is None else prompt, completion)
        return f'{self._prefix}"choices":[],{usage}{self._usage_end}'.encode()

    def _ended(self, parts: list[str], d: OutputDelta) -> bytes:
        """A step's chunk: ``parts`` (up to its choices), then the running usage, the fingerprint on the last."""
        if self.parsed.continuous_usage:
            usage = _usage_json(len(self._prompt_ids), d.num_output_tokens, chat_chunk=self._chat_usage)
            parts += [",", usage]
        if d.finish_reason is not None:
            parts.append(self._last)
        parts.append("}\n\n")
        return "".join(parts).encode()

    def _token_ids(self, d: OutputDelta) -> str:
        return _ids_json(d.token_ids) if self.parsed.return_token_ids else "null"


class CompletionChunks(Chunks):
    """``text_completion`` chunks: the first also carries the prompt's ids (``return_token_ids``, or ``echo``,
    whose prompt it puts before the first step's text and logprobs)."""

    object = "text_completion"
    _offset = 0  # the logprobs' text_offset where the next chunk's tokens start
    _prompt_sent = False

    def step(self, d: OutputDelta) -> list[bytes]:
        fin = d.finish_reason
        prompt_json = "null"
        if not self._prompt_sent:
            self._prompt_sent = True
            if self.parsed.return_token_ids or self.parsed.echo:
                prompt_json = _ids_json(self._prompt_ids)
        text, tokens = ("", []) if self.parsed.echo_only else (d.text, list(d.token_ids))
        shown = [] if self._scorer is None else self._scorer.next(tokens)
        if self._echo is not None:  # the first step: the prompt, then what the engine gave
            text, shown = self._echo.text + text, [*self._echo.prompt, *shown]
            self._echo = None
        logprobs = "null"
        if self._scorer is not None:
            body = completion_logprobs(shown, self.parsed.logprobs or 0, offset=self._offset)
            self._offset = next_offset(body, self._offset)
            logprobs = enc(body)
        parts = [self._head, '"text":', enc(text), ',"logprobs":', logprobs, ',"finish_reason":',
                 "null" if fin is None else f'"{fin}"', ',"stop_reason":',
                 "null" if d.stop_reason is None else enc(d.stop_reason), ',"prompt_token_ids":',
                 prompt_json, ',"token_ids":', self._token_ids(d), "}]"]
        return [self._ended(parts, d)]


class ChatChunks(Chunks):
    """``chat.completion.chunk`` chunks: the role chunk first (with the prompt's ids), then the content's."""

    object = "chat.completion.chunk"
    _chat_usage = True
    _opened = False

    def opening(self) -> list[bytes]:
        """The role chunk (vLLM sends it, for every choice, when the first output arrives), then the echoed
        last message's content, a chunk of its own; nothing once sent."""
        if self._opened:
            return []
        self._opened = True
        p = self.parsed
        usage = "," + _usage_json(len(self._prompt_ids), 0, chat_chunk=True) if p.continuous_usage else ""
        out = [(f'{self._head}"delta":{{"role":{enc(p.role)},"content":""}},"logprobs":null,'
                f'"finish_reason":null}}]{usage},'
                f'"prompt_token_ids":{_ids_json(self._prompt_ids) if p.return_token_ids else "null"},'
                f'"prompt_text":null}}\n\n').encode()]
        if p.echo_text:
            out.append((f'{self._head}"delta":{{"content":{enc(p.echo_text)}}},"logprobs":null,'
                        f'"finish_reason":null}}]{usage}}}\n\n').encode())
        return out

    def step(self, d: OutputDelta) -> list[bytes]:
        p = self.parsed
        out = self.opening()
        fin = d.finish_reason
        logprobs = "null" if self._scorer is None else enc(
            chat_logprobs(self._scorer.next(d.token_ids), p.logprobs or 0))
        parts = [self._head, '"delta":{"content":', enc(d.text), '},"logprobs":', logprobs, ',"finish_reason":']
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
