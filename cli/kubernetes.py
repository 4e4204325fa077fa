"""``fleetward deploy kubernetes``: Kubernetes manifests generated from a fleet file.

One YAML file per concern, and a ``kustomization.yaml`` that lists them, so ``kubectl apply -k DIR`` installs
the controller, the routers and the autoscaler beside the vLLM Deployments you already run. Each of those
Deployments gets the node agent as a sidecar through a strategic-merge patch (``sidecar-<deployment>.yaml``,
applied with ``kubectl patch``, not by the kustomization: the Deployment is yours). The observability objects
come from :mod:`fleetward.cli.kubeobserve`, from the rules and dashboards in runbooks/ (no second copy).

Secrets: no value is ever generated, put in a ConfigMap or on a command line. The admin token reaches every
container as ``FLEETWARD_ADMIN_TOKEN`` from the Secret ``fleetward-secrets``. A secret *file* the fleet file
names (API keys, passwords, TLS keys) is copied at start by an init container from its Secret into an
in-memory volume, mode 0400 and owned by the container's user: fleetward refuses a secret file others can
read, and Kubernetes cannot give a Secret's file to a non-root user at 0400 (``fsGroup`` makes it 0440).

The output is a function of the fleet file and the options alone (keys sorted, a fixed order of objects), so
``python -m fleetward.cli.kubernetes --write`` regenerates deploy/kubernetes/manifests/ from
deploy/kubernetes/fleet.yaml and a test fails when the two disagree.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from fleetward.fleet.config import FleetConfig, load_model, parse_yaml, read_text
from fleetward.fleet.errors import ConfigError

__all__ = [
    "CREDENTIALS_DIR",
    "DEFAULT_IMAGE",
    "EXAMPLE",
    "OUT",
    "Options",
    "add_parser",
    "generate",
    "main",
    "render",
    "run",
    "write",
]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "deploy" / "kubernetes" / "fleet.yaml"
OUT = ROOT / "deploy" / "kubernetes" / "manifests"
DEFAULT_IMAGE = "ghcr.io/fleetward/fleetward:0.1.0"  # not published: build it (docs/deploy.md, Kubernetes)

CONFIG_DIR = "/etc/fleetward"            # the ConfigMap fleetward-config
CREDENTIALS_DIR = "/run/fleetward/credentials"  # secret files, copied from their Secrets at start
SECRETS_DIR = "/run/fleetward/secrets"   # the Secrets themselves, mounted in the init container only
RUN_DIR = "/var/lib/fleetward"           # run_dir: an emptyDir
PROCESS_MATCH = "vllm serve|vllm.entrypoints.openai.api_server"
SERVICE_USER = 10001                     # controller, router, autoscaler: any user without a home will do
DEFAULT_PORTS = {"routing": 9000, "supervisor": 9100, "agent": 9200, "autoscale": 9300}
CONFIGMAP_LIMIT = 1024 * 1024            # what etcd takes as one object, the ConfigMap's limit


@dataclass(frozen=True)
class Options:
    """What the command line adds to the fleet file."""

    config: str                          # the fleet file, as given (it is named in every file's header)
    path: Path | None = None             # where to read it, when not at ``config`` from here
    namespace: str | None = None         # default: autoscale.kubernetes.namespace, else "default"
    image: str = DEFAULT_IMAGE
    routers: int = 2
    vllm_port: int = 8000
    vllm_user: int = 0                   # the vLLM container's user (vllm/vllm-openai runs as root)
    prometheus_namespace: str = "monitoring"
    trial_infra: bool = False

    def command(self) -> str:
        """The command line these options are, for the headers."""
        words = ["fleetward deploy kubernetes --config", self.config]
        default = Options(config=self.config)
        for name, flag in (("namespace", "--namespace"), ("image", "--image"), ("routers", "--routers"),
                           ("vllm_port", "--vllm-port"), ("vllm_user", "--vllm-user"),
                           ("prometheus_namespace", "--prometheus-namespace")):
            if getattr(self, name) != getattr(default, name):
                words += [flag, str(getattr(self, name))]
        if self.trial_infra:
            words.append("--trial-infra")
        return " ".join(words)


@dataclass(frozen=True)
class Credential:
    """A secret file of the fleet file: the Secret key it comes from, and its name in CREDENTIALS_DIR."""

    field: str       # routing.api_keys_file, etcd_access.key_file, ...
    secret: str
    key: str
    file: str

    @property
    def path(self) -> str:
        return f"{CREDENTIALS_DIR}/{self.file}"


@dataclass
class Plan:
    """The fleet file read, and what the manifests are made of."""

    config: FleetConfig
    raw: dict[str, Any]
    options: Options
    namespace: str
    ports: dict[str, int]
    credentials: list[Credential]
    env_secrets: list[tuple[str, str]]   # (environment variable, key of fleetward-secrets)
    extra_files: dict[str, str] = field(default_factory=dict)  # ConfigMap key -> text (capacity files)

    @property
    def instance(self) -> str:
        return self.config.cluster

    @property
    def deployments(self) -> dict[str, str]:
        return dict(sorted(self.config.autoscale.kubernetes.deployments.items()))


# -- the fleet file -------------------------------------------------------------------------------------


def _credentials(config: FleetConfig) -> tuple[list[Credential], list[tuple[str, str]]]:
    files: list[Credential] = []
    env = [("FLEETWARD_ADMIN_TOKEN", "admin-token")]
    for link in ("etcd", "mqtt"):
        access = getattr(config, f"{link}_access")
        tls = f"fleetward-{link}-tls"
        for name, key in (("ca_file", "ca.crt"), ("cert_file", "tls.crt"), ("key_file", "tls.key")):
            if getattr(access, name) is not None:
                files.append(Credential(f"{link}_access.{name}", tls, key, f"{link}-{key}"))
        if access.password_file is not None:
            files.append(Credential(f"{link}_access.password_file", "fleetward-secrets", f"{link}-password",
                                    f"{link}-password"))
        if access.password_env is not None:
            env.append((access.password_env, f"{link}-password"))
    if config.routing.api_keys_file is not None:
        files.append(Credential("routing.api_keys_file", "fleetward-secrets", "api-keys.yaml", "api-keys.yaml"))
    return files, env


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *sections, leaf = dotted.split(".")
    at = data
    for section in sections:
        inner = at.get(section)
        at[section] = at = dict(inner) if isinstance(inner, Mapping) else {}
    if value is None:
        at.pop(leaf, None)
    else:
        at[leaf] = value


def _capacity_files(config: FleetConfig, source: Path) -> dict[str, tuple[str, str]]:
    """field -> (ConfigMap key, text) of the capacity files the autoscaler reads, as they are now."""
    found: dict[str, tuple[str, str]] = {}
    for name in ("capacity", "prefill_capacity", "decode_capacity"):
        given = getattr(config.autoscale, name)
        if given is None:
            continue
        path = given if given.is_absolute() else source.parent / given
        if not path.is_file():
            raise ConfigError(f"{given}: no such file here (the ConfigMap carries it to the autoscaler)",
                              file=str(source), field=f"autoscale.{name}")
        found[name] = (f"{name.replace('_', '-')}{path.suffix}", read_text(path))
    return found


def plan(options: Options) -> Plan:
    """Read the fleet file with the project's loader (errors name its file, line and field) and decide."""
    source = options.path or Path(options.config)
    config = load_model(FleetConfig, source)
    raw, _ = parse_yaml(read_text(source), file=str(source))
    pools = config.autoscale.kubernetes.namespace
    namespace = options.namespace or pools or "default"
    if pools is not None and pools != namespace:
        raise ConfigError(f"the vLLM Deployments are in {pools}, fleetward would go to {namespace}: the "
                          "sidecars mount fleetward's ConfigMap, so both live in one namespace",
                          file=str(source), field="autoscale.kubernetes.namespace")
    ports = {"routing": config.routing.port, "supervisor": config.supervisor.port,
             "agent": config.supervisor.agent_metrics_port or 0, "autoscale": config.autoscale.port}
    ports = {k: v or DEFAULT_PORTS[k] for k, v in ports.items()}
    if options.vllm_port in ports.values():
        raise ConfigError(f"--vllm-port {options.vllm_port} is also one of fleetward's ports {sorted(ports.values())}",
                          field="--vllm-port")
    credentials, env = _credentials(config)
    if options.trial_infra:  # the trial's etcd and broker speak plain text, without users
        credentials = [c for c in credentials if c.field == "routing.api_keys_file"]
        env = env[:1]
    p = Plan(config, dict(raw), options, namespace, ports, credentials, env)
    p.extra_files = {key: text for key, text in _capacity_files(config, source).values()}
    return p


