"""Log-probabilities as the simulated worker reports them: ``logprobs`` (completions: how many alternatives;
chat: ``logprobs`` with ``top_logprobs``), ``prompt_logprobs`` and the ones ``echo`` gives a prompt, in vLLM
0.32's shapes (``tests/data/vllm-0.32``).

The sim's model (:mod:`.model`) picks the next token as a pure function of the prefix; its distribution is
made the same way. At a prefix whose folded state is ``s``, the token the model generates is rank 1; then come
:data:`TOP_MAX` - 1 runners-up drawn from ``s``, each less likely than the one before; every other token lies
far below them, at a rank and a logprob drawn from ``s`` and the token. So:

- the token a greedy request gets is the most likely one (lm-eval-harness's ``is_greedy`` holds for it);
- a prompt's or an answer's logprobs are the same on every worker, and the log-likelihood of a continuation
  is a function of the text alone, as it is for a real model with greedy decoding;
- a sampled choice (a salted state, :attr:`~.engine.SamplingSpec.salt`) is scored under the state it was
  drawn from, so it too is its position's rank 1.

How vLLM shows a token: decoded alone, and where that ends in U+FFFD (a character whose bytes span several
tokens), decoded again with up to four tokens before it from the same sequence, the text owed to this token
kept, or ``""`` while the character is still incomplete (:class:`TokenText`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fleetward.sim.model import SimModel

__all__ = ["TOP_MAX", "Position", "Scorer", "Shown", "TokenText", "chat_logprobs", "completion_logprobs", "next_offset",
           "prompt_logprobs", "prompt_positions", "shown"]

TOP_MAX = 20  # vLLM's default max_logprobs: the most alternatives a request may ask for
_RUNNER_UP_SALT = 0x5EED_0F_A1
_CONTEXT = 4  # tokens of context that make any UTF-8 character whole
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True, slots=True)
class Position:
    """One position of a sequence: the token there, its logprob and rank, and the ``k`` most likely tokens
    (rank order) with theirs."""

    token: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]

    def entries(self) -> dict[int, tuple[float, int]]:
        """vLLM's dict for the position: the token first, then the top ones, each once: id -> (logprob, rank)."""
        out = {self.token: (self.logprob, self.rank)}
        for rank, (token, logprob) in enumerate(self.top, 1):
            out.setdefault(token, (logprob, rank))
        return out


def _ranked(model: SimModel, state: int, *, ignore_eos: bool) -> list[tuple[int, float]]:
    """The :data:`TOP_MAX` most likely tokens after ``state``, most likely first."""
    first, count = model.span
    best = model.token_for(state, ignore_eos=ignore_eos)
    logprob = -1e-4 - ((state >> 12) & 0xFFFFF) / (1 << 20) * 0.6
    out = [(best, logprob)]
    seen = {best}
    k = 0
    while len(out) < min(TOP_MAX, count):
        k += 1
        draw = SimModel.advance(state, _RUNNER_UP_SALT + k)
        token = first + draw % count
        if token in seen:
            continue
        seen.add(token)
        logprob -= 0.25 + (draw >> 40) / (1 << 24) * 0.75
        out.append((token, logprob))
    return out


def _position(model: SimModel, state: int, token: int, k: int, *, ignore_eos: bool) -> Position:
    ranked = _ranked(model, state, ignore_eos=ignore_eos)
    for rank, (t, logprob) in enumerate(ranked, 1):
        if t == token:
            return Position(token, logprob, rank, tuple(ranked[:k]))
    draw = SimModel.advance(state ^ _RUNNER_UP_SALT, token)
    floor = ranked[-1][1]
    size = model.span[1]
    rank = len(ranked) + 1 + draw % max(1, size - len(ranked))
    return Position(token, floor - 8.0 - (draw >> 40) / (1 << 24) * 40.0, rank, tuple(ranked[:k]))


class Scorer:
    """The positions of one generated sequence, token after token (a stream scores each step's tokens as they
    come): scored under the state the engine generated them from (:meth:`~.engine.SimEngine.submit`'s), ``k``
    alternatives each, shown as vLLM shows them (their context: the tokens generated before)."""

    def __init__(self, model: SimModel, prompt: Sequence[int], k: int, text: TokenText, *, start: int | None = None,
                 salt: int = 0, ignore_eos: bool = False) -> None:
        self._model = model
        self._k = k
        self._text = text
        self._ignore_eos = ignore_eos
        self._state = model.state(prompt, start=start)
        if salt:
            self._state = SimModel.advance(self._state, salt)
        self._seen: list[int] = []

    def positions(self, tokens: Sequence[int]) -> list[Position]:
        out = []
        for token in tokens:
            out.append(_position(self._model, self._state, token, self._k, ignore_eos=self._ignore_eos))
            self._state = SimModel.advance(self._state, token)
        return out

    def next(self, tokens: Sequence[int]) -> list[Shown]:
        """The next ``tokens`` of the sequence, as shown."""
        out = shown(tokens, self.positions(tokens), self._text, context=self._seen)
        self._seen += tokens
        return out


