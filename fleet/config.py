"""Configuration: built once, frozen, typed, validated with the file, line and field in every message.

This is the only module that reads config files and the environment. Every ``fleetward up`` flag has a
field here, so a YAML file can set it; flags given on the command line override the file.

:func:`load_model` is shared with experiment files (``fleetward.chaos``): YAML is parsed keeping each
node's line, then validated by a pydantic model with ``extra="forbid"``, so a misspelt key is reported
as ``fleet.yaml:7: sim.decode_step_ms: unknown field`` rather than ignored.
"""

from __future__ import annotations

import os
import secrets
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from fleetward.fleet.backends import BackendName
from fleetward.fleet.errors import ConfigError

__all__ = [
    "ID_PATTERN",
    "Access",
    "AccessConfig",
    "AttachConfig",
    "AutoscaleConfig",
    "FleetConfig",
    "Frozen",
    "GpuConfig",
    "GpuPolicyConfig",
    "MovesConfig",
    "ProcessRef",
    "PrometheusConfig",
    "RouterConfig",
    "SimConfig",
    "SupervisorConfig",
    "VllmConfig",
    "admin_token_for",
    "admin_token_from_env",
    "admin_token_from_file",
    "admin_token_given",
    "check_private_file",
    "load_fleet_config",
    "load_model",
    "parse_yaml",
    "read_text",
    "resolve_access",
    "secret_path",
    "validation_error",
]

M = TypeVar("M", bound=BaseModel)

# A name that is a key segment, an MQTT topic level and a file name at once: a cluster, a node, a worker id.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
Path_ = tuple[str | int, ...]


