"""The model a simulated worker serves, as its HTTP API names and tokenizes it (vLLM's serving_models.py).

One :class:`ServedModel` per worker, shared by the completions and chat serving and vLLM's other endpoints:
the served name (and the 404 for any other), the context length, the vocabulary that turns text into token
ids and back, the ``system_fingerprint`` and the card ``GET /v1/models`` lists.
"""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path
from typing import Any

from fleetward.fleet.config import SimConfig
from fleetward.fleet.vocab import BUILTIN, Vocabulary
from fleetward.sim.protocol import ApiError
from fleetward.sim.tokenizer import SPECIAL_TOKENS, VOCAB_SIZE, decode, encode

__all__ = ["ServedModel"]

SPECIAL_NAMES = {i: name for name, i in SPECIAL_TOKENS.items()}


class ServedModel:
    """The served model's name, context, vocabulary and fingerprint.

    ``vocab`` is the engine's (None: the built-in byte vocabulary of :mod:`.tokenizer`), so text is
    tokenized here exactly as the engine detokenizes it.
    """

    def __init__(self, config: SimConfig, vocab: Vocabulary | None) -> None:
        self.name = config.model_name
        self.max_model_len = config.max_model_len
        self.vocab = vocab
        self.vocab_size = VOCAB_SIZE if vocab is None else vocab.size
        digest = hashlib.sha256(f"{self.name}:{config.seed}:{config.eos_probability}".encode())
        self.system_fingerprint = f"fleetward-sim-{digest.hexdigest()[:8]}"
        self._tokenizer = config.tokenizer
        self.adapters: dict[str, str] = {}  # LoRA adapters loaded at runtime: name -> path (.lora)

    def encode(self, text: str, *, special: bool) -> list[int]:
        """Text → ids with the vocabulary served (chat text is the rendered template, roles included)."""
        return encode(text) if self.vocab is None else self.vocab.encode(text, add_special_tokens=special)

    def decode(self, ids: list[int], *, skip_special: bool = True) -> str:
        """Ids → text; with ``skip_special`` False, special tokens are written out (``<s>``), as vLLM writes
        an echoed prompt and the tokens of logprobs."""
        if self.vocab is not None:
            return self.vocab.decode(ids, skip_special_tokens=skip_special)
        if skip_special:
            return decode(ids)
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in SPECIAL_NAMES:
                parts += [decode(run), SPECIAL_NAMES[i]]
                run = []
            else:
                run.append(i)
        return "".join([*parts, decode(run)])

    def check(self, model: str | None) -> None:
        """Refuse a request naming another model or adapter (vLLM's 404); no model at all means this one."""
        if model is not None and model != self.name and model not in self.adapters:
            aliases = ", ".join([self.name, *self.adapters])
            raise ApiError(f"The model `{model}` does not exist. Valid aliases: {aliases}.",
                           status=404, err_type="NotFoundError", param="model")

    def start(self, model: str | None) -> int | None:
        """The model state's seed for a request naming ``model``: a LoRA adapter's (a seed of its path: the
        base model changed by it, still a function of the prefix alone), None for the base model."""
        if model is None or model not in self.adapters:
            return None
        return int.from_bytes(hashlib.blake2b(self.adapters[model].encode(), digest_size=8).digest(), "little")

    def cards(self, now: int) -> list[dict[str, Any]]:
        """``GET /v1/models``' list: this model, then each adapter with its path and this model as parent."""
        base = self.card(now)
        return [base, *({**base, "id": name, "root": path, "parent": self.name, "max_model_len": None}
                        for name, path in self.adapters.items())]

    def card(self, now: int) -> dict[str, Any]:
        """This model's entry in ``GET /v1/models``, as vLLM writes it (``max_model_len`` included)."""
        return {"id": self.name, "object": "model", "created": now, "owned_by": "vllm",
                "root": self._root, "parent": None, "max_model_len": self.max_model_len,
                "permission": [{"id": f"modelperm-{secrets.token_hex(8)}", "object": "model_permission",
                                "created": now, "allow_create_engine": False, "allow_sampling": True,
                                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*", "group": None,
                                "is_blocking": False}]}

    @property
    def _root(self) -> str:
        """``root`` in /v1/models: where the tokenizer lives when it is a folder or file (routers load it)."""
        tok = self._tokenizer
        if tok in BUILTIN:
            return self.name
        path = Path(tok).expanduser().resolve()
        return str(path.parent if path.name == "tokenizer.json" else path)
