"""Errors in OpenAI's shape, so every OpenAI SDK raises its usual exception for them.

OpenAI answers `{"error": {"message", "type", "param", "code"}}`: 4xx use type
`invalid_request_error` (401 wrong key: code `invalid_api_key`; 401 no key: code null),
5xx use type `server_error`. The SDKs pick the exception class from the status code
(401 AuthenticationError, 403 PermissionDeniedError, 5xx InternalServerError) and retry 5xx
honouring `Retry-After`. Messages never echo the presented key, not even masked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any

from starlette.responses import JSONResponse

from serving.gateway.protocol.routes import SERVED_ROUTES

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
# The code of a refusal for the monthly dollar budget (serving.gateway.limits.budgets refuses it).
BUDGET_EXCEEDED = "monthly_budget_exceeded"


@dataclass(frozen=True)
class Refusal:
    """A request the gateway answers itself with an error, as a value: what each step of the
    request path returns instead of a response (`response_for` is the one place that makes
    the HTTP answer). `headers` go out with it (Retry-After, x-ratelimit-*)."""

    status: int
    message: str
    type: str
    code: str | None = None
    param: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)

    def document(self) -> dict[str, Any]:
        """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def with_headers(self, headers: Mapping[str, str]) -> Refusal:
        """The same refusal with `headers` added (a header it had is replaced)."""
        return replace(self, headers={**self.headers, **headers})

    def with_default_headers(self, headers: Mapping[str, str]) -> Refusal:
        """The same refusal with those of `headers` it does not set already."""
        return replace(self, headers={**headers, **self.headers})


def response_for(refusal: Refusal) -> JSONResponse:
    """The HTTP answer to a refusal, in OpenAI's error shape."""
    return JSONResponse(refusal.document(), status_code=refusal.status, headers=dict(refusal.headers) or None)


def refusal(
    status: int,
    message: str,
    type_: str,
    code: str | None = None,
    param: str | None = None,
    *,
    headers: Mapping[str, str] | None = None,
) -> Refusal:
    return Refusal(status, message, type_, code, param, dict(headers or {}))


