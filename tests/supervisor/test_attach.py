"""Servers fleetward did not start: adopted by URL (and by their process), protected, never killed blindly.

The servers here are simulated workers started the way an operator starts theirs (conftest's
``outside_servers``): a command that runs the server detached and writes a pidfile (not a child of fleetward,
nor of this test once that command ended).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
import pytest
import pytest_asyncio

from fleetward.chaos.harness import TestFleet
from fleetward.chaos.workload import sse_lines
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.config import AttachConfig, FleetConfig, RouterConfig, SimConfig, SupervisorConfig
from fleetward.fleet.errors import ConfigError
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.procs import is_gone
from fleetward.fleet.registry import publish_attachments, read_fleet, wait_registered
from fleetward.migration.policy import LeastLoadedAffinity, prefix_key
from fleetward.sim.model import SimModel
from fleetward.sim.tokenizer import encode

SIM = SimConfig(decode_step_ms=5.0, decode_ms_per_seq=0.05, prefill_ms_per_token=0.01, seed=11)
MODEL = SimModel(seed=SIM.seed)
SUPERVISOR = SupervisorConfig(restart_budget=1000, backoff_initial_s=0.05, backoff_max_s=0.2)

Server = Any  # conftest's OutsideServer


@pytest.fixture
def servers(outside_servers: Any) -> list[Server]:
    return list(outside_servers(2, SIM))


async def adopted_fleet(tmp_path: Path, etcd: str, mqtt: str, cluster: str, entries: list[AttachConfig]
                        ) -> TestFleet:
    fleet = TestFleet(etcd=etcd, mqtt=mqtt, cluster=cluster, run_dir=tmp_path / "fleet", workers=0, attach=entries,
                      supervisor=SUPERVISOR, routing=RouterConfig(stall_floor_s=0.5), node="n1")
    await fleet.start()
    await fleet.start_router("r0")
    await fleet.wait_healthy(timeout=60)
    return fleet


@pytest_asyncio.fixture
async def restartable(tmp_path: Path, etcd_endpoint: str, broker_endpoint: str, cluster: str,
                      servers: list[Server]) -> AsyncIterator[TestFleet]:
    fleet = await adopted_fleet(tmp_path, etcd_endpoint, broker_endpoint, cluster,
                                [s.entry(restart=True) for s in servers])
    try:
        yield fleet
    finally:
        await fleet.aclose()


async def stream(router_url: str, prompt: list[int], n: int, *, on_tokens: Any = None) -> list[int]:
    tokens: list[int] = []
    body = {"model": SIM.model_name, "prompt": prompt, "max_tokens": n, "stream": True, "return_token_ids": True}
    async with httpx.AsyncClient(timeout=60) as client, \
            client.stream("POST", router_url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in sse_lines(r.aiter_bytes()):
            if line.startswith("data: {"):
                data = orjson.loads(line[6:])
                assert "error" not in data, data
                tokens += data["choices"][0]["token_ids"]
                if on_tokens is not None:
                    await on_tokens(len(tokens))
    return tokens


def serving(fleet: TestFleet, prompt: list[int]) -> str:
    return LeastLoadedAffinity().choose(fleet.worker_ids, {}, prefix_key(prompt))


def by_id(fleet: TestFleet, servers: list[Server], worker: str) -> Server:
    return next(s for s in servers if fleet.url(worker) == s.url)


async def health(fleet: TestFleet, worker: str) -> tuple[str, str]:
    h = (await read_fleet(fleet.store, fleet.keys)).health.get(worker)
    return (h.state.value, h.reason) if h is not None else ("none", "")


async def test_adopted_servers_are_routed_and_a_killed_ones_stream_stays_exact_then_its_command_restarts_it(
        restartable: TestFleet, servers: list[Server], wait_until: Any) -> None:
    fleet = restartable
    assert sorted(fleet.url(w) for w in fleet.worker_ids) == sorted(s.url for s in servers)
    status = await fleet.fleet_status()
    assert {w["health"] for w in status["workers"]} == {"ready"}
    prompt = encode("an adopted server dies mid-stream: ")
    victim = serving(fleet, prompt)
    server = by_id(fleet, servers, victim)
    old = server.process
    assert old is not None and fleet.processes(victim)[0].pid == old.pid, "its process is watched"

    async def kill_at(n: int) -> None:
        if n >= 30 and not is_gone(old):
            old.kill()

    got = await stream(fleet.routers[0].url, prompt, 120, on_tokens=kill_at)
    assert got == MODEL.continuation(prompt, 120), "the stream moved to the other server and stayed exact"
    # The operator's command brought it back: a new process, watched, canaried, ready.
    await wait_until(lambda: (p := server.process) is not None and p.pid != old.pid, timeout=30,
                     message="the restart command started the server again")
    await fleet.wait_healthy(timeout=60)
    assert fleet.processes(victim)[0].pid == server.process.pid


async def test_a_frozen_adopted_server_is_detected_through_its_process(
        restartable: TestFleet, servers: list[Server], wait_until: Any) -> None:
    fleet = restartable
    victim = fleet.worker_ids[0]
    process = by_id(fleet, servers, victim).process
    assert process is not None
    process.send_signal(signal.SIGSTOP)
    try:
        async def frozen() -> bool:
            state, reason = await health(fleet, victim)
            return state in ("unhealthy", "restarting") and "stopped" in reason

        await wait_until(frozen, timeout=20, message="the engine-frozen detector saw the stopped process")
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGCONT)
    await fleet.wait_healthy(timeout=60)


async def test_what_a_killed_server_left_behind_is_stopped_even_when_a_restart_overtakes_its_exit(
        tmp_path: Path, etcd_endpoint: str, broker_endpoint: str, cluster: str, outside_servers: Any,
        monkeypatch: pytest.MonkeyPatch, wait_until: Any) -> None:
    """vLLM's EngineCore outlives a SIGKILLed API server. The agent stops it when it sees the exit; a restart
    ordered meanwhile (the exit was seen as it began) used to cancel that step at its first await, when the
    restart no longer found the old process to clear, and the engine was left running (CI saw it on vLLM).
    Here the server's leftover is a child it started, and the exit watcher is held at its first write until
    the supervisor's restart has begun."""
    server, = outside_servers(1, SIM, ["sh", "-c", 'sleep 600 & exec "$@"', "sh"])
    fleet = await adopted_fleet(tmp_path, etcd_endpoint, broker_endpoint, cluster, [server.entry(restart=True)])
    try:
        victim, = fleet.worker_ids
        api, *rest = fleet.processes(victim)
        assert [p.name() for p in rest] == ["sleep"], "the server's tree is known to the agent"
        agent = fleet.agent
        signal_as_usual = agent.signal
        gate = asyncio.Event()

        async def held(worker: str, detector: str, *args: Any, **kw: Any) -> None:
            if detector == "process" and "pid" not in kw:  # the exit watcher's (the exit seen beginning names a pid)
                await gate.wait()
            await signal_as_usual(worker, detector, *args, **kw)

        monkeypatch.setattr(agent, "signal", held)
        api.kill()
        await wait_until(lambda: agent.is_restarting(victim) and not agent.exits.is_registered(victim), timeout=30,
                         message="the supervisor's restart overtook the exit watcher")
        gate.set()
        await wait_until(lambda: all(is_gone(p) for p in rest), timeout=15,
                         message="the child the killed server left is stopped")
        await fleet.wait_healthy(timeout=60)
        await wait_until(lambda: (tree := fleet.processes(victim)) and tree[0].pid == server.process.pid != api.pid,
                         timeout=60, message="restarted by its command, and watched")
    finally:
        await fleet.aclose()


