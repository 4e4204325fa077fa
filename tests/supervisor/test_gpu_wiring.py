"""GPU health as an operator installs it, on a host without GPUs: `fleetward up` and `fleetward agent` open the
source the fleet file names, over the boundaries a GPU host has (NVML's bindings, faked in place of the
``pynvml`` module; dcgm-exporter, faked as an HTTP server serving its documented metrics). A fault on one
worker's GPU quarantines that worker only, and `fleetward unquarantine` runs the self-test."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from gpufakes import HEALTHY, FakeDcgmExporter, FakeNvml
from testkit import metric

from fleetward.fleet.config import SimConfig
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.launch import fleetward_argv, start_service
from fleetward.fleet.procs import ManagedProcess, free_port
from fleetward.fleet.registry import read_fleet

SIM = SimConfig(decode_step_ms=3.0, seed=3)
ENV = {"PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1"}


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(fleetward_argv(*args), capture_output=True, text=True, timeout=120,
                          env={**os.environ, **ENV, **(env or {})})


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


async def health_of(store: EtcdStore, keys: Keys) -> dict[str, tuple[str, str]]:
    fleet = await read_fleet(store, keys)
    return {w: (h.state.value, h.reason) for w, h in fleet.health.items()}


async def test_up_watches_nvml_maps_gpus_to_workers_and_quarantines_only_the_worker_on_a_faulty_gpu(
        tmp_path: Path, outside_servers: Any, wait_until: Any) -> None:
    nvml = FakeNvml(tmp_path / "nvml.json", gpus=3)
    (outside,) = outside_servers(1, SIM)
    nvml.run_process(2, outside.process.pid)  # a server someone else runs holds a CUDA context on GPU 2
    conf = tmp_path / "fleet.yaml"
    conf.write_text(yaml.safe_dump({
        "gpu": "nvml", "node": "gpuhost", "sim": SIM.model_dump(mode="json"),
        "supervisor": {"gpu_poll_interval_s": 0.2},
        "attach": [{"url": outside.url, "id": "outside", "process": {"pidfile": str(outside.pidfile)}}]}))
    where = ("--run-dir", str(tmp_path), "--cluster", "gputest")
    up = ManagedProcess("fleetward up", fleetward_argv("up", "--config", str(conf), "--workers", "2", *where),
                        log_path=tmp_path / "up.log", env={**ENV, **nvml.env}).start()
    try:
        def status() -> dict[str, Any] | None:
            r = cli("status", "--json", *where)
            data = json.loads(r.stdout) if r.returncode == 0 else {}
            ready = {w["id"] for w in data.get("workers", []) if w["health"] == "ready"}
            return data if ready == {"gpuhost-w0", "gpuhost-w1", "outside"} else None

        data = await wait_until(status, timeout=90, interval=0.5, message="2 workers and the adopted server ready")
        assert data["agents"][0]["gpu"] == {"source": "nvml", "detail": "3 GPUs: NVIDIA H100 80GB HBM3 (fake)",
                                            "gpus": 3}
        assert "GPU health on gpuhost: nvml (3 GPUs" in cli("status", *where).stdout
        # Workers it starts see exactly their GPU, in NVML's numbering.
        pids = {w["id"]: w["pid"] for w in data["workers"]}
        for i in (0, 1):
            env = environ(pids[f"gpuhost-w{i}"])
            assert env["CUDA_VISIBLE_DEVICES"] == str(i) and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        gpus = json.loads(cli("gpu", "--json", *where, env=nvml.env).stdout)
        assert [(g["index"], g["health"], g["workers"]) for g in gpus["gpus"]] == [
            (0, "ok", ["gpuhost-w0"]), (1, "ok", ["gpuhost-w1"]), (2, "ok", ["outside"])]
        assert gpus["gpus"][2]["processes"] == [outside.process.pid]

        state = json.loads((tmp_path / "gputest" / "fleet.json").read_text())
        keys = Keys("gputest")
        async with EtcdStore(state["etcd"]) as store:
            fleet = await read_fleet(store, keys)
            assert {w: r.gpus for w, r in fleet.workers.items()} == {
                "gpuhost-w0": (0,), "gpuhost-w1": (1,), "outside": (2,)}

            # The GPU of w1 falls off the bus: that worker is quarantined, nobody else.
            nvml.xid(1, 79)
            await wait_until(lambda: _state_is(store, keys, "gpuhost-w1", "quarantined"), timeout=30)
            health = await health_of(store, keys)
            assert "Xid 79" in health["gpuhost-w1"][1]
            assert health["gpuhost-w0"][0] == "ready" and health["outside"][0] == "ready"
            gpus = json.loads(cli("gpu", "--json", *where, env=nvml.env).stdout)
            lost = gpus["gpus"][1]
            assert lost["health"] == "drain_and_quarantine" and lost["quarantined"]["worker"] == "gpuhost-w1"

            # A double-bit ECC error on w0's GPU; clearing it runs the self-test, which on a host without CUDA
            # cannot pass: the worker stays quarantined, and says why.
            nvml.xid(0, 48)
            await wait_until(lambda: _state_is(store, keys, "gpuhost-w0", "quarantined"), timeout=30)
            cleared = cli("unquarantine", "gpuhost-w0", *where)
            assert cleared.returncode == 0, cleared.stderr
            await wait_until(lambda: _reason_has(store, keys, "gpuhost-w0", "self-test failed"), timeout=60)
            reason = (await health_of(store, keys))["gpuhost-w0"]
            assert reason[0] == "quarantined" and "Torch not compiled with CUDA" in reason[1], reason
            assert (await health_of(store, keys))["outside"][0] == "ready"
    finally:
        await up.stop(grace=30)


async def _state_is(store: EtcdStore, keys: Keys, worker: str, state: str) -> bool:
    return (await health_of(store, keys)).get(worker, ("", ""))[0] == state


async def _signal_has(store: EtcdStore, keys: Keys, worker: str, text: str) -> bool:
    kv = await store.get(keys.signal(worker, "gpu"))
    return kv is not None and text in json.loads(kv.value)["reason"]


async def _reason_has(store: EtcdStore, keys: Keys, worker: str, text: str) -> bool:
    return text in (await health_of(store, keys)).get(worker, ("", ""))[1]


@pytest.mark.parametrize("source", ["dcgm", "nvml"])
async def test_an_agent_quarantines_the_server_on_the_faulty_gpu_whichever_source_it_reads(
        source: str, tmp_path: Path, etcd_endpoint: str, broker_endpoint: str, cluster: str, outside_servers: Any,
        wait_until: Any) -> None:
    servers = outside_servers(2, SIM)
    nvml = FakeNvml(tmp_path / "nvml.json", gpus=3)
    nvml.run_process(1, servers[0].process.pid)
    with FakeDcgmExporter() as exporter:
        exporter.set({0: HEALTHY, 1: HEALTHY, 2: HEALTHY})
        token = tmp_path / "admin-token"
        token.write_text("gpu-test-token\n")
        token.chmod(0o600)
        control = free_port()
        # dcgm-exporter names no processes: there the first server says its GPU; NVML finds it by its process.
        found = ({"gpus": [1]} if source == "dcgm" else {"process": {"pidfile": str(servers[0].pidfile)}})
        conf = tmp_path / "fleet.yaml"
        conf.write_text(yaml.safe_dump({
            "cluster": cluster, "etcd": etcd_endpoint, "mqtt": broker_endpoint, "admin_token_file": str(token),
            "run_dir": str(tmp_path / "state"), "workers": 1, "node": "gpuhost", "sim": SIM.model_dump(mode="json"),
            "gpu": {"source": "dcgm", "dcgm_url": exporter.url} if source == "dcgm" else "nvml",
            "supervisor": {"port": control, "gpu_poll_interval_s": 0.2},
            "attach": [{"url": servers[0].url, "id": "server0", **found},
                       {"url": servers[1].url, "id": "server1", "gpus": [2]}]}))
        controller = await start_service("controller", fleetward_argv("controller", "--config", str(conf)),
                                         url=f"http://127.0.0.1:{control}", log_path=tmp_path / "controller.log",
                                         env=ENV)
        agent = ManagedProcess("agent", fleetward_argv("agent", "--config", str(conf)), log_path=tmp_path / "agent.log",
                               env={**ENV, **(nvml.env if source == "nvml" else {})}).start()
        keys = Keys(cluster)
        try:
            async with EtcdStore(etcd_endpoint) as store:
                async def all_ready() -> bool:
                    h = await health_of(store, keys)
                    return {w for w, (s, _) in h.items() if s == "ready"} == {"gpuhost-w0", "server0", "server1"}

                await wait_until(all_ready, timeout=90, interval=0.5, message="the agent's worker and 2 servers")
                fleet = await read_fleet(store, keys)
                assert {w: r.gpus for w, r in fleet.workers.items()} == {
                    "gpuhost-w0": (0,), "server0": (1,), "server1": (2,)}
                status = json.loads(cli("status", "--json", "--etcd", etcd_endpoint, "--cluster", cluster).stdout)
                (ours,) = [a for a in status["agents"] if a["node"] == "gpuhost"]
                assert ours["gpu"]["source"] == source and "3 GPUs" in ours["gpu"]["detail"]

                if source == "dcgm":  # the exporter stops answering: the agent says it is blind, then sees again
                    async def source_up() -> float:
                        async with httpx.AsyncClient(timeout=5) as client:
                            return metric((await client.get(f"{ours['url']}/metrics")).text,
                                          "fleetward_agent_gpu_source_up")

                    exporter.status = 503
                    await wait_until(lambda: _is(source_up(), 0.0), timeout=20)
                    exporter.status = 200
                    await wait_until(lambda: _is(source_up(), 1.0), timeout=20)

                # GPU 2 (server1's) falls off the bus (dcgm-exporter: its rows say Xid 79, then they are gone).
                if source == "dcgm":
                    exporter.set({0: HEALTHY, 1: HEALTHY, 2: {**HEALTHY, "DCGM_FI_DEV_XID_ERRORS": 79}})
                else:
                    nvml.xid(2, 79)
                await wait_until(lambda: _state_is(store, keys, "server1", "quarantined"), timeout=30)
                exporter.set({0: HEALTHY, 1: HEALTHY})
                await wait_until(lambda: _signal_has(store, keys, "server1", "GPU lost"), timeout=20)
                health = await health_of(store, keys)
                assert health["gpuhost-w0"][0] == "ready" and health["server0"][0] == "ready", health
                assert "Xid 79" in health["server1"][1]
        finally:
            await agent.stop(grace=30)
            await controller.process.stop(grace=10)


async def _is(value: Any, want: float) -> bool:
    return bool(await value == want)
