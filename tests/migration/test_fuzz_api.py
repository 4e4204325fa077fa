"""Bad input, fuzzed: the router's and the controller's HTTP APIs, from the OpenAPI specs they serve.

A small real fleet (real etcd and Mosquitto, one simulated worker, a router process, a controller
process) is fuzzed with schemathesis through every operation of each spec, in positive mode (what the
spec allows) and negative mode (what it does not), the controller's commands with and without the bearer
token; then statefully, following the specs' links (a 200's ``X-Request-Id`` to a ``Last-Event-ID``
resume; a started worker to the commands on it). Every answer must be below 500, arrive within
``_TIMEOUT_S`` (no hang), and a refusal (4xx) must say why in its body.

Deterministic (``derandomize``) and bounded: ``FLEETWARD_FUZZ_EXAMPLES`` sets the examples per operation
and mode (default 20; raise it for a longer hunt, e.g. 500); ``FLEETWARD_FUZZ_RANDOM=1`` draws new inputs
each run (hypothesis prints the seed of a failure).
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import pytest_asyncio
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error

from fleetward.chaos.harness import TestFleet
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.config import SimConfig, SupervisorConfig
from fleetward.fleet.worker import WorkerRecord
from fleetward.migration.adapters import ADAPTER_ROUTES
from fleetward.migration.passthrough import ROUTES

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

DERANDOMIZE = not os.environ.get("FLEETWARD_FUZZ_RANDOM")  # FLEETWARD_FUZZ_RANDOM=1: new inputs each run
EXAMPLES = int(os.environ.get("FLEETWARD_FUZZ_EXAMPLES", "20"))
_TIMEOUT_S = 20.0
# Fast tokens and a short context, so a request the spec allows finishes in milliseconds.
SIM = SimConfig(decode_step_ms=0.2, decode_ms_per_seq=0.0, prefill_ms_per_token=0.0, max_model_len=64, seed=5)
TOKEN = "fuzz-admin-token"
API_KEY = "sk-fuzz-" + "k" * 24  # the keyed router's one key
GHOST = "ghost-w0"  # a registered worker that never answers: the controller's commands reach its state machine


def _settings(examples: int, **kw: Any) -> settings:
    return settings(max_examples=examples, deadline=None, derandomize=DERANDOMIZE, database=None, print_blob=True,
                    suppress_health_check=list(HealthCheck),
                    phases=[Phase.explicit, Phase.generate, Phase.shrink], **kw)


def _refusal_message(response: Any) -> str | None:
    """What a refusal says, from the shapes the services answer with (OpenAI's, the control API's, FastAPI's)."""
    try:
        body = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict):
        return None
    error = body.get("error", body.get("detail"))
    if isinstance(error, dict):
        error = error.get("message")
    return str(error) if error else None


def check_answer(case: Case, response: Any) -> None:
    """No server error, and a refusal says why."""
    case.validate_response(response, checks=[not_a_server_error])
    if 400 <= response.status_code < 500 and response.status_code != 499:
        assert _refusal_message(response), (
            f"{case.operation.label}: {response.status_code} without a message: {response.content[:300]!r}")


def fuzz_operations(schema: Any, base_url: str, *, auth: dict[str, dict[str, str]],
                    examples: int = EXAMPLES) -> tuple[list[str], list[str]]:
    """Every operation of ``schema``, positive and negative, once per header set of ``auth``.

    Returns (the operations fuzzed, the failures: one line each, with the falsifying request).
    """
    labels: list[str] = []
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        labels.append(operation.label)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            for who, headers in auth.items():
                try:
                    statuses = _fuzz_one(operation, mode, base_url, headers, examples)
                    print(f"{operation.label} [{mode.value}, {who}]: {dict(sorted(statuses.items()))}")
                except Unsatisfiable:
                    assert mode is GenerationMode.NEGATIVE, operation.label  # nothing in it to break
                except Exception as exc:  # every failure is reported, with its request
                    failures.append(f"{operation.label} [{mode.value}, {who}]: {type(exc).__name__}: {exc}")
    return labels, failures


def _fuzz_one(operation: Any, mode: GenerationMode, base_url: str, headers: dict[str, str],
              examples: int) -> Counter[int]:
    statuses: Counter[int] = Counter()

    @_settings(examples)
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Case) -> None:
        response = case.call(base_url=base_url, headers=headers, timeout=_TIMEOUT_S)
        statuses[response.status_code] += 1
        check_answer(case, response)

    run()
    return statuses