@pytest.mark.parametrize("forged", ["command", "exit"])
async def test_a_restart_written_into_etcd_by_hand_is_never_done(
        restartable: TestFleet, servers: list[Server], tmp_path: Path, wait_until: Any, forged: str) -> None:
    """Any holder of the fleet's etcd credentials (every router host) could rewrite ``attach/<id>`` and have the
    agent of another host run a command as root when the server fails, or end the processes a forged entry
    names (``restart_by_exit``). A record whose restart the admin token did not sign (here: the old signature
    kept, the restart changed) is adopted without it: refused, counted, and the server is drained and left for
    an operator, never restarted that way."""
    fleet = restartable
    victim = fleet.worker_ids[0]
    proof = tmp_path / "ran"
    key = fleet.keys.attached(victim)
    record = orjson.loads((await fleet.store.get(key)).value)  # type: ignore[union-attr]
    assert "signature" in record, "fleetward signs what it writes"
    restart = ({"restart_command": ["sh", "-c", f"id > {proof}"]} if forged == "command"
               else {"restart_command": [], "restart_by_exit": True})
    await fleet.store.put(key, orjson.dumps({**record, **restart}))
    registry = fleet.agent.metrics.registry
    await wait_until(lambda: registry.get_sample_value("fleetward_agent_attach_commands_refused_total") == 1,
                     timeout=10, message="the agent refused the forged record")
    process = by_id(fleet, servers, victim).process
    assert process is not None
    # Adopted again, without the restart: the agent's own backend for it can no longer restart it.
    await wait_until(lambda: not fleet.agent.backend_for(victim).can_restart, timeout=30,
                     message="the server adopted again without its forged restart")
    await fleet.wait_healthy(timeout=30)
    process.kill()

    async def left() -> bool:
        state, reason = await health(fleet, victim)
        return state == "dead" and "left for an operator" in reason

    await wait_until(left, timeout=30, message="the failed server was left for an operator")
    assert not proof.exists(), "the forged command never ran"


