"""The clients people put in front of vLLM, through a fleetward router while a worker is SIGKILLed mid-run.

One fleet for the module: three simulated workers serving the ``bpe`` vocabulary (shaped like production
tokenizers; vLLM's benchmark and AIPerf read it from the tiny model's folder) behind a router process, with a
supervisor that restarts what a test killed. Each test runs one client as its own process, the way its users
run it: the official ``openai`` Python client, the official OpenAI Node client (npm), ``vllm bench serve``,
NVIDIA AIPerf, LiteLLM, LangChain's ``ChatOpenAI``, LangChain's completions ``OpenAI`` LLM, which sends lists of
prompts, an RL rollout sampler asking for ``n = 4`` samples (those two are answered whole, one journaled
request per choice: migration/fanout.py), and lm-eval-harness, whose loglikelihood requests ask for the
prompt's logprobs (echo) and are relayed whole. Once tokens flow, the worker that holds the most streams is
SIGKILLed (its engine hung first, so that "it holds streams" is still true when the kill lands). Then every
client must report no failed request, and every output must equal the fault-free reference: what a worker
answers for the same request (greedy decoding, ``ignore_eos``), text and finish; the rollout's samples are
sampled, so only those the kill did not touch must.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from testkit import PATIENT_SUPERVISOR, routed_fleet

from fleetward.chaos.harness import TestFleet
from fleetward.fleet.config import RouterConfig, SimConfig

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

HERE = Path(__file__).parent
VENV = Path(sys.executable).parent.parent
AIPERF = VENV / "clients" / "aiperf" / "bin" / "aiperf"  # its own venv (./dev test installs it)
NODE_CLIENT = HERE / "node" / "node_modules" / "openai"  # npm ci in tests/clients/node (./dev test)
SIM = SimConfig(tokenizer="bpe", decode_step_ms=15.0, decode_ms_per_seq=0.1, prefill_ms_per_token=0.01, seed=3)
MAX_TOKENS = 40
CLIENT_TIMEOUT_S = 240.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(etcd_endpoint: str, broker_endpoint: str,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TestFleet]:
    async with routed_fleet(etcd_endpoint, broker_endpoint, tmp_path_factory.mktemp("clients-fleet"), "client-tests",
                            SIM, router="clients-r0", routing=RouterConfig(stall_floor_s=1.0),
                            supervisor=PATIENT_SUPERVISOR) as f:
        yield f


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's folder: its tokenizer is the one the workers serve (``bpe``)."""
    from fleetward.sim.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny", tokenizer="bpe")


def router_url(fleet: TestFleet) -> str:
    return fleet.routers[0].url


def requests(name: str, n: int = 12, *, chat_only: bool = False) -> list[dict[str, str]]:
    return [{"kind": "chat" if chat_only or i % 2 else "completion", "prompt": f"{name} asks, number {i}: "}
            for i in range(n)]


