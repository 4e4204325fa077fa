"""The load model of docs/scale.md: every shared resource's load as a function of the fleet's size.

Pure arithmetic, no IO: :class:`Workload` (the fleet and its traffic), :class:`Units` (per-unit costs, measured
by ``fleetward bench scale`` on the machine it runs on), :data:`LIMITS` (each resource's limit and where it
comes from) and :func:`loads`, the formulas. Every formula is written once, here; docs/scale.md prints them
beside the measured units and the table this produces.

Checkpoint designs (how in-flight journals are kept for a resume on another router) are compared on paper by
:data:`DESIGNS`: ``etcd`` (today's: a base per request, a delta per stream per flush), ``etcd-sharded``
(today's, over ``shards`` etcd clusters), ``etcd-log`` (only what a resume needs, one record per router per
flush, the base still in etcd) and ``peer`` (journals replicated router to router; etcd holds only a change of
ownership).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

__all__ = ["DESIGNS", "FLEET_SIZED_LABELS", "HOSTS", "LIMITS", "PER_WORKER_METRICS", "Limit", "Units", "Workload",
           "first_over", "loads", "table"]

HOSTS = (10, 100, 1000, 10000)
# Labels whose values grow with the fleet (one per worker, host, router or GPU): a metric that carries one has
# a series per member, and the model counts it. Every such metric is named here, with its term in loads().
FLEET_SIZED_LABELS = frozenset({"worker", "node", "host", "router", "gpu", "pool_member"})
PER_WORKER_METRICS = frozenset({"fleetward_supervisor_worker_restarts_total"})  # series_per_restarted_worker
GiB = 2**30


@dataclass(frozen=True)
class Workload:
    """A fleet and its traffic. The defaults: 8 servers per GPU host; 16 streams per server at 25 tokens/s
    each (3.2M tokens/s at 1,000 hosts: "a few million"); request lengths from the Azure conversation trace
    in ../shared/traces (prompts 1,155 tokens, answers 211 on average)."""

    servers_per_host: int = 8
    streams_per_server: int = 16
    tokens_per_s_per_stream: float = 25.0
    prompt_tokens: int = 1155
    output_tokens: int = 211
    chars_per_token: float = 4.0  # text of a prompt or an answer, per token (English with a BPE vocabulary)
    flush_interval_s: float = 0.075  # routing.checkpoint_interval_ms
    router_cpu_target: float = 0.6  # routers are sized to run at this share of a core each
    failures_per_worker_day: float = 1.0  # pessimistic: crashes, hangs and GPU faults that restart a worker
    controllers: int = 2
    autoscalers: int = 2
    event_subscribers: int = 3  # the controllers and one `fleetward events` (the autoscaler takes scale only)
    compaction_retention_s: float = 300.0  # etcd --auto-compaction-retention=5m: history kept before compaction
    shards: int = 4  # etcd-sharded: checkpoint clusters

    def streams(self, hosts: int) -> float:
        return hosts * self.servers_per_host * self.streams_per_server

    def tokens_per_s(self, hosts: int) -> float:
        return self.streams(hosts) * self.tokens_per_s_per_stream

    def requests_per_s(self, hosts: int) -> float:
        return self.tokens_per_s(hosts) / self.output_tokens


@dataclass(frozen=True)
class Units:
    """Per-unit costs; the defaults are placeholders a run replaces with what it measured (``measured``
    names the ones it did)."""

    router_cpu_s_per_token: float = 44e-6
    router_rss_bytes_base: float = 120e6
    router_rss_bytes_per_stream: float = 60e3
    checkpoint_delta_fixed_bytes: float = 250.0  # key and value of one delta, without its tokens
    checkpoint_delta_bytes_per_token: float = 16.0
    checkpoint_base_fixed_bytes: float = 600.0  # key and value of a base, without prompt and answer
    checkpoint_base_bytes_per_prompt_token: float = 11.0  # its prompt ids and the prompt's text
    checkpoint_base_bytes_per_output_token: float = 16.0
    log_entry_fixed_bytes: float = 8.0  # etcd-log: one stream's entry in a router's record, without tokens
    log_bytes_per_token: float = 3.0  # etcd-log: a token id packed as a varint (text rebuilt on read)
    log_record_fixed_bytes: float = 120.0  # etcd-log: one router's record per flush (key, header)
    etcd_writes_per_worker_s: float = 0.01  # health, signals, registration rewrites in a steady fleet
    watchers_per_router: float = 6.0
    watchers_per_agent: float = 3.0
    controller_cores_fixed: float = 0.01
    controller_cores_per_worker: float = 80e-6
    canaries_per_worker_s: float = 1 / 15
    series_per_router: float = 150.0
    series_per_agent: float = 40.0
    series_per_controller: float = 60.0
    series_per_restarted_worker: float = 1.0  # the controller's fleetward_supervisor_worker_restarts_total{worker}
    series_per_vllm_server: float = 150.0
    mqtt_messages_per_s_capacity: float = 20000.0
    events_per_failure: float = 6.0
    measured: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class Limit:
    value: float
    unit: str
    source: str


LIMITS: dict[str, Limit] = {
    "etcd_requests_per_s": Limit(30000, "requests/s", "etcd performance guide: a 3-member cluster on common "
                                 "cloud machines completes more than 30,000 requests/s under heavy load"),
    "etcd_keys_written_per_s": Limit(30000, "keys/s", "the same guide's figure, taken per key written (each put "
                                     "or delete in a transaction is a revision and a B-tree entry of its own)"),
    "etcd_bytes_per_s": Limit(8 * GiB / 300, "bytes/s", "etcd keeps every revision until compaction: 8 GiB, the "
                              "largest quota etcd suggests (--quota-backend-bytes), over the 5-minute retention"),
    "etcd_db_bytes": Limit(8 * GiB, "bytes", "etcd system limits: 8 GiB is the suggested maximum quota"),
    "etcd_live_keys": Limit(2e6, "keys", "etcd hardware guide: 'millions of keys' make a heavy deployment "
                            "(16-64 GB of memory); an order of magnitude, not a hard limit"),
    "etcd_watchers": Limit(1e4, "watchers", "etcd hardware guide: 'thousands of watchers' make a heavy deployment; "
                           "an order of magnitude, not a hard limit"),
    "etcd_lease_keepalives_per_s": Limit(30000, "requests/s", "counted in etcd's requests too (30,000/s)"),
    "mqtt_messages_per_s": Limit(math.nan, "messages/s", "measured: one Mosquitto broker on this machine, QoS 1, "
                                 "every message delivered to one subscriber"),
    "controller_cpu_cores": Limit(1.0, "cores", "one Python process: the leader does all the work on one core"),
    "router_cpu_cores": Limit(1.0, "cores", "one router process runs on one core (routing.processes adds processes)"),
    "router_memory_bytes": Limit(4 * GiB, "bytes", "a sizing choice: the memory a router process is given"),
    "prometheus_series": Limit(1e7, "series", "a sizing choice: one Prometheus server's budget (Prometheus "
                               "documents no hard limit; memory grows with active series)"),
}

DESIGNS = ("etcd", "etcd-sharded", "etcd-log", "peer")


def routers(w: Workload, u: Units, hosts: int) -> int:
    """Router processes the token rate needs at ``router_cpu_target`` of a core each (two at least)."""
    return max(2, math.ceil(w.tokens_per_s(hosts) * u.router_cpu_s_per_token / w.router_cpu_target))


def _checkpoints(w: Workload, u: Units, hosts: int, design: str) -> dict[str, float]:
    """etcd's load from checkpoints alone: requests (transactions), keys written, bytes, live keys and
    bytes, per second where a rate."""
    s, tok, q = w.streams(hosts), w.tokens_per_s(hosts), w.requests_per_s(hosts)
    flushes = 1 / w.flush_interval_s
    dirty = min(flushes, w.tokens_per_s_per_stream)  # flushes per second that find a stream changed
    r = routers(w, u, hosts)
    life_s = w.output_tokens / w.tokens_per_s_per_stream
    base = (u.checkpoint_base_fixed_bytes + u.checkpoint_base_bytes_per_prompt_token * w.prompt_tokens
            + u.checkpoint_base_bytes_per_output_token * w.output_tokens / 2)
    if design == "peer":
        # etcd holds only a change of ownership: a claim when a client resumes on another router. A router's
        # death sends its streams elsewhere; failures_per_worker_day stands for routers too (pessimistic).
        claims = s * w.failures_per_worker_day / 86400
        return {"requests": claims, "keys": claims, "bytes": claims * 200, "live_keys": 0.0, "live_bytes": 0.0}
    if design == "etcd-log":
        records = r * flushes  # one record per router per flush (under etcd's 1.5 MiB request size)
        bytes_ = records * u.log_record_fixed_bytes + s * dirty * u.log_entry_fixed_bytes + tok * u.log_bytes_per_token
        bases = q  # a base per request (body and prompt ids), never rewritten: the log holds the rest
        bytes_ += bases * (u.checkpoint_base_fixed_bytes + u.checkpoint_base_bytes_per_prompt_token * w.prompt_tokens)
        keys = records * 2 + bases * 2  # each record and base is put, then deleted
        live_keys = s + records * life_s  # bases, and the records a live stream may still need
        live_bytes = s * base + bytes_ * life_s
        return {"requests": records + q, "keys": keys, "bytes": bytes_, "live_keys": live_keys,
                "live_bytes": live_bytes}
    deltas_per_request = dirty * life_s
    delta = u.checkpoint_delta_fixed_bytes + u.checkpoint_delta_bytes_per_token * w.tokens_per_s_per_stream / dirty
    rebases = math.floor(deltas_per_request * delta / base)  # a base is rewritten once its deltas outweigh it
    puts = s * dirty + q * rebases  # every flush that finds a stream changed writes a delta or a base
    deletes = puts  # every key written goes: deltas at a rebase or the end, the base at the end
    bytes_ = s * dirty * delta + q * (1 + rebases) * base
    ops_per_router_flush = (puts + deletes) / r / flushes
    txns = r * flushes * math.ceil(ops_per_router_flush / 64)
    live_keys = s * (1 + deltas_per_request / (rebases + 1) / 2)
    live_bytes = s * (base + deltas_per_request / (rebases + 1) / 2 * delta)
    out = {"requests": txns, "keys": puts + deletes, "bytes": bytes_, "live_keys": live_keys, "live_bytes": live_bytes}
    if design == "etcd-sharded":
        out = {k: v / w.shards for k, v in out.items()}
    return out


def _held_bytes_per_stream(w: Workload, u: Units) -> float:
    """peers: what a holder keeps of one stream: its base and deltas, which never outgrow the base (1.5 times
    a base half-way through the answer, on average)."""
    return 1.5 * (u.checkpoint_base_fixed_bytes + u.checkpoint_base_bytes_per_prompt_token * w.prompt_tokens
                  + u.checkpoint_base_bytes_per_output_token * w.output_tokens / 2)


def loads(w: Workload, u: Units, hosts: int, design: str = "etcd") -> dict[str, float]:
    """Every resource's load at ``hosts`` hosts (keys of :data:`LIMITS`)."""
    workers = hosts * w.servers_per_host
    r = routers(w, u, hosts)
    cp = _checkpoints(w, u, hosts, design)
    # Leases: an agent's (10 s), a router's registration (5 s) and checkpoints (30 s), each leader-elected
    # service's (5 s); a keepalive every ttl / 3 (fleet/lease.py).
    keepalives = hosts * 3 / 10 + r * (3 / 5 + 3 / 30) + (w.controllers + w.autoscalers) * 3 / 5
    fleet_writes = workers * u.etcd_writes_per_worker_s
    events = workers * w.failures_per_worker_day / 86400 * (u.events_per_failure + w.streams_per_server)
    fleet_keys = workers * 4 + hosts * 1 + r  # workers/, health/, signals/ (2); agents/; routers/
    return {
        "etcd_requests_per_s": cp["requests"] + fleet_writes + keepalives,
        "etcd_keys_written_per_s": cp["keys"] + fleet_writes,
        "etcd_bytes_per_s": cp["bytes"] + fleet_writes * 400,
        "etcd_db_bytes": cp["live_bytes"] + (cp["bytes"] + fleet_writes * 400) * w.compaction_retention_s,
        "etcd_live_keys": cp["live_keys"] + fleet_keys,
        "etcd_watchers": r * u.watchers_per_router + hosts * u.watchers_per_agent,
        "etcd_lease_keepalives_per_s": keepalives,
        "mqtt_messages_per_s": events * w.event_subscribers,
        "controller_cpu_cores": u.controller_cores_fixed + u.controller_cores_per_worker * workers,
        "router_cpu_cores": w.tokens_per_s(hosts) * u.router_cpu_s_per_token / r,
        "router_memory_bytes": (u.router_rss_bytes_base + u.router_rss_bytes_per_stream * w.streams(hosts) / r
                                + (w.streams(hosts) / r * _held_bytes_per_stream(w, u) if design == "peer" else 0)),
        "prometheus_series": (r * u.series_per_router + hosts * u.series_per_agent
                              + (w.controllers + w.autoscalers) * u.series_per_controller
                              + w.controllers * workers * u.series_per_restarted_worker  # every worker, once
                              + workers * u.series_per_vllm_server),
    }


