"""The gateway's fair queue for one model, read from the gateway's Redis by Serve's controller.

Measured once: the gateway already keeps, per model, its waiting requests (one sorted set per
tier), the mean time a slot is held (`svc_us`), the live replica count it was told and the
adapted capacity per replica (serving.gateway.queue.fair_queue, fair_queue.lua, capacity.store). This
reads those keys with read-only commands (ZCARD, HGET, GET: never the queue's script, which
also reclaims and admits) and derives the wait a request joining now would see.

The policy's `__call__` runs on Serve's controller loop and must not block it, so the reads run
in a daemon thread every `refresh_s` and the policy reads the cached figures; older than
`stale_s` they count as unknown (the decision then never scales down on them). The same shape
as Ray's own `PrometheusQueryMixin` (ray/serve/autoscaling_policy.py).

The Redis URL comes from the controller's environment (`url_env`), never from the Serve config:
the config is readable by anyone who can read the RayService, and the URL carries a password.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from serving.autoscaling.decision import expected_wait_s
from serving.autoscaling.signals import QueueFigures
from serving.gateway.capacity.store import capacity_key
from serving.gateway.queue.fair_queue import queue_keys

# Under Serve's logger ("ray.serve"): the policy runs in Serve's controller, whose log it joins.
log = logging.getLogger("ray.serve.llmstack_autoscaling")

REDIS_URL_ENV = "LLMSTACK_AUTOSCALING_REDIS_URL"


@dataclass(frozen=True)
class QueueSource:
    """Which model's queue, and what the gateway assumes when Redis holds no figure."""

    model: str  # the served name: the gateway's key
    tiers: int  # the gateway's queue tiers (one sorted set each)
    max_ongoing_requests: int  # capacity per replica until the adaptive capacity stored one
    max_replicas: int  # replicas the gateway assumes until told the live count


def read_figures(client: Any, source: QueueSource) -> QueueFigures:
    """One round trip of read-only commands on the model's queue keys."""
    keys = queue_keys(source.model, source.tiers)
    pipe = client.pipeline(transaction=False)
    for queue in keys.queues:
        pipe.zcard(queue)
    pipe.hget(keys.state, "svc_us")
    pipe.get(keys.replicas)
    pipe.hget(capacity_key(source.model), "slots")
    *depths, svc_us, live, slots = pipe.execute()
    depth = sum(int(d) for d in depths)
    mean_slot_s = int(svc_us) / 1e6 if svc_us is not None and int(svc_us) >= 0 else None
    replicas = int(live) if live is not None else source.max_replicas
    per_replica = int(slots) if slots is not None and int(slots) > 0 else source.max_ongoing_requests
    capacity = max(1, replicas) * per_replica
    return QueueFigures(depth=depth, expected_wait_s=expected_wait_s(depth, mean_slot_s, capacity))


@dataclass
class _Cache:
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    figures: QueueFigures | None = None
    at: float = 0.0


def connect(url: str, timeout_s: float) -> Any:
    """The controller's Redis client, sending on connect only what its Redis user may run
    (infra.plan.redis_acl.autoscaler_user: `read_figures`' reads, and AUTH, always allowed).
    redis-py (>= 5) would also send, unless told otherwise, CLIENT SETINFO (lib_name/lib_version
    None: not sent) and, since 8 speaks RESP3 by default, HELLO and CLIENT MAINT_NOTIFICATIONS
    (protocol 2: AUTH alone). It swallows their refusals, but Redis logs each one in ACL LOG on
    every reconnect, where an operator looks for attacks."""
    import redis

    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        protocol=2,
        lib_name=None,
        lib_version=None,
    )


def _refresh(cache: _Cache, url: str, source: QueueSource, refresh_s: float) -> None:
    from redis.exceptions import RedisError

    client = connect(url, refresh_s)
    while not cache.stop.is_set():
        try:
            figures = read_figures(client, source)
            with cache.lock:
                cache.figures, cache.at = figures, time.monotonic()
        except (RedisError, OSError, ValueError) as exc:  # the figures go stale; the decision holds
            log.warning("gateway queue of model %s not read (%s)", source.model, type(exc).__name__)
        cache.stop.wait(refresh_s)
    client.close()


class GatewayQueue:
    """The latest figures of one model's gateway queue, refreshed in the background."""

    def __init__(
        self, source: QueueSource, *, url_env: str = REDIS_URL_ENV, refresh_s: float = 5.0, stale_s: float = 20.0
    ) -> None:
        self.source, self.refresh_s, self.stale_s = source, refresh_s, stale_s
        self._url = os.environ.get(url_env)
        self._cache = _Cache()
        self._started = False
        if not self._url:
            log.info("%s is not set: model %s scales on its engines' figures only", url_env, source.model)

    @property
    def watched(self) -> bool:
        """A Redis URL is configured: the figures are expected (None from `figures` is then unknown)."""
        return bool(self._url)

    def figures(self) -> QueueFigures | None:
        """The latest figures, or None: no Redis configured, not read yet, or stale."""
        if not self._url:
            return None
        if not self._started:
            self._started = True
            threading.Thread(
                target=_refresh,
                args=(self._cache, self._url, self.source, self.refresh_s),
                name=f"llmstack-queue-{self.source.model}",
                daemon=True,
            ).start()
            # Stop the thread when Serve replaces the policy (a config change builds a new one).
            weakref.finalize(self, self._cache.stop.set)
        with self._cache.lock:
            if self._cache.figures is None or time.monotonic() - self._cache.at > self.stale_s:
                return None
            return self._cache.figures
