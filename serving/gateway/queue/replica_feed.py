"""Live replica counts from Ray Serve, so each model's capacity follows its replicas.

Without a feed the fair queue assumes a model has its stack's `max_replicas` (the most Serve could
run), and that a model with `min_replicas: 0` may be cold on every request. With it, every
`poll_s` the gateway asks Ray's REST API which replicas run (`GET /api/serve/applications/` on the
dashboard, the call `serve status` and KubeRay make) and publishes each model's count to the queue
(`FairQueue.set_replicas`), valid for a few polls. When the dashboard does not answer, the gateway
logs it once per outage, counts it (`replica_feed_errors_total`) and stops publishing: the last
figure expires and the stack's figure holds again.

The response is `ServeInstanceDetails` (python/ray/serve/schema.py, Ray 2.60): `applications` ->
name -> `deployments` -> name -> `replicas`, each with a `state` (ReplicaState: STARTING,
UPDATING, RECOVERING, RUNNING, STOPPING, ...). Only RUNNING replicas take requests. A model's
replicas belong to its LLMServer deployment (infra.render.serve_config.llm_deployment_name),
found in whichever application holds it: one per model on the direct path, one for all otherwise.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from serving.gateway.redis.client import raise_if_cancel_was_lost, stop_loops

log = logging.getLogger("llmstack.gateway.replica_feed")

APPLICATIONS_PATH = "/api/serve/applications/"
RUNNING = "RUNNING"
VALID_POLLS = 3  # a published count outlives this many missed polls, then the stack's figure holds


def running_replicas(details: Any, deployments: Mapping[str, str]) -> dict[str, int]:
    """Served model -> replicas RUNNING, from a `GET /api/serve/applications/` body. `deployments`:
    served model -> its Serve deployment's name. A model whose deployment the body does not list
    is left out (unknown, not zero: its application may not be deployed yet); a listed deployment
    without running replicas is 0 (scaled to zero, or starting)."""
    if not isinstance(details, dict) or not isinstance(details.get("applications"), dict):
        raise ValueError("not a Serve instance details document (no 'applications' object)")
    found: dict[str, int] = {}
    by_deployment = {name: model for model, name in deployments.items()}
    for application in details["applications"].values():
        for name, deployment in ((application or {}).get("deployments") or {}).items():
            model = by_deployment.get(name)
            if model is None or not isinstance(deployment, dict):
                continue
            replicas = deployment.get("replicas") or []
            found[model] = found.get(model, 0) + sum(
                1 for replica in replicas if isinstance(replica, dict) and replica.get("state") == RUNNING
            )
    return found


Publish = Callable[[str, int, float], Awaitable[None]]


class ReplicaFeed:
    """Polls the dashboard at `url` every `poll_s` and publishes each model's running replicas."""

    def __init__(
        self,
        url: str,
        deployments: Mapping[str, str],
        publish: Publish,
        *,
        poll_s: float,
        token: str | None = None,
        on_error: Callable[[str], None] = lambda kind: None,
        on_count: Callable[[str, int], None] = lambda model, count: None,
    ) -> None:
        self.url = url.rstrip("/") + APPLICATIONS_PATH
        # Ray's token authentication reads `Authorization: Bearer <token>` (Ray 2.60,
        # ray/_private/authentication/http_token_authentication.py).
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        self.deployments, self.publish, self.poll_s = dict(deployments), publish, poll_s
        self.on_error, self.on_count = on_error, on_count
        self._failing = False
        self._task: asyncio.Task[None] | None = None
        self._session: Any = None

    async def start(self) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=max(1.0, self.poll_s)), headers=self._headers
        )
        self._task = asyncio.create_task(self._run(), name="replica-feed")

    async def aclose(self) -> None:
        if self._task is not None:
            await stop_loops([self._task])
        if self._session is not None:
            await self._session.close()

    async def _run(self) -> None:
        while True:
            await self.poll_once()
            # Publishing the counts to Redis can return with aclose()'s cancel eaten (Python 3.11):
            # the feed would poll on, and aclose() would wait for it.
            raise_if_cancel_was_lost()
            await asyncio.sleep(self.poll_s)

    async def poll_once(self) -> dict[str, int] | None:
        """One poll: the counts it published, or None when the dashboard or the queue failed."""
        import aiohttp

        try:
            async with self._session.get(self.url) as response:
                response.raise_for_status()
                counts = running_replicas(await response.json(content_type=None), self.deployments)
            for model, count in counts.items():
                await self.publish(model, count, self.poll_s * VALID_POLLS)
                self.on_count(model, count)
        except (aiohttp.ClientError, TimeoutError, ValueError, RuntimeError) as exc:
            raise_if_cancel_was_lost()  # the cancel may come back as the queue's own error
            self.on_error(_kind(exc))
            if not self._failing:  # once per outage: a dashboard down for an hour is one line, plus the metric
                log.warning(
                    "live replica counts unavailable from %s (%s: %s); each model's capacity falls back "
                    "to its stack figure (max_replicas x max_ongoing_requests)",
                    self.url,
                    type(exc).__name__,
                    exc,
                )
            self._failing = True
            return None
        if self._failing:
            log.info("live replica counts from %s again", self.url)
        self._failing = False
        return counts


def _kind(exc: BaseException) -> str:
    """The metric label of a failed poll."""
    import aiohttp

    if isinstance(exc, aiohttp.ClientResponseError):
        return "status"  # e.g. 401 without Ray's token, 503 while the controller restarts
    if isinstance(exc, ValueError):
        return "body"
    if isinstance(exc, RuntimeError):
        return "queue"  # Redis did not take the count (serving.gateway.queue.fair_queue.QueueUnavailable)
    return "unreachable"
