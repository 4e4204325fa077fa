"""From a request's fields to what the engine runs: the prompt's token ids and a :class:`~.engine.SamplingSpec`.

Stages 3 to 5 of vLLM's refusals (the list is in :mod:`.protocol`): the served model and the prompt against
the context, the sampling parameters, then what the engine checks against the model; before them, what
vLLM serves and the sim does not. :func:`parse_request` runs every stage in vLLM's order.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fleetward.sim.engine import SamplingSpec
from fleetward.sim.logprobs import TOP_MAX
from fleetward.sim.protocol import ApiError, refused, validated
from fleetward.sim.servedmodel import ServedModel
from fleetward.sim.tokenizer import render_chat

__all__ = ["ParsedRequest", "parse_request"]

_COMPLETION_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default (also for an explicit null)
_SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy
_MAX_CHARS_PER_TOKEN = 5  # the tiny model's longest vocabulary entry ("<unk>"); vLLM bounds text prompts by it


@dataclass(slots=True)
class ParsedRequest:
    """A completion or chat request the worker accepted: what the engine runs and how the answer is shaped."""

    prompt_ids: list[int]
    spec: SamplingSpec
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    role: str = "assistant"
    # a completion's other prompts (it sent a list), each with its own budget: one choice each, after the first
    more: list[tuple[list[int], SamplingSpec]] = field(default_factory=list)
    n: int = 1  # choices per prompt (``n``), sampled: each with its own salt (SamplingSpec.salt)
    seed: int | None = None
    sampled: bool = False  # temperature above vLLM's epsilon (greedy otherwise)
    adapter: str | None = None  # the LoRA adapter it names (its answer's model), None: the base model
    # Logprobs (.logprobs): alternatives per generated token (completions' ``logprobs``, chat's ``top_logprobs``
    # when ``logprobs`` is true) and per prompt token (``prompt_logprobs``, else what ``echo`` asks for); None:
    # none at all.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    echo: bool = False  # the prompt (completions) or the last message's content (chat) comes before the answer
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (the engine still takes one step, as vLLM's)
    echo_text: str = ""  # chat: what echo puts before the answer

    def choices(self) -> list[tuple[list[int], SamplingSpec]]:
        """Every choice's prompt and spec, in vLLM's order: prompt by prompt, ``n`` choices each."""
        prompts = [(self.prompt_ids, self.spec), *self.more]
        return [(ids, spec if k == 0 else dataclasses.replace(spec, salt=salt(self.seed, k, sampled=self.sampled)))
                for ids, spec in prompts for k in range(self.n)]


def salt(seed: int | None, k: int, *, sampled: bool) -> int:
    """The salt of choice ``k`` of a request with ``seed`` (:attr:`SamplingSpec.salt`; 0: the model's own
    continuation). As in vLLM, choice ``k`` of a seeded sampled request is the request with seed ``seed + k``
    (its child request's), so a seeded sample depends on ``seed + k`` alone; an unseeded one is choice ``k``'s
    own draw, and an unseeded single choice is the model's continuation (the sim's samples are repeatable)."""
    if seed is None or not sampled:
        return k
    return ((seed + k) * 1_000_003 + 1) % (1 << 62) or 1


def parse_request(body: object, *, chat: bool, served: ServedModel) -> ParsedRequest:
    """Validate like vLLM, stage by stage (the list is in :mod:`.protocol`). A completion with a list of
    prompts is one request with a choice per prompt: every prompt is read and checked against the context
    first, then the sampling parameters, then each prompt against the model, as vLLM does."""
    v = validated(body, chat=chat)
    _refuse_unsupported(v)

    served.check(v["model"])
    role = "assistant"
    prompts: list[str | list[int]]
    echo_only = False
    if chat:
        mt_param = "max_completion_tokens" if v["max_completion_tokens"] is not None else "max_tokens"
        max_tokens = v[mt_param]
        if not v["add_generation_prompt"] and v["messages"]:
            role = v["messages"][-1]["role"]
        prompts = [render_chat(v["messages"], add_generation_prompt=v["add_generation_prompt"])]
    else:
        mt_param = "max_tokens"
        max_tokens = v["max_tokens"]
        if max_tokens is None:
            max_tokens = _COMPLETION_DEFAULT_MAX_TOKENS
        if v["echo"] and max_tokens == 0:  # vLLM runs it with one token and answers with the prompt alone
            echo_only, max_tokens = True, 1
        prompts = _completion_prompts(v["prompt"])
        if v["suffix"] is not None:  # the tiny model has no fill-in-the-middle rendering
            raise ApiError("suffix is only supported for models with FIM completion rendering"
                           if isinstance(prompts[0], str) else
                           "suffix requires text prompt input for FIM completion rendering", param="suffix")
    max_len = served.max_model_len
    if max_tokens is not None and max_tokens > max_len:
        raise refused(f"{mt_param}={max_tokens} cannot be greater than max_model_len={max_len}. Please "
                      "request fewer output tokens.", param=mt_param, value=max_tokens)
    encoder = functools.partial(served.encode, special=v["add_special_tokens"])
    all_ids = [_prompt_tokens(prompt, max_len, encoder) for prompt in prompts]
    budgets = [max_len - len(ids) if max_tokens is None else min(max_tokens, max_len - len(ids)) for ids in all_ids]
    bias_ids = _token_keys(v["logit_bias"] or {})
    _check_sampling(v, budgets[0])
    logprobs, prompt_logprobs = _logprobs_asked(v, chat=chat)
    _check_logprobs(logprobs, prompt_logprobs, served.vocab_size)  # the same for every prompt, so checked once
    for ids in all_ids:
        _check_engine(v, bias_ids, ids, served.vocab_size)

    stop = v["stop"]
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    options = v["stream_options"]
    include_usage = options is not None and bool(options.include_usage)
    continuous_usage = include_usage and bool(options.continuous_usage_stats)
    specs = [SamplingSpec(max_tokens=budget, ignore_eos=v["ignore_eos"], stop=stops,
                          stop_token_ids=frozenset(v["stop_token_ids"] or ()),
                          include_stop_str_in_output=v["include_stop_str_in_output"], min_tokens=v["min_tokens"],
                          skip_special_tokens=v["skip_special_tokens"],
                          spaces_between_special_tokens=v["spaces_between_special_tokens"],
                          start=served.start(v["model"])) for budget in budgets]
    sampled = (1.0 if v["temperature"] is None else v["temperature"]) >= _SAMPLING_EPS
    first = salt(v["seed"], 0, sampled=sampled)
    specs = [dataclasses.replace(spec, salt=first) for spec in specs] if first else specs
    return ParsedRequest(all_ids[0], specs[0], bool(v["stream"]), include_usage, continuous_usage,
                         bool(v["return_token_ids"]), role, more=list(zip(all_ids[1:], specs[1:], strict=True)),
                         n=v["n"] or 1, seed=v["seed"], sampled=sampled,
                         adapter=v["model"] if v["model"] in served.adapters else None,
                         logprobs=logprobs, prompt_logprobs=prompt_logprobs, echo=bool(v["echo"]),
                         echo_only=echo_only,
                         echo_text=_echoed_message(v["messages"], role) if chat and v["echo"] else "")


def _logprobs_asked(v: dict[str, Any], *, chat: bool) -> tuple[int | None, int | None]:
    """The logprobs a request asks for, per generated and per prompt token, as vLLM's ``to_sampling_params``
    reads them: chat's ``top_logprobs`` counts only with ``logprobs`` true; ``echo`` without
    ``prompt_logprobs`` asks for the prompt's too (chat: ``top_logprobs`` of them, even without ``logprobs``)."""
    sample = ((v["top_logprobs"] or 0) if v["logprobs"] else None) if chat else v["logprobs"]
    prompt = v["prompt_logprobs"]
    if prompt is None and v["echo"]:
        prompt = v["top_logprobs"] if chat else v["logprobs"]
    return sample, prompt


