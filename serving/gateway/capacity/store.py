"""The adaptive capacity in Redis: every gateway replica reports, one runs the law, all agree.

    store = CapacityStore(redis_url, {"llama": ModelCapacity(ttft_ms=800, itl_ms=60, max_slots=64)})
    slots = await store.tick("llama", recorder.take("llama"), replicas=2)  # every window / 2
    slots = await store.slots("llama")                                     # what every replica reads

Windows are numbered by Redis' clock (capacity.lua), so replicas agree on where one ends. Each
`tick` adds this process's samples to the current window's histogram (one script call), and
claims the law's run for the window that just closed when nobody ran it yet: a short lease
(`lease_s`, under a window) makes one replica the claimant; it reads the merged windows, runs
the law (serving.gateway.capacity.law) here in Python and stores the result with a second call,
which only the lease's holder can do, once per window. A replica that dies holding the lease
delays the decision by at most the lease; samples are merged by addition, so no replica's count
is lost whoever decides.

The capacity is per replica of the model (the fair queue multiplies it by the live replica
count, as it does max_ongoing_requests today): a new replica adds its share at once, and the
latency the law sees is what each engine does with its load.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any

from serving.gateway.capacity.law import (
    DEFAULT_TUNING,
    CapacityState,
    Move,
    Tuning,
    WindowCounts,
    initial_state,
    next_state,
    summarize,
)
from serving.gateway.capacity.recorder import LatencyRecorder, StreamTimer, WindowReport
from serving.gateway.config.capacity_policy import ModelCapacity
from serving.gateway.redis.client import raise_if_cancel_was_lost, stop_loops

log = logging.getLogger("llmstack.gateway.capacity")

LUA = (resources.files("serving.gateway.capacity") / "capacity.lua").read_text()
DEFAULT_WINDOW_S = 2.0
RING = DEFAULT_TUNING.max_windows + 2  # the windows the law reads, the one filling, and one to spare


def capacity_key(model: str) -> str:
    """The hash holding the model's capacity per replica (field `slots`): under the fair queue's
    hash tag, so fair_queue.lua can read it in the same script call (one Cluster slot)."""
    return f"llmstack:{{fq:{model}}}:cap"


def capacity_keys(model: str, ring: int = RING) -> list[str]:
    """The script's KEYS: state, lease, then the window ring (layout in capacity.lua)."""
    base = capacity_key(model)
    return [base, f"{base}:lease", *(f"{base}:w{i}" for i in range(ring))]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _state(reply: list[Any], model: ModelCapacity) -> CapacityState | None:
    """The stored state from a script's (slots, changed, move, decided) fields; None: none yet."""
    slots = int(reply[0])
    if slots < 0:
        return None
    changed, move = _text(reply[1]), _text(reply[2])
    return CapacityState(
        slots=slots,
        changed_window=int(changed) if changed else initial_state(model).changed_window,
        move=Move(move) if move in Move._value2member_map_ else Move.UNMEASURED,
    )


def _windows(rows: list[Any], replicas: int) -> dict[int, WindowCounts]:
    windows = {}
    for row in rows:
        ttft: dict[int, int] = {}
        itl: dict[int, int] = {}
        for name, count in zip(row[2::2], row[3::2]):
            field = _text(name)
            (ttft if field[0] == "t" else itl)[int(field[1:])] = int(count)
        windows[int(row[0])] = WindowCounts(ttft, itl, float(_text(row[1])) / max(1, replicas))
    return windows


