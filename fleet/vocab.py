"""Vocabularies and the detokenizer: token ids → the text a user reads, the way vLLM's engine makes it.

A :class:`Vocabulary` is a Hugging Face ``tokenizers`` tokenizer (a model folder's ``tokenizer.json``), or
one of the built-in vocabularies the test models use (:data:`BUILTIN`):

- ``byte``: 259 ids, ``<unk> <s> </s>`` then one id per byte (no merges): fleetward's original vocabulary;
- ``bpe``: a byte-level BPE of :data:`TRAINED_SIZE` ids (GPT-2/Llama-3 shaped: a printable stand-in
  character per byte, merges, the GPT-2 split regex), where one character may span several tokens;
- ``sp``: a SentencePiece-shaped BPE (Llama-2 shaped: a ``▁`` space marker, one ``<0xNN>`` token per byte
  for characters outside the vocabulary, a decoder that strips the leading space of the text), where a
  token's text depends on the tokens before it.

``bpe`` and ``sp`` are trained here, with the ``tokenizers`` library, on a multilingual text generated
from a fixed seed (:func:`training_text`: Latin, Cyrillic, Greek, Arabic, Devanagari, CJK, Hangul, kana,
emoji with skin tones and ZWJ sequences). Training is deterministic, so every process that names ``bpe``
gets the same ids (and trains only when no earlier process left the result in the user's cache folder);
``fleetward model tiny --tokenizer bpe`` writes the same vocabulary into the model folder real vLLM loads.
Both carry the chat roles ``<|system|> <|user|> <|assistant|>`` as special tokens.

:class:`Detokenizer` is one request's incremental detokenizer with vLLM 0.32's rules
(``FastIncrementalDetokenizer``): a ``DecodeStream`` primed with the prompt's ids, one step per generated
id, incomplete characters held back, ``skip_special_tokens`` and ``spaces_between_special_tokens`` as vLLM
applies them. Fed one request's prompt and every generated id in order, it gives the text vLLM gives for an
uninterrupted run, whichever workers produced the ids. A worker that resumes a generation primes its own
detokenizer with the resumed prompt instead, and its text may differ from the first character after the
boundary on; that is why the router detokenizes (docs/architecture.md, "What is exact").
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import random
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fleetward.fleet.errors import ConfigError

__all__ = [
    "BUILTIN",
    "CHAT_ROLES",
    "TRAINED_SIZE",
    "Detokenizer",
    "Vocabulary",
    "builtin_json",
    "load_vocabulary",
    "training_text",
]

BUILTIN = ("byte", "bpe", "sp")
TRAINED_SIZE = 4096
SPECIAL = ("<unk>", "<s>", "</s>")
CHAT_ROLES = ("<|system|>", "<|user|>", "<|assistant|>")
_SEED = 20261123
_SP_ALPHABET = 320

# vLLM resets a DecodeStream when the tokenizers library raises this (vllm/v1/engine/detokenizer.py).
_INVALID_PREFIX = "Invalid prefix encountered"


class Vocabulary:
    """A loaded tokenizer and where it came from (``source``: a built-in name or a path)."""

    def __init__(self, tokenizer: Any, source: str) -> None:
        self.tokenizer = tokenizer
        self.source = source
        self.size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.added: dict[int, str] = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self.special: frozenset[int] = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items()
                                                 if t.special)

    def __repr__(self) -> str:
        return f"Vocabulary({self.source!r}, size={self.size})"

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_of(self, token: str) -> int | None:
        found = self.tokenizer.token_to_id(token)
        return None if found is None else int(found)

    def detokenizer(self, prompt_ids: Sequence[int], *, skip_special_tokens: bool = True,
                    spaces_between_special_tokens: bool = True) -> Detokenizer:
        return Detokenizer(self, prompt_ids, skip_special_tokens=skip_special_tokens,
                           spaces_between_special_tokens=spaces_between_special_tokens)


class Detokenizer:
    """Generated ids → text deltas for one request, primed with its prompt (vLLM's rules; module docstring)."""

    __slots__ = ("_added", "_last_special", "_skip", "_spaces", "_stream", "_tok")

    def __init__(self, vocab: Vocabulary, prompt_ids: Sequence[int], *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream

        self._tok = vocab.tokenizer
        self._skip = skip_special_tokens
        try:
            self._stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=skip_special_tokens)
        except (OverflowError, TypeError):  # an id no vocabulary holds (negative, beyond 2^32): primed with none
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # vLLM honours spaces_between_special_tokens=False only when special tokens are kept, and then
        # only for added tokens that follow another added token.
        self._spaces = skip_special_tokens or spaces_between_special_tokens or not vocab.added
        self._added = vocab.added
        self._last_special = False

    def step(self, token_id: int) -> str:
        """The text this id adds ("" while a character is incomplete)."""
        try:
            text = self._stream.step(self._tok, token_id)
        except (OverflowError, TypeError):
            text = None  # an id outside the vocabulary: vLLM logs it and emits nothing
        except Exception as exc:
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=self._skip)
            text = self._stream.step(self._tok, token_id)
        if not self._spaces:
            special = self._added.get(token_id)
            if special is not None and self._last_special:
                text = special
            self._last_special = special is not None
        return text or ""

    def feed(self, token_ids: Iterable[int]) -> str:
        return "".join(self.step(t) for t in token_ids)