class Frozen(BaseModel):
    """Base of every config model: immutable, unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class SimConfig(Frozen):
    """The simulated worker's model of time and capacity.

    Defaults give realistic shapes for a small GPU model: ~25 ms decode steps at a moderate batch, a
    prefill cost that makes a 2k-token prompt take ~100 ms, and a KV cache that queues requests
    beyond ~64k resident tokens.
    """

    prefill_ms_per_token: float = Field(0.05, ge=0, description="prefill time per prompt token")
    decode_step_ms: float = Field(18.0, ge=0, description="decode step time with one sequence")
    decode_ms_per_seq: float = Field(0.35, ge=0, description="added step time per running sequence")
    max_num_seqs: int = Field(256, ge=1, description="sequences decoded at once; more wait (vLLM's --max-num-seqs)")
    kv_capacity_tokens: int = Field(65536, ge=16, description="KV cache size; requests beyond it queue")
    max_model_len: int = Field(4096, ge=16, description="context length: a prompt that does not fit is a 400, "
                               "max_tokens is clamped to what is left (as vLLM does)")
    eos_probability: float = Field(0.0, ge=0, le=1, description="chance per step that EOS is the token")
    seed: int = Field(0, description="the simulated model's weights: same seed, same tokens")
    engine_version: str = Field("0.32.0", description="the vLLM version it says it is (GET /version): two workers "
                                "of one model on two versions may give other greedy tokens (another seed)")
    model_name: str = Field("sim-tiny", description="the served model name")
    kv_block_size: int = Field(16, ge=1, description="KV cache block size in tokens")
    max_num_batched_tokens: int = Field(
        8192, ge=1, description="tokens per step (one per running sequence plus admitted prompts)")
    tokenizer: str = Field("byte", description="the vocabulary it serves: byte, bpe or sp (built in, see "
                           "fleetward.fleet.vocab), or a model folder / tokenizer.json")
    chunked_prefill_tokens: int = Field(0, ge=0, description="prefill prompts in chunks of at most this many tokens "
                                        "per step while the running sequences keep decoding (vLLM's chunked "
                                        "prefill); 0: off, a prompt's whole prefill is one step that holds the batch")
    kv_bytes_per_token: int = Field(256, ge=8, description="prefill/decode: KV bytes per token on the wire "
                                    "(fleetward.fleet.kv)")
    kv_latency_ms: float = Field(0.5, ge=0, description="prefill/decode: the KV link's latency per transfer")
    kv_bandwidth_gbps: float = Field(10.0, gt=0, description="prefill/decode: the KV link's bandwidth")
    compute_steps: bool = Field(False, description="spend each engine step's time computing on a CPU, as an "
                                "engine's process does (what a node agent's CPU evidence sees), instead of sleeping "
                                "it (many simulated workers share a small host)")
    poison_token: int | None = Field(None, ge=0, description="a token id that kills the worker (its process exits, "
                                     "after two more tokens) when a request holding it in its prompt is submitted: "
                                     "a poison request, as vLLM has had inputs that kill its engine. None: none")
    responses_store: bool = Field(False, description="keep Responses API answers (``store``) for GET "
                                  "/v1/responses/{id} and ``previous_response_id``, as vLLM with "
                                  "VLLM_ENABLE_RESPONSES_API_STORE=1")
    runtime_lora: bool = Field(False, description="serve vLLM's runtime LoRA endpoints (POST /v1/load_lora_adapter "
                               "and /v1/unload_lora_adapter; adapters listed in /v1/models), as vLLM with "
                               "--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
    kv_lease_s: float = Field(30.0, gt=0, description="prefill/decode: how long a prefill worker keeps a prompt's "
                              "KV for the decode worker to pull, before it frees the blocks")
    kv_timeout_s: float = Field(1.0, gt=0, description="prefill/decode: how long a decode worker waits for a KV "
                                "transfer to complete; keep it below the router's stall allowance "
                                "(routing.stall_floor_s), or a stalled transfer looks like a hung decode worker")

    def step_seconds(self, batch: int, prefill_tokens: int = 0) -> float:
        """One engine step with ``batch`` sequences and ``prefill_tokens`` prompt tokens admitted: the
        simulated worker's latency model (``fleetward.sim.engine``), shared with the autoscaler's simulator."""
        return (self.decode_step_ms + self.decode_ms_per_seq * batch + self.prefill_ms_per_token * prefill_tokens) \
            / 1000.0


class VllmConfig(Frozen):
    """How a real vLLM worker is launched (``--backend vllm``)."""

    model: str | None = Field(None, description="model folder; default: the tiny local model, made on demand")
    tokenizer: Literal["bpe", "sp", "byte"] = Field(
        "bpe", description="the tiny local model's vocabulary (when no model is given): a byte-level BPE, a "
        "SentencePiece-style one with byte fallback, or one id per byte")
    max_model_len: int = Field(2048, ge=16, description="vLLM's --max-model-len")
    dtype: str = Field("float32", description="bfloat16 segfaults in the CPU attention kernel on AMX hosts")
    kv_cache_space_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE on CPU hosts")
    enforce_eager: bool = Field(True, description="vLLM's --enforce-eager (no CUDA graphs / compilation)")
    extra_args: tuple[str, ...] = Field((), description="more vLLM arguments, appended to its command line")
    cpu_binding: str = Field("spread", pattern=r"^(spread|auto|nobind|[0-9][0-9,|-]*)$", description="where a CPU "
                             "worker's OpenMP threads run (VLLM_CPU_OMP_THREADS_BIND; GPU builds ignore it): spread: "
                             "each worker this host starts gets cores of its own, one core left to the rest when "
                             "there are more cores than workers; auto: vLLM's choice, the same cores for every "
                             "server on the host (one starting beside a busy one then gets almost no CPU); nobind; "
                             "or a core list such as 0-7, used by every worker")
    nice: int = Field(0, ge=-20, le=19, description="scheduling niceness of the worker's processes; on a small "
                      "CPU host, a positive value keeps the control plane responsive next to spinning OMP threads")
    start_timeout_s: float = Field(240.0, gt=0, description="how long a starting worker may go without progress "
                                   "(its processes use no CPU and log nothing) before it is given up; one that "
                                   "progresses (loading weights from slow storage, starved by a busy neighbour) "
                                   "is waited for up to start_max_s")
    start_max_s: float = Field(3600.0, gt=0, description="the longest a progressing start is waited for")


class MovesConfig(Frozen):
    """Planned moves of streams (drains, scale-downs, ``fleetward move``, rebalancing): the router carries a
    stream's KV from the worker it leaves to the one it moves to instead of computing it again (docs/pd.md,
    "Planned moves")."""

    kv: bool = Field(True, description="a planned move carries the stream's KV (false: the destination computes "
                     "prompt and emitted tokens again, as a crash needs; kept to measure the difference)")
    concurrency: int = Field(4, ge=1, description="moves one router has in flight at once; the others wait their "
                             "turn, still streaming from the worker they are on (longest context first)")
    budget_tokens_s: int = Field(2_000_000, ge=0, description="KV tokens one router moves per second at most, so "
                                 "planned moves leave the link to live prefill/decode transfers (0: no limit)")
    timeout_s: float = Field(10.0, gt=0, description="how long the worker a stream leaves may take to hand over "
                             "its KV before the stream is computed again on the destination instead; also how "
                             "long a move waits for another worker that can take the stream")
    rebalance: bool = Field(False, description="move streams off a worker whose load is far above the others' "
                            "(rebalance_ratio), longest context first")
    rebalance_ratio: float = Field(2.0, gt=1, description="rebalance: a worker with more than this times the mean "
                                   "load of the model's other workers gives streams away")
    rebalance_min_streams: int = Field(8, ge=1, description="rebalance: a worker with fewer of this router's "
                                       "streams is never rebalanced")
    rebalance_interval_s: float = Field(5.0, gt=0, description="rebalance: how often loads are compared")


class RouterConfig(Frozen):
    """The router (``fleetward router``, also started by ``fleetward up``)."""

    host: str = Field("127.0.0.1", description="address the router binds (``up``: the top-level host unless set)")
    port: int = Field(0, ge=0, le=65535, description="the router's port (``up --router-port``); 0 picks a free one")
    migration_limit: int = Field(3, ge=0, description="resumes allowed per request after its first attempt")
    retry_budget_tokens: float = Field(20.0, ge=0, description="a retry of a request that a worker answered with "
                                       "an error (a 5xx or an error event, before any token) goes ahead only while "
                                       "a bucket of this many tokens is over half full, and takes one; it gives it "
                                       "back if it is served, and every request served adds retry_budget_ratio. "
                                       "Else the client gets the worker's answer at once. Mid-stream resumes, "
                                       "workers unreachable or dead, and planned moves never draw on it. 0: off")
    retry_budget_ratio: float = Field(0.1, ge=0, description="what each request served gives back to the retry "
                                      "budget (0.1: in a fleet that fails every request, about one retry in ten)")
    poison_workers: int = Field(2, ge=0, description="a request this many workers failed while serving it (crashed, "
                                "hung, or judged unhealthy under it) is not sent to another: it may be what breaks "
                                "them (a poison request), and is answered 500 naming them, counted "
                                "(fleetward_router_migration_failures_total{reason=\"poison\"}) and logged with "
                                "a hash of its body; 0: never (every failure is retried up to migration_limit)")
    request_timeout_s: float = Field(600.0, gt=0, description="a request's deadline, migrations included")
    checkpoints: bool = Field(True, description="checkpoint journals to etcd (off only to measure their cost)")
    checkpoint_interval_ms: float = Field(75.0, gt=0, description="one etcd transaction per interval")
    event_ids: bool = Field(False, description="every SSE event carries ``id: <request id>:<tokens>``, the point a "
                            "``Last-Event-ID`` resume starts from; off: streams are byte for byte vLLM's, and a "
                            "client asks for ids per request with the header ``X-Fleetward-Event-Ids: 1`` "
                            "(docs/operations.md, \"Resuming a stream\")")
    processes: int = Field(1, ge=1, le=64, description="router processes on the one port (SO_REUSEPORT; each one "
                           "event loop, one core at most; they share state through etcd as replicas do)")
    api_keys_file: Path | None = Field(None, description="require an API key (``Authorization: Bearer``) on the "
                                       "public API: a YAML file of named keys, each with its concurrency limit "
                                       "(docs/operations.md, \"API keys\"); none: the API is open")
    api_key_max_concurrency: int = Field(0, ge=0, description="requests in flight per API key, for keys that do not "
                                         "set max_concurrency (0: no limit)")
    max_in_flight: int = Field(4096, ge=1, description="requests this router holds at once (streams a client left "
                                "included, while resumable); more are shed with 503 and Retry-After, counted in "
                                "fleetward_router_shed_total")
    store_outage_hold_s: float = Field(30.0, ge=0, description="how long a worker whose records vanished while "
                                       "the store was out of this router's reach stays routable, unless its records "
                                       "come back or it fails where it serves (0: dropped at once)")
    max_request_bytes: int = Field(64 * 2**20, ge=1024, description="the largest request body the router takes; "
                                   "one over it is answered 413 before it is held (64 MiB)")
    checkpoint_incremental: bool = Field(True, description="after a request's first checkpoint, write only the "
                                         "tokens since the last flush (false: the whole journal every flush, as "
                                         "before; kept to measure the difference)")
    checkpoint_ttl_s: int = Field(30, ge=2, description="how long a dead router's checkpoints stay resumable")
    checkpoint_store: Literal["etcd", "peers"] = Field(
        "etcd", description="where checkpoints are kept: etcd (every router's in etcd), or peers (each router's "
        "sent to the next router by id, etcd holding none; a router with no peer writes to etcd). peers needs "
        "the admin token (FLEETWARD_ADMIN_TOKEN): routers authenticate each other with it. docs/scale.md says "
        "when etcd stops being enough")
    detached_grace_s: float = Field(30.0, ge=0, description="how long a disconnected client may resume")
    stall_floor_s: float = Field(1.0, gt=0, description="least silence, with work in flight, that counts as a stall")
    moves: MovesConfig = Field(default_factory=MovesConfig, description="planned moves of streams with their KV")
    prefill_timeout_s: float = Field(30.0, gt=0, description="prefill/decode: how long the prefill step may take "
                                     "before the decode worker computes the prompt itself")
    kv_failure_policy: Literal["retry", "recompute", "aggregated", "fail"] = Field(
        "retry", description="prefill/decode: what a failed KV transfer leads to (docs/pd.md): retry (prefill again "
        "on another prefill worker, kv_retries times, then recompute), recompute (the decode worker computes the "
        "prompt itself), aggregated (the request goes to a worker without prefill), fail (an error to the client)")
    kv_retries: int = Field(1, ge=0, description="prefill/decode: prefills on other prefill workers after a failed "
                            "KV transfer (kv_failure_policy retry)")
    kv_verify: bool = Field(True, description="prefill/decode: decode workers check every KV transfer (frames, "
                            "order, digest) before using it; off only to see what unchecked KV does")
    stall_hold_s: float = Field(30.0, ge=0, description="after moving a worker's streams away for silence, send it "
                                "no new request for this long, unless it emits a token or the supervisor finds "
                                "it ready again")
    adapters_interval_s: float = Field(5.0, gt=0, description="how often the router asks each worker which LoRA "
                                       "adapters it serves (and at once after a load or unload passed through it)")
    itl_multiplier: float = Field(8.0, gt=1, description="allowed silence as a multiple of the fleet's p99 ITL")
    prefill_s_per_token: float = Field(0.002, ge=0, description="initial prefill estimate (learned at run time)")
    policy: Literal["least_loaded_affinity", "least_loaded"] = Field(
        "least_loaded_affinity", description="how a worker is picked (fleetward.migration.policy.POLICIES)")
    affinity_tokens: int = Field(64, ge=0, description="prompt prefix that picks the preferred worker; 0: off")
    affinity_slack: int = Field(4, ge=0, description="in-flight requests above the least loaded before affinity yields")
    drain_timeout_s: float = Field(30.0, ge=0, description="on shutdown, how long open streams may finish")
    lease_ttl_s: int = Field(5, ge=2, description="the router's registration lease: a dead router vanishes within it")
    retry_after_s: int = Field(1, ge=1, description="Retry-After on 503 when no worker is healthy")
    detokenize: bool = Field(True, description="turn token ids into text at the router, the same whatever worker "
                             "produced them (off only to measure its cost: the workers' text is passed on)")
    tokenizers: dict[str, str] = Field(
        default_factory=dict, description="model name → its tokenizer (a model folder or tokenizer.json on the "
        "router's host, or byte|bpe|sp), for workers that advertise none; the router turns token ids into text "
        "with it")


class SupervisorConfig(Frozen):
    """The supervisor: node agents' detectors and the leader-elected controller."""

    host: str = Field("127.0.0.1", description="address the control API binds (``up``: the top-level host unless "
                      "set)")
    port: int = Field(0, ge=0, le=65535, description="the controller's control API; 0 picks a free port")
    agent_metrics_port: int | None = Field(0, ge=0, le=65535, description="agent: the port its /metrics binds (on "
                                           "the address its workers bind); 0 picks a free one, null serves none")
    prometheus_url: str = Field("", description="a Prometheus whose pending and firing alerts the controller's fleet "
                                "page lists (``up --prometheus``: its own)")
    lease_ttl_s: int = Field(5, ge=2, description="leadership lease: a dead leader is replaced within this")
    canary_prompt: str = Field("The fleet keeps serving", description="what a canary asks a worker")
    canary_max_tokens: int = Field(4, ge=1, description="tokens a canary asks for")
    canary_timeout_s: float = Field(2.0, gt=0, description="deadline of a routine canary")
    canary_interval_s: float = Field(15.0, gt=0, description="an idle worker gets a canary this often")
    canary_busy_max_s: float = Field(30.0, gt=0, description="an engine that computes (its node agent sees its "
                                     "processes use CPU) but moves no token counter is taken for one long step for "
                                     "up to this, then for one that does not return; and a starting worker whose "
                                     "canary waited behind the engine's work gets twice the deadline, up to this")
    golden_quorum: int = Field(2, ge=1, description="workers of one kind (model, engine version, GPU type) that "
                               "must agree before their canary output is golden")
    progress_interval_s: float = Field(0.25, gt=0, description="how often routers' stream progress is read")
    metrics_interval_s: float = Field(10.0, gt=0, description="how often workers' /metrics are scraped")
    metrics_frozen_after_s: float = Field(10.0, gt=0, description="token counters standing still this long while "
                                          "requests run: suspect")
    engine_check_interval_s: float = Field(0.25, gt=0, description="agent: engine process state sampling")
    exit_check_interval_s: float = Field(0.02, gt=0, description="agent: how often a worker's processes are checked "
                                         "for an exit under way (a killed process is named before it has finished "
                                         "exiting, which takes a large one seconds)")
    engine_no_progress_s: float = Field(5.0, gt=0, description="agent: CPU-idle time of an engine with work that "
                                        "counts as suspect")
    engine_stall_s: float = Field(1.0, gt=0, description="agent: how long an engine's processes may go unscheduled "
                                  "(no CPU time, no context switch) while work waits on them before it counts as "
                                  "hung (fatal: frozen by the cgroup freezer, stuck in the kernel)")
    engine_probe_interval_s: float = Field(2.0, gt=0, description="agent: an engine that shows no progress gets a "
                                           "one-token request at most this often, so that an idle one is checked "
                                           "too (a frozen idle engine is named within about this plus "
                                           "engine_stall_s)")
    actions_retention_s: float = Field(86400.0, gt=0, description="how long a finished action (done, failed, "
                                       "refused) stays in etcd (actions/) for `fleetward events` and audits before "
                                       "the leader deletes it")
    action_max_age_s: float = Field(600.0, gt=0, description="agent: a signed action issued longer ago than this "
                                    "is refused, not carried out (clocks of the nodes must agree within it)")
    gpu_poll_interval_s: float = Field(1.0, gt=0, description="agent: how often GPU health (NVML) is read")
    recover_canaries: int = Field(2, ge=1, description="good canaries in a row before a suspect worker is ready again")
    suspect_timeout_s: float = Field(30.0, gt=0, description="suspicion nothing resolves becomes unhealthy "
                                     "(degraded GPUs excepted)")
    restart_budget: int = Field(3, ge=0, description="restarts within the window before a crash loop quarantines")
    restart_window_s: float = Field(600.0, gt=0, description="the window restart_budget counts in")
    restart_attempts: int = Field(3, ge=1, description="agent: tries to bring a worker back per restart")
    backoff_initial_s: float = Field(0.5, ge=0, description="agent: first wait between start attempts (doubles)")
    backoff_max_s: float = Field(30.0, ge=0, description="agent: longest wait between start attempts")
    drain_timeout_s: float = Field(60.0, ge=0, description="`fleetward drain`'s default deadline before open "
                                   "streams move")
    drain_move_s: float = Field(15.0, ge=0, description="after a drain's deadline, how long the routers have to "
                                "move the streams still open with their KV (routing.moves) before the rest are "
                                "moved by computing them again; 0: at once, as a failure is")


