"""The Kubernetes actuator against a local stand-in for the API server's scale subresource, real etcd, and (for
the drain) a real supervisor controller, router and simulated worker.

The stand-in (:class:`ApiServer`) plays ``GET`` and ``PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale``
as the API server documents them (an ``autoscaling/v1`` ``Scale``; a ``Status`` on errors; the patch types the
scale subresource takes) and records every request the real ``kubernetes_asyncio`` client sends, so the tests
check the request shapes: method, path, the patch's body and ``Content-Type``, the bearer token. None of this
has met a live API server.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes_asyncio.client import ApiClient, Configuration
from testkit import stream_completion

from fleetward.autoscale.actuate import ActuationError, NewWorker
from fleetward.autoscale.daemon import PoolRecord
from fleetward.autoscale.kubernetes import (
    INSTALL_HINT,
    KubernetesActuator,
    Limits,
    PoolPods,
    drain_ended,
    kubernetes_client,
    open_kubernetes_actuator,
    replicas_for,
)
from fleetward.chaos.harness import TestFleet
from fleetward.fleet.config import KubernetesScaleConfig, SimConfig
from fleetward.fleet.errors import ConfigError
from fleetward.fleet.etcd import EtcdStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.registry import read_fleet, read_leader
from fleetward.fleet.worker import HealthRecord, HealthState, WorkerRecord

NS = "fw"
TOKEN = "sa-token"
SCALE_PATH = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"
# What the API server takes as a patch of the scale subresource (apply-patch+yaml needs a fieldManager).
PATCH_TYPES = {"application/json-patch+json", "application/merge-patch+json", "application/strategic-merge-patch+json"}


# -- the stand-in API server ------------------------------------------------------------------------------


@dataclass
class Call:
    method: str
    path: str
    content_type: str
    authorization: str
    body: Any


@dataclass
class ApiServer:
    """The scale subresource of some Deployments (name -> spec.replicas), with the answers the API server gives."""

    replicas: dict[str, int] = field(default_factory=dict)
    forbidden: set[str] = field(default_factory=set)  # verbs the service account's Role lacks
    fail_next: list[int] = field(default_factory=list)  # statuses to answer the next requests with
    calls: list[Call] = field(default_factory=list)
    versions: dict[str, int] = field(default_factory=dict)

    def patches(self) -> list[Call]:
        return [c for c in self.calls if c.method == "PATCH"]

    def _scale(self, name: str) -> dict[str, Any]:
        n = self.replicas[name]
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": name, "namespace": NS, "resourceVersion": str(self.versions.get(name, 1)),
                             "uid": "0b6f7d2a-1c1e-4c8e-9f0a-5d2f0d7b9e11",
                             "creationTimestamp": "2025-01-01T00:00:00Z"},
                "spec": {"replicas": n}, "status": {"replicas": n, "selector": f"app={name}"}}

    @staticmethod
    def _status(code: int, reason: str, message: str) -> web.Response:
        return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                  "message": message, "reason": reason, "code": code}, status=code)

    async def handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body: Any = json.loads(raw) if raw else None
        self.calls.append(Call(request.method, request.path, request.headers.get("Content-Type", ""),
                               request.headers.get("Authorization", ""), body))
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._status(401, "Unauthorized", "Unauthorized")
        ns, name = request.match_info["ns"], request.match_info["name"]
        verb = "get" if request.method == "GET" else "patch"
        if self.fail_next:
            code = self.fail_next.pop(0)
            return self._status(code, "ServiceUnavailable" if code == 503 else "Conflict", f"HTTP {code} (stand-in)")
        if verb in self.forbidden:
            return self._status(403, "Forbidden", f'deployments.apps "{name}" is forbidden: User '
                                f'"system:serviceaccount:{ns}:fleetward-autoscaler" cannot {verb} resource '
                                f'"deployments/scale" in API group "apps" in the namespace "{ns}"')
        if ns != NS or name not in self.replicas:
            return self._status(404, "NotFound", f'deployments.apps "{name}" not found')
        if verb == "patch":
            if request.content_type not in PATCH_TYPES:
                return self._status(415, "UnsupportedMediaType", f"the body of the request was in an unknown format "
                                    f"- accepted media types include: {', '.join(sorted(PATCH_TYPES))}")
            wanted = (body.get("metadata") or {}).get("resourceVersion")
            if wanted is not None and wanted != str(self.versions.get(name, 1)):
                return self._status(409, "Conflict", f'Operation cannot be fulfilled on deployments.apps "{name}": '
                                    "the object has been modified; please apply your changes to the latest version")
            self.replicas[name] = int(body["spec"]["replicas"])
            self.versions[name] = self.versions.get(name, 1) + 1
        return web.json_response(self._scale(name))


@pytest_asyncio.fixture
async def apiserver() -> AsyncIterator[tuple[ApiServer, str]]:
    api = ApiServer(replicas={"vllm": 2})
    app = web.Application()
    for method in ("GET", "PATCH"):
        app.router.add_route(method, SCALE_PATH, api.handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield api, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def client_for(url: str) -> ApiClient:
    return ApiClient(Configuration(host=url, api_key={"BearerToken": TOKEN}, api_key_prefix={"BearerToken": "Bearer"}))


ROOMY = Limits(least=0, most=64)  # the limits of a pool the tests do not push against


def actuator_for(url: str, store: EtcdStore, keys: Keys, limits: Limits = ROOMY, **kw: Any) -> KubernetesActuator:
    return KubernetesActuator(KubernetesScaleConfig(namespace=NS), NS, client_for(url), store=store, keys=keys,
                              admin_token="admin", backoff_s=0.01, limits=limits, **kw)


async def register(store: EtcdStore, keys: Keys, wid: str, state: HealthState = HealthState.READY,
                   **extra: Any) -> None:
    await store.put(keys.worker(wid), WorkerRecord(wid, f"http://{wid}", "aggregated", "m", wid, "vllm").to_json())
    await store.put(keys.health_of(wid), HealthRecord(state, extra={"node": wid, **extra}).to_json())


DRAINED: dict[str, Any] = {"cordoned": True, "drain": {"deadline": None, "then": "cordon", "by": "autoscaler",
                                                        "moving_until": None}}


# -- the rule, without IO -----------------------------------------------------------------------------------


def test_a_cordon_drain_has_ended_only_when_its_deadline_is_gone() -> None:
    assert drain_ended(HealthRecord(HealthState.DRAINING, extra=DRAINED))
    running = {**DRAINED, "drain": {**DRAINED["drain"], "deadline": 1.7e9}}
    assert not drain_ended(HealthRecord(HealthState.DRAINING, extra=running))
    moving = {**DRAINED, "drain": {**DRAINED["drain"], "moving_until": 1.7e9}}
    assert not drain_ended(HealthRecord(HealthState.DRAINING, extra=moving))
    operator = {**DRAINED, "drain": {**DRAINED["drain"], "by": "operator"}}
    assert not drain_ended(HealthRecord(HealthState.DRAINING, extra=operator)), "an operator's cordon keeps its pod"
    assert not drain_ended(HealthRecord(HealthState.READY)) and not drain_ended(None)


@dataclass
class Cluster:
    """A pool's pods as the ReplicaSet keeps them: ``pending`` (created, not registered: NotReady), ``live``
    (registered, Ready), ``draining`` (Ready until the drain ends), ``drained`` (NotReady)."""

    spec: int
    pods: list[str]
    asks: int = 0
    deleted_ready: int = 0

    def count(self, kind: str) -> int:
        return self.pods.count(kind)

    def actuate(self) -> None:
        pods = PoolPods(live=self.count("live") + self.count("draining"), drained=self.count("drained"),
                        asks=self.asks)
        before = self.spec
        self.spec = replicas_for(before, pods)
        assert replicas_for(self.spec, pods) == self.spec, "asked again, the same replicas"
        assert self.spec >= min(before, pods.live), "never below the workers not retiring"
        assert self.spec >= before - pods.drained, "down by the drained retirees at most"

    def sync(self) -> None:
        """The ReplicaSet: creates pods up to spec, deletes NotReady ones first (pending, then drained)."""
        while len(self.pods) < self.spec:
            self.pods.append("pending")
        rank = {"pending": 0, "drained": 1, "draining": 2, "live": 2}
        self.pods.sort(key=lambda k: rank[k])
        while len(self.pods) > self.spec:
            gone = self.pods.pop(0)
            self.deleted_ready += gone in ("live", "draining")

    def register(self) -> None:
        if "pending" in self.pods:
            self.pods[self.pods.index("pending")] = "live"
            self.asks = max(0, self.asks - 1)


EVENTS = st.one_of(st.tuples(st.just("ask"), st.integers(1, 3)), st.tuples(st.just("retire"), st.integers(1, 2)),
                   st.sampled_from([("end", 0), ("sync", 0), ("register", 0), ("again", 0)]))


@settings(max_examples=300, deadline=None)
@given(start=st.integers(1, 5), events=st.lists(EVENTS, max_size=40))
def test_replicas_never_cut_a_ready_pod_and_settle_at_the_workers_wanted(start: int,
                                                                       events: list[tuple[str, int]]) -> None:
    c = Cluster(spec=start, pods=["live"] * start)
    for kind, n in events:
        if kind == "ask":
            c.asks += n
            c.actuate()
        elif kind == "retire":
            for _ in range(min(n, c.count("live"))):
                c.pods[c.pods.index("live")] = "draining"
            c.actuate()
        elif kind == "end" and "draining" in c.pods:
            c.pods[c.pods.index("draining")] = "drained"
            c.actuate()
        elif kind == "sync":
            c.sync()
        elif kind == "register":
            c.register()
        elif kind == "again":
            c.actuate()
        assert c.deleted_ready == 0, f"a Ready pod was deleted after {kind}"
    # Every drain ends, every pod registers, the daemon calls again each interval: the pool settles.
    wanted = c.count("live") + c.asks  # the retirees go
    for _ in range(4):
        c.pods = ["drained" if k == "draining" else k for k in c.pods]
        c.actuate()
        c.sync()
        while "pending" in c.pods:
            c.register()
        c.actuate()
        c.sync()
    assert c.deleted_ready == 0
    assert c.spec == len(c.pods) == c.count("live") == wanted and c.asks == 0


def test_the_daemon_takes_any_new_worker_of_the_pool_for_a_placeholder_and_parks_no_pod() -> None:
    from types import SimpleNamespace

    from fleetward.autoscale.daemon import Autoscaler
    from fleetward.autoscale.observe import Member, PoolView

    def view(**members: HealthState | None) -> PoolView:
        v = PoolView("aggregated")
        for wid, state in members.items():
            v.members[wid] = Member(wid, wid, None, state, state is not HealthState.DEAD)
        return v

    daemon: Any = SimpleNamespace(names_workers=True)
    rec = PoolRecord("aggregated", asked={"a-w0": "a", "a-w1": "a"}, retiring=["b"], members=["a", "b"])
    Autoscaler._settle(daemon, rec, view(a=HealthState.READY, b=HealthState.DRAINING, c=HealthState.STARTING))
    assert rec.asked == {"a-w1": "a"} and rec.members == ["a", "b", "c"], "c fulfilled the oldest placeholder"
    Autoscaler._settle(daemon, rec, view(a=HealthState.READY, b=HealthState.DRAINING, c=HealthState.READY))
    assert rec.asked == {"a-w1": "a"}, "c counts once"
    Autoscaler._settle(daemon, rec, view(a=HealthState.READY, b=HealthState.DEAD, c=HealthState.READY,
                                         d=HealthState.STARTING))
    assert rec.asked == {} and rec.retiring == [] and rec.parked == [], "b's pod is gone for good: not parked"


# -- the client's requests against the stand-in, etcd real ---------------------------------------------------


async def test_scale_up_patches_the_replicas_once_per_ask(apiserver: tuple[ApiServer, str], store: EtcdStore,
                                                          keys: Keys) -> None:
    api, url = apiserver
    for wid in ("vllm-a", "vllm-b"):
        await register(store, keys, wid)
    # What the daemon wrote before acting: one placeholder asked, the pool's two workers when it decided.
    rec = PoolRecord("aggregated", desired=3, asked={"vllm-a-w0": "vllm-a"}, members=["vllm-a", "vllm-b"])
    await store.put(keys.scale_of("aggregated"), rec.to_json())
    ask = [NewWorker("vllm-a-w0", "vllm-a")]
    first = actuator_for(url, store, keys)
    try:
        await first.add("aggregated", ask, "up")
        await first.add("aggregated", ask, "up: asked again")
    finally:
        await first.aclose()
    standby = actuator_for(url, store, keys)  # a new leader asks again for what its predecessor asked
    try:
        await standby.add("aggregated", ask, "up: after a failover")
        assert api.replicas["vllm"] == 3 and len(api.patches()) == 1, [c.body for c in api.patches()]
        # The new pod registers before the daemon has settled the ask: it fulfils it, nothing more is added.
        await register(store, keys, "vllm-c", HealthState.STARTING)
        await standby.add("aggregated", ask, "up: asked again")
        assert api.replicas["vllm"] == 3 and len(api.patches()) == 1
    finally:
        await standby.aclose()

    path = SCALE_PATH.format(ns=NS, name="vllm")
    assert all(c.path == path for c in api.calls) and {c.method for c in api.calls} == {"GET", "PATCH"}
    assert all(c.authorization == f"Bearer {TOKEN}" for c in api.calls)
    patch = api.patches()[0]
    assert patch.content_type == "application/merge-patch+json" and patch.content_type in PATCH_TYPES
    assert patch.body == {"metadata": {"resourceVersion": "1"}, "spec": {"replicas": 3}}


def test_the_limits_hold_whatever_the_records_ask() -> None:
    roomy = Limits(least=2, most=100)
    assert roomy.bound(6, 10_000, drained=0) == 12, "up by double at most"
    assert roomy.bound(1, 10_000, drained=0) == 5, "or by 4"
    limits = Limits(least=2, most=10)
    assert limits.bound(8, 10_000, drained=0) == 10, "never past max_workers"
    assert limits.bound(10, 10_000, drained=1) == 11, "but the retirees not gone yet still have their pods"
    assert limits.bound(10, 10_000, drained=500) == 20, "themselves no more than max_workers"
    assert limits.bound(5, 0, drained=0) == 2, "never below min_workers"
    assert limits.bound(1, 0, drained=0) == 1, "nor made to start pods by a scale-down"
    assert limits.bound(4, 5, drained=0) == 5 and limits.bound(4, 3, drained=1) == 3, "within them: as asked"


async def test_a_forged_scale_record_moves_the_deployment_no_further_than_the_limits(
        apiserver: tuple[ApiServer, str], store: EtcdStore, keys: Keys) -> None:
    """Anyone who can write to etcd can write scale/<pool>: one that asks for ten thousand workers moves the
    Deployment up by the step, and no further than max_workers, however often the daemon calls."""
    api, url = apiserver
    await register(store, keys, "vllm-a")
    api.replicas["vllm"] = 1
    asked = {f"forged-w{i}": "forged" for i in range(10_000)}
    await store.put(keys.scale_of("aggregated"), PoolRecord("aggregated", asked=asked, members=["vllm-a"]).to_json())
    act = actuator_for(url, store, keys, limits=Limits(least=1, most=8))
    try:
        seen = []
        for _ in range(4):
            await act.add("aggregated", [], "forged")
            seen.append(api.replicas["vllm"])
    finally:
        await act.aclose()
    assert seen == [5, 8, 8, 8]


async def test_a_changed_deployment_or_a_busy_api_server_is_read_again(apiserver: tuple[ApiServer, str],
                                                                      store: EtcdStore, keys: Keys) -> None:
    api, url = apiserver
    await register(store, keys, "vllm-a")
    await store.put(keys.scale_of("aggregated"), PoolRecord("aggregated", asked={"x-w0": "x"},
                                                            members=["vllm-a"]).to_json())
    api.replicas["vllm"], api.versions["vllm"] = 1, 1
    act = actuator_for(url, store, keys)
    try:
        api.fail_next = [503]  # the GET: the API server is busy
        await act.add("aggregated", [NewWorker("x-w0", "x")], "up")
        api.versions["vllm"] = 7  # someone else changed it after our read: the PATCH's resourceVersion is stale
        api.replicas["vllm"] = 1
        api.fail_next = [409]
        await act.add("aggregated", [NewWorker("x-w0", "x")], "up")
    finally:
        await act.aclose()
    assert api.replicas["vllm"] == 2
    assert [c.method for c in api.calls] == ["GET", "GET", "PATCH", "GET", "GET", "PATCH"]


async def test_a_missing_rbac_verb_and_a_missing_deployment_are_named(apiserver: tuple[ApiServer, str],
                                                                     store: EtcdStore, keys: Keys) -> None:
    api, url = apiserver
    await store.put(keys.scale_of("aggregated"), PoolRecord("aggregated", asked={"x-w0": "x"}).to_json())
    api.replicas["vllm"] = 0  # one worker asked for, none there: a patch to 1 is due
    act = actuator_for(url, store, keys)
    try:
        api.forbidden = {"patch"}
        with pytest.raises(ActuationError) as refused:
            await act.add("aggregated", [NewWorker("x-w0", "x")], "up")
        said = str(refused.value)
        assert "HTTP 403" in said and "verb patch on resource deployments/scale (apiGroup apps)" in said
        assert f"namespace {NS}" in said and "cannot patch resource" in said, said
        api.forbidden = {"get"}
        with pytest.raises(ActuationError, match="allows verb get on resource deployments/scale"):
            await act.add("aggregated", [NewWorker("x-w0", "x")], "up")
        api.forbidden = set()
        wrong = KubernetesActuator(KubernetesScaleConfig(deployments={"aggregated": "nope"}), NS, client_for(url),
                                   store=store, keys=keys, admin_token="admin", limits=ROOMY)
        try:
            with pytest.raises(ActuationError) as missing:
                await wrong.add("aggregated", [NewWorker("x-w0", "x")], "up")
        finally:
            await wrong.aclose()
        assert (f"the Deployment nope (autoscale.kubernetes.deployments.aggregated) does not exist in namespace {NS}"
                in str(missing.value))
        with pytest.raises(ActuationError, match="no Deployment is set for pool decode"):
            await act.add("decode", [NewWorker("x-w0", "x")], "up")
    finally:
        await act.aclose()
    assert len(api.patches()) == 1 and api.replicas["vllm"] == 0, "the refused patch was not tried again"
    assert sum(c.path.endswith("/nope/scale") for c in api.calls) == 1, "nor the 404"


async def test_the_kubeconfig_is_the_fallback_outside_a_pod(apiserver: tuple[ApiServer, str], store: EtcdStore,
                                                            keys: Keys, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    api, url = apiserver
    kubeconfig = {"apiVersion": "v1", "kind": "Config", "current-context": "t",
                  "clusters": [{"name": "c", "cluster": {"server": url}}],
                  "users": [{"name": "u", "user": {"token": TOKEN}}],
                  "contexts": [{"name": "t", "context": {"cluster": "c", "user": "u"}}]}
    (tmp_path / "kubeconfig").write_text(json.dumps(kubeconfig))
    (tmp_path / "namespace").write_text(NS + "\n")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod
    api.replicas["vllm"] = 0
    await store.put(keys.scale_of("aggregated"), PoolRecord("aggregated", asked={"x-w0": "x"}).to_json())
    act = await open_kubernetes_actuator(KubernetesScaleConfig(), store=store, keys=keys, admin_token="admin",
                                         limits=ROOMY, kubeconfig=tmp_path / "kubeconfig",
                                         namespace_file=tmp_path / "namespace")
    try:
        assert act.namespace == NS
        await act.add("aggregated", [NewWorker("x-w0", "x")], "up")
    finally:
        await act.aclose()
    assert api.replicas["vllm"] == 1 and api.calls[0].authorization == f"Bearer {TOKEN}"


def test_without_the_kubernetes_extra_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kubernetes_asyncio", None)  # what an import of a missing package does
    with pytest.raises(ConfigError, match=r"pip install 'fleetward\[kubernetes\]'") as err:
        kubernetes_client()
    assert err.value.field == "autoscale.actuator" and INSTALL_HINT in str(err.value)
    # ... and a fleet that scales locally never imports it.
    probe = "import sys, fleetward.autoscale.daemon; assert 'kubernetes_asyncio' not in sys.modules"
    subprocess.run([sys.executable, "-c", probe], check=True, env={"PYTHONSAFEPATH": "1"})


# -- the drain, through a real supervisor controller --------------------------------------------------------


@pytest.fixture
def sim_config() -> SimConfig:
    return SimConfig(decode_step_ms=15.0, seed=5)


async def test_scale_down_drains_first_and_lowers_the_replicas_after_the_drain_ended(
        apiserver: tuple[ApiServer, str], fleet: TestFleet, wait_until: Any) -> None:
    api, url = apiserver
    api.replicas["vllm"] = 1
    wid = "node-w0"
    leader = await wait_until(lambda: read_leader(fleet.store, fleet.keys), timeout=30, message="a controller leads")

    async def in_flight() -> int:
        async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
            body = (await client.get(leader.url + "/v1/fleet")).json()
        return int(next((w["in_flight"] for w in body["workers"] if w["id"] == wid), 0))

    async def health() -> HealthRecord | None:
        return (await read_fleet(fleet.store, fleet.keys)).health.get(wid)

    await wait_until(lambda: _state_is(health, HealthState.READY), timeout=60, message="the worker serves")
    streaming = asyncio.create_task(stream_completion(fleet.routers[0].url, [5, 6, 7], 300, model="sim-tiny"))
    act = KubernetesActuator(KubernetesScaleConfig(namespace=NS), NS, client_for(url), store=fleet.store,
                             keys=fleet.keys, admin_token=fleet.admin_token, limits=ROOMY)
    try:
        await wait_until(lambda: _positive(in_flight), timeout=30, message="the controller counts the stream")
        await act.retire("aggregated", [wid], 60.0, "down")
        h = await health()
        assert h is not None and h.state is HealthState.DRAINING and h.extra["drain"]["then"] == "cordon"
        assert h.extra["drain"]["deadline"] is not None, "its stream still runs: the drain has not ended"
        assert not api.patches() and api.replicas["vllm"] == 1, "no replica is taken while the drain runs"
        await act.retire("aggregated", [wid], 60.0, "down: asked again")  # the daemon's next interval
        assert not api.patches()

        got = await asyncio.wait_for(streaming, 60)
        assert len(got.tokens) == 300, "the drain let the stream finish"
        await wait_until(lambda: _drained(health), timeout=30, message="the drain ended")
        await act.retire("aggregated", [wid], 60.0, "down: asked again")
        assert api.replicas["vllm"] == 0 and len(api.patches()) == 1
        assert api.patches()[0].body["spec"] == {"replicas": 0}
        await act.retire("aggregated", [wid], 60.0, "down: asked again")  # its pod is still going: no second patch
        assert len(api.patches()) == 1
    finally:
        streaming.cancel()
        await act.aclose()


async def _state_is(health: Any, state: HealthState) -> bool:
    h = await health()
    return h is not None and h.state is state


async def _positive(count: Any) -> bool:
    return bool(await count() > 0)


async def _drained(health: Any) -> bool:
    return drain_ended(await health())
