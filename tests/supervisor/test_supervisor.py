"""The supervisor on real simulated workers, real etcd, a real broker and a real router process.

Each failure is detected and remediated, and streams stay exact throughout.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import pytest_asyncio
from testkit import BusRecorder, fleet_sim

from fleetward.chaos.fakegpu import FakeGpuSource
from fleetward.chaos.harness import TestFleet
from fleetward.chaos.workload import sse_lines
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.config import RouterConfig, SupervisorConfig
from fleetward.fleet.launch import controller_argv, service_env
from fleetward.fleet.procs import ManagedProcess, free_port
from fleetward.fleet.registry import read_fleet
from fleetward.fleet.signing import ActionSigner
from fleetward.fleet.worker import WorkerSpec
from fleetward.sim.model import SimModel
from fleetward.sim.tokenizer import encode

pytestmark = pytest.mark.asyncio(loop_scope="module")

SIM = fleet_sim(seed=3)
MODEL = SimModel(seed=SIM.seed)
SUPERVISOR = SupervisorConfig(canary_interval_s=5.0, canary_timeout_s=1.0, restart_budget=100,
                              backoff_initial_s=0.05, backoff_max_s=0.2, lease_ttl_s=2)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(etcd_endpoint: str, broker_endpoint: str,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TestFleet]:
    async with TestFleet(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster="supervisor-tests",
                         run_dir=tmp_path_factory.mktemp("supervisor"), workers=3, backend=SimBackend(SIM),
                         routing=RouterConfig(stall_floor_s=0.5), supervisor=SUPERVISOR,
                         gpu=FakeGpuSource(count=3), gpus_per_worker=1) as f:
        f.events = BusRecorder(f.bus)  # type: ignore[attr-defined]
        await f.events.subscribed.wait()  # type: ignore[attr-defined]
        await f.start_router("r0")
        yield f


async def command(fleet: TestFleet, worker: str, what: str, body: dict[str, Any] | None = None,
                  token: str | None = None, controller: int = 0) -> httpx.Response:
    ctl = fleet.controllers[controller][0]
    transport = httpx.ASGITransport(app=ctl.app())
    async with httpx.AsyncClient(transport=transport, base_url="http://controller") as client:
        return await client.post(f"/v1/workers/{worker}/{what}", json=body or {},
                                 headers={"Authorization": f"Bearer {token or fleet.admin_token}"})


async def state_of(fleet: TestFleet, worker: str) -> str:
    h = (await read_fleet(fleet.store, fleet.keys)).health.get(worker)
    return h.state.value if h else "none"


async def stream(fleet: TestFleet, prompt: list[int], max_tokens: int, on_tokens: Any = None) -> tuple[list[int], Any]:
    tokens: list[int] = []
    error = None
    async with httpx.AsyncClient(timeout=60) as client, client.stream(
            "POST", fleet.routers[0].url + "/v1/completions",
            json={"model": "sim-tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                  "return_token_ids": True}, headers={"X-Fleetward-Trace": "1"}) as r:
        assert r.status_code == 200
        async for line in sse_lines(r.aiter_bytes()):
            if line.startswith("data: {"):
                data = orjson.loads(line[6:])
                if "error" in data:
                    error = data["error"]
                    continue
                tokens.extend(data["choices"][0]["token_ids"])
                if on_tokens is not None:
                    await on_tokens(len(tokens), data["fleetward"]["worker"])
    return tokens, error


async def test_a_crash_is_detected_at_once_and_the_worker_restarted(healthy: TestFleet, wait_until: Any) -> None:
    events = healthy.events  # type: ignore[attr-defined]
    mark = events.mark()
    victim = healthy.worker_ids[0]
    healthy.kill(victim)
    await wait_until(lambda: events.of("restart", victim, mark), timeout=10, message="restart issued")
    unhealthy = [e for e in events.of("health.changed", victim, mark) if e.data["state"] == "unhealthy"]
    assert unhealthy[0].data["detector"] == "process" and "exited with code -9" in unhealthy[0].data["reason"]
    await healthy.wait_healthy()
    states = [e.data["state"] for e in events.of("health.changed", victim, mark)]
    assert states[:4] == ["unhealthy", "restarting", "starting", "ready"]


@pytest.mark.parametrize("how", ["hang switch", "sigstop"])
async def test_a_silent_hang_mid_stream_is_detected_migrated_and_restarted(healthy: TestFleet, how: str,
                                                                          wait_until: Any) -> None:
    events = healthy.events  # type: ignore[attr-defined]
    mark = events.mark()
    prompt = encode(f"hang by {how}: ")
    hung: list[str] = []

    async def on_tokens(n: int, worker: str) -> None:
        if n == 30 and not hung:
            hung.append(worker)
            if how == "hang switch":
                await healthy.fault(worker, hang=True)  # /health stays 200, the engine stops
            else:
                healthy.handle(worker).process.signal(signal.SIGSTOP)

    tokens, error = await stream(healthy, prompt, 150, on_tokens)
    assert error is None and tokens == MODEL.continuation(prompt, 150), "the stream moved on, exactly"
    (victim,) = hung
    await wait_until(lambda: events.of("hang.detected", victim, mark), timeout=15, message="hang detected")
    detected = events.of("hang.detected", victim, mark)[0]
    # The router's stall report or a routine canary (whichever catches the hung engine first) raises the
    # suspicion and a canary confirms it; a stopped process is also seen directly by the node agent, and
    # which of the two gets there first is a race (both within about a second; the agent's detector has
    # its own tests in test_detectors.py).
    expected = {"stream-progress+canary", "canary"} if how == "hang switch" else {"engine-frozen",
                                                                                  "stream-progress+canary"}
    assert detected.data["detector"] in expected
    await wait_until(lambda: events.of("restart", victim, mark), timeout=10)
    await healthy.wait_healthy()


async def test_a_worker_emitting_wrong_tokens_is_caught_by_golden_canaries(healthy: TestFleet,
                                                                          wait_until: Any) -> None:
    events = healthy.events  # type: ignore[attr-defined]
    mark = events.mark()
    victim = healthy.worker_ids[1]
    await healthy.fault(victim, wrong_tokens={"probability": 1.0})

    def caught() -> bool:
        return any(e.data["state"] == "unhealthy" and "wrong tokens" in e.data["reason"]
                   for e in events.of("health.changed", victim, mark))

    await wait_until(caught, timeout=20, message="a routine canary notices the wrong tokens")
    await healthy.wait_healthy()


async def test_gpu_faults_follow_the_xid_policy(healthy: TestFleet, wait_until: Any) -> None:
    events = healthy.events  # type: ignore[attr-defined]
    gpu: FakeGpuSource = healthy.gpu
    w0, w1, w2 = healthy.worker_ids
    mark = events.mark()
    gpu.inject_xid(0, 13)  # graphics engine exception: restart the worker
    gpu.inject_xid(1, 79)  # fallen off the bus: retire the GPU
    gpu.throttle(2, "hw_thermal")  # slow, not broken
    await wait_until(lambda: events.of("restart", w0, mark), timeout=10)
    await wait_until(lambda: events.of("quarantine", w1, mark), timeout=10)
    await wait_until(lambda: any(e.data["state"] == "suspect" for e in events.of("health.changed", w2, mark)),
                     timeout=10)
    assert await healthy.store.get(healthy.keys.quarantine_of(healthy.node, 1)) is not None
    assert not healthy.processes(w1), "the quarantined worker is stopped"
    gpu.unthrottle(2)
    await wait_until(lambda: _is(healthy, w2, "ready"), timeout=15, message="throttling ended")
    # Clearing the quarantine runs the self-test first: a failing GPU stays out.
    gpu.clear(1)
    gpu.fail_selftest(1, reason="wrong matmul")
    assert (await command(healthy, w1, "quarantine/clear")).status_code == 200
    await wait_until(lambda: _reason_has(healthy, w1, "self-test failed"), timeout=15)
    gpu.pass_selftest(1)
    assert (await command(healthy, w1, "quarantine/clear")).status_code == 200
    await wait_until(lambda: _is(healthy, w1, "ready"), timeout=30)


async def _is(fleet: TestFleet, worker: str, state: str) -> bool:
    return await state_of(fleet, worker) == state


async def _reason_has(fleet: TestFleet, worker: str, text: str) -> bool:
    h = (await read_fleet(fleet.store, fleet.keys)).health.get(worker)
    return h is not None and text in h.reason


async def test_drain_lets_a_stream_finish_and_routes_nothing_new_there(healthy: TestFleet, wait_until: Any) -> None:
    prompt = encode("drain around me: ")
    serving: list[str] = []
    done = asyncio.Event()

    async def on_tokens(n: int, worker: str) -> None:
        if n == 5 and not serving:
            serving.append(worker)
            r = await command(healthy, worker, "drain", {"deadline_s": 60, "then": "stop"})
            assert r.status_code == 200 and r.json()["what"].endswith("it is then stopped")
            await wait_until(lambda: _is(healthy, worker, "draining"), timeout=5)
            await stream(healthy, encode("somewhere else"), 5, collect_worker)
            done.set()

    seen_workers: list[str] = []

    async def collect_worker(n: int, worker: str) -> None:
        seen_workers.append(worker)

    tokens, error = await stream(healthy, prompt, 200, on_tokens)
    assert error is None and tokens == MODEL.continuation(prompt, 200), "the drained worker finished the stream"
    assert done.is_set() and serving[0] not in seen_workers, "no new work on a draining worker"
    await wait_until(lambda: _is(healthy, serving[0], "dead"), timeout=15, message="stopped once drained")
    assert not healthy.processes(serving[0])
    r = await command(healthy, serving[0], "restart")  # an operator's restart of a stopped worker starts it
    assert r.status_code == 200 and r.json() | {"leader": None} == {
        "accepted": True, "leader": None, "state": "dead", "what": "starting it again"}
    await wait_until(lambda: _is(healthy, serving[0], "ready"), timeout=30, message="started again")
    await healthy.wait_workers_routable(len(healthy.worker_ids))


async def test_a_command_for_an_unknown_worker_is_404_and_leaves_no_trace(healthy: TestFleet) -> None:
    r = await command(healthy, "wrokerr", "restart")
    assert r.status_code == 404
    assert r.json()["workers"] == sorted(healthy.worker_ids) and "no worker 'wrokerr'" in r.json()["error"]
    fleet = await read_fleet(healthy.store, healthy.keys)
    assert "wrokerr" not in fleet.health and "wrokerr" not in fleet.workers, "no phantom worker"
    actions = (await healthy.store.get_prefix(healthy.keys.actions)).items
    assert not [kv.key for kv in actions if "wrokerr" in kv.key], "no orphan action"


async def test_an_action_the_leader_did_not_sign_is_refused_and_a_replay_is_not_run_again(
        healthy: TestFleet, wait_until: Any) -> None:
    """Anyone who can write to etcd could queue a restart around the control API's token. The agent carries out
    only actions the leader signed, addressed to its node, fresh, and not run before."""
    worker = healthy.worker_ids[0]
    pids = healthy.processes(worker)
    agent = healthy.agent
    assert agent is not None
    refused = agent.metrics.refused._value.get()
    now = healthy.agent.clock.wall()
    base: dict[str, Any] = {"worker": worker, "node": healthy.node, "kind": "restart", "delay_s": 0.0,
                            "reason": "forged", "status": "pending", "issued_by": "nobody", "issued_at": now}
    forged = {**base, "id": f"{worker}.restart.forged"}
    wrong_key = ActionSigner("not-the-admin-token").sign({**base, "id": f"{worker}.restart.wrongkey"})
    stale = ActionSigner(healthy.admin_token).sign({**base, "id": f"{worker}.restart.stale", "issued_at": now - 3600})
    elsewhere = ActionSigner(healthy.admin_token).sign({**base, "id": f"{worker}.restart.elsewhere", "node": "n9"})
    for body in (forged, wrong_key, stale, elsewhere):
        await healthy.store.put(healthy.keys.action(healthy.node, body["id"]), orjson.dumps(body))

    async def statuses() -> dict[str, str]:
        items = (await healthy.store.get_prefix(healthy.keys.actions_of(healthy.node))).items
        return {orjson.loads(kv.value)["id"]: orjson.loads(kv.value)["status"] for kv in items}

    async def all_refused() -> bool:
        got = await statuses()
        return all(got.get(b["id"]) == "refused" for b in (forged, wrong_key, stale, elsewhere))

    await wait_until(all_refused, timeout=10, message="the four actions marked refused")
    assert agent.metrics.refused._value.get() == refused + 4
    reasons = {orjson.loads(kv.value)["id"]: orjson.loads(kv.value)["reason_done"]
               for kv in (await healthy.store.get_prefix(healthy.keys.actions_of(healthy.node))).items}
    assert "not signed" in reasons[forged["id"]] and "not signed" in reasons[wrong_key["id"]]
    assert "ago" in reasons[stale["id"]] and "node 'n9'" in reasons[elsewhere["id"]]

    # A signed restart the leader issued (through the control API) runs once; its body put back as pending (a
    # replay) does not run it again.
    r = await command(healthy, worker, "restart")
    assert r.status_code == 200, r.text
    await wait_until(lambda: healthy.processes(worker) and healthy.processes(worker) != pids, timeout=30,
                     message="restarted by the signed action")
    await wait_until(lambda: _is(healthy, worker, "ready"), timeout=30, message="ready again")
    items = (await healthy.store.get_prefix(healthy.keys.actions_of(healthy.node))).items
    done = [orjson.loads(kv.value) for kv in items if orjson.loads(kv.value).get("status") == "done"
            and orjson.loads(kv.value)["worker"] == worker and orjson.loads(kv.value)["kind"] == "restart"]
    assert done and "signature" in done[-1] and done[-1]["term"] > 0  # the leader's election revision
    replay = {k: v for k, v in done[-1].items() if k not in ("claimed_at", "done_at", "reason_done")}
    after = healthy.processes(worker)
    replayed = await healthy.store.put(healthy.keys.action(healthy.node, replay["id"] + ".again"),
                                       orjson.dumps({**replay, "status": "pending"}))
    del replayed
    await wait_until(lambda: agent.metrics.refused._value.get() == refused + 5, timeout=10,
                     message="the replay refused")
    assert healthy.processes(worker) == after, "not restarted again"


async def test_a_command_that_cannot_apply_is_409_with_why(healthy: TestFleet) -> None:
    worker = healthy.worker_ids[0]
    r = await command(healthy, worker, "undrain")
    assert r.status_code == 409 and r.json() == {"error": f"{worker}: it is not drained: it is ready",
                                                 "state": "ready"}
    assert (await command(healthy, worker, "drain", {"then": "later"})).status_code == 400


async def test_the_control_api_needs_the_token(healthy: TestFleet) -> None:
    r = await command(healthy, healthy.worker_ids[0], "drain", token="wrong")
    assert r.status_code == 401
    r = await command(healthy, healthy.worker_ids[0], "drain", {"then": "later"}, token="wrong")
    assert r.status_code == 401, "the token first: a bad body from a caller without it is no 400"
    for what in ("undrain", "restart", "quarantine/clear"):
        assert (await command(healthy, healthy.worker_ids[0], what, token="wrong")).status_code == 401


async def test_a_crash_loop_quarantines_the_worker(etcd_endpoint: str, broker_endpoint: str, tmp_path: Path,
                                                  wait_until: Any) -> None:
    supervisor = SUPERVISOR.model_copy(update={"restart_budget": 2, "backoff_max_s": 0.1})
    async with TestFleet(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster="crash-loop", run_dir=tmp_path,
                         workers=1, backend=SimBackend(SIM), supervisor=supervisor) as fleet:
        events = BusRecorder(fleet.bus)
        await events.subscribed.wait()
        (victim,) = fleet.worker_ids
        for _ in range(3):
            await fleet.wait_healthy()
            fleet.kill(victim)
            await wait_until(lambda: _not_ready(fleet, victim), timeout=5)
        await wait_until(lambda: events.of("quarantine", victim), timeout=15, message="crash loop quarantined")
        assert "crash loop" in events.of("quarantine", victim)[0].data["reason"]
        assert await state_of(fleet, victim) == "quarantined"
        events.task.cancel()


async def test_the_leader_deletes_finished_actions_past_their_retention_and_keeps_the_rest(
        etcd_endpoint: str, broker_endpoint: str, tmp_path: Path, wait_until: Any) -> None:
    """actions/ would otherwise grow by every restart, stop and self-test the fleet ever had."""
    supervisor = SUPERVISOR.model_copy(update={"actions_retention_s": 4.0})
    async with TestFleet(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster="retention", run_dir=tmp_path,
                         workers=0, supervisor=supervisor) as fleet:
        now = fleet.agent.clock.wall()
        bodies = {
            "old-done": {"status": "done", "issued_at": now - 100, "done_at": now - 90},
            "old-refused": {"status": "refused", "issued_at": now - 100, "done_at": now - 90},
            "fresh-done": {"status": "done", "issued_at": now, "done_at": now + 3600},  # within the retention
            "pending": {"status": "pending", "issued_at": now - 100},
            "claimed": {"status": "claimed", "issued_at": now - 100},
        }
        for name, body in bodies.items():
            await fleet.store.put(fleet.keys.action("n9", name), orjson.dumps({"id": name, "kind": "restart",
                                                                               "worker": "w9", **body}))

        async def left() -> set[str]:
            return {kv.key.rsplit("/", 1)[1] for kv in (await fleet.store.get_prefix(fleet.keys.actions)).items}

        await wait_until(lambda: _gone(left, {"old-done", "old-refused"}), timeout=30,
                         message="the old finished actions deleted")
        assert await left() == {"fresh-done", "pending", "claimed"}


async def _gone(left: Any, names: set[str]) -> bool:
    return not (await left()) & names


async def _not_ready(fleet: TestFleet, worker: str) -> bool:
    return not await _is(fleet, worker, "ready")


async def test_the_standby_takes_over_when_the_leader_is_killed_mid_action(
        etcd_endpoint: str, broker_endpoint: str, tmp_path: Path, wait_until: Any) -> None:
    async with TestFleet(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster="failover", run_dir=tmp_path, workers=2,
                         backend=SimBackend(SIM), supervisor=SUPERVISOR, controller=False) as fleet:
        conf = tmp_path / "fleet.yaml"
        conf.write_text(orjson.dumps({"supervisor": SUPERVISOR.model_dump(mode="json")}).decode())
        argv = controller_argv(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster="failover", config=conf,
                               controller_id="leader")
        leader = ManagedProcess("leader", argv, log_path=tmp_path / "leader.log",
                                env=service_env(admin_token=fleet.admin_token)).start()
        events = BusRecorder(fleet.bus)
        await events.subscribed.wait()
        try:
            await fleet.wait_healthy(timeout=30)  # the leader process made them ready
            standby = await fleet.start_controller(wait=False)
            assert not standby.leading.is_set()
            victim = fleet.worker_ids[0]
            snapshot = await fleet.store.get_prefix(fleet.keys.root)
            fleet.kill(victim)
            try:
                async with asyncio.timeout(60):
                    async for ev in fleet.store.watch_prefix(fleet.keys.actions,
                                                             start_revision=snapshot.revision + 1):
                        if ev.kind == "put" and orjson.loads(ev.value)["status"] == "pending":
                            leader.kill()  # right after it issued the restart, before the worker is back
                            break
            except TimeoutError:
                state = await fleet.store.get_prefix(fleet.keys.root)
                pytest.fail(f"no restart was issued for {victim}; the key space: "
                            f"{[(kv.key, kv.value[:200]) for kv in state.items]}; the leader's log: "
                            f"{(tmp_path / 'leader.log').read_text()[-3000:]}")
            async with asyncio.timeout(20):
                await standby.leading.wait()
            await fleet.wait_healthy(timeout=30)
            await wait_until(lambda: events.of("action", victim), timeout=10, message="the agent's action event")
            restarts = [e.data["action"] for e in events.of("action", victim) if e.data["action_kind"] == "restart"]
            assert restarts == [f"{victim}.restart.1"], "restarted exactly once"
            health = (await read_fleet(fleet.store, fleet.keys)).health[victim]
            assert health.extra["restart_count"] == 1
        finally:
            events.task.cancel()
            await leader.stop()


async def test_a_leader_whose_lease_expires_campaigns_again_instead_of_dying(
        etcd_endpoint: str, broker_endpoint: str, tmp_path: Path, wait_until: Any) -> None:
    """What a starved machine does to a leader: its lease runs out. It must step down and lead again (nobody
    else campaigns here), still deciding: a crash afterwards is acted on."""
    async with TestFleet(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster="lease-lost", run_dir=tmp_path, workers=1,
                         backend=SimBackend(SIM), supervisor=SUPERVISOR) as fleet:
        ctl, task = fleet.controllers[0]
        assert ctl.leading.is_set() and ctl.election is not None
        old_key = ctl.election.key
        await fleet.store.revoke(ctl.election.lease.id)  # the lease is gone, as if keepalives never arrived
        await wait_until(lambda: ctl.election is not None and ctl.election.key != old_key and ctl.leading.is_set(),
                         timeout=30)
        assert not task.done(), "the controller survived losing its lease"
        victim = fleet.worker_ids[0]
        fleet.kill(victim)
        await wait_until(lambda: _restarted(fleet, victim), timeout=30)
        await fleet.wait_healthy(timeout=30)


async def _restarted(fleet: TestFleet, worker: str) -> bool:
    h = (await read_fleet(fleet.store, fleet.keys)).health.get(worker)
    return h is not None and h.extra.get("restart_count", 0) >= 1


async def test_a_backend_that_fails_to_start_or_never_gets_ready_is_dead_with_a_reason(
        etcd_endpoint: str, broker_endpoint: str, tmp_path: Path, wait_until: Any) -> None:
    class Broken(SimBackend):
        start_timeout = 3.0

        def argv(self, spec: WorkerSpec) -> list[str]:
            if spec.id.endswith("exits"):
                return [sys.executable, "-c", "import sys; print('bad model path'); sys.exit(3)"]
            return [sys.executable, "-c", "import time; time.sleep(600)"]  # never listens

    async with TestFleet(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster="broken", run_dir=tmp_path, workers=0,
                         backend=SimBackend(SIM), supervisor=SUPERVISOR) as fleet:
        fleet.agent.backend = Broken(SIM)
        specs = [WorkerSpec(id=f"b-{kind}", host="127.0.0.1", port=free_port(), model="sim-tiny", node="node")
                 for kind in ("exits", "silent")]
        await fleet.agent.start_workers(specs)
        await wait_until(lambda: _is(fleet, "b-exits", "dead"), timeout=10)
        await wait_until(lambda: _is(fleet, "b-silent", "dead"), timeout=10)
        health = (await read_fleet(fleet.store, fleet.keys)).health
        assert "exited with code 3" in health["b-exits"].reason
        assert "not ready after 3s" in health["b-silent"].reason
