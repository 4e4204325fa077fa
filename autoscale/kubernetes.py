"""The autoscaler's actuator on Kubernetes: each pool is a Deployment, scaled through its ``scale`` subresource.

Each vLLM pod of a pool's Deployment carries a fleetward agent sidecar that adopts the pod's server and
registers it as a worker of the pool (``workers/<pod>-127-0-0-1-8000``, ``node`` the pod's name). So:

- **add** raises ``spec.replicas``; the ReplicaSet names and places the new pods, and their sidecars register
  them. The ids the planner asked for are placeholders (``names_workers``): any new worker of the pool
  fulfils one (the daemon settles them so).
- **retire** drains each worker through the supervisor leader's control API first, as
  :class:`~fleetward.autoscale.actuate.LocalActuator` does, but ``then: cordon``: stopping the server of a pod
  would only make the kubelet restart it. Once a worker's drain has ended (``health/<id>``: ``draining``,
  ``cordoned``, its ``drain`` without a deadline), its sidecar's readiness probe fails and the pod is
  NotReady; then ``spec.replicas`` is lowered by the number of such retirees, and the ReplicaSet, which
  deletes NotReady pods before Ready ones on a scale-down, deletes those. The daemon calls ``retire`` again
  every interval for the retirees that have not gone yet, so a drain that ends later is finished then.

Two API calls only, on ``deployments/scale`` in the pools' namespace: ``get`` and ``patch`` (the Role in
docs/autoscale.md). No pod is read or written.

**Idempotency.** Nothing is ever added to or taken from the replicas relative to an earlier call: each call
computes the replicas from state that outlives the leader, etcd and the Deployment's own ``spec.replicas``:

- ``live``: workers of the pool registered now (``workers/``), not dead, and not a retiree whose drain ended;
- ``drained``: the registered workers an autoscaler retired whose drain ended (NotReady pods);
- ``asks``: the ids asked for and not fulfilled yet: ``asked`` in ``scale/<pool>`` (the daemon's fenced record,
  written before it acts) and those ``add`` is given, less the workers registered since the record's
  ``members`` (the pool's workers when the daemon decided), so a pod that registers between the decision and
  this call fulfils its ask here too.

Then (:func:`replicas_for`), with ``spec`` the Deployment's ``spec.replicas``:

- asks outstanding: ``max(spec, live + drained + asks)``: only up, the drained pods still counted (they are
  not taken away while new pods start, since a new pod is NotReady too and the ReplicaSet could pick it);
- none: ``min(spec, max(live, spec - drained))``: only down, by the drained retirees at most, never below
  the live workers.

Whatever the records say, the replicas stay within :class:`Limits`: the pool's ``min_workers`` and
``max_workers`` (plus the retirees whose pods are not gone yet), and up by at most double or 4 a call; etcd is
written by many hosts, and a record that asks for ten thousand pods is not a reason to start them.

So asking twice for the same workers, or a new leader asking again for what its predecessor asked, gives the
same number and no second patch; a retire called again after its patch finds ``spec`` already there. The
patch carries the ``resourceVersion`` it was computed from: a Deployment changed in between answers 409 and
the computation is done again. What is not exact: a scale-up asked in the seconds between a retiree's patch
and its pod's sidecar deregistering counts that retiree once more (one pod too many, which the planner
retires later), and a pod replaced by the ReplicaSet (evicted) registers as a new worker and fulfils an ask.

Tested against the client's request shapes and a local stand-in for the API server's endpoints
(``tests/autoscale/test_kubernetes_actuator.py``), never against a live API server.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tenacity import AsyncRetrying, RetryError, retry_if_exception, stop_after_attempt, wait_exponential

from fleetward.autoscale.actuate import ActuationError, ControlApi, NewWorker
from fleetward.autoscale.daemon import PoolRecord
from fleetward.fleet.config import KubernetesScaleConfig
from fleetward.fleet.errors import ConfigError
from fleetward.fleet.etcd import StateStore
from fleetward.fleet.keys import Keys
from fleetward.fleet.registry import FleetSnapshot, read_fleet
from fleetward.fleet.worker import HealthRecord, HealthState

__all__ = ["KubernetesActuator", "Limits", "PoolPods", "drain_ended", "open_kubernetes_actuator", "replicas_for"]

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
INSTALL_HINT = "pip install 'fleetward[kubernetes]'"
# kubectl scale's patch: a JSON merge patch of the Scale (the client would pick a strategic merge patch for a
# dict; the API server takes both on the scale subresource, and a merge patch is the plainest).
PATCH_CONTENT_TYPE = "application/merge-patch+json"
_TRANSIENT = frozenset({409, 429, 500, 502, 503, 504})  # 409: the Deployment changed since it was read


class _CallFailed(Exception):
    """A call to the API server failed: which verb (``get``, ``patch``), and the client's exception."""

    def __init__(self, verb: str, exc: BaseException) -> None:
        super().__init__(f"{verb}: {exc}")
        self.verb, self.exc = verb, exc