def _vllm_deployment() -> dict[Literal["aggregated", "prefill", "decode"], str]:
    return {"aggregated": "vllm"}


class KubernetesScaleConfig(Frozen):
    """Where the autoscaler scales each pool on Kubernetes (``autoscale.actuator: kubernetes``): a Deployment's
    scale subresource, with a namespaced Role that allows get and patch on ``deployments/scale`` only."""

    namespace: str | None = Field(None, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", description="the pools' "
                                  "namespace (default: the autoscaler pod's own, from its service account)")
    deployments: dict[Literal["aggregated", "prefill", "decode"], str] = Field(
        default_factory=_vllm_deployment,
        description="the Deployment of each pool's vLLM pods (each pod with the agent sidecar: `fleetward deploy "
                    "kubernetes`)")


class AutoscaleConfig(Frozen):
    """The autoscaler (``fleetward autoscaler``; ``fleetward up --autoscale`` starts one)."""

    enabled: bool = Field(False, description="``up``: start an autoscaler (``--autoscale``)")
    host: str = Field("127.0.0.1", description="address its /health and /metrics bind (``up``: the top-level host "
                      "unless set)")
    port: int = Field(0, ge=0, le=65535, description="its /health and /metrics port; 0 picks a free one")
    pools: tuple[Literal["aggregated", "prefill", "decode"], ...] = Field(
        ("aggregated",), min_length=1, description="the pools it scales, by worker role: one decision each")
    policy: Literal["fleetward", "reactive", "dynamo-style", "static-peak"] = Field(
        "fleetward", description="how it decides (fleetward.autoscale.planner; the others are the baselines)")
    ttft_s: float = Field(2.0, gt=0, description="SLA: p99 time to first token")
    itl_s: float = Field(0.05, gt=0, description="SLA: p99 of requests' mean inter-token latency")
    ttft_per_1k_s: float = Field(0.0, ge=0, description="SLA: TTFT allowed per 1,000 prompt tokens on top of ttft_s "
                                 "(long-context SLOs)")
    interval_s: float = Field(30.0, gt=0, description="one observation and decision per interval")
    min_workers: int = Field(1, ge=0, description="fewest workers per pool")
    max_workers: int = Field(8, ge=1, description="most workers per pool")
    predictor: Literal["constant", "moving-average", "holt-winters", "arima"] = Field(
        "holt-winters", description="how the next intervals' arrival rate is predicted")
    capacity: Path | None = Field(None, description="a capacity model file (``fleetward profile`` or ``replay`` "
                                  "writes one); without it, per_worker_rps, else the simulated worker is profiled "
                                  "in the fleet simulator (backend sim)")
    per_worker_rps: float | None = Field(None, gt=0, description="a flat capacity: requests/s one worker carries "
                                         "within the SLA (instead of a capacity file)")
    prefill_capacity: Path | None = Field(None, description="the prefill pool's capacity file, measured on a prefill "
                                          "worker (with its mean_input); without it, derived from the aggregated "
                                          "model (docs/autoscale.md)")
    decode_capacity: Path | None = Field(None, description="the decode pool's capacity file, measured on a decode "
                                         "worker (with its mean_output); without it, derived from the aggregated "
                                         "model (docs/autoscale.md)")
    startup_s: float | None = Field(None, ge=0, description="a new worker's start-up time (default: the capacity "
                                    "file's, else 5 s for sim and 60 s for vLLM)")
    down_stable: int = Field(6, ge=1, description="intervals that must all want fewer workers before scaling down")
    headroom: float = Field(0.1, ge=0, description="capacity kept above the predicted load at least (0.1: 10 %); "
                            "more when recent forecasts fell short by more (learned)")
    margin_quantile: float = Field(0.95, ge=0, le=1, description="the planner keeps this quantile of how far recent "
                                   "forecasts fell short (the last 40 intervals) above its forecast; 0 turns it off")
    capacity_trust_max: float = Field(1.25, ge=1.0, description="how far past the capacity model the planner may "
                                      "load workers once the SLA has held at that load (learned; 1 turns it off)")
    drain_deadline_s: float = Field(60.0, ge=0, description="scale-down: how long a retired worker's streams may "
                                    "finish before they move to other workers")
    nodes: tuple[str, ...] = Field((), description="nodes new workers may go to (default: the nodes that run "
                                   "workers of the pool now)")
    lease_ttl_s: int = Field(5, ge=2, description="leadership lease: a dead planner is replaced within this")
    actuator: Literal["local", "kubernetes"] = Field(
        "local", description="how workers are started and retired: local, through the supervisor's control API (the "
        "node agents start them); kubernetes, by each pool's Deployment replicas (scale subresource), the drain "
        "first (docs/deploy.md, Kubernetes)")
    kubernetes: KubernetesScaleConfig = Field(default_factory=KubernetesScaleConfig,
                                              description="actuator kubernetes: the namespace and the Deployments")

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleConfig:
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers {self.min_workers} is above max_workers {self.max_workers}")
        return self


