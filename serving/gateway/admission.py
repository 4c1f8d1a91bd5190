"""Admission: the one place that decides whether a request may reach the model servers.

Steps: authenticate the key, cap the body size, check the key's model allow-list and the
request policy (serving.gateway.request_policy: max_tokens/n/logprobs/logit_bias), then ask
the limiter (serving.gateway.limits: request and token GCRA, concurrency, daily budget) with
the tokens this request reserves (serving.gateway.metering). The rest of the gateway sees one
`Admission` (with a `Ticket` to settle when the response ends) or one error response.

Order matters: the key is checked before the body is read, so unauthenticated callers cannot
make the gateway read (or buffer) anything.

Redis outages: a key verified in the last `key_cache_ttl_s` is still accepted (keys.RecentlyVerifiedKeys)
and the limiter falls back as its fail mode says; either sets the `degraded` gauge. Keys in
shadow mode are served when over a limit, and the would-be refusal is logged and counted.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from serving.gateway import errors
from serving.gateway.access_log import caller_of, note_caller
from serving.gateway.body import BodyError, request_document
from serving.gateway.key_format import KeyRecord
from serving.gateway.keys import KeyStore, KeyStoreUnavailable, RecentlyVerifiedKeys
from serving.gateway.limits import Limiter, LimiterUnavailable, Ticket, effective_limits
from serving.gateway.metering import (
    COMPLETION_PATHS,
    UsageMeter,
    estimate_prompt_tokens,
    output_allowance,
    rate_limit_headers,
    request_usage_upstream,
    requested_output,
    reserve_tokens,
    wants_stream,
)
from serving.gateway.metrics import GatewayMetrics
from serving.gateway.request_policy import check_request
from serving.gateway.settings import GatewaySettings, KeyLimits

# Shadow-mode refusals go to the access log's stream: one JSON object per line, like access lines.
events = logging.getLogger("llmstack.gateway.access")
PROMPT_LOG_CHARS = 2000


@dataclass(frozen=True)
class Admission:
    """An admitted request: who sent it, its body (already read, and possibly rewritten to ask
    for stream usage), the model it names, its limiter ticket, the x-ratelimit-* headers for
    the response, and the meter that bills it."""

    key: KeyRecord
    body: bytes
    model: str | None
    ticket: Ticket
    headers: dict[str, str]
    meter: UsageMeter


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key from `Authorization: Bearer <key>`, else from `X-API-Key: <key>`."""
    authorization = headers.get("authorization", "")
    scheme, _, credential = authorization.partition(" ")
    if scheme.lower() == "bearer" and credential.strip():
        return credential.strip()
    return headers.get("x-api-key", "").strip() or None


def requested_model(document: dict | None) -> str | None:
    """The `model` field of a request's JSON object; None when it names no model as a string."""
    model = document.get("model") if document is not None else None
    return model if isinstance(model, str) else None


def model_allowed(key: KeyRecord, model: str | None, *, has_body: bool) -> bool:
    """Unrestricted keys may call anything. A restricted key's bodiless requests (GET /v1/models)
    are not model-scoped, but a body must name an allowed model: a body we cannot read a model
    from might still be one the upstream reads a model from."""
    if key.allowed_models is None:
        return True
    if model is None:
        return not has_body
    return model in key.allowed_models


