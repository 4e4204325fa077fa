"""``fleetward deploy kubernetes``: the manifests checked in are the generator's, and what it makes is valid.

No API server runs here: built-in objects are validated offline with kubernetes-validate (the API's OpenAPI
schemas of one Kubernetes version, strict: an unknown field is an error), the Prometheus Operator's objects
with jsonschema against the CRDs vendored in k8s_schemas/ (README there). Then what the manifests mean: the
autoscaler's Role, the sidecar, the rules and dashboards from runbooks/, no secret in a ConfigMap or an
argument, and fleet files the project's own loader reads.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from fleetward.cli.kubeobserve import DASHBOARDS, RULES
from fleetward.cli.kubernetes import OUT, Options, example_options, render
from fleetward.cli.main import main
from fleetward.fleet.config import FleetConfig, load_model
from fleetward.fleet.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = Path(__file__).with_name("k8s_schemas")
KUBERNETES = "1.31.0"  # the oldest version the manifests need (a preStop sleep); kubernetes-validate bundles it
CRDS = {kind: SCHEMAS / f"monitoring.coreos.com_{kind.lower()}s.yaml"
        for kind in ("PrometheusRule", "ServiceMonitor", "PodMonitor")}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")
LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
SENTINEL = "s3cret-VALUE-never-in-a-manifest"

# A vLLM Deployment as a user runs it: what the sidecar patch is applied to.
VLLM: dict[str, Any] = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "vllm", "namespace": "inference"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "vllm"}},
                 "template": {"metadata": {"labels": {"app": "vllm"}},
                              "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0",
                                                       "args": ["--model", "Qwen/Qwen2.5-0.5B-Instruct"],
                                                       "ports": [{"containerPort": 8000}],
                                                       "resources": {"limits": {"nvidia.com/gpu": 1}}}],
                                       "volumes": [{"name": "cache", "emptyDir": {}}]}}}}


def documents(files: dict[str, str]) -> Iterator[tuple[str, dict[str, Any]]]:
    for name, text in files.items():
        if name != "kustomization.yaml":
            for doc in yaml.safe_load_all(text):
                yield name, doc


def checked_in() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(OUT.glob("*.yaml"))}


def objects(files: dict[str, str], kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in documents(files) if doc["kind"] == kind]


def merge(base: Any, patch: Any) -> Any:
    """A strategic merge as far as these patches need: maps merged, lists of named items merged by name."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = merge(base[key], value) if key in base else value
        return merged
    if isinstance(base, list) and isinstance(patch, list) and all(isinstance(i, dict) and "name" in i
                                                                   for i in base + patch):
        by_name = {i["name"]: i for i in base}
        for item in patch:
            by_name[item["name"]] = merge(by_name[item["name"]], item) if item["name"] in by_name else item
        return list(by_name.values())
    return patch


def crd_validator(kind: str) -> tuple[jsonschema.protocols.Validator, dict[str, Any]]:
    crd = yaml.safe_load(CRDS[kind].read_text())
    version = next(v for v in crd["spec"]["versions"] if v["storage"])
    return jsonschema.Draft4Validator(version["schema"]["openAPIV3Schema"]), crd


def validate_custom(doc: dict[str, Any]) -> None:
    """A Prometheus Operator object: its schema, and that its apiVersion and kind are the CRD's."""
    validator, crd = crd_validator(doc["kind"])
    version = next(v for v in crd["spec"]["versions"] if v["storage"])
    if doc["apiVersion"] != f"{crd['spec']['group']}/{version['name']}":
        raise jsonschema.ValidationError(f"apiVersion {doc['apiVersion']} is not the CRD's")
    if doc["kind"] != crd["spec"]["names"]["kind"]:
        raise jsonschema.ValidationError(f"kind {doc['kind']} is not the CRD's")
    validator.validate(doc)
    # Its metadata as any object's (an ObjectMeta, checked in a ConfigMap).
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]},
                                 KUBERNETES, strict=True)


def validate(doc: dict[str, Any]) -> None:
    if doc["apiVersion"].startswith("monitoring.coreos.com/"):
        validate_custom(doc)
    else:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    metadata = doc["metadata"]
    assert DNS_LABEL.match(metadata["name"]), metadata["name"]
    for key, value in metadata.get("labels", {}).items():
        assert LABEL_KEY.match(key) and LABEL_VALUE.match(value), (key, value)