def _pod_fleet(p: Plan) -> dict[str, Any]:
    """The fleet file of the controller, the routers and the autoscaler (fleet.yaml of the ConfigMap)."""
    data = dict(p.raw)
    for key in ("attach", "node", "advertise_host", "admin_token_file", "etcd_port", "mqtt_port", "etcd_host",
                "mqtt_host", "tls", "router", "controller"):
        data.pop(key, None)
    data.update(workers=0, backend="vllm", run_dir=RUN_DIR, host="0.0.0.0")
    if p.options.trial_infra:
        data.update(etcd="fleetward-etcd:2379", mqtt="fleetward-mosquitto:1883")
        data.pop("etcd_access", None)
        data.pop("mqtt_access", None)
    for credential in p.credentials:
        _set(data, credential.field, credential.path)
    for section, port in (("routing", "routing"), ("supervisor", "supervisor"), ("autoscale", "autoscale")):
        _set(data, f"{section}.host", "0.0.0.0")
        _set(data, f"{section}.port", p.ports[port])
    _set(data, "supervisor.agent_metrics_port", p.ports["agent"])
    _set(data, "autoscale.actuator", "kubernetes")
    _set(data, "autoscale.kubernetes.namespace", p.namespace)
    _set(data, "prometheus.enabled", False)
    for name in ("capacity", "prefill_capacity", "decode_capacity"):
        if getattr(p.config.autoscale, name) is not None:
            _set(data, f"autoscale.{name}", f"{CONFIG_DIR}/{name.replace('_', '-')}"
                 f"{Path(str(getattr(p.config.autoscale, name))).suffix}")
    return data


