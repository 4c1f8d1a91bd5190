"""The OpenAI routes the gateway serves: an explicit allowlist of method + canonical path.

A request is matched on the path uvicorn decoded once, and only an exact match is served;
everything else is answered 404 (or 405) before any upstream call. The matched route's
canonical path is what goes upstream, already encoded, so the upstream sees byte for byte the
path that was checked (a second decoding on the way, as `%252e` -> `%2e` -> `.`, would
otherwise reach routes nobody checked). Canonical paths hold only RFC 3986 unreserved
characters and `/`: encoded and decoded forms are the same bytes.

Ray Serve LLM's OpenAI ingress (ray 2.60, `ray/llm/_internal/serve/core/ingress/ingress.py`,
DEFAULT_ENDPOINTS) serves GET /v1/models, GET /v1/models/{model}, POST /v1/completions,
/v1/chat/completions, /v1/embeddings, /v1/audio/transcriptions, /v1/score, /tokenize and
/detokenize. The gateway serves the OpenAI JSON routes among them, whose bodies it polices
and meters. Not served: transcriptions (multipart audio, nothing the gateway can check or
meter, and no stack model is a speech model), and score / tokenize / detokenize (vLLM's own
API, not OpenAI's: unmetered access to the engine).

Query strings are dropped: no proxied route takes one, so forwarding them would only give
callers an unchecked channel to the upstream.

On the direct serving path each model is its own Serve application under its own route prefix
(`infra.render.serve_config.model_routes`, rendered into the gateway's settings as
`model_routes`): a request naming a routed model goes to `<prefix><canonical path>`. The
prefix comes from the settings (checked canonical at start), never from the request. Requests
that name no routed model (`GET /v1/models`) go to `/`, where an application lists every model.

The Batch API's routes (/v1/files, /v1/batches: serving.gateway.batch.api) are the gateway's own:
nothing of them goes upstream. Their ids are matched against the exact pattern the gateway
makes them with, so no other spelling of an id (encoded, dotted, another case) reaches a lookup.
GET /v1/batches and GET /v1/files read their `after`, `limit` (and for files `order`, `purpose`)
from the query string, as OpenAI's do.

Each body route also names OpenAI's request fields for it. Any other top-level field is a
vLLM extension (`ignore_eos`, `top_k`, `priority`, `chat_template`, `request_id`, ...) and
passes only when the stack lists it (serving.gateway.admission.body).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

CHAT_COMPLETIONS = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
MODELS = "/v1/models"
MODEL_PREFIX = MODELS + "/"
FILES = "/v1/files"
BATCHES = "/v1/batches"
# The ids the Batch API gives its files and batches (serving.gateway.batch.objects makes them): the
# allowlist matches them in paths.
FILE_ID = re.compile(r"file-[0-9a-f]{24}")
BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")

# OpenAI's request fields, from openai-python's `types/chat/completion_create_params.py`,
# `types/completion_create_params.py` and `types/embedding_create_params.py` (openai 3.57; a
# test compares them with the installed SDK). `stream` is declared on the SDK's subclasses.
CHAT_FIELDS = frozenset(
    {
        "audio",
        "frequency_penalty",
        "function_call",
        "functions",
        "logit_bias",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "messages",
        "metadata",
        "modalities",
        "model",
        "moderation",
        "n",
        "parallel_tool_calls",
        "prediction",
        "presence_penalty",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "reasoning_effort",
        "response_format",
        "safety_identifier",
        "seed",
        "service_tier",
        "stop",
        "store",
        "stream",
        "stream_options",
        "temperature",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "user",
        "verbosity",
        "web_search_options",
    }
)
COMPLETION_FIELDS = frozenset(
    {
        "best_of",
        "echo",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "max_tokens",
        "model",
        "n",
        "presence_penalty",
        "prompt",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "suffix",
        "temperature",
        "top_p",
        "user",
    }
)
EMBEDDING_FIELDS = frozenset({"dimensions", "encoding_format", "input", "model", "user"})

# POST routes and the body fields OpenAI defines for each.
BODY_ROUTES: dict[str, frozenset[str]] = {
    CHAT_COMPLETIONS: CHAT_FIELDS,
    COMPLETIONS: COMPLETION_FIELDS,
    EMBEDDINGS: EMBEDDING_FIELDS,
}

SERVED_ROUTES = (
    "POST /v1/chat/completions, POST /v1/completions, POST /v1/embeddings, GET /v1/models, "
    "GET /v1/models/{model}, and the Batch API: GET|POST /v1/files, GET|DELETE /v1/files/{id}, "
    "GET /v1/files/{id}/content, GET|POST /v1/batches, GET /v1/batches/{id}, "
    "POST /v1/batches/{id}/cancel"
)

# The Batch API: (pattern of the canonical path, {method: handler}). Handlers: serving.gateway.batch.api.
_FILE = FILE_ID.pattern
_BATCH = BATCH_ID.pattern
LOCAL_ROUTES: tuple[tuple[re.Pattern[str], dict[str, str]], ...] = (
    (re.compile(re.escape(FILES)), {"POST": "files.create", "GET": "files.list"}),
    (re.compile(re.escape(FILES) + f"/({_FILE})"), {"GET": "files.retrieve", "DELETE": "files.delete"}),
    (re.compile(re.escape(FILES) + f"/({_FILE})/content"), {"GET": "files.content"}),
    (re.compile(re.escape(BATCHES)), {"POST": "batches.create", "GET": "batches.list"}),
    (re.compile(re.escape(BATCHES) + f"/({_BATCH})"), {"GET": "batches.retrieve"}),
    (re.compile(re.escape(BATCHES) + f"/({_BATCH})/cancel"), {"POST": "batches.cancel"}),
)

_CANONICAL = re.compile(r"/[A-Za-z0-9._~/-]*")  # unreserved characters (RFC 3986 2.3) and "/"


@dataclass(frozen=True)
class ApiRoute:
    """A request the gateway serves. `path` is canonical: exactly what is sent upstream.
    `model` is set for GET /v1/models/{model}; `fields` are the OpenAI body fields (empty for GETs).
    `handler` names the gateway's own handler of a Batch API route (nothing goes upstream), and
    `resource` the file or batch id in its path."""

    method: str
    path: str
    fields: frozenset[str] = frozenset()
    model: str | None = None
    handler: str | None = None
    resource: str | None = None

    @property
    def takes_body(self) -> bool:
        return self.method == "POST"


@dataclass(frozen=True)
class RouteRefusal:
    """404 for a path the gateway does not serve; 405 (with the methods it allows) for a served
    path asked with another method."""

    status: int
    allow: tuple[str, ...] = ()


NOT_FOUND = RouteRefusal(404)


def is_canonical(path: str) -> bool:
    """A decoded path the gateway could send as is: unreserved characters only (so no `%`,
    which would mean it was encoded more than once), no empty, `.` or `..` segments."""
    if not _CANONICAL.fullmatch(path):
        return False
    segments = path.split("/")[1:]
    return all(segment not in ("", ".", "..") for segment in segments)


def upstream_prefix_for(model: str | None, model_routes: Mapping[str, str]) -> str:
    """The path prefix to put before the canonical `/v1/...` upstream: `/tiny-chat` for a routed
    model, "" otherwise (one application at `/`, or a request naming no model)."""
    if model is None:
        return ""
    return model_routes.get(model, "").rstrip("/")


def resolve(method: str, path: str, served_models: Collection[str]) -> ApiRoute | RouteRefusal:
    """The route for `method` and the once-decoded `path`, or why there is none. Exact matches
    only: no trailing slash, no case folding, no prefix matches; methods are case-sensitive."""
    if not is_canonical(path):
        return NOT_FOUND
    if path in BODY_ROUTES:
        return ApiRoute("POST", path, BODY_ROUTES[path]) if method == "POST" else RouteRefusal(405, ("POST",))
    if path == MODELS or (path.startswith(MODEL_PREFIX) and path[len(MODEL_PREFIX) :] in served_models):
        if method != "GET":
            return RouteRefusal(405, ("GET",))
        return ApiRoute("GET", path, model=path[len(MODEL_PREFIX) :] if path != MODELS else None)
    for pattern, handlers in LOCAL_ROUTES:
        match = pattern.fullmatch(path)
        if match is not None:
            if method not in handlers:
                return RouteRefusal(405, tuple(sorted(handlers)))
            return ApiRoute(method, path, handler=handlers[method], resource=next(iter(match.groups()), None))
    return NOT_FOUND