class PrometheusConfig(Frozen):
    """A local Prometheus (``fleetward up --prometheus``): scrapes every service and worker, runs the alert rules."""

    enabled: bool = Field(False, description="``up``: start Prometheus (``--prometheus``; Debian's prometheus package)")
    host: str = Field("127.0.0.1", description="address it binds (``up``: the top-level host unless set)")
    port: int = Field(0, ge=0, le=65535, description="its web and API port; 0 picks a free one")
    scrape_interval_s: float = Field(5.0, gt=0, description="how often targets are scraped and rules evaluated")


# The names of fleetward.supervisor.gpu's Action and THROTTLE_REASONS (a test keeps them equal): the policy
# section is checked here, with the file's lines, and the supervisor builds its GpuPolicy from it.
GpuActionName = Literal["ignore", "degraded", "restart_worker", "drain_and_quarantine"]
ThrottleReason = Literal["sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"]


class GpuRuleConfig(Frozen):
    """One rule of the GPU policy: what to do, and the reason shown (default: the catalogue's). An action
    name alone (``13: drain_and_quarantine``) is short for ``{action: drain_and_quarantine}``."""

    action: GpuActionName = Field(description="ignore, degraded (slow: suspect, not restarted), restart_worker, or "
                                  "drain_and_quarantine (the GPU stays out until it passes its self-test)")
    reason: str | None = Field(None, min_length=1, description="what the signal and the fleet page say (default: "
                               "the catalogue's reason for it)")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"action": value} if isinstance(value, str) else value