def _agent_fleet(p: Plan, role: str) -> dict[str, Any]:
    """The sidecar agent's fleet file for the pods of one pool: its one attach entry is the pod's vLLM."""
    data = _pod_fleet(p)
    data["attach"] = [{"url": f"http://127.0.0.1:{p.options.vllm_port}", "role": role,
                       "process": {"match": PROCESS_MATCH}, "restart_by_exit": True}]
    # A pod never comes back: its agent, on its way out, gives the server up and leaves no dead worker behind.
    data["attach_lifetime"] = "agent"
    return data


_FLEET_HEADER = """\
# {what}, generated by
#   {command}
# Do not edit: change {config} and generate again.
# Each service binds its pod's IP (--host $(POD_IP) on its command line), the address it registers in etcd;
# the hosts below are what `kubectl exec ... fleetward ...` commands read. Secret files are under
# {credentials} (copied from their Secrets at start); the admin token is FLEETWARD_ADMIN_TOKEN.
"""


def _fleet_text(p: Plan, data: dict[str, Any], what: str) -> str:
    header = _FLEET_HEADER.format(what=what, command=p.options.command(), config=p.options.config,
                                  credentials=CREDENTIALS_DIR)
    return header + _dump(data)


def fleet_files(p: Plan) -> dict[str, str]:
    """ConfigMap key -> text: fleet.yaml, agent-<pool>.yaml for each pool's sidecars, capacity files."""
    files = {"fleet.yaml": _fleet_text(p, _pod_fleet(p), "The fleet file of fleetward's pods")}
    for role in p.deployments:
        files[f"agent-{role}.yaml"] = _fleet_text(p, _agent_fleet(p, role), f"The {role} pool's sidecar agents' "
                                                  "fleet file")
    files.update(sorted(p.extra_files.items()))
    return files


# -- building blocks ------------------------------------------------------------------------------------


def labels(p: Plan, component: str) -> dict[str, str]:
    return {**selector(p, component), "app.kubernetes.io/part-of": "fleetward",
            "app.kubernetes.io/managed-by": "fleetward"}


def selector(p: Plan, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "fleetward", "app.kubernetes.io/instance": p.instance,
            "app.kubernetes.io/component": component}


def meta(p: Plan, name: str, component: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "namespace": p.namespace, "labels": labels(p, component), **extra}


# The label the sidecar patch puts on each vLLM pod: what the NetworkPolicy and the PodMonitors select.
WORKER_LABEL = "fleetward/worker"


def _env(p: Plan) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "HOME", "value": "/tmp"},
    ]
    env += [{"name": var, "valueFrom": {"secretKeyRef": {"name": "fleetward-secrets", "key": key}}}
            for var, key in p.env_secrets]
    return env


def _credentials_for(p: Plan, *, api_keys: bool) -> list[Credential]:
    return [c for c in p.credentials if api_keys or c.field != "routing.api_keys_file"]


def _secret_volumes(p: Plan, credentials: list[Credential]) -> list[dict[str, Any]]:
    volumes = []
    for secret in sorted({c.secret for c in credentials}):
        items = [{"key": c.key, "path": c.key} for c in credentials if c.secret == secret]
        # 0444: the init container, running as the service's user, reads them; nothing else mounts them.
        volumes.append({"name": secret, "secret": {"secretName": secret, "defaultMode": 0o444,
                                                   "items": sorted(items, key=lambda i: i["key"])}})
    return volumes


def _init_credentials(p: Plan, credentials: list[Credential], security: dict[str, Any]) -> dict[str, Any]:
    copies = "".join(f"cp -L {SECRETS_DIR}/{c.secret}/{c.key} {c.path}\n" for c in credentials)
    return {
        "name": "fleetward-credentials",
        "image": p.options.image,
        "command": ["sh", "-c", f"set -e\numask 077\n{copies}"],
        "securityContext": security,
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
        "volumeMounts": [{"name": "fleetward-credentials", "mountPath": CREDENTIALS_DIR},
                         *({"name": s, "mountPath": f"{SECRETS_DIR}/{s}", "readOnly": True}
                           for s in sorted({c.secret for c in credentials}))],
    }


def _restricted(user: int) -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": user, "runAsGroup": user, "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}}


def _probe(path: str, port: int, *, period: int = 10, failures: int = 3) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "timeoutSeconds": 3,
            "failureThreshold": failures}