async def reference(fleet: TestFleet, reqs: list[dict[str, str]], max_tokens: int = MAX_TOKENS) -> list[dict[str, Any]]:
    """What a worker answers for each request, without faults: (text, finish reason)."""
    url = fleet.url(fleet.worker_ids[0])
    common = {"model": SIM.model_name, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    out = []
    async with httpx.AsyncClient(timeout=60) as client:
        for r in reqs:
            if r["kind"] == "chat":
                body = (await client.post(url + "/v1/chat/completions", json={
                    **common, "messages": [{"role": "user", "content": r["prompt"]}]})).json()["choices"][0]
                out.append({"text": body["message"]["content"], "finish_reason": body["finish_reason"]})
            else:
                body = (await client.post(url + "/v1/completions", json={**common, "prompt": r["prompt"]})).json()
                out.append({"text": body["choices"][0]["text"], "finish_reason": body["choices"][0]["finish_reason"]})
    return out


async def _busy_worker(fleet: TestFleet, client: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    view = (await client.get(router_url(fleet) + "/fleetward/v1/progress")).json()["workers"]
    return {w: v for w, v in view.items() if v["in_flight"] > 0 and v["tokens"] > 0
            and w in fleet.worker_ids and fleet.processes(w)}


async def kill_a_worker_mid_stream(fleet: TestFleet, client_proc: asyncio.subprocess.Process) -> str:
    """SIGKILL the worker holding the most streams, once it has sent tokens, while the client runs.

    The router's progress view says which worker holds streams and has sent tokens. That worker's engine is
    made to hang first (its fault switch: the process runs, its streams get no further token), so once the
    router has read what was on the wire (its view of the worker stays the same), the streams it still shows
    there are open and mid-way when the SIGKILL lands. If none is left (they had just finished), the hang is
    lifted and the search goes on. (Not SIGSTOP: the node agent finds a stopped engine at once and has the
    worker restarted, which would take out a worker the test meant to leave alone.)
    """
    async with httpx.AsyncClient(timeout=10) as client:
        while client_proc.returncode is None:
            busy = await _busy_worker(fleet, client)
            if busy:
                worker = max(busy, key=lambda w: busy[w]["in_flight"])
                await fleet.fault(worker, hang=True)
                before: Any = None
                for _ in range(50):  # until the router has read everything the hung worker had sent
                    await asyncio.sleep(0.05)
                    now = (await client.get(router_url(fleet) + "/fleetward/v1/progress")).json()["workers"]
                    seen = now.get(worker, {}).get("in_flight", 0), now.get(worker, {}).get("tokens", 0)
                    if seen == before:
                        break
                    before = seen
                if before is not None and before[0] > 0:
                    fleet.kill(worker)
                    return worker
                await fleet.fault(worker, hang=False)
            await asyncio.sleep(0.01)
    raise AssertionError("the client finished before a worker held a stream with tokens flowing")


async def run_killing_a_worker(fleet: TestFleet, argv: list[str], *, log: Path, env: dict[str, str] | None = None,
                               cwd: Path = HERE) -> bytes:
    """Run a client to its end, killing a worker mid-run; its stdout. Asserts the kill caused migrations."""
    counter = "fleetward_router_migrations_total"
    before = await router_counter(fleet, counter)
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=err,
                                                    stdin=asyncio.subprocess.DEVNULL, cwd=cwd,
                                                    env={**os.environ, **(env or {})})
        try:
            output = asyncio.ensure_future(proc.communicate())
            killer = asyncio.ensure_future(kill_a_worker_mid_stream(fleet, proc))
            done, _ = await asyncio.wait({output, killer}, timeout=CLIENT_TIMEOUT_S,
                                         return_when=asyncio.FIRST_EXCEPTION)
            if killer in done:
                killer.result()  # raises if the client finished first
            out, _ = await asyncio.wait_for(output, CLIENT_TIMEOUT_S)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            for task in (output, killer):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, AssertionError):
                    await task
    tail = (await asyncio.to_thread(log.read_text, errors="replace"))[-3000:]
    assert proc.returncode == 0, f"{argv[0]} exited {proc.returncode}:\n{tail}"
    assert await router_counter(fleet, counter) > before, "the killed worker's requests were served elsewhere"
    return out