async def test_without_a_restart_command_a_failed_server_is_drained_left_running_and_taken_back(
        tmp_path: Path, etcd_endpoint: str, broker_endpoint: str, cluster: str, servers: list[Server],
        wait_until: Any) -> None:
    fleet = await adopted_fleet(tmp_path, etcd_endpoint, broker_endpoint, cluster,
                                [s.entry(restart=False) for s in servers])
    try:
        victim = fleet.worker_ids[0]
        server = by_id(fleet, servers, victim)
        process = server.process
        assert process is not None
        process.send_signal(signal.SIGSTOP)  # hung, not dead: fleetward must not kill it

        async def left() -> bool:
            state, reason = await health(fleet, victim)
            return state == "dead" and "left for an operator" in reason

        await wait_until(left, timeout=30, message="the hung server was drained and left for an operator")
        assert not is_gone(process), "a server fleetward did not start and cannot restart is never killed"
        assert victim not in {w.id for w in (await read_fleet(fleet.store, fleet.keys)).routable()}
        # The operator restarts it; fleetward takes it back.
        process.kill()
        await asyncio.to_thread(server.start)
        await fleet.wait_healthy(timeout=60)
        assert fleet.processes(victim)[0].pid == server.process.pid
    finally:
        await fleet.aclose()


async def test_a_server_known_by_url_only_is_protected_and_given_up_without_being_touched(
        tmp_path: Path, etcd_endpoint: str, broker_endpoint: str, cluster: str, servers: list[Server],
        wait_until: Any) -> None:
    fleet = await adopted_fleet(tmp_path, etcd_endpoint, broker_endpoint, cluster,
                                [s.entry(restart=False, process=False) for s in servers])
    try:
        assert all(fleet.processes(w) == [] for w in fleet.worker_ids), "no process to watch: URL only"
        prompt = encode("by url only: ")
        assert await stream(fleet.routers[0].url, prompt, 20) == MODEL.continuation(prompt, 20)
        gone = fleet.worker_ids[0]
        await fleet.store.delete(fleet.keys.attached(gone))  # what `fleetward worker remove` does

        async def given_up() -> bool:
            return gone not in (await read_fleet(fleet.store, fleet.keys)).workers

        await wait_until(given_up, timeout=10, message="the agent gave the server up")
    finally:
        await fleet.aclose()
    assert all(s.process is not None and not is_gone(s.process) for s in servers), \
        "giving a server up, and stopping the agent, leave it running"


async def test_a_loopback_url_is_registered_at_the_address_other_hosts_reach_this_node_at(
        tmp_path: Path, store: EtcdStore, bus: Any, keys: Keys, servers: list[Server], wait_until: Any) -> None:
    """One fleet file for every host attaches http://127.0.0.1:8000, the server beside each agent: routers on
    other hosts must get the node's address, not their own loopback (advertise_host). The agent itself still
    reaches the server as given."""
    from fleetward.supervisor.agent import NodeAgent

    agent = NodeAgent(store=store, bus=bus, keys=keys, backend=SimBackend(), node="n1", log_dir=tmp_path,
                      advertise_host="127.0.0.2", supervisor=SUPERVISOR)
    await agent.start()
    try:
        (worker,) = await publish_attachments(store, keys, [servers[0].entry(restart=False)], "n1", signer=None)
        await wait_registered(store, keys, [worker], timeout=30)
        record = (await read_fleet(store, keys)).workers[worker]
        assert record.url == f"http://127.0.0.2:{servers[0].port}", record.url
        assert agent.handles[worker].spec.bind_url == servers[0].url
    finally:
        await agent.aclose(grace=5)


def test_advertised_host_is_the_address_on_the_route_to_a_remote_etcd() -> None:
    import psutil

    from fleetward.fleet.procs import advertised_host

    ours = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    remote = advertised_host("127.0.0.1", ["10.255.0.1:2379"])  # nothing is sent: a route lookup
    assert remote in ours and not remote.startswith("127."), remote
    assert advertised_host("0.0.0.0", ["10.255.0.1:2379"]) == remote
    assert advertised_host("127.0.0.1", ["127.0.0.1:2379"]) == "127.0.0.1", "one host: as it listens"
    assert advertised_host("0.0.0.0", []) == "127.0.0.1"
    assert advertised_host("10.1.2.3", ["10.255.0.1:2379"]) == "10.1.2.3", "an address others reach already"
    assert advertised_host("127.0.0.1", ["10.255.0.1:2379"], "gpu-7.internal") == "gpu-7.internal"