def kubernetes_client() -> Any:
    """``kubernetes_asyncio`` (the ``kubernetes`` extra), imported only by a fleet that scales on Kubernetes."""
    try:
        import kubernetes_asyncio
        import kubernetes_asyncio.client
        import kubernetes_asyncio.config
    except ImportError as exc:
        raise ConfigError(f"autoscale.actuator kubernetes needs the Kubernetes client: {INSTALL_HINT} ({exc})",
                          field="autoscale.actuator") from exc
    return kubernetes_asyncio


@dataclass(frozen=True, slots=True)
class PoolPods:
    """What a pool's replicas are computed from (module docstring)."""

    live: int
    drained: int
    asks: int


def replicas_for(spec: int, pods: PoolPods) -> int:
    """The Deployment's replicas for a pool now, given its ``spec.replicas`` (the rule in the module docstring)."""
    if pods.asks > 0:
        return max(spec, pods.live + pods.drained + pods.asks)
    return min(spec, max(pods.live, spec - pods.drained))


@dataclass(frozen=True, slots=True)
class Limits:
    """What no record in etcd makes the actuator go past, whoever wrote it: a pool's ``min_workers`` and
    ``max_workers`` (``autoscale``), and a step up of at most ``max(4, spec)`` replicas a call (double, or 4:
    the default scale-up policy of Kubernetes' HorizontalPodAutoscaler)."""

    least: int
    most: int

    def bound(self, spec: int, want: int, drained: int) -> int:
        """``want`` within the limits: at most ``most`` plus the drained retirees whose pods are not gone yet
        (themselves at most ``most``), up by the step at most, and never below ``least`` unless ``spec`` is."""
        if want > spec:
            want = min(want, self.most + min(drained, self.most), spec + max(_STEP_UP, spec))
        return max(want, min(spec, self.least))


_STEP_UP = 4


def drain_ended(health: HealthRecord | None) -> bool:
    """Whether ``health`` is a worker an autoscaler retired whose cordon drain has ended: its streams finished
    or moved, it is out of routing, and its pod is NotReady."""
    return health is not None and health.retired  # the same test as the sidecar's readiness (supervisor/agent.py)


def pool_pods(fleet: FleetSnapshot, pool: str, record: PoolRecord | None, asked: Sequence[str] = ()) -> PoolPods:
    registered = {w for w, r in fleet.workers.items() if r.role == pool}
    dead = {w for w in registered if (h := fleet.health.get(w)) is not None and h.state is HealthState.DEAD}
    drained = {w for w in registered if drain_ended(fleet.health.get(w))}
    live = registered - dead - drained
    asks = set(asked) | (set(record.asked) if record is not None else set())
    fresh = registered - dead - set(record.members) if record is not None else set()
    return PoolPods(live=len(live), drained=len(drained), asks=max(0, len(asks) - len(fresh)))