class GpuPolicyConfig(Frozen):
    """Overrides of the GPU policy (docs/operations.md, "GPU health"); what is not set keeps its default."""

    unknown_xid: GpuActionName | None = Field(None, description="an Xid the table lacks (default restart_worker)")
    xid: dict[int, GpuRuleConfig] = Field(default_factory=dict, description="per Xid: an action, or {action, reason}")
    throttle: dict[ThrottleReason, GpuRuleConfig] = Field(default_factory=dict, description="per clock-slowdown reason")
    ecc_dbe: GpuRuleConfig | None = Field(None, description="an uncorrectable ECC error (default drain_and_quarantine)")
    ecc_sbe: GpuRuleConfig | None = Field(None, description="corrected ECC errors (default ignore)")
    lost: GpuRuleConfig | None = Field(None, description="a GPU lost or fallen off the bus (default "
                                       "drain_and_quarantine)")
    retirement_pending: GpuRuleConfig | None = Field(None, description="page retirement / row remapping "
                                                     "pending (default drain_and_quarantine)")

    def overrides(self) -> dict[str, Any]:
        """What the file sets, in the shape ``GpuPolicy.from_config`` reads."""
        return self.model_dump(mode="json", exclude_none=True, exclude_defaults=True)


class GpuConfig(Frozen):
    """Where a node agent reads the health of its host's GPUs (``gpu:``; ``gpu: nvml`` is short for ``gpu:
    {source: nvml}``)."""

    source: Literal["auto", "nvml", "dcgm", "off"] = Field(
        "auto", description="auto: dcgm-exporter when dcgm_url is set, else NVML when its bindings load and it "
        "sees a GPU, else off (said once in the agent's log and in `fleetward status`); nvml or dcgm: that one, "
        "or the agent does not start; off: no GPU health")
    dcgm_url: str | None = Field(None, pattern=r"^https?://[^\s/]+(/\S*)?$", description="this host's "
                                 "dcgm-exporter metrics, e.g. http://127.0.0.1:9400/metrics")
    per_worker: int = Field(1, ge=0, le=64, description="GPUs each worker this node starts gets (worker i: GPUs "
                            "i*k .. i*k+k-1, as CUDA_VISIBLE_DEVICES in NVML's order); 0: none")
    policy: GpuPolicyConfig = Field(GpuPolicyConfig(), description="overrides of the Xid / ECC / throttle policy")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"source": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _dcgm_needs_a_url(self) -> GpuConfig:
        if self.source == "dcgm" and not self.dcgm_url:
            raise ValueError("source dcgm needs dcgm_url (this host's dcgm-exporter, e.g. "
                             "http://127.0.0.1:9400/metrics)")
        return self


