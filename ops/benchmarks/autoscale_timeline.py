"""What the autoscaling demo measured, from its raw record: replica-count samples, the
moments load started, a replica was killed and load stopped, and every request's result.

Pure, so the demo's figures can be checked on hand-made timelines. All times are seconds on
one monotonic clock; the findings are relative to the event they follow.
"""

from __future__ import annotations

from collections import Counter

from pydantic import BaseModel, Field

from ops.benchmarks.resume_metrics import quantile
from ops.llmctl.bench.stats import RequestResult


class Sample(BaseModel):
    """One `serve.status()` reading of the model deployment's replicas, by state."""

    t: float = Field(description="When the reading was taken.")
    states: dict[str, int] = Field(description="Replica count per state, e.g. {'RUNNING': 1, 'STARTING': 1}.")

    @property
    def running(self) -> int:
        return self.states.get("RUNNING", 0)

    @property
    def total(self) -> int:  # replicas that exist or are being made; stopping ones are leaving
        return sum(n for state, n in self.states.items() if state not in ("STOPPING", "STOPPED"))


class Findings(BaseModel):
    """The figures BENCHMARKS.md records; None where the event did not happen."""

    peak_running: int = Field(description="Most RUNNING replicas seen.")
    upscale_decided_s: float | None = Field(description="Load start -> a second replica exists (any state).")
    scaled_up_s: float | None = Field(description="Load start -> two replicas RUNNING.")
    kill_detected_s: float | None = Field(description="Kill -> fewer RUNNING replicas reported.")
    recovered_s: float | None = Field(description="Kill -> as many RUNNING replicas as before the kill.")
    failed_after_kill: int = Field(description="Requests that failed between the kill and the recovery.")
    failed_after_kill_by_type: dict[str, int] = Field(description="Those failures by error type.")
    last_failure_after_kill_s: float | None = Field(description="Kill -> the last failed request's end.")
    ok_during_recovery: int = Field(description="Requests that succeeded between kill and recovery.")
    in_flight_at_kill: int = Field(description="Requests sent before the kill that had not finished.")
    in_flight_at_kill_failed: int = Field(description="How many of those failed.")
    in_flight_at_kill_max_e2e_s: float | None = Field(description="Slowest of those, end to end.")
    in_flight_gap_s: dict[str, float | None] = Field(
        description="The pause those streams showed their client around the kill (`gaps_at`): p50, p99, max "
        "(nearest rank); what a resume costs the reader, or a replica's slowdown when none was needed."
    )
    failed_before_kill: int = Field(description="Failures under load before the kill (should be 0).")
    failed_after_recovery: int = Field(description="Failures after recovery, until load stopped.")
    scaled_down_s: float | None = Field(description="Load stop -> one replica left (RUNNING, nothing else).")
    replica_changes: list[tuple[float, dict[str, int]]] = Field(
        description="(seconds since load start, states) at every change: the replica count over time."
    )


def _first(samples: list[Sample], after: float, condition) -> Sample | None:
    return next((s for s in samples if s.t >= after and condition(s)), None)


def _since(sample: Sample | None, event: float) -> float | None:
    return None if sample is None else round(sample.t - event, 1)


def changes(samples: list[Sample], origin: float) -> list[tuple[float, dict[str, int]]]:
    """Only the samples whose states differ from the one before: a readable timeline."""
    out: list[tuple[float, dict[str, int]]] = []
    for sample in samples:
        if not out or out[-1][1] != sample.states:
            out.append((round(sample.t - origin, 1), dict(sample.states)))
    return out


def gaps_at(results: list[RequestResult], kill_at: float) -> list[float]:
    """For each request in flight at `kill_at` that got content after it: the pause between its
    last chunk before the kill (or the kill, for one still in prefill) and its first after it."""
    gaps = []
    for r in results:
        if not r.start <= kill_at <= r.end:
            continue
        before = [t for t in r.chunk_times if t <= kill_at]
        after = [t for t in r.chunk_times if t > kill_at]
        if after:
            gaps.append(after[0] - (before[-1] if before else kill_at))
    return gaps


def findings(
    samples: list[Sample], results: list[RequestResult], load_start: float, kill_at: float | None, load_stop: float
) -> Findings:
    killed = kill_at is not None
    up_decided = _first(samples, load_start, lambda s: s.total >= 2)
    scaled_up = _first(samples, load_start, lambda s: s.running >= 2)
    before = max((s.running for s in samples if s.t <= (kill_at or 0)), default=0) if kill_at else 0
    if kill_at is not None:
        detected = _first(samples, kill_at, lambda s: s.running < before)
        recovered = _first(samples, detected.t, lambda s: s.running >= before) if detected else None
        window_end = recovered.t if recovered else load_stop
    else:
        detected = recovered = None
        window_end = kill_at = load_stop
    in_window = [r for r in results if r.end >= kill_at and r.start <= window_end]
    failed = [r for r in in_window if r.error]
    in_flight = [r for r in results if r.start <= kill_at <= r.end]
    down = _first(samples, load_stop, lambda s: s.running == 1 and s.total == 1)
    gaps = gaps_at(results, kill_at) if killed else []
    return Findings(
        peak_running=max((s.running for s in samples), default=0),
        upscale_decided_s=_since(up_decided, load_start),
        scaled_up_s=_since(scaled_up, load_start),
        kill_detected_s=_since(detected, kill_at) if detected else None,
        recovered_s=_since(recovered, kill_at) if recovered else None,
        failed_after_kill=len(failed),
        failed_after_kill_by_type=dict(Counter(r.error for r in failed)),
        last_failure_after_kill_s=round(max(r.end for r in failed) - kill_at, 1) if failed else None,
        ok_during_recovery=len(in_window) - len(failed),
        in_flight_at_kill=len(in_flight),
        in_flight_at_kill_failed=sum(1 for r in in_flight if r.error),
        in_flight_at_kill_max_e2e_s=round(max(r.end - r.start for r in in_flight), 1) if in_flight else None,
        in_flight_gap_s={
            name: None if value is None else round(value, 3)
            for name, value in (
                ("p50", quantile(gaps, 0.5)),
                ("p99", quantile(gaps, 0.99)),
                ("max", max(gaps, default=None)),
            )
        },
        failed_before_kill=sum(1 for r in results if r.error and r.end < kill_at),
        failed_after_recovery=sum(1 for r in results if r.error and r.start > window_end),
        scaled_down_s=_since(down, load_stop),
        replica_changes=changes(samples, load_start),
    )
