"""The gateway's Redis clients: bounded pools, short timeouts, no blind retries.

A burst of requests must not open a Redis connection each: hundreds of connects at once on
a busy replica take longer than the command timeout, so a burst would turn into 503s. A
`BlockingConnectionPool` keeps at most `MAX_CONNECTIONS` per client and makes the rest wait
(for at most `TIMEOUT_S`) for a free one; one Redis round trip is far shorter than a
connect, so waiting for a pooled connection is the fast path under load.

No automatic retries: a command retried after a timeout may have run already, and a
limiter script that ran twice charges twice. The callers decide what a failure means.
"""

from __future__ import annotations

from typing import Any

MAX_CONNECTIONS = 32
TIMEOUT_S = 2.0  # connect, each command, and the wait for a pooled connection


def redis_client(url: str, *, decode_responses: bool = False) -> Any:
    import redis.asyncio as redis  # here, so the in-memory key store needs no redis package
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=MAX_CONNECTIONS, timeout=TIMEOUT_S, socket_timeout=TIMEOUT_S,
        socket_connect_timeout=TIMEOUT_S, decode_responses=decode_responses, retry=Retry(NoBackoff(), 0))
    return redis.Redis(connection_pool=pool)
