"""Helpers the test modules share (importable as ``testkit``: the pytest config puts tests/ on the path).

- Simulated workers at a test's pace: :func:`fleet_sim` (a fleet behind a router: a few ms a token, so a
  fault lands mid-stream) and :func:`instant_sim` (the worker alone: as fast as it goes).
- A fleet for a test module: :func:`routed_fleet` (workers on the session's etcd and broker, behind one
  router); :data:`PATIENT_SUPERVISOR` restarts as often as a test kills.
- A stream as a client reads it: :func:`stream_completion` returns the ids, the events and an in-band error;
  :func:`fleet_serves` is the steady state of the fault tests (the fleet takes its workers back and a
  stream through the router is the model's exact continuation).
- The simulated worker in-process: :func:`asgi` (httpx's ASGI transport, buffered) and :func:`serve`
  (uvicorn on a free port in the test's loop, for tests that act mid-stream); :func:`eventually` and
  :func:`pump` (a :class:`ManualClock` jumped one engine step at a time).
- A request's checkpoint in etcd: :func:`checkpointed` (what a resume on another router needs).
- SSE bodies and metrics: :func:`sse`, :func:`sse_events`, :func:`tokens_of`, :func:`ids_of`, :func:`metric`.
- An experiment of the library run as a user runs it: :func:`run_experiment` (its journal, every check passed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from fleetward.chaos import faults as fault_library
from fleetward.chaos.fault import CATALOGUE, Fault, Target
from fleetward.chaos.harness import TestFleet
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.bus import Event, EventBus
from fleetward.fleet.clock import SYSTEM_CLOCK, Clock, ManualClock
from fleetward.fleet.config import RouterConfig, SimConfig, SupervisorConfig
from fleetward.fleet.procs import free_port, is_the_process
from fleetward.fleet.sse import sse_data, sse_lines
from fleetward.migration.checkpoint import read_checkpoint
from fleetward.sim.engine import Faults
from fleetward.sim.model import sim_model
from fleetward.sim.server import SimWorker
from fleetward.sim.tokenizer import encode

TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


# -- simulated workers at a test's pace ---------------------------------------------------------------------


def fleet_sim(**overrides: Any) -> SimConfig:
    """Workers of a fleet test: 4 ms a decode step (a 20-token stream is long enough to cut mid-way)."""
    return SimConfig(**{"decode_step_ms": 4.0, "decode_ms_per_seq": 0.05, "prefill_ms_per_token": 0.01,
                        **overrides})


def instant_sim(**overrides: Any) -> SimConfig:
    """A worker tested alone: half a millisecond a step, no per-sequence or prefill cost."""
    return SimConfig(**{"decode_step_ms": 0.5, "decode_ms_per_seq": 0.0, "prefill_ms_per_token": 0.0,
                        **overrides})


# -- a fleet for a test module ----------------------------------------------------------------------------------

# Restarts as often as a test kills, quickly: the tests are about what clients see, not the crash-loop budget.
PATIENT_SUPERVISOR = SupervisorConfig(restart_budget=1000, backoff_initial_s=0.05, backoff_max_s=0.2)

# The leases (agents', controllers', routers') of a test fleet beside real vLLM: two vLLM servers streaming, or
# one restarting and compiling its kernels, starve the other processes' loops on 2 cores for 5-11 s at a time.
# With 5 s and 10 s leases a healthy worker was deregistered mid-test (its stream answered 503), a controller
# lost its lease mid-drain and a router's record lapsed. No vLLM test is about a lease running out.
VLLM_LEASE_S = 15


@contextlib.asynccontextmanager
async def routed_fleet(etcd: str, mqtt: str, run_dir: Path, cluster: str, sim: SimConfig, *, workers: int = 3,
                       router: str = "r0", routing: RouterConfig | None = None, **fleet: Any
                       ) -> AsyncIterator[TestFleet]:
    """``workers`` simulated workers on the session's etcd and broker, their agent and controller, and one
    router (``router``, started): a router that gives up on a silent worker after half a second by default."""
    routing = routing if routing is not None else RouterConfig(stall_floor_s=0.5)
    async with TestFleet(etcd=etcd, mqtt=mqtt, cluster=cluster, run_dir=run_dir, workers=workers,
                         backend=SimBackend(sim), routing=routing, **fleet) as f:
        await f.start_router(router)
        yield f


# -- streams as a client reads them ---------------------------------------------------------------------------


@dataclass
class Streamed:
    """What a client read: the token ids of every choice, each event, the in-band error if one came."""

    tokens: list[int] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    error: dict[str, Any] | None = None


async def stream_completion(url: str, prompt: list[int], max_tokens: int, *, model: str,
                            headers: dict[str, str] | None = None,
                            on_event: Callable[[Streamed, dict[str, Any]], Awaitable[None]] | None = None,
                            ) -> Streamed:
    """POST a streamed completion to ``url``/v1/completions with ``return_token_ids`` and read it to the end
    (a status other than 200 fails the test with the body)."""
    got = Streamed()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "return_token_ids": True}
    async with httpx.AsyncClient(timeout=60) as c, \
            c.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in sse_lines(r.aiter_bytes()):
            if not line.startswith("data: {"):
                continue
            data = orjson.loads(line[6:])
            got.events.append(data)
            if "error" in data:
                got.error = data["error"]
                continue
            for choice in data.get("choices") or []:
                got.tokens += choice.get("token_ids") or []
            if on_event is not None:
                await on_event(got, data)
    return got


async def fleet_serves(fleet: TestFleet, config: SimConfig, tag: str, *, tokens: int = 20) -> None:
    """The steady state: the fleet takes all its workers back and a stream through its router is the model's
    exact continuation."""
    await fleet.wait_workers_routable(len(fleet.worker_ids), timeout=60)
    prompt = encode(f"serving after {tag}: ")
    got = await stream_completion(fleet.routers[0].url, prompt, tokens, model=config.model_name)
    assert got.tokens == sim_model(config).continuation(prompt, tokens)


# -- the simulated worker in-process ---------------------------------------------------------------------------


def signal_named(entry: dict[str, Any], sig: int) -> None:
    """Send ``sig`` to the process a status answer or an etcd record names (its ``pid`` and ``started_at``), once
    it is checked to be that process: a pid read from an answer may belong to someone else by the time it is
    signalled (fleet/procs.is_the_process)."""
    proc = psutil.Process(entry["pid"])
    assert is_the_process(proc, started_by=entry["started_at"]), f"pid {entry['pid']} is not the one named: {entry}"
    proc.send_signal(sig)


async def eventually(cond: Callable[[], object], *, within: float = 10.0) -> None:
    """Wait until ``cond()`` is true; fail after ``within`` seconds (a deadline, not a timing claim)."""
    async with asyncio.timeout(within):
        # Polling: the conditions are other tasks' state (engine, server, client) with no event to await.
        while not cond():  # noqa: ASYNC110
            await asyncio.sleep(0.001)


async def until(check: Callable[[], Awaitable[bool]], *, within: float = 10.0) -> None:
    """Ask ``check()`` again until it is true (e.g. a worker process's state); fail after ``within`` s."""
    async with asyncio.timeout(within):
        while not await check():
            pass


async def pump(clock: ManualClock, until: Callable[[], bool]) -> None:
    """Jump ``clock`` one engine step at a time until ``until()`` holds."""
    while not until():
        await eventually(lambda: until() or clock.sleepers > 0)
        if not until():
            clock.advance(1.0)


def _no_crash() -> None:
    raise AssertionError("an in-process test asked the worker to crash")


@contextlib.asynccontextmanager
async def asgi(config: SimConfig, *, clock: Clock = SYSTEM_CLOCK, faults: Faults | None = None
               ) -> AsyncIterator[tuple[httpx.AsyncClient, SimWorker]]:
    """The app in-process through httpx's ASGI transport (responses are buffered), engine running."""
    worker = SimWorker(config, admin_token=TOKEN, clock=clock, crash=_no_crash, faults=faults)
    async with worker.app.router.lifespan_context(worker.app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(worker.app), base_url="http://sim") as c:
            yield c, worker


class _InProcessServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # leave pytest's signal handlers alone
        yield


@contextlib.asynccontextmanager
async def serve(config: SimConfig, *, clock: Clock = SYSTEM_CLOCK) -> AsyncIterator[tuple[str, SimWorker]]:
    """The app on a real socket (uvicorn in this event loop), for tests that act mid-stream."""
    worker = SimWorker(config, admin_token=TOKEN, clock=clock, crash=_no_crash)
    port = free_port()
    server = _InProcessServer(uvicorn.Config(worker.app, host="127.0.0.1", port=port, log_config=None,
                                             lifespan="on", timeout_graceful_shutdown=2))
    async with asyncio.TaskGroup() as tg:
        tg.create_task(server.serve())
        try:
            await eventually(lambda: server.started)
            yield f"http://127.0.0.1:{port}", worker
        finally:
            server.should_exit = True


# -- SSE bodies and metrics -------------------------------------------------------------------------------------


def sse(text: str) -> list[Any]:
    """The events of an SSE body: parsed JSON objects, and the string ``"[DONE]"``."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def sse_events(response: httpx.Response) -> AsyncIterator[Any]:
    """The events of a streamed response as they arrive (JSON objects, and ``"[DONE]"``)."""
    return sse_data(response.aiter_bytes())


def vllm_error(r: httpx.Response) -> dict[str, Any]:
    """The ``error`` of a vLLM-shaped error body, after checking the shape (keys in vLLM's order, code = status)."""
    body = r.json()
    assert list(body) == ["error"], body
    error: dict[str, Any] = body["error"]
    assert list(error) == ["message", "type", "param", "code"]
    assert error["code"] == r.status_code
    return error


def tokens_of(events: list[Any]) -> list[int]:
    return [t for e in events if isinstance(e, dict) and e.get("choices") for t in e["choices"][0]["token_ids"]]


def ids_of(events: list[Any]) -> list[int]:
    """Token ids of completion or chat events (a chat stream's role chunk has none)."""
    return [t for e in events if isinstance(e, dict) and e.get("choices")
            for t in e["choices"][0].get("token_ids") or []]


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the sample ``name`` with ``labels`` in a Prometheus exposition."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"no sample {name} {labels}")


LIBRARY = Path(__file__).resolve().parents[1] / "chaos" / "experiments"


def run_experiment(file: str, out: Path, *, timeout: float = 300) -> dict[str, Any]:
    """``fleetward chaos run LIBRARY/FILE --out OUT``: it exits 0 and every checker it names passes; its journal."""
    done = subprocess.run([sys.executable, "-m", "fleetward.cli", "chaos", "run", str(LIBRARY / file),
                           "--out", str(out), "--no-report"], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    journal: dict[str, Any] = json.loads((out / "journal.json").read_text())
    verdicts = {v["checker"]: v["status"] for v in journal["checks"]["verdicts"]}
    # What a checker that did not pass said, and when each fault ran: an "unknown" is diagnosed from this.
    said = {v["checker"]: v["summary"] for v in journal["checks"]["verdicts"] if v["status"] != "pass"}
    timeline = [(a["activity"].get("name"), a.get("t_start"), a.get("t_end"), a.get("status")) for a in journal["run"]]
    assert verdicts and set(verdicts.values()) == {"pass"}, (verdicts, said, timeline, journal.get("duration"))
    return journal


async def checkpointed(fleet: TestFleet, request_id: str, tokens: int = 0) -> bool:
    """Whether the request's checkpoint (its base and deltas) is in etcd with at least ``tokens`` emitted: a
    router killed before its first flush leaves nothing to resume, so a test waits on this before a kill."""
    found = await read_checkpoint(fleet.store, fleet.keys, request_id)
    return found is not None and len(found[0].emitted) >= tokens


# -- comparing two servers' answers to one request ----------------------------------------------------------

# What differs between two answers to the same request: the ids a server makes up and the clock.
_VOLATILE = re.compile(rb'"(id|item_id)":"(cmpl|chatcmpl|resp|msg|embd|pooling|score|modelperm)[-_][^"]*"'
                       rb'|"(created|created_at)":\d+')


def normalized(raw: bytes) -> bytes:
    """``raw`` with the ids a server makes up and its clock replaced by ``"_"``."""
    return _VOLATILE.sub(lambda m: m.group(0).split(b":")[0] + b':"_"', raw)


def merge_chunk(prev: dict[str, Any], new: dict[str, Any]) -> bool:
    """Fold chunk ``new`` into ``prev`` when both carry text of one choice and ``prev`` did not end it."""
    if not (prev.get("choices") and new.get("choices")) or len(prev["choices"]) != 1 or len(new["choices"]) != 1:
        return False
    a, b = prev["choices"][0], new["choices"][0]
    if a.get("finish_reason") is not None or "role" in (a.get("delta") or {}) or "role" in (b.get("delta") or {}):
        return False
    if "delta" in a:
        a["delta"]["content"] = (a["delta"].get("content") or "") + (b["delta"].get("content") or "")
    else:
        a["text"] += b["text"]
    for key, value in b.items():
        if key == "token_ids" and isinstance(value, list):
            a["token_ids"] = [*(a.get("token_ids") or []), *value]
        elif key == "logprobs" and isinstance(value, dict) and isinstance(a.get("logprobs"), dict):
            a["logprobs"] = {k: [*a["logprobs"].get(k, []), *v] if isinstance(v, list) else v
                             for k, v in value.items()}
        elif key in ("prompt_token_ids", "prompt_logprobs") and value is None:
            continue  # vLLM sends what is the prompt's on a choice's first chunk only: null after it
        elif key not in ("delta", "text"):
            a[key] = value
    prev.update({k: v for k, v in new.items() if k != "choices"})
    return True


def choice_index(chunk: Any) -> int | None:
    """The index of a stream chunk's one choice, or None (a usage chunk, ``[DONE]``, another event)."""
    if isinstance(chunk, dict) and isinstance(chunk.get("choices"), list) and len(chunk["choices"]) == 1:
        index = chunk["choices"][0].get("index")
        return index if isinstance(index, int) else None
    return None


def canonical(raw: bytes) -> Any:
    """A body as a client reads it, less what may differ between two servers' answers to one request: the ids
    they make up, the clock, and where a stream's events break. vLLM puts several engine steps' tokens in one
    event when its API server falls behind, so two runs of a request may cut the same text in different places
    (the router passes that on: one event per worker event); text, tokens, usage and every other field may not
    differ."""
    text = normalized(raw)
    if not text.startswith((b"data: ", b"event: ")):
        return text
    parsed = []
    for block in filter(None, text.split(b"\n\n")):
        fields = dict(line.split(b": ", 1) for line in block.split(b"\n"))
        kind, data = fields.get(b"event", b""), fields[b"data"]
        obj: Any = data.decode() if data == b"[DONE]" else json.loads(data)
        if isinstance(obj, dict):
            obj.pop("sequence_number", None)  # numbered in order; checked where it matters
        parsed.append((kind, obj))
    if len({i for _, obj in parsed if (i := choice_index(obj)) is not None}) > 1:
        # Several choices interleave as their tokens come (timing): each choice's events in order, by index.
        last = len(parsed)  # the events of no choice (usage, [DONE]) stay at the end
        parsed.sort(key=lambda e: last if (i := choice_index(e[1])) is None else i)
    events: list[list[Any]] = []
    for kind, obj in parsed:
        if events and kind == events[-1][0] == b"response.output_text.delta":
            events[-1][1]["delta"] += obj["delta"]
        elif not (events and isinstance(obj, dict) and isinstance(events[-1][1], dict) and not kind
                  and merge_chunk(events[-1][1], obj)):
            events.append([kind, obj])
    return events


def same_answer_of(got: bytes, want: bytes) -> None:
    """Two answers to one request read the same: byte for byte but for ids and times when their streams broke
    into the same number of events; what a client reads (:func:`canonical`) when one server put several
    steps into one event because its reader fell behind (timing, not content), or when a stream has several
    choices (how they interleave is timing)."""
    if got.count(b"\n\n") == want.count(b"\n\n") and b'"index":1' not in want.replace(b" ", b""):
        assert normalized(got) == normalized(want)
    else:
        assert canonical(got) == canonical(want)


def write_lora_adapter(path: Path, *, seed: int, rank: int = 8) -> Path:
    """A LoRA adapter for the tiny model (``q_proj`` and ``v_proj`` of its 2 layers), PEFT's files, weights
    drawn from ``seed``: vLLM loads it, and its greedy output differs from the base model's."""
    import torch  # the vLLM tier's venv has it
    from safetensors.torch import save_file

    from fleetward.sim.tinymodel import TINY_SHAPE

    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    head = TINY_SHAPE["head_dim"]
    width = {"q_proj": TINY_SHAPE["num_attention_heads"] * head, "v_proj": TINY_SHAPE["num_key_value_heads"] * head}
    tensors = {}
    for layer in range(TINY_SHAPE["num_hidden_layers"]):
        for module, out in width.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, TINY_SHAPE["hidden_size"], generator=g)
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=g)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": list(width), "bias": "none", "base_model_name_or_path": None, "fan_in_fan_out": False,
        "modules_to_save": None, "use_rslora": False, "use_dora": False}))
    return path