def variant(tmp_path: Path, text: str, **options: Any) -> dict[str, str]:
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    return render(Options(config=str(path), **options))


PD_FLEET = """\
cluster: pd-trial
etcd: etcd:2379
mqtt: mqtt:1883
routing: {port: 8080}
autoscale:
  pools: [prefill, decode]
  per_worker_rps: 2
  drain_deadline_s: 120
  kubernetes: {deployments: {prefill: vllm-prefill, decode: vllm-decode}}
"""


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """The checked-in example, the same with the trial's etcd and broker, and a prefill/decode fleet."""
    tmp = tmp_path_factory.mktemp("variants")
    return {"example": render(example_options()),
            "trial": render(Options(config=str(ROOT / "deploy/kubernetes/fleet.yaml"), trial_infra=True)),
            "pd": variant(tmp, PD_FLEET, namespace="serving", routers=3, vllm_port=8001, vllm_user=1000)}


# -- the checked-in output -------------------------------------------------------------------------------


def test_the_checked_in_manifests_are_the_generators_output() -> None:
    assert checked_in() == render(example_options()), "regenerate them: python -m fleetward.cli.kubernetes --write"


def test_the_command_writes_the_checked_in_manifests(tmp_path: Path) -> None:
    out = tmp_path / "manifests"
    done = subprocess.run([sys.executable, "-m", "fleetward.cli", "deploy", "kubernetes", "--config",
                           "deploy/kubernetes/fleet.yaml", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert done.returncode == 0, done.stderr
    assert {p.name: p.read_text() for p in sorted(out.glob("*.yaml"))} == checked_in()


def test_a_bad_fleet_file_is_refused_naming_its_file_line_and_field(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "fleet.yaml"
    bad.write_text("cluster: prod\nrouting:\n  port: 99999\n")
    assert main(["deploy", "kubernetes", "--config", str(bad), "--out", str(tmp_path / "out")]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert f"{bad}:3: routing.port:" in said
    assert not (tmp_path / "out").exists()


def test_pools_in_another_namespace_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"autoscale\.kubernetes\.namespace"):
        variant(tmp_path, "autoscale: {kubernetes: {namespace: elsewhere}}\n", namespace="inference")


def test_every_file_says_it_is_generated_and_from_what() -> None:
    for name, text in checked_in().items():
        assert "# Generated by `fleetward deploy kubernetes --config deploy/kubernetes/fleet.yaml`" in text, name
        assert "Do not edit by hand" in text, name


def test_the_kustomization_lists_every_file_but_the_sidecar_patches_and_the_example_secret(
        variants: dict[str, dict[str, str]]) -> None:
    for files in variants.values():
        kustomization = yaml.safe_load(files["kustomization.yaml"])
        expected = sorted(n for n in files if n != "kustomization.yaml" and not n.startswith(("sidecar-", "secret.")))
        assert sorted(kustomization["resources"]) == expected
        namespaces = {doc["metadata"]["namespace"] for _, doc in documents(files)}
        assert namespaces == {kustomization["namespace"]}


# -- offline validation ----------------------------------------------------------------------------------


def test_every_object_is_valid_for_its_schema(variants: dict[str, dict[str, str]]) -> None:
    seen = set()
    for files in variants.values():
        for name, doc in documents(files):
            if name.startswith("sidecar-"):
                continue  # a patch: validated merged into a Deployment, below
            validate(doc)
            seen.add(doc["kind"])
    assert {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "ServiceAccount", "Role", "RoleBinding",
            "NetworkPolicy", "PrometheusRule", "ServiceMonitor", "PodMonitor", "StatefulSet", "Secret"} <= seen


def test_each_sidecar_patch_merged_into_a_vllm_deployment_is_valid(variants: dict[str, dict[str, str]]) -> None:
    for files in variants.values():
        for name, patch in documents(files):
            if name.startswith("sidecar-") and not name.endswith(".remove.yaml"):
                user = copy.deepcopy(VLLM)
                user["metadata"] = dict(patch["metadata"])
                merged = merge(user, patch)
                validate(merged)
                assert [c["name"] for c in merged["spec"]["template"]["spec"]["containers"]] == \
                    ["vllm", "fleetward-agent"]
                assert merged["spec"]["selector"] == VLLM["spec"]["selector"]


def test_each_validator_rejects_a_broken_manifest() -> None:
    files = render(example_options())
    deployment = copy.deepcopy(objects(files, "Deployment")[0])
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    unknown = copy.deepcopy(objects(files, "Service")[0])
    unknown["spec"]["prot"] = 1  # strict: an unknown field is an error
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(unknown)
    rule = copy.deepcopy(objects(files, "PrometheusRule")[0])
    del rule["spec"]["groups"][0]["rules"][0]["expr"]
    with pytest.raises(jsonschema.ValidationError):
        validate(rule)
    monitor = copy.deepcopy(objects(files, "PodMonitor")[0])
    monitor["spec"]["podMetricsEndpoints"] = "every pod"
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor)
    service_monitor = copy.deepcopy(objects(files, "ServiceMonitor")[0])
    service_monitor["apiVersion"] = "monitoring.coreos.com/v2"
    with pytest.raises(jsonschema.ValidationError):
        validate(service_monitor)
    labelled = copy.deepcopy(objects(files, "PodMonitor")[0])
    labelled["metadata"]["labels"] = "not a map"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(labelled)
    misnamed = copy.deepcopy(objects(files, "ConfigMap")[0])
    misnamed["metadata"]["name"] = "Fleetward_Config"
    with pytest.raises(AssertionError):
        validate(misnamed)


def test_every_configmap_fits_in_one_mebibyte(variants: dict[str, dict[str, str]]) -> None:
    for files in variants.values():
        for cm in objects(files, "ConfigMap"):
            assert sum(len(v.encode()) for v in cm["data"].values()) < 1024 * 1024


# -- what the manifests mean -----------------------------------------------------------------------------


def test_the_autoscalers_role_allows_get_and_patch_on_the_pools_deployments_scale_only(
        variants: dict[str, dict[str, str]]) -> None:
    for which, names in (("example", ["vllm"]), ("pd", ["vllm-decode", "vllm-prefill"])):
        files = variants[which]
        (role,) = objects(files, "Role")
        assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["deployments/scale"], "resourceNames": names,
                                  "verbs": ["get", "patch"]}]
        assert objects(files, "ClusterRole") == [] and objects(files, "ClusterRoleBinding") == []
        (binding,) = objects(files, "RoleBinding")
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "fleetward-autoscaler",
                                        "namespace": role["metadata"]["namespace"]}]
        tokens = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["automountServiceAccountToken"]
                  for d in objects(files, "Deployment") if d["metadata"]["name"].startswith("fleetward-")}
        assert tokens == {"fleetward-autoscaler": True, "fleetward-controller": False, "fleetward-router": False}


