"""Server-sent events as OpenAI-compatible servers stream them: lines and ``data:`` payloads.

Every client of a token stream in fleetward (the testbed's workload, the autoscaler's live replay and
profiler, tests) reads events here, so a line is ended the way the SSE spec says and nowhere else.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import orjson

__all__ = ["sse_data", "sse_lines"]

_EOL = re.compile(rb"\r\n|\r|\n")


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of an SSE body, ended by CR, LF or CRLF only (as the SSE spec says).

    Not ``httpx``'s ``aiter_lines``: like ``str.splitlines`` it also splits on U+0085, U+2028, U+001C...,
    which JSON leaves unescaped, so a token whose text is one of them would cut an event in two. An
    unterminated last line (the body ended mid-line) is dropped, as the spec drops an incomplete event.
    """
    buf = b""
    async for chunk in chunks:
        buf += chunk
        start = 0
        for m in _EOL.finditer(buf):
            if m.group() == b"\r" and m.end() == len(buf):
                break  # maybe the first half of a CRLF: wait for more
            yield buf[start:m.start()].decode("utf-8", errors="replace")
            start = m.end()
        buf = buf[start:]


async def sse_data(chunks: AsyncIterator[bytes]) -> AsyncIterator[Any]:
    """The ``data:`` payloads of an SSE body (:func:`sse_lines`), parsed: a JSON value, or ``"[DONE]"``.

    A payload that is not JSON raises :class:`json.JSONDecodeError` (orjson's is one), nesting too deep included.
    """
    async for line in sse_lines(chunks):
        if line.startswith("data: "):
            payload = line[len("data: "):]
            yield payload if payload == "[DONE]" else orjson.loads(payload)
