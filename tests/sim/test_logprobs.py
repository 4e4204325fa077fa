"""Logprobs, echo and streams of several choices on the simulated worker (sim/logprobs.py, sim/sse.py), against
what vLLM 0.32 answered.

The recordings in tests/data/vllm-0.32 come from real vLLM on the tiny model (the bpe vocabulary the sim serves
too), each for the request listed here. The sim must answer with the same keys in the same order, the same
types and the same number of tokens; its numbers are its own. A map keyed by token (text or id) is compared by
the shape of its values. Then what clients read off the numbers: the token a greedy request gets is the most
likely one, logprobs are the same on every asking, a prompt's echo is its text, and lm-eval-harness's
loglikelihood request reads a continuation's log-likelihood that does not depend on what follows it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from testkit import asgi, instant_sim, sse

DATA = Path(__file__).parents[1] / "data" / "vllm-0.32"
FAST = instant_sim(model_name="tiny", tokenizer="bpe")  # the vocabulary of the recordings' model
CHAT = [{"role": "user", "content": "hi"}]
ECHOED = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
_MAPS = ("top_logprobs", "prompt_logprobs")  # keyed by token: their values' shapes are compared, not their keys

# recording -> the request that made it
RECORDED: dict[str, tuple[str, dict[str, Any]]] = {
    "completion_logprobs.json": ("/v1/completions", {"prompt": "Hello", "max_tokens": 3, "logprobs": 2,
                                                     "temperature": 0}),
    "completion_greedy_logprobs.json": ("/v1/completions", {"prompt": [40, 41, 42, 43], "max_tokens": 4,
                                                            "logprobs": 0, "temperature": 0}),
    "completion_echo_logprobs.json": ("/v1/completions", {"prompt": [[40, 41, 42, 43], [44, 45, 46]],
                                                          "max_tokens": 1, "logprobs": 1, "echo": True,
                                                          "temperature": 0, "seed": 1234}),
    "completion_echo.json": ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "echo": True,
                                                 "temperature": 0}),
    "completion_prompt_logprobs.json": ("/v1/completions", {"prompt": "Hello", "max_tokens": 2,
                                                            "prompt_logprobs": 1, "temperature": 0}),
    "chat_logprobs.json": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "logprobs": True,
                                                    "top_logprobs": 2, "temperature": 0}),
    "chat_echo.json": ("/v1/chat/completions", {"messages": ECHOED, "add_generation_prompt": False, "echo": True,
                                                "max_tokens": 2, "temperature": 0}),
    "completion_logprobs_stream.sse": ("/v1/completions", {"prompt": "Hello", "max_tokens": 3, "logprobs": 2,
                                                           "temperature": 0, "stream": True}),
    "completion_echo_stream.sse": ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "echo": True,
                                                       "temperature": 0, "stream": True}),
    "chat_logprobs_stream.sse": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "logprobs": True,
                                                          "top_logprobs": 2, "temperature": 0, "stream": True}),
    "chat_echo_stream.sse": ("/v1/chat/completions", {"messages": ECHOED, "add_generation_prompt": False,
                                                      "echo": True, "max_tokens": 2, "temperature": 0,
                                                      "stream": True}),
}


# streams of several choices (n, a list of prompts): recording -> the request
FANNED: dict[str, tuple[str, dict[str, Any]]] = {
    "completion_n2_stream.sse": ("/v1/completions", {"prompt": "Hello", "max_tokens": 3, "n": 2, "temperature": 1.0,
                                                     "seed": 5, "stream": True}),
    "completion_batch_stream.sse": ("/v1/completions", {"prompt": ["Hello", "Bye"], "max_tokens": 3,
                                                        "temperature": 0, "stream": True,
                                                        "stream_options": {"include_usage": True}}),
    "chat_n2_stream.sse": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "n": 2, "temperature": 1.0,
                                                    "seed": 5, "stream": True,
                                                    "stream_options": {"include_usage": True}}),
}


def shape(value: Any, key: str | None = None) -> Any:
    """Keys (in order) and types, recursively; every item of a list counts (so do tokens), but a list of
    integers is one type; a map keyed by token is the set of its values' shapes."""
    if isinstance(value, dict):
        if key in _MAPS:
            return sorted({json.dumps(shape(v)) for v in value.values()})
        return {k: shape(v, k) for k, v in value.items()}
    if isinstance(value, list):
        if all(type(v) is int for v in value):  # ids, bytes, offsets (any number: their count is the text's)
            return ["int"]
        return [shape(v, key) for v in value]
    if isinstance(value, float):
        return "number"
    return type(value).__name__


