"""The router on real simulated workers, real etcd and a real broker: exact streams through failures."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import psutil
import pytest
import pytest_asyncio
from testkit import PATIENT_SUPERVISOR, checkpointed, fleet_sim, routed_fleet, signal_named

from fleetward.chaos.harness import RouterProcess, TestFleet
from fleetward.chaos.workload import sse_lines
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.config import RouterConfig
from fleetward.fleet.worker import HealthRecord, HealthState
from fleetward.migration.checkpoint import read_checkpoint
from fleetward.sim.model import SimModel
from fleetward.sim.tokenizer import encode, render_chat

pytestmark = pytest.mark.asyncio(loop_scope="module")

SIM = fleet_sim(seed=7)
MODEL = SimModel(seed=SIM.seed)
# Tests kill and hang workers on purpose, many times: the supervisor restarts them at once, never quarantines.


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(etcd_endpoint: str, broker_endpoint: str,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TestFleet]:
    routing = RouterConfig(stall_floor_s=0.5, checkpoint_interval_ms=50, checkpoint_ttl_s=10, detached_grace_s=10)
    async with routed_fleet(etcd_endpoint, broker_endpoint, tmp_path_factory.mktemp("router-fleet"), "router-tests",
                            SIM, routing=routing, supervisor=PATIENT_SUPERVISOR) as f:
        yield f


def router(fleet: TestFleet) -> RouterProcess:
    return fleet.routers[0]


async def stream_tokens(url: str, body: dict[str, Any], *, path: str = "/v1/completions",
                        headers: dict[str, str] | None = None,
                        on_tokens: Any = None) -> tuple[list[int], list[dict[str, Any]], list[str]]:
    """(token ids, every data object, every SSE id) of one streamed request.

    Checks every event's id on the way: ``<rid>:<n>`` must name exactly the tokens the client holds once
    it has that event (after a Last-Event-ID resume, counting the ones it had: ``first_n``).
    """
    tokens: list[int] = []
    events: list[dict[str, Any]] = []
    ids: list[str] = []
    held = int((headers or {}).get("Last-Event-ID", "x:0").rpartition(":")[2])
    async with httpx.AsyncClient(timeout=60) as client, client.stream(
            "POST", url + path, json={**body, "stream": True, "return_token_ids": True},
            headers={**EVENT_IDS, **(headers or {})}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in sse_lines(r.aiter_bytes()):
            if line.startswith("id: "):
                ids.append(line[4:])
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = orjson.loads(line[6:])
            events.append(data)
            for choice in data.get("choices") or []:
                new = choice.get("token_ids") or []
                tokens.extend(new)
                if on_tokens is not None and new:
                    await on_tokens(len(tokens))
            if ids and "choices" in data:
                assert ids[-1].endswith(f":{held + len(tokens)}"), (ids[-1], held + len(tokens))
    return tokens, events, ids


EVENT_IDS = {"X-Fleetward-Event-Ids": "1"}  # these tests check the ids (off by default: vLLM sends none)


def reference(prompt: list[int], n: int) -> list[int]:
    return MODEL.continuation(prompt, n)


def serving_worker(fleet: TestFleet, prompt: list[int]) -> str:
    """The worker the router's affinity sends this prompt to (with an idle fleet)."""
    from fleetward.migration.policy import LeastLoadedAffinity, prefix_key

    return LeastLoadedAffinity().choose([w for w in fleet.worker_ids if fleet.processes(w)], {}, prefix_key(prompt))


async def test_a_stream_without_faults_equals_the_model(healthy: TestFleet) -> None:
    prompt = encode("plain run: ")
    tokens, events, ids = await stream_tokens(router(healthy).url, {"model": "sim-tiny", "prompt": prompt,
                                                                      "max_tokens": 40})
    assert tokens == reference(prompt, 40)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert ids[-1].endswith(":40")
    assert len({e["id"] for e in events}) == 1


