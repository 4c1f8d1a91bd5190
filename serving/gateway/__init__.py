"""The API gateway: the only way in to the model servers, and the product's security boundary.

It authenticates API keys (stored hashed in Redis), admits requests, and proxies them -
streams included - to Ray Serve's OpenAI-compatible ingress. Each concern has its own small
module (policy and settings, routes, body, key_format, keys, tenants, admission,
request_policy, reservation, limits with redis_limits and local_limits, redis_client, metering,
proxy, upstream_errors, errors, access_log, fair_queue, budgets, usage_ledger, app, server);
limits and token reservation are steps of `admission`, settlement ends the proxy relay.

This package ships as a slim image: it must never import ray, vllm, torch, pulumi, or our
own `infra` / `ops` packages (a test enforces it).
"""
