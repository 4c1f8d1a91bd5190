"""From what Serve and the gateway report to `decision.Signals`: plain data in, plain data out.

Each replica reports its engine's figures under the names below (`replica.LLMServer`); Serve
averages each replica's reports over `look_back_period_s` and hands the policy one value per
metric per replica (`AutoscalingContext.aggregated_metrics`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from serving.autoscaling.decision import Signals

ENGINE_WAITING = "llmstack_engine_waiting"
KV_CACHE_USE = "llmstack_kv_cache_use"


class _Load(Protocol):
    @property
    def waiting(self) -> int: ...
    @property
    def kv_cache_use(self) -> float: ...


def engine_metrics(loads: Iterable[_Load]) -> dict[str, float]:
    """One replica's report: waiting requests summed over its engines, the highest KV use
    (a replica is as full as its fullest engine). Empty before the engine's first step."""
    loads = list(loads)
    if not loads:
        return {}
    return {
        ENGINE_WAITING: float(sum(load.waiting for load in loads)),
        KV_CACHE_USE: max(load.kv_cache_use for load in loads),
    }


@dataclass(frozen=True)
class QueueFigures:
    """The gateway's fair queue for one model, as read from its Redis."""

    depth: int  # requests waiting, all tiers
    expected_wait_s: float | None  # how long a request joining now would wait; None: unknown


def signals(
    ongoing: float,
    aggregated: Mapping[str, Mapping[Any, float]] | None,
    running: Iterable[Any],
    queue: QueueFigures | None,
) -> Signals:
    """`aggregated`: Serve's per-metric, per-replica averages; only `running` replicas count
    (a stopping replica's last report says nothing of the replicas that stay). An engine figure
    is known once every running replica reported it: a replica still loading its weights has
    not, and a mean without it would call the others idle."""
    running = list(running)
    aggregated = aggregated or {}

    def per_replica(name: str) -> list[float] | None:
        values = aggregated.get(name, {})
        if not running or any(replica not in values for replica in running):
            return None
        return [float(values[replica]) for replica in running]

    waiting = per_replica(ENGINE_WAITING)
    kv = per_replica(KV_CACHE_USE)
    return Signals(
        ongoing=max(0.0, float(ongoing)),
        engine_waiting=None if waiting is None else sum(waiting),
        kv_cache_use=None if kv is None else sum(kv) / len(kv),
        queue_depth=None if queue is None else float(queue.depth),
        queue_wait_s=None if queue is None else queue.expected_wait_s,
    )
