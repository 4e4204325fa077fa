"""TLS and credentials on the cluster's links, against a real etcd and a real Mosquitto.

Both servers speak only TLS and require a client certificate of their CA (trustme makes the CAs here); etcd
has its auth on (a ``root`` and a ``fleetward`` user), Mosquitto a password file and no anonymous clients.
A fleetward client with the right CA, certificate and password works; with a wrong CA, without a client
certificate, or with a wrong password it is refused with an error that says which. A client whose etcd token
was dropped authenticates again by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import pytest_asyncio
import trustme
from pydantic import SecretStr

from fleetward.chaos.attached import AttachedFleet
from fleetward.fleet.backends import SimBackend
from fleetward.fleet.bus import MqttBus
from fleetward.fleet.config import Access, AccessConfig, SimConfig, load_fleet_config, resolve_access
from fleetward.fleet.errors import BusUnavailable, ConfigError, StoreError, StoreUnavailable
from fleetward.fleet.etcd import EtcdStore, enable_auth
from fleetward.fleet.infra import LocalBroker, LocalEtcd, ServerTls, write_mosquitto_passwords
from fleetward.fleet.procs import ManagedProcess

on_module_loop = pytest.mark.asyncio(loop_scope="module")  # the servers are started once per module

PASSWORD = SecretStr("s3cret-fleet")
ROOT_PASSWORD = SecretStr("s3cret-root")


@dataclass(frozen=True)
class Pki:
    ca_file: Path
    cert_file: Path
    key_file: Path
    other_ca_file: Path  # a CA that signed nothing these servers present
    other_cert_file: Path  # a client certificate of that other CA
    other_key_file: Path
    server: ServerTls


def _write_key(path: Path, blob: trustme.Blob) -> Path:
    blob.write_to_path(str(path))
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("fleetward-client@example.org")
    stranger = other.issue_cert("stranger@example.org")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    other.cert_pem.write_to_path(str(d / "other-ca.pem"))
    server.cert_chain_pems[0].write_to_path(str(d / "server.pem"))
    _write_key(d / "server.key", server.private_key_pem)
    client.cert_chain_pems[0].write_to_path(str(d / "client.pem"))
    _write_key(d / "client.key", client.private_key_pem)
    stranger.cert_chain_pems[0].write_to_path(str(d / "stranger.pem"))
    _write_key(d / "stranger.key", stranger.private_key_pem)
    return Pki(d / "ca.pem", d / "client.pem", d / "client.key", d / "other-ca.pem", d / "stranger.pem",
               d / "stranger.key",
               ServerTls(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key"))


def good_access(pki: Pki, *, password: SecretStr | None = PASSWORD) -> Access:
    return Access(tls=True, ca_file=pki.ca_file, cert_file=pki.cert_file, key_file=pki.key_file,
                  username="fleetward" if password is not None else None, password=password)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def secure_etcd(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalEtcd]:
    d = tmp_path_factory.mktemp("secure-etcd")
    etcd = LocalEtcd(d / "data", tls=pki.server)
    etcd.start(d)
    try:
        await etcd.wait_ready()
        await enable_auth(etcd.endpoint, access=good_access(pki, password=None), root_password=ROOT_PASSWORD,
                          user="fleetward", password=PASSWORD, prefix="/fleetward/")
        await etcd.wait_ready()
        yield etcd
    finally:
        await etcd.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def secure_broker(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalBroker]:
    d = tmp_path_factory.mktemp("secure-broker")
    passwords = write_mosquitto_passwords(d / "passwords", {"fleetward": PASSWORD.get_secret_value()})
    broker = LocalBroker(d / "data", kind="mosquitto", tls=pki.server, password_file=passwords)
    broker.start(d)
    try:
        await broker.wait_ready()
        yield broker
    finally:
        await broker.stop()


@contextlib.asynccontextmanager
async def short_store(endpoint: str, access: Access) -> AsyncIterator[EtcdStore]:
    """A store that gives up quickly (the refusals below are retried as if etcd were away)."""
    store = EtcdStore(endpoint, access=access, attempts=2, retry_budget_s=2.0, timeout_s=2.0)
    try:
        yield store
    finally:
        await store.aclose()


# -- etcd --------------------------------------------------------------------------------------------------


@on_module_loop
async def test_etcd_client_with_ca_certificate_and_password_reads_writes_and_watches(
        secure_etcd: LocalEtcd, pki: Pki) -> None:
    async with EtcdStore(secure_etcd.endpoint, access=good_access(pki), attempts=3, retry_budget_s=5.0) as store:
        rev = await store.put("/fleetward/tls/a", b"1")
        kv = await store.get("/fleetward/tls/a")
        assert kv is not None and kv.value == b"1"
        lease = await store.grant(10)
        assert await store.keepalive(lease) > 0
        watch = store.watch_prefix("/fleetward/tls/", start_revision=rev)
        async with contextlib.aclosing(watch):
            event = await anext(watch)
        assert (event.key, event.value) == ("/fleetward/tls/a", b"1")
        await store.revoke(lease)


@on_module_loop
async def test_etcd_refuses_a_client_that_trusts_another_ca(secure_etcd: LocalEtcd, pki: Pki) -> None:
    async with short_store(secure_etcd.endpoint, replace(good_access(pki), ca_file=pki.other_ca_file)) as store:
        with pytest.raises(StoreUnavailable, match="etcd_access") as info:
            await store.get("/fleetward/tls/a")
    assert "CERTIFICATE_VERIFY_FAILED" in str(info.value) or "handshake" in str(info.value).lower()


@on_module_loop
async def test_etcd_refuses_a_client_without_a_client_certificate(secure_etcd: LocalEtcd, pki: Pki) -> None:
    access = replace(good_access(pki), cert_file=None, key_file=None)
    async with short_store(secure_etcd.endpoint, access) as store:
        with pytest.raises(StoreUnavailable, match="etcd_access"):
            await store.get("/fleetward/tls/a")


@on_module_loop
async def test_etcd_refuses_a_client_certificate_of_another_ca(secure_etcd: LocalEtcd, pki: Pki) -> None:
    access = replace(good_access(pki), cert_file=pki.other_cert_file, key_file=pki.other_key_file)
    async with short_store(secure_etcd.endpoint, access) as store:
        with pytest.raises(StoreUnavailable, match="etcd_access"):
            await store.get("/fleetward/tls/a")


@on_module_loop
async def test_etcd_refuses_a_wrong_password_at_once_naming_the_user(secure_etcd: LocalEtcd, pki: Pki) -> None:
    async with short_store(secure_etcd.endpoint, good_access(pki, password=SecretStr("wrong"))) as store:
        with pytest.raises(StoreError, match="refused user 'fleetward'") as info:
            await store.get("/fleetward/tls/a")
    assert not isinstance(info.value, StoreUnavailable)
    assert "wrong" not in str(info.value)


@on_module_loop
async def test_etcd_refuses_a_client_without_credentials_when_auth_is_on(secure_etcd: LocalEtcd, pki: Pki) -> None:
    async with short_store(secure_etcd.endpoint, good_access(pki, password=None)) as store:
        with pytest.raises(StoreError, match=r"etcd_access\.username"):
            await store.get("/fleetward/tls/a")


@on_module_loop
async def test_etcd_user_may_not_leave_its_prefix(secure_etcd: LocalEtcd, pki: Pki) -> None:
    async with short_store(secure_etcd.endpoint, good_access(pki)) as store:
        with pytest.raises(StoreError, match="lacks the permission"):
            await store.put("/elsewhere/x", b"1")


@on_module_loop
async def test_etcd_client_authenticates_again_when_its_token_is_dropped(secure_etcd: LocalEtcd, pki: Pki) -> None:
    """etcd drops every token of a user whose password changes (here: to the same password), as it drops
    an idle one after --auth-token-ttl; the next call is refused for its token, and must still succeed."""
    async with EtcdStore(secure_etcd.endpoint, access=good_access(pki), attempts=3, retry_budget_s=5.0) as store:
        await store.put("/fleetward/tls/token", b"before")
        client = store._client
        assert client is not None
        token = client.metadata
        await drop_tokens(secure_etcd, pki)
        await store.put("/fleetward/tls/token", b"after")
        assert client.metadata != token  # it did authenticate again, on the same connection
        kv = await store.get("/fleetward/tls/token")
        assert kv is not None and kv.value == b"after"


async def drop_tokens(secure_etcd: LocalEtcd, pki: Pki) -> None:
    """etcd drops the fleetward user's tokens: its password set again, to the same value (as root)."""
    from aetcd import rpc

    async with EtcdStore(secure_etcd.endpoint, access=replace(good_access(pki), username="root",
                                                               password=ROOT_PASSWORD)) as admin:
        root = await admin._connected()
        await rpc.AuthStub(root.channel).UserChangePassword(
            rpc.AuthUserChangePasswordRequest(name="fleetward", password=PASSWORD.get_secret_value()),
            metadata=root.metadata, timeout=5)