# -- loading ------------------------------------------------------------------------------------------------

_lock = threading.Lock()
_cache: dict[str, Vocabulary] = {}


def load_vocabulary(source: str | Path) -> Vocabulary:
    """A built-in name, a model folder with ``tokenizer.json``, or a ``tokenizer.json`` file (cached).

    Raises :class:`ConfigError` naming the source when it cannot be loaded.
    """
    key = str(source)
    with _lock:
        found = _cache.get(key)
    if found is not None:
        return found
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # pragma: no cover - a base dependency
        raise ConfigError(f"tokenizer {key}: the tokenizers library is missing ({exc})") from exc
    if key in BUILTIN:
        tokenizer = Tokenizer.from_str(json.dumps(builtin_json(key)))
    else:
        path = Path(key).expanduser()
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"tokenizer {key}: no tokenizer.json there (a model folder, a tokenizer.json "
                              f"file, or one of {', '.join(BUILTIN)})")
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:
            raise ConfigError(f"tokenizer {file}: cannot be loaded: {exc}") from exc
    vocab = Vocabulary(tokenizer, key)
    with _lock:
        return _cache.setdefault(key, vocab)


# -- built-in vocabularies --------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (what ByteLevel tokenizers use as vocab keys)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def _added(tokens: Iterable[tuple[str, int]]) -> list[dict[str, Any]]:
    return [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": True} for c, i in tokens]


def _byte_json() -> dict[str, Any]:
    b2u = _bytes_to_unicode()
    vocab = {t: i for i, t in enumerate(SPECIAL)}
    vocab.update({b2u[b]: len(SPECIAL) + b for b in range(256)})
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": _added((t, i) for i, t in enumerate(SPECIAL)),
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }


# Syllables per script: words are drawn from them, so the corpus has many distinct words that share pieces
# (what BPE merges learn), in every script a production vocabulary meets.
_SCRIPTS: dict[str, tuple[Sequence[str], Sequence[str]]] = {
    "latin": ([*"bcdfghjklmnprstvwz", "th", "ch", "sh", "qu", "st", "tr"],
              [*"aeiou", "ei", "ou", "ä", "é", "ü", "ñ", "ø"]),
    "cyrillic": (list("бвгджзклмнпрстфхцчшщ"), list("аеёиоуыэюя")),
    "greek": (list("βγδζθκλμνξπρστφχψ"), list("αεηιουωάέί")),
    "arabic": (list("بتثجحخدذرزسشصضطظعغفقكلمنهو"), ["\u0627", "ي", "و", "َ", "ِ", "ُ"]),
    "devanagari": (list("कखगघचछजझटठडढणतथदधनपफबभमयरलवशषसह"), ["ा", "ि", "ी", "ु", "ू", "े", "ै", "ो", "ं", "्"]),
}
_CJK = (0x4E00, 0x4E00 + 1500)  # the most common CJK ideographs sit near the start of the block
_HANGUL = (0xAC00, 0xAC00 + 11172)
_KANA = (0x3041, 0x3096)
_EMOJI = ["😀", "😂", "🥲", "😍", "🤔", "🙈", "🚀", "🔥", "✨", "🎉", "🌍", "🍣", "🧪", "💡", "❤️", "👍", "🐍",
          "🦀", "☕", "🌧️"]
_SKIN = ["", "🏻", "🏼", "🏽", "🏾", "🏿"]
_ZWJ = ["👩‍💻", "👨‍👩‍👧", "🏳️‍🌈", "🧑‍🚀", "👩🏽‍🔬"]
_ENGLISH = ("the of and to in is that it for on with as was be by at this are from or have an they which one "
            "you had not but what all were when we there can more if no out so said up its about into than them "
            "time only new some could these two may first then do any like my now over such our man me even most "
            "made after also did many before must through back years where much your way well down should because "
            "each just those people how too little state good very make world still own see men work long get here "
            "between both life being under never day same another know while last might us great old year off come "
            "since against go came right used take three worker router stream token migration request fleet").split()