def events(text: str) -> list[Any]:
    """A stream's events with the engine's pacing taken out: the chunks that carry text or tokens, in order."""
    return [e for e in sse(text) if e == "[DONE]" or e["choices"] or "usage" in e]


@pytest.mark.parametrize("name", list(RECORDED))
async def test_logprobs_and_echo_answer_in_vllms_shape(name: str) -> None:
    path, body = RECORDED[name]
    async with asgi(FAST) as (client, _):
        r = await client.post(path, json={"model": "tiny", **body})
    assert r.status_code == 200, r.text
    recorded = (DATA / name).read_text()
    if name.endswith(".sse"):
        ours, theirs = events(r.text), events(recorded)
    else:
        ours, theirs = r.json(), json.loads(recorded)
    assert json.dumps(shape(ours), indent=1) == json.dumps(shape(theirs), indent=1)


def by_choice(events: list[Any]) -> dict[str, list[Any]]:
    """A stream of several choices as each choice's chunks (their shapes, in order), then what ends it: the
    engine interleaves the choices as it pleases."""
    out: dict[str, list[Any]] = {}
    for e in events:
        key = "end" if e == "[DONE]" or not e["choices"] else str(e["choices"][0]["index"])
        out.setdefault(key, []).append(shape(e))
    return out


@pytest.mark.parametrize("name", list(FANNED))
async def test_several_choices_stream_side_by_side_in_vllms_shape(name: str) -> None:
    """Each choice's chunks as vLLM writes them (a chat's role chunks first, for every choice), the fingerprint
    on each choice's last chunk or on the usage chunk, the usage of every choice (each prompt counted once);
    and each choice's text is what the same request answers whole."""
    path, body = FANNED[name]
    async with asgi(FAST) as (client, _):
        r = await client.post(path, json={"model": "tiny", **body})
        whole = (await client.post(path, json={"model": "tiny", **body, "stream": False,
                                               "stream_options": None})).json()
    assert r.status_code == 200, r.text
    ours, theirs = events(r.text), events((DATA / name).read_text())
    assert json.dumps(by_choice(ours), indent=1) == json.dumps(by_choice(theirs), indent=1)
    if "chat" in name:
        assert [e["choices"][0]["delta"].get("role") for e in ours[:2]] == ["assistant", "assistant"]
    texts: dict[int, str] = {}
    for e in ours[:-1]:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"]["content"] if "chat" in name else c["text"])
    assert [texts[k] for k in sorted(texts)] == [
        c["message"]["content"] if "chat" in name else c["text"] for c in whole["choices"]]
    if "usage" in whole:
        usage = {k: v for k, v in whole["usage"].items() if v is not None}
        assert [e["usage"] for e in ours if e != "[DONE]" and e.get("usage")] in ([], [usage])