class CapacityStore:
    """One per gateway process. `models`: served model name -> its targets and bounds."""

    def __init__(
        self,
        redis_url: str,
        models: Mapping[str, ModelCapacity],
        *,
        window_s: float = DEFAULT_WINDOW_S,
        lease_s: float | None = None,
        tuning: Tuning = DEFAULT_TUNING,
        owner: str | None = None,
    ) -> None:
        from serving.gateway.redis.client import redis_client

        if tuning.max_windows + 2 > RING:
            raise ValueError(f"tuning.max_windows {tuning.max_windows} needs a ring of more than {RING} windows")
        self.models, self.window_s, self.tuning = dict(models), window_s, tuning
        self.lease_s = window_s / 2 if lease_s is None else lease_s
        self.owner = owner or uuid.uuid4().hex
        self._redis = redis_client(redis_url)
        self._script = self._redis.register_script(LUA)
        self._slots: dict[str, int] = {}  # the last capacity this process read, per model

    async def aclose(self) -> None:
        await self._redis.aclose()

    def manages(self, model: str | None) -> bool:
        return model in self.models

    async def _call(self, model: str, op: str, *args: Any) -> Any:
        return await self._script(keys=capacity_keys(model), args=[op, int(self.window_s * 1e6), *args])

    async def tick(self, model: str, report: WindowReport, replicas: int) -> int:
        """Report `report` and, if this process wins the window's lease, run the law. `replicas`:
        the model's replicas now (the fair queue's live count, else its max_replicas), to read
        the merged in-flight peak per replica. Returns the capacity per replica every gateway
        replica now reads."""
        config = self.models[model]
        pairs = [x for bucket, n in report.ttft.items() for x in (f"t{bucket}", n)]
        pairs += [x for bucket, n in report.itl.items() for x in (f"i{bucket}", n)]
        reply = await self._call(
            model,
            "tick",
            report.peak_in_flight,
            self.owner,
            max(1, int(self.lease_s * 1000)),
            self.tuning.max_windows,
            *pairs,
        )
        state = _state(reply[1:5], config)
        if int(reply[0]) == 1:
            closed = int(reply[5])
            state = state or initial_state(config)
            recent = _windows(reply[6], replicas)
            after = next_state(
                state, closed, summarize(state, closed, recent, config, self.tuning), config, self.tuning
            )
            decided = await self._call(
                model, "decide", self.owner, closed, after.slots, after.changed_window, after.move.value
            )
            if int(decided[0]) == 1 and after.slots != state.slots:
                log.info(
                    "model %s capacity %d -> %d per replica (%s)", model, state.slots, after.slots, after.move.value
                )
            slots = int(decided[1])
        else:
            slots = config.max_slots if state is None else state.slots
        self._slots[model] = slots = min(config.max_slots, max(config.min_slots, slots))
        return slots

    async def state(self, model: str) -> CapacityState | None:
        """The stored state (None while no replica has run the law for the model yet)."""
        return _state(await self._call(model, "read"), self.models[model])

    async def slots(self, model: str) -> int:
        """The model's capacity per replica as stored (its ceiling until the law first ran)."""
        state = await self.state(model)
        config = self.models[model]
        return config.max_slots if state is None else min(config.max_slots, max(config.min_slots, state.slots))

    def last_slots(self, model: str) -> int | None:
        """The capacity this process last read, without a round trip (None before its first tick)."""
        return self._slots.get(model)

    async def run(
        self,
        recorder: LatencyRecorder,
        replicas: Callable[[str], int],
        on_slots: Callable[[str, int], None] | None = None,
    ) -> None:
        """Tick every model twice a window until cancelled; a failure skips a tick (its samples
        are dropped: the next windows measure again) and the capacity stays as last read.
        `on_slots(model, slots)`: told the capacity per replica after each tick (a gauge)."""
        from redis.exceptions import RedisError

        while True:
            await asyncio.sleep(self.window_s / 2)
            for model in self.models:
                report = recorder.take(model)
                try:
                    slots = await self.tick(model, report, max(1, replicas(model)))
                    if on_slots is not None:
                        on_slots(model, slots)
                except (RedisError, OSError, TimeoutError) as exc:
                    raise_if_cancel_was_lost()  # the cancel may come back as the library's own error
                    log.warning("capacity of model %s not updated (%s)", model, type(exc).__name__)
                except Exception:  # a bug must not stop the loop: the capacity would freeze unseen
                    raise_if_cancel_was_lost()
                    log.exception("capacity of model %s not updated", model)
                # A tick can return normally with aclose()'s cancel eaten (Python 3.11): a loop that
                # went on would outlive the gateway's shutdown, and aclose() would wait for it.
                raise_if_cancel_was_lost()


class AdaptiveCapacity:
    """The whole of it for one gateway process: its recorder, its store and the ticking task.

        capacity = AdaptiveCapacity(redis_url, settings.model_capacities, replicas=live_or_max)
        await capacity.start()
        timer = capacity.timer(model, loop.time())   # the relay: chunk() per token chunk, end() at the end
        capacity.per_replica(model)                  # what the fair queue multiplies by its replicas

    `replicas(model)`: the model's replicas now (the fair queue's live count, else max_replicas)."""

    def __init__(
        self,
        redis_url: str,
        models: Mapping[str, ModelCapacity],
        *,
        replicas: Callable[[str], int],
        window_s: float = DEFAULT_WINDOW_S,
        tuning: Tuning = DEFAULT_TUNING,
        on_slots: Callable[[str, int], None] | None = None,
    ) -> None:
        self.models = dict(models)
        self.recorder = LatencyRecorder(self.models)
        self.store = CapacityStore(redis_url, self.models, window_s=window_s, tuning=tuning)
        self._replicas, self._on_slots = replicas, on_slots
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(
            self.store.run(self.recorder, self._replicas, self._on_slots), name="adaptive-capacity"
        )

    async def aclose(self) -> None:
        if self._task is not None:
            await stop_loops([self._task])
        await self.store.aclose()

    def timer(self, model: str | None, now: float) -> StreamTimer:
        return self.recorder.start(model, now)

    def per_replica(self, model: str) -> int | None:
        """The model's capacity per replica as last read from Redis (None: not yet, or not an
        adaptive model): the fair queue uses it in place of max_ongoing_requests."""
        return self.store.last_slots(model) if model in self.models else None
