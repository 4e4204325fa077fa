"""The router's Prometheus metrics (one registry per router; the catalogue is docs/metrics.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fleetward.fleet.kv import KV_ERROR_KINDS

__all__ = ["RouterMetrics"]


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("fleetward_router_requests", "Requests by endpoint and outcome.",
                                ["endpoint", "outcome"], registry=r)
        self.tokens = Counter("fleetward_router_tokens", "Completion tokens delivered to clients.", registry=r)
        self.received = Counter("fleetward_router_requests_received", "New requests accepted (resumes not counted): "
                                "the arrival rate the autoscaler plans for.", ["endpoint"], registry=r)
        self.migrations = Counter("fleetward_router_migrations", "Streams resumed on another worker, by trigger.",
                                  ["reason"], registry=r)
        self.upstream_errors = Counter("fleetward_router_upstream_errors", "Failed upstream attempts by kind.",
                                       ["kind"], registry=r)
        self.prefills = Counter("fleetward_router_prefills", "Prefill/decode: prompts prefilled on a prefill worker "
                                "before their decode, by outcome (failed: the decode worker computed the prompt "
                                "itself).", ["outcome"], registry=r)
        for outcome in ("ok", "failed"):
            self.prefills.labels(outcome)
        self.prefill_seconds = Histogram("fleetward_router_prefill_seconds",
                                         "Prefill/decode: how long the prefill step took (successful ones).",
                                         buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r)
        self.kv_failures = Counter("fleetward_router_kv_transfer_failures", "Prefill/decode: KV transfers a decode "
                                   "worker refused, by what its checks found (handled by routing.kv_failure_policy)",
                                   ["kind"], registry=r)
        for kind in KV_ERROR_KINDS:
            self.kv_failures.labels(kind)
        self.in_flight = Gauge("fleetward_router_in_flight_requests", "Requests being served.", registry=r)
        self.key_requests = Counter("fleetward_router_api_key_requests", "Requests by API key (its name in "
                                    "routing.api_keys_file) and whether its concurrency limit let them in.",
                                    ["key", "result"], registry=r)
        self.auth_failures = Counter("fleetward_router_auth_failures", "Requests refused for a missing or wrong "
                                     "API key (401).", ["reason"], registry=r)
        for reason in ("missing", "wrong"):
            self.auth_failures.labels(reason)
        self.shed = Counter("fleetward_router_shed", "New requests refused (503) because the router holds "
                            "routing.max_in_flight already.", ["reason"], registry=r)
        self.shed.labels("in_flight")
        self.stall = Histogram("fleetward_router_migration_stall_seconds",
                               "Client-visible gap between the last token before a failure and the first after it.",
                               buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 5, 10, 30), registry=r)
        self.ttft = Histogram("fleetward_router_time_to_first_token_seconds", "Time to first token at the router, "
                              "by the model asked for (one the fleet serves).", ["model"],
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 5, 7.5, 10, 15,
                                       30, 60), registry=r)
        self.itl = Histogram("fleetward_router_time_per_output_token_seconds",
                             "A streamed request's mean inter-token latency after its first token, at the router, by "
                             "the model asked for.", ["model"],
                             buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5),
                             registry=r)
        self.checkpoint_flush = Histogram("fleetward_router_checkpoint_flush_seconds",
                                          "Duration of a checkpoint flush (every live journal's changes, one etcd "
                                          "transaction per batch).",
                                          buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
                                          registry=r)
        self.checkpoint_slice = Histogram("fleetward_router_checkpoint_slice_seconds",
                                          "How long a checkpoint flush held the event loop at a stretch (it "
                                          "encodes in slices and lets tokens through in between).",
                                          buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025),
                                          registry=r)
        self.checkpoint_bytes = Counter("fleetward_router_checkpoint_bytes",
                                        "Bytes of checkpoint values written (whole bases and deltas): to etcd, or "
                                        "to the peer router that keeps them (routing.checkpoint_store: peers).",
                                        registry=r)
        self.checkpoint_lag = Gauge("fleetward_router_checkpoint_lag_seconds",
                                    "Seconds since a checkpoint flush last succeeded (0 with checkpoints off).",
                                    registry=r)
        self.replica_bytes = Gauge("fleetward_router_replica_bytes",
                                   "Bytes of other routers' checkpoints this router holds for them "
                                   "(routing.checkpoint_store: peers; 0 otherwise).", registry=r)
        self.migration_failures = Counter("fleetward_router_migration_failures",
                                          "Streams that could not be resumed after a worker failed, by why "
                                          "(limit: migration_limit exhausted; not_resumable; deadline; no_worker; "
                                          "poison: routing.poison_workers workers failed while serving it).",
                                          ["reason"], registry=r)
        for reason in ("limit", "not_resumable", "deadline", "no_worker", "poison"):  # at 0: increase() sees the 1st
            self.migration_failures.labels(reason)
        self.moves = Counter("fleetward_router_moves",
                             "Planned moves of streams (drain, scale-down, operator, rebalance), by trigger and "
                             "outcome (kv: continued from the KV it carried; reprefill: the KV path failed and the "
                             "stream was computed again; failed: it could not continue).",
                             ["trigger", "outcome"], registry=r)
        for trigger in ("drain", "scale-down", "operator", "rebalance"):  # at 0, so increase() sees the first
            for outcome in ("kv", "reprefill", "failed"):
                self.moves.labels(trigger, outcome)
        self.move_stall = Histogram("fleetward_router_move_stall_seconds",
                                    "A planned move's stall: from the stream's last token on the worker it left "
                                    "to its first on the next, by outcome.", ["outcome"],
                                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r)
        self.move_bytes = Counter("fleetward_router_move_kv_bytes",
                                  "KV bytes planned moves carried (as the worker that handed them over counted "
                                  "them; a connector that moves KV as files reports none).", registry=r)
        self.move_tokens = Counter("fleetward_router_move_kv_tokens",
                                   "Tokens whose KV planned moves carried instead of computing them again.",
                                   registry=r)
        self.checkpoint_flushes = Counter("fleetward_router_checkpoint_flushes",
                                          "Checkpoint flushes that wrote something.", registry=r)
        self.checkpoint_txns = Counter("fleetward_router_checkpoint_txns", "Checkpoint writes: etcd transactions, "
                                       "and requests to the peer router that keeps them (checkpoint_store: peers).",
                                       registry=r)
        self.passthrough_retries = Counter(
            "fleetward_router_passthrough_retries", "Passed-through requests (embeddings, responses, tokenize, ...) "
            "tried again on another worker before the client had a byte, by endpoint and why (connect; status: "
            "a 5xx; broken: the answer broke off).", ["endpoint", "reason"], registry=r)
        self.passthrough_cut = Counter(
            "fleetward_router_passthrough_cut", "Passed-through answers whose worker failed after the client had "
            "part of them: ended with an error event (streams) or a cut connection, by endpoint.", ["endpoint"],
            registry=r)
        self.upstream_attempts = Counter("fleetward_router_upstream_attempts", "Requests sent to workers, by "
                                         "attempt (first: a request's, or a choice's, first; retry: after a failure; "
                                         "move: a planned move or a KV handover tried again). All over first: how "
                                         "much load the routers add to a failing fleet.", ["attempt"], registry=r)
        for attempt in ("first", "retry", "move"):
            self.upstream_attempts.labels(attempt)
        self.too_large = Counter("fleetward_router_requests_too_large", "Requests answered 413: a body over "
                                 "routing.max_request_bytes.", registry=r)
        self.transfer_params_stripped = Counter(
            "fleetward_router_client_transfer_params_stripped", "Client requests that named a worker-to-worker "
            "parameter (kv_transfer_params, ec_transfer_params), taken out before the request went on, by "
            "parameter.", ["param"], registry=r)
        self.retries_refused = Counter("fleetward_router_retry_budget_refused", "Retries not made because the retry "
                                       "budget was spent: the client got the worker's failure at once.", registry=r)
        self.retry_tokens = Gauge("fleetward_router_retry_budget_tokens", "Tokens in the retry budget (retries of "
                                  "requests a worker answered with an error go ahead while over half full).",
                                  registry=r)
        self.workers_routable = Gauge("fleetward_router_workers_routable", "Workers new requests may go to.",
                                      registry=r)
        self.workers_held = Gauge("fleetward_router_workers_held", "Workers still routed to although their records "
                                  "vanished while the store was out of this router's reach (routing."
                                  "store_outage_hold_s): until they are written again or fail.", registry=r)

    def transfer_params_taken(self, params: list[str]) -> None:
        """A client's worker-to-worker parameters, taken out of its request (:mod:`.guard`), counted."""
        for param in params:
            self.transfer_params_stripped.labels(param).inc()