def prompt_positions(model: SimModel, prompt: Sequence[int], k: int, *,
                     start: int | None = None) -> list[Position | None]:
    """Each prompt token's :class:`Position` given the tokens before it; the first has none (``None``)."""
    out: list[Position | None] = [None] if prompt else []
    state = model.state(prompt[:1], start=start)
    for token in prompt[1:]:
        out.append(_position(model, state, token, k, ignore_eos=False))
        state = SimModel.advance(state, token)
    return out


class TokenText:
    """How vLLM shows a token in logprobs (module docstring): ``decode`` is the served vocabulary's, special
    tokens kept."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode

    def plain(self, token: int) -> str:
        return self._decode([token])

    def at(self, token: int, context: Sequence[int]) -> str:
        """``token``'s text after the sequence's ``context`` (the tokens before it, of the same sequence)."""
        text = self._decode([token])
        if not text.endswith(_REPLACEMENT):
            return text
        before = list(context[-_CONTEXT:])
        for n in range(1, len(before) + 1):
            window = before[-n:]
            whole = self._decode([*window, token])
            if whole.endswith(_REPLACEMENT):
                continue
            # The window's own tokens that end in U+FFFD were shown as "": their text is this token's.
            clean = len(window)
            while clean and self._decode([window[clean - 1]]).endswith(_REPLACEMENT):
                clean -= 1
            head = self._decode(window[:clean]) if clean else ""
            same = 0
            while same < min(len(head), len(whole)) and head[same] == whole[same]:
                same += 1
            return whole[same:]
        return ""


def _clamped(logprob: float) -> float:
    return max(logprob, -9999.0)


@dataclass(frozen=True, slots=True)
class Shown:
    """A position as a client reads it: the token's text, and its entries (:meth:`Position.entries`) as
    ``(token, text, logprob, rank)``; no entries where the position has no logprob (a prompt's first)."""

    token: int
    text: str
    logprob: float | None
    entries: tuple[tuple[int, str, float, int], ...]


def shown(tokens: Sequence[int], positions: Sequence[Position | None], text: TokenText, *,
          context: Sequence[int] = ()) -> list[Shown]:
    """``tokens`` of one sequence (``context``: its tokens before them) with their positions, as shown."""
    out = []
    seen = list(context)
    for token, pos in zip(tokens, positions, strict=True):
        if pos is None:
            out.append(Shown(token, text.plain(token), None, ()))
        else:
            mine = text.at(token, seen)
            out.append(Shown(token, mine, _clamped(pos.logprob), tuple(
                (t, mine if t == token else text.at(t, seen), _clamped(logprob), rank)
                for t, (logprob, rank) in pos.entries().items())))
        seen.append(token)
    return out


def completion_logprobs(tokens: Sequence[Shown], num: int, *, offset: int = 0) -> dict[str, Any]:
    """A completion choice's ``logprobs``: each token with ``num`` alternatives besides it (keyed by text, so
    tokens that read alike are one key, as in vLLM), ``text_offset`` counted from ``offset``."""
    offsets: list[int] = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s.text)
    tops: list[dict[str, float] | None] = []
    for s in tokens:
        tops.append({t: logprob for i, (_id, t, logprob, _rank) in enumerate(s.entries) if i <= num}
                    if s.logprob is not None else None)
    return {"text_offset": offsets, "token_logprobs": [s.logprob for s in tokens], "tokens": [s.text for s in tokens],
            "top_logprobs": tops}


def next_offset(logprobs: dict[str, Any], offset: int) -> int:
    """The ``text_offset`` after a chunk's ``logprobs`` (``offset`` when it has no token)."""
    if not logprobs["tokens"]:
        return offset
    return int(logprobs["text_offset"][-1]) + len(logprobs["tokens"][-1])


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(tokens: Sequence[Shown], top_logprobs: int) -> dict[str, Any]:
    """A chat choice's ``logprobs``: each token with its logprob and bytes, and the position's first
    ``top_logprobs`` entries (the token first, then by rank)."""
    return {"content": [{"token": s.text, "logprob": s.logprob, "bytes": _bytes(s.text), "top_logprobs": [
        {"token": t, "logprob": logprob, "bytes": _bytes(t)}
        for i, (_id, t, logprob, _rank) in enumerate(s.entries) if i < top_logprobs]} for s in tokens]}


def prompt_logprobs(tokens: Sequence[Shown]) -> list[dict[str, dict[str, Any]] | None]:
    """``prompt_logprobs``: per prompt token (the first: ``null``), the token and the top ones by id, each
    with its logprob, rank and text."""
    return [{str(t): {"logprob": logprob, "rank": rank, "decoded_token": text} for t, text, logprob, rank in s.entries}
            if s.logprob is not None else None for s in tokens]
