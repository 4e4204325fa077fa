"""Planned moves on real vLLM (CPU): a stream moved for a plan carries its KV from one vLLM server to another.

Two vLLM servers, both ``kv_both`` with fleetward's connector (fleetward.fleet.kvconnector: vLLM's
ExampleConnector with a manifest and a check before any load), adopted as aggregated workers behind the
router, with the supervisor. A planned move stops the stream on its server (vLLM frees the request's blocks
into its prefix cache), asks that server for the KV of prompt plus emitted tokens (one token, unstreamed,
``do_remote_decode``: the prefix cache makes it a prefill of the tail only, and the connector saves the
blocks with their manifest), and sends the stream on to the other server, whose connector finds the folder by
prompt, checks it and loads it (docs/pd.md, "Planned moves").

A drain under load moves every stream with its KV, each exact as ids and text; a KV file corrupted between
the save and the load (the destination held still meanwhile) is refused by the destination's check, which
computes the stream instead: exact, later.

Named ``test_a_...`` to run before the session's shared vLLM servers start: two vLLM servers at once. The
pair (``kv_pair``) is test_a_pd_on_vllm's next, which stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import pytest_asyncio
from testkit import VLLM_LEASE_S, eventually, metric

from fleetward.chaos.harness import TestFleet
from fleetward.chaos.workload import sse_lines
from fleetward.fleet.backends import VllmBackend
from fleetward.fleet.cgroups import CpuGroup, cgroups_available
from fleetward.fleet.config import RouterConfig, SupervisorConfig, VllmConfig
from fleetward.fleet.kv import MANIFEST
from fleetward.fleet.procs import pid_from_file

pytestmark = pytest.mark.asyncio(loop_scope="session")

WORKERS = ("kv-a", "kv-b")  # the KV pair's (tests/vllm/conftest.py, kv_pair)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def moving(tiny_model: Path, etcd_endpoint: str, broker_endpoint: str,
                 kv_pair: Any) -> AsyncIterator[tuple[TestFleet, Path]]:
    assert tuple(s.id for s in kv_pair.servers) == WORKERS
    # Leases of VLLM_LEASE_S: a controller that loses its lease mid-drain orders no move, and a router whose
    # record lapses is not asked what runs where.
    fleet = TestFleet(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster="vllm-moves", workers=0, node="cpu",
                      backend=VllmBackend(VllmConfig(), tiny_model), attach=kv_pair.servers,
                      run_dir=kv_pair.root / "fleet-moves",
                      routing=RouterConfig(stall_floor_s=15.0, affinity_tokens=0, lease_ttl_s=VLLM_LEASE_S),
                      lease_ttl=VLLM_LEASE_S,
                      supervisor=SupervisorConfig(canary_timeout_s=5.0, canary_interval_s=30.0, drain_move_s=30.0,
                                                  lease_ttl_s=VLLM_LEASE_S))
    try:
        await fleet.start()
        await fleet.restore(timeout=240)
        await fleet.start_router("moves-router")
        yield fleet, kv_pair.kv
    finally:
        await fleet.aclose()  # the servers live on for test_a_pd_on_vllm, which stops them
        kv_pair.keep()


def prompt(seed: int, length: int) -> list[int]:
    return [(i * 7 + seed * 13) % 4000 + 5 for i in range(length)]


async def direct(fleet: TestFleet, ids: list[int], n: int) -> tuple[list[int], str]:
    """What one vLLM server computes, no fault and no move: the reference."""
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(fleet.url(WORKERS[0]) + "/v1/completions", json={
            "model": fleet.spec(WORKERS[0]).model, "prompt": ids, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return list(choice["token_ids"]), str(choice["text"])


class Stream:
    def __init__(self) -> None:
        self.rid = ""
        self.tokens: list[int] = []
        self.text = ""
        self.workers: list[str] = []
        self.error: str | None = None
        self.going = asyncio.Event()

    async def read(self, fleet: TestFleet, ids: list[int], n: int, *, going_after: int = 20) -> Stream:
        body = {"model": fleet.spec(WORKERS[0]).model, "prompt": ids, "max_tokens": n, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        async with httpx.AsyncClient(timeout=180) as client, client.stream(
                "POST", fleet.routers[0].url + "/v1/completions", json=body, headers={"X-Fleetward-Trace": "1"}) as r:
            assert r.status_code == 200, await r.aread()
            self.rid = r.headers["x-request-id"]
            async for line in sse_lines(r.aiter_bytes()):
                if not line.startswith("data: {"):
                    continue
                data = orjson.loads(line[6:])
                if "error" in data:
                    self.error = data["error"]["message"]
                    continue
                for c in data.get("choices") or []:
                    got = c.get("token_ids") or []
                    self.tokens += got
                    self.text += c.get("text") or ""
                    self.workers += [data["fleetward"]["worker"]] * len(got)
                if len(self.tokens) >= going_after:
                    self.going.set()
        self.going.set()
        return self


async def moves(fleet: TestFleet) -> dict[tuple[str, str], float]:
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(fleet.routers[0].url + "/metrics")).text
    return {(t, o): metric(text, "fleetward_router_moves_total", trigger=t, outcome=o)
            for t in ("drain", "operator") for o in ("kv", "reprefill", "failed")}


def log_of(fleet: TestFleet, worker: str) -> str:
    return (fleet.run_dir.parent / f"{worker}.log").read_text(errors="replace")


def loads(fleet: TestFleet, worker: str) -> int:
    """KV loads the server's connector made (ExampleConnector logs each)."""
    return log_of(fleet, worker).count("Inject KV cache of")