def config_files(files: dict[str, str]) -> dict[str, str]:
    (cm,) = [c for c in objects(files, "ConfigMap") if c["metadata"]["name"] == "fleetward-config"]
    data: dict[str, str] = cm["data"]
    return data


def load_fleet(text: str, tmp_path: Path, name: str) -> FleetConfig:
    path = tmp_path / name
    path.write_text(text)
    return load_model(FleetConfig, path)


def test_the_fleet_files_of_the_configmap_load_with_the_projects_loader(variants: dict[str, dict[str, str]],
                                                                        tmp_path: Path) -> None:
    for which, files in variants.items():
        for name, text in config_files(files).items():
            config = load_fleet(text, tmp_path, f"{which}-{name}")
            assert config.autoscale.actuator == "kubernetes"
            assert config.workers == 0 and config.run_dir == Path("/var/lib/fleetward")
    example = load_fleet(config_files(variants["example"])["fleet.yaml"], tmp_path, "fleet.yaml")
    assert example.attach == () and example.admin_token_file is None
    assert str(example.routing.api_keys_file).startswith("/run/fleetward/credentials/")
    assert example.etcd_access.key_file == Path("/run/fleetward/credentials/etcd-tls.key")
    trial = load_fleet(config_files(variants["trial"])["fleet.yaml"], tmp_path, "trial.yaml")
    assert (trial.etcd, trial.mqtt) == ("fleetward-etcd:2379", "fleetward-mosquitto:1883")
    assert not trial.etcd_access.uses_tls and trial.etcd_access.username is None