class BusRecorder:
    """Every event a bus carries from now on (wait on ``subscribed`` before acting)."""

    def __init__(self, bus: EventBus) -> None:
        self.events: list[Event] = []
        self.subscribed = asyncio.Event()
        self.task = asyncio.create_task(self._run(bus))

    async def _run(self, bus: EventBus) -> None:
        async for e in bus.subscribe(subscribed=self.subscribed):
            self.events.append(e)

    def of(self, kind: str, worker: str | None = None, since: int = 0) -> list[Event]:
        """The events of ``kind`` (of ``worker``, when given) from index ``since`` (a :meth:`mark`) on."""
        return [e for e in self.events[since:] if e.kind == kind and (worker is None or e.worker == worker)]

    def mark(self) -> int:
        return len(self.events)

    def detected(self, worker: str, detector: str) -> bool:
        """Whether the supervisor called ``worker`` unhealthy by ``detector``."""
        return any(e.data["state"] == "unhealthy" and e.data["detector"] == detector
                   for e in self.of("health.changed", worker))


def library_fault(name: str, worker: str, **params: Any) -> Fault:
    """The chaos library's fault ``name`` (``process.kill_engine``...) aimed at one worker, as an experiment
    builds it (recovery waits up to 240 s: a vLLM restart on a busy CPU)."""
    assert fault_library.process  # importing the package fills the catalogue
    spec = CATALOGUE[name]
    return spec.factory(spec.params(recover_timeout_s=240, **params), Target(kind="worker", ids=(worker,)))
