"""The simulated worker's "model": the next token is a pure function of the whole prefix.

A 64-bit state is folded over every token of the prefix (prompt, then each generated token) and the
next token is read off the state. So:

- any continuation is checkable: ``continuation(prompt + emitted[:k], n)`` equals ``emitted[k:k+n]``;
- migration is exact by construction on simulated workers (the property tests rely on this);
- a checker can compute the fault-free reference of any request without running a worker.

On the byte vocabulary (``vocab_size`` None) generated tokens are printable ASCII bytes, so text is
readable; on any other vocabulary (the trained ``bpe`` and ``sp`` ones, see :mod:`fleetward.fleet.vocab`)
they are any id after the three specials, so merged tokens, byte-fallback tokens, split multibyte
characters and the chat roles all occur. EOS comes with ``eos_probability``. Different ``seed`` values
are different "models".
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleetward.fleet.config import SimConfig
from fleetward.sim.tokenizer import BYTE_OFFSET, EOS_ID

__all__ = ["SimModel", "sim_model"]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_PRINTABLE_FIRST, _PRINTABLE_COUNT = 32, 95  # ' ' .. '~'
_EOS_SCALE = 1 << 24


def _mix(state: int, token: int) -> int:
    """splitmix64 over (state, token): cheap, well spread, and pure."""
    z = (state ^ ((token + 1) * _GOLDEN)) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


@dataclass(frozen=True)
class SimModel:
    seed: int = 0
    eos_probability: float = 0.0
    vocab_size: int | None = None  # None: the byte vocabulary, printable ASCII only

    @property
    def span(self) -> tuple[int, int]:
        """``(first, count)``: the ids the model generates besides EOS."""
        if self.vocab_size is None:
            return BYTE_OFFSET + _PRINTABLE_FIRST, _PRINTABLE_COUNT
        return BYTE_OFFSET, self.vocab_size - BYTE_OFFSET

    @classmethod
    def of_reference(cls, ref: Mapping[str, Any]) -> SimModel:
        """The model a backend's ``reference()`` describes (``kind: model``)."""
        size = ref.get("vocab_size")
        return cls(int(ref.get("seed", 0)), float(ref.get("eos_probability", 0.0)),
                   None if size is None else int(size))

    def state(self, prefix: Iterable[int], start: int | None = None) -> int:
        s = self.seed & _MASK if start is None else start
        for t in prefix:
            s = _mix(s, t)
        return s

    def token_for(self, state: int, *, ignore_eos: bool = False) -> int:
        """The token generated from a prefix whose folded state is ``state``."""
        if not ignore_eos and self.eos_probability > 0:
            if (state >> 40) % _EOS_SCALE < self.eos_probability * _EOS_SCALE:
                return EOS_ID
        first, count = self.span
        return first + (state % count)

    def generate(self, prompt: Iterable[int], *, ignore_eos: bool = False) -> Iterator[int]:
        """Tokens after ``prompt``, forever (EOS included when it comes; the caller stops)."""
        s = self.state(prompt)
        while True:
            t = self.token_for(s, ignore_eos=ignore_eos)
            yield t
            s = _mix(s, t)

    def continuation(self, prefix: Iterable[int], n: int, *, ignore_eos: bool = False) -> list[int]:
        """The next ``n`` tokens after ``prefix``, stopping early after EOS."""
        out: list[int] = []
        for t in self.generate(prefix, ignore_eos=ignore_eos):
            if len(out) >= n:
                break
            out.append(t)
            if t == EOS_ID:
                break
        return out

    @staticmethod
    def advance(state: int, token: int) -> int:
        return _mix(state, token)

    # -- KV: what a prefill worker hands a decode worker ---------------------------------------------------

    def kv_blocks(self, prefix: Sequence[int], bytes_per_token: int, block_tokens: int) -> list[bytes]:
        """The KV of ``prefix`` in blocks of ``block_tokens``: per token, ``bytes_per_token`` bytes made from
        the state after it (so the KV of a position depends on everything before it, as attention's does)."""
        return self._kv(prefix, bytes_per_token, block_tokens)[0]

    def _kv(self, prefix: Sequence[int], bytes_per_token: int, block_tokens: int) -> tuple[list[bytes], int]:
        """:meth:`kv_blocks`, and the state after ``prefix``."""
        reps = max(1, bytes_per_token // 8)
        s = self.seed & _MASK
        per_token: list[bytes] = []
        for i, t in enumerate(prefix):
            s = _mix(s, t)
            per_token.append(((s ^ (i * _GOLDEN)) & _MASK).to_bytes(8, "little") * reps)
        return [b"".join(per_token[i:i + block_tokens]) for i in range(0, len(per_token), block_tokens)], s

    def state_from_kv(self, prompt: Sequence[int], covered: int, payload: bytes, bytes_per_token: int,
                      block_tokens: int) -> int:
        """The state a decode worker generates from, given KV ``payload`` for the first ``covered`` prompt
        tokens: the prompt's own state when the KV is the prompt's, else a different one. A decode reads
        every block (attention does), so any wrong byte anywhere gives other tokens, from the first one."""
        blocks, covered_state = self._kv(prompt[:covered], bytes_per_token, block_tokens)
        state = self.state(prompt[covered:], start=covered_state)  # the prompt's state, folded once
        if payload == b"".join(blocks):
            return state
        return _mix(state, int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little"))


def sim_model(config: SimConfig) -> SimModel:
    """The model a simulated worker with ``config`` serves (its vocabulary loaded for the size)."""
    if config.tokenizer == "byte":
        return SimModel(config.seed, config.eos_probability)
    from fleetward.fleet.vocab import load_vocabulary

    return SimModel(config.seed, config.eos_probability, load_vocabulary(config.tokenizer).size)