async def test_the_greedy_token_is_the_most_likely_and_every_asking_reads_the_same() -> None:
    body = {"model": "tiny", "prompt": "The same prompt", "max_tokens": 12, "logprobs": 5, "temperature": 0,
            "ignore_eos": True}
    async with asgi(FAST) as (client, _):
        first = (await client.post("/v1/completions", json=body)).json()
        again = (await client.post("/v1/completions", json=body)).json()
        chat = (await client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": CHAT, "max_tokens": 6, "logprobs": True, "top_logprobs": 3,
            "temperature": 0})).json()
    assert first["choices"] == again["choices"]
    lp = first["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 12
    for logprob, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        # keyed by text: where an alternative reads as the token does ("" for part of a character), it takes
        # the token's place, as in vLLM
        assert logprob < 0 and logprob >= max(top.values()) and len(top) <= 6
    assert "".join(lp["tokens"]) == first["choices"][0]["text"] or "" in lp["tokens"]
    for tok in chat["choices"][0]["logprobs"]["content"]:
        values = [t["logprob"] for t in tok["top_logprobs"]]
        assert len(values) == 3 and values == sorted(values, reverse=True) and tok["logprob"] == values[0]
        assert tok["bytes"] == list(tok["token"].encode())


async def test_lm_eval_harness_reads_a_continuations_log_likelihood_from_an_echo() -> None:
    """lm-eval-harness's loglikelihood request (echo, logprobs 1, max_tokens 1) for context + continuation:
    the continuation's logprobs are the ones it has after the context whatever comes after it, the prompt's
    first token has none, the text is the prompt's with one token more, and a continuation made of the greedy
    tokens reads as greedy (lm-eval's is_greedy)."""
    async with asgi(FAST) as (client, _):
        greedy = (await client.post("/v1/completions", json={
            "model": "tiny", "prompt": "Paris is", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})).json()["choices"][0]
        context = greedy["prompt_token_ids"]
        cont, other = greedy["token_ids"], [40, 41, 42]
        r = await client.post("/v1/completions", json={
            "model": "tiny", "prompt": [context + cont, context + other, context + cont + [50]], "max_tokens": 1,
            "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    n = len(context)

    def read(choice: dict[str, Any], length: int) -> tuple[float, bool]:  # lm-eval's parse_logprobs
        lp = choice["logprobs"]
        logprobs = lp["token_logprobs"][n:n + length]
        tops = lp["top_logprobs"][n:n + length]
        return sum(logprobs), all(t == max(top.values()) for t, top in zip(logprobs, tops, strict=True))

    assert choices[0]["logprobs"]["token_logprobs"][0] is None
    assert len(choices[0]["logprobs"]["tokens"]) == n + 3 + 1
    mine, is_greedy = read(choices[0], 3)
    theirs, other_greedy = read(choices[1], 3)
    assert is_greedy and not other_greedy and mine > theirs
    assert math.isclose(read(choices[2], 3)[0], mine), "what follows a continuation changes nothing before it"
    assert choices[0]["text"].startswith("Paris is" + greedy["text"])  # the prompt's text, then one token more
    assert choices[1]["prompt_logprobs"][0] is None and len(choices[1]["prompt_logprobs"]) == n + 3


async def test_echo_puts_the_prompt_or_the_last_message_before_the_answer() -> None:
    async with asgi(FAST) as (client, _):
        plain = (await client.post("/v1/completions", json={
            "model": "tiny", "prompt": "Hello there", "max_tokens": 4, "temperature": 0})).json()
        echoed = (await client.post("/v1/completions", json={
            "model": "tiny", "prompt": "Hello there", "max_tokens": 4, "temperature": 0, "echo": True})).json()
        only = (await client.post("/v1/completions", json={
            "model": "tiny", "prompt": "Hello there", "max_tokens": 0, "echo": True, "logprobs": 1})).json()
        chat = (await client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": ECHOED, "add_generation_prompt": False, "echo": True, "max_tokens": 3,
            "temperature": 0})).json()
        alone = (await client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": ECHOED, "add_generation_prompt": False, "max_tokens": 3,
            "temperature": 0})).json()
    assert echoed["choices"][0]["text"] == "Hello there" + plain["choices"][0]["text"]
    assert only["choices"][0]["text"] == "Hello there" and only["usage"]["completion_tokens"] == 1
    assert "".join(only["choices"][0]["logprobs"]["tokens"]) == "Hello there"
    assert chat["choices"][0]["message"]["content"] == "Sure" + alone["choices"][0]["message"]["content"]
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


# vLLM 0.32's answers to logprobs it will not give (recorded from the tiny model, 4,096 ids)
REFUSED = [
    ("/v1/completions", {"logprobs": 21}, "Requested sample logprobs of 21, which is greater than max allowed: 20 "
                                          "(parameter=logprobs, value=21)"),
    ("/v1/completions", {"logprobs": -1}, "Requested sample logprobs of 4096, which is greater than max allowed: 20 "
                                          "(parameter=logprobs, value=4096)"),
    ("/v1/completions", {"logprobs": -2}, "`logprobs` must be a positive value or -1. (parameter=logprobs, "
                                          "value=-2)"),
    ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "`prompt_logprobs` are not available when "
                                                                "`stream=True`. (parameter=prompt_logprobs)"),
    ("/v1/completions", {"prompt_logprobs": 21}, "Requested prompt logprobs of 21, which is greater than max "
                                                 "allowed: 20 (parameter=prompt_logprobs, value=21)"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "when using `top_logprobs`, `logprobs` must be set to true. "
                                                  "(parameter=top_logprobs)"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "Requested sample logprobs of 21, which is "
                                                                     "greater than max allowed: 20 "
                                                                     "(parameter=logprobs, value=21)"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -2}, "`top_logprobs` must be a positive value or "
                                                                     "-1. (parameter=top_logprobs, value=-2)"),
]


@pytest.mark.parametrize(("path", "extra", "message"), REFUSED)
async def test_logprobs_vllm_will_not_give_are_refused_as_vllm_refuses_them(path: str, extra: dict[str, Any],
                                                                            message: str) -> None:
    body = {"model": "tiny", "max_tokens": 2, **({"messages": CHAT} if "chat" in path else {"prompt": "Hello"}),
            **extra}
    async with asgi(FAST) as (client, _):
        r = await client.post(path, json=body)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == message
