"""The fault proxy on real sockets: every toxic observable from a client, SSE toxics on a real sim worker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
import pytest_asyncio
import uvicorn

from fleetward.chaos.net import (
    Bandwidth,
    Blackhole,
    Latency,
    LimitData,
    Partition,
    Proxy,
    ProxyRegistry,
    Reset,
    Slicer,
    SlowClose,
    SseCorrupt,
    SseCut,
    SseDropDone,
    SseStall,
)
from fleetward.chaos.workload import sse_lines
from fleetward.fleet.config import SimConfig
from fleetward.fleet.procs import free_port
from fleetward.sim.model import SimModel
from fleetward.sim.server import create_app

pytestmark = pytest.mark.asyncio(loop_scope="module")

SIM = SimConfig(decode_step_ms=2.0, decode_ms_per_seq=0.0, prefill_ms_per_token=0.0, seed=3)
MODEL = SimModel(seed=SIM.seed)


class Echo:
    """A TCP server that echoes, counts connections and keeps what it received."""

    def __init__(self) -> None:
        self.connections = 0
        self.received = bytearray()
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> Echo:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                self.received += data
                writer.write(data)
                await writer.drain()
        writer.close()

    async def aclose(self) -> None:
        assert self.server is not None
        self.server.close()
        for w in self.writers:
            w.close()


@pytest_asyncio.fixture(loop_scope="module")
async def echo() -> AsyncIterator[Echo]:
    e = await Echo().start()
    yield e
    await e.aclose()


@pytest_asyncio.fixture(loop_scope="module")
async def proxy(echo: Echo) -> AsyncIterator[Proxy]:
    async with Proxy("echo", ("127.0.0.1", echo.port)) as p:
        yield p


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sim_url() -> AsyncIterator[str]:
    """A simulated worker served by uvicorn in this event loop (real HTTP/1.1, chunked SSE)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(SIM, admin_token="t"), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve())
    for _ in range(2000):  # until uvicorn listens (at most 20 s)
        if server.started:
            break
        await asyncio.sleep(0.01)
    assert server.started
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    await task


@pytest_asyncio.fixture(loop_scope="module")
async def http_proxy(sim_url: str) -> AsyncIterator[Proxy]:
    port = int(sim_url.rsplit(":", 1)[1])
    async with Proxy("sim", ("127.0.0.1", port), http=True) as p:
        yield p