def _files(p: Plan, credentials: list[Credential], security: dict[str, Any], *, tmp: str
           ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """A fleetward container's mounts, the pod's volumes for them and its init containers: the ConfigMap, the run
    dir, ``/tmp`` (the volume named ``tmp``) and, when it reads secret files, their in-memory copy with the init
    container that makes it."""
    mounts: list[dict[str, Any]] = [
        {"name": "fleetward-config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "fleetward-run", "mountPath": RUN_DIR}, {"name": tmp, "mountPath": "/tmp"}]
    volumes: list[dict[str, Any]] = [
        {"name": "fleetward-config", "configMap": {"name": "fleetward-config"}},
        {"name": "fleetward-run", "emptyDir": {}}, {"name": tmp, "emptyDir": {}}]
    init = []
    if credentials:
        mounts.append({"name": "fleetward-credentials", "mountPath": CREDENTIALS_DIR, "readOnly": True})
        volumes += [{"name": "fleetward-credentials", "emptyDir": {"medium": "Memory", "sizeLimit": "4Mi"}},
                    *_secret_volumes(p, credentials)]
        init.append(_init_credentials(p, credentials, security))
    return mounts, volumes, init


def _pod(p: Plan, component: str, container: dict[str, Any], *, api_keys: bool = False,
         service_account: str | None = None, grace_s: int = 30) -> dict[str, Any]:
    """A pod template of one of fleetward's own services."""
    credentials = _credentials_for(p, api_keys=api_keys)
    security = _restricted(SERVICE_USER)
    mounts, volumes, init = _files(p, credentials, security, tmp="tmp")
    env = [*_env(p), {"name": "FLEETWARD_CONFIG", "value": f"{CONFIG_DIR}/fleet.yaml"}]  # for `kubectl exec`
    container = {"image": p.options.image, "command": ["fleetward"], "env": env, "securityContext": security,
                 "volumeMounts": mounts, **container}
    spec: dict[str, Any] = {
        "serviceAccountName": service_account or f"fleetward-{component}",
        "automountServiceAccountToken": service_account is not None,
        "terminationGracePeriodSeconds": grace_s,
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": volumes,
        # Spread the replicas over nodes, so that losing one leaves a leader or a router standing.
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "ScheduleAnyway",
                                       "labelSelector": {"matchLabels": selector(p, component)}}],
    }
    if init:
        spec["initContainers"] = init
    return {"metadata": {"labels": labels(p, component)}, "spec": spec}


def _deployment(p: Plan, component: str, replicas: int, template: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(p, f"fleetward-{component}", component),
            "spec": {"replicas": replicas, "selector": {"matchLabels": selector(p, component)},
                     # One new pod up before an old one goes: a standby takes the lead, a router the traffic.
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                     "template": template}}


def _pdb(p: Plan, component: str, **budget: int) -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": meta(p, f"fleetward-{component}", component),
            "spec": {**budget, "selector": {"matchLabels": selector(p, component)}}}


def _args(command: str) -> list[str]:
    return [command, "--config", f"{CONFIG_DIR}/fleet.yaml", "--host", "$(POD_IP)", "--id", "$(POD_NAME)"]


# -- the services ---------------------------------------------------------------------------------------


def controller(p: Plan) -> list[dict[str, Any]]:
    port = p.ports["supervisor"]
    container = {
        "name": "controller", "args": _args("controller"),
        "ports": [{"name": "control", "containerPort": port}],
        # /health: 200 while the process serves, leader or standby (supervisor/api.py).
        "readinessProbe": _probe("/health", port), "livenessProbe": _probe("/health", port),
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
    }
    return [_deployment(p, "controller", 2, _pod(p, "controller", container)),
            _pdb(p, "controller", minAvailable=1)]


def router(p: Plan) -> list[dict[str, Any]]:
    port = p.ports["routing"]
    processes = p.config.routing.processes
    drain = math.ceil(p.config.routing.drain_timeout_s)
    container = {
        "name": "router", "args": _args("router"),
        "ports": [{"name": "http", "containerPort": port}],
        # /health is 503 once SIGTERM stopped new requests: the pod leaves the Service while its streams finish.
        "readinessProbe": _probe("/health", port, period=5, failures=1),
        # Liveness outlasts the drain (routing.drain_timeout_s), or it would cut the streams it lets finish.
        "livenessProbe": _probe("/health", port, failures=max(3, math.ceil((drain + 30) / 10))),
        # Ending the pod waits a little first, for the Service's endpoints to drop it.
        "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
        "resources": {"requests": {"cpu": f"{500 * processes}m", "memory": f"{512 * processes}Mi"},
                      "limits": {"memory": f"{2 * processes}Gi"}},
    }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": meta(p, "fleetward-router", "router"),
               "spec": {"type": "ClusterIP", "selector": selector(p, "router"),
                        "ports": [{"name": "http", "port": port, "targetPort": "http"}]}}
    template = _pod(p, "router", container, api_keys=True, grace_s=drain + 15)
    return [_deployment(p, "router", p.options.routers, template), service,
            _pdb(p, "router", maxUnavailable=1)]


def autoscaler(p: Plan) -> list[dict[str, Any]]:
    port = p.ports["autoscale"]
    container = {
        "name": "autoscaler", "args": _args("autoscaler"),
        "ports": [{"name": "metrics", "containerPort": port}],
        "readinessProbe": _probe("/health", port), "livenessProbe": _probe("/health", port),
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
    }
    # The only pod with a token for the API server: its Role allows the scale of the pools' Deployments only.
    template = _pod(p, "autoscaler", container, service_account="fleetward-autoscaler")
    return [_deployment(p, "autoscaler", 2, template), _pdb(p, "autoscaler", minAvailable=1)]