async def router_counter(fleet: TestFleet, prefix: str) -> float:
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(router_url(fleet) + "/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def assert_exact(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    assert [g["error"] for g in got] == [None] * len(expected), [g["error"] for g in got if g["error"]]
    assert [{"text": g["text"], "finish_reason": g["finish_reason"]} for g in got] == expected


async def _job_client(fleet: TestFleet, tmp_path: Path, argv: list[str], name: str, *, chat_only: bool = False) -> None:
    reqs = requests(name, chat_only=chat_only)
    expected = await reference(fleet, reqs)
    job = {"base_url": router_url(fleet), "model": SIM.model_name, "max_tokens": MAX_TOKENS, "concurrency": 6,
           "requests": reqs}
    out = await run_killing_a_worker(fleet, [*argv, json.dumps(job)], log=tmp_path / f"{name}.log")
    assert_exact(json.loads(out), expected)


async def test_the_openai_python_client_streams_through_a_worker_kill(healthy: TestFleet, tmp_path: Path) -> None:
    await _job_client(healthy, tmp_path, [sys.executable, str(HERE / "run_openai.py")], "openai-python")


async def test_the_openai_node_client_streams_through_a_worker_kill(healthy: TestFleet, tmp_path: Path) -> None:
    node = shutil.which("node")
    assert node and NODE_CLIENT.is_dir(), "node, and the openai npm package (./dev test: npm ci in tests/clients/node)"
    await _job_client(healthy, tmp_path, [node, str(HERE / "node" / "run_openai.mjs")], "openai-node")


async def test_litellm_streams_through_a_worker_kill(healthy: TestFleet, tmp_path: Path) -> None:
    await _job_client(healthy, tmp_path, [sys.executable, str(HERE / "run_litellm.py")], "litellm")


async def test_langchains_chat_openai_streams_through_a_worker_kill(healthy: TestFleet, tmp_path: Path) -> None:
    await _job_client(healthy, tmp_path, [sys.executable, str(HERE / "run_langchain.py")], "langchain",
                      chat_only=True)


async def test_langchains_completions_llm_batches_prompts_through_a_worker_kill(healthy: TestFleet,
                                                                                 tmp_path: Path) -> None:
    """LangChain's completions ``OpenAI`` LLM sends its prompts as lists (``batch_size`` per request, not
    streamed), as lm-eval-harness does: every prompt answered, each as a worker answers it alone, though a
    worker computing some of them was SIGKILLed (each prompt is a journaled request of its own: those
    continued on another worker from their tokens)."""
    reqs = [{"kind": "completion", "prompt": f"langchain batch, prompt {i}: "} for i in range(12)]
    expected = await reference(healthy, reqs)
    job = {"base_url": router_url(healthy), "model": SIM.model_name, "max_tokens": MAX_TOKENS, "batch_size": 4,
           "requests": reqs}
    out = await run_killing_a_worker(healthy, [sys.executable, str(HERE / "run_langchain_batch.py"), json.dumps(job)],
                                     log=tmp_path / "langchain-batch.log")
    assert_exact(json.loads(out), expected)


async def test_lm_eval_harness_scores_the_same_through_a_worker_kill(healthy: TestFleet, tiny_model: Path,
                                                                    tmp_path: Path) -> None:
    """lm-eval-harness on small tasks of our own (tests/clients/lmeval: multiple choice scored by
    loglikelihood, and answers generated greedily), with its ``local-completions`` and
    ``local-chat-completions`` models, run against a worker and then through the router while a worker is
    SIGKILLed: every request answered, and every document's responses the same. Its loglikelihood requests
    (echo, logprobs) are relayed whole and sent again from the start where a worker fails before answering;
    its generations are journaled, one request per prompt of a batch."""
    job = {"model": SIM.model_name, "tokenizer": str(tiny_model), "reference_url": healthy.url(healthy.worker_ids[0]),
           "router_url": router_url(healthy)}
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    out = await run_killing_a_worker(healthy, [sys.executable, str(HERE / "run_lm_eval.py"), json.dumps(job)],
                                     log=tmp_path / "lm-eval.log", env=env)
    runs = json.loads(out.splitlines()[-1])
    want = {"local-completions": ["fleetward_choice", "fleetward_answer"],
            "local-chat-completions": ["fleetward_answer"]}
    for model_type, tasks in want.items():
        reference, routed = runs["reference"][model_type], runs["router"][model_type]
        assert "error" not in reference and "error" not in routed, (model_type, reference, routed)
        assert sorted(routed) == sorted(tasks)
        for task in tasks:
            assert len(routed[task]) == 16
            assert routed[task] == reference[task], (model_type, task)


async def test_an_rl_rollout_sampler_gets_every_sample_through_a_worker_kill(healthy: TestFleet,
                                                                            tmp_path: Path) -> None:
    """``n = 4`` seeded samples per prompt, not streamed, as RL rollout jobs ask for them: every prompt gets its
    four samples, though a worker computing some of them was SIGKILLed. Each sample is a journaled request of
    its own (seed + k, as vLLM's child requests): one the kill did not touch is the one a worker gives for
    the request (seeded: the same on every worker); one it did continued on another worker from its tokens,
    a fresh sample from there on (docs/architecture.md, "What is exact"), so no more differ than moved."""
    prompts = [f"rollout {i}: " for i in range(8)]
    url = healthy.url(healthy.worker_ids[0])
    async with httpx.AsyncClient(timeout=60) as client:
        expected = [[c["text"] for c in (await client.post(url + "/v1/completions", json={
            "model": SIM.model_name, "prompt": p, "max_tokens": MAX_TOKENS, "n": 4, "temperature": 1.0, "seed": i,
            "ignore_eos": True})).json()["choices"]] for i, p in enumerate(prompts)]
    job = {"base_url": router_url(healthy), "model": SIM.model_name, "max_tokens": MAX_TOKENS, "n": 4,
           "concurrency": 2, "requests": [{"prompt": p} for p in prompts]}
    moved = await router_counter(healthy, "fleetward_router_migrations_total")
    out = await run_killing_a_worker(healthy, [sys.executable, str(HERE / "run_rollouts.py"), json.dumps(job)],
                                     log=tmp_path / "rollouts.log")
    moved = await router_counter(healthy, "fleetward_router_migrations_total") - moved
    got = json.loads(out)
    assert [g["error"] for g in got] == [None] * len(prompts), [g["error"] for g in got if g["error"]]
    assert [len(g["samples"]) for g in got] == [4] * len(prompts)
    same = sum(a == b for g, want in zip(got, expected, strict=True) for a, b in zip(g["samples"], want, strict=True))
    assert same >= 4 * len(prompts) - moved, f"{4 * len(prompts) - same} samples differ, {moved} moved"
    assert all(len(set(s)) == 4 for s in expected), "four different samples each"
    assert {r for g in got for r in g["finish_reasons"]} == {"length"}


async def test_vllm_bench_serve_completes_every_request_through_a_worker_kill(
        healthy: TestFleet, tiny_model: Path, tmp_path: Path) -> None:
    """``vllm bench serve --backend openai --endpoint /v1/completions --dataset-name random``: every request
    completed with its full length, and the texts are the ones the same run gets from a worker directly."""
    result = tmp_path / "bench.json"
    argv = [sys.executable, str(HERE / "run_vllm_bench.py"), str(result), healthy.url(healthy.worker_ids[0]),
            router_url(healthy), "--backend", "openai", "--endpoint", "/v1/completions", "--model", SIM.model_name,
            "--tokenizer", str(tiny_model), "--dataset-name", "random", "--random-input-len", "32",
            "--random-output-len", str(MAX_TOKENS), "--num-prompts", "16", "--max-concurrency", "8", "--ignore-eos",
            "--temperature", "0", "--seed", "0", "--disable-tqdm"]
    await run_killing_a_worker(healthy, argv, log=tmp_path / "bench.log", env={"HF_HUB_OFFLINE": "1"})
    runs = json.loads(result.read_text())
    ref, routed = runs["reference"], runs["routed"]
    assert ref["completed"] == 16 and ref["failed"] == 0, ref["errors"]
    assert routed["completed"] == 16 and routed["failed"] == 0, [e for e in routed["errors"] if e]
    assert routed["output_lens"] == [MAX_TOKENS] * 16
    assert routed["generated_texts"] == ref["generated_texts"]


def _hub_cache(model: Path, root: Path) -> Path:
    """``model``'s tokenizer laid out as a hub cache entry ``local/tiny`` (AIPerf takes only hub ids offline)."""
    snapshot = root / "models--local--tiny" / "snapshots" / "local"
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, snapshot / f.name)
    (root / "models--local--tiny" / "refs").mkdir(exist_ok=True)
    (root / "models--local--tiny" / "refs" / "main").write_text("local")
    return root