async def roundtrip(p: Proxy, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(p.host, p.port)
    writer.write(payload)
    await writer.drain()
    got = await reader.readexactly(len(payload))
    writer.close()
    return got


# -- byte toxics ---------------------------------------------------------------------------------------------


async def test_data_passes_unchanged_and_is_counted(proxy: Proxy, echo: Echo) -> None:
    assert await roundtrip(proxy, b"hello" * 1000) == b"hello" * 1000
    assert proxy.stats.connections_total == 1
    assert proxy.stats.bytes_out["upstream"] == proxy.stats.bytes_out["downstream"] == 5000


async def test_latency_delays_the_delayed_link_behind_a_clean_one(echo: Echo) -> None:
    async with Proxy("slow", ("127.0.0.1", echo.port)) as slow, Proxy("fast", ("127.0.0.1", echo.port)) as fast:
        toxic = slow.add(Latency(300, direction="downstream"))
        order: list[str] = []

        async def one(p: Proxy) -> None:
            await roundtrip(p, b"ping")
            order.append(p.name)

        await asyncio.gather(one(slow), one(fast))
        assert order == ["fast", "slow"]
        assert toxic.hits >= 1


async def test_latency_keeps_order_and_pipelines_pieces(proxy: Proxy) -> None:
    proxy.add(Latency(50, jitter_ms=40, direction="both", seed=1))
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    for i in range(20):
        writer.write(f"{i:02d}".encode())
        await writer.drain()
    got = await reader.readexactly(40)
    writer.close()
    assert got == b"".join(f"{i:02d}".encode() for i in range(20))


async def test_bandwidth_makes_a_big_transfer_finish_after_a_small_one(echo: Echo) -> None:
    async with Proxy("thin", ("127.0.0.1", echo.port)) as thin, Proxy("fat", ("127.0.0.1", echo.port)) as fat:
        toxic = thin.add(Bandwidth(20_000, direction="downstream"))
        order: list[str] = []

        async def one(p: Proxy, n: int) -> None:
            assert await roundtrip(p, b"x" * n) == b"x" * n
            order.append(p.name)

        await asyncio.gather(one(thin, 10_000), one(fat, 200_000))
        assert order == ["fat", "thin"], "10 kB at 20 kB/s arrive after 200 kB unthrottled"
        assert toxic.hits == 10_000


async def test_slicer_delivers_small_pieces(proxy: Proxy) -> None:
    toxic = proxy.add(Slicer(average_size=4, size_variation=2, delay_ms=3, direction="downstream", seed=2))
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    writer.write(b"abcdefghijklmnopqrstuvwxyz0123456789")
    await writer.drain()
    pieces: list[bytes] = []
    while sum(map(len, pieces)) < 36:
        pieces.append(await reader.read(65536))
    writer.close()
    assert b"".join(pieces) == b"abcdefghijklmnopqrstuvwxyz0123456789"
    assert len(pieces) > 1 and max(map(len, pieces)) <= 6
    assert toxic.hits >= 6


async def test_reset_breaks_open_and_new_connections(proxy: Proxy) -> None:
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    writer.write(b"before")
    await reader.readexactly(6)
    toxic = proxy.add(Reset())
    with pytest.raises(ConnectionResetError):
        await reader.read(100)
        await reader.read(100)
    with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
        await roundtrip(proxy, b"after")
    assert toxic.hits >= 2
    proxy.remove(toxic)
    assert await roundtrip(proxy, b"again") == b"again"


async def test_blackhole_swallows_and_times_out_without_reaching_the_server(proxy: Proxy, echo: Echo) -> None:
    toxic = proxy.add(Blackhole(timeout_ms=100))
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    writer.write(b"into the void")
    await writer.drain()
    assert await reader.read(100) == b"", "closed after the timeout, nothing delivered"
    assert toxic.hits == len(b"into the void")
    assert echo.connections == 0 and not echo.received
    proxy.remove(toxic)
    assert await roundtrip(proxy, b"back") == b"back"


async def test_limit_data_closes_after_exactly_n_bytes(proxy: Proxy) -> None:
    toxic = proxy.add(LimitData(10, direction="downstream"))
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    writer.write(b"0123456789abcdefghij")
    await writer.drain()
    assert await reader.read() == b"0123456789"
    assert toxic.hits == 1


async def test_slow_close_passes_the_close_on_after_a_clean_one(echo: Echo) -> None:
    async with Proxy("slowclose", ("127.0.0.1", echo.port)) as slow, \
            Proxy("plain", ("127.0.0.1", echo.port)) as plain:
        toxic = slow.add(SlowClose(300, direction="downstream"))
        order: list[str] = []

        async def one(p: Proxy) -> None:
            reader, writer = await asyncio.open_connection(p.host, p.port)
            writer.write(b"bye")
            await reader.readexactly(3)
            writer.write_eof()  # the echo server closes in turn; its FIN comes back through the proxy
            assert await reader.read() == b""
            order.append(p.name)

        await asyncio.gather(one(slow), one(plain))
        assert order == ["plain", "slowclose"]
        assert toxic.hits == 1


@pytest.mark.parametrize("direction", ["both", "upstream", "downstream"])
async def test_a_partition_holds_data_and_loses_none(proxy: Proxy, echo: Echo, direction: str,
                                                     wait_until: Any) -> None:
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    writer.write(b"warm")
    await reader.readexactly(4)
    toxic = proxy.add(Partition(direction=direction))
    writer.write(b"held")
    await writer.drain()
    await wait_until(lambda: toxic.hits >= 1, message="the partition held a piece")
    if direction == "downstream":
        await wait_until(lambda: bytes(echo.received) == b"warmheld", message="requests still arrive one way")
    else:
        assert bytes(echo.received) == b"warm", "nothing crossed the partition"
    read = asyncio.ensure_future(reader.readexactly(4))
    # The piece the client waits for is held (counted in hits): a partition that let it through would have
    # delivered it by now, and the read completes within the grace period. A hold never does.
    done, _ = await asyncio.wait({read}, timeout=0.3)
    assert not done, "a piece crossed the partition"
    proxy.remove(toxic)
    assert await read == b"held"
    writer.close()
    assert bytes(echo.received) == b"warmheld"


async def test_a_new_connection_waits_for_the_partition_to_heal(proxy: Proxy, echo: Echo, wait_until: Any) -> None:
    toxic = proxy.add(Partition())
    trip = asyncio.ensure_future(roundtrip(proxy, b"late"))
    await wait_until(lambda: toxic.hits >= 1)
    assert echo.connections == 0
    proxy.remove(toxic)
    assert await trip == b"late"
    assert echo.connections == 1


async def test_disable_refuses_connections_and_enable_restores_them(proxy: Proxy) -> None:
    await proxy.disable()
    with pytest.raises(OSError):
        await asyncio.open_connection(proxy.host, proxy.port)
    await proxy.enable()
    assert await roundtrip(proxy, b"up") == b"up"


async def test_a_proxy_fails_over_to_the_next_upstream(echo: Echo) -> None:
    dead = free_port()
    async with Proxy("failover", [("127.0.0.1", dead), ("127.0.0.1", echo.port)]) as p:
        assert await roundtrip(p, b"alive") == b"alive"


async def test_links_are_found_by_glob_and_fault_all_their_proxies(echo: Echo) -> None:
    reg = ProxyRegistry()
    try:
        a = await reg.add("agent->etcd", [("127.0.0.1", echo.port)] * 3, per_upstream=True)
        await reg.add("r0->etcd", ("127.0.0.1", echo.port))
        await reg.add("r0->broker", ("127.0.0.1", echo.port))
        assert [k.name for k in reg.select("*->etcd")] == ["agent->etcd", "r0->etcd"]
        assert len(a.proxies) == 3
        toxic = a.add(Reset())
        for p in a.proxies:
            assert toxic in p.toxics
        a.remove(toxic)
        assert not a.toxics
    finally:
        await reg.aclose()


# -- HTTP and SSE -----------------------------------------------------------------------------------------


async def stream(url: str, prompt: list[int], n: int) -> tuple[list[str], list[int], Exception | None]:
    """(raw SSE data payloads, token ids, the error that ended the stream if any)."""
    events: list[str] = []
    tokens: list[int] = []
    body = {"model": SIM.model_name, "prompt": prompt, "max_tokens": n, "stream": True, "return_token_ids": True}
    try:
        async with httpx.AsyncClient(timeout=30) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in sse_lines(r.aiter_bytes()):
                if line.startswith("data: "):
                    events.append(line[6:])
                    if line != "data: [DONE]":
                        tokens += orjson.loads(line[6:])["choices"][0]["token_ids"]
    except httpx.HTTPError as exc:
        return events, tokens, exc
    return events, tokens, None


async def test_http_keep_alive_and_plain_bodies_pass_through(http_proxy: Proxy) -> None:
    async with httpx.AsyncClient(timeout=10) as c:
        for _ in range(3):
            assert (await c.get(http_proxy.url + "/health")).status_code == 200
        models = (await c.get(http_proxy.url + "/v1/models")).json()
    assert models["data"][0]["id"] == SIM.model_name
    assert http_proxy.stats.connections_total == 1 and http_proxy.stats.responses == 4


async def test_an_sse_stream_passes_exactly(http_proxy: Proxy) -> None:
    events, tokens, err = await stream(http_proxy.url, [5, 6, 7], 30)
    assert err is None and tokens == MODEL.continuation([5, 6, 7], 30) and events[-1] == "[DONE]"


async def test_sse_cut_delivers_exactly_n_events_then_eof(http_proxy: Proxy) -> None:
    toxic = http_proxy.add(SseCut(after_events=5))
    events, tokens, err = await stream(http_proxy.url, [8, 9], 30)
    assert len(events) == 5 and tokens == MODEL.continuation([8, 9], 30)[:5]
    assert isinstance(err, httpx.RemoteProtocolError), "the body ends unfinished"
    assert toxic.hits == 1


async def test_sse_corrupt_changes_one_token_id(http_proxy: Proxy) -> None:
    toxic = SseCorrupt(after_events=3)
    http_proxy.add(toxic)
    _, tokens, err = await stream(http_proxy.url, [10, 11], 12)
    expected = MODEL.continuation([10, 11], 12)
    assert err is None
    assert [i for i, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b] == [3]
    assert toxic.changed == [(expected[3], tokens[3])]


async def test_sse_drop_done_ends_the_stream_without_it(http_proxy: Proxy) -> None:
    toxic = http_proxy.add(SseDropDone())
    events, tokens, err = await stream(http_proxy.url, [12], 6)
    assert err is None and "[DONE]" not in events and tokens == MODEL.continuation([12], 6)
    assert toxic.hits == 1


async def test_sse_stall_holds_events_and_loses_none(http_proxy: Proxy, wait_until: Any) -> None:
    toxic = http_proxy.add(SseStall(after_events=4))
    task = asyncio.ensure_future(stream(http_proxy.url, [13, 14], 20))
    await wait_until(lambda: toxic.hits == 1, message="the stream stalled")
    assert not task.done() and http_proxy.stats.sse_events == 4
    http_proxy.remove(toxic)
    events, tokens, err = await task
    assert err is None and tokens == MODEL.continuation([13, 14], 20) and events[-1] == "[DONE]"


async def test_sse_toxics_limited_to_some_streams(http_proxy: Proxy) -> None:
    http_proxy.add(SseCut(after_events=2, streams=1))
    first = await stream(http_proxy.url, [15], 10)
    second = await stream(http_proxy.url, [15], 10)
    assert len(first[0]) == 2 and first[2] is not None
    assert second[2] is None and second[1] == MODEL.continuation([15], 10)


async def test_sse_toxics_need_an_http_proxy(proxy: Proxy) -> None:
    with pytest.raises(ValueError, match="HTTP-aware"):
        proxy.add(SseCut(after_events=1))