def rbac(p: Plan) -> list[dict[str, Any]]:
    accounts = [{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(p, f"fleetward-{c}", c),
                 "automountServiceAccountToken": c == "autoscaler"} for c in ("autoscaler", "controller", "router")]
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": meta(p, "fleetward-autoscaler", "autoscaler"),
            "rules": [{"apiGroups": ["apps"], "resources": ["deployments/scale"],
                       "resourceNames": sorted(set(p.deployments.values())), "verbs": ["get", "patch"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": meta(p, "fleetward-autoscaler", "autoscaler"),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "fleetward-autoscaler"},
               "subjects": [{"kind": "ServiceAccount", "name": "fleetward-autoscaler", "namespace": p.namespace}]}
    return [*accounts, role, binding]


def configmap(p: Plan) -> list[dict[str, Any]]:
    data = fleet_files(p)
    size = sum(len(v.encode()) for v in data.values())
    if size > CONFIGMAP_LIMIT:
        raise ConfigError(f"the ConfigMap fleetward-config would hold {size:,} bytes, over Kubernetes' 1 MiB",
                          file=p.options.config)
    return [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(p, "fleetward-config", "config"),
             "data": data}]


def sidecar_patch(p: Plan, role: str, deployment: str) -> dict[str, Any]:
    """The strategic-merge patch that puts the agent beside the vLLM container of ``deployment``'s pods."""
    port = p.ports["agent"]
    credentials = _credentials_for(p, api_keys=False)
    # The agent ends vLLM's process tree to restart it (restart_by_exit: the kubelet starts the container
    # again) and reads its /proc. It runs as root with every capability dropped but KILL (signal another
    # user's process) and SYS_PTRACE (read another user's /proc/<pid>): a capability added to a non-root
    # container never reaches its process (Kubernetes sets no ambient capabilities), and as vLLM's own
    # user it would still need every capability vLLM holds to read its /proc.
    security = {"runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"], "add": ["KILL", "SYS_PTRACE"]}}
    if p.options.vllm_user != 0:  # the same user as vLLM: signals and /proc need no capability but ptrace's
        security = {**security, "runAsUser": p.options.vllm_user, "runAsNonRoot": True,
                    "capabilities": {"drop": ["ALL"]}}
    # Named apart from the volumes of the vLLM pod the patch goes into.
    mounts, volumes, init = _files(p, credentials, security, tmp="fleetward-tmp")
    agent = {
        "name": "fleetward-agent", "image": p.options.image, "command": ["fleetward"],
        # Kubernetes expands $(POD_NAME) and $(POD_IP) from the environment below.
        "args": ["agent", "--config", f"{CONFIG_DIR}/agent-{role}.yaml", "--node", "$(POD_NAME)",
                 "--advertise-host", "$(POD_IP)"],
        "env": [*_env(p), {"name": "FLEETWARD_CONFIG", "value": f"{CONFIG_DIR}/agent-{role}.yaml"}],
        "ports": [{"name": "fleetward", "containerPort": port}],
        # /ready is 503 once the autoscaler retired this pod's vLLM worker and its drain is over: the pod turns
        # NotReady, and a ReplicaSet scaled down deletes NotReady pods first, so the worker the autoscaler
        # drained is the one that goes. /health: the agent's process serves.
        "readinessProbe": _probe("/ready", port, period=5, failures=1),
        "livenessProbe": _probe("/health", port),
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}},
        "securityContext": security,
        "volumeMounts": mounts,
    }
    spec: dict[str, Any] = {
        # The agent sees vLLM's processes (exits at once, a frozen EngineCore) and can end them.
        "shareProcessNamespace": True,
        # A scale-down drains the worker first (autoscale.drain_deadline_s); the pod's end waits for it.
        "terminationGracePeriodSeconds": math.ceil(p.config.autoscale.drain_deadline_s) + 30,
        "containers": [agent],
        "volumes": volumes,
    }
    if init:
        spec["initContainers"] = init
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": deployment, "namespace": p.namespace},
            "spec": {"template": {"metadata": {"labels": {WORKER_LABEL: "true", "fleetward/pool": role}},
                                  "spec": spec}}}


def _fleetward_pods(p: Plan, *components: str) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "fleetward",
                                            "app.kubernetes.io/instance": p.instance},
                            "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                                                  "values": sorted(components)}]}}


def _tcp(*ports: int) -> list[dict[str, Any]]:
    return [{"port": port, "protocol": "TCP"} for port in ports]