@contextlib.contextmanager
def slowed(fleet: TestFleet, cpus: float = 0.25) -> Iterator[None]:
    """Both servers held to ``cpus`` of a CPU each (a cgroup), as a throttled GPU host would be: the tiny model
    otherwise streams hundreds of tokens a second, so a whole stream can end before a move reaches it, and two
    servers at full speed starve this process (its client, controller and agent) for seconds at a time. Greedy
    output does not change; the references are computed at full speed before. Without cgroups: unslowed."""
    if not cgroups_available():
        yield
        return
    groups = [CpuGroup(f"vllm-moves-{w}") for w in WORKERS]
    try:
        for w, group in zip(WORKERS, groups, strict=True):
            group.limit(cpus)
            pid = pid_from_file(fleet.run_dir.parent / f"{w}.pid")
            assert pid, w
            group.add_tree(pid)
        yield
    finally:
        for group in groups:
            group.remove()


async def in_flight(fleet: TestFleet) -> dict[str, int]:
    """Requests in flight per worker that have emitted a token, as the router says (not as a client has read so
    far: a starved client reads tokens the server sent seconds ago); none while any still waits for its first
    (a stream moved before its first token has no KV to carry, and its client could not tell it moved)."""
    async with httpx.AsyncClient(timeout=10) as client:
        view = (await client.get(fleet.routers[0].url + "/fleetward/v1/progress")).json()
    workers = view.get("workers") or {}
    if any(int(v.get("pending_prefill_tokens", 0)) for v in workers.values()):
        return {}
    return {w: int(v.get("in_flight", 0)) for w, v in workers.items()}


async def test_a_drain_under_load_moves_every_stream_with_its_kv_exactly(moving: tuple[TestFleet, Path]) -> None:
    fleet, _ = moving
    # The streams run on servers slowed to a sliver of a CPU (see slowed). A stream can still end before the
    # drain's move comes: it must have ended exactly on its server, and the drain is tried again with other
    # prompts until one moves.
    moved: list[Stream] = []
    for attempt in range(4):
        # Lengths off vLLM's CPU block of 128 tokens: the connector saves whole blocks of the prompt it is asked
        # for; each stream as long as the model's context allows.
        prompts = [prompt(s + 10 * attempt, 301 + 118 * s) for s in range(4)]
        n = 1350
        # The references in one batch: the tiny model's greedy output is the same batched as alone
        # (test_tiny_model_on_vllm), and four at once cost about what one does.
        want = await asyncio.gather(*(direct(fleet, p, n) for p in prompts))
        before = await moves(fleet)
        streams = [Stream() for _ in prompts]
        with slowed(fleet):
            tasks = [asyncio.ensure_future(s.read(fleet, p, n)) for s, p in zip(streams, prompts, strict=True)]
            async with asyncio.timeout(60):  # every stream under way, as the router says (its state, over HTTP)
                while sum((busy := await in_flight(fleet)).values()) < len(prompts):
                    if all(t.done() for t in tasks):
                        break
                    await asyncio.sleep(0.01)
            source = max(WORKERS, key=lambda w: busy.get(w, 0))
            dest = next(w for w in WORKERS if w != source)
            loaded = loads(fleet, dest)
            r = await fleet.supervisor_command(source, "drain", {"deadline_s": 0, "then": "cordon"})
            assert r.status_code == 200, r.text
            # Slowed until every stream has moved or ended: the rest of each is read at full speed (the
            # tokens, not their pace, are what is checked).
            def moved_or_ended(streams: list[Stream] = streams, tasks: list[Any] = tasks, dest: str = dest) -> bool:
                return all(t.done() or (s.workers and s.workers[-1] == dest)
                           for s, t in zip(streams, tasks, strict=True))

            await eventually(moved_or_ended, within=300)
        done = await asyncio.gather(*tasks, return_exceptions=True)
        try:
            assert not [e for e in done if isinstance(e, BaseException)], done
            for s, (ids, text) in zip(streams, want, strict=True):
                assert s.error is None, s.error
                assert s.tokens == ids, "exact ids"
                assert s.text == text, "exact text"
            moved = [s for s in streams if s.workers[0] == source and s.workers[-1] == dest]
            paths = [(s.workers[0], s.workers[-1]) for s in streams]
            # A stream on the drained server moved, or finished there before its move came (not cut, not failed).
            assert all(s in moved or s.workers[-1] == s.workers[0] for s in streams), paths
            assert busy.get(source, 0) >= len(moved)
            delta = {k: v - before[k] for k, v in (await moves(fleet)).items()}
            assert delta[("drain", "kv")] == len(moved) and sum(delta.values()) == len(moved), (delta, paths)
            assert loads(fleet, dest) - loaded >= len(moved), "the destination loaded each moved stream's KV"
        finally:
            await fleet.supervisor_command(source, "undrain")
            await fleet.restore(timeout=120)
        if moved:
            break
    assert moved, "no attempt's drain came before its streams ended"