@on_module_loop
async def test_a_new_watch_on_a_stream_opened_with_a_dropped_token_still_delivers(
        secure_etcd: LocalEtcd, pki: Pki) -> None:
    """etcd reads a watch stream's token when the stream opens: once that token is dropped, a watch created
    on the stream is cancelled ("permission denied"). The stream is opened again with a fresh token, and the
    watch already on it resumes without a gap."""
    async with EtcdStore(secure_etcd.endpoint, access=good_access(pki), attempts=3, retry_budget_s=5.0) as store:
        rev = await store.put("/fleetward/stream/a", b"1")
        first = store.watch_prefix("/fleetward/stream/", start_revision=rev)
        async with contextlib.aclosing(first):
            assert (await anext(first)).value == b"1"
            await drop_tokens(secure_etcd, pki)
            second = store.watch_prefix("/fleetward/stream/", start_revision=rev)
            async with contextlib.aclosing(second), asyncio.timeout(20):
                assert (await anext(second)).value == b"1"
                await store.put("/fleetward/stream/b", b"2")
                assert (await anext(second)).value == b"2"
                assert (await anext(first)).value == b"2"


# -- the broker -------------------------------------------------------------------------------------------


@on_module_loop
async def test_bus_with_ca_certificate_and_password_publishes_and_subscribes(
        secure_broker: LocalBroker, pki: Pki) -> None:
    subscribed = asyncio.Event()
    async with MqttBus(secure_broker.endpoint, "tls", access=good_access(pki), connect_attempts=2) as bus:
        events = bus.subscribe(["worker.up"], subscribed=subscribed)
        async with contextlib.aclosing(events):
            got = asyncio.ensure_future(anext(events))
            async with asyncio.timeout(10):
                await subscribed.wait()
            sent = await bus.publish("worker.up", worker="w1")
            async with asyncio.timeout(10):
                event = await got
        assert event.id == sent.id
        assert await bus.flush(5)