def networkpolicies(p: Plan) -> list[dict[str, Any]]:
    """Ingress only (egress stays open: DNS, etcd, the broker, the API server are wherever you run them).
    Traffic from a pod's own node (the kubelet's probes) is always allowed."""
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name":
                                                        p.options.prometheus_namespace}}}
    workers = {"podSelector": {"matchLabels": {WORKER_LABEL: "true"}}}
    services = ("autoscaler", "controller", "router")
    agent, vllm = p.ports["agent"], p.options.vllm_port

    def policy(name: str, component: str, pods: dict[str, Any], ingress: list[dict[str, Any]]) -> dict[str, Any]:
        return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta(p, name, component),
                "spec": {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": ingress}}

    # The vLLM pods: routers send requests, the controller canaries and scrapes, the autoscaler reads load.
    # Nothing else reaches vLLM: put your own clients through the routers.
    to_workers = [{"from": [_fleetward_pods(p, *services), prometheus], "ports": _tcp(vllm, agent)}]
    if set(p.deployments) & {"prefill", "decode"}:  # prefill and decode workers hand KV to each other
        to_workers.append({"from": [workers]})
    policies = [
        policy("fleetward-workers", "agent", workers["podSelector"], to_workers),
        # Clients on the routers' port, from anywhere; fleetward and Prometheus on every port (with
        # routing.processes > 1 each process also serves its own metrics and progress on a port of its own).
        policy("fleetward-router", "router", {"matchLabels": selector(p, "router")},
               [{"ports": _tcp(p.ports["routing"])}, {"from": [_fleetward_pods(p, *services), prometheus]}]),
        # The control API (drain, restart, ...; the admin token guards it too): routers, the autoscaler, and
        # the controllers, where operators' commands run (`kubectl exec`; docs/deploy.md, Kubernetes).
        policy("fleetward-controller", "controller", {"matchLabels": selector(p, "controller")},
               [{"from": [_fleetward_pods(p, *services), prometheus],
                 "ports": _tcp(p.ports["supervisor"])}]),
        policy("fleetward-autoscaler", "autoscaler", {"matchLabels": selector(p, "autoscaler")},
               [{"from": [_fleetward_pods(p, "controller"), prometheus], "ports": _tcp(p.ports["autoscale"])}]),
    ]
    if p.options.trial_infra:
        for component, port in (("etcd", 2379), ("mqtt", 1883)):
            policies.append(policy(f"fleetward-{component}", component, {"matchLabels": selector(p, component)},
                                   [{"from": [_fleetward_pods(p, *services), workers], "ports": _tcp(port)}]))
    return policies


def secret_example(p: Plan) -> list[dict[str, Any]]:
    """The Secrets with placeholders, each key named: what `kubectl create secret` must be given."""
    keys: dict[str, dict[str, str]] = {"fleetward-secrets": {"admin-token": "REPLACE-ME"}}
    for _, key in p.env_secrets[1:]:
        keys["fleetward-secrets"][key] = "REPLACE-ME"
    for c in p.credentials:
        keys.setdefault(c.secret, {})[c.key] = f"REPLACE-ME: the file {c.field} names"
    return [{"apiVersion": "v1", "kind": "Secret", "metadata": meta(p, name, "secrets"), "type": "Opaque",
             "stringData": dict(sorted(data.items()))} for name, data in sorted(keys.items())]


ETCD_IMAGE = "gcr.io/etcd-development/etcd:v3.5.17"
MOSQUITTO_IMAGE = "eclipse-mosquitto:2"
_TRIAL = "for a trial only, not for production: one member, no TLS, no users"


def trial_infra(p: Plan) -> dict[str, tuple[str, list[dict[str, Any]]]]:
    """A one-member etcd and an anonymous Mosquitto (--trial-infra): the fleet files point at them."""
    peer = "http://$(POD_NAME).fleetward-etcd:2380"
    etcd = {
        "name": "etcd", "image": ETCD_IMAGE, "command": ["etcd"],
        "args": ["--name=$(POD_NAME)", "--data-dir=/var/lib/etcd/data", "--listen-client-urls=http://0.0.0.0:2379",
                 "--advertise-client-urls=http://$(POD_NAME).fleetward-etcd:2379",
                 "--listen-peer-urls=http://0.0.0.0:2380", f"--initial-advertise-peer-urls={peer}",
                 "--initial-cluster=fleetward-etcd-0=http://fleetward-etcd-0.fleetward-etcd:2380",
                 "--auto-compaction-mode=periodic", "--auto-compaction-retention=1h"],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"name": "client", "containerPort": 2379}, {"name": "peer", "containerPort": 2380}],
        "readinessProbe": _probe("/health", 2379), "livenessProbe": _probe("/health", 2379, failures=6),
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}],
    }
    statefulset = {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta(p, "fleetward-etcd", "etcd"),
        "spec": {"replicas": 1, "serviceName": "fleetward-etcd", "selector": {"matchLabels": selector(p, "etcd")},
                 "template": {"metadata": {"labels": labels(p, "etcd")},
                              "spec": {"securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                                                           "runAsNonRoot": True,
                                                           "seccompProfile": {"type": "RuntimeDefault"}},
                                       "automountServiceAccountToken": False, "containers": [etcd]}},
                 "volumeClaimTemplates": [{"metadata": {"name": "data"},
                                           "spec": {"accessModes": ["ReadWriteOnce"],
                                                    "resources": {"requests": {"storage": "8Gi"}}}}]}}
    headless = {"apiVersion": "v1", "kind": "Service", "metadata": meta(p, "fleetward-etcd", "etcd"),
                "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": selector(p, "etcd"),
                         "ports": [{"name": "client", "port": 2379}, {"name": "peer", "port": 2380}]}}
    conf = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(p, "fleetward-mosquitto", "mqtt"),
            "data": {"mosquitto.conf": f"# {_TRIAL}\nlistener 1883\nallow_anonymous true\npersistence false\n"}}
    mosquitto = {
        "name": "mosquitto", "image": MOSQUITTO_IMAGE, "ports": [{"name": "mqtt", "containerPort": 1883}],
        "readinessProbe": {"tcpSocket": {"port": 1883}, "periodSeconds": 10},
        "livenessProbe": {"tcpSocket": {"port": 1883}, "periodSeconds": 10},
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "conf", "mountPath": "/mosquitto/config", "readOnly": True}],
    }
    broker = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(p, "fleetward-mosquitto", "mqtt"),
        "spec": {"replicas": 1, "strategy": {"type": "Recreate"}, "selector": {"matchLabels": selector(p, "mqtt")},
                 "template": {"metadata": {"labels": labels(p, "mqtt")},
                              "spec": {"securityContext": {"runAsUser": 1883, "runAsGroup": 1883, "runAsNonRoot": True,
                                                           "seccompProfile": {"type": "RuntimeDefault"}},
                                       "automountServiceAccountToken": False, "containers": [mosquitto],
                                       "volumes": [{"name": "conf",
                                                    "configMap": {"name": "fleetward-mosquitto"}}]}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": meta(p, "fleetward-mosquitto", "mqtt"),
               "spec": {"selector": selector(p, "mqtt"), "ports": [{"name": "mqtt", "port": 1883}]}}
    return {"trial-etcd.yaml": (f"etcd, {_TRIAL}.", [headless, statefulset]),
            "trial-mosquitto.yaml": (f"Mosquitto, {_TRIAL}.", [conf, broker, service])}


def sidecar_removal(patch: dict[str, Any]) -> dict[str, Any]:
    """The strategic-merge patch that takes out what ``patch`` put in (uninstall)."""
    spec = patch["spec"]["template"]["spec"]
    undo: dict[str, Any] = {"shareProcessNamespace": None, "terminationGracePeriodSeconds": None}
    for key in ("containers", "initContainers", "volumes"):
        if key in spec:
            undo[key] = [{"name": item["name"], "$patch": "delete"} for item in spec[key]]
    labels = {key: None for key in patch["spec"]["template"]["metadata"]["labels"]}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": dict(patch["metadata"]),
            "spec": {"template": {"metadata": {"labels": labels}, "spec": undo}}}


