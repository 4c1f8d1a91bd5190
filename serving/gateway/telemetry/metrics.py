"""Prometheus metrics of one gateway process, served at GET /metrics on the metrics port (never
the public one: tenant names and usage are nobody else's business).

Each app gets its own `CollectorRegistry` (not prometheus_client's global one), so several
gateways in one test process do not collide, and /metrics shows gateway metrics only.

Label values are bounded on purpose. `model` comes from request bodies, which anyone with a
key can fill with junk: a name the stack does not serve is counted as `other`, so a caller
cannot grow the series count; "" means the request named no model. `tenant` comes from key records
the platform team creates.
`status` is the HTTP status code. Unauthenticated requests have tenant "".

The names below are a contract: the Grafana dashboard and the alert rules in `ops/` use them,
and a test checks that they reference nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from serving.gateway.limits.budget_metrics import BudgetUsage
from serving.gateway.limits.budgets import NANO_PER_USD

OTHER_MODEL = "other"
# From 5 ms (a refused request) to 10 min (a long stream); TTFT buckets stop at 1 min.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)

__all__ = ["CONTENT_TYPE_LATEST", "GatewayMetrics", "OTHER_MODEL"]


class GatewayMetrics:
    def __init__(self, served_models: Iterable[str]) -> None:
        self.served_models = frozenset(served_models)
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "llmstack_gateway_requests",
            "Requests answered, by HTTP status, model and tenant.",
            ["status", "model", "tenant"],
            registry=r,
        )
        self.duration = Histogram(
            "llmstack_gateway_request_duration_seconds",
            "Time from request to the last byte of the response (whole stream), by model.",
            ["model"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "llmstack_gateway_time_to_first_token_seconds",
            "Streams only: time from request to the first chunk carrying generated text, by model.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "llmstack_gateway_tokens",
            "Tokens billed, by kind (prompt|completion), model and tenant.",
            ["kind", "model", "tenant"],
            registry=r,
        )
        self.rate_limited = Counter(
            "llmstack_gateway_rate_limited",
            "Admissions over a limit, by limit (requests|tokens|concurrency|daily_tokens|monthly_budget) and mode "
            "(enforced: refused with 429; shadow: the key is in shadow mode, so only counted and logged).",
            ["limit", "mode"],
            registry=r,
        )
        self.redis_errors = Counter(
            "llmstack_gateway_redis_errors",
            "Redis calls that failed, by component (keys|limiter|queue).",
            ["component"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "llmstack_gateway_upstream_errors",
            "Upstream failures, by kind (unavailable|timeout|failed|stream_broken|idle_timeout|total_timeout|"
            "error_status: a 5xx or redirect answer).",
            ["kind"],
            registry=r,
        )
        # Streams continued on another replica after theirs died (serving.gateway.resume).
        self.stream_resumes = Counter(
            "llmstack_gateway_stream_resumes",
            "Streams continued on another replica, by model and why the upstream stream ended (connection_reset|"
            "eof_without_done|idle_timeout|upstream_unavailable|engine_error).",
            ["model", "reason"],
            registry=r,
        )
        self.stream_resume_failures = Counter(
            "llmstack_gateway_stream_resume_failures",
            "Interrupted streams that ended with an error event instead (past max_resumes or the deadline, an answer "
            "that cannot be continued, an upstream failure that is not a lost replica), by model and reason.",
            ["model", "reason"],
            registry=r,
        )
        self.stream_resume_gap = Histogram(
            "llmstack_gateway_stream_resume_gap_seconds",
            "Time between the upstream stream breaking and the client's next bytes from its continuation, by model.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.stream_resume_overhead_tokens = Counter(
            "llmstack_gateway_stream_resume_overhead_tokens",
            "Tokens the engine processed again for continuations and nobody is billed for: the platform's cost, by "
            "model and kind (prompt: the re-done prefill; completion: tokens generated again at the seam).",
            ["model", "kind"],
            registry=r,
        )
        self.answer_retries = Counter(
            "llmstack_gateway_answer_retries",
            "Non-streamed completions sent once more because their replica died before answering, by model and "
            "reason (connection_reset|upstream_unavailable).",
            ["model", "reason"],
            registry=r,
        )
        self.in_flight = Gauge(
            "llmstack_gateway_in_flight_requests", "Requests being answered now (streams included).", registry=r
        )
        self.degraded = Gauge(
            "llmstack_gateway_degraded",
            "1 while Redis is unreachable and keys come from the local cache and limits are per replica.",
            registry=r,
        )
        # Cost: the rate card monthly budgets are charged at, and how much of each budget is spent.
        self.model_price = Gauge(
            "llmstack_gateway_model_usd_per_million_tokens",
            "The model's rate card: USD per 1M prompt + completion tokens at full use (from the stack's plan).",
            ["model"],
            registry=r,
        )
        # The fair queue (serving.gateway.queue.fair_queue): waiting for a slot of a saturated model.
        self.queue_waiting = Gauge(
            "llmstack_gateway_queue_waiting",
            "Requests of this gateway process waiting for a slot, by model and tier (sum over pods: the queue depth).",
            ["model", "tier"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "llmstack_gateway_queue_wait_seconds",
            "Time admitted requests waited for a slot, by model and tier.",
            ["model", "tier"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.queue_admitted = Counter(
            "llmstack_gateway_queue_admitted",
            "Requests given a slot of a queued model, by model and tenant.",
            ["model", "tenant"],
            registry=r,
        )
        self.queue_shed = Counter(
            "llmstack_gateway_queue_shed",
            "Requests refused a slot, by model, tenant and status (429: the tenant's share; 503: model saturated).",
            ["model", "tenant", "status"],
            registry=r,
        )
        # Live replicas (serving.gateway.queue.replica_feed): what each model's queue capacity follows.
        self.model_replicas = Gauge(
            "llmstack_gateway_model_replicas",
            "Replicas Ray Serve reports RUNNING for the model, at the last successful poll of its REST API.",
            ["model"],
            registry=r,
        )
        # The adaptive capacity (serving.gateway.capacity): what the fair queue multiplies by the replicas.
        self.model_capacity = Gauge(
            "llmstack_gateway_model_capacity",
            "Requests in flight per replica the model's adaptive capacity allows now (max_ongoing_requests while "
            "the engine keeps its latency target; lower while it does not, the excess waiting in the queue).",
            ["model"],
            registry=r,
        )
        self.replica_feed_errors = Counter(
            "llmstack_gateway_replica_feed_errors",
            "Polls of Ray's REST API that failed, by kind (unreachable|status|body|queue): capacity falls back "
            "to the stack's figure once counts expire.",
            ["kind"],
            registry=r,
        )
        # The Batch API (serving.gateway.batch): lines enqueued, and how each one ended.
        self.batch_lines = Counter(
            "llmstack_gateway_batch_lines",
            "Batch lines by tenant and outcome (queued: enqueued to run; completed: a 2xx answer; failed: an error "
            "answer, refused up front, or cancelled, expired or stopped before it ran).",
            ["tenant", "outcome"],
            registry=r,
        )
        self.batch_memory = Gauge(
            "llmstack_gateway_batch_memory_bytes",
            "Bytes the Batch API's uploads, validations, finalizations and downloads hold in this process, "
            "within gateway.batch.memory_bytes() (serving.gateway.batch.memory).",
            registry=r,
        )
        # The gateway's Redis (serving.gateway.telemetry.redis_memory): it must never evict, so watch its room.
        self.redis_memory_used = Gauge(
            "llmstack_gateway_redis_memory_used_bytes", "Redis's used_memory, as INFO memory last said.", registry=r
        )
        self.redis_memory_max = Gauge(
            "llmstack_gateway_redis_memory_max_bytes",
            "Redis's maxmemory, as INFO memory last said (0: no limit set).",
            registry=r,
        )
        self.redis_evicting = Gauge(
            "llmstack_gateway_redis_evicting",
            "1 when Redis's maxmemory-policy is not noeviction: under memory pressure it would delete budgets, "
            "spend and usage.",
            registry=r,
        )
        self.redis_out_of_memory = Counter(
            "llmstack_gateway_redis_out_of_memory",
            "Redis writes refused for memory (OOM), by component (limiter|batch|...): admission fails closed.",
            ["component"],
            registry=r,
        )
        self.budget_used = BudgetUsage()
        r.register(self.budget_used)

    def model_label(self, model: str | None) -> str:
        """The model as a label value: "" when the request names none (GET /v1/models)."""
        if model is None:
            return ""
        return model if model in self.served_models else OTHER_MODEL

    def observe_request(self, *, status: int | None, model: str | None, tenant: str | None, duration_s: float) -> None:
        label = self.model_label(model)
        self.requests.labels(status=str(status or 0), model=label, tenant=tenant or "").inc()
        self.duration.labels(model=label).observe(duration_s)

    def observe_tokens(self, *, model: str | None, tenant: str | None, prompt: int, completion: int) -> None:
        label = self.model_label(model)
        if prompt:
            self.tokens.labels(kind="prompt", model=label, tenant=tenant or "").inc(prompt)
        if completion:
            self.tokens.labels(kind="completion", model=label, tenant=tenant or "").inc(completion)

    def observe_budgets(self, ticket: Any) -> None:
        """The budget-used gauge of the key and its tenant, from what an admission in Redis saw
        (`ticket`: serving.gateway.limits.limiter.Ticket); nothing for budgets not set."""
        spend, who = ticket.spend, ticket.who
        if spend is None:
            return
        now = datetime.now(UTC)
        if who.monthly_budget_usd is not None:
            self.budget_used.observe(who.tenant, who.key_id, spend.key_nano_usd, who.monthly_budget_usd, now)
        if spend.tenant_budget_nano_usd > 0:
            self.budget_used.observe(
                who.tenant, "", spend.tenant_nano_usd, Decimal(spend.tenant_budget_nano_usd) / NANO_PER_USD, now
            )

    def set_prices(self, usd_per_million_tokens: Mapping[str, Decimal]) -> None:
        for model, price in usd_per_million_tokens.items():
            self.model_price.labels(model=model).set(float(price))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def names(self) -> set[str]:
        """Every series name this registry exposes (counters with _total, histograms with
        _bucket/_sum/_count), for checking dashboards and alert rules against."""
        return {sample.name for family in self.registry.collect() for sample in family.samples} | {
            family.name + suffix
            for family in self.registry.collect()
            for suffix in (
                ("_total",)
                if family.type == "counter"
                else ("_bucket", "_sum", "_count")
                if family.type == "histogram"
                else ("",)
            )
        }
