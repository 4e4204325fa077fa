"""The request journal: everything needed to resume a generation elsewhere, and the rules for doing so.

Sans-IO. A :class:`Journal` is one in-flight request: the client's body, the prompt as token ids (known
from the first upstream chunk), every token emitted so far, the worker, attempts, the deadline. From it
:meth:`Journal.upstream_request` builds the next attempt:

- the first attempt goes to the API the client called (``/v1/completions`` or ``/v1/chat/completions``)
  with ``return_token_ids`` on, so the worker reports the prompt ids and every token's id;
- a resumed attempt always goes to ``/v1/completions`` with ``prompt = prompt ids + emitted ids`` and
  the remaining ``max_tokens`` / ``min_tokens``, same sampling parameters. A chat stream is converted
  back to chat chunks by the router, so the client does not see the switch.

Exactness: with greedy decoding (temperature 0) the resumed stream equals the uninterrupted one, token
for token (the worker computes the same next token from the same prefix). With sampling the stream
still has no gap and no duplicate, but the continuation after a migration is a fresh sample. Requests
whose state is not a function of the prefix cannot be resumed exactly and are not migrated after their
first token (see :func:`migration_blocker`): the client gets a clear error event instead.

Text is made by the router (:meth:`Journal.record`): one incremental detokenizer per request, primed
with the prompt's ids and fed every generated id whichever worker produced it, with vLLM's rules
(:class:`fleetward.fleet.vocab.Detokenizer`). So the text a client reads is a function of the token ids
alone; a worker that resumes a generation would detokenize from the resumed prompt instead, and may
render the characters around the boundary differently. Without a vocabulary (none can be loaded for the
model) the workers' text is passed on.

Stop strings are matched by the router (:class:`StopChecker`), not the worker: a stop string may
straddle a migration boundary, and a worker only searches the text it generated itself. As in vLLM, a
stop string is looked for only once more than ``min_tokens`` tokens exist, the token that completes it
is the last one kept, and the text of a token that ended the generation by itself (EOS, a
``stop_token_ids`` id) is not output unless ``include_stop_str_in_output``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from fleetward.fleet.vocab import Detokenizer, Vocabulary

__all__ = [
    "Journal",
    "Kind",
    "RequestRefused",
    "StopChecker",
    "batched",
    "fanout",
    "migration_blocker",
    "new_request_id",
    "request_schema",
    "validate_body",
    "whole_reason",
]


class Kind(StrEnum):
    COMPLETION = "completion"
    CHAT = "chat"

    @property
    def path(self) -> str:
        return "/v1/completions" if self is Kind.COMPLETION else "/v1/chat/completions"

    @property
    def id_prefix(self) -> str:
        return "cmpl-" if self is Kind.COMPLETION else "chatcmpl-"


class RequestRefused(ValueError):
    """The request is malformed or asks for something the router cannot do (a 4xx for the client)."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


def new_request_id(kind: Kind) -> str:
    return f"{kind.id_prefix}fw{uuid.uuid4().hex[:20]}"


# Body keys the router owns: never forwarded as the client sent them.
_ROUTER_KEYS = {"stream", "stream_options", "stop", "include_stop_str_in_output", "return_token_ids",
                "max_tokens", "max_completion_tokens", "min_tokens", "prompt", "messages", "n", "best_of"}
# Sampling keys that mean the same thing on /v1/completions, so a chat request can resume there.
_PORTABLE = {"model", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "logit_bias", "stop_token_ids", "ignore_eos", "skip_special_tokens",
             "spaces_between_special_tokens", "bad_words", "allowed_token_ids", "user", "priority"}