@on_module_loop
async def test_broker_refuses_anonymous_clients_at_once(secure_broker: LocalBroker, pki: Pki) -> None:
    with pytest.raises(BusUnavailable, match="refused anonymous clients"):
        await MqttBus(secure_broker.endpoint, "tls", access=good_access(pki, password=None),
                      connect_attempts=5).start()


@on_module_loop
async def test_broker_refuses_a_wrong_password_without_saying_it(secure_broker: LocalBroker, pki: Pki) -> None:
    with pytest.raises(BusUnavailable, match="refused user 'fleetward'") as info:
        await MqttBus(secure_broker.endpoint, "tls", access=good_access(pki, password=SecretStr("wrong-pw")),
                      connect_attempts=5).start()
    assert "wrong-pw" not in str(info.value)


@on_module_loop
async def test_broker_refuses_a_client_that_trusts_another_ca(secure_broker: LocalBroker, pki: Pki) -> None:
    with pytest.raises(BusUnavailable, match="mqtt_access") as info:
        await MqttBus(secure_broker.endpoint, "tls", access=replace(good_access(pki), ca_file=pki.other_ca_file),
                      connect_attempts=2).start()
    assert "CERTIFICATE_VERIFY_FAILED" in str(info.value)


@on_module_loop
async def test_broker_refuses_a_client_without_a_client_certificate(secure_broker: LocalBroker, pki: Pki) -> None:
    with pytest.raises(BusUnavailable, match="mqtt_access"):
        await MqttBus(secure_broker.endpoint, "tls", access=replace(good_access(pki), cert_file=None, key_file=None),
                      connect_attempts=2).start()


# -- config ------------------------------------------------------------------------------------------------


