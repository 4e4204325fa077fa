"""The simulated worker: vLLM 0.32's OpenAI-compatible HTTP API over :class:`~.simengine.SimEngine`.

Run it as its own process::

    python -m fleetward.sim.server --host H --port P [--config-json '{...SimConfig...}'] [--model-name M]

or build the ASGI app in-process with :func:`create_app`. The admin token comes from
``FLEETWARD_ADMIN_TOKEN`` (a random one when unset; never logged).

Endpoints
---------
- ``POST /v1/completions``, ``POST /v1/chat/completions``: stream and non-stream, byte for byte in vLLM's
  shapes (key order included; see ``tests/data/vllm-0.32``). ``prompt`` is text, a list of token ids, or
  a one-element list of either. Honoured: ``max_tokens`` (chat: ``max_completion_tokens`` too; clamped to
  the context left, as vLLM does), ``ignore_eos``, ``stop`` (str or list), ``stop_token_ids``,
  ``include_stop_str_in_output``, ``return_token_ids``, ``stream_options.include_usage`` and
  ``continuous_usage_stats``, ``min_tokens``, ``add_generation_prompt`` (chat), the ``X-Request-Id``
  header. Accepted and ignored, because the simulated model is greedy and deterministic: ``temperature``,
  ``top_p``, ``top_k``, ``min_p``, ``seed``, the penalties, ``logit_bias``, ``bad_words``,
  ``allowed_token_ids``, ``priority``, ``user`` (and any other key vLLM would accept), though checked as
  vLLM checks them. Refused with a 400 naming the parameter, although vLLM serves them: ``n`` other than 1
  (every choice would be identical), several prompts in one request (or none), ``echo``,
  ``logprobs``/``prompt_logprobs``/``top_logprobs``, beam search.

  Every request vLLM 0.32 refuses for the tiny model is refused at the same stage, with vLLM's status, type,
  ``param`` and message (the stages and the vLLM files they come from are listed above :func:`_refused`):
  wrong types as its lax schema sees them (``"5"`` is a valid ``max_tokens``), a malformed chat message (any
  role is fine, and so is a message without content), a prompt over the context, sampling parameters out of
  range, token ids outside the vocabulary, ``suffix``. One difference: for a malformed chat message vLLM
  lists the complaint of every message type it knows; the sim gives the first, which carries the ``param``.
  Unknown routes and methods get FastAPI's ``{"detail": ...}`` 404 and 405, as from vLLM.
- ``GET /health`` (200, empty body, also while hung), ``GET /metrics`` (vLLM's metric names and labels),
  ``GET /v1/models`` (with ``max_model_len``).
- Admin, behind ``Authorization: Bearer <token>`` (401 without a token, 403 with a wrong one):

  - ``GET /admin/faults`` → ``{"hang": false, "slowdown": 1.0, "error_rate": 0.0,
    "wrong_tokens": {"probability": 0.0}, "wrong_tokens_after": null, "crash_after_tokens": null,
    "reset_after_tokens": null}`` (``crash_after_tokens`` reads the tokens still to come before the crash);
  - ``POST /admin/faults`` with any of ``{"clear": true}`` (applied first), ``{"hang": bool}``,
    ``{"slowdown": factor > 0}``, ``{"error_rate": 0..1}``, ``{"wrong_tokens": {"probability": 0..1}}``,
    ``{"wrong_tokens_after": k | null}``, ``{"crash_after_tokens": k | null}``,
    ``{"reset_after_tokens": k | null}`` (k >= 0; see *Connection faults*), ``{"fail_inflight": true}``
    (every open request gets vLLM's EngineCore error: in band plus ``[DONE]`` on streams, a 500
    otherwise), ``{"reset_inflight": true}`` (applied after ``fail_inflight``), ``{"crash": true}``
    (answers 202, then the process ends at once with ``os._exit(137)``, as if killed; other keys are
    ignored). Answers the switches as ``GET`` does, plus ``"failed_inflight": n`` / ``"reset_inflight": n``
    (requests failed / cut) when those were given;
  - ``GET /admin/state`` → live ``running``, ``waiting``, ``kv_usage``, ``kv_blocks_used``,
    ``kv_blocks_total``, ``steps``, ``hung``, ``stalled`` (the loop noticed the hang and is parked),
    ``preemptions``, ``generation_tokens``, ``faults``, ``model``.

Connection faults
-----------------
``crash_after_tokens: k`` (also preset at start with ``--faults-json``, counted from start): the engine
emits exactly k more tokens, counted from when the switch is set, across all requests, then no more
(requests keep arriving and queue). The process then ends through the same path as ``{"crash": true}``
(``os._exit(137)``) as soon as every token the engine has emitted, before or after the switch, has
been handed to the HTTP server: each stream's chunk carrying it was given to uvicorn's ``send``, which
returned; finished non-stream responses were sent the same way; and the answer to the ``POST`` that
set the switch too. uvicorn writes to the socket at once, so those bytes are in the kernel's send
buffer, and the kernel delivers them (then a FIN) after the process is gone; the one exception is a
client that stopped reading until the buffer filled, whose unsent bytes are lost as with a real kill
(and whose pending ``send`` delays the crash until it reads again). So with streams only, clients see
exactly k more tokens in total, then the connections break (an incomplete chunked body, or a refused
connection for requests arriving later). A non-stream request still generating when the budget runs
out gets no response; its tokens count towards k. ``clear`` or ``null`` disarms; a new k restarts the
count.

``reset_inflight: true``: every request the engine has not finished (running or queued) is aborted
(slot and KV blocks freed at once, unless the engine is hung: then once it runs again) and its
connection is dropped: a stream ends mid-body without ``[DONE]`` and without an error event, even if
tokens were waiting for it; a non-stream request gets the head of a 200 response and then the
connection closes (ASGI cannot drop a connection before a response starts; the server would answer
500), so the client sees a body that ends before it began (httpx: ``RemoteProtocolError``). Both count
as ``finished_reason="abort"``. New requests are served as usual.

``reset_after_tokens: k``: a request that reaches k output tokens without having finished is cut the
same way once the chunk carrying its k-th token has been sent: a stream delivers exactly k tokens, then
its connection drops. Requests that finish at k tokens or fewer end normally; requests already past k
when the switch is set are cut at their next step without a further token. Non-stream requests are cut
too (the head of a 200, then the drop). The switch stays until cleared.

The drop is a clean close (FIN) by the server, not a TCP RST; uvicorn logs each one as "ASGI callable
returned without completing response."

Failures look like vLLM's: ``{"error": {"message", "type", "param", "code"}}``; while ``error_rate`` hits,
new requests get the 500 a dead EngineCore gives. A client that disconnects (stream or not) aborts its
request in the engine, freeing its batch slot and KV blocks.

One module (over 600 lines) because it is the whole OpenAI-compatible surface of a vLLM server, which
the tests compare field by field with the real one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import hmac
import json
import logging
import math
import os
import secrets
import signal
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import aiohttp
import uvicorn
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, create_model
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.config import SimConfig, admin_token_from_env
from fleetward.fleet.errors import WorkerError
from fleetward.fleet.kv import KV_ERROR_TYPE, KvFrame, KvLink, KvOffer, KvSenderDied, KvTransferError, digest, frames_of
from fleetward.fleet.kv import pull as pull_kv
from fleetward.fleet.kv import send as send_kv
from fleetward.fleet.vocab import BUILTIN
from fleetward.sim.engine import (
    ENGINE_DEAD_MESSAGE,
    EngineStats,
    Faults,
    Histogram,
    RequestCut,
    SamplingSpec,
    SimEngine,
    SimRequest,
)
from fleetward.sim.kvfaults import KvFaultHook, KvRule
from fleetward.sim.tokenizer import VOCAB_SIZE, encode, render_chat

__all__ = ["SimWorker", "create_app", "main"]

log = logging.getLogger("fleetward.simworker")

_enc = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_DONE = b"data: [DONE]\n\n"
_COMPLETION_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default (also for an explicit null)
CRASH_EXIT_CODE = 137  # what a shell reports for a SIGKILLed process


def _crash_process() -> None:
    logging.getLogger("fleetward.simworker").warning("crash requested through /admin/faults: exiting now")
    for h in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            h.flush()
    os._exit(CRASH_EXIT_CODE)


class _ApiError(WorkerError):
    """A request the worker refuses; becomes vLLM's error body (never leaves this module)."""

    def __init__(self, message: str, *, status: int = 400, err_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message, status=status)
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.status}}