class KubernetesActuator:
    """Scales each pool's Deployment (``config.deployments``) in ``namespace`` through ``api_client`` (a
    ``kubernetes_asyncio`` ``ApiClient``: :func:`open_kubernetes_actuator` makes one from the pod's service
    account or a kubeconfig); drains through the supervisor leader's control API."""

    names_workers = True

    def __init__(self, config: KubernetesScaleConfig, namespace: str, api_client: Any, *, store: StateStore,
                 keys: Keys, admin_token: str, limits: Limits, attempts: int = 4, backoff_s: float = 0.2,
                 timeout_s: float = 10.0) -> None:
        k8s = kubernetes_client()
        self.config, self.namespace, self.limits = config, namespace, limits
        self.store, self.keys = store, keys
        self.api_client = api_client
        self._apps = k8s.client.AppsV1Api(api_client)
        self._api_exception: type[Exception] = k8s.client.exceptions.ApiException
        self.control = ControlApi(store, keys, admin_token, timeout_s=timeout_s)
        self._attempts, self._backoff_s, self._timeout_s = attempts, backoff_s, timeout_s

    async def aclose(self) -> None:
        try:
            await self.control.aclose()
        finally:
            await self.api_client.close()

    async def add(self, pool: str, workers: Sequence[NewWorker], reason: str) -> None:
        await self._scale(pool, [w.id for w in workers], reason)

    async def retire(self, pool: str, workers: Sequence[str], deadline_s: float, reason: str) -> None:
        fleet = await read_fleet(self.store, self.keys)
        for wid in workers:
            h = fleet.health.get(wid)
            if h is not None and h.state is HealthState.DRAINING:
                continue  # drained or draining already: only its pod is left to remove
            await self.control.drain(wid, deadline_s, "cordon")
            log.info("%s: draining %s within %.0f s, then cordoned (%s)", pool, wid, deadline_s, reason)
        await self._scale(pool, (), reason)

    # -- the scale subresource ----------------------------------------------------------------------------

    def _deployment(self, pool: str) -> str:
        name = next((n for p, n in self.config.deployments.items() if p == pool), None)
        if name is None:
            raise ActuationError(f"no Deployment is set for pool {pool}: add it to autoscale.kubernetes.deployments")
        return name

    async def _scale(self, pool: str, asked: Sequence[str], reason: str) -> None:
        name = self._deployment(pool)
        retrying = AsyncRetrying(stop=stop_after_attempt(self._attempts), reraise=False,
                                 wait=wait_exponential(multiplier=self._backoff_s, max=self._backoff_s * 8),
                                 retry=retry_if_exception(self._transient))
        try:
            async for attempt in retrying:
                with attempt:
                    await self._scale_once(pool, name, asked, reason)
        except RetryError as exc:
            cause = exc.last_attempt.exception()
            assert isinstance(cause, _CallFailed)
            raise self._translate(cause, pool, name, f"{self._attempts} attempts") from cause.exc
        except _CallFailed as exc:
            raise self._translate(exc, pool, name, "") from exc.exc

    async def _scale_once(self, pool: str, name: str, asked: Sequence[str], reason: str) -> None:
        kv = await self.store.get(self.keys.scale_of(pool))
        record = PoolRecord.from_json(kv.value) if kv is not None else None
        fleet = await read_fleet(self.store, self.keys)
        try:
            scale = await self._apps.read_namespaced_deployment_scale(name, self.namespace,
                                                                      _request_timeout=self._timeout_s)
        except (self._api_exception, *_connection_errors()) as exc:
            raise _CallFailed("get", exc) from exc
        spec = int(scale.spec.replicas or 0) if scale.spec is not None else 0
        pods = pool_pods(fleet, pool, record, asked)
        asked_for = replicas_for(spec, pods)
        want = self.limits.bound(spec, asked_for, pods.drained)
        if want != asked_for:
            log.warning("%s: the fleet's records ask for %d replicas of Deployment %s/%s; %d is as far as "
                        "min_workers %d, max_workers %d and the step allow from %d", pool, asked_for, self.namespace,
                        name, want, self.limits.least, self.limits.most, spec)
        if want == spec:
            return
        body = {"metadata": {"resourceVersion": scale.metadata.resource_version}, "spec": {"replicas": want}}
        try:
            await self._apps.patch_namespaced_deployment_scale(name, self.namespace, body,
                                                               _content_type=PATCH_CONTENT_TYPE,
                                                               _request_timeout=self._timeout_s)
        except (self._api_exception, *_connection_errors()) as exc:
            raise _CallFailed("patch", exc) from exc
        log.info("%s: Deployment %s/%s replicas %d -> %d (%d live, %d drained, %d asked; %s)", pool, self.namespace,
                 name, spec, want, pods.live, pods.drained, pods.asks, reason)

    def _transient(self, exc: BaseException) -> bool:
        if not isinstance(exc, _CallFailed):
            return False
        if isinstance(exc.exc, self._api_exception):
            return getattr(exc.exc, "status", None) in _TRANSIENT
        return True  # no answer: a connection refused or reset, a timeout

    def _translate(self, failed: _CallFailed, pool: str, name: str, tries: str) -> ActuationError:
        exc, verb = failed.exc, failed.verb
        where = f"Deployment {name} in namespace {self.namespace}"
        after = f" (after {tries})" if tries else ""
        if not isinstance(exc, self._api_exception):
            host = getattr(getattr(self.api_client, "configuration", None), "host", "?")
            return ActuationError(f"scaling pool {pool}: the Kubernetes API server at {host} did not answer the {verb} "
                                  f"of {where}{after}: {type(exc).__name__}: {exc}")
        status, why = getattr(exc, "status", None), _reason(exc)
        if status == 403:
            return ActuationError(
                f"scaling pool {pool}: the API server refused to {verb} deployments/scale of {where} (HTTP 403): the "
                f"autoscaler's service account needs a Role in namespace {self.namespace} that allows verb {verb} on "
                f"resource deployments/scale (apiGroup apps), bound to it (the Role: get and patch): {why}")
        if status == 404:
            return ActuationError(
                f"scaling pool {pool}: the Deployment {name} (autoscale.kubernetes.deployments.{pool}) does not exist "
                f"in namespace {self.namespace}: {why}")
        if status == 401:
            return ActuationError(f"scaling pool {pool}: the API server did not accept the autoscaler's credentials "
                                  f"(HTTP 401) on {where}: {why}")
        return ActuationError(f"scaling pool {pool}: the {verb} of {where}: HTTP {status}{after}: {why}")


