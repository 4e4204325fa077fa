"""What a client may not make the router hold or pass on (migration/guard.py), in-process: the body limit by
length and for a chunked body, and taking out worker-to-worker parameters. The router's own wiring of both is
tested as a process in test_router_dropin.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from starlette.types import Receive, Scope, Send

from fleetward.migration.guard import BodyLimit, without_transfer_params
from fleetward.migration.upstream import SseReader, UpstreamError


async def echo_length(scope: Scope, receive: Receive, send: Send) -> None:
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(size).encode()})


async def post(app: Any, content: Any) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://r") as client:
        return await client.post("/v1/completions", content=content)


async def test_a_body_over_the_limit_is_refused_by_its_length_or_as_it_comes() -> None:
    refused: list[int] = []
    app = BodyLimit(echo_length, limit=1000, refused=lambda: refused.append(1))

    async def chunks(n: int) -> AsyncIterator[bytes]:  # no Content-Length: chunked
        for _ in range(n):
            yield b"x" * 300

    assert (await post(app, b"x" * 1000)).text == "1000"
    assert (await post(app, chunks(3))).text == "900", "a chunked body within the limit reaches the app whole"
    for too_big in (b"x" * 1001, chunks(4)):
        r = await post(app, too_big)
        assert r.status_code == 413
        assert r.json()["error"]["code"] == 413 and "1000 bytes" in r.json()["error"]["message"]
    assert len(refused) == 2


@pytest.mark.parametrize(("body", "kept"), [
    ({"prompt": "x", "kv_transfer_params": {"remote_url": "http://a"}, "ec_transfer_params": {}}, {"prompt": "x"}),
    ({"prompt": "x", "max_tokens": 3}, None),
])
def test_transfer_params_are_taken_out_of_a_body_and_nothing_else(body: dict[str, Any],
                                                                   kept: dict[str, Any] | None) -> None:
    raw = orjson.dumps(body)
    out, taken = without_transfer_params(raw)
    if kept is None:
        assert out is raw and taken == []
    else:
        assert orjson.loads(out) == kept and sorted(taken) == ["ec_transfer_params", "kv_transfer_params"]
    assert without_transfer_params(b'["kv_transfer_params"]') == (b'["kv_transfer_params"]', [])
    assert without_transfer_params(b"not json kv_transfer_params") == (b"not json kv_transfer_params", [])


def test_a_workers_event_that_never_ends_is_a_broken_stream_not_the_routers_memory() -> None:
    reader = SseReader(max_event=1000)
    got: list[Any] = []
    reader.feed(b'data: {"choices": [{"index": 0, "text": "a", "token_ids": [1], "finish_reason": null}]}\n\n',
                got.append)
    assert len(got) == 1
    with pytest.raises(UpstreamError) as exc:
        for _ in range(5):
            reader.feed(b"data: " + b"y" * 300, got.append)
    assert exc.value.kind == "bad_chunk" and "1000 bytes" in str(exc.value)
