"""The CLI as a user runs it: real processes, real signals, real etcd and broker."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from fleetward.fleet.procs import ManagedProcess, free_port

FLEETWARD = [sys.executable, "-m", "fleetward.cli"]
ENV = {"PYTHONSAFEPATH": "1"}


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FLEETWARD, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **ENV})


def ours(run_dir: Path) -> list[psutil.Process]:
    """Every live process whose command line mentions this run's folder or was started by `up`."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if str(run_dir) in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def holding(root: Path, secret: str) -> list[Path]:
    """Files under ``root`` that hold ``secret``, except the file meant to hold it."""
    found = []
    for f in root.rglob("*"):
        with contextlib.suppress(OSError):
            if f.is_file() and f.name != "admin-token" and secret.encode() in f.read_bytes():
                found.append(f)
    return found


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


async def test_up_starts_a_fleet_that_status_shows_and_sigterm_leaves_nothing(tmp_path: Path,
                                                                             wait_until: Any) -> None:
    router_port = free_port()
    conf = tmp_path / "fleet.yaml"
    conf.write_text(f"routing:\n  port: {router_port}\n")  # honoured, not silently ignored
    up = ManagedProcess("fleetward up", [*FLEETWARD, "up", "--config", str(conf), "--workers", "3", "--run-dir",
                                         str(tmp_path), "--cluster", "clitest"],
                        log_path=tmp_path / "up.log", env=ENV).start()
    try:
        def status() -> dict[str, Any] | None:
            r = run("status", "--json", "--run-dir", str(tmp_path), "--cluster", "clitest")
            if r.returncode != 0:
                return None
            data = json.loads(r.stdout)
            ready = [w for w in data["workers"] if w["health"] == "ready"]
            return data if len(ready) == 3 and data["routers"] else None

        data = await wait_until(status, timeout=90, interval=0.5, message="3 ready workers and a router")
        assert data["cluster"] == "clitest" and data["routers"][0]["url"] == f"http://127.0.0.1:{router_port}"
        assert {tuple(sorted(w)) for w in data["workers"]} == {
            ("health", "id", "model", "node", "phase", "pid", "pids", "reason", "role", "since", "started_at", "url")}
        assert all(w["role"] == "aggregated" and w["model"] == "sim-tiny" for w in data["workers"])
        tree = up.tree()
        assert all(w["pid"] in w["pids"] and set(w["pids"]) <= {p.pid for p in tree} for w in data["workers"])
        controller = data["controller"]
        assert controller["url"].startswith("http://") and controller["id"]
        table = run("status", "--run-dir", str(tmp_path), "--cluster", "clitest")
        assert table.returncode == 0 and controller["url"] in table.stdout
        for w in data["workers"]:
            assert w["id"] in table.stdout and str(w["pid"]) in table.stdout
        await _operator_commands_mean_what_they_say(tmp_path, [w["id"] for w in data["workers"]], wait_until)
        root = tmp_path / "clitest"
        before = {f: (root / f).stat().st_mtime_ns for f in ("fleet.json", "admin-token")}
        second = run("up", "--workers", "1", "--run-dir", str(tmp_path), "--cluster", "clitest")
        assert second.returncode == 1 and f"a fleet already runs in {root} (pid {up.pid}" in second.stderr
        assert {f: (root / f).stat().st_mtime_ns for f in before} == before, "the live fleet's files are untouched"
        assert (root / "etcd-data").is_dir() and run("status", "--run-dir", str(tmp_path), "--cluster",
                                                     "clitest").returncode == 0, "and it still answers"
        assert len(tree) >= 7  # up, etcd, broker, 3 workers, router
        # The admin token drove the commands above; it is on no command line, and in no log, etcd or broker file.
        token = (root / "admin-token").read_text().strip()
        assert len(token) >= 24 and not [p.cmdline() for p in tree if alive(p) and token in " ".join(p.cmdline())]
        assert holding(tmp_path, token) == []
        up.signal(signal.SIGTERM)
        assert await up.wait_exit() == 0
        assert "stopped; no process left behind" in up.log_tail()
        assert holding(tmp_path, token) == [], "nor written out at shutdown"
        assert [p for p in tree if alive(p)] == []
        assert ours(tmp_path) == []
        assert not (tmp_path / "clitest" / "fleet.json").exists()
    finally:
        await up.stop()


