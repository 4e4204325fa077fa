"""Who the router lets in. API keys on its public API (routing.api_keys_file): the official openai client with
its key, 401s without one, a per-key concurrency limit (429) that frees its slot when a stream ends or its client
goes away, and keys that never reach the logs. And a bound on what one router holds (routing.max_in_flight):
more is shed with 503, counted. A real router process, real etcd and broker, a simulated worker."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from testkit import checkpointed, fleet_sim

from fleetward.chaos.harness import TestFleet
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.errors import ConfigError
from fleetward.migration.apikeys import ApiKeys

pytestmark = pytest.mark.asyncio(loop_scope="module")

SIM = fleet_sim(seed=5)
ONE = "sk-one-" + "a" * 24  # at most one request in flight
MANY = "sk-many-" + "b" * 24  # listed by its SHA-256: no limit


def keys_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    os.chmod(path, mode)
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def keyed(etcd_endpoint: str, broker_endpoint: str,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[TestFleet, str]]:
    run_dir = tmp_path_factory.mktemp("router-keys")
    path = keys_file(run_dir / "keys.yaml", f"keys:\n  - name: one\n    key: {ONE}\n    max_concurrency: 1\n"
                     f"  - name: many\n    key_sha256: {hashlib.sha256(MANY.encode()).hexdigest()}\n")
    async with TestFleet(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster="router-keys", run_dir=run_dir,
                         workers=1, backend=SimBackend(SIM)) as fleet:
        router = await fleet.start_router("keyed", api_keys_file=path)
        yield fleet, router.url


async def metric(url: str, name: str) -> float:
    async with httpx.AsyncClient() as client:
        text = (await client.get(url + "/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def test_the_openai_client_works_with_its_key_and_is_refused_without_one(keyed: tuple[TestFleet, str]) -> None:
    fleet, url = keyed
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=ONE, max_retries=0)
    done = await client.completions.create(model="sim-tiny", prompt="hello", max_tokens=8)
    assert done.choices[0].text and done.usage is not None and done.usage.completion_tokens == 8
    stream = await client.chat.completions.create(model="sim-tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=6, stream=True)
    assert [c async for c in stream]
    missing = await metric(url, 'fleetward_router_auth_failures_total{reason="missing"}')
    wrong = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-not-a-key-" + "c" * 20, max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
        await wrong.completions.create(model="sim-tiny", prompt="hello", max_tokens=2)
    async with httpx.AsyncClient(base_url=url) as http:
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
            r = await http.request(method, path, json={"model": "sim-tiny", "prompt": "x", "max_tokens": 1})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (path, r.text)
            assert r.json()["error"]["type"] == "AuthenticationError" and "missing API key" in r.text
        assert (await http.get("/health")).status_code == 200, "health stays open (load balancers probe it)"
    assert await metric(url, 'fleetward_router_auth_failures_total{reason="missing"}') == missing + 3
    log = (fleet.log_dir / "keyed.log").read_text()
    assert ONE not in log and MANY not in log, "keys never in the router's log"


async def test_a_key_at_its_concurrency_limit_gets_429_and_its_slot_comes_back(keyed: tuple[TestFleet, str],
                                                                                 wait_until: Any) -> None:
    _, url = keyed
    body = {"model": "sim-tiny", "prompt": "a long one", "max_tokens": 4000, "stream": True}
    small = {"model": "sim-tiny", "prompt": "short", "max_tokens": 2}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        async with http.stream("POST", "/v1/completions", json=body,
                               headers={"Authorization": f"Bearer {ONE}"}) as held:
            assert held.status_code == 200
            await anext(held.aiter_bytes())  # the stream runs: the key's one slot is taken
            r = await http.post("/v1/completions", json=small, headers={"Authorization": f"Bearer {ONE}"})
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["type"] == "RateLimitError" and "'one'" in r.text
            r = await http.post("/v1/completions", json=small, headers={"Authorization": f"Bearer {MANY}"})
            assert r.status_code == 200, "another key is not held up by this one's limit"
        # The client went away mid-stream: the slot is free again.

        async def accepted() -> bool:
            r = await http.post("/v1/completions", json=small, headers={"Authorization": f"bearer {ONE}"})
            return r.status_code == 200

        await wait_until(accepted, timeout=10, message="the key's slot freed once its client went away")
    assert await metric(url, 'fleetward_router_api_key_requests_total{key="one",result="over_limit"}') >= 1


EVENT_IDS = {"X-Fleetward-Event-Ids": "1"}


async def _events(lines: AsyncIterator[str], n: int | None = None) -> list[str]:
    """The next SSE ids in a response's ``lines`` (``<request id>:<tokens held>``): ``n`` of them, or all."""
    ids: list[str] = []
    async for line in lines:
        if line.startswith("id: "):
            ids.append(line[4:])
            if len(ids) == n:
                break
    return ids


