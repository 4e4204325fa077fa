"""A poison request (one that kills the worker serving it) is not carried across the fleet by migration.

Simulated workers whose process exits when a request holding ``SimConfig.poison_token`` in its prompt is
submitted, as vLLM's engine has died on some inputs. The first worker dies under the request and its stream
moves; the second dies too; the router sends it to no third worker: the client gets an error that says why,
and the event, the metric and the log name the request, a hash of its body and the workers (issue 48). The
same for a request passed through whole (a chat the journal cannot make): each worker dies before answering.
One worker dying under a stream stays a migration: every other test of this folder.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from testkit import PATIENT_SUPERVISOR, BusRecorder, fleet_serves, fleet_sim, metric, routed_fleet, stream_completion

from fleetward.chaos.harness import TestFleet
from fleetward.fleet.config import RouterConfig
from fleetward.migration.poison import body_digest, broke_under
from fleetward.migration.upstream import UpstreamError
from fleetward.sim.model import SimModel
from fleetward.sim.tokenizer import encode

POISON = 7  # a token id: the steady-state checks' prompts are text, and never hold it
SIM = fleet_sim(seed=3, poison_token=POISON)
MODEL = SimModel(seed=SIM.seed)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(etcd_endpoint: str, broker_endpoint: str, tmp_path_factory: pytest.TempPathFactory
                ) -> AsyncIterator[TestFleet]:
    async with routed_fleet(etcd_endpoint, broker_endpoint, tmp_path_factory.mktemp("poison"), "poison-tests", SIM,
                            routing=RouterConfig(stall_floor_s=0.5), supervisor=PATIENT_SUPERVISOR) as f:
        yield f


def pids(fleet: TestFleet) -> dict[str, int | None]:
    """Each worker's process, None while the agent restarts it (between the old one's stop and the new start)."""
    return {w: h.process.pid if (h := fleet.agent.handles.get(w)) else None for w in fleet.worker_ids}


async def poison_metric(fleet: TestFleet) -> float:
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(fleet.routers[0].url + "/metrics")).text
    return metric(text, "fleetward_router_migration_failures_total", reason="poison")


# A chat request the journal cannot make (its parameters have no completions equivalent): passed through whole.
PASSED_THROUGH = {"chat_template_kwargs": {"enable_thinking": False}, "top_logprobs": 0, "parallel_tool_calls": True}


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("stream", [True, False, None], ids=["streamed", "whole", "passed-through"])
async def test_a_request_that_kills_two_workers_is_sent_to_no_third(fleet: TestFleet, stream: bool | None,
                                                                     wait_until: Any) -> None:
    await fleet.wait_healthy(timeout=30)
    before, counted = pids(fleet), await poison_metric(fleet)
    recorder = BusRecorder(fleet.bus)
    await recorder.subscribed.wait()
    prompt = [*encode("a request the engine cannot take: "), POISON, *encode(" and more")]
    try:
        if stream:
            got = await stream_completion(fleet.routers[0].url, prompt, 40, model=SIM.model_name)
            assert got.error is not None, "the stream ends with an error, not with a third worker's tokens"
            assert got.tokens == MODEL.continuation(prompt, len(got.tokens)), "what came before it is exact"
            message = got.error["message"]
        else:
            async with httpx.AsyncClient(timeout=60) as client:
                if stream is None:
                    text = "a request the engine cannot take: \x04 and more"  # byte 4 is token 7, the poison
                    assert POISON in encode(text)
                    r = await client.post(fleet.routers[0].url + "/v1/chat/completions", json={
                        "model": SIM.model_name, "messages": [{"role": "user", "content": text}], "max_tokens": 40,
                        "ignore_eos": True, **PASSED_THROUGH})
                else:
                    r = await client.post(fleet.routers[0].url + "/v1/completions", json={
                        "model": SIM.model_name, "prompt": prompt, "max_tokens": 40, "ignore_eos": True})
            assert r.status_code == 500, r.text
            assert "Retry-After" not in r.headers, "asking again would do the same harm"
            message = r.json()["error"]["message"]
        assert "2 workers failed while serving this request" in message and "poison request" in message, message

        def poisoned() -> list[Any]:
            return [e for e in recorder.events if e.kind == "poison"]

        await wait_until(poisoned, timeout=10, message="the poison event published")
        (event,) = poisoned()
        killed = event.data["workers"]
        assert len(set(killed)) == 2 and set(killed) <= set(fleet.worker_ids), event.data
        assert f"Request {event.data['request']}," in message, "the answer names the request"
        if stream is None:
            assert event.data["request"] == "POST /v1/chat/completions"
        assert re.fullmatch(r"[0-9a-f]{16}", event.data["body_sha256"]) and event.data["body_sha256"] in message
        await wait_until(lambda: all(pids(fleet)[w] not in (None, before[w]) for w in killed), timeout=30,
                         message="both died under it (restarted by the supervisor)")
        (spared,) = set(fleet.worker_ids) - set(killed)
        assert pids(fleet)[spared] == before[spared], "the third worker never got it"
        assert await poison_metric(fleet) == counted + 1
    finally:
        recorder.task.cancel()
    await fleet_serves(fleet, SIM, f"after the poison ({stream})")


def test_what_counts_as_a_worker_failing_under_a_request() -> None:
    def e(kind: str, message: str = "x", status: int | None = None) -> UpstreamError:
        return UpstreamError(kind, message, status=status)

    assert all(broke_under(x) for x in (e("reset"), e("eof"), e("bad_chunk"), e("error_event", status=500),
                                        e("status", status=500), e("aborted", "stalled: no token for 2.0s"),
                                        e("aborted", "worker unhealthy: canary failed"),
                                        e("aborted", "worker dead: exited")))
    # Never reached, its own refusal, the worker's load, a planned move, a lapsed lease, a GPU taken away.
    assert not any(broke_under(x) for x in (e("connect"), e("status", status=400), e("status", status=503),
                                            e("aborted", "move: drain"), e("aborted", "worker deregistered"),
                                            e("aborted", "worker quarantined: xid 79")))
    assert body_digest({"b": 1, "a": 2}) == body_digest({"a": 2, "b": 1}) != body_digest({"a": 2})
    assert body_digest(b'{"a": 2, "b": 1}') == body_digest({"b": 1, "a": 2}), "a passed-through body: its JSON"
    assert re.fullmatch(r"[0-9a-f]{16}", body_digest(b"\x00 not json")) and body_digest(b"x") != body_digest(b"y")
