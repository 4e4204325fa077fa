"""The wire protocol of the simulated worker's completions and chat: vLLM 0.32's request schema and its error body.

vLLM 0.32 refuses a request at one of these stages, and the sim at the same ones, in the same order, with the
same status, type, param and message (the files named are under vllm/):

1. checks of the raw body (the ``mode="before"`` validators of entrypoints/openai/completion/protocol.py and
   chat_completion/protocol.py; pydantic runs the last defined first): 400 "BadRequestError";
2. the request schema (the fields of those models, lax as pydantic is by default, so "5" is a max_tokens
   and "yes" a stream), reported by entrypoints/serve/exception_handling/handlers/validation.py: 400
   "Bad Request", ``param`` the first error's location ("body.max_tokens");
3. the served model (404), then the prompt against the context (renderers/params.py TokenizeParams). A
   max_tokens beyond the context left is clamped to it (entrypoints/serve/utils/api_utils.py
   get_max_tokens), not refused; only a max_tokens over the whole context is;
4. the sampling parameters (sampling_params.py: SamplingParams.from_optional, then _verify_args);
5. what the engine checks against the model (SamplingParams.verify, v1/engine/input_processor.py).

The sim's own refusals (several choices or prompts in one stream, beam search) come after stage 2. Stages 1 and
2 are here (:func:`validated`); 3 to 5 in :mod:`.sampling`. Every refusal is an :class:`ApiError`, which
becomes vLLM's ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from starlette.exceptions import HTTPException
from starlette.requests import Request

from fleetward.fleet.errors import WorkerError
from fleetward.sim.engine import ENGINE_DEAD_MESSAGE

__all__ = ["ApiError", "engine_dead", "field_error", "read_json", "refused", "schema_error", "validated"]

_REPORTED_ERRORS = 10  # vLLM's validation message lists this many errors, then counts the rest
_ECHOED_CHARS = 200  # ... and echoes each value up to this many characters
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


class ApiError(WorkerError):
    """A request the worker refuses; becomes vLLM's error body (:meth:`body`)."""

    def __init__(self, message: str, *, status: int = 400, err_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message, status=status)
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.status}}


def engine_dead() -> ApiError:
    """The 500 a dead EngineCore gives."""
    return ApiError(ENGINE_DEAD_MESSAGE, status=500, err_type="InternalServerError")


def refused(message: str, *, param: str | None = None, value: object = None) -> ApiError:
    """A 400 worded as vLLM words its ``VLLMValidationError``: the parameter and the value it names are
    appended to the message (vllm/exceptions.py)."""
    named = [f"parameter={param}"] if param is not None else []
    if value is not None:
        named.append(f"value={value}")
    return ApiError(f"{message} ({', '.join(named)})" if named else message, param=param)


def field_error(kind: str, loc: tuple[str | int, ...], msg: str, value: object, **ctx: object) -> dict[str, Any]:
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


def schema_error(errors: Sequence[Mapping[str, Any] | str]) -> ApiError:
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
    return ApiError(f"{len(errors)} validation {label}:\n" + "\n".join(lines), err_type="Bad Request",
                    param=None if isinstance(first, str) else _location(first["loc"]))


def _check_raw(body: dict[str, Any], *, chat: bool) -> None:
    """Stage 1: vLLM's checks of the raw body, in its order (which differs between the two endpoints)."""
    def stream_options() -> None:
        if body.get("stream_options") and not body.get("stream"):
            raise refused("Stream options can only be defined when `stream=True`.", param="stream_options")

    def logprobs() -> None:
        count = "top_logprobs" if chat else "logprobs"
        for key in ("prompt_logprobs", count):
            value = body.get(key)
            if value is not None and not isinstance(value, (int, float)):
                raise refused(f"`{key}` must be an integer.", param=key, value=value)
        if (prompt := body.get("prompt_logprobs")) is not None:
            if body.get("stream") and (prompt > 0 or prompt == -1):
                raise refused("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
            if prompt < 0 and prompt != -1:
                raise refused("`prompt_logprobs` must be a positive value or -1.", param="prompt_logprobs",
                              value=prompt)
        if (value := body.get(count)) is not None:
            if value < 0 and value != -1:
                raise refused(f"`{count}` must be a positive value or -1.", param=count, value=value)
            if chat and (value == -1 or value > 0) and not body.get("logprobs"):
                raise refused("when using `top_logprobs`, `logprobs` must be set to true.", param=count)

    if chat:
        if body.get("continue_final_message") and body.get("add_generation_prompt"):
            raise refused("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        logprobs()
        stream_options()
    else:
        if body.get("prompt") is None or body.get("prompt") == "":
            raise refused("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
        stream_options()
        logprobs()
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise refused("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    if isinstance(salt, str) and (len(salt) > 128 or not _CACHE_SALT_FORBIDDEN.isdisjoint(salt)):
        raise refused("Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', "
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
            errors.append(field_error("dict_type", at, "Input should be a valid dictionary", m))
            continue
        role, content = m.get("role"), m.get("content")
        is_content = isinstance(content, (str, list, dict))  # a JSON object is iterable, so vLLM takes it
        if isinstance(role, str) and ("content" not in m or is_content or (content is None and role == "assistant")):
            continue
        if "content" not in m:
            errors.append(field_error("missing", (*at, "content"), "Field required", m))
        elif not is_content:
            errors.append(field_error("string_type", (*at, "content"), "Input should be a valid string", content))
        elif "role" not in m:
            errors.append(field_error("missing", (*at, "role"), "Field required", m))
        else:
            errors.append(field_error("literal_error", (*at, "role"), "Input should be 'developer'", role,
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



async def read_json(request: Request) -> object:
    """The request's JSON body, refused as FastAPI (and so vLLM) refuses one it cannot read."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise schema_error(["Unsupported Media Type: Only 'application/json' is allowed"])
    raw = await request.body()
    if not raw:  # FastAPI takes an empty body for a missing one
        raise schema_error([field_error("missing", (), "Field required", None)])
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise schema_error([field_error("json_invalid", (exc.pos,), "JSON decode error", {},
                                        error=exc.msg)]) from None
    except ValueError:  # not UTF-8, or an integer too long to read: FastAPI's own answer, as vLLM gives it
        raise HTTPException(400, "There was an error parsing the body") from None


def validated(body: object, *, chat: bool) -> dict[str, Any]:
    """Stages 1 and 2 (module docstring): the request's fields, with vLLM's types and defaults."""
    if isinstance(body, dict):
        _check_raw(body, chat=chat)
    bad_messages = _message_errors(body.get("messages")) if chat and isinstance(body, dict) else []
    try:
        # FastAPI validates a body as it would an object's attributes; so does vLLM, so the sim too.
        v = dict((_CHAT_REQUEST if chat else _COMPLETION_REQUEST).model_validate(body, from_attributes=True))
    except ValidationError as exc:
        errors: list[Mapping[str, Any] | str] = [*bad_messages, *exc.errors(include_url=False)]
        raise schema_error(errors) from None
    if bad_messages:
        raise schema_error(bad_messages)
    return v