def training_text(*, seed: int = _SEED, sentences: int = 12000) -> list[str]:
    """The multilingual training text of ``bpe`` and ``sp`` (deterministic for a seed)."""
    rng = random.Random(seed)

    def word(script: str) -> str:
        if script == "english":
            return rng.choice(_ENGLISH)
        if script == "cjk":
            return "".join(chr(rng.randrange(*_CJK)) for _ in range(rng.randint(1, 4)))
        if script == "hangul":
            return "".join(chr(rng.randrange(*_HANGUL)) for _ in range(rng.randint(1, 3)))
        if script == "kana":
            return "".join(chr(rng.randrange(*_KANA)) for _ in range(rng.randint(2, 5)))
        if script == "emoji":
            pick = rng.random()
            if pick < 0.2:
                return rng.choice(_ZWJ)
            base = rng.choice(_EMOJI)
            return base + (rng.choice(_SKIN) if base in ("👍",) else "")
        consonants, vowels = _SCRIPTS[script]
        return "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(1, 4)))

    scripts = ["english"] * 6 + list(_SCRIPTS) + ["cjk", "cjk", "hangul", "kana", "emoji"]
    out = []
    for _ in range(sentences):
        script = rng.choice(scripts)
        words = [word(script if rng.random() < 0.85 else rng.choice(scripts)) for _ in range(rng.randint(3, 14))]
        sep = "" if script in ("cjk", "kana") else " "
        line = sep.join(words)
        if rng.random() < 0.5:
            line = line[:1].upper() + line[1:]
        out.append(line + rng.choice([".", "!", "?", ",", ":", "。", "…", "\n", " 42", " (1999)"]))
    return out


def _train(kind: str) -> dict[str, Any]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = training_text()
    if kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=TRAINED_SIZE - len(CHAT_ROLES), special_tokens=list(SPECIAL),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
                                      show_progress=False)
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        # Few characters: the rest (rare ideographs, emoji) are spelled as <0xNN> byte tokens. The alphabet is
        # chosen here, by count then code point: the trainer's own cut breaks ties differently in each run.
        counts = Counter(ch for line in text for ch in line.replace(" ", "▁"))
        alphabet = sorted(counts, key=lambda ch: (-counts[ch], ch))[:_SP_ALPHABET]
        trainer = trainers.BpeTrainer(vocab_size=TRAINED_SIZE - len(CHAT_ROLES) - 256,
                                      special_tokens=list(SPECIAL), initial_alphabet=alphabet,
                                      limit_alphabet=len(alphabet), min_frequency=2, show_progress=False)
    tok.train_from_iterator(text, trainer=trainer)
    data: dict[str, Any] = json.loads(tok.to_str())
    model = data["model"]
    if kind == "sp":
        # Llama-2's layout: specials, then <0x00>..<0xFF>, then the pieces; byte fallback in the decoder.
        trained = sorted(model["vocab"].items(), key=lambda kv: kv[1])
        vocab = {t: i for i, t in enumerate(SPECIAL)}
        vocab.update({f"<0x{b:02X}>": len(SPECIAL) + b for b in range(256)})
        for token, _ in trained:
            vocab.setdefault(token, len(vocab))
        model["vocab"] = vocab
        data["decoder"] = {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ]}
    vocab = model["vocab"]
    roles = [(role, len(vocab) + k) for k, role in enumerate(CHAT_ROLES)]
    data["added_tokens"] = _added([(t, i) for i, t in enumerate(SPECIAL)] + roles)
    assert len(vocab) + len(roles) <= TRAINED_SIZE
    return data


def _cache_file(kind: str) -> Path:
    """Where a trained vocabulary is kept for the next process: under ``$XDG_CACHE_HOME/fleetward`` (else
    ``~/.cache/fleetward``), named for what made it (this module's source and the ``tokenizers`` version), so
    a change to either trains again. Training takes 1-3 s of CPU, and every simulated worker names ``bpe``."""
    import tokenizers

    made_by = hashlib.sha256(Path(__file__).read_bytes() + tokenizers.__version__.encode()).hexdigest()[:16]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fleetward"
    return root / f"vocab-{kind}-{made_by}.json"


def _trained_text(kind: str) -> str:
    """``kind``'s trained ``tokenizer.json``: from the cache when it holds a readable one, else trained (and
    written there for the next process, atomically; a cache that cannot be written is only slower)."""
    path = _cache_file(kind)
    with contextlib.suppress(OSError, ValueError):
        text = path.read_text(encoding="utf-8")
        json.loads(text)  # a file that is not whole (a full disk, an edit) is trained again
        return text
    text = json.dumps(_train(kind), ensure_ascii=False)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)
    return text


@functools.cache
def _builtin_text(kind: str) -> str:
    return json.dumps(_byte_json(), ensure_ascii=False) if kind == "byte" else _trained_text(kind)


def builtin_json(kind: str) -> dict[str, Any]:
    """The ``tokenizer.json`` of a built-in vocabulary (a fresh copy)."""
    if kind not in BUILTIN:
        raise ConfigError(f"no built-in vocabulary {kind!r}; choose one of {', '.join(BUILTIN)}")
    result: dict[str, Any] = json.loads(_builtin_text(kind))
    return result
