"""API keys on the router's public API (``routing.api_keys_file``), each with a limit on its requests in flight.

Clients send a key as OpenAI's do (``Authorization: Bearer <key>``), so the official ``openai`` client works
unchanged with ``api_key=...``. The file names each key and says how many of its requests may run at once:

.. code-block:: yaml

    keys:
      - name: team-a
        key: sk-team-a-0f3c...          # the key itself,
        max_concurrency: 32
      - name: batch
        key_sha256: 9f86d0818...        # or its SHA-256 (hex), so the file need not hold the key
        # max_concurrency: routing.api_key_max_concurrency (0: no limit)

A presented key is looked up by its SHA-256 digest, so neither its bytes nor a prefix of them decide how long
the check takes. The file must not be readable by others (as the admin token file). Keys are never logged:
metrics and logs name the key's ``name``. The limit holds per router process (a router group's children and
replicas each count their own).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field, SecretStr, model_validator

from fleetward.fleet.config import ID_PATTERN, Frozen, check_private_file, load_model, secret_path

__all__ = ["ApiKey", "ApiKeys", "ApiKeysFile"]


class ApiKeyEntry(Frozen):
    name: str = Field(pattern=ID_PATTERN, description="the key's name in metrics and logs")
    key: SecretStr | None = Field(None, min_length=8, description="the key as clients send it")
    key_sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$", description="or the key's SHA-256, hex")
    max_concurrency: int | None = Field(None, ge=0, description="its requests in flight at most (0: no limit)")

    @model_validator(mode="after")
    def _one_key(self) -> ApiKeyEntry:
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError("give exactly one of key and key_sha256")
        return self

    def digest(self) -> bytes:
        if self.key is not None:
            return hashlib.sha256(self.key.get_secret_value().encode()).digest()
        assert self.key_sha256 is not None
        return bytes.fromhex(self.key_sha256)


class ApiKeysFile(Frozen):
    keys: list[ApiKeyEntry] = Field(min_length=1, description="the keys clients may send")

    @model_validator(mode="after")
    def _unique(self) -> ApiKeysFile:
        names = [k.name for k in self.keys]
        if len(set(names)) != len(names):
            raise ValueError(f"key names repeat: {sorted({n for n in names if names.count(n) > 1})}")
        if len({k.digest() for k in self.keys}) != len(self.keys):
            raise ValueError("the same key is listed twice")
        return self


@dataclass
class ApiKey:
    """One key at run time: its name, its limit and its requests in flight."""

    name: str
    limit: int  # 0: no limit
    in_flight: int = field(default=0)

    def acquire(self) -> bool:
        if self.limit and self.in_flight >= self.limit:
            return False
        self.in_flight += 1
        return True

    def release(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)


_BEARER = re.compile(r"^\s*bearer\s+(\S+)\s*$", re.IGNORECASE)


class ApiKeys:
    """The keys of one router, by digest."""

    def __init__(self, file: ApiKeysFile, *, default_limit: int = 0) -> None:
        self.by_digest = {e.digest(): ApiKey(e.name, e.max_concurrency if e.max_concurrency is not None
                                             else default_limit) for e in file.keys}

    @classmethod
    def load(cls, path: Path, *, default_limit: int = 0) -> ApiKeys:
        """The keys in ``path``; :class:`ConfigError` (file, line, field) when it is unreadable, readable by
        others, or malformed."""
        path = secret_path(path)
        check_private_file(path, field="routing.api_keys_file", what="API keys")
        return cls(load_model(ApiKeysFile, path), default_limit=default_limit)

    @property
    def names(self) -> list[str]:
        return [k.name for k in self.by_digest.values()]

    def check(self, authorization: str | None) -> ApiKey | str:
        """The key an ``Authorization`` header carries, or why it is refused ("missing" or "wrong")."""
        m = _BEARER.match(authorization or "")
        if m is None:
            return "missing"
        key = self.by_digest.get(hashlib.sha256(m.group(1).encode()).digest())
        return key if key is not None else "wrong"
