"""The router's stream client (migration/upstream.py) against a small HTTP/1.1 server in the test: bytes split
anywhere, kept-alive connections the server closed, an idle one closed on time, failures before and during a
response, a connection reset before the request is written (on uvloop too, the router's loop)."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
import pytest
import uvloop

from fleetward.migration import upstream as upstream_module
from fleetward.migration.upstream import Chunk, Upstream, UpstreamError, UpstreamStream

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]


def sse(*events: bytes) -> bytes:
    """A chunked SSE body: one chunk per event, then the last chunk."""
    out = b""
    for e in events:
        out += b"%x\r\n%s\r\n" % (len(e), e)
    return out + b"0\r\n\r\n"


def event(token: int, finish: str | None = None) -> bytes:
    chunk = {"choices": [{"index": 0, "text": "x", "token_ids": [token], "finish_reason": finish}]}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
BODY = HEAD + sse(event(1), event(2), event(3, "length"), b"data: [DONE]\n\n")


async def read_request(reader: asyncio.StreamReader) -> bool:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    await reader.readexactly(length)
    return True


@pytest.fixture
async def server() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> str:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            n = 0
            try:
                while await read_request(reader):
                    n += 1
                    if not await handler(reader, writer, n):
                        break
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        srv = await asyncio.start_server(serve, "127.0.0.1", 0)
        servers.append(srv)
        return f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"

    yield start
    for srv in servers:
        srv.close()
        await srv.wait_closed()


@pytest.fixture
async def up() -> AsyncIterator[Upstream]:
    client = Upstream()
    await client.start()
    try:
        yield client
    finally:
        await client.aclose()


class Collect:
    """A sink that keeps the token ids, as the router's relay records them."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.opens = 0

    def opened(self, stream: UpstreamStream) -> None:
        self.opens += 1

    def chunk(self, chunk: Chunk) -> bool:
        self.ids += chunk.token_ids
        return chunk.finish_reason is not None

    def flush(self) -> None:
        pass


async def tokens(up: Upstream, url: str, got: Collect | None = None) -> list[int]:
    sink = got or Collect()
    await up.stream(url, "/v1/completions", {"prompt": [1]}, UpstreamStream("w", sink))
    return sink.ids


async def test_bytes_split_anywhere_give_the_same_chunks(server: Callable[[Handler], Awaitable[str]],
                                                         up: Upstream) -> None:
    async def trickle(_: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        for k in range(0, len(BODY), 7):  # 7 bytes at a time: events, chunk sizes and CRLFs split
            writer.write(BODY[k : k + 7])
            await writer.drain()
        return True

    url = await server(trickle)
    assert await tokens(up, url) == [1, 2, 3]
    assert await tokens(up, url) == [1, 2, 3], "and again on the kept-alive connection"


async def test_a_kept_alive_connection_the_server_closed_is_replaced(
        server: Callable[[Handler], Awaitable[str]], up: Upstream) -> None:
    """The server answers one request per connection, then closes it on the next request without a word:
    the request goes again on a fresh connection instead of failing."""
    connections = 0

    async def once(_: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        nonlocal connections
        if n > 1:
            return False  # closes without answering
        connections += 1
        writer.write(BODY)
        await writer.drain()
        return True

    url = await server(once)
    for _ in range(3):
        assert await tokens(up, url) == [1, 2, 3]
    assert connections == 3


async def test_a_connection_lost_mid_stream_is_a_reset(server: Callable[[Handler], Awaitable[str]],
                                                       up: Upstream) -> None:
    async def dies(_: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(HEAD + b"%x\r\n%s\r\n" % (len(event(1)), event(1)))
        await writer.drain()
        return False

    url = await server(dies)
    got = Collect()
    with pytest.raises(UpstreamError) as err:
        await tokens(up, url, got)
    assert err.value.kind == "reset" and got.ids == [1]


async def test_an_error_status_and_a_silent_close_before_answering(
        server: Callable[[Handler], Awaitable[str]], up: Upstream) -> None:
    async def busy(_: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        body = orjson.dumps({"error": {"message": "the engine is dead", "code": 503}})
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        return True

    async def mute(_: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        return False

    with pytest.raises(UpstreamError) as err:
        await tokens(up, await server(busy))
    assert (err.value.kind, err.value.status, err.value.message) == ("status", 503, "the engine is dead")
    with pytest.raises(UpstreamError) as err:
        await tokens(up, await server(mute))
    assert err.value.kind == "connect" and "closed the connection before answering" in err.value.message


async def test_an_idle_kept_alive_connection_is_closed_on_time_and_an_abort_closes_a_stream(
        server: Callable[[Handler], Awaitable[str]], up: Upstream, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pooled connection is closed once idle for IDLE_S, whether or not another request comes (the worker may
    be gone); an aborted stream fails as ``aborted`` and its connection closes (the worker cancels)."""
    monkeypatch.setattr(upstream_module, "IDLE_S", 0.2)
    closed = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(BODY)
        await writer.drain()
        if await reader.read(1) == b"":  # the router's next request, or its close
            closed.set()
            return False
        return True

    url = await server(answer)
    assert await tokens(up, url) == [1, 2, 3]
    await asyncio.wait_for(closed.wait(), 5)

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(HEAD + b"%x\r\n%s\r\n" % (len(event(1)), event(1)))
        await writer.drain()
        await reader.read(1)  # until the router closes
        closed.set()
        return False

    closed.clear()
    sink = Collect()
    stream = UpstreamStream("w", sink)
    task = asyncio.ensure_future(up.stream(await server(endless), "/v1/completions", {}, stream))
    while not sink.ids:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    stream.abort("stalled: test")
    with pytest.raises(UpstreamError) as err:
        await task
    assert (err.value.kind, err.value.message, sink.opens) == ("aborted", "stalled: test", 1)
    await asyncio.wait_for(closed.wait(), 5)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_connection_closed_before_the_request_is_written_fails_as_not_answered(loop: str) -> None:
    """The worker (or a reset on the link) closes a fresh connection before the router writes its request. On
    uvloop, the router's loop, a write to a closed transport raises; the request must fail as ``connect`` (the
    router then tries another worker), never as the router's own error (a 500 to the client)."""

    async def scenario() -> None:
        async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            linger = struct.pack("ii", 1, 0)  # a reset, not a FIN: what the fault proxy's network.reset does
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
            writer.close()

        srv = await asyncio.start_server(hang_up, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        up = Upstream()
        await up.start()
        connect = up._connect

        async def connected_then_closed(url: str, key: tuple[str, str, int]) -> upstream_module._Conn:
            conn = await connect(url, key)
            while not conn.closed:  # noqa: ASYNC110
                await asyncio.sleep(0.005)  # until the reset arrived, before the request is written
            return conn

        up._connect = connected_then_closed  # type: ignore[method-assign]
        try:
            with pytest.raises(UpstreamError) as err:
                await tokens(up, url)
            assert err.value.kind == "connect" and "closed before the request was sent" in err.value.message
        finally:
            await up.aclose()
            srv.close()
            await srv.wait_closed()

    if loop == "uvloop":
        uvloop.run(scenario())
    else:
        asyncio.run(scenario())