def fuzz_links(schema: Any, base_url: str, headers: dict[str, str], *,
               examples: int = EXAMPLES) -> tuple[int, Counter[str]]:
    """The spec's links, followed by schemathesis' state machine (raises on the first failure).

    Returns how many requests used what an earlier answer gave (a request id, a started worker's id), and
    every answer's operation and status (what to look at when none did).
    """
    machine: Any = schema.as_state_machine()
    given_out: set[str] = set()
    answers: Counter[str] = Counter()
    followed = 0

    class Links(machine):
        def get_call_kwargs(self, case: Case) -> dict[str, Any]:
            return {"base_url": base_url, "headers": headers, "timeout": _TIMEOUT_S}

        def validate_response(self, response: Any, case: Case, additional_checks: Any = None, **kw: Any) -> None:
            nonlocal followed
            headers: Mapping[str, Any] = case.headers or {}
            resumed = str(headers.get("Last-Event-ID", "")).rpartition(":")[0]
            worker = str((case.path_parameters or {}).get("worker", ""))
            followed += bool(({resumed, worker} - {""}) & given_out)  # an empty header is nobody's id
            answers[f"{case.operation.label} {response.status_code}"] += 1
            if response.status_code == 200:
                answered = {k.lower(): v for k, v in response.headers.items()}
                given_out.add((answered.get("x-request-id") or [""])[0])
                if case.operation.label == "POST /v1/workers" and isinstance(case.body, dict):
                    given_out.add(str(case.body.get("id")))
            check_answer(case, response)

    Links.run(settings=_settings(examples, stateful_step_count=6))
    return followed, answers


def load_spec(url: str, edit: Callable[[dict[str, Any]], None] | None = None) -> Any:
    """The spec a service serves (after ``edit``), bound to the service."""
    raw = requests.get(f"{url}/openapi.json", timeout=10).json()
    if edit is not None:
        edit(raw)
    schema = schemathesis.openapi.from_dict(raw)
    schema.config.base_url = url
    return schema


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(etcd_endpoint: str, broker_endpoint: str,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TestFleet]:
    run_dir: Path = tmp_path_factory.mktemp("fuzz-fleet")
    supervisor = SupervisorConfig(restart_budget=1000, backoff_initial_s=0.05, backoff_max_s=0.2)
    async with TestFleet(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster="fuzz-api", run_dir=run_dir, workers=1,
                         backend=SimBackend(SIM), supervisor=supervisor, controller_processes=1, admin_token=TOKEN,
                         node="fuzznode") as f:
        await f.start_router("r0")
        # A worker on a node no agent runs, whose URL answers nothing: commands on it get past "no such worker"
        # without touching the real worker the router serves from.
        ghost = WorkerRecord(id=GHOST, url="http://127.0.0.1:9", role="aggregated", model="ghost-model",
                             node="ghostnode", backend="sim")
        await f.store.put(f.keys.worker(GHOST), ghost.to_json())
        yield f


async def _controller_url(fleet: TestFleet) -> str:
    leader = await fleet.wait_leader()
    async with httpx.AsyncClient(timeout=10) as client:
        for _ in range(100):  # the ghost registered with the leader's state machine
            r = await client.get(f"{leader.url}/v1/workers", headers={"authorization": f"Bearer {TOKEN}"})
            if GHOST in r.json().get("workers", {}):
                return leader.url
            await asyncio.sleep(0.1)
    raise AssertionError(f"the controller never saw {GHOST}")


def _router_spec_for(model: str, *, only_generations: bool = False) -> Callable[[dict[str, Any]], None]:
    """The router's spec with ``model`` the one model it serves, so what the spec allows reaches a worker;
    ``only_generations``: just the two operations that link to their resume (the rest, passed through to a
    worker, leave the state machine no link to follow), with bodies the journal takes and a worker serves, so
    that most answers are 200s with a link to follow: the prompt, a few tokens, ``stream`` and
    ``temperature`` (what the journal does not take is passed through, what a worker refuses is its 400, and
    neither has an id of the router's to resume)."""

    def edit(raw: dict[str, Any]) -> None:
        generations = ("/v1/completions", "/v1/chat/completions")
        for item in raw["paths"].values():
            for operation in item.values():
                for content in operation.get("requestBody", {}).get("content", {}).values():
                    props = content["schema"].get("properties", {})
                    if "model" in props:
                        props["model"] = {"type": "string", "enum": [model]}
                    if only_generations:
                        content["schema"]["additionalProperties"] = False
                        for key in set(props) - {"model", "prompt", "messages", "stream"}:
                            props.pop(key)
                        props["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": 8}
                        props["temperature"] = {"type": "number", "minimum": 0, "maximum": 1}
                        if "prompt" in props:
                            props["prompt"] = {"oneOf": props["prompt"]["oneOf"][:2]}  # one prompt
        if only_generations:
            raw["paths"] = {path: raw["paths"][path] for path in generations}

    return edit


async def test_the_router_answers_any_request_its_spec_allows_or_forbids_without_a_server_error(
        fleet: TestFleet) -> None:
    url = fleet.routers[0].url
    schema = load_spec(url, _router_spec_for(SIM.model_name))
    labels, failures = await asyncio.to_thread(fuzz_operations, schema, url, auth={"anonymous": {}})
    assert set(labels) >= {"GET /health", "GET /metrics", "GET /v1/models", "GET /fleetward/v1/progress",
                           "POST /v1/completions", "POST /v1/chat/completions",
                           *(f"{r.method} {r.path}" for r in ROUTES)}
    assert not failures, "\n\n".join(failures)


