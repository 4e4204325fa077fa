"""The node agent: registration bound to its lease, worker.up / worker.down events, exits seen at once."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil

from fleetward.fleet.backends import SimBackend
from fleetward.fleet.bus import Event, MqttBus
from fleetward.fleet.config import SupervisorConfig
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.launch import agent_argv, service_env
from fleetward.fleet.procs import ManagedProcess, free_port
from fleetward.fleet.registry import read_fleet
from fleetward.fleet.worker import HealthRecord, HealthState, WorkerSpec
from fleetward.supervisor.agent import NodeAgent
from fleetward.supervisor.signals import Severity, Signal


async def collect(bus: MqttBus, into: list[Event], subscribed: asyncio.Event) -> None:
    async for event in bus.subscribe(["worker.up", "worker.down"], subscribed=subscribed):
        into.append(event)


async def test_killing_the_agent_makes_its_workers_vanish_within_the_ttl(
        etcd_endpoint: str, broker_endpoint: str, cluster: str, store: EtcdStore, keys: Keys, bus: MqttBus,
        tmp_path: Path, wait_until: Any) -> None:
    events: list[Event] = []
    subscribed = asyncio.Event()
    listener = asyncio.create_task(collect(bus, events, subscribed))
    await subscribed.wait()
    agent = ManagedProcess("agent", agent_argv(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster=cluster, workers=2,
                                               lease_ttl_s=3, run_dir=tmp_path),
                           log_path=tmp_path / "agent.log", env=service_env()).start()
    try:
        async def registered() -> bool:  # no controller runs here: registered, not yet ready
            return len((await read_fleet(store, keys)).workers) == 2

        await wait_until(registered, timeout=60, message="two workers registered")
        await wait_until(lambda: len([e for e in events if e.kind == "worker.up"]) == 2, timeout=10)
        worker_pids = [r.pid for r in (await read_fleet(store, keys)).workers.values()]
        snapshot = await store.get_prefix(keys.workers)

        agent.kill()  # SIGKILL, no cleanup
        async for ev in store.watch_prefix(keys.workers, start_revision=snapshot.revision + 1):
            assert ev.kind == "delete"
            if not (await store.get_prefix(keys.workers)).items:
                break
        # Its workers die with it (PR_SET_PDEATHSIG), nothing is orphaned.
        await wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                         for p in worker_pids if p), timeout=10)
    finally:
        await agent.stop()
        listener.cancel()


async def test_a_worker_exit_is_reported_at_once_and_a_clean_stop_revokes_the_lease(
        etcd_endpoint: str, broker_endpoint: str, cluster: str, store: EtcdStore, keys: Keys, bus: MqttBus,
        tmp_path: Path, wait_until: Any) -> None:
    from fleetward.chaos.harness import TestFleet

    events: list[Event] = []
    subscribed = asyncio.Event()
    listener = asyncio.create_task(collect(bus, events, subscribed))
    await subscribed.wait()
    fleet = TestFleet(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster=cluster, run_dir=tmp_path, workers=2,
                      lease_ttl=30, controller=False)
    await fleet.start()
    try:
        victim = fleet.worker_ids[0]
        snapshot = await store.get_prefix(keys.root)
        fleet.kill(victim)
        seen: list[str] = []
        async for ev in store.watch_prefix(keys.root, start_revision=snapshot.revision + 1):
            seen.append(f"{ev.kind} {ev.key[len(keys.root):]}")
            if ev.kind == "delete" and ev.key == keys.worker(victim):
                break
        # Well before any lease could expire (TTL 30 s): the signal first, then the deregistration. The signal
        # may come twice: as the exit starts (seen in /proc), then with its exit code.
        assert seen[-1] == f"delete workers/{victim}" and 2 <= len(seen) <= 3, seen
        assert set(seen[:-1]) == {f"put signals/{victim}/process"}, seen
        kv = await store.get(keys.signal(victim, "process"))
        assert kv is not None
        signal = Signal.from_json(kv.value)
        assert (signal.severity, signal.reason) == (Severity.FATAL, "process exited with code -9")
        await wait_until(lambda: any(e.kind == "worker.down" and e.worker == victim for e in events), timeout=10)
        # One exit, counted once: whether it was seen beginning, completing, or both.
        assert fleet.agent.metrics.registry.get_sample_value("fleetward_agent_worker_exits_total") == 1
    finally:
        await fleet.agent.aclose()
    # A clean stop revokes the lease (TTL 30 s): the keys are gone right away.
    assert (await store.get_prefix(keys.workers)).items == ()
    await fleet.aclose()
    listener.cancel()


# A launcher that leaves a child in the worker's process group, as vLLM's API server leaves its EngineCore.
_WITH_CHILD = ("import os, subprocess, sys; subprocess.Popen(['sleep', '600']); "
               "os.execvp(sys.argv[1], sys.argv[1:])")


async def test_what_a_dead_worker_leaves_behind_is_stopped_at_once(
        etcd_endpoint: str, broker_endpoint: str, cluster: str, tmp_path: Path, wait_until: Any) -> None:
    """SIGKILL of a worker's root process only (vLLM's API server) leaves its children running, reparented
    to init; the agent stops them as soon as it sees the root exit, restart or not (here no supervisor
    runs, so no restart ever comes)."""
    import signal
    import sys

    from fleetward.chaos.harness import TestFleet

    fleet = TestFleet(etcd=etcd_endpoint, mqtt=broker_endpoint, cluster=cluster, run_dir=tmp_path, workers=1,
                      controller=False)
    await fleet.start()
    try:
        (worker,) = fleet.worker_ids
        fleet.wrap_launch(worker, [sys.executable, "-c", _WITH_CHILD])
        await fleet.restart(worker)
        root, *children = fleet.processes(worker)
        assert [p.name() for p in children] == ["sleep"]
        root.send_signal(signal.SIGKILL)
        await wait_until(lambda: not any(psutil.pid_exists(p.pid) and p.is_running() and
                                         p.status() != psutil.STATUS_ZOMBIE for p in children),
                         timeout=15, message="the orphaned child is stopped")
    finally:
        await fleet.aclose()


async def test_a_worker_whose_port_was_taken_before_it_bound_starts_elsewhere(
        store: EtcdStore, bus: MqttBus, keys: Keys, tmp_path: Path) -> None:
    """A port picked free can be taken by another process before the worker binds it (the pick-then-bind
    race). The worker exits; it is started again with backoff on another port, not marked dead at once."""
    import socket

    from fleetward.fleet.backends import SimBackend
    from fleetward.fleet.config import SimConfig, SupervisorConfig
    from fleetward.fleet.worker import WorkerSpec
    from fleetward.supervisor.agent import NodeAgent

    backend = SimBackend(SimConfig())
    agent = NodeAgent(store=store, bus=bus, keys=keys, backend=backend, node="n1", log_dir=tmp_path,
                      supervisor=SupervisorConfig(backoff_initial_s=0.05))
    notes: list[str] = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        spec = WorkerSpec(id="n1-w0", host="127.0.0.1", port=port, model=backend.model_name, node="n1")
        try:
            await agent.start_workers([spec], progress=lambda _w, what: notes.append(what))
            assert notes == ["launched", "retrying", "ready"]
            record = (await read_fleet(store, keys)).workers["n1-w0"]
            assert record.url != f"http://127.0.0.1:{port}" and record.url.startswith("http://127.0.0.1:")
            assert "n1-w0" not in agent.failed
        finally:
            await agent.aclose()


def test_exiting_names_a_process_whose_exit_started_and_not_a_live_one() -> None:
    """What the agent reads every ``exit_check_interval_s``: a SIGKILLed child is exiting (a zombie here, since
    nobody reaps it yet) before anyone waits for it, then gone."""
    import subprocess
    import time

    from fleetward.supervisor.watchers import exiting

    child = subprocess.Popen(["sleep", "600"])
    try:
        assert exiting(child.pid) is None
        child.kill()
        deadline = time.monotonic() + 10
        while exiting(child.pid) is None:
            assert time.monotonic() < deadline, "a SIGKILLed process never showed its exit"
        assert exiting(child.pid) in (("zombie", -9), ("exiting", -9))
    finally:
        child.kill()
        child.wait()
    assert exiting(child.pid) == ("gone", None)


async def test_signals_for_one_worker_and_detector_reach_etcd_in_the_order_they_were_decided(
        store: EtcdStore, bus: MqttBus, keys: Keys, tmp_path: Path) -> None:
    """An exit is signalled twice: as it begins (seen in /proc) and when it completes (with its code). Two puts
    in flight at once may reach etcd in either order (found in CI: the exit code overwritten by the earlier
    finding). Here the first put is held back while the second is decided; what etcd keeps is the second."""
    from fleetward.fleet.backends import SimBackend
    from fleetward.fleet.config import SimConfig
    from fleetward.supervisor.agent import NodeAgent

    class FirstPutLate:
        """The real store; its first put waits until a second put has begun (or 0.5 s, which is what
        happens when the agent orders its puts: the second does not begin before the first is done)."""

        def __init__(self) -> None:
            self.second = asyncio.Event()
            self.puts = 0

        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        async def put(self, key: str, value: bytes, **kw: Any) -> Any:
            self.puts += 1
            if self.puts == 1:
                try:
                    await asyncio.wait_for(self.second.wait(), 0.5)
                except TimeoutError:
                    pass
            else:
                self.second.set()
            return await store.put(key, value, **kw)

    agent = NodeAgent(store=FirstPutLate(), bus=bus, keys=keys,
                      backend=SimBackend(SimConfig()), node="n1", log_dir=tmp_path)
    try:
        first = asyncio.create_task(agent.signal("n1-w0", "process", Severity.FATAL, "exit began"))
        await asyncio.sleep(0)
        await agent.signal("n1-w0", "process", Severity.FATAL, "process exited with code -9")
        await first
        kv = await store.get(keys.signal("n1-w0", "process"))
        assert kv is not None
        signal = Signal.from_json(kv.value)
        assert signal.reason == "process exited with code -9"
    finally:
        await agent.aclose()


# A worker that listens before it serves, as vLLM does (its socket is bound before its engine starts, its app
# served last): it blocks on a FIFO (no wake-up, no CPU) until the test lets it go, then becomes the
# simulated worker in the same process.
LISTENS_EARLY = """
import os, socket, sys
fifo, port, argv = sys.argv[1], int(sys.argv[sys.argv.index("--port") + 1]), sys.argv[2:]
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port)); s.listen(16)
print("(EngineCore pid=1) INFO 11-27 05:22:13 [core.py:1] loading the weights", flush=True)
open(fifo).read()
s.close()
os.execv(argv[0], argv)
"""


@contextlib.asynccontextmanager
async def starting_late(agent: NodeAgent, spec: WorkerSpec, fifo: Path) -> AsyncIterator[asyncio.Task[None]]:
    """``agent`` starting a :class:`ListensEarly` worker; the worker is let go and the agent closed after."""
    starting = asyncio.create_task(agent.start_workers([spec]))
    try:
        yield starting
    finally:
        if not starting.done():
            with contextlib.suppress(OSError):  # let the worker go, or it waits on the FIFO for ever
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            starting.cancel()
        await agent.aclose(grace=5)


class ListensEarly(SimBackend):
    def __init__(self, fifo: Path) -> None:
        super().__init__()
        self.fifo = fifo

    def argv(self, spec: WorkerSpec) -> list[str]:
        return [sys.executable, "-c", LISTENS_EARLY, str(self.fifo), *super().argv(spec)]


async def test_a_worker_still_starting_is_not_judged_by_the_engine_frozen_detector(
        store: EtcdStore, bus: MqttBus, keys: Keys, tmp_path: Path, wait_until: Any) -> None:
    """A launched vLLM worker listens before it serves: the agent's probe of its idle engine waited in the
    socket's backlog and a healthy worker still starting would be named frozen. A worker is judged once it
    registered (ready); a start that hangs is the start timeout's to catch."""
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    config = SupervisorConfig()
    agent = NodeAgent(store=store, bus=bus, keys=keys, backend=ListensEarly(fifo), node="n1", log_dir=tmp_path,
                      supervisor=config)
    spec = WorkerSpec(id="late", host="127.0.0.1", port=free_port(), model=agent.backend.model_name, node="n1")
    said: list[str] = []

    async def collect(since: int) -> None:
        async for ev in store.watch_prefix(keys.signal("late", "engine-frozen"), start_revision=since):
            said.append(Signal.from_json(ev.value).severity.value if ev.kind == "put" else "deleted")

    collector = asyncio.create_task(collect((await store.get_prefix(keys.root)).revision + 1))
    async with starting_late(agent, spec, fifo) as starting, contextlib.AsyncExitStack() as later:
        later.callback(collector.cancel)
        await wait_until(lambda: "late" in agent.handles, timeout=30, message="the worker was launched")
        # Not a race: nothing may be said about it at any time. The wait gives the old defect (a fatal verdict
        # some 2 s after the agent's first look) the time to show.
        await asyncio.sleep(4 * config.engine_stall_s + config.engine_probe_interval_s)
        assert not starting.done(), "the worker does not serve yet"
        fifo.write_text("go")
        await starting
        assert "late" in agent.handles and not agent.failed, agent.failed
        pid = agent.handles["late"].process.pid
        await asyncio.sleep(config.engine_probe_interval_s + 2 * config.engine_stall_s)  # judged now: healthy
        assert agent.handles["late"].process.pid == pid, "never restarted"
        assert all(s == "ok" for s in said), said


async def test_a_starting_worker_says_in_status_what_it_is_at(
        store: EtcdStore, bus: MqttBus, keys: Keys, tmp_path: Path, wait_until: Any) -> None:
    """A start may take minutes (a large model loading, a busy host): ``fleetward status`` shows what it is at,
    the last line it logged, and not only ``starting``; the leader's health record stays the leader's."""
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    agent = NodeAgent(store=store, bus=bus, keys=keys, backend=ListensEarly(fifo), node="n1", log_dir=tmp_path)
    spec = WorkerSpec(id="slow", host="127.0.0.1", port=free_port(), model=agent.backend.model_name, node="n1")
    async with starting_late(agent, spec, fifo) as starting:
        async def phase() -> str:
            workers = (await read_fleet(store, keys, phases=True)).to_status()["workers"]
            return "".join(w["phase"] for w in workers)

        assert await wait_until(phase, timeout=30, message="the phase is said") == "loading the weights"
        kv = await store.get(keys.health_of("slow"))
        assert kv is not None
        health = HealthRecord.from_json(kv.value)
        assert (health.state, health.reason, health.detector) == (HealthState.STARTING, "launched", "agent")
        fifo.write_text("go")
        await starting
        assert not agent.failed, agent.failed
