"""How many replicas a model needs, from what saturates it: the decision, pure.

Ongoing requests say how busy a replica is, not whether it is full. An LLM replica is full
when its engine cannot take the next request: the KV cache is used up (long prompts fill it
at low concurrency) or the scheduler holds requests waiting; and users feel it as time in the
gateway's queue before the engine even sees their request. So `decide` scales up when any of
those saturates, and down only when all of them are quiet and the load would still fit on one
replica fewer:

- up, one replica at a time, from the replicas that run (not the target): while a new replica
  loads its weights (minutes) the same saturation asks for the same target, not one more per tick;
- down, one replica at a time, only when the engine waits for nothing, nobody waits in the
  gateway's queue, and the KV use spread over one replica fewer stays under `kv_cache_low`.
  `kv_cache_low` under `kv_cache_high` is the hysteresis: the KV use after a scale-down cannot
  be what triggers the next scale-up;
- between the two, hold: neither direction, so Serve's own delay counters reset;
- `cooldown_s` after any change: the signals are averaged over Serve's look-back window, which
  still holds the load from before the change.

Serve then applies `upscale_delay_s` / `downscale_delay_s` to what this returns (a direction must
hold that long before it is acted on), and clamps to the bounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SaturationThresholds(BaseModel):
    """`llmstack:models[].autoscaling.saturation`: when a model's replicas count as full, and as idle."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine_waiting_per_replica: float = Field(
        default=1.0,
        gt=0,
        description="Scale up when vLLM's schedulers hold at least this many requests waiting per replica (averaged "
        "over Serve's look-back window): the engine has no room (KV cache or max_num_seqs) to start "
        "them. 1: on average every replica had a request it could not start.",
    )
    kv_cache_high: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="Scale up when the replicas' mean KV cache use reaches this fraction. vLLM takes KV blocks as "
        "sequences grow: near full, a new long prompt waits and running sequences get preempted "
        "(recomputed), which costs every stream on the replica.",
    )
    kv_cache_low: float = Field(
        default=0.5,
        ge=0,
        lt=1,
        description="Scale down only if the KV use spread over one replica fewer stays under this fraction. Must be "
        "under kv_cache_high: the gap keeps a steady load from flapping between two replica counts.",
    )
    queue_depth_per_replica: float = Field(
        default=4.0,
        gt=0,
        description="Scale up when the gateway's fair queue for the model holds this many requests per replica: "
        "requests the gateway keeps out of the engine because its capacity is used up.",
    )
    queue_wait_s: float = Field(
        default=2.0,
        gt=0,
        description="Scale up when a request joining the gateway's queue now would wait this long: its depth times "
        "the mean time a slot is held, over the model's capacity (the queue's own figures in Redis). "
        "An estimate that moves with the queue; the measured waits (their p90) are the gateway's "
        "llmstack_gateway_queue_wait_seconds, which trail the queue by the wait itself.",
    )
    cooldown_s: float = Field(
        default=60.0,
        ge=0,
        description="Hold the replica count this long after any change: Serve's look-back window still averages "
        "the load from before it.",
    )

    @model_validator(mode="after")
    def _hysteresis(self) -> SaturationThresholds:
        if self.kv_cache_low >= self.kv_cache_high:
            raise ValueError(
                f"kv_cache_low {self.kv_cache_low} must be under kv_cache_high {self.kv_cache_high}: "
                "without a gap a steady load flaps between two replica counts"
            )
        return self


@dataclass(frozen=True)
class Signals:
    """What the engine and the gateway know about one model now. None: not known (no replica
    reported yet, or the gateway's Redis is not reachable); an unknown signal never scales down."""

    ongoing: float  # Serve's own count: requests running or queued at the replicas, all replicas
    engine_waiting: float | None  # requests vLLM's schedulers hold waiting, all replicas
    kv_cache_use: float | None  # mean KV cache use of the replicas, 0..1
    queue_depth: float | None  # requests waiting in the gateway's fair queue for the model
    queue_wait_s: float | None  # how long a request joining that queue now would wait


