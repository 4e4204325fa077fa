"""Hosts as network namespaces: real drops between them, and nothing left behind, also after a kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from fleetward.chaos.hostnet import Drop, HostNetwork, leftover_namespaces

pytestmark = pytest.mark.skipif(HostNetwork.unavailable_reason() is not None,
                                reason=str(HostNetwork.unavailable_reason()))

# A client in the clients' namespace: one streamed completion through router-0 (on h0).
STREAM = ("import json, urllib.request; body = json.dumps({'model': 'sim-tiny', 'prompt': 'Hello', 'max_tokens': 4, "
          "'stream': True}).encode(); req = urllib.request.Request('http://10.77.0.10:8000/v1/completions', body, "
          "{'content-type': 'application/json'}); print(urllib.request.urlopen(req, timeout=20).read().decode())")
LISTEN = "import socket,time;s=socket.socket();s.bind(('0.0.0.0',5000));s.listen();time.sleep(600)"


def _wait(cond: object, within: float = 20.0) -> None:
    """Until ``cond()`` holds (a deadline, not a timing claim)."""
    deadline = time.monotonic() + within
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "the condition did not come true in time"
        time.sleep(0.05)


@pytest.fixture
def net() -> Iterator[HostNetwork]:
    n = HostNetwork(3).create()
    try:
        yield n
    finally:
        n.destroy()


def _links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


def test_hosts_reach_each_other_and_the_run_s_own_network_is_untouched(net: HostNetwork) -> None:
    assert set(leftover_namespaces(net.prefix)) == set(net.namespaces)
    assert net.prefix not in _links() and "10.77.0." not in subprocess.run(
        ["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    for src in ("h0", "h1", "clients"):
        assert net.connects(src, "h2", 9, refused_counts=True)  # nothing listens: a reset, the path flows
    assert not net.connects("h0", "h2", 9)  # refused is not accepted


def test_isolate_cut_one_way_and_heal(net: HostNetwork) -> None:
    listener = subprocess.Popen(net.exec_argv("h1", [sys.executable, "-c", LISTEN]))
    try:
        _wait(lambda: net.connects("h0", "h1", 5000))
        net.partition("cut", [Drop("h0", "h1"), Drop("h1", "h0")])
        assert not net.connects("h0", "h1", 5000, timeout=0.3)
        assert net.connects("clients", "h1", 5000)  # only that link
        net.partition("svc", [Drop("clients", "h1", port=5000)])
        assert not net.connects("clients", "h1", 5000, timeout=0.3)
        assert net.connects("clients", "h1", 9, refused_counts=True)  # other ports flow
        net.heal("cut")
        assert net.connects("h0", "h1", 5000) and not net.connects("clients", "h1", 5000, timeout=0.3)
        net.heal()
        net.partition("one-way", [Drop("h2", "h0")])
        assert not net.connects("h2", "h0", 9, timeout=0.3, refused_counts=True)
        net.heal()
        assert all(net.connects(s, "h1", 5000) for s in ("h0", "h2", "clients"))
    finally:
        listener.kill()
        listener.wait()


def test_destroy_kills_what_runs_inside_and_leaves_no_namespace() -> None:
    net = HostNetwork(2).create()
    inside = subprocess.Popen(net.exec_argv("h0", [sys.executable, "-c", LISTEN]))
    # Inside h0 and listening before the namespaces go: a process still on its way in (``ip netns exec``
    # between opening the namespace and entering it) is not inside yet, and no scan of the namespace finds it.
    _wait(lambda: net.connects("h1", "h0", 5000))
    net.destroy()
    assert inside.wait(timeout=10) == -signal.SIGKILL
    assert leftover_namespaces(net.prefix) == []
    assert net.prefix not in _links()


def test_a_kill_9_of_the_run_leaves_no_namespace_veth_or_process(tmp_path: Path) -> None:
    """The run's process dies without cleaning up: its reaper removes the namespaces and kills what ran there."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import subprocess, sys, time
        from fleetward.chaos.hostnet import HostNetwork
        net = HostNetwork(3).create()
        for h in ("h0", "h1", "h2"):
            subprocess.Popen(net.exec_argv(h, [sys.executable, "-c", {LISTEN!r}]), start_new_session=True)
        print(net.prefix, flush=True)
        time.sleep(600)
    """))
    run = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert run.stdout is not None
    prefix = run.stdout.readline().strip()
    assert prefix.startswith("fw")
    net = HostNetwork(3, run_id=prefix[2:-1])
    _wait(lambda: all(any(True for _ in _pids(ns)) for ns in (net.hosts[0].ns, net.hosts[2].ns)))
    inside = [p for h in net.hosts for p in _pids(h.ns)]
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    _wait(lambda: leftover_namespaces(prefix) == [])
    _wait(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                          for p in inside))
    assert prefix not in _links()


def _pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout
    return [int(p) for p in out.split()]


def test_fleetward_up_on_three_hosts_serves_then_a_kill_9_leaves_nothing(tmp_path: Path) -> None:
    """`fleetward up --hosts 3` as a user runs it: a stream through its router from the clients' namespace; then
    the command is killed with SIGKILL, and no namespace, veth or fleet process is left."""
    before = set(leftover_namespaces())
    up = subprocess.Popen([sys.executable, "-m", "fleetward.cli", "up", "--hosts", "3", "--workers", "1",
                           "--run-dir", str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True)
    try:
        assert up.stdout is not None
        lines = []
        for line in up.stdout:
            lines.append(line)
            if "is up on 3 hosts" in line or "Traceback" in line:
                break
        assert "is up on 3 hosts" in "".join(lines), "".join(lines)
        (ns,) = [n for n in set(leftover_namespaces()) - before if n.endswith("-c")]  # the clients' namespace
        prefix = ns[:-1]
        fleet = [p for n in leftover_namespaces(prefix) for p in _pids(n)]
        assert len(fleet) >= 3 + 3 + 3 + 2 + 2  # etcd, agents, workers, controllers, routers (and the broker)
        client = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", STREAM], capture_output=True,
                                text=True, check=False, timeout=60)
        assert "data: [DONE]" in client.stdout, client.stdout + client.stderr
    finally:
        os.kill(up.pid, signal.SIGKILL)
        up.wait()
    _wait(lambda: leftover_namespaces(prefix) == [])
    _wait(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in fleet))
    assert prefix not in _links()
