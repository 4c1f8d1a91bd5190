"""Admission: the one place that decides whether a request may reach the model servers.

Today: authenticate the key, cap the body size, check the key's model allow-list. The
rate-limit issue adds its steps here, after authentication and body parsing (GCRA request
rate, token reservation from the prompt estimate + max_tokens, quotas, concurrency), so the
rest of the gateway keeps seeing one `Admission` or one error response.

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


@dataclass(frozen=True)
class Admission:
    """An admitted request: who sent it, its body (already read) and the model it names."""

    key: KeyRecord
    body: bytes
    model: str | None


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
    if not body.lstrip().startswith(b"{"):
        return None
    try:
        document = json.loads(body)
    except ValueError:
        return None
    model = document.get("model") if isinstance(document, dict) else None
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


async def admit(request: Request, key_store: KeyStore, *, max_body_bytes: int) -> Admission | Response:
    key = presented_key(request.headers)
    if key is None:
        return errors.missing_api_key()
    try:
        record = await key_store.verify(key)
    except KeyStoreUnavailable:
        return errors.key_store_unavailable()
    if record is None:
        return errors.invalid_api_key()
    body = await read_body_within(request, max_body_bytes)
    if body is None:
        return errors.body_too_large(max_body_bytes)
    model = requested_model(body)
    if not model_allowed(record, model, has_body=bool(body.strip())):
        return errors.model_not_allowed(model)
    return Admission(key=record, body=body, model=model)