class ProcessRef(Frozen):
    """How a node agent finds the process of a server it did not start: exactly one of these."""

    pidfile: Path | None = Field(None, description="a file holding the API server's pid")
    systemd_unit: str | None = Field(None, description="a systemd unit whose MainPID is the API server")
    container: str | None = Field(None, description="a container (docker) whose main process is the API server")
    match: str | None = Field(None, min_length=1, description="a regular expression (RE2: no backreferences or "
                              "lookaround) searched for in each process's command line: the oldest match is the API "
                              "server (a sidecar in the server's pod, with shareProcessNamespace: e.g. 'vllm serve')")

    @field_validator("match")
    @classmethod
    def _regex(cls, value: str | None) -> str | None:
        if value is not None:
            from fleetward.fleet.procs import command_line_pattern

            command_line_pattern(value)  # refused as RE2 refuses it (linear time: procs.command_line_pattern)
        return value

    @model_validator(mode="after")
    def _one(self) -> ProcessRef:
        given = [n for n in ("pidfile", "systemd_unit", "container", "match") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of pidfile, systemd_unit, container and match")
        return self


class AttachConfig(Frozen):
    """A vLLM (or any OpenAI-compatible, vLLM-metric) server fleetward did not start, to protect.

    It is registered like any other worker: routers route and migrate its streams, and the supervisor
    watches it with every detector that needs no process of its own (stream progress, canaries, metrics).
    With ``process`` the node agent also watches its process (exit, a stopped or frozen engine). A restart
    runs ``restart_command`` (e.g. ``systemctl restart vllm@0``); without one the worker is drained and
    left for an operator: fleetward never kills a server it did not start unless told how to restart it.
    """

    url: str = Field(pattern=r"^https?://[^/\s:]+:[0-9]{1,5}/?$", description="http://host:port of the server")
    id: str | None = Field(None, pattern=ID_PATTERN,
                           description="the worker id (default <node>-<host>-<port>)")
    model: str | None = Field(None, description="the served model name (default: what /v1/models lists)")
    role: Literal["aggregated", "prefill", "decode"] = Field("aggregated", description="its pool")
    node: str | None = Field(None, description="the node whose agent watches it (default: the agent's own)")
    tokenizer: str | None = Field(None, description="its tokenizer, as routers' hosts see it (a model folder or "
                                  "tokenizer.json); default: the model folder its /v1/models names as root")
    process: ProcessRef | None = Field(None, description="how to find its process (none: watched by URL only)")
    restart_command: tuple[str, ...] = Field((), description="argv run to restart it (none: drain and leave it "
                                             "for an operator)")
    restart_by_exit: bool = Field(False, description="restart it by ending its process tree and waiting for what "
                                  "runs it to start it again (the kubelet, a container's restart policy); needs "
                                  "process, and no restart_command")
    gpus: tuple[int, ...] | None = Field(None, description="the GPUs it runs on, by NVML index (default: found "
                                         "from NVML's compute processes and its process tree; dcgm: none "
                                         "unless given)")

    @field_validator("restart_command", mode="before")
    @classmethod
    def _argv(cls, value: Any) -> Any:
        return tuple(shlex.split(value)) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _restart(self) -> AttachConfig:
        if self.restart_by_exit and self.restart_command:
            raise ValueError("give restart_command or restart_by_exit, not both")
        if self.restart_by_exit and self.process is None:
            raise ValueError("restart_by_exit needs process: the process whose exit restarts the server")
        return self

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.url.rstrip("/").split("://", 1)[1].rpartition(":")
        return host, int(port)

    def worker_id(self, node: str) -> str:
        host, port = self.host_port
        return self.id or f"{self.node or node}-{host.replace('.', '-')}-{port}"


class AccessConfig(Frozen):
    """TLS and credentials for one of the cluster's links (``etcd_access:``, ``mqtt_access:``).

    Only paths and names: the password itself is read from ``password_file`` (mode 0600) or from the
    environment variable ``password_env`` names, never from the fleet file or a command line.
    """

    tls: bool = Field(False, description="speak TLS (implied by ca_file or cert_file); without ca_file the "
                      "system's CAs verify the server")
    ca_file: Path | None = Field(None, description="PEM file of the CA(s) that verify the server's certificate")
    cert_file: Path | None = Field(None, description="PEM client certificate (mutual TLS); needs key_file")
    key_file: Path | None = Field(None, description="PEM private key of cert_file")
    username: str | None = Field(None, min_length=1, description="user to authenticate as (etcd auth; MQTT "
                                 "username); needs password_file or password_env")
    password_file: Path | None = Field(None, description="a file holding the password (mode 0600)")
    password_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                                     description="or: the environment variable holding the password")

    @model_validator(mode="after")
    def _complete(self) -> AccessConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together (a client certificate and its key)")
        if self.password_file is not None and self.password_env is not None:
            raise ValueError("give password_file or password_env, not both")
        has_password = self.password_file is not None or self.password_env is not None
        if (self.username is None) == has_password:
            raise ValueError("username needs a password (password_file or password_env), and a password a "
                             "username")
        return self

    @property
    def uses_tls(self) -> bool:
        return self.tls or self.ca_file is not None or self.cert_file is not None


@dataclass(frozen=True, slots=True)
class Access:
    """What a client needs to reach etcd or the broker: resolved from an :class:`AccessConfig` by
    :func:`resolve_access` (the password read, a :class:`SecretStr`, so it prints as ``**********``)."""

    tls: bool = False
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    username: str | None = None
    password: SecretStr | None = None


def resolve_access(config: AccessConfig, *, field: str) -> Access:
    """The :class:`Access` ``config`` describes; :class:`ConfigError` naming ``field`` (``etcd_access``,
    ``mqtt_access``) when a file it names is missing, or the password is missing, empty or readable by others."""
    files: dict[str, Path | None] = {}
    for name in ("ca_file", "cert_file", "key_file"):
        given = getattr(config, name)
        path = files[name] = secret_path(given) if given is not None else None
        if path is not None and not path.is_file():
            raise ConfigError(f"{path}: no such file", file=str(path), field=f"{field}.{name}")
    password: SecretStr | None = None
    if config.password_file is not None:
        password = _secret_file(config.password_file, field=f"{field}.password_file", what="password")
    elif config.password_env is not None:
        raw = os.environ.get(config.password_env, "")
        if not raw:
            raise ConfigError(f"the environment variable {config.password_env} (the password) is not set",
                              field=f"{field}.password_env")
        password = SecretStr(raw)
    return Access(tls=config.uses_tls, ca_file=files["ca_file"], cert_file=files["cert_file"],
                  key_file=files["key_file"], username=config.username, password=password)


def secret_path(path: Path) -> Path:
    """Where to read the secret file ``path``: under systemd, the credential of the same file name when the unit
    loaded one (``LoadCredential=NAME:PATH`` puts a copy that the service's user can read, mode 0400, in
    ``$CREDENTIALS_DIRECTORY``: a ``DynamicUser`` cannot read the 0600 original); else ``path`` itself. So one
    fleet file serves every host and unit: ``password_file: /etc/fleetward/etcd-password`` is read there by
    root, and from the credential ``etcd-password`` by a unit that loaded it."""
    loaded = os.environ.get("CREDENTIALS_DIRECTORY")
    if loaded and (Path(loaded) / path.name).is_file():
        return Path(loaded) / path.name
    return path