# -- rendering ------------------------------------------------------------------------------------------


_MARK = "# Generated by `fleetward deploy kubernetes"


def _header(p: Plan, what: str) -> str:
    lines = textwrap.wrap(what, width=110)
    return ("".join(f"# {line}\n" for line in lines) + f"# Generated by `{p.options.command()}`.\n"
            f"# Do not edit by hand: change {p.options.config} (or the options) and generate again.\n")


class _Dumper(yaml.SafeDumper):
    """Block style, keys sorted, and a text of several lines (a fleet file, a dashboard) as a literal block."""


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _text)
_Dumper.ignore_aliases = lambda self, data: True  # type: ignore[method-assign]  # a manifest reads without anchors


def _dump(data: Any, *, sort_keys: bool = True) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=sort_keys, default_flow_style=False, width=110)


def _documents(objects: list[dict[str, Any]]) -> str:
    return "".join("---\n" + _dump(o) for o in objects)


def generate(options: Options) -> dict[str, tuple[str, list[dict[str, Any]]]]:
    """File name -> (what it holds, its objects), in the order the kustomization lists them."""
    return _generate(plan(options))


def _generate(p: Plan) -> dict[str, tuple[str, list[dict[str, Any]]]]:
    from fleetward.cli.kubeobserve import dashboards, monitoring

    options = p.options
    files: dict[str, tuple[str, list[dict[str, Any]]]] = {
        "config.yaml": ("The fleet files of fleetward's pods and of each pool's sidecar agents.", configmap(p)),
        "rbac.yaml": ("Service accounts; the autoscaler's Role: get and patch on the pools' deployments/scale, "
                      "nothing else.", rbac(p)),
        "controller.yaml": ("The supervisor controllers (leader-elected) and their disruption budget.", controller(p)),
        "router.yaml": ("The routers, their Service and their disruption budget.", router(p)),
        "autoscaler.yaml": ("The autoscalers (leader-elected) and their disruption budget.", autoscaler(p)),
        "networkpolicy.yaml": ("Who reaches what: clients the routers, fleetward the vLLM pods, Prometheus "
                               "every /metrics.", networkpolicies(p)),
        "monitoring.yaml": ("The alert rules (runbooks/alerts/fleetward.rules.yml) and the scrape targets, for "
                            "the Prometheus Operator.", monitoring(p)),
        "dashboards.yaml": ("The Grafana dashboards (runbooks/dashboards/), for Grafana's sidecar.", dashboards(p)),
    }
    if options.trial_infra:
        files.update(trial_infra(p))
    for role, deployment in p.deployments.items():
        patch = sidecar_patch(p, role, deployment)
        files[f"sidecar-{deployment}.yaml"] = (
            f"A strategic-merge patch of your Deployment {deployment} (the {role} pool): the agent sidecar. Not in "
            f"the kustomization: `kubectl patch deployment {deployment} -n {p.namespace} --patch-file "
            f"sidecar-{deployment}.yaml`.", [patch])
        files[f"sidecar-{deployment}.remove.yaml"] = (
            f"Takes the agent sidecar out of your Deployment {deployment} again (uninstall): `kubectl patch "
            f"deployment {deployment} -n {p.namespace} --patch-file sidecar-{deployment}.remove.yaml`; the grace "
            "period returns to Kubernetes' default (30 s).", [sidecar_removal(patch)])
    files["secret.example.yaml"] = (
        "The Secrets fleetward reads, with placeholders: not in the kustomization. Create them with `kubectl "
        "create secret` from your files instead (docs/deploy.md, Kubernetes).", secret_example(p))
    return files


