"""Admission: the one place that decides whether a request may reach the model servers.

Steps: authenticate the key, cap the body size, check the key's model allow-list and the
request policy (serving.gateway.request_policy: max_tokens/n/logprobs/logit_bias), then ask
the limiter (serving.gateway.limits: request and token GCRA, concurrency, daily budget) with
the tokens this request reserves (serving.gateway.metering). The rest of the gateway sees one
`Admission` (with a `Ticket` to settle when the response ends) or one error response.

Order matters: the key is checked before the body is read, so unauthenticated callers cannot
make the gateway read (or buffer) anything.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from serving.gateway import errors
from serving.gateway.key_format import KeyRecord
from serving.gateway.keys import KeyStore, KeyStoreUnavailable
from serving.gateway.limits import Limiter, LimiterUnavailable, Ticket, effective_limits
from serving.gateway.metering import (
    UsageMeter,
    estimate_prompt_tokens,
    rate_limit_headers,
    request_usage_upstream,
    reserve_tokens,
    wants_stream,
)
from serving.gateway.request_policy import check_request
from serving.gateway.settings import GatewaySettings


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


def requested_model(body: bytes) -> str | None:
    """The `model` field of a JSON body; None when there is no JSON object with a string model.
    Malformed bodies are the upstream's to reject, with its own (OpenAI-shaped) message."""
    document = json_object(body)
    model = document.get("model") if document is not None else None
    return model if isinstance(model, str) else None


def json_object(body: bytes) -> dict | None:
    if not body.lstrip().startswith(b"{"):
        return None
    try:
        document = json.loads(body)
    except ValueError:
        return None
    return document if isinstance(document, dict) else None


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


async def admit(request: Request, key_store: KeyStore, limiter: Limiter, settings: GatewaySettings
                ) -> Admission | Response:
    key = presented_key(request.headers)
    if key is None:
        return errors.missing_api_key()
    try:
        record = await key_store.verify(key)
    except KeyStoreUnavailable:
        return errors.key_store_unavailable()
    if record is None:
        return errors.invalid_api_key()
    body = await read_body_within(request, settings.max_body_bytes)
    if body is None:
        return errors.body_too_large(settings.max_body_bytes)
    model = requested_model(body)
    if not model_allowed(record, model, has_body=bool(body.strip())):
        return errors.model_not_allowed(model)

    document, path = json_object(body), request.url.path
    violation = check_request(document, path, settings)  # before the limiter: a refusal costs no quota
    if violation is not None:
        return errors.invalid_request(violation.param, violation.message, violation.code)
    limits = effective_limits(record, settings.default_limits)
    reserved = reserve_tokens(document, path, settings.max_tokens_ceiling)
    try:
        ticket = await limiter.admit(record.key_id, limits, reserved)
    except LimiterUnavailable:
        return errors.limiter_unavailable()
    decision = ticket.decision
    headers = rate_limit_headers(decision)
    if not decision.allowed:
        limit = {"requests": limits.requests_per_minute, "tokens": limits.tokens_per_minute,
                 "concurrency": limits.max_concurrent_requests, "daily_tokens": limits.daily_token_budget}
        return errors.rate_limited(decision.refused, limit[decision.refused], decision.retry_after_s, headers)
    stream, strip_usage = wants_stream(document, path), False
    if stream:
        body, client_asked = request_usage_upstream(document)
        strip_usage = not client_asked
    meter = UsageMeter(stream=stream, strip_usage=strip_usage, reserved=reserved,
                       prompt_estimate=estimate_prompt_tokens(document) if document is not None else 0)
    return Admission(key=record, body=body, model=model, ticket=ticket, headers=headers, meter=meter)
