"""Bad input to the simulated worker is refused as vLLM 0.32 refuses it: the status, the error type and
the parameter vLLM names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from testkit import (
    asgi,
    instant_sim,
    sse,
    vllm_error,
)

from fleetward.fleet.config import SimConfig
from fleetward.sim.model import SimModel
from fleetward.sim.server import SimWorker

DATA = Path(__file__).parents[1] / "data" / "vllm-0.32"
MODEL = "sim-test"
FAST = instant_sim(model_name=MODEL)
SIM = SimModel(FAST.seed, FAST.eos_probability)


# -- bad input ---------------------------------------------------------------------------------------------------
#
# What vLLM 0.32 refuses, and how, is read off its source (vllm/entrypoints/openai/*/protocol.py, the exception
# handlers in vllm/entrypoints/serve/exception_handling/, renderers/params.py, sampling_params.py,
# v1/engine/input_processor.py); the expected messages below are the ones it answers, verbatim.


SMALL = SimConfig(**{**FAST.model_dump(), "max_model_len": 64})


async def post(path: str, body: Any, config: SimConfig = SMALL) -> tuple[httpx.Response, SimWorker]:
    """``body`` posted to a fresh in-process worker (bytes as they are, anything else as JSON)."""
    async with asgi(config) as (c, worker):
        if isinstance(body, bytes):
            r = await c.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = await c.post(path, json=body)
    return r, worker


@pytest.mark.parametrize("path, body, status, err_type, param, message", [
    ("/v1/completions", b'{"prompt": ', 400, "Bad Request", "body.11", "JSON decode error"),
    ("/v1/completions", b"", 400, "Bad Request", "body", "'type': 'missing', 'loc': 'body'"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "NotFoundError", "model",
     f"The model `nope` does not exist. Valid aliases: {MODEL}."),
    ("/v1/chat/completions", {"model": "nope", "messages": []}, 404, "NotFoundError", "model",
     f"The model `nope` does not exist. Valid aliases: {MODEL}."),
    ("/v1/completions", {"prompt": [5, 400]}, 400, "BadRequestError", None, "Token id 400 is out of vocabulary"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "BadRequestError", "max_tokens",
     "max_tokens must be at least 1, got -1."),
    ("/v1/completions", {"max_tokens": 3}, 400, "BadRequestError", "prompt",
     "Either prompt or prompt_embeds must be provided and non-empty."),
    ("/v1/completions", {"prompt": "x", "n": 2, "temperature": 0}, 400, "BadRequestError", None,
     "n must be 1 when using greedy sampling, got 2."),
    ("/v1/chat/completions", {"model": MODEL}, 400, "Bad Request", "body.messages", "Field required"),
])
async def test_bad_requests_get_vllm_like_errors(path: str, body: Any, status: int, err_type: str,
                                                 param: str | None, message: str) -> None:
    r, worker = await post(path, body)
    error = vllm_error(r)
    assert (r.status_code, error["type"], error["param"]) == (status, err_type, param)
    assert message in error["message"]
    assert worker.engine.stats.generation_tokens == 0


def _schema(*errors: str) -> str:
    """The message of vLLM's validation handler for these errors (each as ``str`` of the error dict)."""
    return f"{len(errors)} validation error{'s' if len(errors) > 1 else ''}:\n" + "\n".join(f"  {e}" for e in errors)


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"prompt": "x", "max_tokens": "five"}, "body.max_tokens", _schema(
        "{'type': 'int_parsing', 'loc': 'body.max_tokens', 'msg': 'Input should be a valid integer, unable to "
        "parse string as an integer', 'input': 'five'}")),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5.5}, "body.max_tokens", _schema(
        "{'type': 'int_from_float', 'loc': 'body.max_tokens', 'msg': 'Input should be a valid integer, got a "
        "number with a fractional part', 'input': '5.5'}")),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "body.temperature", _schema(
        "{'type': 'float_parsing', 'loc': 'body.temperature', 'msg': 'Input should be a valid number, unable to "
        "parse string as a number', 'input': 'hot'}")),
    ("/v1/completions", {"prompt": "x", "stream": "maybe"}, "body.stream", _schema(
        "{'type': 'bool_parsing', 'loc': 'body.stream', 'msg': 'Input should be a valid boolean, unable to "
        "interpret input', 'input': 'maybe'}")),
    ("/v1/completions", {"prompt": 5}, "body.prompt", _schema(
        "{'type': 'list_type', 'loc': 'body.prompt', 'msg': 'Input should be a valid list', 'input': '5'}",
        "{'type': 'list_type', 'loc': 'body.prompt', 'msg': 'Input should be a valid list', 'input': '5'}",
        "{'type': 'string_type', 'loc': 'body.prompt', 'msg': 'Input should be a valid string', 'input': '5'}",
        "{'type': 'list_type', 'loc': 'body.prompt', 'msg': 'Input should be a valid list', 'input': '5'}")),
    ("/v1/completions", {"prompt": "x", "user": 5, "min_tokens": None}, "body.user", _schema(
        "{'type': 'string_type', 'loc': 'body.user', 'msg': 'Input should be a valid string', 'input': '5'}",
        "{'type': 'int_type', 'loc': 'body.min_tokens', 'msg': 'Input should be a valid integer', 'input': 'None'}")),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "body.stop", _schema(
        "{'type': 'string_type', 'loc': 'body.stop', 'msg': 'Input should be a valid string', 'input': '<list of "
        "5 items>'}",
        "{'type': 'too_long', 'loc': 'body.stop', 'msg': 'List should have at most 4 items after validation, not "
        "5', 'input': '<list of 5 items>', 'ctx': {'field_type': 'List', 'max_length': 4, 'actual_length': 5}}")),
    ("/v1/chat/completions", {"messages": "hi"}, "body.messages", _schema(
        "{'type': 'list_type', 'loc': 'body.messages', 'msg': 'Input should be a valid list', 'input': 'hi'}")),
    ("/v1/completions", [1, 2], "body", _schema(
        "{'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be a valid dictionary or object "
        "to extract fields from', 'input': '<list of 2 items>'}")),
])
async def test_a_wrong_type_is_refused_with_the_validation_errors_vllm_lists(path: str, body: Any, param: str,
                                                                            message: str) -> None:
    r, worker = await post(path, body)
    error = vllm_error(r)
    assert (r.status_code, error["type"], error["param"], error["message"]) == (400, "Bad Request", param, message)
    assert worker.engine.stats.generation_tokens == 0