def check_private_file(path: Path, *, field: str, what: str) -> None:
    """:class:`ConfigError` naming ``field`` when the ``what`` file at ``path`` cannot be read or is readable by
    others (a file of secrets: the admin token, a password, API keys)."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} file: {exc.strerror}", file=str(path), field=field) from exc
    if mode & 0o077:
        raise ConfigError(f"the {what} file is readable by others (chmod 600 it)", file=str(path), field=field)


def _secret_file(path: Path, *, field: str, what: str) -> SecretStr:
    path = secret_path(path)
    check_private_file(path, field=field, what=what)
    try:
        raw = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} file: {exc.strerror}", file=str(path), field=field) from exc
    if not raw:
        raise ConfigError(f"the {what} file is empty", file=str(path), field=field)
    return SecretStr(raw)


class FleetConfig(Frozen):
    """Everything ``fleetward up`` needs; each field is also a flag (``--workers``, ``--backend``, ...)."""

    cluster: str = Field("local", pattern=ID_PATTERN,
                         description="the cluster's name: its etcd prefix /fleetward/<cluster>/ and MQTT topics")
    workers: int = Field(3, ge=0, le=512, description="workers this node starts")
    prefill_workers: int = Field(0, ge=0, le=511, description="of those, how many form the prefill pool, the rest "
                                 "the decode pool (docs/pd.md); 0: every worker aggregated")
    backend: BackendName = Field("sim", description="simulated workers, or real vLLM")
    host: str = Field("127.0.0.1", description="the address the router, the controller and the workers bind to "
                      "(not the embedded etcd and broker: etcd_host, mqtt_host)")
    run_dir: Path = Field(Path(".fleetward"), description="where logs, data and the running fleet's state go")
    etcd: str | None = Field(None, description="attach to this etcd (host:port; a cluster's members "
                             "comma-separated: a:2379,b:2379,c:2379) instead of starting one")
    etcd_port: int = Field(0, ge=0, le=65535, description="port for the embedded etcd; 0 picks a free one")
    mqtt: str | None = Field(None, description="attach to this broker (host:port) instead of starting one")
    mqtt_port: int = Field(0, ge=0, le=65535, description="port for the embedded broker; 0 picks a free one")
    etcd_host: str = Field("127.0.0.1", description="address the embedded etcd binds (``host`` does not expose it)")
    mqtt_host: str = Field("127.0.0.1", description="address the embedded broker binds (``host`` does not expose "
                           "it)")
    etcd_access: AccessConfig = Field(AccessConfig(), description="TLS and credentials for etcd")
    mqtt_access: AccessConfig = Field(AccessConfig(), description="TLS and credentials for the broker")
    tls: bool = Field(False, description="``up``: start the embedded etcd and broker with TLS (client certificates "
                      "required) and passwords, all generated in the run dir; etcd_access and mqtt_access are "
                      "then filled in")
    worker_base_port: int = Field(0, ge=0, le=65535, description="first worker port; 0 picks free ones")
    lease_ttl_s: int = Field(10, ge=2, le=3600, description="workers' registration lease (the agent's)")
    node: str = Field(default_factory=lambda: os.uname().nodename, description="this node's name (default: the "
                      "host name)")
    advertise_host: str | None = Field(None, description="the address other hosts reach this node's workers and "
                                       "adopted servers at, when they listen on loopback or on every address "
                                       "(127.0.0.1, 0.0.0.0): default this host's address on its route to etcd when "
                                       "etcd is on another host, else as they listen (docs/deploy.md)")
    router: bool = Field(True, description="start a router in front of the workers")
    controller: bool = Field(True, description="start a supervisor controller (health verdicts, remediation)")
    attach: tuple[AttachConfig, ...] = Field((), description="servers fleetward did not start, to protect")
    attach_lifetime: Literal["kept", "agent"] = Field(
        "kept", description="kept: the attach: entries this file's agent published stay in etcd when it stops (a "
        "host that comes back adopts them again); agent: an agent that stops gives them up, and their workers' "
        "records go (a Kubernetes pod, which never comes back: the sidecar's fleet file)")
    admin_token_file: Path | None = Field(None, description="a file holding the admin token (mode 0600); "
                                          "FLEETWARD_ADMIN_TOKEN wins over it")
    sim: SimConfig = Field(SimConfig(), description="the simulated workers (``backend: sim``)")
    vllm: VllmConfig = Field(VllmConfig(), description="the vLLM workers (``backend: vllm``)")
    routing: RouterConfig = Field(RouterConfig(), description="the router")
    supervisor: SupervisorConfig = Field(SupervisorConfig(), description="health detection and remediation")
    autoscale: AutoscaleConfig = Field(AutoscaleConfig(), description="SLA-driven scaling of the workers")
    prometheus: PrometheusConfig = Field(PrometheusConfig(), description="a local Prometheus with the alert rules")
    gpu: GpuConfig = Field(GpuConfig(), description="GPU health: where the agent reads it, GPUs per worker, the "
                           "policy")

    @field_validator("etcd", "mqtt")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is None:
            return None
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"expected host:port, got {value!r}")
        return value

    @model_validator(mode="after")
    def _a_decode_pool(self) -> FleetConfig:
        if self.prefill_workers and self.prefill_workers >= self.workers:
            raise ValueError(f"prefill_workers={self.prefill_workers} leaves no decode worker among "
                             f"workers={self.workers}")
        return self


def admin_token_from_env() -> SecretStr:
    """The token that protects admin and control endpoints.

    ``FLEETWARD_ADMIN_TOKEN`` when set; otherwise a fresh random token for this run. It is a
    :class:`SecretStr`, so it prints as ``**********`` in logs and reprs.
    """
    raw = os.environ.get("FLEETWARD_ADMIN_TOKEN")
    return SecretStr(raw if raw else secrets.token_urlsafe(24))


def admin_token_from_file(path: Path) -> SecretStr:
    """The admin token in ``path``; :class:`ConfigError` when it is missing, empty, or readable by others."""
    return _secret_file(path, field="admin_token_file", what="admin token")


def admin_token_for(config: FleetConfig) -> SecretStr:
    """``FLEETWARD_ADMIN_TOKEN``, else ``admin_token_file``, else a fresh random token for this run."""
    given = admin_token_given()
    if given is not None:
        return given
    if config.admin_token_file is not None:
        return admin_token_from_file(config.admin_token_file)
    return SecretStr(secrets.token_urlsafe(24))


def admin_token_given() -> SecretStr | None:
    """``FLEETWARD_ADMIN_TOKEN`` when set (None otherwise: the caller looks where its fleet keeps one)."""
    raw = os.environ.get("FLEETWARD_ADMIN_TOKEN", "").strip()
    return SecretStr(raw) if raw else None


class _LineLoader(yaml.SafeLoader):
    """A safe loader that remembers the line of every mapping key and sequence item."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        # A value that matches a YAML type's pattern but is not one (2001-02-30, 0b_) is a ValueError from
        # the constructor: make it a YAML error at the value's line.
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, OverflowError) as exc:
            raise yaml.constructor.ConstructorError(None, None, f"cannot read {node.value!r}: {exc}",
                                                    node.start_mark) from None