@pytest.fixture
def password_file(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "etcd-password"
    path.write_text(PASSWORD.get_secret_value() + "\n")
    path.chmod(0o600)
    yield path


def test_access_config_resolves_the_password_from_a_file_and_hides_it(password_file: Path, pki: Pki) -> None:
    config = AccessConfig(ca_file=pki.ca_file, cert_file=pki.cert_file, key_file=pki.key_file,
                          username="fleetward", password_file=password_file)
    access = resolve_access(config, field="etcd_access")
    assert access.tls and access.password is not None
    assert access.password.get_secret_value() == PASSWORD.get_secret_value()
    assert PASSWORD.get_secret_value() not in repr(access) + str(access) + repr(config)


def test_access_config_takes_the_password_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETWARD_TEST_MQTT_PASSWORD", "from-env")
    access = resolve_access(AccessConfig(username="u", password_env="FLEETWARD_TEST_MQTT_PASSWORD"),
                            field="mqtt_access")
    assert access.password is not None and access.password.get_secret_value() == "from-env"
    assert not access.tls
    monkeypatch.delenv("FLEETWARD_TEST_MQTT_PASSWORD")
    with pytest.raises(ConfigError, match="FLEETWARD_TEST_MQTT_PASSWORD"):
        resolve_access(AccessConfig(username="u", password_env="FLEETWARD_TEST_MQTT_PASSWORD"), field="mqtt_access")


def test_password_file_readable_by_others_is_refused(password_file: Path) -> None:
    password_file.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others") as info:
        resolve_access(AccessConfig(username="u", password_file=password_file), field="etcd_access")
    assert info.value.field == "etcd_access.password_file"


def test_under_systemd_secret_files_are_read_from_the_credentials_the_unit_loaded(
        tmp_path: Path, pki: Pki, monkeypatch: pytest.MonkeyPatch) -> None:
    """A DynamicUser unit cannot read root's 0600 files; ``LoadCredential=NAME:PATH`` gives it a copy in
    $CREDENTIALS_DIRECTORY, and the fleet file's paths stay as they are (docs/deploy.md)."""
    from fleetward.migration.apikeys import ApiKeys

    credentials = tmp_path / "credentials"
    credentials.mkdir()
    for name, text in (("etcd-password", "from-the-credential\n"), ("client.key", pki.key_file.read_text()),
                       ("api-keys.yaml", "keys:\n  - {name: team-a, key: sk-team-a-0123456789}\n")):
        (credentials / name).write_text(text)
        (credentials / name).chmod(0o400)  # as systemd leaves them
    unreadable = tmp_path / "etc-fleetward"  # where the fleet file says; not there for this process
    config = AccessConfig(ca_file=pki.ca_file, cert_file=pki.cert_file, key_file=unreadable / "client.key",
                          username="fleetward", password_file=unreadable / "etcd-password")
    with pytest.raises(ConfigError, match="no such file"):
        resolve_access(config, field="etcd_access")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(credentials))
    access = resolve_access(config, field="etcd_access")
    assert access.password is not None and access.password.get_secret_value() == "from-the-credential"
    assert access.key_file == credentials / "client.key"
    assert ApiKeys.load(unreadable / "api-keys.yaml").names == ["team-a"]
    # A credential of another name does not stand in for a file: the path itself is read.
    assert resolve_access(AccessConfig(username="u", password_file=password_file_at(tmp_path)),
                          field="mqtt_access").password is not None


def password_file_at(root: Path) -> Path:
    path = root / "mqtt-password"
    path.write_text("own\n")
    path.chmod(0o600)
    return path


def test_bad_access_in_a_fleet_file_names_file_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("cluster: c\netcd: 127.0.0.1:2379\netcd_access:\n  username: fleetward\n  cert_file: c.pem\n")
    with pytest.raises(ConfigError) as info:
        load_fleet_config(path)
    text = str(info.value)
    assert "fleet.yaml" in text and "etcd_access" in text and info.value.line == 3
    assert "key_file" in text


def test_tls_on_the_amqtt_fallback_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="need Mosquitto"):
        LocalBroker(tmp_path / "broker", kind="amqtt", password_file=tmp_path / "passwords")