async def test_what_vllm_coerces_or_accepts_is_served_too() -> None:
    """vLLM's request models are lax: "5" is a max_tokens and "yes" a stream. Chat messages may have any role
    and no content (the tiny model's template renders them), and an assistant's content may be null."""
    async with asgi(FAST) as (c, _):
        r = await c.post("/v1/completions", json={"prompt": [40, 41], "max_tokens": "5", "ignore_eos": "yes"})
        assert (r.status_code, r.json()["usage"]["completion_tokens"]) == (200, 5)
        streamed = await c.post("/v1/completions", json={"prompt": [40, 41], "max_tokens": 2, "stream": "yes"})
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = sse(streamed.text)
        assert (events[-2]["choices"][0]["finish_reason"], events[-1]) == ("length", "[DONE]")
        chat = await c.post("/v1/chat/completions", json={"max_tokens": 3, "messages": [
            {"role": "wizard", "content": "hi"}, {"role": "user"}, {"role": "assistant", "content": None}]})
        assert chat.status_code == 200, chat.text


@pytest.mark.parametrize("messages, param, first", [
    ([{"role": "user", "content": None}], "body.messages.0.ChatCompletionDeveloperMessageParam.content",
     "{'type': 'string_type', 'loc': 'body.messages.0.ChatCompletionDeveloperMessageParam.content', 'msg': "
     "'Input should be a valid string', 'input': 'None'}"),
    ([{"role": "wizard", "content": 5}], "body.messages.0.ChatCompletionDeveloperMessageParam.content",
     "{'type': 'string_type', 'loc': 'body.messages.0.ChatCompletionDeveloperMessageParam.content', 'msg': "
     "'Input should be a valid string', 'input': '5'}"),
    ([{"content": "hi"}], "body.messages.0.ChatCompletionDeveloperMessageParam.role",
     "{'type': 'missing', 'loc': 'body.messages.0.ChatCompletionDeveloperMessageParam.role', 'msg': "
     "'Field required', 'input': '<dict of 1 items>'}"),
    ([{"role": 5, "content": "hi"}], "body.messages.0.ChatCompletionDeveloperMessageParam.role",
     "{'type': 'literal_error', 'loc': 'body.messages.0.ChatCompletionDeveloperMessageParam.role', 'msg': "
     "\"Input should be 'developer'\", 'input': '5', 'ctx': {'expected': \"'developer'\"}}"),
    ([{"role": "user", "content": "hi"}, "hi"], "body.messages.1.ChatCompletionDeveloperMessageParam",
     "{'type': 'dict_type', 'loc': 'body.messages.1.ChatCompletionDeveloperMessageParam', 'msg': "
     "'Input should be a valid dictionary', 'input': 'hi'}"),
])
async def test_a_malformed_chat_message_is_refused_naming_the_field_vllm_names(messages: list[Any], param: str,
                                                                              first: str) -> None:
    r, _ = await post("/v1/chat/completions", {"messages": messages})
    error = vllm_error(r)
    assert (r.status_code, error["type"], error["param"]) == (400, "Bad Request", param)
    assert error["message"].split("\n")[1] == f"  {first}"


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 65}, "max_tokens",
     "max_tokens=65 cannot be greater than max_model_len=64. Please request fewer output tokens. "
     "(parameter=max_tokens, value=65)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 65},
     "max_completion_tokens", "max_completion_tokens=65 cannot be greater than max_model_len=64. Please request "
     "fewer output tokens. (parameter=max_completion_tokens, value=65)"),
    ("/v1/completions", {"prompt": [5] * 66}, "input_tokens",
     "This model's maximum context length is 64 tokens. However, your prompt contains 66 input tokens, which "
     "exceeds this limit even without any output tokens. Please reduce the length of the input prompt. "
     "(parameter=input_tokens, value=66)"),
    # A text prompt is tokenized only up to one token past the context, so vLLM says "at least".
    ("/v1/completions", {"prompt": "x" * 100}, "input_tokens",
     "This model's maximum context length is 64 tokens. However, your prompt contains at least 65 input tokens, "
     "which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. "
     "(parameter=input_tokens, value=65)"),
    # ... and one over 5 characters a token (the tiny model's longest vocabulary entry, "<unk>") is not tokenized.
    ("/v1/completions", {"prompt": "x" * 321}, "input_text",
     "This model's maximum context length is 64 tokens. However, your prompt contains 321 characters (more than "
     "320 characters, which is the upper bound for 64 input tokens). Please reduce the length of the input "
     "prompt. (parameter=input_text, value=321)"),
    ("/v1/completions", {"prompt": [5] * 64}, "max_tokens",
     "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"),
])
async def test_a_request_over_the_context_is_refused_naming_the_numbers(path: str, body: dict[str, Any],
                                                                        param: str, message: str) -> None:
    r, _ = await post(path, body)
    error = vllm_error(r)
    assert (r.status_code, error["type"], error["param"], error["message"]) == (400, "BadRequestError", param,
                                                                                message)