async def test_aiperf_completes_every_request_through_a_worker_kill(
        healthy: TestFleet, tiny_model: Path, tmp_path: Path) -> None:
    """NVIDIA AIPerf's streamed completions: no request failed, every one has its full length, and each
    text (from AIPerf's raw export of every chunk) equals a worker's answer to the same prompt. AIPerf counts
    an in-band error as a success, so the texts are what proves the streams whole."""
    assert AIPERF.exists(), f"AIPerf is installed by ./dev test into {AIPERF.parent.parent}"
    cache = _hub_cache(tiny_model, tmp_path / "hub")
    artifacts = tmp_path / "aiperf"
    argv = [str(AIPERF), "profile", "--model", SIM.model_name, "--url", router_url(healthy), "--endpoint-type",
            "completions", "--streaming", "--request-count", "16", "--concurrency", "8", "--tokenizer", "local/tiny",
            "--synthetic-input-tokens-mean", "32", "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean",
            str(MAX_TOKENS), "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--extra-inputs",
            "temperature:0", "--random-seed", "0", "--export-level", "raw", "--artifact-dir", str(artifacts),
            "--ui-type", "none", "--no-server-metrics"]
    await run_killing_a_worker(healthy, argv, log=tmp_path / "aiperf.log", cwd=tmp_path,
                               env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    raw = await asyncio.to_thread((artifacts / "profile_export_raw.jsonl").read_text)
    records = [json.loads(line) for line in raw.splitlines()]
    assert len(records) == 16
    assert [r["status"] for r in records] == [200] * 16
    assert not [r["error"] for r in records if r.get("error")]
    prompts, texts = [], []
    for r in records:
        prompts.append({"kind": "completion", "prompt": r["payload"]["prompt"]})
        chunks = [json.loads(p["value"]) for resp in r["responses"] for p in resp["packets"]
                  if p["name"] == "data" and p["value"].startswith("{")]
        assert not [c for c in chunks if "error" in c]
        texts.append({"text": "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")),
                      "finish_reason": next((c["choices"][0]["finish_reason"] for c in chunks
                                             if c.get("choices") and c["choices"][0]["finish_reason"]), None)})
    await healthy.restore(timeout=60)  # the reference comes from a worker: the killed one is back
    assert texts == await reference(healthy, prompts)