def corrupt(folder: Path) -> None:
    """Values changed in a valid layer file: a load would give other tokens. (safetensors.torch is imported
    before the destination is held still: importing torch on a busy machine takes seconds.)"""
    from safetensors.torch import load_file, save_file

    layer = sorted(folder.glob("*.safetensors"))[0]
    tensors = load_file(str(layer))
    tensors["kv_cache"].view(-1)[::97] += 3.0
    save_file(tensors, str(layer))


async def test_a_kv_file_corrupted_during_a_move_is_refused_and_the_stream_computed_again_exactly(
        moving: tuple[TestFleet, Path]) -> None:
    """The destination's API server is held still (SIGSTOP: its kernel still takes the connection) while the
    source saves the KV; the saved folder is corrupted; the destination then goes on, checks, refuses."""
    fleet, kv = moving
    import safetensors.torch  # noqa: F401 - now, not while the destination is held still (see corrupt)

    # On servers slowed to a sliver of a CPU (see slowed); a stream that ended before its move came anyway is
    # tried again with another prompt; each is as long as the model allows.
    for attempt in range(5):
        ids, n = prompt(40 + attempt, 201), 1800
        want = await direct(fleet, ids, n)
        s = Stream()
        with slowed(fleet):
            # Moved past the prompt's own blocks: the connector saved those at the stream's prefill (before
            # ``saved``), and a move that early finds them stored and saves nothing new to corrupt.
            task = asyncio.ensure_future(s.read(fleet, ids, n, going_after=300))
            await s.going.wait()
            source = s.workers[-1]
            dest = next(w for w in WORKERS if w != source)
            refused = log_of(fleet, dest).count("failed its check (checksum")
            saved = {p.parent for p in kv.glob(f"*/{MANIFEST}")}

            def new() -> set[Path]:
                return {p.parent for p in kv.glob(f"*/{MANIFEST}")} - saved  # noqa: B023 - this attempt's

            pid = pid_from_file(fleet.run_dir.parent / f"{dest}.pid")
            assert pid
            os.kill(pid, signal.SIGSTOP)
            try:
                r = await fleet.supervisor_post("/v1/moves", {"request": s.rid, "to": dest})
                assert r.status_code == 200, r.text
                await eventually(lambda: new() or task.done(), within=30)  # noqa: B023
                if new():
                    assert len(new()) == 1, new()
                    corrupt(new().pop())
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            # Slowed until the stream has moved (or ended where it was): its rest is read at full speed.
            await eventually(lambda: len(set(s.workers)) > 1 or task.done(), within=300)  # noqa: B023
        await task
        if len(set(s.workers)) > 1:
            break
    assert s.error is None and s.tokens == want[0] and s.text == want[1], "later, never wrong"
    assert source in s.workers and dest in s.workers, "moved"
    assert log_of(fleet, dest).count("failed its check (checksum") == refused + 1, "the destination refused it"
    await fleet.restore(timeout=120)