async def test_healthy_servers_of_two_vllm_versions_are_not_taken_for_wrong_tokens(
        tmp_path: Path, etcd_endpoint: str, broker_endpoint: str, cluster: str, outside_servers: Any,
        wait_until: Any) -> None:
    """A rolling upgrade: two servers on one version agree on the canary's greedy tokens (its golden); the one
    already upgraded answers differently (here: another seed). Goldens are kept per engine version (GET
    /version), so it is compared with its own kind, never restarted as corrupt."""
    old = SIM.model_copy(update={"engine_version": "0.32.0"})
    new = SIM.model_copy(update={"engine_version": "0.33.0", "seed": SIM.seed + 1})
    assert SimModel(seed=old.seed).continuation([1, 2, 3], 8) != SimModel(seed=new.seed).continuation([1, 2, 3], 8)
    servers = [*outside_servers(2, old), *outside_servers(1, new)]
    fleet = TestFleet(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster=cluster, run_dir=tmp_path / "fleet",
                      workers=0, attach=[s.entry(restart=True) for s in servers], node="n1",
                      supervisor=SUPERVISOR.model_copy(update={"canary_interval_s": 0.5}))
    try:
        await fleet.start()
        await fleet.wait_healthy(timeout=60)
        records = (await read_fleet(fleet.store, fleet.keys)).workers
        assert sorted(r.engine or "" for r in records.values()) == ["vllm 0.32.0", "vllm 0.32.0", "vllm 0.33.0"]
        upgraded = next(w for w, r in records.items() if r.engine == "vllm 0.33.0")
        pid = fleet.processes(upgraded)[0].pid
        controller = fleet.controllers[0][0]
        canaries = controller.metrics.registry

        def passed() -> float:
            return canaries.get_sample_value("fleetward_supervisor_canaries_total", {"result": "ok"}) or 0.0

        await wait_until(lambda: len(controller.golden.golden) == 1, timeout=30, message="the old version's golden")
        after = passed()
        await wait_until(lambda: passed() >= after + 9, timeout=30, message="three more canary rounds")
        assert not canaries.get_sample_value("fleetward_supervisor_canaries_total", {"result": "wrong"})
        assert (await health(fleet, upgraded))[0] == "ready"
        assert fleet.processes(upgraded)[0].pid == pid, "never restarted, never suspected of wrong tokens"
    finally:
        await fleet.aclose()


def test_an_attach_entry_is_checked_with_file_line_and_field(tmp_path: Path) -> None:
    from fleetward.fleet.config import load_fleet_config

    path = tmp_path / "fleet.yaml"
    path.write_text("workers: 0\nattach:\n  - url: http://10.0.0.5:8000\n    process: {pidfile: /run/a.pid, "
                    "container: vllm}\n")
    with pytest.raises(ConfigError) as info:
        load_fleet_config(path)
    assert (info.value.line, info.value.field) == (4, "attach[0].process")
    assert "exactly one of pidfile, systemd_unit, container and match" in str(info.value)
    path.write_text("workers: 0\nattach:\n  - url: http://10.0.0.5:8000\n    process:\n      match: 'vllm (serve'\n")
    with pytest.raises(ConfigError) as info:
        load_fleet_config(path)
    assert (info.value.line, info.value.field) == (5, "attach[0].process.match")
    assert "not a regular expression" in str(info.value)
    path.write_text("workers: 0\nattach:\n  - url: http://10.0.0.5:8000\n    process:\n      match: '(vllm) \\1'\n")
    with pytest.raises(ConfigError) as info:
        load_fleet_config(path)
    assert info.value.field == "attach[0].process.match" and "no backreferences" in str(info.value)
    path.write_text("workers: 0\nattach:\n  - url: http://10.0.0.5:8000\n    restart_by_exit: true\n")
    with pytest.raises(ConfigError) as info:
        load_fleet_config(path)
    assert "restart_by_exit needs process" in str(info.value)
    ok = FleetConfig.model_validate({"attach": [{"url": "http://10.0.0.5:8000", "restart_command":
                                                  "systemctl restart vllm@0"}]})
    assert ok.attach[0].restart_command == ("systemctl", "restart", "vllm@0")
    assert ok.attach[0].worker_id("gpu-3") == "gpu-3-10-0-0-5-8000"
