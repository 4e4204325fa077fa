"""The byte-level tokenizer shared by the simulated worker and the tiny local model.

Ids 0, 1, 2 are ``<unk>``, ``<s>``, ``</s>`` (Llama's convention), also when written in a text, as the
tokenizers library reads its special tokens; id ``3 + b`` is the byte ``b``. No BOS is
added, so a text prompt and its token ids are interchangeable, which is what migration (resume from
prompt ids + emitted ids) relies on. The tiny model's ``tokenizer.json`` (see :mod:`.tinymodel`) encodes
exactly like :func:`encode`, so the simulated worker and real vLLM agree on ids.

The chat template is one fixed format, rendered here in Python for the simulated worker and shipped as
Jinja in the tiny model's ``tokenizer_config.json`` for vLLM; a test checks they agree.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

__all__ = [
    "BOS_ID",
    "CHAT_TEMPLATE",
    "EOS_ID",
    "UNK_ID",
    "VOCAB_SIZE",
    "IncrementalDecoder",
    "decode",
    "encode",
    "render_chat",
]

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_OFFSET = 3
VOCAB_SIZE = BYTE_OFFSET + 256

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


SPECIAL_TOKENS = {"<unk>": UNK_ID, "<s>": BOS_ID, "</s>": EOS_ID}
_SPECIAL = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))


def encode(text: str) -> list[int]:
    """Ids of ``text``; a special token written in the text is that token, as HF tokenizers (so vLLM) read it."""
    ids: list[int] = []
    start = 0
    for m in _SPECIAL.finditer(text):
        ids += [BYTE_OFFSET + b for b in text[start:m.start()].encode("utf-8")]
        ids.append(SPECIAL_TOKENS[m.group()])
        start = m.end()
    return ids + [BYTE_OFFSET + b for b in text[start:].encode("utf-8")]


def _bytes_of(ids: Iterable[int]) -> bytes:
    return bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < VOCAB_SIZE)


def decode(ids: Iterable[int]) -> str:
    """Text of ``ids``; special tokens are skipped, invalid UTF-8 becomes U+FFFD."""
    return _bytes_of(ids).decode("utf-8", errors="replace")


def render_chat(messages: Sequence[Mapping[str, object]], *, add_generation_prompt: bool = True) -> str:
    """Python twin of :data:`CHAT_TEMPLATE`."""
    out = "".join(f"<|{m['role']}|>{_content_text(m.get('content'))}\n" for m in messages)
    return out + ("<|assistant|>" if add_generation_prompt else "")


def _content_text(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return str(content)


class IncrementalDecoder:
    """Turns a stream of ids into text deltas without splitting a UTF-8 character across deltas.

    Like vLLM's incremental detokenizer: bytes of an unfinished character are held back until the
    character completes (or the stream ends, see :meth:`flush`).
    """

    def __init__(self) -> None:
        self._pending = b""

    def push(self, token_id: int) -> str:
        self._pending += _bytes_of((token_id,))
        try:
            text = self._pending.decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.reason == "unexpected end of data" and len(self._pending) - exc.start < 4:
                text = self._pending[: exc.start].decode("utf-8", errors="replace")
                self._pending = self._pending[exc.start:]
                return text
            text = self._pending.decode("utf-8", errors="replace")
        self._pending = b""
        return text

    step = push  # the name fleetward.fleet.vocab.Detokenizer uses

    def flush(self) -> str:
        text = self._pending.decode("utf-8", errors="replace")
        self._pending = b""
        return text
