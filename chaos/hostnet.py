"""Hosts as Linux network namespaces on one bridge, and real partitions between them with nftables.

A :class:`HostNetwork` is N hosts (``h0``, ``h1``, ...), a ``clients`` namespace (where the run itself, its
workload and its probes live) and a ``switch`` namespace holding the bridge that joins them. Every name
starts with ``fw<run id>-``, and nothing changes in the namespace the run was started from: no interface,
address, route or rule there; each host's veth is made in the switch with its other end directly in the host.

=========== =====================================================================================================
host        namespace ``fw<id>-h<i>``, address ``10.77.0.<10+i>``: its own ports, so every host runs etcd on 2379
clients     namespace ``fw<id>-c``, address ``10.77.0.2``: the run's process enters it (:meth:`HostNetwork.enter`)
switch      namespace ``fw<id>-sw``: the bridge ``br0`` and one veth per host, named like the host
=========== =====================================================================================================

Partitions are packet drops in each namespace's own nftables table (``inet fleetward``, chains ``input`` and
``output``): a :class:`Drop` names who stops hearing whom, and optionally one service's port.
:meth:`HostNetwork.partition` installs a fault's drops under its name and :meth:`HostNetwork.heal` removes
them; every namespace's chains are rewritten from the drops in effect, atomically (``nft -f``). There is no
netem in this kernel: delay and loss stay with the in-process proxy (:mod:`fleetward.chaos.net`).

Nothing is left behind: :meth:`HostNetwork.destroy` kills every process inside the namespaces and deletes
them (the veths and the bridge go with them), and a reaper started with the network, in a session of its own,
does the same when the run's process dies without cleaning up (``kill -9``). ``python -m
fleetward.chaos.hostnet --cleanup`` removes what any earlier run left.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import os
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fleetward.fleet.claims import claim, release

__all__ = ["Drop", "Host", "HostNetwork", "leftover_namespaces"]

SUBNET = "10.77.0"
PREFIX = "fw"
_CLONE_NEWNET = 0x40000000
_TABLE = """table inet fleetward {
    chain input { type filter hook input priority 0; policy accept; }
    chain output { type filter hook output priority 0; policy accept; }
}
"""


@dataclass(frozen=True)
class Host:
    name: str  # h0, h1, ..., clients
    ns: str  # the namespace
    address: str


@dataclass(frozen=True)
class Drop:
    """``dst`` stops hearing ``src`` (packets from ``src`` are dropped where ``dst`` receives them, and on their
    way out of ``src``); ``port``: only traffic to that TCP port on ``dst`` (and its answers), e.g. etcd's."""

    src: str
    dst: str
    port: int | None = None


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _setns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc().setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _ip(*args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["ip", *args], input=stdin, capture_output=True, text=True, check=False)
    if check and res.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res


_OURS = re.compile(rf"^{PREFIX}[0-9a-f]{{6}}-(h\d+|c|sw)$")


def leftover_namespaces(prefix: str = PREFIX) -> list[str]:
    """The host networks' namespaces (``fw<id>-...``) named ``prefix...`` that exist (``ip netns list``)."""
    res = _ip("netns", "list", check=False)
    names = [line.split()[0] for line in res.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix) and _OURS.match(n)]


def _pids_in(ns: str) -> list[int]:
    res = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


def remove_namespaces(names: Iterable[str], *, spare: Iterable[int] = (), timeout: float = 10.0) -> None:
    """Kill every process inside ``names`` (but ``spare``), then delete the namespaces."""
    names = list(names)
    spared = set(spare)
    deadline = time.monotonic() + timeout
    while True:
        pids = [p for ns in names for p in _pids_in(ns) if p not in spared]
        if not pids or time.monotonic() > deadline:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    for ns in names:
        _ip("netns", "del", ns, check=False)