def _int_field(body: dict[str, Any], key: str, *, minimum: int) -> int | None:
    """An integer field as vLLM reads it (pydantic's lax mode: ``3.0`` is 3)."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not -2**63 <= value < 2**63:
        raise RequestRefused(f"{key} must be a 64-bit integer, got {value!r}", param=key)
    if value < minimum:
        raise RequestRefused(f"{key} must be at least {minimum}, got {value}.", param=key)
    return value


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in value)


def batched(prompt: Any) -> bool:
    """A list of prompts, as vLLM takes it: strings, or lists of token ids, not both (one request, one choice
    each)."""
    return isinstance(prompt, list) and len(prompt) > 0 and not _is_ids(prompt) and (
        all(isinstance(p, str) and p for p in prompt) or all(_is_ids(p) for p in prompt))


def validate_body(body: Any, kind: Kind) -> None:
    """Refuse what the journal cannot take: wrong types, a missing prompt. A refused body is not refused to the
    client: it goes to a worker as sent (:mod:`.serving`), which answers it as vLLM does. A body of several
    choices (:func:`fanout`) is taken, to be split into one journal per choice (:mod:`.fanout`)."""
    if not isinstance(body, dict):
        raise RequestRefused("the request body must be a JSON object")
    if not isinstance(body.get("model"), str) or not body.get("model"):
        raise RequestRefused("model is required (a string; see GET /v1/models)", param="model")
    if kind is Kind.COMPLETION:
        prompt = body.get("prompt")
        if not ((isinstance(prompt, str) and prompt) or _is_ids(prompt) or batched(prompt)):
            raise RequestRefused("prompt must be a non-empty string, a non-empty list of token ids, or a list of "
                                 "those", param="prompt")
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestRefused("messages must be a non-empty list of message objects", param="messages")
    for key in ("n", "best_of"):
        _int_field(body, key, minimum=1)
    _int_field(body, "max_tokens", minimum=1)
    _int_field(body, "max_completion_tokens", minimum=1)
    _int_field(body, "min_tokens", minimum=0)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise RequestRefused("stop must be a string or a list of strings", param="stop")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise RequestRefused("stream_options must be an object", param="stream_options")


def fanout(body: dict[str, Any], kind: Kind) -> str | None:
    """The request's several choices (``n`` or ``best_of`` above 1, a list of prompts), or None for one."""
    for key in ("n", "best_of"):
        value = body.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 1:  # 2.0 is 2 to vLLM
            return f"{key}={value}"
    if kind is Kind.COMPLETION and batched(body.get("prompt")):
        return "a list of prompts"
    return None


def whole_reason(body: dict[str, Any], kind: Kind) -> str | None:
    """Why a request answered whole (not streamed) is relayed to one worker as it was sent, and its answer
    passed back as the worker wrote it, instead of being made from the router's journal; None when it is not.

    The journal is one stream of tokens, made from the chunks of a streamed attempt. Some answers hold what
    no such stream carries: several choices (``n``, ``best_of``, a list of prompts; most are split into one
    journaled request per choice instead, :mod:`~fleetward.migration.fanout`), the prompt's logprobs
    (``prompt_logprobs``, and ``echo``, which vLLM answers with them), or a state that is not a function of
    the token prefix (:func:`migration_blocker`: constrained decoding, tools, chat logprobs). The client reads
    nothing of a whole answer until it is complete, so when its worker fails first, the request is sent again
    from its start to another worker (:class:`~fleetward.migration.passthrough.Passthrough`): exact for greedy
    requests, a fresh sample otherwise, and never a partial answer.

    One stream too: a chat stream with ``echo``, whose echoed last message comes in a chunk of its own without
    token ids, which the journal does not write. It is passed through as a stream (failing over before its
    first byte only), as vLLM wrote it.
    """
    if body.get("stream"):
        return "echo (a chat stream's echoed message is a chunk of no tokens)" if (
            kind is Kind.CHAT and body.get("echo")) else None
    several = fanout(body, kind)
    if several is not None:
        return several
    if body.get("prompt_logprobs") is not None:
        return "prompt_logprobs"
    return migration_blocker(body, kind)