def openai_error(
    status: int,
    message: str,
    type_: str,
    code: str | None = None,
    param: str | None = None,
    *,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """A refusal answered at once, for code that answers its own requests (the Batch API)."""
    return response_for(refusal(status, message, type_, code, param, headers=headers))


def missing_api_key() -> Refusal:
    return refusal(
        401,
        "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY' or 'X-API-Key: YOUR_KEY'. "
        "Ask your platform team for a key.",
        INVALID_REQUEST,
    )


def invalid_api_key() -> Refusal:
    return refusal(
        401,
        "Incorrect API key provided, or the key was revoked or has expired. Ask your platform team for a key.",
        INVALID_REQUEST,
        code="invalid_api_key",
    )


def model_not_allowed(model: str | None) -> Refusal:
    message = (
        f"This API key may not use the model {model!r}."
        if model is not None
        else "This API key is limited to certain models: the request body must name one in 'model'."
    )
    return refusal(403, message, INVALID_REQUEST, code="model_not_allowed", param="model")


def body_too_large(limit: int) -> Refusal:
    return refusal(
        413,
        f"Request body is larger than this gateway accepts ({limit} bytes).",
        INVALID_REQUEST,
        code="request_too_large",
    )


def invalid_request(param: str | None, message: str, code: str) -> Refusal:
    """400 for a request the gateway's policy refuses (serving.gateway.admission.validation)."""
    return refusal(400, message, INVALID_REQUEST, code=code, param=param)


def not_found(path: str) -> Refusal:
    return refusal(
        404, f"Unknown path {path[:200]!r}: this gateway serves {SERVED_ROUTES}.", INVALID_REQUEST, code="unknown_url"
    )


def model_not_found(model: str) -> Refusal:
    return refusal(
        404,
        f"The model {model[:200]!r} does not exist or this API key may not use it.",
        INVALID_REQUEST,
        code="model_not_found",
        param="model",
    )


def body_timeout(timeout_s: float) -> Refusal:
    # Sent before the body was read whole: uvicorn closes the connection after it.
    return refusal(
        408, f"The request body did not arrive within {timeout_s:g} s.", INVALID_REQUEST, code="request_timeout"
    )


def method_not_allowed(method: str) -> Refusal:
    return refusal(405, f"Method {method} is not allowed here.", INVALID_REQUEST, code="method_not_allowed")


def upstream_unavailable() -> Refusal:
    # Retry-After: the model servers may be restarting or scaling; the SDKs retry after it.
    return refusal(
        503,
        "The model servers are not reachable right now. Please retry shortly.",
        SERVER_ERROR,
        code="upstream_unavailable",
        headers={"Retry-After": "1"},
    )


def key_store_unavailable() -> Refusal:
    # Without the key store no key can be checked; refusing beats letting anyone in.
    return refusal(
        503,
        "The gateway cannot check API keys right now. Please retry shortly.",
        SERVER_ERROR,
        code="key_store_unavailable",
        headers={"Retry-After": "1"},
    )


def upstream_timeout() -> Refusal:
    return refusal(
        504, "The model servers did not answer in time. Please retry.", SERVER_ERROR, code="upstream_timeout"
    )


def upstream_failed() -> Refusal:
    return refusal(
        502, "The model servers returned an invalid response. Please retry.", SERVER_ERROR, code="upstream_error"
    )


_REFUSAL_TEXT = {
    "requests": "requests per minute (RPM)",
    "tokens": "tokens per minute (TPM)",
    "concurrency": "concurrent requests",
    "daily_tokens": "daily token budget",
    "monthly_budget": "monthly budget in dollars",
}


_SCOPE_TEXT = {
    "key": "this API key",
    "tenant": "this API key's tenant (all its keys together)",
    "shadow": "this API key in shadow mode",
}


def rate_limited(
    refused: str, limit: int, retry_after_s: float | None, headers: dict[str, str], *, scope: str = "key"
) -> Refusal:
    """429 as OpenAI sends it: type `requests` or `tokens`, code `rate_limit_exceeded` (the
    daily budget gets its own code, so clients can tell a quota from a rate). `scope` says whose
    limit it was: the key's, its tenant's, or the ceiling every shadow-mode key stays under."""
    what, whose = _REFUSAL_TEXT[refused], _SCOPE_TEXT[scope]
    if retry_after_s is None:
        message = (
            f"Request too large for the {what} limit of {whose} ({limit}): it reserves more tokens than "
            "the limit allows. Lower max_tokens (or the prompt), or ask your platform team for a higher limit."
        )
    else:
        message = f"Rate limit reached for {whose} on {what}: limit {limit}. Please try again in {retry_after_s:.3f}s."
    type_ = "requests" if refused in ("requests", "concurrency") else "tokens"
    code = "daily_token_budget_exceeded" if refused == "daily_tokens" else "rate_limit_exceeded"
    if retry_after_s is None:
        # 429 like OpenAI's "Request too large", but waiting cannot help: tell the OpenAI SDKs
        # (which honour x-should-retry) not to retry what can never be admitted.
        headers = {**headers, "x-should-retry": "false"}
    return refusal(429, message, type_, code=code, headers=headers)


def monthly_budget_exceeded(
    budget_usd: Decimal, retry_after_s: float | None, headers: dict[str, str], *, scope: str = "key"
) -> Refusal:
    """429 with its own code (BUDGET_EXCEEDED): a quota in dollars, not a
    rate, renewed at the start of the next UTC month (Retry-After says when). Retrying before
    then cannot help, so the OpenAI SDKs are told not to (x-should-retry: false)."""
    whose = _SCOPE_TEXT[scope]
    if retry_after_s is None:
        message = (
            f"Request too large for the monthly budget of {whose} (${budget_usd:.2f}): its reservation alone "
            "costs more. Lower max_tokens (or the prompt), or ask your platform team for a higher budget."
        )
    else:
        message = (
            f"The monthly budget of {whose} (${budget_usd:.2f}) is spent. It renews at the start of the next "
            f"calendar month (UTC), in {retry_after_s:.0f}s; ask your platform team for a higher budget."
        )
    return refusal(429, message, "tokens", code=BUDGET_EXCEEDED, headers={**headers, "x-should-retry": "false"})


def limiter_unavailable() -> Refusal:
    # Fail mode `closed`: without the limiter nothing is admitted.
    return refusal(
        503,
        "The gateway cannot check rate limits right now. Please retry shortly.",
        SERVER_ERROR,
        code="limiter_unavailable",
        headers={"Retry-After": "1"},
    )


def gateway_busy() -> Refusal:
    # Every Redis connection is busy with other requests: load, not an outage. Nothing is
    # admitted on a guess; the SDKs retry after Retry-After.
    return refusal(
        503,
        "The gateway is busy right now. Please retry shortly.",
        SERVER_ERROR,
        code="gateway_busy",
        headers={"Retry-After": "1"},
    )


def queue_refused(
    status: int, code: str, message: str, retry_after_s: float, headers: dict[str, str] | None = None
) -> Refusal:
    """No slot of a saturated model (serving.gateway.queue.fair_share.Refusal): 429 when the tenant's own
    requests are what it waits behind (code tenant_queue_share_exceeded), 503 model_saturated when
    everyone else's are. Retry-After is the queue's drain time; the SDKs retry after it."""
    type_ = "requests" if status == 429 else SERVER_ERROR
    return refusal(
        status, message, type_, code=code, headers={**(headers or {}), "Retry-After": str(max(1, round(retry_after_s)))}
    )