def _echoed_message(messages: list[Any], role: str) -> str:
    """What chat's ``echo`` puts before the answer: the last message's content where it has the answer's role."""
    last = messages[-1] if messages else None
    if not isinstance(last, dict) or last.get("role") != role:
        return ""
    content = last.get("content")
    if isinstance(content, list):
        return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def _completion_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """A completion request's prompts: text or token ids, or a list of those (vLLM's schema has checked the
    types)."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return [prompt]
    if not prompt:  # vLLM would answer with no choices at all
        raise refused("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
    return list(prompt)


def _refuse_unsupported(v: dict[str, Any]) -> None:
    """What vLLM serves and the sim does not: beam search."""
    if v.get("use_beam_search"):
        raise ApiError("use_beam_search is not supported by the simulated worker", param="use_beam_search")


def _prompt_tokens(prompt: str | list[int], max_len: int, encoder: Callable[[str], list[int]]) -> list[int]:
    """Stage 3: the prompt's token ids, refused as vLLM refuses a prompt over the context. vLLM tokenizes text
    only up to one token past the context (and not at all past a bound on characters), so for text it can
    only say "at least"."""
    if isinstance(prompt, list):
        ids, count = prompt, len(prompt)
    else:
        if len(prompt) > max_len * _MAX_CHARS_PER_TOKEN:
            raise refused(f"This model's maximum context length is {max_len} tokens. However, your prompt "
                          f"contains {len(prompt)} characters (more than {max_len * _MAX_CHARS_PER_TOKEN} "
                          f"characters, which is the upper bound for {max_len} input tokens). Please reduce "
                          "the length of the input prompt.", param="input_text", value=len(prompt))
        ids = encoder(prompt)
        count = min(len(ids), max_len + 1)
    if count > max_len:
        at_least = "at least " if count == max_len + 1 else ""
        raise refused(f"This model's maximum context length is {max_len} tokens. However, your prompt contains "
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
        raise refused(f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad!r}",
                      param="logit_bias", value=bad)
    return list(dict.fromkeys(ids))


def _check_sampling(v: dict[str, Any], max_tokens: int) -> None:
    """Stage 4: vLLM's checks of the sampling parameters, in its order, with the defaults it fills in."""
    n = 1 if v["n"] is None else v["n"]
    if n < 1:
        raise refused(f"n must be at least 1, got {n}.")
    for key in ("presence_penalty", "frequency_penalty"):
        penalty = 0.0 if v[key] is None else v[key]
        if not -2.0 <= penalty <= 2.0:
            raise refused(f"{key} must be in [-2, 2], got {penalty}.")
    repetition = 1.0 if v["repetition_penalty"] is None else v["repetition_penalty"]
    if not math.isfinite(repetition):
        raise refused(f"repetition_penalty must be a finite number, got {repetition}.")
    if repetition <= 0.0:
        raise refused(f"repetition_penalty must be greater than zero, got {repetition}.")
    t = 1.0 if v["temperature"] is None else v["temperature"]
    for wrong, why in ((not math.isfinite(t), "be a finite number"), (t < 0.0, "be non-negative"),
                       (t > 2.0, "be in [0, 2]")):
        if wrong:
            raise refused(f"temperature must {why}, got {t}.", param="temperature", value=t)
    top_p = 1.0 if v["top_p"] is None else v["top_p"]
    if not 0.0 < top_p <= 1.0:
        raise refused(f"top_p must be in (0, 1], got {top_p}.", param="top_p", value=top_p)
    top_k = 0 if v["top_k"] is None else v["top_k"]
    if top_k < -1:
        raise refused(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    min_p = 0.0 if v["min_p"] is None else v["min_p"]
    if not 0.0 <= min_p <= 1.0:
        raise refused(f"min_p must be in [0, 1], got {min_p}.")
    if max_tokens < 1:
        raise refused(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens", value=max_tokens)
    min_tokens = v["min_tokens"]
    if min_tokens < 0:
        raise refused(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if min_tokens > max_tokens:
        raise refused(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")
    stop = v["stop"]
    if stop == "" or (isinstance(stop, list) and "" in stop):
        raise refused("stop cannot contain an empty string.")
    bad_words = list(dict.fromkeys(v["bad_words"] or []))
    if "" in bad_words:
        raise refused(f"bad_words cannot contain an empty string. Got bad_words={bad_words}")
    if n > 1 and t < _SAMPLING_EPS:  # greedy
        raise refused(f"n must be 1 when using greedy sampling, got {n}.")


def _check_logprobs(sample: int | None, prompt: int | None, vocab_size: int) -> None:
    """Stage 5 begins with the logprobs asked for (-1: the whole vocabulary), against vLLM's max_logprobs."""
    for key, kind, asked in (("logprobs", "sample", sample), ("prompt_logprobs", "prompt", prompt)):
        count = vocab_size if asked == -1 else asked
        if count is not None and count > TOP_MAX:
            raise refused(f"Requested {kind} logprobs of {count}, which is greater than max allowed: {TOP_MAX}",
                          param=key, value=count)


def _check_engine(v: dict[str, Any], bias_ids: list[int], prompt_ids: list[int], vocab_size: int) -> None:
    """Stage 5: what vLLM's engine checks against the model, in its order (after :func:`_check_logprobs`): the
    token ids the request names, then the prompt."""
    for key, ids in (("logit_bias", bias_ids), ("stop_token_ids", list(dict.fromkeys(v["stop_token_ids"] or [])))):
        if bad := [i for i in ids if not 0 <= i < vocab_size]:
            raise refused(f"token_id(s) {bad} in {key} contain out-of-vocab token ids. Vocabulary size: "
                          f"{vocab_size}", param=key, value=bad)
    allowed = v["allowed_token_ids"]
    if allowed is not None and not allowed:
        raise refused("allowed_token_ids is not None and empty!", param="allowed_token_ids", value=allowed)
    if allowed and (bad := [i for i in allowed if not 0 <= i < vocab_size]):
        raise refused("allowed_token_ids contains out-of-vocab token id!", param="allowed_token_ids", value=bad)
    if not prompt_ids:
        raise refused("The decoder prompt cannot be empty")
    if max(prompt_ids) >= vocab_size:  # negative ids do not pass the schema
        raise refused(f"Token id {max(prompt_ids)} is out of vocabulary")