@pytest.mark.parametrize("fault", ["crash", "hang", "fail_inflight", "reset"])
async def test_a_stream_resumes_exactly_when_its_worker_fails_mid_way(healthy: TestFleet, fault: str) -> None:
    prompt = encode(f"migrate through {fault}: ")
    worker = serving_worker(healthy, prompt)
    fired = False

    async def on_tokens(n: int) -> None:
        nonlocal fired
        if n >= 25 and not fired:
            fired = True
            if fault == "crash":
                healthy.kill(worker)
            elif fault == "hang":
                await healthy.fault(worker, hang=True)
            elif fault == "fail_inflight":
                await healthy.fault(worker, fail_inflight=True)
            else:
                await healthy.fault(worker, reset_inflight=True)

    tokens, events, _ = await stream_tokens(router(healthy).url, {"model": "sim-tiny", "prompt": prompt,
                                                                    "max_tokens": 120}, on_tokens=on_tokens)
    assert fired
    assert tokens == reference(prompt, 120), "no token lost, none duplicated, none changed"
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
    assert finishes == ["length"]
    assert "error" not in str(events)


async def test_new_requests_avoid_a_worker_whose_streams_just_moved_away_for_silence(
        etcd_endpoint: str, broker_endpoint: str, tmp_path: Any, wait_until: Any) -> None:
    """Once the router moved a hung worker's stream away, the worker has nothing in flight and looks the least
    loaded. New requests must not go there and stall in turn: each is served by another worker, first try.

    No supervisor runs (the test marks the workers ready itself), so the hung worker stays "ready" throughout,
    as it does until a supervisor's verdict: only the router can keep requests away from it."""
    routing = RouterConfig(stall_floor_s=0.5)
    async with TestFleet(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster="router-shun", run_dir=tmp_path,
                         workers=3, backend=SimBackend(SIM), routing=routing, controller=False) as fleet:
        for w in fleet.worker_ids:
            await fleet.store.put(fleet.keys.health_of(w),
                                  HealthRecord(HealthState.READY, "marked by the test", "test", time.time()).to_json())
        r = await fleet.start_router("r0")
        trace = {"X-Fleetward-Trace": "1"}
        prompt = encode("hang, then shun: ")
        worker = serving_worker(fleet, prompt)

        async def hang(n: int) -> None:
            if n == 20:
                await fleet.fault(worker, hang=True)

        tokens, events, _ = await stream_tokens(r.url, {"model": "sim-tiny", "prompt": prompt, "max_tokens": 60},
                                                headers=trace, on_tokens=hang)
        assert tokens == reference(prompt, 60)
        assert {e["fleetward"]["worker"] for e in events if "fleetward" in e} - {worker}, "it moved on"
        first_try = events[0]["fleetward"]["attempt"]

        async def idle() -> bool:  # the hung worker holds nothing now: it looks the least loaded
            async with httpx.AsyncClient(timeout=5) as c:
                view = (await c.get(r.url + "/fleetward/v1/progress")).json()
            in_flight: int = view["workers"].get(worker, {}).get("in_flight", 0)
            return in_flight == 0

        await wait_until(idle, timeout=10, message="the hung worker's stream released")
        # Prompts whose affinity is the hung worker: without shunning, all of them would go there. The search stops
        # at the 4th (about a dozen tries): this runs on the loop that keeps the agent's registration lease alive,
        # and a search through a thousand prompts (a process check each) blocked it past the lease's TTL on a loaded
        # machine; every worker's registration then expired, and the router answered 503.
        candidates = (encode(f"right after the hang {i}: ") for i in range(1000))
        prompts = list(itertools.islice((p for p in candidates if serving_worker(fleet, p) == worker), 4))
        results = await asyncio.gather(*(stream_tokens(r.url, {"model": "sim-tiny", "prompt": p, "max_tokens": 30},
                                                       headers=trace) for p in prompts))
        for i, (got, events, _) in enumerate(results):
            served = {(e["fleetward"]["worker"], e["fleetward"]["attempt"]) for e in events if "fleetward" in e}
            assert len(served) == 1, f"request {i}: {sorted(served)}"
            ((served_by, attempt),) = served
            assert attempt == first_try and served_by != worker, f"request {i}: {served_by}, attempt {attempt}"
            assert got == reference(prompts[i], 30)
        await fleet.fault(worker, hang=False)


