"""Prefill/decode on real vLLM (CPU): two servers joined by fleetward's connector (vLLM's ExampleConnector,
each request's KV as safetensors files under a shared folder, plus a manifest the loading side checks before
it loads anything: fleetward.fleet.kvconnector, docs/pd.md), adopted with roles ``prefill`` and ``decode``,
behind fleetward's router. They are the KV pair test_a_moves_on_vllm used (``kv_both``, which makes and takes
KV, so one pair serves both modules: a pair costs a minute to start here), and this module stops them.

A stream's prompt is prefilled on the one and decoded on the other, which loads the KV instead of computing
it. Then KV faults as real file faults in the shared folder (corrupted values, another prompt's KV, a
truncated file, a missing layer): on vLLM's own connector these give wrong tokens with HTTP 200 or kill the
decode server (docs/pd.md); here the faulty folder is refused (by the prefill server's scheduler, which
checks it first: it would load its own KV for a prompt it has seen), the prompt is computed, the folder is
written again, and every stream equals the aggregated reference token for token. A hung prefill server costs
time, not tokens.

Named ``test_a_...`` to run before the session's shared vLLM servers start: two vLLM servers at once on
this machine, not four.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
from array import array
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import pytest_asyncio

from fleetward.chaos.harness import TestFleet
from fleetward.chaos.workload import sse_lines
from fleetward.fleet.backends import VllmBackend
from fleetward.fleet.config import RouterConfig, SupervisorConfig, VllmConfig

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT_LEN = 300  # vLLM's CPU KV blocks hold 128 tokens, and the connector moves whole blocks: 256 of these
COVERED = 256


PREFILL, DECODE = "kv-a", "kv-b"  # the KV pair's servers (tests/vllm/conftest.py, kv_pair), adopted with roles


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def pd(tiny_model: Path, etcd_endpoint: str, broker_endpoint: str,
             kv_pair: Any) -> AsyncIterator[tuple[TestFleet, Path]]:
    role = {PREFILL: "prefill", DECODE: "decode"}
    servers = [s.model_copy(update={"role": role[s.id]}) for s in kv_pair.servers]
    fleet = TestFleet(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster="vllm-pd", workers=0, node="cpu",
                      backend=VllmBackend(VllmConfig(), tiny_model), attach=servers, run_dir=kv_pair.root / "fleet-pd",
                      routing=RouterConfig(stall_floor_s=2.0, prefill_timeout_s=5.0),
                      # Canaries (one-token prompts, which crash vLLM's own connector) as usual.
                      supervisor=SupervisorConfig(canary_timeout_s=5.0, canary_interval_s=5.0))
    try:
        await fleet.start()
        await fleet.restore(timeout=240)
        await fleet.start_router("pd-router")
        yield fleet, kv_pair.kv
    finally:
        await fleet.aclose()
        kv_pair.stop()  # the last module of the pair's


def prompt(seed: int) -> list[int]:
    """Not a prefix of test_a_moves_on_vllm's prompts (another stride): the same servers served those, and a
    prompt in a server's prefix cache needs no KV from the other."""
    return [(i * 11 + seed * 13) % 4000 + 5 for i in range(PROMPT_LEN)]


def folder_of(kv: Path, ids: list[int]) -> Path:
    """Where the connector keeps the KV of ``ids`` (the MD5 of the covered tokens as int64)."""
    return kv / hashlib.md5(array("q", ids[:COVERED]).tobytes(), usedforsecurity=False).hexdigest()