@dataclass(frozen=True)
class Replicas:
    running: int  # replicas serving now
    target: int  # what Serve aims for (above running while new replicas start)
    min: int
    max: int
    target_ongoing_requests: float  # the stack's per-replica load: idle below it (scale to zero needs 0)


class Why(str, Enum):
    ENGINE_WAITING = "engine_waiting"
    KV_CACHE = "kv_cache"
    QUEUE_DEPTH = "queue_depth"
    QUEUE_WAIT = "queue_wait"
    QUIET = "quiet"
    HOLD = "hold"
    COOLDOWN = "cooldown"
    COLD_START = "cold_start"


@dataclass(frozen=True)
class Decision:
    replicas: int
    why: Why


def saturated(signals: Signals, replicas: int, t: SaturationThresholds) -> Why | None:
    """The first signal that says the model's `replicas` are full, or None."""
    n = max(1, replicas)
    if signals.engine_waiting is not None and signals.engine_waiting >= t.engine_waiting_per_replica * n:
        return Why.ENGINE_WAITING
    if signals.kv_cache_use is not None and signals.kv_cache_use >= t.kv_cache_high:
        return Why.KV_CACHE
    if signals.queue_depth is not None and signals.queue_depth >= t.queue_depth_per_replica * n:
        return Why.QUEUE_DEPTH
    if signals.queue_wait_s is not None and signals.queue_wait_s >= t.queue_wait_s:
        return Why.QUEUE_WAIT
    return None


def quiet_with_one_fewer(signals: Signals, replicas: Replicas, t: SaturationThresholds) -> bool:
    """Every signal known and quiet, and the load would fit on `running - 1` replicas."""
    if None in (signals.engine_waiting, signals.kv_cache_use, signals.queue_depth):
        return False
    assert signals.engine_waiting is not None and signals.kv_cache_use is not None
    if signals.engine_waiting > 0 or signals.queue_depth or (signals.queue_wait_s or 0) > 0:
        return False
    fewer = replicas.running - 1
    if fewer <= 0:  # to zero only when nothing at all is asked of the model
        return signals.ongoing <= 0
    return (
        signals.kv_cache_use * replicas.running / fewer < t.kv_cache_low
        and signals.ongoing / fewer <= replicas.target_ongoing_requests
    )


def decide(
    signals: Signals, replicas: Replicas, t: SaturationThresholds, *, now: float, last_change: float | None
) -> Decision:
    """The replica count to ask Serve for, within [min, max]."""

    def bounded(n: int) -> int:
        return max(replicas.min, min(replicas.max, n))

    if replicas.running == 0:
        # Nothing measures an engine that does not run: start one when anything is asked of it.
        asked = signals.ongoing > 0 or (signals.queue_depth or 0) > 0
        return Decision(bounded(max(replicas.target, 1 if asked else 0)), Why.COLD_START if asked else Why.HOLD)
    if last_change is not None and now - last_change < t.cooldown_s:
        return Decision(bounded(replicas.target), Why.COOLDOWN)
    why = saturated(signals, replicas.running, t)
    if why is not None:
        return Decision(bounded(max(replicas.target, replicas.running + 1)), why)
    if quiet_with_one_fewer(signals, replicas, t):
        return Decision(bounded(replicas.running - 1), Why.QUIET)
    return Decision(bounded(replicas.target), Why.HOLD)


def expected_wait_s(depth: float, mean_slot_s: float | None, capacity: float) -> float | None:
    """How long a request joining a queue of `depth` waits when `capacity` slots each free up after
    `mean_slot_s` on average (Little's law on the fair queue's own figures); None when unknown."""
    if mean_slot_s is None or capacity <= 0:
        return None
    return depth * mean_slot_s / capacity if depth > 0 else 0.0