async def test_only_the_key_that_started_a_stream_may_resume_it(keyed: tuple[TestFleet, str], wait_until: Any) -> None:
    fleet, url = keyed
    body = {"model": "sim-tiny", "prompt": "whose stream is it", "max_tokens": 400, "stream": True}
    # The resume points come from the streams' event ids (asked for: vLLM's streams carry none).
    owner, other = {"Authorization": f"Bearer {MANY}", **EVENT_IDS}, {"Authorization": f"Bearer {ONE}"}
    other_router = (await fleet.start_router("keyed-2", api_keys_file=fleet.run_dir / "keys.yaml")).url
    async with httpx.AsyncClient(timeout=60) as http:
        # On the router that holds it, while its client still reads: another key cannot take it over.
        async with http.stream("POST", url + "/v1/completions", json=body, headers=owner) as held:
            assert held.status_code == 200
            lines = held.aiter_lines()
            last = (await _events(lines, 2))[-1]
            r = await http.post(url + "/v1/completions", json=body, headers={**other, "Last-Event-ID": last})
            assert r.status_code == 404 and "unknown" in r.json()["error"]["message"], r.text
            rest = await _events(lines)
            assert rest[-1].endswith(":400"), "the owner's stream ran to its end, not taken over"
        # Through another router, from the checkpoint, after the owner's client went away.
        async with http.stream("POST", url + "/v1/completions", json=body, headers=owner) as gone:
            last = (await _events(gone.aiter_lines(), 2))[-1]

        await wait_until(lambda: checkpointed(fleet, last.rpartition(":")[0]), timeout=10,
                         message="the request checkpointed")
        for headers, status in (({}, 401), (other, 404), (owner, 200)):
            async with http.stream("POST", other_router + "/v1/completions", json=body,
                                   headers={**headers, "Last-Event-ID": last}) as r:
                assert r.status_code == status, (headers, await r.aread())
                if status == 200:
                    assert (await _events(r.aiter_lines()))[-1].endswith(":400"), "the owner resumed it to its end"


async def test_a_keys_file_is_checked_before_the_router_serves(tmp_path: Path) -> None:
    ok = keys_file(tmp_path / "ok.yaml", f"keys:\n  - name: one\n    key: {ONE}\n")
    keys = ApiKeys.load(ok, default_limit=4)
    got = keys.check(f"Bearer {ONE}")
    assert not isinstance(got, str) and got.name == "one" and got.limit == 4
    assert keys.check(None) == "missing" and keys.check("Basic abc") == "missing"
    assert keys.check(f"Bearer {ONE}x") == "wrong"
    with pytest.raises(ConfigError, match="readable by others"):
        ApiKeys.load(keys_file(tmp_path / "open.yaml", ok.read_text(), mode=0o644))
    bad = keys_file(tmp_path / "bad.yaml", f"keys:\n  - name: one\n    key: {ONE}\n  - name: two\n"
                    "    max_concurrency: -1\n    key: short\n")
    with pytest.raises(ConfigError) as err:
        ApiKeys.load(bad)
    assert str(err.value).startswith(f"{bad}:6: keys[1].key") and "line 5: keys[1].max_concurrency" in str(err.value)
    assert "short" not in str(err.value), "a key is never echoed, even a wrong one"
    twice = keys_file(tmp_path / "twice.yaml", f"keys:\n  - name: a\n    key: {ONE}\n  - name: b\n    key: {ONE}\n")
    with pytest.raises(ConfigError, match="listed twice"):
        ApiKeys.load(twice)


async def test_a_router_at_max_in_flight_sheds_new_requests_with_503_and_counts_them(
        keyed: tuple[TestFleet, str], wait_until: Any) -> None:
    fleet, _ = keyed
    bounded = await fleet.start_router("bounded", max_in_flight=1, detached_grace_s=1.0)
    url = bounded.url
    body = {"model": "sim-tiny", "prompt": "a long one", "max_tokens": 4000, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        async with http.stream("POST", "/v1/completions", json=body) as held:
            assert held.status_code == 200
            await anext(held.aiter_bytes())
            r = await http.post("/v1/completions", json={"model": "sim-tiny", "prompt": "x", "max_tokens": 2})
            assert r.status_code == 503 and r.headers["retry-after"] == "1" and "max_in_flight" in r.text
        assert await metric(url, 'fleetward_router_shed_total{reason="in_flight"}') == 1

        async def accepted() -> bool:
            r = await http.post("/v1/completions", json={"model": "sim-tiny", "prompt": "x", "max_tokens": 2})
            return r.status_code == 200

        # The client left: its stream stays resumable for detached_grace_s, then the router lets it go.
        await wait_until(accepted, timeout=30, message="room again once the left stream is let go")
    await fleet.stop_router(bounded)