def render(options: Options) -> dict[str, str]:
    """File name -> its text: every manifest and the kustomization."""
    p = plan(options)
    files = _generate(p)
    text = {name: _header(p, what) + _documents(objects) for name, (what, objects) in files.items()}
    resources = [n for n in files if not n.startswith(("sidecar-", "secret."))]
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "namespace": p.namespace, "resources": resources}
    text["kustomization.yaml"] = (_header(p, "`kubectl apply -k` this folder. The sidecar patches and the "
                                          "example Secret are applied apart.")
                                  + _dump(kustomization, sort_keys=False))
    return dict(sorted(text.items()))


def write(options: Options, out: Path) -> list[Path]:
    """Write the files into ``out`` (made if missing). A file an earlier run made that this one does not (a
    sidecar of a pool since removed) goes; any other file there is left alone."""
    files = render(options)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.yaml"):
        if old.name not in files and _MARK in old.read_text(errors="replace")[:1000]:
            old.unlink()
    written = []
    for name, text in files.items():
        (out / name).write_text(text)
        written.append(out / name)
    return written


# -- the command ----------------------------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    deploy = sub.add_parser("deploy", help="deployment files generated from a fleet file")
    kinds = deploy.add_subparsers(dest="deploy_command", required=True, metavar="TARGET")
    k = kinds.add_parser("kubernetes", help="Kubernetes manifests: controller, routers, autoscaler, the agent "
                         "sidecar patch of your vLLM Deployments, NetworkPolicies, monitoring (docs/deploy.md)")
    _add_options(k)


def _add_options(k: argparse.ArgumentParser) -> None:
    k.add_argument("--config", required=True, help="the fleet file (etcd, mqtt, routing, supervisor, autoscale)")
    k.add_argument("--out", type=Path, required=True, help="folder to write the manifests into")
    k.add_argument("--namespace", help="where fleetward and your vLLM Deployments run (default: "
                   "autoscale.kubernetes.namespace, else default)")
    k.add_argument("--image", default=DEFAULT_IMAGE, help=f"fleetward's container image (default {DEFAULT_IMAGE}; "
                   "build your own, docs/deploy.md)")
    k.add_argument("--routers", type=int, default=2, help="router replicas (default 2)")
    k.add_argument("--vllm-port", dest="vllm_port", type=int, default=8000, help="vLLM's port in its pods "
                   "(default 8000)")
    k.add_argument("--vllm-user", dest="vllm_user", type=int, default=0, help="the user vLLM's container runs as "
                   "(default 0, as vllm/vllm-openai); the agent sidecar runs as it")
    k.add_argument("--prometheus-namespace", dest="prometheus_namespace", default="monitoring",
                   help="the namespace of the Prometheus that scrapes fleetward (NetworkPolicy; default monitoring)")
    k.add_argument("--trial-infra", dest="trial_infra", action="store_true", help="also a one-member etcd and an "
                   "anonymous Mosquitto, for a trial (not for production)")


def _options(args: argparse.Namespace) -> Options:
    if not 1 <= args.routers <= 64:
        raise ConfigError(f"{args.routers}: between 1 and 64", field="--routers")
    if not 0 < args.vllm_port < 65536:
        raise ConfigError(f"{args.vllm_port}: not a port", field="--vllm-port")
    return Options(config=str(args.config), namespace=args.namespace, image=args.image, routers=args.routers,
                   vllm_port=args.vllm_port, vllm_user=args.vllm_user,
                   prometheus_namespace=args.prometheus_namespace, trial_infra=args.trial_infra)


def run(args: argparse.Namespace, out: Console, err: Console) -> int:
    options = _options(args)
    written = write(options, args.out)
    del err
    out.print(f"wrote {len(written)} files to {args.out}: `kubectl apply -k {args.out}`, then the sidecar "
              f"patch{'es' if sum(n.name.startswith('sidecar-') for n in written) > 1 else ''} "
              "(docs/deploy.md, Kubernetes)", highlight=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m fleetward.cli.kubernetes [--write]``: the example's manifests, printed or rewritten."""
    prog = argparse.ArgumentParser(prog="python -m fleetward.cli.kubernetes", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    prog.add_argument("--write", action="store_true", help=f"rewrite {OUT.relative_to(ROOT)}")
    args = prog.parse_args(argv)
    options = example_options()
    if not args.write:
        sys.stdout.write(json.dumps(sorted(render(options)), indent=1) + "\n")
        return 0
    for path in write(options, OUT):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


def example_options() -> Options:
    """The options deploy/kubernetes/manifests/ is generated with (the config as named from the repository)."""
    return Options(config=str(EXAMPLE.relative_to(ROOT)), path=EXAMPLE)


if __name__ == "__main__":
    raise SystemExit(main())