async def test_a_chat_stream_resumes_through_completions_and_stays_a_chat_stream(healthy: TestFleet) -> None:
    messages = [{"role": "user", "content": "tell me a long story"}]
    prompt = encode(render_chat(messages))
    worker = serving_worker(healthy, prompt)

    async def on_tokens(n: int) -> None:
        if n == 10:
            healthy.kill(worker)

    tokens, events, _ = await stream_tokens(router(healthy).url, {"model": "sim-tiny", "messages": messages,
                                                                    "max_tokens": 60},
                                            path="/v1/chat/completions", on_tokens=on_tokens)
    assert tokens == reference(prompt, 60)
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert text.encode() == bytes(t - 3 for t in tokens)


async def test_the_openai_client_works_unchanged_through_a_migration(healthy: TestFleet) -> None:
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=router(healthy).url + "/v1", api_key="unused")
    prompt_text = "openai client says: "
    worker = serving_worker(healthy, encode(prompt_text))
    stream = await client.completions.create(model="sim-tiny", prompt=prompt_text, max_tokens=50, stream=True,
                                             temperature=0)
    text = ""
    async for chunk in stream:
        text += chunk.choices[0].text
        if len(text) == 15:
            healthy.kill(worker)
    assert text.encode() == bytes(t - 3 for t in reference(encode(prompt_text), 50))

    chat = await client.chat.completions.create(model="sim-tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=30, stream=True)
    content = ""
    async for chunk in chat:
        if chunk.choices and chunk.choices[0].delta.content:
            content += chunk.choices[0].delta.content
    expected = reference(encode(render_chat([{"role": "user", "content": "hi"}])), 30)
    assert content.encode() == bytes(t - 3 for t in expected)
    done = await client.completions.create(model="sim-tiny", prompt="non-stream", max_tokens=8)
    assert done.usage is not None and done.usage.completion_tokens == 8
    assert done.choices[0].text.encode() == bytes(t - 3 for t in reference(encode("non-stream"), 8))


async def test_a_non_resumable_request_fails_with_a_clear_error_instead_of_diverging(healthy: TestFleet) -> None:
    prompt = encode("constrained: ")
    worker = serving_worker(healthy, prompt)

    async def on_tokens(n: int) -> None:
        if n == 5:
            healthy.kill(worker)

    _, events, _ = await stream_tokens(router(healthy).url, {"model": "sim-tiny", "prompt": prompt, "max_tokens": 50,
                                                               "guided_regex": "[a-z ]+"}, on_tokens=on_tokens)
    error = events[-1].get("error")
    assert error is not None and "cannot be resumed exactly" in error["message"]
    assert "guided_regex" in error["message"]


async def test_a_resume_of_a_request_that_cannot_be_continued_exactly_is_refused_and_leaves_it_alone(
        healthy: TestFleet, wait_until: Any) -> None:
    """The client of a constrained stream goes away and comes back with Last-Event-ID: a new attempt could
    diverge, so the resume is refused (409, saying why) on the router that holds it and on another one."""
    body = {"model": "sim-tiny", "prompt": encode("constrained, resumed: "), "max_tokens": 400, "stream": True,
            "guided_regex": "[a-z ]+"}
    last_id = ""
    async with httpx.AsyncClient(timeout=30) as client, client.stream(
            "POST", router(healthy).url + "/v1/completions", json=body, headers=EVENT_IDS) as r:
        async for line in sse_lines(r.aiter_bytes()):
            if line.startswith("id: "):
                last_id = line[4:]
                if int(last_id.rpartition(":")[2]) >= 5:
                    break
    rid = last_id.rpartition(":")[0]
    await wait_until(lambda: checkpointed(healthy, rid, 5), timeout=15)
    second = await healthy.start_router("r-second-look")
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            for url in (second.url, router(healthy).url):  # a claim from the checkpoint; the router holding it
                r = await client.post(url + "/v1/completions", json=body, headers={"Last-Event-ID": last_id})
                assert r.status_code == 409, r.text
                assert "cannot be resumed exactly" in r.text and "guided_regex" in r.text
        found = await read_checkpoint(healthy.store, healthy.keys, rid)
        assert found is not None and found[0].owner is None and len(found[0].emitted) >= 5, "left as it was"
    finally:
        await healthy.stop_router(second)


async def test_the_migration_limit_is_respected(healthy: TestFleet) -> None:
    # Every worker breaks under every request: with the poison rule on (tests/migration/test_poison.py) the
    # second worker would end it; this router has it off, so the limit does.
    limited = await healthy.start_router("limit", poison_workers=0)
    try:
        for wid in healthy.worker_ids:
            await healthy.fault(wid, reset_after_tokens=3)
        tokens, events, _ = await stream_tokens(limited.url, {"model": "sim-tiny", "prompt": encode("limit"),
                                                              "max_tokens": 100})
    finally:
        await healthy.stop_router(limited)
    error = events[-1].get("error")
    assert error is not None and "migration_limit=3" in error["message"]
    assert tokens == reference(encode("limit"), len(tokens)), "what was delivered is still exact"


async def test_bad_requests_get_4xx_with_a_message(healthy: TestFleet, same_answer: Any) -> None:
    """A request the journal cannot take is the worker's to answer, in its words (vLLM's), as it wrote them."""
    url = router(healthy).url
    async with httpx.AsyncClient(timeout=30) as client:
        for raw in (b'{"model": "sim-tiny"', b'{"model": "sim-tiny", "prompt": ""}', b'{"prompt": []}',
                    b'{"model": "sim-tiny", "prompt": "x", "max_tokens": "four"}'):
            r = await client.post(url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
            direct = await client.post(healthy.url(healthy.worker_ids[0]) + "/v1/completions", content=raw,
                                       headers={"content-type": "application/json"})
            assert r.status_code == direct.status_code, (raw, r.text)
            same_answer(r.content, direct.content)
            if raw != b'{"model": "sim-tiny", "prompt": ""}':  # vLLM (and the sim) prompts with BOS alone
                assert r.status_code == 400, (raw, r.text)
        r = await client.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"})
        assert r.status_code == 404 and "sim-tiny" in r.json()["error"]["message"]
        r = await client.post(url + "/v1/completions", json={"model": "sim-tiny", "prompt": [40] * 5000,
                                                             "max_tokens": 4})
        assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
        r = await client.post(url + "/v1/completions", json={"model": "sim-tiny", "prompt": "x", "n": 2,
                                                             "temperature": 0})
        assert r.status_code == 400 and "n must be 1 when using greedy sampling" in r.json()["error"]["message"]


async def test_unknown_routes_and_wrong_methods_get_the_openai_error_shape(fleet: TestFleet) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        missing = await client.post(router(fleet).url + "/v1/nope", json={})
        wrong = await client.get(router(fleet).url + "/v1/completions")
    assert (missing.status_code, missing.json()) == (404, {"error": {
        "message": "no route POST /v1/nope on this router", "type": "NotFoundError", "param": None, "code": 404}})
    assert (wrong.status_code, wrong.headers["allow"], wrong.json()) == (405, "POST", {"error": {
        "message": "/v1/completions does not take GET; it takes POST", "type": "MethodNotAllowedError",
        "param": None, "code": 405}})
    assert list(missing.json()["error"]) == list(wrong.json()["error"]) == ["message", "type", "param", "code"]


async def test_no_healthy_worker_gives_503_with_retry_after(healthy: TestFleet, wait_until: Any) -> None:
    for wid in healthy.worker_ids:
        healthy.kill(wid)
    url = router(healthy).url

    async def refused() -> httpx.Response | None:
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.post(url + "/v1/completions", json={"model": "sim-tiny", "prompt": "x"})
        # Until the router has seen the deaths in etcd it tries them and fails over: also a 503.
        return r if r.status_code == 503 and "no healthy worker" in r.text else None

    response = await wait_until(refused, timeout=15)
    assert response.headers["retry-after"] == "1"
    assert "no healthy worker" in response.json()["error"]["message"]


async def test_client_disconnect_cancels_the_generation_on_the_worker(healthy: TestFleet, wait_until: Any) -> None:
    prompt = encode("abandoned: ")
    async with httpx.AsyncClient(timeout=30) as client, client.stream(
            "POST", router(healthy).url + "/v1/completions",
            json={"model": "sim-tiny", "prompt": prompt, "max_tokens": 4000, "stream": True}, headers=EVENT_IDS) as r:
        lines = sse_lines(r.aiter_bytes())  # held, so the stream stays open until the block ends
        while not (await anext(lines)).startswith("data: {"):
            pass
        running = {w: (await healthy.state(w))["running"] for w in healthy.worker_ids}
        assert sorted(running.values()) == [0, 0, 1]
        worker = max(running, key=running.__getitem__)

    async def idle() -> bool:
        running: int = (await healthy.state(worker))["running"]
        return running == 0

    await wait_until(idle, timeout=15)


async def test_checkpoint_writes_follow_the_flush_interval_not_the_token_rate(healthy: TestFleet) -> None:
    url = router(healthy).url

    async def txns() -> dict[str, float]:
        async with httpx.AsyncClient() as client:
            text = (await client.get(url + "/metrics")).text
        values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                  if line.startswith(("fleetward_router_checkpoint_txns_total", "fleetward_router_tokens_total",
                                      "fleetward_router_checkpoint_flushes_total"))}
        return values

    async def run(streams: int) -> tuple[float, float, float]:
        before = await txns()
        await asyncio.gather(*(stream_tokens(url, {"model": "sim-tiny", "prompt": encode(f"load {streams} {i}"),
                                                   "max_tokens": 150}) for i in range(streams)))
        after = await txns()
        return tuple(after[k] - before[k] for k in ("fleetward_router_checkpoint_txns_total",
                                                    "fleetward_router_checkpoint_flushes_total",
                                                    "fleetward_router_tokens_total"))  # type: ignore[return-value]

    few_txns, few_flushes, few_tokens = await run(2)
    many_txns, many_flushes, many_tokens = await run(32)
    assert many_tokens == 16 * few_tokens
    assert few_txns == few_flushes and many_txns == many_flushes, "one transaction per flush"
    assert many_txns < 4 * few_txns, "16x the token rate must not mean 16x the etcd writes"


async def test_a_restarted_router_is_whole_before_it_serves(healthy: TestFleet) -> None:
    second = await healthy.start_router("r-restart")
    try:
        async with httpx.AsyncClient() as client:
            status = (await client.get(second.url + "/health")).status_code
            models = (await client.get(second.url + "/v1/models")).json()
        assert status == 200
        assert [m["id"] for m in models["data"]] == ["sim-tiny"]
        tokens, _, _ = await stream_tokens(second.url, {"model": "sim-tiny", "prompt": encode("new router"),
                                                        "max_tokens": 10})
        assert tokens == reference(encode("new router"), 10)
    finally:
        await healthy.stop_router(second)


async def copy_tokens(fleet: TestFleet, holder: RouterProcess, rid: str) -> int | None:
    """The tokens of ``rid``'s copy the router ``holder`` keeps for a peer (``checkpoint_store: peers``)."""
    async with httpx.AsyncClient(timeout=5) as client:
        r = await client.get(f"{holder.url}/fleetward/v1/replicas/{rid}",
                             headers={"Authorization": f"Bearer {fleet.admin_token}"})
    return int(r.json()["tokens"]) if r.status_code == 200 else None


@pytest.mark.parametrize("store", ["etcd", "peers"])
async def test_a_client_resumes_on_another_router_with_last_event_id(healthy: TestFleet, wait_until: Any,
                                                                     store: str) -> None:
    """The client's router is killed mid-stream; the client resumes on another router with Last-Event-ID and
    reads one exact stream. With routing.checkpoint_store: peers the other router holds the copy, and etcd
    holds none of it."""
    first = await healthy.start_router(f"r-dying-{store}", checkpoint_store=store)
    second = await healthy.start_router(f"r-rescue-{store}", checkpoint_store=store)
    prompt = encode("resume me elsewhere: ")
    body = {"model": "sim-tiny", "prompt": prompt, "max_tokens": 300, "stream": True, "return_token_ids": True}
    got: list[int] = []
    last_id = rid = ""

    async def saved() -> bool:
        if store == "etcd":
            return await checkpointed(healthy, rid, 20)
        return (await copy_tokens(healthy, second, rid) or 0) >= 20 and not await checkpointed(healthy, rid)

    # Every worker 20x slower until the kill: the 260 tokens after the 40th take longer than the wait for the
    # checkpoint may, so the router is killed mid-stream whatever the wait takes (at full speed they take a
    # second, and a router that has sent the whole stream has nothing left to resume).
    for w in healthy.worker_ids:
        await healthy.fault(w, slowdown=20.0)
    try:
        with pytest.raises(httpx.HTTPError):  # the router dies under the client
            async with httpx.AsyncClient(timeout=30) as client, client.stream(
                    "POST", first.url + "/v1/completions", json=body, headers=EVENT_IDS) as r:
                async for line in sse_lines(r.aiter_bytes()):
                    if line.startswith("id: "):
                        last_id = line[4:]
                    if line.startswith("data: {"):
                        got.extend(orjson.loads(line[6:])["choices"][0]["token_ids"])
                        if len(got) == 40:
                            rid = last_id.rpartition(":")[0]
                            await wait_until(saved, timeout=15)
                            healthy.kill_router(first)
        for w in healthy.worker_ids:
            await healthy.fault(w, slowdown=1.0)
        assert last_id.endswith(f":{len(got)}") and len(got) >= 40
        rest, events, ids = await stream_tokens(second.url, body, headers={"Last-Event-ID": last_id})
        assert got + rest == reference(prompt, 300), "replayed from the checkpoint, regenerated past it, exact"
        assert ids[-1] == f"{rid}:300"
        assert {e["id"] for e in events} == {rid}
    finally:
        await healthy.stop_router(first)
        await healthy.stop_router(second)


async def test_with_copies_kept_by_peer_routers_a_client_that_left_resumes_on_the_peer_while_its_router_lives(
        healthy: TestFleet, wait_until: Any) -> None:
    """The client leaves its router, which lives on and keeps the journal for detached_grace_s; it comes back
    through the peer that holds the copy, which claims it there and serves the rest exactly."""
    first = await healthy.start_router("r-peer-c", checkpoint_store="peers")
    second = await healthy.start_router("r-peer-d", checkpoint_store="peers")
    prompt = encode("left a living router: ")
    body = {"model": "sim-tiny", "prompt": prompt, "max_tokens": 300, "stream": True, "return_token_ids": True}
    try:
        got: list[int] = []
        last_id = ""
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.get(f"{second.url}/fleetward/v1/replicas/cmpl-x", headers={"Authorization": "Bearer no"})
            assert r.status_code == 401, "a router's copies need the admin token"
            async with client.stream("POST", first.url + "/v1/completions", json=body, headers=EVENT_IDS) as r:
                assert r.status_code == 200, await r.aread()
                async for line in sse_lines(r.aiter_bytes()):
                    if line.startswith("id: "):
                        last_id = line[4:]
                    if line.startswith("data: {"):
                        got.extend(orjson.loads(line[6:])["choices"][0]["token_ids"])
                        if len(got) >= 40:
                            break  # the client goes away; its router keeps the journal
            rid = last_id.rpartition(":")[0]
            assert last_id == f"{rid}:{len(got)}"

            async def held() -> bool:
                return (await copy_tokens(healthy, second, rid) or 0) >= len(got)

            await wait_until(held, timeout=15)
        rest, events, ids = await stream_tokens(second.url, body, headers={"Last-Event-ID": last_id})
        assert got + rest == reference(prompt, 300)
        assert ids[-1] == f"{rid}:300" and {e["id"] for e in events} == {rid}
    finally:
        await healthy.stop_router(first)
        await healthy.stop_router(second)


async def test_an_unknown_last_event_id_is_refused_clearly(healthy: TestFleet) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(router(healthy).url + "/v1/completions",
                              json={"model": "sim-tiny", "prompt": "x", "stream": True},
                              headers={"Last-Event-ID": "cmpl-nope:3"})
    assert r.status_code == 404 and "unknown, finished" in r.json()["error"]["message"]


async def test_a_stalled_client_holds_up_no_other_stream_and_its_event_ids_name_what_it_holds(
        healthy: TestFleet, wait_until: Any) -> None:
    """The router reads upstream ahead of a client that stops reading (its socket buffers fill up): other
    streams meanwhile run to their end, exact. The id of every event it then sends must still count that
    event's tokens, not the journal's."""
    prompt = encode("stalled reader: ")
    url = router(healthy).url
    tokens: list[int] = []
    ids: list[str] = []
    small_buffer = httpx.AsyncHTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)])
    async with httpx.AsyncClient(timeout=60, transport=small_buffer) as client, client.stream(
            "POST", url + "/v1/completions",
            json={"model": "sim-tiny", "prompt": prompt, "max_tokens": 600, "stream": True,
                  "return_token_ids": True}, headers=EVENT_IDS) as r:
        lines = sse_lines(r.aiter_bytes())
        while not (line := await anext(lines)).startswith("data: {"):
            pass
        others = [encode(f"beside a stalled reader {i}: ") for i in range(4)]
        got = await asyncio.gather(*(stream_tokens(url, {"model": "sim-tiny", "prompt": p, "max_tokens": 120})
                                     for p in others))
        assert [tokens for tokens, _, _ in got] == [reference(p, 120) for p in others]

        async def upstream_done() -> bool:
            async with httpx.AsyncClient() as probe:
                view = (await probe.get(url + "/fleetward/v1/progress")).json()
            return not any(w["in_flight"] for w in view["workers"].values())

        await wait_until(upstream_done, timeout=30, message="the router read the whole stream ahead of us")
        tokens.extend(orjson.loads(line[6:])["choices"][0]["token_ids"])
        async for line in lines:
            if line.startswith("id: "):
                ids.append(line[4:])
            elif line.startswith("data: {"):
                tokens.extend(orjson.loads(line[6:])["choices"][0]["token_ids"])
                assert ids[-1].endswith(f":{len(tokens)}"), (ids[-1], len(tokens))
    assert tokens == reference(prompt, 600)