def request_schema(kind: Kind) -> dict[str, Any]:
    """The body :func:`validate_body` accepts, as a JSON Schema (the router's OpenAPI spec serves it).

    Only the keys the router itself reads are described; any other key is passed on to the worker, which
    answers for it (``additionalProperties``).
    """
    token_ids = {"type": "array", "items": {"type": "integer"}, "minItems": 1}
    props: dict[str, Any] = {
        "model": {"type": "string", "minLength": 1, "description": "a model the fleet serves (GET /v1/models)"},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"},
                                                             "continuous_usage_stats": {"type": "boolean"}}},
        "max_tokens": {"type": "integer", "minimum": 1},
        "min_tokens": {"type": "integer", "minimum": 0},
        "n": {"type": "integer", "minimum": 1, "description": "more than 1: not streamed (stream: false) only"},
        "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "include_stop_str_in_output": {"type": "boolean"},
        "return_token_ids": {"type": "boolean"},
        "temperature": {"type": "number", "minimum": 0},
        "seed": {"type": "integer"},
    }
    if kind is Kind.COMPLETION:
        props["prompt"] = {"oneOf": [
            {"type": "string", "minLength": 1}, token_ids,
            {"type": "array", "minItems": 1, "description": "a list of prompts: not streamed (stream: false) only",
             "items": {"oneOf": [{"type": "string", "minLength": 1}, token_ids]}}]}
        props["best_of"] = {"type": "integer", "minimum": 1,
                            "description": "more than 1: not streamed (stream: false) only"}
        required = ["model", "prompt"]
    else:
        message = {"type": "object", "required": ["role", "content"],
                   "properties": {"role": {"type": "string"}, "content": {"type": "string"}}}
        props["messages"] = {"type": "array", "items": message, "minItems": 1}
        props["max_completion_tokens"] = {"type": "integer", "minimum": 1}
        required = ["model", "messages"]
    return {"type": "object", "required": required, "properties": props, "additionalProperties": True}


def migration_blocker(body: dict[str, Any], kind: Kind) -> str | None:
    """Why this request cannot be resumed exactly after its first token, or None when it can."""
    if body.get("echo"):
        return "echo"
    for key in ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                "structured_outputs", "tools", "tool_choice"):
        value = body.get(key)
        if value not in (None, {}, [], "none", {"type": "text"}):
            return f"{key} (constrained decoding state is not a function of the token prefix alone)"
    if kind is Kind.CHAT:
        if body.get("logprobs"):
            return "logprobs on chat completions (a resumed chat stream cannot convert them yet)"
        unknown = set(body) - _ROUTER_KEYS - _PORTABLE - {"logprobs", "top_logprobs", "add_generation_prompt",
                                                          "chat_template_kwargs", "chat_template"}
        if unknown:
            return f"chat parameters without a completions equivalent: {', '.join(sorted(unknown))}"
    return None