async def _operator_commands_mean_what_they_say(run_dir: Path, workers: list[str], wait_until: Any) -> None:
    """A typo is refused with the known ids (and leaves no phantom row); a command that cannot apply says
    why; `drain` cordons: the worker stays up, out of routing, until `undrain` takes it back."""
    where = ("--run-dir", str(run_dir), "--cluster", "clitest")

    def health(worker: str) -> dict[str, Any] | None:
        data = json.loads(run("status", "--json", *where).stdout)
        return next((w for w in data["workers"] if w["id"] == worker), None)

    typo = run("drain", "wokrer-0", *where)
    assert typo.returncode == 1 and "no worker 'wokrer-0'" in typo.stderr, typo.stderr
    assert all(w in typo.stderr for w in workers)
    assert health("wokrer-0") is None, "no phantom worker"
    target = workers[0]
    not_drained = run("undrain", target, *where)
    assert not_drained.returncode == 1 and "it is not drained: it is ready" in not_drained.stderr
    drained = run("drain", target, *where)
    assert drained.returncode == 0, drained.stderr
    assert "stays out of routing (cordoned) until `fleetward undrain`" in drained.stdout
    cordoned = await wait_until(lambda: (h := health(target)) and "cordoned" in h["reason"] and h, timeout=30)
    assert cordoned["health"] == "draining" and cordoned["pids"], "cordoned, not stopped"
    assert run("drain", target, *where).returncode == 1, "cordoned already"
    back = run("undrain", target, *where)
    assert back.returncode == 0 and "back into routing" in back.stdout, back.stderr
    await wait_until(lambda: (h := health(target)) and h["health"] == "ready", timeout=30)
    # `move`: a request or a worker, not both, not neither; a worker the cluster does not know is a 404.
    neither = run("move", *where)
    assert neither.returncode == 2 and "name a request, or --from WORKER" in neither.stderr, neither.stderr
    assert run("move", "--from", "wokrer-0", *where).returncode == 1
    ordered = run("move", "--from", target, "--to", workers[1], *where)
    assert ordered.returncode == 0 and f"moving every stream off {target} to {workers[1]}" in ordered.stdout


def test_status_without_a_fleet_says_how_to_start_one(tmp_path: Path) -> None:
    r = run("status", "--run-dir", str(tmp_path))
    assert r.returncode == 2
    assert "no running local fleet found" in r.stderr and "fleetward up" in r.stderr


def test_status_against_an_unreachable_etcd_gives_up_with_a_clear_message() -> None:
    port = free_port()
    r = run("status", "--etcd", f"127.0.0.1:{port}", timeout=60)
    assert r.returncode == 1
    assert f"etcd unreachable at 127.0.0.1:{port}" in r.stderr
    assert "Traceback" not in r.stderr


def test_an_invalid_config_file_names_file_line_and_field(tmp_path: Path) -> None:
    conf = tmp_path / "fleet.yaml"
    conf.write_text("workers: 2\nsim:\n  decode_step_ms: fast\n")
    r = run("up", "--config", str(conf), "--run-dir", str(tmp_path))
    assert r.returncode == 2
    assert f"{conf}:3: sim.decode_step_ms" in r.stderr
    assert "valid number" in r.stderr


def test_a_port_in_use_is_a_clear_error_and_nothing_is_left_running(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run("up", "--workers", "1", "--etcd-port", str(port), "--run-dir", str(tmp_path))
    assert r.returncode == 1
    assert f"port {port} on 127.0.0.1 is already in use" in r.stderr
    assert ours(tmp_path) == []


def test_model_tiny_writes_a_model_folder(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    r = run("model", "tiny", "--out", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "llama"