def test_fleet_file_without_access_keeps_working(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("cluster: c\netcd: 10.0.0.1:2379\nmqtt: 10.0.0.1:1883\n")
    config = load_fleet_config(path)
    assert resolve_access(config.etcd_access, field="etcd_access") == Access()
    assert (config.etcd_host, config.mqtt_host) == ("127.0.0.1", "127.0.0.1")



# -- fleetward up --tls ------------------------------------------------------------------------------------


FLEETWARD = [sys.executable, "-m", "fleetward.cli"]


def fleetward(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FLEETWARD, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONSAFEPATH": "1"})


def listening_ips(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port}


@on_module_loop
async def test_up_with_tls_serves_through_the_router_and_keeps_etcd_and_the_broker_on_loopback(
        tmp_path: Path, wait_until: Any) -> None:
    """``fleetward up --tls --host 0.0.0.0``: the router is exposed, etcd and the broker are not; both want
    TLS, a client certificate and a password, which every process of the fleet has (from files: no secret on
    any command line); ``fleetward status`` finds them through the local fleet's state file."""
    where = ("--run-dir", str(tmp_path), "--cluster", "tlsfleet")
    up = ManagedProcess("fleetward up --tls", [*FLEETWARD, "up", "--tls", "--host", "0.0.0.0", "--workers", "1",
                                               *where], log_path=tmp_path / "up.log",
                        env={"PYTHONSAFEPATH": "1"}).start()
    try:
        def ready() -> dict[str, Any] | None:
            r = fleetward("status", "--json", *where)
            if r.returncode != 0:
                return None
            data = json.loads(r.stdout)
            return data if data["routers"] and [w for w in data["workers"] if w["health"] == "ready"] else None

        status = await wait_until(ready, timeout=120, interval=0.5, message="a ready worker and a router (TLS)")
        state = json.loads((tmp_path / "tlsfleet" / "fleet.json").read_text())
        etcd_port, mqtt_port = int(state["etcd"].rpartition(":")[2]), int(state["mqtt"].rpartition(":")[2])
        assert listening_ips(etcd_port) == {"127.0.0.1"} and listening_ips(mqtt_port) == {"127.0.0.1"}
        router = status["routers"][0]["url"]
        assert listening_ips(int(router.rpartition(":")[2])) == {"0.0.0.0"}

        async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
            r = await client.post(f"{router.replace('0.0.0.0', '127.0.0.1')}/v1/completions",
                                  json={"model": "sim-tiny", "prompt": "Hello", "max_tokens": 8})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8

        secrets_ = [(tmp_path / "tlsfleet" / "tls" / f).read_text().strip()
                    for f in ("etcd-password", "etcd-root-password", "mqtt-password")]
        for p in up.tree():
            with contextlib.suppress(psutil.Error):
                cmd = " ".join(p.cmdline())
                assert not any(s in cmd for s in secrets_), f"a password on the command line of {cmd[:80]}"
        assert not any(s in (tmp_path / "tlsfleet" / "fleet.json").read_text() for s in secrets_)

        # `fleetward events` reaches the broker through fleet.json too.
        events = ManagedProcess("fleetward events", [*FLEETWARD, "events", "scale", "--count", "1", *where],
                                log_path=tmp_path / "events.log", env={"PYTHONSAFEPATH": "1"}).start()
        try:
            access = resolve_access(AccessConfig.model_validate(state["mqtt_access"]), field="mqtt_access")
            async with MqttBus(state["mqtt"], "tlsfleet", access=access) as bus:
                async def printed() -> bool:  # published until the subscriber, once subscribed, got one
                    await bus.publish("scale", reason="tls-test")
                    return not events.is_running

                await wait_until(printed, timeout=60, interval=0.2, message="fleetward events got an event")
            assert await events.wait_exit() == 0 and "reason=tls-test" in events.log_tail()
        finally:
            await events.stop()

        # A chaos run attached to this fleet reaches its etcd and broker through fleet.json too.
        attached = AttachedFleet(state, (tmp_path / "tlsfleet" / "admin-token").read_text().strip(),
                                 SimBackend(SimConfig()))
        try:
            await attached.start()
            assert attached.worker_ids and attached.routers
        finally:
            await attached.aclose()

        # What comes without the certificates and passwords is refused.
        async with short_store(state["etcd"], Access()) as plain:
            with pytest.raises(StoreUnavailable):
                await plain.get("/fleetward/tlsfleet/")
        pki = Access(tls=True, ca_file=Path(state["mqtt_access"]["ca_file"]),
                     cert_file=Path(state["mqtt_access"]["cert_file"]),
                     key_file=Path(state["mqtt_access"]["key_file"]))
        with pytest.raises(BusUnavailable, match="refused anonymous clients"):
            await MqttBus(state["mqtt"], "tlsfleet", access=pki, connect_attempts=2).start()
        async with short_store(state["etcd"], pki) as certified_only:
            with pytest.raises(StoreError, match="auth on"):
                await certified_only.get("/fleetward/tlsfleet/")

        up.signal(signal.SIGTERM)
        assert await up.wait_exit() == 0
    finally:
        await up.stop()


@on_module_loop
async def test_watch_resumes_across_an_etcd_restart_that_dropped_every_token(
        secure_etcd: LocalEtcd, pki: Pki, tmp_path: Path) -> None:
    """etcd keeps its simple tokens in memory: after a restart every token is unknown, the watch stream's
    too. The watch resumes (a new stream, a fresh token) and misses nothing."""
    async with EtcdStore(secure_etcd.endpoint, access=good_access(pki), attempts=20, retry_budget_s=30.0) as store:
        rev = await store.put("/fleetward/restart/a", b"1")
        watch = store.watch_prefix("/fleetward/restart/", start_revision=rev)
        async with contextlib.aclosing(watch):
            assert (await anext(watch)).value == b"1"
            await secure_etcd.stop()
            secure_etcd.start(tmp_path)
            await secure_etcd.wait_ready()
            async with EtcdStore(secure_etcd.endpoint, access=good_access(pki)) as writer:  # not the watcher's
                await writer.put("/fleetward/restart/b", b"2")
            async with asyncio.timeout(30):
                event = await anext(watch)
        assert (event.key, event.value) == ("/fleetward/restart/b", b"2")