async def test_the_router_survives_resumes_along_its_specs_links(fleet: TestFleet) -> None:
    url = fleet.routers[0].url
    schema = load_spec(url, _router_spec_for(SIM.model_name, only_generations=True))
    for worker in fleet.worker_ids:  # back to serving after the fuzzing before (a worker it broke, restarted)
        await fleet.ensure_serving(worker)
    followed, answers = await asyncio.to_thread(fuzz_links, schema, url, {})
    assert followed > 0, f"no resume of a request the router answered; its answers: {dict(answers)}"


async def test_a_keyed_router_answers_with_or_without_its_key_without_a_server_error(fleet: TestFleet) -> None:
    keys = fleet.run_dir / "keys.yaml"
    keys.write_text(f"keys:\n  - name: fuzz\n    key: {API_KEY}\n    max_concurrency: 4\n")
    keys.chmod(0o600)
    router = await fleet.start_router("r-keyed", api_keys_file=keys)
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            spec = (await client.get(router.url + "/openapi.json")).json()
        assert spec["components"]["securitySchemes"]["apiKey"] == {"type": "http", "scheme": "bearer"}
        keyed = {p for p, item in spec["paths"].items() for op in item.values() if "security" in op}
        assert keyed == {"/v1/completions", "/v1/chat/completions", "/v1/models", *(r.path for r in ROUTES),
                         *ADAPTER_ROUTES}, (
            "every API route takes the key; health, metrics and progress stay open")
        schema = load_spec(router.url, _router_spec_for(SIM.model_name))
        key = {"authorization": f"Bearer {API_KEY}"}
        labels, failures = await asyncio.to_thread(
            fuzz_operations, schema, router.url, examples=max(5, EXAMPLES // 4),
            auth={"key": key, "no key": {}, "wrong key": {"authorization": "Bearer sk-" + "0" * 24}})
        assert "POST /v1/completions" in labels
        assert not failures, "\n\n".join(failures)
        linked = load_spec(router.url, _router_spec_for(SIM.model_name, only_generations=True))
        followed, answers = await asyncio.to_thread(fuzz_links, linked, router.url, key)
        assert followed > 0, f"no resume under the same key; the router's answers: {dict(answers)}"
    finally:
        await fleet.stop_router(router)


def _on_workers(*workers: str) -> Callable[[dict[str, Any]], None]:
    """The controller's spec with the commands' worker one of ``workers`` (what it forbids: any other string)."""

    def edit(raw: dict[str, Any]) -> None:
        for path, item in raw["paths"].items():
            for operation in item.values():
                for param in operation.get("parameters", []):
                    if param["name"] == "worker" and path.startswith("/v1/workers/{worker}"):
                        param["schema"] = {"type": "string", "enum": list(workers)}

    return edit


async def test_the_controller_answers_any_request_with_or_without_the_token_without_a_server_error(
        fleet: TestFleet) -> None:
    url = await _controller_url(fleet)
    # The router's tests are done: the real worker may be drained, stopped and restarted now.
    schema = load_spec(url, _on_workers(GHOST, *fleet.worker_ids))
    labels, failures = await asyncio.to_thread(
        fuzz_operations, schema, url, auth={"token": {"authorization": f"Bearer {TOKEN}"}, "no token": {},
                                            "wrong token": {"authorization": "Bearer nope"}})
    assert set(labels) >= {"GET /v1/workers", "POST /v1/workers", "POST /v1/workers/{worker}/drain",
                           "POST /v1/workers/{worker}/undrain", "POST /v1/workers/{worker}/restart",
                           "POST /v1/workers/{worker}/quarantine/clear", "GET /v1/fleet", "GET /health"}
    assert not failures, "\n\n".join(failures)


async def test_the_controller_survives_commands_along_its_specs_links(fleet: TestFleet) -> None:
    url = await _controller_url(fleet)
    # Commands on workers it was asked to start (on nodes no agent runs: never started, so refused).
    followed, answers = await asyncio.to_thread(fuzz_links, load_spec(url), url, {"authorization": f"Bearer {TOKEN}"})
    assert followed > 0, f"no command on a worker it was asked to start; its answers: {dict(answers)}"


@pytest.mark.parametrize("body", [b"[]", b'"cordon"', b"3", b'{"deadline_s": "nan"}', b'{"deadline_s": NaN}',
                                  b'{"deadline_s": "inf"}', b'{"deadline_s": 1e999}', b'{"deadline_s": -1}',
                                  b'{"deadline_s": [1]}', b'{"then": "explode"}', b"{", b"\xff"])
async def test_a_malformed_drain_is_refused_with_400_saying_why(fleet: TestFleet, body: bytes) -> None:
    """Found by the fuzzer: a JSON array as the body was a 500 (``.get`` on a list); a NaN or infinite
    deadline was accepted and written into the worker's health record, where it never passes."""
    url = await _controller_url(fleet)
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(f"{url}/v1/workers/{GHOST}/drain", content=body,
                              headers={"authorization": f"Bearer {TOKEN}", "content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith("bad drain request: ")
