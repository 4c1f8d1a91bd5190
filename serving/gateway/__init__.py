"""The API gateway: the only way in to the model servers, and the product's security boundary.

It authenticates API keys (stored hashed in Redis), admits requests, and proxies them -
streams included - to Ray Serve's OpenAI-compatible ingress. One package per concern, in the
order a request meets them (pyproject's import contracts keep each above only what it uses):

    http/       the ASGI shell: the app factory that wires the rest, the public app, probes, the server
    pipeline/   the request path: Gateway.handle, stage after stage
    batch/      OpenAI's Batch API (/v1/files, /v1/batches), its lines run through admission
    upstream/   the proxy to the model servers, and the stream a queued request waits in
    admission/  the stages before the proxy: authenticate, read and check the body, limit, queue
    telemetry/  Prometheus metrics, the access log, Redis's memory
    queue/      the fair queue per model (Lua in Redis, the same arithmetic pure in fair_share)
    limits/     rate limits, token and dollar budgets, the usage ledger (Lua in .lua files)
    auth/       API keys: their format, the hashed store
    metering/   tokens: what a request reserves, what its answer used
    config/     the settings (environment) and the stack's gateway policy (schemas only)
    protocol/   the OpenAI surface: the routes allowed, refusals and their error shape, stream events
    redis/      the Redis client and the Lua script loader

This package ships as a slim image: it must never import ray, vllm, torch, pulumi, or our
own `infra` / `ops` packages (a test and an import contract enforce it).
"""