async def test_a_non_streamed_request_is_cancelled_when_its_client_goes(healthy: TestFleet, wait_until: Any) -> None:
    request = asyncio.create_task(httpx.AsyncClient(timeout=60).post(
        router(healthy).url + "/v1/completions",
        json={"model": "sim-tiny", "prompt": encode("nobody waits for me"), "max_tokens": 4000}))

    async def busy_worker() -> str | None:
        for w in healthy.worker_ids:
            if (await healthy.state(w))["running"]:
                return w
        return None

    worker = await wait_until(busy_worker, timeout=10, message="the generation started")
    request.cancel()  # the client hangs up
    with contextlib.suppress(asyncio.CancelledError):
        await request

    async def idle() -> bool:
        running: int = (await healthy.state(worker))["running"]
        return running == 0

    await wait_until(idle, timeout=15, message="the worker stopped generating for nobody")


async def test_a_dead_routers_streams_are_cancelled_on_the_workers_and_its_checkpoints_expire(
        healthy: TestFleet, wait_until: Any) -> None:
    doomed = await healthy.start_router("r-doomed", checkpoint_ttl_s=3)
    body = {"model": "sim-tiny", "prompt": encode("orphan to be"), "max_tokens": 4000, "stream": True}
    try:
        async with httpx.AsyncClient(timeout=30) as client, client.stream(
                "POST", doomed.url + "/v1/completions", json=body, headers=EVENT_IDS) as r:
            lines = sse_lines(r.aiter_bytes())
            while not (line := await anext(lines)).startswith("id: "):
                pass
            rid = line[4:].rpartition(":")[0]

            await wait_until(lambda: checkpointed(healthy, rid), timeout=10)
            healthy.kill_router(doomed)

            async def nothing_runs() -> bool:
                return all([(await healthy.state(w))["running"] == 0 for w in healthy.worker_ids])

            await wait_until(nothing_runs, timeout=15, message="workers cancel what the dead router asked for")

            async def expired() -> bool:
                return await healthy.store.get(healthy.keys.request(rid)) is None

            await wait_until(expired, timeout=20, message="the orphaned checkpoint expires with its lease")
    finally:
        await healthy.stop_router(doomed)