class HostNetwork:
    """N hosts, a clients namespace and a switch (see the module docstring). Root, ``ip`` and ``nft``."""

    def __init__(self, hosts: int, *, run_id: str | None = None) -> None:
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts must be between 1 and 200, not {hosts}")
        self.id = run_id or secrets.token_hex(3)
        self.prefix = f"{PREFIX}{self.id}-"
        self.hosts = [Host(f"h{i}", f"{self.prefix}h{i}", f"{SUBNET}.{10 + i}") for i in range(hosts)]
        self.clients = Host("clients", f"{self.prefix}c", f"{SUBNET}.2")
        self.switch = f"{self.prefix}sw"
        self._drops: dict[str, list[Drop]] = {}
        self._reaper: subprocess.Popen[bytes] | None = None
        self._home: int | None = None  # the namespace the run came from, while it is in another
        self.created = False

    # -- lookups

    @property
    def nodes(self) -> list[Host]:
        """The hosts and the clients' namespace."""
        return [*self.hosts, self.clients]

    @property
    def namespaces(self) -> list[str]:
        return [h.ns for h in self.nodes] + [self.switch]

    def host(self, name: str) -> Host:
        for h in self.nodes:
            if name in (h.name, h.ns, h.address):
                return h
        raise KeyError(f"no host {name!r}; hosts: {', '.join(h.name for h in self.nodes)}")

    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run on ``host``'s network (``ip netns exec``, which execs it: the pid stays the same)."""
        return ["ip", "netns", "exec", self.host(host).ns, *argv]

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why host namespaces cannot be made here, or None when they can."""
        if os.geteuid() != 0:
            return "hosts in network namespaces need root"
        for cmd, pkg in (("ip", "iproute2"), ("nft", "nftables")):
            if shutil.which(cmd) is None:
                return f"the {cmd} command is not installed (Debian: apt-get install {pkg})"
        return None

    # -- life

    def create(self, *, reaper: bool = True) -> HostNetwork:
        """Make the namespaces, the bridge, the veths, addresses and empty nftables tables; start the reaper."""
        reason = self.unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        self.created = True
        claim("netns", self.prefix)  # what a reaper killed with the run leaves goes at the next one's reclaim
        if reaper:  # first: whatever happens from here on, it removes what was made
            self._reaper = subprocess.Popen(
                [sys.executable, "-m", "fleetward.chaos.hostnet", "--reap", str(os.getpid()), self.prefix],
                start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)
        try:
            for ns in self.namespaces:
                _ip("netns", "add", ns)
            sw = self.switch
            _ip("-n", sw, "link", "set", "lo", "up")
            _ip("-n", sw, "link", "add", "br0", "type", "bridge")
            _ip("-n", sw, "link", "set", "br0", "up")
            for h in self.nodes:
                _ip("-n", sw, "link", "add", h.name[:15], "type", "veth", "peer", "name", "eth0", "netns", h.ns)
                _ip("-n", sw, "link", "set", h.name[:15], "master", "br0", "up")
                _ip("-n", h.ns, "link", "set", "lo", "up")
                _ip("-n", h.ns, "addr", "add", f"{h.address}/24", "dev", "eth0")
                _ip("-n", h.ns, "link", "set", "eth0", "up")
                self._nft(h.ns, _TABLE)
        except BaseException:
            self.destroy()
            raise
        return self

    def _nft(self, ns: str, script: str) -> None:
        res = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=script, capture_output=True,
                             text=True, check=False)
        if res.returncode:
            raise RuntimeError(f"nft in {ns}: {res.stderr.strip()}")

    def enter(self, host: str = "clients") -> None:
        """Move this thread (call it from the main thread before any other starts, so that every thread and
        child inherits it) onto ``host``'s network. :meth:`destroy` comes back first."""
        if self._home is None:
            self._home = os.open("/proc/self/ns/net", os.O_RDONLY)
        _setns(f"/run/netns/{self.host(host).ns}")

    def leave(self) -> None:
        if self._home is not None:
            if _libc().setns(self._home, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the run's own network failed")
            os.close(self._home)
            self._home = None

    def destroy(self) -> None:
        """Kill what runs in the namespaces, delete them (veths and bridge with them), stop the reaper."""
        self.leave()
        remove_namespaces(self.namespaces, spare=(os.getpid(),))
        if self._reaper is not None:
            with contextlib.suppress(ProcessLookupError):
                self._reaper.kill()
            self._reaper.wait()
            self._reaper = None
        if self.created and not leftover_namespaces(self.prefix):
            release("netns", self.prefix)
        self.created = False

    def __enter__(self) -> HostNetwork:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    # -- partitions

    def partition(self, name: str, drops: Sequence[Drop]) -> None:
        """Put ``drops`` in effect under ``name`` (a fault's), beside any other fault's."""
        for d in drops:
            self.host(d.src), self.host(d.dst)  # a KeyError names the hosts
        self._drops[name] = list(drops)
        self._apply()

    def heal(self, name: str | None = None) -> None:
        """Remove ``name``'s drops (every fault's when None)."""
        if name is None:
            self._drops.clear()
        else:
            self._drops.pop(name, None)
        self._apply()

    @property
    def drops(self) -> list[Drop]:
        return [d for ds in self._drops.values() for d in ds]

    def _apply(self) -> None:
        rules: dict[str, list[str]] = {h.ns: [] for h in self.nodes}
        for d in self.drops:
            src, dst = self.host(d.src), self.host(d.dst)
            to_port = f" tcp dport {d.port}" if d.port else ""
            from_port = f" tcp sport {d.port}" if d.port else ""
            # Where dst receives: nothing from src (to the port); where src sends: nothing to dst (to the port),
            # and dst's answers from that port are dropped on their way back too.
            rules[dst.ns].append(f"add rule inet fleetward input ip saddr {src.address}{to_port} drop")
            rules[src.ns].append(f"add rule inet fleetward output ip daddr {dst.address}{to_port} drop")
            if d.port:
                rules[dst.ns].append(f"add rule inet fleetward output ip daddr {src.address}{from_port} drop")
        for ns, lines in rules.items():
            self._nft(ns, "flush chain inet fleetward input\nflush chain inet fleetward output\n"
                      + "".join(line + "\n" for line in dict.fromkeys(lines)))

    # -- probes

    def connects(self, src: str, dst: str, port: int, *, timeout: float = 1.0, refused_counts: bool = False) -> bool:
        """Whether a TCP connection from ``src``'s network to ``dst:port`` is accepted within ``timeout`` (or
        refused, with ``refused_counts``: a reset came back, so the path flows where nothing listens).

        A thread of its own enters ``src``'s network to make the socket (a socket stays in the namespace it
        was made in) and ends with the probe."""
        result: list[bool] = []
        address = self.host(dst).address

        def probe() -> None:
            try:
                _setns(f"/run/netns/{self.host(src).ns}")
                with socket.create_connection((address, port), timeout=timeout):
                    result.append(True)
            except ConnectionRefusedError:
                result.append(refused_counts)
            except OSError:
                result.append(False)

        t = threading.Thread(target=probe, name=f"probe {src}->{dst}:{port}", daemon=True)
        t.start()
        t.join(timeout + 2.0)
        return bool(result and result[0])


def _reap(parent: int, prefix: str) -> None:
    """Wait for ``parent`` to end, then remove every namespace named ``prefix*`` and what runs in it."""
    try:
        fd = os.pidfd_open(parent)
    except ProcessLookupError:
        fd = None
    seen = False
    while fd is not None:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            break
        left = bool(leftover_namespaces(prefix))
        if seen and not left:  # destroyed by the run itself: nothing to do
            return
        seen = seen or left
    remove_namespaces(leftover_namespaces(prefix))
    release("netns", prefix)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fleetward.chaos.hostnet",
                                description="Remove host namespaces a run left behind.")
    p.add_argument("--reap", nargs=2, metavar=("PID", "PREFIX"), help="(internal) wait for PID, then remove PREFIX*")
    p.add_argument("--cleanup", action="store_true", help=f"remove every {PREFIX}<id>-* namespace now")
    args = p.parse_args(argv)
    if args.reap:
        _reap(int(args.reap[0]), args.reap[1])
        return 0
    if args.cleanup:
        left = leftover_namespaces()
        remove_namespaces(left)
        print(f"removed {len(left)} namespace(s)" + (f": {', '.join(left)}" if left else ""))
        return 0
    p.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