def table(w: Workload, u: Units, design: str = "etcd", hosts: tuple[int, ...] = HOSTS) -> dict[str, Any]:
    """``{"<hosts>": {"<resource>": {"load", "limit", "unit"}}}`` (``scale.json``'s ``table``)."""
    limits = {k: replace(v, value=u.mqtt_messages_per_s_capacity) if k == "mqtt_messages_per_s" else v
              for k, v in LIMITS.items()}
    out: dict[str, Any] = {}
    for h in hosts:
        out[str(h)] = {k: {"load": v, "limit": limits[k].value, "unit": limits[k].unit}
                       for k, v in loads(w, u, h, design).items()}
    return out


def first_over(tab: dict[str, Any]) -> dict[str, Any] | None:
    """The smallest size at which a resource passes its limit, and which (the most over it first)."""
    for h in sorted(tab, key=int):
        over = sorted(((row["load"] / row["limit"], name) for name, row in tab[h].items()
                       if row["load"] > row["limit"]), reverse=True)
        if over:
            return {"hosts": int(h), "resources": [{"resource": n, "times_limit": x} for x, n in over]}
    return None


def describe(w: Workload) -> dict[str, Any]:
    return {**asdict(w), "at_1000_hosts": {"streams": w.streams(1000), "tokens_per_s": w.tokens_per_s(1000),
                                           "requests_per_s": w.requests_per_s(1000)}}