async def test_a_router_group_serves_one_port_from_several_processes(healthy: TestFleet, wait_until: Any) -> None:
    """``routing.processes: 2``: two routers on one port (SO_REUSEPORT), each registered with an address of its
    own; streams through the port are exact, a client resumes on whichever process takes its connection,
    a killed process is started again, and stopping the group leaves no process behind."""
    group = await healthy.start_router("r-group", processes=2)
    try:
        async def members() -> dict[str, dict[str, Any]]:
            snap = await healthy.store.get_prefix(healthy.keys.routers)
            found = {kv.key.rpartition("/")[2]: orjson.loads(kv.value) for kv in snap.items}
            return {rid: info for rid, info in found.items() if rid.startswith("r-group-")}

        await wait_until(lambda: _count(members, 2), timeout=30, message="both processes registered")
        first = await members()
        assert {info["public_url"] for info in first.values()} == {group.url}
        assert len({info["url"] for info in first.values()} | {group.url}) == 3, "each has its own address too"

        prompts = [encode(f"group {i}: ") for i in range(8)]
        results = await asyncio.gather(*(stream_tokens(group.url, {"model": "sim-tiny", "prompt": p, "max_tokens": 40})
                                          for p in prompts))
        assert [r[0] for r in results] == [reference(p, 40) for p in prompts]

        # A client that drops its connection and resumes: whichever process takes the new connection.
        prompt = encode("resume in the group: ")
        body = {"model": "sim-tiny", "prompt": prompt, "max_tokens": 200, "stream": True, "return_token_ids": True}
        got: list[int] = []
        last_id = ""
        async with httpx.AsyncClient(timeout=30) as client, client.stream(
                "POST", group.url + "/v1/completions", json=body, headers=EVENT_IDS) as r:
            async for line in sse_lines(r.aiter_bytes()):
                if line.startswith("id: "):
                    last_id = line[4:]
                if line.startswith("data: {"):
                    got.extend(orjson.loads(line[6:])["choices"][0]["token_ids"])
                    if len(got) >= 30:
                        break
        rid = last_id.rpartition(":")[0]
        await wait_until(lambda: checkpointed(healthy, rid, len(got)), timeout=15)
        rest, _, _ = await stream_tokens(group.url, body, headers={"Last-Event-ID": last_id})
        assert got + rest == reference(prompt, 200)

        victim = next(iter(first))
        signal_named(first[victim], signal.SIGKILL)

        async def restarted() -> bool:
            now = (await members()).get(victim)
            return now is not None and now["pid"] != first[victim]["pid"]

        await wait_until(restarted, timeout=60, message="the killed process was started again")
        tokens, _, _ = await stream_tokens(group.url, {"model": "sim-tiny", "prompt": prompts[0], "max_tokens": 40})
        assert tokens == reference(prompts[0], 40)
        pids = [info["pid"] for info in (await members()).values()]
    finally:
        await healthy.stop_router(group)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


async def _count(members: Any, n: int) -> bool:
    return len(await members()) == n
