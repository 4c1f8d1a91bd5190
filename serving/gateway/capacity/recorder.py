"""What the relay tells the capacity about each stream it forwards: when it went upstream, when
each chunk came back. Local to one gateway process, synchronous and O(1) per chunk; the store
(serving.gateway.capacity.store) sends what accumulated to Redis once per tick.

    timer = recorder.start(model, loop.time())   # the request leaves for the upstream
    for chunk in upstream:                       # each body chunk that carries tokens
        timer.chunk(loop.time())
    timer.end()                                  # finally: the stream ended, however it ended

The first chunk's delay is the TTFT sample, each later gap an ITL sample. The TTFT counts from
the moment the request goes upstream, after any wait in the gateway's queue: the capacity is
about what the engine does with what it was given; the queue's wait is the fair queue's.

A stream resumed on another replica (serving.gateway.upstream.resuming_relay) calls `resumed()`
when its continuation goes out: the delay to the continuation's first chunk (noticing the break,
then the new replica's prefill of prompt and answer so far) is neither: counted as an ITL, one
dying replica's streams would look like an engine far over its latency target and cut the
capacity of the healthy ones. The continuation's later gaps are ITL samples like any.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from serving.gateway.capacity.histogram import Histogram


@dataclass(frozen=True)
class WindowReport:
    """One process's samples of one model since its last report."""

    ttft: dict[int, int]  # histogram bucket -> count
    itl: dict[int, int]
    peak_in_flight: int  # most streams of the model this process had in flight at once

    @property
    def empty(self) -> bool:
        return not self.ttft and not self.itl and self.peak_in_flight == 0


@dataclass
class _ModelSamples:
    ttft: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)
    in_flight: int = 0
    peak: int = 0


class StreamTimer:
    """One relayed request; `chunk` at each body chunk that carries tokens, `end` once at the end."""

    def __init__(self, samples: _ModelSamples | None, started: float) -> None:
        self._samples, self._last, self._first = samples, started, True
        self._resuming = False  # the next chunk is a continuation's first: not a sample
        if samples is not None:
            samples.in_flight += 1
            samples.peak = max(samples.peak, samples.in_flight)

    def chunk(self, now: float) -> None:
        if self._samples is None:
            return
        if not self._resuming:
            gap_ms = max(0.0, (now - self._last) * 1000)
            (self._samples.ttft if self._first else self._samples.itl).add(gap_ms)
        self._first, self._last, self._resuming = False, now, False

    def resumed(self) -> None:
        """The upstream stream broke and a continuation is on its way to another replica: its first
        chunk counts as no sample (module docstring); gaps after it count as ITL."""
        self._resuming = True

    def end(self) -> None:
        if self._samples is not None:
            self._samples.in_flight -= 1
            self._samples = None  # a second end counts nothing twice


class LatencyRecorder:
    """Per-model latency samples of one gateway process. Only the served `models` are recorded:
    a model name from a request body never makes Redis keys."""

    def __init__(self, models: Iterable[str]) -> None:
        self._models = {model: _ModelSamples() for model in models}

    def start(self, model: str | None, now: float) -> StreamTimer:
        return StreamTimer(self._models.get(model or ""), now)

    def take(self, model: str) -> WindowReport:
        """What accumulated for `model`, and start again (the peak from what is in flight now)."""
        samples = self._models[model]
        report = WindowReport(samples.ttft.take(), samples.itl.take(), samples.peak)
        samples.peak = samples.in_flight
        return report

    def in_flight(self, model: str) -> int:
        return self._models[model].in_flight
