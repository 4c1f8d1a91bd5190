"""The vLLM scheduler's latest figures, kept in the replica's process for Serve's autoscaler.

vLLM hands every stat logger the scheduler's stats after each engine step (`StatLoggerBase`, the
interface vLLM documents for custom loggers). This one keeps only the latest figures per engine
index; `replica.LLMServer.record_autoscaling_stats` reads them when Serve polls. vLLM loads it
through its stat logger plugin entry point (`vllm.stat_logger_plugins` in pyproject.toml): Ray
Serve LLM builds the engine and passes its own loggers only, so the plugin is vLLM's one
supported way in. The engine core runs in its own process, but stat loggers run in the
frontend (`AsyncLLM`), which is the Serve replica's process, so a module global is shared.

It is loaded in every vLLM engine of an image with llmstack installed; keeping three numbers
per step costs nothing measurable. `VLLM_PLUGINS` (vLLM's allow-list) can leave it out.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase


@dataclass(frozen=True)
class SchedulerLoad:
    waiting: int  # requests the scheduler holds waiting (deferred ones included)
    running: int
    kv_cache_use: float  # 0..1


_lock = threading.Lock()
_latest: dict[int, SchedulerLoad] = {}  # engine index -> its latest figures


def latest() -> dict[int, SchedulerLoad]:
    """A copy of the latest figures of every engine of this process (empty before the first step)."""
    with _lock:
        return dict(_latest)


def forget() -> None:
    with _lock:
        _latest.clear()


class SchedulerLoadTap(StatLoggerBase):  # type: ignore[misc]  # vLLM's types are Any to mypy
    """A vLLM stat logger that keeps the scheduler's waiting, running and KV cache use."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.engine_index = engine_index

    def record(
        self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
    ) -> None:
        if scheduler_stats is None:  # an iteration without scheduler figures changes nothing
            return
        deferred = int(getattr(scheduler_stats, "num_skipped_waiting_reqs", 0))  # waiting as well, just later
        load = SchedulerLoad(
            waiting=int(scheduler_stats.num_waiting_reqs) + deferred,
            running=int(scheduler_stats.num_running_reqs),
            kv_cache_use=float(scheduler_stats.kv_cache_usage),
        )
        with _lock:
            _latest[engine_idx] = load

    def log_engine_initialized(self) -> None:
        pass