class StopChecker:
    """Stop-string matching over a text stream, holding back what might be the start of a stop string.

    Mirrors vLLM (its incremental detokenizer's ``stop_buffer_length``): without
    ``include_stop_str_in_output`` the stop string is not emitted and the last ``len(longest stop) - 1``
    characters are held back until more text shows they are not part of one; with it, nothing is held back
    and a stop string may begin in text already emitted (kept in ``tail`` to be searched).
    """

    def __init__(self, stops: list[str], *, include: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include
        self.held = ""  # text not emitted yet (always empty with ``include``)
        self.tail = ""  # with ``include``: the last characters emitted, where a stop string may have begun
        self._keep = max((len(s) for s in self.stops), default=1) - 1

    def restore(self, held: str, text: str) -> None:
        """The state after a checkpoint: ``held`` back, ``text`` emitted."""
        self.held = held
        self.tail = text[len(text) - self._keep:] if self.include and self._keep else ""

    def feed(self, delta: str, *, check: bool = True) -> tuple[str, str | None]:
        """Text that is safe to emit now, and the stop string that matched (generation ends) if any.

        Only a match that ends inside ``delta`` counts (what ended earlier was looked at before, or was
        within ``min_tokens`` when ``check`` was off); of several, the one that ends first, as in vLLM.
        """
        if not self.stops:
            return delta, None
        prior = self.tail if self.include else self.held
        full = prior + delta
        best: tuple[int, str] | None = None
        if check and delta:
            for s in self.stops:
                i = full.find(s, max(0, len(prior) - len(s) + 1))
                if i >= 0 and (best is None or i + len(s) < best[0] + len(best[1])):
                    best = (i, s)
        if best is not None:
            i, s = best
            self.held = self.tail = ""
            return (full[len(prior): i + len(s)], s) if self.include else (full[:i], s)
        if self.include:
            self.tail = full[len(full) - self._keep:] if self._keep else ""
            return delta, None
        cut = max(0, len(full) - self._keep)
        self.held = full[cut:]
        return full[:cut], None

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


@dataclass
class Journal:
    """One in-flight request (see the module docstring)."""

    id: str
    kind: Kind
    body: dict[str, Any]
    created: float = field(default_factory=time.time)
    deadline: float = 0.0  # wall-clock seconds
    prompt_ids: list[int] | None = None
    emitted: list[int] = field(default_factory=list)
    text: str = ""
    text_ends: list[int] = field(default_factory=list)  # len(text) after each emitted token
    worker: str | None = None
    attempts: int = 0
    migrations: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    blocker: str | None = None
    owner: str | None = None  # the API key (its name) that started it: only that key may resume it
    fingerprint: str | None = None  # the last worker's system_fingerprint, passed on as vLLM sends it
    dirty: bool = True
    logprob_chars: int = 0  # characters of the logprobs' token strings so far (the next text_offset)
    vocab: Vocabulary | None = field(default=None, repr=False)  # None: the workers' text is passed on
    stop: StopChecker = field(init=False, repr=False)
    _detok: Detokenizer | None = field(default=None, init=False, repr=False)
    _static: tuple[tuple[Any, ...], bytes] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        stop = self.body.get("stop")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        self.stop = StopChecker(stops, include=bool(self.body.get("include_stop_str_in_output")))
        self.blocker = migration_blocker(self.body, self.kind)
        if self.kind is Kind.COMPLETION and isinstance(self.body.get("prompt"), list):
            self.prompt_ids = list(self.body["prompt"])

    @property
    def model(self) -> str:
        return str(self.body["model"])

    @property
    def max_tokens(self) -> int | None:
        value = self.body.get("max_tokens")
        if value is None:
            value = self.body.get("max_completion_tokens")
        return int(value) if value is not None else None

    @property
    def remaining(self) -> int | None:
        m = self.max_tokens
        return None if m is None else max(0, m - len(self.emitted))

    @property
    def wants_token_ids(self) -> bool:
        return bool(self.body.get("return_token_ids"))

    @property
    def wants_continuous_usage(self) -> bool:
        """Usage in every chunk (``stream_options.continuous_usage_stats``, with ``include_usage`` as in vLLM)."""
        opts = self.body.get("stream_options") or {}
        return bool(opts.get("include_usage")) and bool(opts.get("continuous_usage_stats"))

    @property
    def wants_usage(self) -> bool:
        opts = self.body.get("stream_options") or {}
        return bool(opts.get("include_usage")) or not self.body.get("stream")

    @property
    def is_done(self) -> bool:
        return self.finish_reason is not None

    def resumable(self) -> str | None:
        """None if the request may be resumed (a new attempt, or a replay of a finished one); otherwise why not."""
        if not self.emitted or self.is_done:
            return None  # nothing sent yet, any worker can start over; or nothing is left to generate
        if self.blocker:
            return self.blocker
        if self.prompt_ids is None:
            return "the worker never reported the prompt's token ids"
        return None

    def upstream_request(self) -> tuple[str, dict[str, Any]]:
        """Path and body of the next attempt."""
        if not self.emitted and (self.kind is Kind.COMPLETION or self.prompt_ids is None):
            body = {k: v for k, v in self.body.items() if k not in _ROUTER_KEYS or k in ("prompt", "messages")}
            if self.kind is Kind.COMPLETION and self.prompt_ids is not None:
                body["prompt"] = self.prompt_ids
            path = self.kind.path
        else:
            assert self.prompt_ids is not None
            body = {k: v for k, v in self.body.items() if k in _PORTABLE}
            body["prompt"] = self.prompt_ids + self.emitted
            if self.kind is Kind.COMPLETION and self.body.get("logprobs") is not None:
                body["logprobs"] = self.body["logprobs"]
            path = Kind.COMPLETION.path
        body["stream"] = True
        body["return_token_ids"] = True
        remaining = self.remaining
        if remaining is not None:
            body["max_tokens"] = remaining
        min_tokens = self.body.get("min_tokens")
        if min_tokens:
            body["min_tokens"] = max(0, int(min_tokens) - len(self.emitted))
        return path, body

    def echo_text(self) -> str:
        """The prompt's text a streamed completion with ``echo`` opens with, as vLLM writes it: the prompt
        string as sent, or token ids decoded with their special tokens (empty without a vocabulary). The
        attempts ask for token ids, and with those vLLM leaves the echo out, so the router puts it back."""
        prompt = self.body.get("prompt")
        if isinstance(prompt, str):
            return prompt
        if self.vocab is None or self.prompt_ids is None:
            return ""
        return self.vocab.decode(self.prompt_ids, skip_special_tokens=False)

    def text_after(self, n: int) -> str:
        """The text the client has not seen if it holds the first ``n`` tokens."""
        return self.text[self.text_ends[n - 1]:] if n > 0 else self.text

    def detokenizer(self) -> Detokenizer | None:
        """The request's detokenizer, made once the prompt's ids are known (and brought up to date with
        the tokens emitted before, when the journal was restored from a checkpoint)."""
        if self._detok is None and self.vocab is not None and self.prompt_ids is not None:
            body = self.body
            self._detok = self.vocab.detokenizer(
                self.prompt_ids, skip_special_tokens=body.get("skip_special_tokens", True) is not False,
                spaces_between_special_tokens=body.get("spaces_between_special_tokens", True) is not False)
            self._detok.feed(self.emitted)
        return self._detok

    def record(self, token_ids: list[int], text: str, finish_reason: str | None,
               stop_reason: str | int | None) -> tuple[list[int], str, str | None]:
        """Fold one upstream chunk in; returns (tokens, text, finish reason) to send to the client.

        ``text`` is the worker's, used only without a detokenizer.
        """
        if self.is_done:
            return [], "", None
        remaining = self.remaining
        # The worker ended the generation with this chunk's last token (EOS or a stop token id: stop
        # strings are the router's, never sent to workers).
        token_stop = finish_reason == "stop" and not isinstance(stop_reason, str)
        if remaining is not None and len(token_ids) > remaining:
            token_ids = token_ids[:remaining]
            finish_reason, token_stop = finish_reason or "length", False
        detok = self.detokenizer()
        if detok is None:
            self.emitted.extend(token_ids)
            out_text, matched = self.stop.feed(text)
            self.text_ends.extend([len(self.text) + len(out_text)] * len(token_ids))
        else:
            token_ids, out_text, matched = self._detokenize(detok, token_ids, token_stop)
        if matched is not None:
            finish_reason, stop_reason = "stop", matched
        elif finish_reason is not None:
            out_text += self.stop.flush()
        elif remaining is not None and len(self.emitted) >= (self.max_tokens or 0):
            finish_reason = "length"
            out_text += self.stop.flush()
        if finish_reason is not None and token_ids:
            self.text_ends[-1] = len(self.text) + len(out_text)  # the text held back ends with the last token
        self.text += out_text
        self.dirty = True
        if finish_reason is not None:
            self.finish_reason = finish_reason
            self.stop_reason = stop_reason
        return token_ids, out_text, finish_reason

    def _detokenize(self, detok: Detokenizer, token_ids: list[int],
                    token_stop: bool) -> tuple[list[int], str, str | None]:
        """The text of ``token_ids`` with vLLM's rules (module docstring); tokens after the one that
        completes a stop string are dropped."""
        last = len(token_ids) - 1
        min_tokens = int(self.body.get("min_tokens") or 0)
        out: list[str] = []
        base = len(self.text)
        for k, t in enumerate(token_ids):
            piece = "" if k == last and token_stop and not self.stop.include else detok.step(t)
            self.emitted.append(t)
            if self.stop.stops:
                piece, matched = self.stop.feed(piece, check=len(self.emitted) > min_tokens)
            else:
                matched = None
            out.append(piece)
            base += len(piece)
            self.text_ends.append(base)
            if matched is not None:
                return token_ids[: k + 1], "".join(out), matched
        return token_ids, "".join(out), None

    def logprobs_offsets(self, logprobs: Any) -> Any:
        """Completions ``logprobs`` with ``text_offset`` counted from the request's first token, as one
        uninterrupted vLLM run counts it (a resumed attempt's worker counts from its own start)."""
        if not isinstance(logprobs, dict) or not isinstance(logprobs.get("tokens"), list):
            return logprobs
        offsets = []
        for token in logprobs["tokens"]:
            offsets.append(self.logprob_chars)
            self.logprob_chars += len(token) if isinstance(token, str) else 0
        return {**logprobs, "text_offset": offsets}

    # -- checkpoints ------------------------------------------------------------------------------------

    @property
    def static_key(self) -> tuple[int, float]:
        """What the rarely changing part of a checkpoint depends on besides the router: the prompt ids (by
        identity: a chat request learns them from its first chunk) and the deadline (a resume moves it)."""
        return id(self.prompt_ids), self.deadline

    def checkpoint_bytes(self, router: str) -> bytes:
        """:meth:`checkpoint` as JSON, re-encoding only what changes: the body and prompt ids (often the
        bulk of it) are encoded once and reused while they stay the same."""
        static_key = (*self.static_key, router)
        if self._static is None or self._static[0] != static_key:
            head = orjson.dumps({"v": 1, "id": self.id, "kind": self.kind.value, "router": router, "body": self.body,
                                 "prompt_ids": self.prompt_ids, "deadline": self.deadline, "created": self.created,
                                 "owner": self.owner})
            self._static = (static_key, head[:-1] + b",")
        dynamic = orjson.dumps({
            "emitted": self.emitted, "text": self.text, "text_ends": self.text_ends, "stop_held": self.stop.held,
            "logprob_chars": self.logprob_chars, "worker": self.worker, "attempts": self.attempts,
            "migrations": self.migrations, "finish_reason": self.finish_reason})
        return self._static[1] + dynamic[1:]

    def delta_bytes(self, n: int, c: int) -> bytes:
        """What changed since a checkpoint that held ``n`` tokens and ``c`` characters of text: the tokens,
        text and text offsets after them, and the small fields whole. Tokens, text and offsets only grow,
        so a delta applied to that checkpoint (:meth:`apply_delta`) gives :meth:`checkpoint` again."""
        return orjson.dumps({
            "n": n, "c": c, "emitted": self.emitted[n:], "text": self.text[c:], "text_ends": self.text_ends[n:],
            "stop_held": self.stop.held, "logprob_chars": self.logprob_chars, "worker": self.worker,
            "attempts": self.attempts, "migrations": self.migrations, "finish_reason": self.finish_reason})

    def apply_delta(self, d: dict[str, Any]) -> bool:
        """Fold in a delta (:meth:`delta_bytes`). One that overlaps what the journal holds (a write retried
        after a timeout that had in fact committed) adds only what is new; one that starts past it (a gap:
        never written by :class:`~fleetward.migration.checkpoint.Checkpointer`) is refused: False."""
        n, c = int(d["n"]), int(d["c"])
        if n > len(self.emitted) or c > len(self.text):
            return False
        skip = len(self.emitted) - n
        self.emitted += d["emitted"][skip:]
        self.text_ends += d["text_ends"][skip:]
        self.text += d["text"][len(self.text) - c:]
        self.stop.restore(d.get("stop_held") or "", self.text)
        self.logprob_chars = int(d.get("logprob_chars") or 0)
        self.worker = d.get("worker")
        self.attempts = int(d.get("attempts", 0))
        self.migrations = int(d.get("migrations", 0))
        self.finish_reason = d.get("finish_reason")
        return True

    def checkpoint(self, router: str) -> dict[str, Any]:
        return {
            "v": 1, "id": self.id, "kind": self.kind.value, "router": router, "body": self.body,
            "prompt_ids": self.prompt_ids, "emitted": self.emitted, "text": self.text, "text_ends": self.text_ends,
            "stop_held": self.stop.held, "logprob_chars": self.logprob_chars,
            "worker": self.worker, "attempts": self.attempts, "migrations": self.migrations,
            "deadline": self.deadline, "created": self.created, "finish_reason": self.finish_reason,
            "owner": self.owner,
        }

    @classmethod
    def from_checkpoint(cls, data: dict[str, Any]) -> Journal:
        j = cls(id=data["id"], kind=Kind(data["kind"]), body=data["body"], created=data.get("created", 0.0),
                deadline=data.get("deadline", 0.0))
        j.prompt_ids = data.get("prompt_ids")
        j.owner = data.get("owner")
        j.emitted = list(data.get("emitted") or [])
        j.text = data.get("text") or ""
        j.text_ends = list(data.get("text_ends") or [])
        j.finish_reason = data.get("finish_reason")
        j.stop.restore(data.get("stop_held") or "", j.text)
        j.logprob_chars = int(data.get("logprob_chars") or 0)
        j.worker = data.get("worker")
        j.attempts = int(data.get("attempts", 0))
        j.migrations = int(data.get("migrations", 0))
        return j