async def test_max_tokens_is_clamped_to_the_context_left() -> None:
    # vLLM 0.32 refuses only a max_tokens over max_model_len itself; prompt + max_tokens over the context is
    # clamped (vllm/entrypoints/serve/utils/api_utils.py get_max_tokens).
    async with asgi(SMALL) as (c, _):
        r = await c.post("/v1/completions", json={"prompt": [5] * 60, "max_tokens": 10})
    assert (r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["finish_reason"]) == (4, "length")


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"prompt": ""}, "prompt",
     "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)"),
    # vLLM checks the raw body before its schema, so this is what it says about a bad max_tokens too.
    ("/v1/completions", {"prompt": "", "max_tokens": "five"}, "prompt",
     "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options",
     "Stream options can only be defined when `stream=True`. (parameter=stream_options)"),
    ("/v1/chat/completions", {"messages": [], "continue_final_message": True, "add_generation_prompt": True}, None,
     "Cannot set both `continue_final_message` and `add_generation_prompt` to True."),
    ("/v1/completions", {"prompt": "x", "cache_salt": ""}, "cache_salt",
     "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)"),
    ("/v1/completions", {"prompt": "x", "logprobs": "many"}, "logprobs",
     "`logprobs` must be an integer. (parameter=logprobs, value=many)"),
])
async def test_what_vllm_checks_before_its_schema_is_a_bad_request_error_naming_the_parameter(
        path: str, body: dict[str, Any], param: str | None, message: str) -> None:
    r, _ = await post(path, body)
    error = vllm_error(r)
    assert (r.status_code, error["type"], error["param"], error["message"]) == (400, "BadRequestError", param,
                                                                                message)