def test_the_sidecar_shares_the_process_namespace_and_adopts_its_pods_vllm(variants: dict[str, dict[str, str]],
                                                                          tmp_path: Path) -> None:
    files = variants["example"]
    (patch,) = [doc for name, doc in documents(files) if name == "sidecar-vllm.yaml"]
    pod = patch["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True
    assert pod["terminationGracePeriodSeconds"] >= 60  # autoscale.drain_deadline_s of the example
    (agent,) = pod["containers"]
    assert agent["args"] == ["agent", "--config", "/etc/fleetward/agent-aggregated.yaml", "--node", "$(POD_NAME)",
                             "--advertise-host", "$(POD_IP)"]
    env = {e["name"]: e for e in agent["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert agent["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 9200}
    assert agent["livenessProbe"]["httpGet"] == {"path": "/health", "port": 9200}
    assert agent["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["KILL", "SYS_PTRACE"]}
    config = load_fleet(config_files(files)["agent-aggregated.yaml"], tmp_path, "agent.yaml")
    (entry,) = config.attach
    assert entry.url == "http://127.0.0.1:8000" and entry.restart_by_exit and not entry.restart_command
    assert entry.process is not None and entry.process.match == "vllm serve|vllm.entrypoints.openai.api_server"
    assert re.search(entry.process.match, "/usr/bin/python3 /usr/local/bin/vllm serve Qwen/Qwen2.5-0.5B")
    assert config.supervisor.agent_metrics_port == 9200 and config.host == "0.0.0.0"
    # Each pool's sidecars attach their pod's server in that pool, on the port given.
    pd = variants["pd"]
    for role, deployment in (("prefill", "vllm-prefill"), ("decode", "vllm-decode")):
        (entry,) = load_fleet(config_files(pd)[f"agent-{role}.yaml"], tmp_path, f"{role}.yaml").attach
        assert (entry.role, entry.url) == (role, "http://127.0.0.1:8001")
        (patch,) = [doc for name, doc in documents(pd) if name == f"sidecar-{deployment}.yaml"]
        assert patch["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 120
        security = patch["spec"]["template"]["spec"]["containers"][0]["securityContext"]
        assert security["runAsUser"] == 1000 and security["capabilities"] == {"drop": ["ALL"]}


def test_the_prometheus_rule_is_the_rules_file(variants: dict[str, dict[str, str]]) -> None:
    (rule,) = objects(variants["example"], "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_each_dashboard_configmap_is_its_dashboard_file(variants: dict[str, dict[str, str]]) -> None:
    maps = [c for c in objects(variants["example"], "ConfigMap") if c["metadata"]["labels"].get("grafana_dashboard")]
    found = {}
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        ((name, text),) = cm["data"].items()
        found[name] = json.loads(text)
    assert found == {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def test_the_scrape_targets_name_the_jobs_the_alerts_and_dashboards_group_by(
        variants: dict[str, dict[str, str]]) -> None:
    files = variants["example"]
    jobs = set()
    for monitor in objects(files, "PodMonitor") + objects(files, "ServiceMonitor"):
        for endpoint in monitor["spec"].get("podMetricsEndpoints", []) + monitor["spec"].get("endpoints", []):
            jobs |= {r["replacement"] for r in endpoint["relabelings"] if r.get("targetLabel") == "job"}
    assert jobs == {"router", "controller", "autoscaler", "agent", "worker"}


def test_no_secret_value_reaches_a_configmap_or_a_command_line(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Secret files that exist and hold a value, and the admin token in the environment: none is read.
    for name in ("admin-token", "api-keys.yaml", "etcd-password", "key.pem"):
        (tmp_path / name).write_text(SENTINEL)
        (tmp_path / name).chmod(0o600)
    monkeypatch.setenv("FLEETWARD_ADMIN_TOKEN", SENTINEL)
    monkeypatch.setenv("ETCD_PASSWORD", SENTINEL)
    files = variant(tmp_path, f"""\
etcd: etcd:2379
mqtt: mqtt:1883
admin_token_file: {tmp_path}/admin-token
etcd_access: {{cert_file: {tmp_path}/key.pem, key_file: {tmp_path}/key.pem, username: u,
              password_file: {tmp_path}/etcd-password}}
mqtt_access: {{username: u, password_env: ETCD_PASSWORD}}
routing: {{api_keys_file: {tmp_path}/api-keys.yaml}}
""")
    assert not any(SENTINEL in text for text in files.values())
    for _, doc in documents(files):
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            for env in container.get("env", []):
                if env["name"] in ("FLEETWARD_ADMIN_TOKEN", "ETCD_PASSWORD"):
                    assert "value" not in env and env["valueFrom"]["secretKeyRef"]["name"] == "fleetward-secrets"
            words = " ".join(container.get("command", []) + container.get("args", []))
            assert "admin-token" not in words and "--admin-token" not in words
    for cm in objects(files, "ConfigMap"):
        for text in cm["data"].values():  # every secret file is the pod's copy, under /run/fleetward/
            assert not any(str(tmp_path) in line for line in text.splitlines() if not line.startswith("#"))
    (secrets,) = [d for d in objects(files, "Secret") if d["metadata"]["name"] == "fleetward-secrets"]
    assert set(secrets["stringData"]) == {"admin-token", "api-keys.yaml", "etcd-password", "mqtt-password"}
    assert all(v.startswith("REPLACE-ME") for v in secrets["stringData"].values())


def test_the_control_api_is_reached_only_from_fleetwards_pods_and_prometheus(
        variants: dict[str, dict[str, str]]) -> None:
    policies = {p["metadata"]["name"]: p["spec"] for p in objects(variants["example"], "NetworkPolicy")}
    (rule,) = policies["fleetward-controller"]["ingress"]
    assert rule["ports"] == [{"port": 9100, "protocol": "TCP"}]
    pods, prometheus = rule["from"]
    assert pods["podSelector"]["matchExpressions"][0]["values"] == ["autoscaler", "controller", "router"]
    assert prometheus == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    workers = policies["fleetward-workers"]
    assert workers["podSelector"] == {"matchLabels": {"fleetward/worker": "true"}}
    assert [r["ports"] for r in workers["ingress"]] == [[{"port": 8000, "protocol": "TCP"},
                                                          {"port": 9200, "protocol": "TCP"}]]
    assert {"ports": [{"port": 9000, "protocol": "TCP"}]} in policies["fleetward-router"]["ingress"]


def test_the_trial_infrastructure_is_one_etcd_member_and_an_anonymous_broker(
        variants: dict[str, dict[str, str]]) -> None:
    files = variants["trial"]
    (etcd,) = objects(files, "StatefulSet")
    assert etcd["spec"]["replicas"] == 1 and etcd["spec"]["volumeClaimTemplates"]
    assert etcd["spec"]["template"]["spec"]["containers"][0]["image"].startswith("gcr.io/etcd-development/etcd:v3.5.")
    (conf,) = [c for c in objects(files, "ConfigMap") if c["metadata"]["name"] == "fleetward-mosquitto"]
    assert "allow_anonymous true" in conf["data"]["mosquitto.conf"]
    assert "not for production" in files["trial-etcd.yaml"] and "not for production" in files["trial-mosquitto.yaml"]
    assert "trial-etcd.yaml" not in variants["example"]


def test_the_removal_patch_takes_out_everything_the_sidecar_patch_put_in(variants: dict[str, dict[str, str]]) -> None:
    files = variants["example"]
    (patch,) = [doc for name, doc in documents(files) if name == "sidecar-vllm.yaml"]
    (removal,) = [doc for name, doc in documents(files) if name == "sidecar-vllm.remove.yaml"]
    added, undone = patch["spec"]["template"], removal["spec"]["template"]
    assert set(undone["metadata"]["labels"]) == set(added["metadata"]["labels"])
    for key in ("containers", "initContainers", "volumes"):
        assert [(i["name"], "delete") for i in added["spec"][key]] == \
            [(i["name"], i["$patch"]) for i in undone["spec"][key]]
    assert undone["spec"]["shareProcessNamespace"] is None