# Bounds on what a config or experiment file may be: they hold hundreds of values, a few levels deep.
_MAX_DEPTH = 64
_MAX_VALUES = 100_000  # aliases counted as what they stand for (a "billion laughs" file expands past it)
_OPENING = (yaml.BlockMappingStartToken, yaml.BlockSequenceStartToken, yaml.FlowMappingStartToken,
            yaml.FlowSequenceStartToken)
_CLOSING = (yaml.BlockEndToken, yaml.FlowMappingEndToken, yaml.FlowSequenceEndToken)


def _yaml_error(exc: yaml.YAMLError, text: str, file: str) -> ConfigError:
    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML does not allow: a position, no mark
        return ConfigError(f"not valid YAML: {exc.reason} {exc.character!r}", file=file,
                           line=text.count("\n", 0, exc.position) + 1)
    mark = getattr(exc, "problem_mark", None)
    line = mark.line + 1 if mark is not None else None
    problem = getattr(exc, "problem", None) or str(exc)
    return ConfigError(f"not valid YAML: {problem}", file=file, line=line)


def parse_yaml(text: str, *, file: str) -> tuple[Any, dict[Path_, int]]:
    """Parse YAML, returning the data and a map from each path to its 1-based line.

    Whatever the text, the answer is the data or a :class:`ConfigError` with the line: bad YAML, tags the
    safe loader does not know, keys that cannot be keys, values nested more than ``_MAX_DEPTH`` deep
    (PyYAML recurses), or more than ``_MAX_VALUES`` of them once aliases are expanded (or an alias within
    itself).
    """
    try:
        depth = 0
        for token in yaml.scan(text, Loader=_LineLoader):  # the scanner does not recurse; the composer does
            if isinstance(token, _OPENING):
                depth += 1
                if depth > _MAX_DEPTH:
                    raise ConfigError(f"nested more than {_MAX_DEPTH} levels deep", file=file,
                                      line=token.start_mark.line + 1)
            elif isinstance(token, _CLOSING):
                depth -= 1
        node = yaml.compose(text, Loader=_LineLoader)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, text, file) from exc
    if node is None:  # an empty file: what it lacks is reported at line 1
        return {}, {(): 1}
    lines: dict[Path_, int] = {(): node.start_mark.line + 1}
    todo: list[tuple[yaml.Node, Path_]] = [(node, ())]
    seen = 0
    while todo:
        n, path = todo.pop()
        seen += 1
        if seen > _MAX_VALUES or len(path) > _MAX_DEPTH:
            problem = (f"more than {_MAX_VALUES:,} values" if seen > _MAX_VALUES
                       else f"nested more than {_MAX_DEPTH} levels deep")
            raise ConfigError(f"{problem} once its aliases are expanded", file=file, line=n.start_mark.line + 1)
        if isinstance(n, yaml.MappingNode):
            for key_node, value_node in n.value:
                child = (*path, str(key_node.value))
                lines[child] = key_node.start_mark.line + 1
                todo.append((value_node, child))
        elif isinstance(n, yaml.SequenceNode):
            for i, item in enumerate(n.value):
                lines[(*path, i)] = item.start_mark.line + 1
                todo.append((item, (*path, i)))
    try:
        data = yaml.load(text, Loader=_LineLoader)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, text, file) from exc
    return data, lines


def _line_for(lines: Mapping[Path_, int], path: Path_) -> int | None:
    while path:
        if path in lines:
            return lines[path]
        keyed = tuple(str(p) for p in path)  # an integer mapping key (gpu.policy.xid.13) is a string in the file
        if keyed in lines:
            return lines[keyed]
        path = path[:-1]
    return lines.get(())


def _field_name(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def validation_error(exc: ValidationError, *, file: str, lines: Mapping[Path_, int]) -> ConfigError:
    """Turn pydantic's errors into one :class:`ConfigError` naming file, line and field of each."""
    problems = []
    first: tuple[int | None, str] | None = None
    for err in exc.errors():
        # Pydantic puts union/tag names into loc; keep only the parts that exist in the file.
        loc = tuple(p for p in err["loc"] if isinstance(p, int) or not str(p).startswith(("function-", "tagged")))
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        line = _line_for(lines, loc)
        field = _field_name(loc)
        problems.append((line, field, msg))
        if first is None:
            first = (line, field)
    assert first is not None
    if len(problems) == 1:
        line, field, msg = problems[0]
        return ConfigError(msg, file=file, line=line, field=field or None)
    detail = "; ".join(f"line {ln}: {fld}: {msg}" for ln, fld, msg in problems)
    return ConfigError(f"{len(problems)} problems: {detail}", file=file, line=first[0], field=first[1] or None)


def load_model(model: type[M], path: str | Path, *, overrides: Mapping[str, Any] | None = None) -> M:
    """Read a YAML file into ``model``; errors name the file, the line and the field.

    ``overrides`` (e.g. from command-line flags) are applied on top of the file's keys; a dotted key
    (``routing.port``) sets one key of a section and keeps the section's others.
    """
    file = str(path)
    data, lines = parse_yaml(read_text(path), file=file)
    if not isinstance(data, dict):
        raise ConfigError("the top level must be a mapping of keys to values", file=file, line=1)
    try:
        return model.model_validate(_merge(data, overrides or {}))
    except ValidationError as exc:
        raise validation_error(exc, file=file, lines=lines) from None


def read_text(path: str | Path) -> str:
    """A config or experiment file's text: UTF-8, or a :class:`ConfigError` with the line of the first bad byte."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", file=str(path)) from exc
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text ({exc.reason} at byte {exc.start})", file=str(path),
                          line=raw.count(b"\n", 0, exc.start) + 1) from None


def _merge(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(data)
    for key, value in overrides.items():
        *sections, leaf = key.split(".")
        at = merged
        for section in sections:
            inner = at.get(section)
            at[section] = at = dict(inner) if isinstance(inner, Mapping) else {}
        at[leaf] = value
    return merged


def load_fleet_config(path: str | Path | None, overrides: Mapping[str, Any] | None = None) -> FleetConfig:
    """The fleet config from an optional file plus flag overrides (flags win)."""
    if path is not None:
        return load_model(FleetConfig, path, overrides=overrides)
    try:
        return FleetConfig.model_validate(_merge({}, overrides or {}))
    except ValidationError as exc:
        raise validation_error(exc, file="<command line>", lines={}) from None