async def aggregated(fleet: TestFleet, ids: list[int], n: int) -> list[int]:
    """What one vLLM server computes alone (the prefill server is a whole vLLM: it can decode too)."""
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(fleet.url(PREFILL) + "/v1/completions", json={
            "model": fleet.spec(PREFILL).model, "prompt": ids, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
    r.raise_for_status()
    return list(r.json()["choices"][0]["token_ids"])


async def through_the_router(fleet: TestFleet, ids: list[int], n: int) -> tuple[list[int], set[str]]:
    """The streamed tokens, and the workers that produced them."""
    tokens: list[int] = []
    workers: set[str] = set()
    body = {"model": fleet.spec(DECODE).model, "prompt": ids, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    async with httpx.AsyncClient(timeout=120) as client, client.stream(
            "POST", fleet.routers[0].url + "/v1/completions", json=body, headers={"X-Fleetward-Trace": "1"}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in sse_lines(r.aiter_bytes()):
            if line.startswith("data: {"):
                data = orjson.loads(line[6:])
                tokens += [t for c in data.get("choices") or [] for t in c.get("token_ids") or []]
                workers.add(data["fleetward"]["worker"])
    return tokens, workers


async def prefills(fleet: TestFleet) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(fleet.routers[0].url + "/metrics")).text
    out = {}
    for line in text.splitlines():
        if line.startswith("fleetward_router_prefills_total{"):
            out[line.split('outcome="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def decode_log(fleet: TestFleet) -> str:
    return (fleet.run_dir.parent / f"{DECODE}.log").read_text(errors="replace")


def refusals(fleet: TestFleet) -> int:
    """KV folders either server refused (the prefill server checks too: it would load its own KV for a prompt
    it has seen, and then not write it again)."""
    return sum((fleet.run_dir.parent / f"{w}.log").read_text(errors="replace").count("failed its check")
               for w in (PREFILL, DECODE))


async def test_a_stream_is_prefilled_on_one_server_and_decoded_from_its_kv_on_the_other(
        pd: tuple[TestFleet, Path]) -> None:
    fleet, kv = pd
    ids = prompt(1)
    before = await prefills(fleet)
    loads = decode_log(fleet).count("Inject KV cache of 256 tokens")
    tokens, workers = await through_the_router(fleet, ids, 40)
    assert workers == {DECODE}, "decode workers stream; the prefill worker only made the KV"
    assert (await prefills(fleet))["ok"] == before["ok"] + 1
    assert (folder_of(kv, ids) / "fleetward-manifest.json").is_file(), "the producer wrote its manifest"
    assert decode_log(fleet).count("Inject KV cache of 256 tokens") == loads + 1, "the decode server loaded it"
    assert tokens == await aggregated(fleet, ids, 40)
    assert await fleet.worker_serving(DECODE), "one-token canaries did not kill the decode server"


def corrupt(folder: Path) -> None:
    """Values changed in a valid file: the KV loads, and gives other tokens."""
    from safetensors.torch import load_file, save_file

    layer = sorted(folder.glob("*.safetensors"))[0]
    tensors = load_file(str(layer))
    tensors["kv_cache"].view(-1)[::97] += 3.0
    save_file(tensors, str(layer))


def stale(folder: Path, other: Path) -> None:
    """Another prompt's KV (and its manifest) in this prompt's folder: blocks freed and reused."""
    for p in folder.iterdir():
        p.unlink()
    for p in other.iterdir():
        shutil.copy(p, folder / p.name)


def truncate(folder: Path) -> None:
    layer = sorted(folder.glob("*.safetensors"))[0]
    layer.write_bytes(layer.read_bytes()[: layer.stat().st_size // 2])


def partial(folder: Path) -> None:
    """The prefill side died between layers: the last layer's file never written."""
    sorted(folder.glob("*.safetensors"))[-1].unlink()


@pytest.mark.parametrize("fault", ["corrupt", "stale", "truncate", "partial"])
async def test_kv_file_faults_are_refused_and_the_stream_stays_exact(pd: tuple[TestFleet, Path], fault: str) -> None:
    fleet, kv = pd
    seed = {"corrupt": 2, "stale": 3, "truncate": 4, "partial": 5}[fault]
    ids, other = prompt(seed), prompt(seed + 100)
    want = await aggregated(fleet, ids, 30)
    # The prefill server writes this prompt's KV (and the other's), then the fault is made in the folder. With
    # vLLM's own connector, the next prefill finds the folder, loads it and does not write it again, and the
    # decode server loads the fault.
    await through_the_router(fleet, ids, 1)
    await through_the_router(fleet, other, 1)
    folder = folder_of(kv, ids)
    assert (folder / "fleetward-manifest.json").is_file()
    {"corrupt": corrupt, "truncate": truncate, "partial": partial}.get(fault, lambda f: stale(f, folder_of(kv, other)))(
        folder)
    refused = refusals(fleet)
    tokens, workers = await through_the_router(fleet, ids, 30)
    assert workers == {DECODE}
    assert refusals(fleet) >= refused + 1, "the faulty KV was refused"
    assert tokens == want, "it computed the prompt itself: exact"
    assert not folder.exists() or (folder / "fleetward-manifest.json").is_file(), "the bad folder is gone"
    assert await fleet.worker_serving(DECODE)


async def test_a_hung_prefill_server_costs_time_not_tokens(pd: tuple[TestFleet, Path]) -> None:
    fleet, _ = pd
    ids = prompt(9)
    want = await aggregated(fleet, ids, 40)
    engine = fleet.engine_processes(PREFILL)
    assert engine, "the prefill server's EngineCore"
    for p in engine:
        os.kill(p.pid, signal.SIGSTOP)  # silent: /health stays 200, the prefill never answers
    try:
        # Whichever comes first: the router's prefill times out (prefill_timeout_s), or the node agent sees the
        # stopped engine and the supervisor takes the server out of routing and restarts it (whose graceful
        # stop may let the prefill finish). Either way the stream is served, exactly; the router's own
        # handling of a failed prefill is tested deterministically on simulated workers (tests/migration/test_pd.py).
        tokens, workers = await through_the_router(fleet, ids, 40)
        assert workers == {DECODE}
        assert tokens == want, "exact, whatever the prefill server did"
    finally:
        for p in engine:
            with contextlib.suppress(ProcessLookupError):  # the supervisor may have restarted it meanwhile
                os.kill(p.pid, signal.SIGCONT)