def _engine_dead() -> _ApiError:
    return _ApiError(ENGINE_DEAD_MESSAGE, status=500, err_type="InternalServerError")


def _json_response(body: dict[str, Any], status: int = 200) -> Response:
    return Response(_enc(body).encode(), status_code=status, media_type="application/json")


def _error_response(err: _ApiError) -> Response:
    return _json_response(err.body(), err.status)


def _stream_error(err: WorkerError) -> bytes:
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


# -- request parsing ----------------------------------------------------------------------------------
#
# vLLM 0.32 refuses a request at one of these stages, and the sim at the same ones, in the same order, with
# the same status, type, param and message (the files named are under vllm/):
#
# 1. checks of the raw body (the ``mode="before"`` validators of entrypoints/openai/completion/protocol.py and
#    chat_completion/protocol.py; pydantic runs the last defined first): 400 "BadRequestError";
# 2. the request schema (the fields of those models, lax as pydantic is by default, so "5" is a max_tokens
#    and "yes" a stream), reported by entrypoints/serve/exception_handling/handlers/validation.py: 400
#    "Bad Request", ``param`` the first error's location ("body.max_tokens");
# 3. the served model (404), then the prompt against the context (renderers/params.py TokenizeParams). A
#    max_tokens beyond the context left is clamped to it (entrypoints/serve/utils/api_utils.py
#    get_max_tokens), not refused; only a max_tokens over the whole context is;
# 4. the sampling parameters (sampling_params.py: SamplingParams.from_optional, then _verify_args);
# 5. what the engine checks against the model (SamplingParams.verify, v1/engine/input_processor.py).
#
# The sim's own refusals (n > 1, echo, logprobs, beam search, several prompts) come after stage 2.

_MAX_CHARS_PER_TOKEN = 5  # the tiny model's longest vocabulary entry ("<unk>"); vLLM bounds text prompts by it
_REPORTED_ERRORS = 10  # vLLM's validation message lists this many errors, then counts the rest
_ECHOED_CHARS = 200  # ... and echoes each value up to this many characters
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def _refused(message: str, *, param: str | None = None, value: object = None) -> _ApiError:
    """A 400 worded as vLLM words its ``VLLMValidationError``: the parameter and the value it names are
    appended to the message (vllm/exceptions.py)."""
    named = [f"parameter={param}"] if param is not None else []
    if value is not None:
        named.append(f"value={value}")
    return _ApiError(f"{message} ({', '.join(named)})" if named else message, param=param)


def _error(kind: str, loc: tuple[str | int, ...], msg: str, value: object, **ctx: object) -> dict[str, Any]:
    """One schema error as pydantic reports it (``loc`` without the leading "body")."""
    return {"type": kind, "loc": loc, "msg": msg, "input": value, **({"ctx": ctx} if ctx else {})}


def _location(loc: Sequence[str | int]) -> str:
    """``loc`` as vLLM's ``param`` spells it: under "body", without pydantic's names for the members of a
    union ("list[constrained-int]", "str")."""
    def member(part: str | int) -> bool:
        return isinstance(part, str) and (part in {"str", "int", "float", "bool"} or
                                          any(c in part for c in "[](){}"))
    return ".".join(["body", *(str(part) for part in loc if not member(part))])