@pytest.mark.parametrize("body, param, message", [
    ({"n": 0}, None, "n must be at least 1, got 0."),
    ({"presence_penalty": 3}, None, "presence_penalty must be in [-2, 2], got 3.0."),
    ({"repetition_penalty": 0}, None, "repetition_penalty must be greater than zero, got 0.0."),
    ({"temperature": -1}, "temperature", "temperature must be non-negative, got -1.0. (parameter=temperature, "
     "value=-1.0)"),
    ({"temperature": 2.5}, "temperature", "temperature must be in [0, 2], got 2.5. (parameter=temperature, "
     "value=2.5)"),
    ({"top_p": 0}, "top_p", "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)"),
    ({"top_k": -2}, None, "top_k must be 0 (disable), or at least 1, got -2."),
    ({"min_p": 1.5}, None, "min_p must be in [0, 1], got 1.5."),
    ({"min_tokens": -1}, None, "min_tokens must be greater than or equal to 0, got -1."),
    ({"min_tokens": 9, "max_tokens": 8}, None, "min_tokens must be less than or equal to max_tokens=8, got 9."),
    ({"stop": ["a", ""]}, None, "stop cannot contain an empty string."),
    ({"bad_words": [""]}, None, "bad_words cannot contain an empty string. Got bad_words=['']"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "logit_bias contains key(s) that cannot be converted to integer "
     "token IDs: ['x'] (parameter=logit_bias, value=['x'])"),
])
async def test_sampling_parameters_out_of_range_are_refused_as_vllm_refuses_them(
        body: dict[str, Any], param: str | None, message: str) -> None:
    r, _ = await post("/v1/completions", {"prompt": "x", **body})
    error = vllm_error(r)
    assert (r.status_code, error["type"], error["param"], error["message"]) == (400, "BadRequestError", param,
                                                                                message)


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": "x", "suffix": "y"}, "suffix", "suffix is only supported for models with FIM completion rendering"),
    ({"prompt": [40], "suffix": "y"}, "suffix", "suffix requires text prompt input for FIM completion rendering"),
    ({"prompt": "x", "stop_token_ids": [2, 300]}, "stop_token_ids", "token_id(s) [300] in stop_token_ids contain "
     "out-of-vocab token ids. Vocabulary size: 259 (parameter=stop_token_ids, value=[300])"),
    ({"prompt": "x", "logit_bias": {"-1": 5}}, "logit_bias", "token_id(s) [-1] in logit_bias contain out-of-vocab "
     "token ids. Vocabulary size: 259 (parameter=logit_bias, value=[-1])"),
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids",
     "allowed_token_ids is not None and empty! (parameter=allowed_token_ids, value=[])"),
    ({"prompt": [""]}, None, "The decoder prompt cannot be empty"),
    ({"prompt": [[]]}, None, "The decoder prompt cannot be empty"),
])
async def test_what_the_model_cannot_take_is_refused_as_vllm_refuses_it_for_the_tiny_model(
        body: dict[str, Any], param: str | None, message: str) -> None:
    r, _ = await post("/v1/completions", body)
    error = vllm_error(r)
    assert (r.status_code, error["type"], error["param"], error["message"]) == (400, "BadRequestError", param,
                                                                                message)


async def test_unknown_routes_and_methods_answer_as_vllm_does_with_fastapis_detail() -> None:
    # vLLM registers its HTTPException handler for FastAPI's subclass, so the 404 and 405 of Starlette's routing
    # (Starlette's class) keep FastAPI's default body. The sim matches that, not the OpenAI error shape.
    async with asgi(FAST) as (c, _):
        missing = await c.post("/v1/nope", json={})
        wrong = await c.get("/v1/completions")
    assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
    assert (wrong.status_code, wrong.json(), wrong.headers["allow"]) == (405, {"detail": "Method Not Allowed"},
                                                                          "POST")
