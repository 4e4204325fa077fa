"""SSE toxics, and the HTTP/1.1 response parser that feeds them events.

==================== ==========================================================================================
toxic                effect (HTTP: a ``text/event-stream`` response on an ``http=True`` proxy)
==================== ==========================================================================================
:class:`SseCut`      a ``text/event-stream`` response is cut (FIN, or RST) right after ``after_events`` events
                     were delivered: the client gets exactly that many events, then EOF
:class:`SseStall`    after ``after_events`` events, the response's events are held (the connection stays open)
                     until the toxic is removed; then they flow again, none lost
:class:`SseCorrupt`  one token id in ``token_ids`` of a ``data:`` JSON event is changed
:class:`SseDropDone` ``data: [DONE]`` is dropped; the response still ends properly
==================== ==========================================================================================

HTTP: a proxy made with ``http=True`` parses the downstream side as HTTP/1.1 responses (keep-alive,
several responses per connection, ``Content-Length``, chunked, read-until-close, 1xx). Chunked
``text/event-stream`` responses (what uvicorn and vLLM send) are de-chunked, split into events, passed
through the SSE toxics and re-framed one event per chunk; every other body passes byte for byte. SSE
toxics need ``http=True``. Not handled: responses to ``HEAD`` (the proxy does not parse requests), and
``Upgrade``; a head it cannot parse turns the rest of that connection into plain bytes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from fleetward.chaos.net.toxics import Toxic, _checked, _Close, _ids
from fleetward.sim.tokenizer import VOCAB_SIZE

if TYPE_CHECKING:
    # The parser only reads its connection; the proxy imports this module, not the reverse.
    from fleetward.chaos.net.proxy import _Conn

__all__ = ["SseCorrupt", "SseCut", "SseDropDone", "SseStall"]


class _SseToxic(Toxic):
    sse = True

    def __init__(self, *, streams: int | None = None, **kw: object) -> None:
        kw["direction"] = "downstream"
        super().__init__(**kw)  # type: ignore[arg-type]
        self.streams = streams
        self._taken = 0

    def picks_response(self, resp: _Response) -> bool:
        key = -resp.id
        if key not in self._chosen:
            ok = self.streams is None or self._taken < self.streams
            ok = ok and (self.toxicity >= 1.0 or self._rng.random() < self.toxicity)
            self._chosen[key] = ok
            self._taken += ok
        return self._chosen[key]


class SseCut(_SseToxic):
    """``hits`` counts responses cut."""

    kind = "sse_cut"

    def __init__(self, after_events: int, reset: bool = False, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.after_events = _checked("after_events", after_events, 0)
        self.reset = reset

    async def event(self, conn: _Conn, resp: _Response, event: bytes) -> bytes | None:
        if self.picks_response(resp) and resp.events >= self.after_events:
            self.hits += 1
            raise _Close(self.reset)
        return event

    async def delivered(self, conn: _Conn, resp: _Response) -> None:
        if self.picks_response(resp) and resp.events >= self.after_events:
            self.hits += 1
            raise _Close(self.reset)


class SseStall(_SseToxic):
    """``hits`` counts responses stalled."""

    kind = "sse_stall"

    def __init__(self, after_events: int = 0, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.after_events = after_events

    async def event(self, conn: _Conn, resp: _Response, event: bytes) -> bytes | None:
        if self.picks_response(resp) and resp.events >= self.after_events and not self.is_removed:
            self.hits += 1
            await self.hold()
        return event


class SseCorrupt(_SseToxic):
    """Changes ``token_ids[index]`` of ``count`` token-carrying events per response, from event
    ``after_events`` on, to ``(id + 1) % vocab_size``. ``hits`` counts events changed."""

    kind = "sse_corrupt"

    def __init__(self, after_events: int = 0, count: int = 1, index: int = 0, vocab_size: int = VOCAB_SIZE,
                 **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.after_events = after_events
        self.count = count
        self.index = index
        self.vocab_size = vocab_size
        self._done: dict[int, int] = {}
        self.changed: list[tuple[int, int]] = []  # (old id, new id), for verify and tests

    async def event(self, conn: _Conn, resp: _Response, event: bytes) -> bytes | None:
        if (not self.picks_response(resp) or resp.events < self.after_events
                or self._done.get(resp.id, 0) >= self.count):
            return event
        lines = event.split(b"\n")
        for i, line in enumerate(lines):
            if not line.startswith(b"data:") or line[5:].strip() in (b"", b"[DONE]"):
                continue
            try:
                body = json.loads(line[5:])
            except ValueError:
                return event
            choices = body.get("choices") if isinstance(body, dict) else None
            ids = choices[0].get("token_ids") if choices and isinstance(choices[0], dict) else None
            if not ids or not -len(ids) <= self.index < len(ids):
                return event
            old = ids[self.index]
            ids[self.index] = (old + 1) % self.vocab_size
            self.changed.append((old, ids[self.index]))
            lines[i] = b"data: " + json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
            self._done[resp.id] = self._done.get(resp.id, 0) + 1
            self.hits += 1
            return b"\n".join(lines)
        return event


class SseDropDone(_SseToxic):
    """``hits`` counts ``[DONE]`` events dropped."""

    kind = "sse_drop_done"

    async def event(self, conn: _Conn, resp: _Response, event: bytes) -> bytes | None:
        if self.picks_response(resp) and any(line.strip() == b"data: [DONE]" for line in event.split(b"\n")):
            self.hits += 1
            return None
        return event


# -- HTTP responses and SSE events ---------------------------------------------------------------------------


@dataclass
class _Response:
    id: int
    status: int
    sse: bool
    mode: Literal["none", "chunked", "length", "eof"]
    rewrite: bool
    events: int = 0  # events delivered
    pending: bytearray = field(default_factory=bytearray)  # SSE bytes not yet a whole event
    trailer: bytearray = field(default_factory=bytearray)


class _HttpDownstream:
    """Incremental HTTP/1.1 response parser; SSE responses go through the SSE toxics event by event."""

    def __init__(self, conn: _Conn) -> None:
        self.conn = conn
        self.buf = bytearray()
        self.state = "head"
        self.raw = False
        self.resp: _Response | None = None
        self.left = 0
        self._length = 0

    async def feed(self, data: bytes) -> AsyncIterator[bytes]:
        if self.raw:
            yield data
            return
        self.buf += data
        while True:
            if self.state == "head":
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(self.buf) > 65536:
                        self.raw = True
                        yield bytes(self.buf)
                        self.buf.clear()
                    return
                head = bytes(self.buf[:end + 4])
                del self.buf[:end + 4]
                resp = self._parse_head(head)
                if resp is None:
                    self.raw = True
                    yield head + bytes(self.buf)
                    self.buf.clear()
                    return
                self.conn.proxy.stats.responses += 1
                yield head
                self.resp = resp
                self.state = {"none": "head", "chunked": "size", "length": "length", "eof": "eof"}[resp.mode]
                self.left = self._length if resp.mode == "length" else 0
                if resp.mode == "length" and self.left == 0:
                    self.state = "head"
            elif self.state == "length":
                if not self.buf:
                    return
                yield self._take()
                if self.left == 0:
                    self.state = "head"
            elif self.state == "eof":
                if not self.buf:
                    return
                piece = bytes(self.buf)
                self.buf.clear()
                async for out in self._body(piece):
                    yield out
                return
            elif self.state == "size":
                end = self.buf.find(b"\r\n")
                if end < 0:
                    return
                line = bytes(self.buf[:end])
                try:
                    size = int(line.split(b";")[0].strip(), 16)
                except ValueError:
                    self.raw = True
                    yield bytes(self.buf)
                    self.buf.clear()
                    return
                assert self.resp is not None
                if not self.resp.rewrite:
                    yield bytes(self.buf[:end + 2])
                del self.buf[:end + 2]
                if size == 0:
                    self.state = "trailer"
                else:
                    self.state, self.left = "data", size
            elif self.state == "data":
                if not self.buf:
                    return
                async for out in self._body(self._take()):
                    yield out
                if self.left == 0:
                    self.state = "crlf"
            elif self.state == "crlf":
                if len(self.buf) < 2:
                    return
                assert self.resp is not None
                if not self.resp.rewrite:
                    yield bytes(self.buf[:2])
                del self.buf[:2]
                self.state = "size"
            elif self.state == "trailer":
                end = self.buf.find(b"\r\n")
                if end < 0:
                    return
                line = bytes(self.buf[:end + 2])
                del self.buf[:end + 2]
                assert self.resp is not None
                if not self.resp.rewrite:
                    yield line
                else:
                    self.resp.trailer += line
                if line == b"\r\n":
                    if self.resp.rewrite:
                        if self.resp.pending:  # a last event without its blank line
                            rest = bytes(self.resp.pending)
                            self.resp.pending.clear()
                            yield self._frame(rest)
                        yield b"0\r\n" + bytes(self.resp.trailer)
                    self.state = "head"

    def _take(self) -> bytes:
        """Up to ``left`` buffered bytes of the body (or of the chunk), taken off the buffer."""
        n = min(self.left, len(self.buf))
        piece = bytes(self.buf[:n])
        del self.buf[:n]
        self.left -= n
        return piece

    def _parse_head(self, head: bytes) -> _Response | None:
        try:
            lines = head.decode("latin-1").split("\r\n")
            version, status_s, *_ = lines[0].split(" ", 2)
            if not version.startswith("HTTP/1."):
                return None
            status = int(status_s)
        except (ValueError, UnicodeDecodeError):
            return None
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        sse = headers.get("content-type", "").lower().startswith("text/event-stream")
        mode: Literal["none", "chunked", "length", "eof"]
        self._length = 0
        if 100 <= status < 200 or status in (204, 304):
            mode = "none"
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            mode = "chunked"
        elif "content-length" in headers:
            mode = "length"
            try:
                self._length = int(headers["content-length"])
            except ValueError:
                return None
        else:
            mode = "eof"
        rewrite = sse and mode in ("chunked", "eof")
        return _Response(next(_ids), status, sse, mode, rewrite)

    def _frame(self, payload: bytes) -> bytes:
        assert self.resp is not None
        if self.resp.mode == "chunked":
            return f"{len(payload):x}\r\n".encode() + payload + b"\r\n"
        return payload

    async def _body(self, piece: bytes) -> AsyncIterator[bytes]:
        resp = self.resp
        assert resp is not None
        if not resp.rewrite:
            yield piece
            return
        resp.pending += piece
        while True:
            cut = _event_end(resp.pending)
            if cut < 0:
                return
            event = bytes(resp.pending[:cut])
            del resp.pending[:cut]
            toxics = [t for t in self.conn.proxy._active("downstream", sse=True)]
            out: bytes | None = event
            for t in toxics:
                out = await t.event(self.conn, resp, out) if out is not None else None
                if out is None:
                    break
            if out is None:
                continue
            yield self._frame(out)
            resp.events += 1
            self.conn.proxy.stats.sse_events += 1
            for t in toxics:
                await t.delivered(self.conn, resp)


def _event_end(buf: bytearray) -> int:
    """End (exclusive, separator included) of the first complete SSE event in ``buf``, or -1."""
    ends = [i + n for sep, n in ((b"\n\n", 2), (b"\r\n\r\n", 4), (b"\r\r", 2)) if (i := buf.find(sep)) >= 0]
    return min(ends) if ends else -1