def _echoed(value: object) -> object:
    """A value as vLLM's validation message echoes it: text cut short, containers by their size."""
    if isinstance(value, (list, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= _ECHOED_CHARS else text[:_ECHOED_CHARS] + "...[truncated]"


def _schema_error(errors: Sequence[Mapping[str, Any] | str]) -> _ApiError:
    """Errors against the request schema as vLLM's validation handler reports them: 400, type "Bad Request",
    ``param`` the first error's location, one line per error (ten at most), the values echoed cut short."""
    def line(error: Mapping[str, Any] | str) -> str:
        if isinstance(error, str):
            return error
        text = str({**error, "loc": _location(error["loc"]), "input": _echoed(error["input"])})
        return text if len(text) <= 1000 else text[:1000] + "...[truncated]"

    label = "error" if len(errors) == 1 else "errors"
    lines = [f"  {line(e)}" for e in errors[:_REPORTED_ERRORS]]
    if len(errors) > _REPORTED_ERRORS:
        lines.append(f"  ...and {len(errors) - _REPORTED_ERRORS} more {label}")
    first = errors[0]
    return _ApiError(f"{len(errors)} validation {label}:\n" + "\n".join(lines), err_type="Bad Request",
                     param=None if isinstance(first, str) else _location(first["loc"]))


def _check_raw(body: dict[str, Any], *, chat: bool) -> None:
    """Stage 1: vLLM's checks of the raw body, in its order (which differs between the two endpoints)."""
    def stream_options() -> None:
        if body.get("stream_options") and not body.get("stream"):
            raise _refused("Stream options can only be defined when `stream=True`.", param="stream_options")

    def logprobs() -> None:
        for key in ("prompt_logprobs", "top_logprobs" if chat else "logprobs"):
            value = body.get(key)
            if value is not None and not isinstance(value, (int, float)):
                raise _refused(f"`{key}` must be an integer.", param=key, value=value)

    if chat:
        if body.get("continue_final_message") and body.get("add_generation_prompt"):
            raise _refused("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        logprobs()
        stream_options()
    else:
        if body.get("prompt") is None or body.get("prompt") == "":
            raise _refused("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
        stream_options()
        logprobs()
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise _refused("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    if isinstance(salt, str) and (len(salt) > 128 or not _CACHE_SALT_FORBIDDEN.isdisjoint(salt)):
        raise _refused("Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', "
                       "'\\\\', or NUL.", param="cache_salt")


def _message_errors(messages: object) -> list[dict[str, Any]]:
    """Stage 2 for each chat message: what vLLM's union of message types refuses.

    vLLM takes any role (the tiny model's template renders it) and a message without content; it refuses a
    message that is not an object, has no role or a role that is not a string, or content that is neither
    text nor a list of parts (null is content only for the assistant). For such a message vLLM lists the
    complaint of every type in its union; the sim gives the first, which names the field vLLM's ``param``
    names (its first type is the developer message: content, then role).
    """
    if not isinstance(messages, list):
        return []  # the schema says so
    errors = []
    for i, m in enumerate(messages):
        at: tuple[str | int, ...] = ("messages", i, "ChatCompletionDeveloperMessageParam")
        if not isinstance(m, dict):
            errors.append(_error("dict_type", at, "Input should be a valid dictionary", m))
            continue
        role, content = m.get("role"), m.get("content")
        is_content = isinstance(content, (str, list, dict))  # a JSON object is iterable, so vLLM takes it
        if isinstance(role, str) and ("content" not in m or is_content or (content is None and role == "assistant")):
            continue
        if "content" not in m:
            errors.append(_error("missing", (*at, "content"), "Field required", m))
        elif not is_content:
            errors.append(_error("string_type", (*at, "content"), "Input should be a valid string", content))
        elif "role" not in m:
            errors.append(_error("missing", (*at, "role"), "Field required", m))
        else:
            errors.append(_error("literal_error", (*at, "role"), "Input should be 'developer'", role,
                                 expected="'developer'"))
    return errors


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


_TokenIds = list[Annotated[int, Field(ge=0)]]

# The request fields the sim reads or vLLM types, with vLLM's types and defaults (completion/protocol.py,
# chat_completion/protocol.py). A default of None on a type without None lets the key be absent but refuses
# an explicit null, as vLLM does (pydantic does not validate defaults). Keys not here are accepted and ignored,
# as vLLM accepts unknown keys.
_FIELDS: dict[str, tuple[Any, Any]] = {
    "model": (str | None, None),
    "prompt": (_TokenIds | list[_TokenIds] | str | list[str] | None, None),
    "messages": (list[Any], ...),  # each message is checked by _message_errors
    "echo": (bool | None, False),
    "frequency_penalty": (float | None, None),
    "logit_bias": (dict[str, float] | None, None),
    "logprobs": (int | None, None),
    "top_logprobs": (int | None, 0),
    "max_tokens": (int | None, None),
    "max_completion_tokens": (int | None, None),
    "n": (int | None, 1),
    "presence_penalty": (float | None, None),
    "seed": (Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None, None),
    "stop": (str | Annotated[list[str], Field(max_length=4)] | None, None),  # VLLM_MAX_STOP_STRINGS
    "stream": (bool | None, False),
    "stream_options": (_StreamOptions | None, None),
    "suffix": (str | None, None),
    "temperature": (float | None, None),
    "top_p": (float | None, None),
    "user": (str | None, None),
    "use_beam_search": (bool, False),
    "top_k": (int | None, None),
    "min_p": (float | None, None),
    "repetition_penalty": (float | None, None),
    "length_penalty": (float, 1.0),
    "stop_token_ids": (list[int] | None, None),
    "include_stop_str_in_output": (bool, False),
    "ignore_eos": (bool, False),
    "min_tokens": (int, 0),
    "skip_special_tokens": (bool, True),
    "spaces_between_special_tokens": (bool, True),
    "allowed_token_ids": (list[int] | None, None),
    "prompt_logprobs": (int | None, None),
    "bad_words": (list[str], None),
    "add_generation_prompt": (bool, True),
    "continue_final_message": (bool, False),
    "add_special_tokens": (bool, True),
    "priority": (int, 0),
    "request_id": (str, None),
    "return_token_ids": (bool | None, None),
    "cache_salt": (str | None, None),
}


def _request_model(name: str, fields: str, **differing: tuple[Any, Any]) -> type[BaseModel]:
    """A model of ``fields`` in vLLM's order (several errors are listed in it), unknown keys allowed."""
    spec: dict[str, Any] = {f: differing.get(f, _FIELDS[f]) for f in fields.split()}
    return create_model(name, __config__=ConfigDict(extra="allow"), **spec)


_SAMPLING_FIELDS = ("use_beam_search top_k min_p repetition_penalty length_penalty stop_token_ids "
                    "include_stop_str_in_output ignore_eos min_tokens skip_special_tokens "
                    "spaces_between_special_tokens")
_COMPLETION_REQUEST = _request_model(
    "CompletionRequest",
    "model prompt echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed stop stream "
    f"stream_options suffix temperature top_p user {_SAMPLING_FIELDS} allowed_token_ids prompt_logprobs "
    "bad_words add_special_tokens priority request_id return_token_ids cache_salt",
    n=(int, 1))
_CHAT_REQUEST = _request_model(
    "ChatCompletionRequest",
    "messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens n "
    f"presence_penalty seed stop stream stream_options temperature top_p user {_SAMPLING_FIELDS} prompt_logprobs "
    "allowed_token_ids bad_words echo add_generation_prompt continue_final_message add_special_tokens priority "
    "request_id return_token_ids cache_salt",
    echo=(bool, False), logprobs=(bool | None, False), add_special_tokens=(bool, False))


def _refuse_unsupported(v: dict[str, Any]) -> None:
    """What vLLM serves and the sim does not: its model is greedy and deterministic, one sample per request."""
    n = v["n"]
    if n is not None and n > 1:
        raise _ApiError(f"n={n} is not supported by the simulated worker: its model is greedy and "
                        "deterministic, so every choice would be the same; send n=1", param="n")
    for key in ("echo", "use_beam_search"):
        if v.get(key):
            raise _ApiError(f"{key} is not supported by the simulated worker", param=key)
    for key in ("logprobs", "prompt_logprobs", "top_logprobs"):
        value = v.get(key)
        if value is not None and value is not False and not (key == "top_logprobs" and value == 0):
            raise _ApiError(f"{key} is not supported by the simulated worker", param=key)


def _prompt_tokens(prompt: str | list[int], max_len: int, encoder: Callable[[str], list[int]]) -> list[int]:
    """Stage 3: the prompt's token ids, refused as vLLM refuses a prompt over the context. vLLM tokenizes text
    only up to one token past the context (and not at all past a bound on characters), so for text it can
    only say "at least"."""
    if isinstance(prompt, list):
        ids, count = prompt, len(prompt)
    else:
        if len(prompt) > max_len * _MAX_CHARS_PER_TOKEN:
            raise _refused(f"This model's maximum context length is {max_len} tokens. However, your prompt "
                           f"contains {len(prompt)} characters (more than {max_len * _MAX_CHARS_PER_TOKEN} "
                           f"characters, which is the upper bound for {max_len} input tokens). Please reduce "
                           "the length of the input prompt.", param="input_text", value=len(prompt))
        ids = encoder(prompt)
        count = min(len(ids), max_len + 1)
    if count > max_len:
        at_least = "at least " if count == max_len + 1 else ""
        raise _refused(f"This model's maximum context length is {max_len} tokens. However, your prompt contains "
                       f"{at_least}{count} input tokens, which exceeds this limit even without any output tokens. "
                       "Please reduce the length of the input prompt.", param="input_tokens", value=count)
    return ids


def _token_keys(bias: dict[str, float]) -> list[int]:
    """``logit_bias``'s token ids, refused as vLLM refuses keys that are not ids."""
    ids, bad = [], []
    for key in bias:
        try:
            ids.append(int(key))
        except ValueError:
            bad.append(key)
    if bad:
        raise _refused(f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad!r}",
                       param="logit_bias", value=bad)
    return list(dict.fromkeys(ids))


def _check_sampling(v: dict[str, Any], max_tokens: int) -> None:
    """Stage 4: vLLM's checks of the sampling parameters, in its order, with the defaults it fills in."""
    n = 1 if v["n"] is None else v["n"]
    if n < 1:
        raise _refused(f"n must be at least 1, got {n}.")
    for key in ("presence_penalty", "frequency_penalty"):
        penalty = 0.0 if v[key] is None else v[key]
        if not -2.0 <= penalty <= 2.0:
            raise _refused(f"{key} must be in [-2, 2], got {penalty}.")
    repetition = 1.0 if v["repetition_penalty"] is None else v["repetition_penalty"]
    if not math.isfinite(repetition):
        raise _refused(f"repetition_penalty must be a finite number, got {repetition}.")
    if repetition <= 0.0:
        raise _refused(f"repetition_penalty must be greater than zero, got {repetition}.")
    t = 1.0 if v["temperature"] is None else v["temperature"]
    for wrong, why in ((not math.isfinite(t), "be a finite number"), (t < 0.0, "be non-negative"),
                       (t > 2.0, "be in [0, 2]")):
        if wrong:
            raise _refused(f"temperature must {why}, got {t}.", param="temperature", value=t)
    top_p = 1.0 if v["top_p"] is None else v["top_p"]
    if not 0.0 < top_p <= 1.0:
        raise _refused(f"top_p must be in (0, 1], got {top_p}.", param="top_p", value=top_p)
    top_k = 0 if v["top_k"] is None else v["top_k"]
    if top_k < -1:
        raise _refused(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    min_p = 0.0 if v["min_p"] is None else v["min_p"]
    if not 0.0 <= min_p <= 1.0:
        raise _refused(f"min_p must be in [0, 1], got {min_p}.")
    if max_tokens < 1:
        raise _refused(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens", value=max_tokens)
    min_tokens = v["min_tokens"]
    if min_tokens < 0:
        raise _refused(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if min_tokens > max_tokens:
        raise _refused(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")
    stop = v["stop"]
    if stop == "" or (isinstance(stop, list) and "" in stop):
        raise _refused("stop cannot contain an empty string.")
    bad_words = list(dict.fromkeys(v["bad_words"] or []))
    if "" in bad_words:
        raise _refused(f"bad_words cannot contain an empty string. Got bad_words={bad_words}")


def _check_engine(v: dict[str, Any], bias_ids: list[int], prompt_ids: list[int], vocab_size: int) -> None:
    """Stage 5: what vLLM's engine checks against the model, in its order: token ids the request names, then
    the prompt."""
    for key, ids in (("logit_bias", bias_ids), ("stop_token_ids", list(dict.fromkeys(v["stop_token_ids"] or [])))):
        if bad := [i for i in ids if not 0 <= i < vocab_size]:
            raise _refused(f"token_id(s) {bad} in {key} contain out-of-vocab token ids. Vocabulary size: "
                           f"{vocab_size}", param=key, value=bad)
    allowed = v["allowed_token_ids"]
    if allowed is not None and not allowed:
        raise _refused("allowed_token_ids is not None and empty!", param="allowed_token_ids", value=allowed)
    if allowed and (bad := [i for i in allowed if not 0 <= i < vocab_size]):
        raise _refused("allowed_token_ids contains out-of-vocab token id!", param="allowed_token_ids", value=bad)
    if not prompt_ids:
        raise _refused("The decoder prompt cannot be empty")
    if max(prompt_ids) >= vocab_size:  # negative ids do not pass the schema
        raise _refused(f"Token id {max(prompt_ids)} is out of vocabulary")


@dataclass(slots=True)
class _Parsed:
    prompt_ids: list[int]
    spec: SamplingSpec
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    role: str = "assistant"


class _Metrics(Collector):
    """vLLM's engine metrics (names, labels, buckets) read from :class:`EngineStats` at scrape time."""

    def __init__(self, stats: EngineStats, model_name: str) -> None:
        self._stats = stats
        self._labels = ["model_name", "engine"]
        self._values = [model_name, "0"]

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        g = GaugeMetricFamily(name, doc, labels=self._labels)
        g.add_metric(self._values, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        c = CounterMetricFamily(name, doc, labels=self._labels)
        c.add_metric(self._values, value)
        return c

    def _histogram(self, name: str, doc: str, h: Histogram) -> Metric:
        m = HistogramMetricFamily(name, doc, labels=self._labels)
        m.add_metric(self._values, [(floatToGoString(b), c) for b, c in h.cumulative()], h.sum)
        return m

    def collect(self) -> Iterable[Metric]:
        s = self._stats
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                          s.running)
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                          s.waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                          s.kv_usage)
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                            s.preemptions)
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.",
                            s.generation_tokens)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*self._labels, "finished_reason"])
        for reason, n in s.finished.items():
            success.add_metric([*self._values, reason], n)
        yield success
        yield self._histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", s.ttft)
        yield self._histogram("vllm:inter_token_latency_seconds",
                              "Histogram of inter-token latency in seconds.", s.itl)
        yield self._histogram("vllm:e2e_request_latency_seconds",
                              "Histogram of e2e request latency in seconds.", s.e2e)
        yield self._histogram("vllm:request_queue_time_seconds",
                              "Histogram of time spent in WAITING phase for request.", s.queue)


class _EventStream(StreamingResponse):
    """An SSE response that always closes its generator and then runs ``on_close`` (the engine release),
    whether the stream ended, the client went away, the request was cut, or the server is shutting down.

    A cut (:class:`RequestCut` out of the generator) returns without the final body message: an ASGI app
    that returns with its response incomplete makes the server close the connection there (uvicorn logs
    "ASGI callable returned without completing response."), so the client's chunked body ends unfinished.
    """

    def __init__(self, events: AsyncGenerator[bytes, None], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except RequestCut as exc:
            log.info("%s; dropping the stream mid-body", exc)
        finally:
            try:
                await self._events.aclose()
            finally:
                self._on_close()


class _Released(Response):
    """A JSON response that runs ``on_close`` once it is sent (or sending failed)."""

    def __init__(self, body: dict[str, Any], status: int, on_close: Callable[[], None]) -> None:
        super().__init__(_enc(body).encode(), status_code=status, media_type="application/json")
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _Cut(Response):
    """Drops the connection of a cut non-stream request, then runs ``on_close``.

    ASGI cannot close a connection before a response starts (the server would answer 500 instead), so
    this sends the head of a chunked 200 response and returns without a body: the server closes the
    connection there, and the client sees a response whose body ends before it began.
    """

    def __init__(self, cut: RequestCut, on_close: Callable[[], None]) -> None:
        super().__init__(status_code=200)
        self._cut = cut
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        log.info("%s; dropping the connection after the response head", self._cut)
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
        finally:
            self._on_close()


@dataclass(slots=True)
class _StoredKv:
    frames: list[KvFrame]
    expires: float


class SimWorker:
    """One simulated worker: its config, engine, metrics and the ASGI app (:attr:`app`) serving them.

    ``crash`` is what ``{"crash": true}`` calls after answering, and what a spent ``crash_after_tokens``
    budget calls (default: end the process at once); tests running the app in-process pass something
    harmless. ``faults`` are the switches the worker starts with (a worker can start already faulty).
    """

    def __init__(self, config: SimConfig, *, admin_token: SecretStr | str | None = None,
                 clock: Clock = SYSTEM_CLOCK, crash: Callable[[], None] = _crash_process,
                 faults: Faults | None = None) -> None:
        self.config = config
        self.model_name = config.model_name
        self.clock = clock
        self.engine = SimEngine(config, clock=clock, crash=self._crash_after_tokens, faults=faults)
        token = admin_token if admin_token is not None else admin_token_from_env()
        self._token = (token.get_secret_value() if isinstance(token, SecretStr) else token).encode()
        self._crash = crash
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Metrics(self.engine.stats, self.model_name))
        digest = hashlib.sha256(f"{self.model_name}:{config.seed}:{config.eos_probability}".encode())
        self.system_fingerprint = f"fleetward-sim-{digest.hexdigest()[:8]}"
        self._model_json = _enc(self.model_name)
        self.vocab = self.engine.scheduler.vocab
        self.vocab_size = VOCAB_SIZE if self.vocab is None else self.vocab.size
        self._fingerprint_json = _enc(self.system_fingerprint)
        # Prefill/decode (fleetward.fleet.kv): the KV this worker computed for decode workers to pull, by
        # transfer id, oldest first (every entry has the same lease, so expiry follows insertion order).
        self.kv_hook = KvFaultHook(die=self._crash)
        self.kv_link = KvLink(config.kv_latency_ms / 1000, config.kv_bandwidth_gbps * 1.25e8)
        self._kv_store: dict[str, _StoredKv] = {}
        self.kv_stats: dict[str, Any] = {"offered": 0, "sent": 0, "loaded": 0, "recomputed": 0, "failed": {}}
        self._session: aiohttp.ClientSession | None = None

        app = FastAPI(lifespan=self._lifespan, openapi_url=None, docs_url=None, redoc_url=None)
        app.state.worker = self
        app.state.engine = self.engine
        r = app.router
        r.add_route("/v1/completions", self._completions, methods=["POST"])
        r.add_route("/v1/chat/completions", self._chat_completions, methods=["POST"])
        r.add_route("/health", self._health, methods=["GET"])
        r.add_route("/metrics", self._metrics, methods=["GET"])
        r.add_route("/v1/models", self._models, methods=["GET"])
        r.add_route("/admin/faults", self._get_faults, methods=["GET"])
        r.add_route("/admin/faults", self._post_faults, methods=["POST"])
        r.add_route("/admin/state", self._state, methods=["GET"])
        r.add_route("/kv/{transfer_id}", self._kv, methods=["GET"])
        self.app = app
        from fleetward.sim.endpoints import mount  # its routes use this module's helpers

        mount(self)

    def _crash_after_tokens(self) -> None:
        log.warning("crash_after_tokens: the token budget is spent and handed to the HTTP server")
        self._crash()

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        async with asyncio.TaskGroup() as tg:
            engine = tg.create_task(self.engine.run(), name="sim-engine")
            try:
                yield
            finally:
                engine.cancel()
                self.kv_hook.clear()
                if self._session is not None:
                    await self._session.close()

    # -- plain endpoints ----------------------------------------------------------------------------

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def _metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def _models(self, request: Request) -> Response:
        now = int(self.clock.wall())
        card = {"id": self.model_name, "object": "model", "created": now, "owned_by": "vllm",
                "root": self._root, "parent": None, "max_model_len": self.config.max_model_len,
                "permission": [{"id": f"modelperm-{secrets.token_hex(8)}", "object": "model_permission",
                                "created": now, "allow_create_engine": False, "allow_sampling": True,
                                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*", "group": None,
                                "is_blocking": False}]}
        return _json_response({"object": "list", "data": [card]})

    # -- admin --------------------------------------------------------------------------------------

    def _refuse(self, request: Request) -> Response | None:
        header = request.headers.get("authorization")
        if not header:
            return Response('{"error":"missing bearer token"}', status_code=401,
                            media_type="application/json", headers={"WWW-Authenticate": "Bearer"})
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._token):
            return Response('{"error":"wrong token"}', status_code=403, media_type="application/json")
        return None

    async def _get_faults(self, request: Request) -> Response:
        if (refused := self._refuse(request)) is not None:
            return refused
        return _json_response({**self.engine.faults.to_json(), "kv": self.kv_hook.to_json()})

    async def _state(self, request: Request) -> Response:
        if (refused := self._refuse(request)) is not None:
            return refused
        return _json_response({**self.engine.state(), "model": self.model_name, "kv": self.kv_stats})

    async def _post_faults(self, request: Request) -> Response:
        if (refused := self._refuse(request)) is not None:
            return refused
        try:
            body = json.loads(await request.body())
            new, crash, fail_inflight, reset_inflight = self._parse_faults(body)
            kv_change = self._parse_kv_faults(body)
        except (ValueError, _ApiError) as exc:
            msg = exc.message if isinstance(exc, _ApiError) else f"not JSON: {exc}"
            return _json_response({"error": msg}, 400)
        if crash:
            log.warning("crash requested through /admin/faults")
            return Response('{"crash":true}', status_code=202, media_type="application/json",
                            background=BackgroundTask(self._crash))
        release = self.engine.hold_crash()  # a spent crash_after_tokens waits for this answer to be sent
        try:
            faults = self.engine.update_faults(new)
            if body.get("clear") is True:
                self.kv_hook.clear()
            kv_change()
            out = {**faults.to_json(), "kv": self.kv_hook.to_json()}
            if fail_inflight:
                out["failed_inflight"] = self.engine.fail_inflight()
            if reset_inflight:
                out["reset_inflight"] = self.engine.reset_inflight()
            log.info("faults now %s", out)
        except BaseException:
            release()
            raise
        return _Released(out, 200, release)

    def _parse_faults(self, body: object) -> tuple[Faults, bool, bool, bool]:
        if not isinstance(body, dict):
            raise _ApiError("expected a JSON object")
        known = {"clear", "crash", "hang", "slowdown", "error_rate", "wrong_tokens", "wrong_tokens_after",
                 "crash_after_tokens", "reset_after_tokens", "fail_inflight", "reset_inflight", "kv"}
        if unknown := sorted(set(body) - known):
            raise _ApiError(f"unknown fault switch(es) {unknown}; known: {sorted(known)}")

        def flag(key: str) -> bool:
            v = body.get(key, False)
            if not isinstance(v, bool):
                raise _ApiError(f"{key}: expected true or false, got {v!r}")
            return v

        def number(key: str, v: object, lo: float, hi: float, *, lo_open: bool = False) -> float:
            left = "(" if lo_open else "["
            wrong = _ApiError(f"{key}: expected a number in {left}{lo}, {hi}], got {v!r}")
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise wrong
            if not (lo < v if lo_open else lo <= v) or v > hi:
                raise wrong
            return float(v)

        cur = Faults() if flag("clear") else Faults(**vars(self.engine.faults))
        if "hang" in body:
            cur.hang = flag("hang")
        if "slowdown" in body:
            cur.slowdown = number("slowdown", body["slowdown"], 0, 1e6, lo_open=True)
        if "error_rate" in body:
            cur.error_rate = number("error_rate", body["error_rate"], 0, 1)
        if "wrong_tokens" in body:
            wt = body["wrong_tokens"]
            if wt is None:
                cur.wrong_tokens_probability = 0.0
            elif isinstance(wt, dict) and set(wt) <= {"probability"}:
                cur.wrong_tokens_probability = number("wrong_tokens.probability",
                                                      wt.get("probability", 1.0), 0, 1)
            else:
                raise _ApiError(f'wrong_tokens: expected {{"probability": p}} or null, got {wt!r}')
        def count(key: str) -> int | None:
            k = body[key]
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
                raise _ApiError(f"{key}: expected a token count >= 0 or null, got {k!r}")
            return k

        if "wrong_tokens_after" in body:
            cur.wrong_tokens_after = count("wrong_tokens_after")
        if "crash_after_tokens" in body:
            cur.crash_after_tokens = count("crash_after_tokens")
        if "reset_after_tokens" in body:
            cur.reset_after_tokens = count("reset_after_tokens")
        return cur, flag("crash"), flag("fail_inflight"), flag("reset_inflight")

    def _parse_kv_faults(self, body: dict[str, Any]) -> Callable[[], None]:
        """The ``kv`` switch (:mod:`fleetward.sim.kvfaults`), checked now and applied by the returned call."""
        if "kv" not in body:
            return lambda: None
        op = body["kv"]
        if not isinstance(op, dict) or len(op) != 1 or next(iter(op)) not in ("add", "remove", "clear"):
            raise _ApiError(f'kv: expected {{"add": rule}}, {{"remove": id}} or {{"clear": true}}, got {op!r}')
        if "add" in op:
            try:
                rule = KvRule.parse(op["add"])
            except ValueError as exc:
                raise _ApiError(str(exc)) from None
            return functools.partial(self.kv_hook.add, rule)
        if "remove" in op:
            if not isinstance(op["remove"], str):
                raise _ApiError(f"kv.remove: a rule id, got {op['remove']!r}")
            return functools.partial(self.kv_hook.remove, op["remove"])
        if op["clear"] is not True:
            raise _ApiError(f"kv.clear: expected true, got {op['clear']!r}")
        return self.kv_hook.clear

    # -- KV transfer (prefill/decode) ---------------------------------------------------------------

    def _offer_kv(self, request: Request, prompt_ids: list[int]) -> KvOffer | None:
        """Keep the KV of ``prompt_ids``' whole blocks (all but the last token) for a decode worker to pull."""
        bs = self.config.kv_block_size
        covered = (len(prompt_ids) - 1) // bs * bs
        if covered <= 0:
            return None
        now = self.clock.monotonic()
        store = self._kv_store
        while store and next(iter(store.values())).expires <= now:
            del store[next(iter(store))]
        blocks = self.engine.scheduler.model.kv_blocks(prompt_ids[:covered], self.config.kv_bytes_per_token, bs)
        tid = f"kv-{secrets.token_hex(8)}"
        store[tid] = _StoredKv(frames_of(tid, blocks, bs), now + self.config.kv_lease_s)
        self.kv_stats["offered"] += 1
        return KvOffer(str(request.base_url).rstrip("/"), tid, covered, len(blocks),
                       digest(prompt_ids[:covered], blocks))

    async def _kv(self, request: Request) -> Response:
        tid = request.path_params["transfer_id"]
        stored = self._kv_store.get(tid)
        if stored is None or stored.expires <= self.clock.monotonic():
            self._kv_store.pop(tid, None)
            return _json_response({"error": {"message": f"no KV transfer {tid} here (unknown, or its lease of "
                                            f"{self.config.kv_lease_s:g} s ran out)", "type": "NotFoundError",
                                             "code": 404}}, 404)
        self.kv_stats["sent"] += 1

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in send_kv(tid, stored.frames, self.kv_hook, self.kv_link):
                    yield chunk
            except KvSenderDied as exc:
                log.warning("kv transfer cut by a fault: %s", exc)
                raise
            # Sent: the blocks are freed, as a prefill worker frees them once the decode side has read them
            # (a second pull of this transfer finds it expired, and the router prefills again).
            self._kv_store.pop(tid, None)

        return StreamingResponse(body(), media_type="application/octet-stream")

    async def _load_kv(self, params: dict[str, Any], offer: KvOffer, prompt_ids: list[int]) -> tuple[int, int] | None:
        """Pull a prefill worker's KV for ``prompt_ids``: ``(tokens, state)`` to start from, or None to compute
        the prompt here (the transfer failed and the request said ``kv_load_failure_policy: recompute``).
        Raises :class:`KvTransferError` otherwise."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        covered = min(offer.tokens, len(prompt_ids))
        try:
            got = await pull_kv(self._session, offer, prompt_ids, timeout=self.config.kv_timeout_s,
                                verify=params.get("verify", True) is not False)
        except KvTransferError as exc:
            failed = self.kv_stats["failed"]
            failed[exc.kind] = failed.get(exc.kind, 0) + 1
            if params.get("kv_load_failure_policy") != "recompute":
                raise
            log.info("%s; computing the prompt here (kv_load_failure_policy recompute)", exc)
            self.kv_stats["recomputed"] += 1
            return None
        self.kv_stats["loaded"] += 1
        model, bs = self.engine.scheduler.model, self.config.kv_block_size
        return covered, model.state_from_kv(prompt_ids, covered, got.payload, self.config.kv_bytes_per_token, bs)

    # -- completions --------------------------------------------------------------------------------

    async def _read_json(self, request: Request) -> object:
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            raise _schema_error(["Unsupported Media Type: Only 'application/json' is allowed"])
        raw = await request.body()
        if not raw:  # FastAPI takes an empty body for a missing one
            raise _schema_error([_error("missing", (), "Field required", None)])
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise _schema_error([_error("json_invalid", (exc.pos,), "JSON decode error", {},
                                        error=exc.msg)]) from None
        except ValueError:  # not UTF-8, or an integer too long to read: FastAPI's own answer, as vLLM gives it
            raise HTTPException(400, "There was an error parsing the body") from None

    def _request_id(self, request: Request, body: dict[str, Any], prefix: str) -> str:
        rid = request.headers.get("x-request-id") or body.get("request_id")
        return f"{prefix}{rid if isinstance(rid, str) and rid else secrets.token_hex(8)}"

    def _parse(self, body: object, *, chat: bool) -> _Parsed:
        """Validate like vLLM, stage by stage (see the comment above :func:`_refused`)."""
        if isinstance(body, dict):
            _check_raw(body, chat=chat)
        bad_messages = _message_errors(body.get("messages")) if chat and isinstance(body, dict) else []
        try:
            # FastAPI validates a body as it would an object's attributes; so does vLLM, so the sim too.
            v = dict((_CHAT_REQUEST if chat else _COMPLETION_REQUEST).model_validate(body, from_attributes=True))
        except ValidationError as exc:
            errors: list[Mapping[str, Any] | str] = [*bad_messages, *exc.errors(include_url=False)]
            raise _schema_error(errors) from None
        if bad_messages:
            raise _schema_error(bad_messages)
        _refuse_unsupported(v)

        model = v["model"]
        if model is not None and model != self.model_name:
            raise _ApiError(f"The model `{model}` does not exist. Valid aliases: {self.model_name}.",
                            status=404, err_type="NotFoundError", param="model")
        role = "assistant"
        prompt: str | list[int]
        if chat:
            mt_param = "max_completion_tokens" if v["max_completion_tokens"] is not None else "max_tokens"
            max_tokens = v[mt_param]
            if not v["add_generation_prompt"] and v["messages"]:
                role = v["messages"][-1]["role"]
            prompt = render_chat(v["messages"], add_generation_prompt=v["add_generation_prompt"])
        else:
            mt_param = "max_tokens"
            max_tokens = v["max_tokens"]
            if max_tokens is None:
                max_tokens = _COMPLETION_DEFAULT_MAX_TOKENS
            prompt = self._completion_prompt(v["prompt"])
            if v["suffix"] is not None:  # the tiny model has no fill-in-the-middle rendering
                raise _ApiError("suffix is only supported for models with FIM completion rendering"
                                if isinstance(prompt, str) else
                                "suffix requires text prompt input for FIM completion rendering", param="suffix")
        max_len = self.config.max_model_len
        if max_tokens is not None and max_tokens > max_len:
            raise _refused(f"{mt_param}={max_tokens} cannot be greater than max_model_len={max_len}. Please "
                           "request fewer output tokens.", param=mt_param, value=max_tokens)
        prompt_ids = _prompt_tokens(prompt, max_len, functools.partial(self._encode, special=v["add_special_tokens"]))
        budget = max_len - len(prompt_ids)
        max_tokens = budget if max_tokens is None else min(max_tokens, budget)
        bias_ids = _token_keys(v["logit_bias"] or {})
        _check_sampling(v, max_tokens)
        _check_engine(v, bias_ids, prompt_ids, self.vocab_size)

        stop = v["stop"]
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        options = v["stream_options"]
        include_usage = options is not None and bool(options.include_usage)
        continuous_usage = include_usage and bool(options.continuous_usage_stats)
        spec = SamplingSpec(max_tokens=max_tokens, ignore_eos=v["ignore_eos"], stop=stops,
                            stop_token_ids=frozenset(v["stop_token_ids"] or ()),
                            include_stop_str_in_output=v["include_stop_str_in_output"], min_tokens=v["min_tokens"],
                            skip_special_tokens=v["skip_special_tokens"],
                            spaces_between_special_tokens=v["spaces_between_special_tokens"])
        return _Parsed(prompt_ids, spec, bool(v["stream"]), include_usage, continuous_usage,
                       bool(v["return_token_ids"]), role)

    def _encode(self, text: str, *, special: bool) -> list[int]:
        """Text → ids with the vocabulary served (chat text is the rendered template, roles included)."""
        return encode(text) if self.vocab is None else self.vocab.encode(text, add_special_tokens=special)

    @property
    def _root(self) -> str:
        """``root`` in /v1/models: where the tokenizer lives when it is a folder or file (routers load it)."""
        tok = self.config.tokenizer
        if tok in BUILTIN:
            return self.model_name
        path = Path(tok).expanduser().resolve()
        return str(path.parent if path.name == "tokenizer.json" else path)

    @staticmethod
    def _completion_prompt(prompt: str | list[Any]) -> str | list[int]:
        """The one prompt of a completion request: text or token ids (vLLM's schema has checked the types)."""
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            return prompt
        if not prompt:  # vLLM would answer with no choices at all; the sim serves one prompt per request
            raise _refused("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
        if len(prompt) > 1:
            raise _ApiError(f"the simulated worker takes one prompt per request, got {len(prompt)}; send "
                            "them as separate requests", param="prompt")
        only: str | list[int] = prompt[0]
        return only

    async def _completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def _chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, *, chat: bool) -> Response:
        try:
            body = await self._read_json(request)
            parsed = self._parse(body, chat=chat)
            assert isinstance(body, dict)
            if self.engine.draw_error():
                raise _engine_dead()
        except _ApiError as exc:
            return _error_response(exc)
        rid = self._request_id(request, body, "chatcmpl-" if chat else "cmpl-")
        created = int(self.clock.wall())
        kv_params = body.get("kv_transfer_params")
        kv: tuple[int, int] | None = None
        if isinstance(kv_params, dict) and (offer := KvOffer.of(kv_params)) is not None:
            try:
                kv = await self._load_kv(kv_params, offer, parsed.prompt_ids)
            except KvTransferError as exc:
                return _error_response(_ApiError(str(exc), status=502, err_type=KV_ERROR_TYPE, param=exc.kind))
        req = self.engine.submit(parsed.prompt_ids, parsed.spec, rid, kv=kv)
        release = functools.partial(self.engine.release, req)
        if parsed.stream:
            events = (self._chat_events if chat else self._completion_events)(req, parsed, rid, created)
            return _EventStream(events, release)
        try:
            outcome = await self._await_or_abort(request, req)
        except BaseException:
            release()
            raise
        if isinstance(outcome, RequestCut):
            return _Cut(outcome, release)
        if outcome is not None:
            err = _engine_dead() if outcome.status >= 500 else _ApiError(outcome.message)
        elif req.finish_reason == "abort":
            err = _ApiError("Client disconnected")
        else:
            build = self._chat_body if chat else self._completion_body
            answer = build(req, parsed, rid, created)
            if isinstance(kv_params, dict) and kv_params.get("do_remote_decode"):
                offer = self._offer_kv(request, parsed.prompt_ids)
                answer["kv_transfer_params"] = None if offer is None else offer.params()
            return _Released(answer, 200, release)
        return _Released(err.body(), err.status, release)

    async def _await_or_abort(self, request: Request, req: SimRequest) -> WorkerError | RequestCut | None:
        """Wait for ``req`` to finish; abort it in the engine if the client disconnects first."""

        async def watch_disconnect() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.engine.abort(req)

        async with asyncio.TaskGroup() as tg:
            watcher = tg.create_task(watch_disconnect())
            try:
                await req.wait_finished()
            except (WorkerError, RequestCut) as exc:
                return exc
            finally:
                watcher.cancel()
        return None

    # -- response bodies ----------------------------------------------------------------------------

    def _usage(self, req: SimRequest) -> dict[str, Any]:
        p, c = len(req.prompt_ids), len(req.output_ids)
        return {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c,
                "prompt_tokens_details": None, "completion_tokens_details": None}

    def _completion_body(self, req: SimRequest, p: _Parsed, rid: str, created: int) -> dict[str, Any]:
        rt = p.return_token_ids
        choice = {"index": 0, "text": req.output_text, "logprobs": None, "finish_reason": req.finish_reason,
                  "stop_reason": req.stop_reason, "token_ids": list(req.output_ids) if rt else None,
                  "prompt_logprobs": None, "prompt_token_ids": p.prompt_ids if rt else None,
                  "routed_experts": None}
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": [choice], "service_tier": None, "system_fingerprint": self.system_fingerprint,
                "usage": self._usage(req), "kv_transfer_params": None, "ec_transfer_params": None,
                "metrics": None}

    def _chat_body(self, req: SimRequest, p: _Parsed, rid: str, created: int) -> dict[str, Any]:
        rt = p.return_token_ids
        message = {"role": p.role, "content": req.output_text, "refusal": None, "annotations": None,
                   "audio": None, "function_call": None, "reasoning": None}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": req.finish_reason,
                  "stop_reason": req.stop_reason, "token_ids": list(req.output_ids) if rt else None,
                  "routed_experts": None}
        return {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": [choice], "service_tier": None, "system_fingerprint": self.system_fingerprint,
                "usage": self._usage(req), "prompt_logprobs": None,
                "prompt_token_ids": p.prompt_ids if rt else None, "prompt_text": None,
                "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}

    def _usage_event(self, rid: str, obj: str, created: int, prompt: int, completion: int) -> bytes:
        return (f'data: {{"id":{_enc(rid)},"object":"{obj}","created":{created},"model":{self._model_json},'
                f'"choices":[],{_usage_json(prompt, completion)},'
                f'"system_fingerprint":{self._fingerprint_json}}}\n\n').encode()

    async def _completion_events(self, req: SimRequest, p: _Parsed, rid: str,
                                 created: int) -> AsyncGenerator[bytes, None]:
        head = (f'data: {{"id":{_enc(rid)},"object":"text_completion","created":{created},'
                f'"model":{self._model_json},"choices":[{{"index":0,"text":')
        rt = p.return_token_ids
        prompt_json = _ids_json(p.prompt_ids) if rt else "null"
        n_prompt = len(p.prompt_ids)
        tail = f',"system_fingerprint":{self._fingerprint_json}' if not p.include_usage else ""
        try:
            while True:
                d = await req.next_output()
                fin = d.finish_reason
                parts = [head, _enc(d.text), ',"logprobs":null,"finish_reason":',
                         "null" if fin is None else f'"{fin}"', ',"stop_reason":',
                         "null" if d.stop_reason is None else _enc(d.stop_reason), ',"prompt_token_ids":',
                         prompt_json, ',"token_ids":', _ids_json(d.token_ids) if rt else "null", "}]"]
                prompt_json = "null"
                if p.continuous_usage:
                    parts += [",", _usage_json(n_prompt, d.num_output_tokens)]
                if fin is not None:
                    parts.append(tail)
                parts.append("}\n\n")
                yield "".join(parts).encode()
                if fin is not None:
                    break
            if p.include_usage:
                yield self._usage_event(rid, "text_completion", created, n_prompt, len(req.output_ids))
        except WorkerError as exc:
            yield _stream_error(exc)
        yield _DONE

    async def _chat_events(self, req: SimRequest, p: _Parsed, rid: str,
                           created: int) -> AsyncGenerator[bytes, None]:
        head = (f'data: {{"id":{_enc(rid)},"object":"chat.completion.chunk","created":{created},'
                f'"model":{self._model_json},"choices":[{{"index":0,"delta":')
        rt = p.return_token_ids
        n_prompt = len(p.prompt_ids)
        tail = f',"system_fingerprint":{self._fingerprint_json}' if not p.include_usage else ""
        first = True
        try:
            while True:
                d = await req.next_output()
                if first:  # vLLM sends the role chunk when the first output arrives
                    usage = "," + _usage_json(n_prompt, 0, chat_chunk=True) if p.continuous_usage else ""
                    yield (f'{head}{{"role":{_enc(p.role)},"content":""}},"logprobs":null,'
                           f'"finish_reason":null}}]{usage},'
                           f'"prompt_token_ids":{_ids_json(p.prompt_ids) if rt else "null"},'
                           f'"prompt_text":null}}\n\n').encode()
                    first = False
                fin = d.finish_reason
                parts = [head, '{"content":', _enc(d.text), '},"logprobs":null,"finish_reason":']
                if fin is None:
                    parts.append("null")
                else:
                    parts += [f'"{fin}","stop_reason":',
                              "null" if d.stop_reason is None else _enc(d.stop_reason)]
                parts += [',"token_ids":', _ids_json(d.token_ids) if rt else "null", "}]"]
                if p.continuous_usage:
                    parts += [",", _usage_json(n_prompt, d.num_output_tokens, chat_chunk=True)]
                if fin is not None:
                    parts.append(tail)
                parts.append("}\n\n")
                yield "".join(parts).encode()
                if fin is not None:
                    break
            if p.include_usage:
                yield self._usage_event(rid, "chat.completion.chunk", created, n_prompt, len(req.output_ids))
        except WorkerError as exc:
            yield _stream_error(exc)
        yield _DONE


def create_app(config: SimConfig, *, admin_token: SecretStr | str | None = None, clock: Clock = SYSTEM_CLOCK,
               crash: Callable[[], None] = _crash_process) -> FastAPI:
    """The simulated worker's ASGI app (the engine runs in its lifespan; ``app.state.engine`` is it).

    ``admin_token`` defaults to :func:`~fleetward.fleet.config.admin_token_from_env`.
    """
    return SimWorker(config, admin_token=admin_token, clock=clock, crash=crash).app


class _Server(uvicorn.Server):
    """uvicorn's server, except that a signal which asked for a graceful shutdown is not raised again
    afterwards: a worker stopped by SIGTERM exits 0, which is what "stopped cleanly" means to a supervisor.
    Signal handlers only record (uvicorn's ``handle_exit``); a second Ctrl-C forces the exit."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m fleetward.sim.server",
        description="A simulated vLLM worker (OpenAI-compatible API, fault switches).")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--config-json", default=None, help="a SimConfig as JSON")
    ap.add_argument("--model-name", default=None, help="served model name (overrides the config's)")
    ap.add_argument("--faults-json", default=None, help="fault switches to start with, as POST /admin/faults "
                    "takes them (e.g. {\"crash_after_tokens\": 100})")
    ap.add_argument("--access-log", action="store_true", help="log every HTTP request")
    ap.add_argument("--log-level", default="info")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Serve one simulated worker until SIGTERM/SIGINT; return the exit code."""
    args = _parser().parse_args(argv)
    try:
        config = SimConfig.model_validate_json(args.config_json) if args.config_json else SimConfig()
        if args.model_name:
            config = SimConfig.model_validate({**config.model_dump(), "model_name": args.model_name})
    except ValidationError as exc:
        print(f"simworker: bad --config-json: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(stream=sys.stdout, level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    token_from_env = bool(os.environ.get("FLEETWARD_ADMIN_TOKEN"))
    worker = SimWorker(config, admin_token=admin_token_from_env())
    if args.faults_json:
        try:
            faults, *_ = worker._parse_faults(json.loads(args.faults_json))
        except (ValueError, _ApiError) as exc:
            print(f"simworker: bad --faults-json: {exc}", file=sys.stderr)
            return 2
        worker.engine.update_faults(faults)
    log.info("fleetward sim worker starting: model %r on http://%s:%d, pid %d, max_model_len %d, "
             "max_num_seqs %d, kv %d tokens, admin token %s", config.model_name, args.host, args.port,
             os.getpid(), config.max_model_len, config.max_num_seqs, config.kv_capacity_tokens,
             "from FLEETWARD_ADMIN_TOKEN" if token_from_env
             else "random (set FLEETWARD_ADMIN_TOKEN to use the admin endpoints)")
    server = _Server(uvicorn.Config(
        worker.app, host=args.host, port=args.port, log_config=None, log_level=args.log_level,
        access_log=args.access_log, timeout_graceful_shutdown=3, lifespan="on"))
    server.run()
    log.info("fleetward sim worker stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