async def read_body_within(request: Request, limit: int) -> bytes | None:
    """The body, or None as soon as it is known to exceed `limit` bytes. Checks the declared
    Content-Length first, then counts while reading, since chunked bodies declare nothing."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)


class Admitter:
    """Admission with what it needs: the key store (and its outage cache), the limiter, the
    settings and the metrics (each admission sets the `degraded` gauge from what it saw of Redis)."""

    def __init__(self, settings: GatewaySettings, key_store: KeyStore, limiter: Limiter,
                 metrics: GatewayMetrics) -> None:
        self.settings, self.key_store, self.limiter, self.metrics = settings, key_store, limiter, metrics
        self.recent_keys = RecentlyVerifiedKeys(settings.key_cache_ttl_s)

    async def _verify(self, key: str) -> tuple[KeyRecord | None, bool]:
        """(record, came from the outage cache)."""
        try:
            record = await self.key_store.verify(key)
        except KeyStoreUnavailable:
            self.metrics.redis_errors.labels(component="keys").inc()
            return self.recent_keys.recall(key), True
        self.recent_keys.remember(key, record)
        return record, False

    async def admit(self, request: Request) -> Admission | Response:
        settings = self.settings
        key = presented_key(request.headers)
        if key is None:
            return errors.missing_api_key()
        record, from_cache = await self._verify(key)
        if record is None:
            return errors.key_store_unavailable() if from_cache else errors.invalid_api_key()
        note_caller(request.scope, record)
        body = await read_body_within(request, settings.max_body_bytes)
        if body is None:
            return errors.body_too_large(settings.max_body_bytes)
        document = request_document(body, request.url.path, settings)  # the one parse, bounded
        if isinstance(document, BodyError):
            return errors.invalid_request(document.param, document.message, document.code)
        model = requested_model(document)
        caller_of(request.scope).model = model
        if not model_allowed(record, model, has_body=document is not None):
            return errors.model_not_allowed(model)

        path = request.url.path
        violation = check_request(document, path, settings)  # before the limiter: a refusal costs no quota
        if violation is not None:
            return errors.invalid_request(violation.param, violation.message, violation.code)
        if settings.log_prompts and document is not None:
            caller_of(request.scope).prompt = prompt_text(document)
        allowance, added_max_tokens = output_allowance(settings.max_tokens_ceiling,
                                                       settings.model_context_lengths.get(model or ""))
        reserved = reserve_tokens(document, path, allowance)
        limits = effective_limits(record, settings.default_limits)
        try:
            ticket = await self.limiter.admit(record.key_id, limits, reserved)
        except LimiterUnavailable:
            return errors.limiter_unavailable()
        self.metrics.degraded.set(1 if from_cache or ticket.local_fallback else 0)
        headers = rate_limit_headers(ticket.decision)
        if not ticket.decision.allowed:
            refusal = self._over_limit(record, limits, ticket, headers)
            if refusal is not None:
                return refusal
            headers = {name: value for name, value in headers.items() if name != "retry-after"}
        stream = wants_stream(document, path)
        upstream_document, strip_usage = upstream_request(document, path, stream=stream,
                                                          added_max_tokens=added_max_tokens)
        if upstream_document is not document:
            body = json.dumps(upstream_document).encode()
        meter = UsageMeter(stream=stream, strip_usage=strip_usage, reserved=reserved,
                           prompt_estimate=estimate_prompt_tokens(document) if document is not None else 0)
        return Admission(key=record, body=body, model=model, ticket=ticket, headers=headers, meter=meter)


    def _over_limit(self, record: KeyRecord, limits: KeyLimits, ticket: Ticket, headers: dict[str, str]
                    ) -> Response | None:
        """The 429 for a request over a limit; None when the key is in shadow mode, which serves
        it anyway, uncharged (exactly what enforcement would have left in the limiter), and logs it."""
        refused = ticket.decision.refused
        self.metrics.rate_limited.labels(limit=refused, mode="shadow" if record.shadow else "enforced").inc()
        if record.shadow:
            events.warning(json.dumps({"event": "shadow_rate_limited", "key_id": record.key_id,
                                       "tenant": record.tenant, "limit": refused, "reserved": ticket.reserved}))
            return None
        limit = {"requests": limits.requests_per_minute, "tokens": limits.tokens_per_minute,
                 "concurrency": limits.max_concurrent_requests, "daily_tokens": limits.daily_token_budget}
        return errors.rate_limited(refused, limit[refused], ticket.decision.retry_after_s, headers)


def upstream_request(document: dict | None, path: str, *, stream: bool, added_max_tokens: int | None
                     ) -> tuple[dict | None, bool]:
    """The body to send upstream (the same object when unchanged) and whether to strip the
    usage chunk from the stream: streams always ask for usage (so they can be billed), and a
    completion without max_tokens gets the ceiling when the model's context would not bound it."""
    strip_usage = False
    if document is None or path not in COMPLETION_PATHS:
        return document, strip_usage
    if stream:
        document, client_asked = request_usage_upstream(document)
        strip_usage = not client_asked
    if added_max_tokens is not None and requested_output(document) is None:
        document = {**document, "max_tokens": added_max_tokens}
    return document, strip_usage


def prompt_text(document: dict) -> str:
    """The prompt part of a body, for access logs of stacks that turn `log_prompts` on."""
    prompt = {k: document[k] for k in ("messages", "prompt", "input") if k in document}
    return json.dumps(prompt)[:PROMPT_LOG_CHARS]