def _connection_errors() -> tuple[type[BaseException], ...]:
    import aiohttp  # the client's transport

    return (aiohttp.ClientError, TimeoutError)


def _reason(exc: Any) -> str:
    """The API server's ``Status.message``, else the HTTP reason."""
    import json

    try:
        body = json.loads(exc.body or "{}")
    except (TypeError, ValueError):
        body = {}
    return str(body.get("message") or exc.reason or "")


def pod_namespace(path: Path = SERVICE_ACCOUNT_NAMESPACE) -> str:
    """The namespace of the pod this runs in, from its service account."""
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"the pools' namespace: not set, and not in a pod ({path}: {exc})",
                          field="autoscale.kubernetes.namespace") from exc


async def open_kubernetes_actuator(config: KubernetesScaleConfig, *, store: StateStore, keys: Keys,
                                   admin_token: str, limits: Limits, configuration: Any = None,
                                   kubeconfig: Path | None = None,
                                   namespace_file: Path = SERVICE_ACCOUNT_NAMESPACE) -> KubernetesActuator:
    """A :class:`KubernetesActuator` with the pod's service account (in-cluster), else ``kubeconfig`` (default:
    the client's, ``KUBECONFIG`` as the process started, else ``~/.kube/config``), unless a ``configuration`` (a
    ``kubernetes_asyncio`` ``Configuration``) is given. The namespace is ``config.namespace``, else the pod's own
    (``namespace_file``)."""
    k8s = kubernetes_client()
    if configuration is None:
        configuration = k8s.client.Configuration()
        try:
            k8s.config.load_incluster_config(client_configuration=configuration)
        except k8s.config.ConfigException as in_cluster:
            try:
                await k8s.config.load_kube_config(config_file=None if kubeconfig is None else str(kubeconfig),
                                                  client_configuration=configuration, persist_config=False)
            except (k8s.config.ConfigException, OSError) as exc:
                raise ConfigError(f"no Kubernetes credentials: not in a pod ({in_cluster}) and no kubeconfig ({exc})",
                                  field="autoscale.actuator") from exc
    namespace = config.namespace or pod_namespace(namespace_file)
    return KubernetesActuator(config, namespace, k8s.client.ApiClient(configuration), store=store, keys=keys,
                              admin_token=admin_token, limits=limits)
