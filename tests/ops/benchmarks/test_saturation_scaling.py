"""The saturation benchmark's findings, on hand-made timelines. Ongoing phase 0-100 s: one replica
throughout, waits of 2 s. Saturation phase 200-400 s: Serve's target goes to 2 at 230 s, the second
replica runs at 260 s; waits of 3 s before it, 0.1 s after; then either steady or flapping."""

from __future__ import annotations

from ops.benchmarks.saturation_scaling import (
    SETTLE_S,
    Request,
    Sample,
    replica_sample,
    saturation_findings,
)


def ongoing_phase():
    samples = [Sample(float(t), 1, 1) for t in range(0, 100)]
    requests = [Request(float(t), t + 3.0, 2.0) for t in range(0, 100, 2)]
    return samples, requests, 0.0, 100.0


def saturation_samples(flap_at: float | None = None) -> list[Sample]:
    samples = []
    for t in range(200, 400):
        running, target = (1, 1) if t < 230 else (1, 2) if t < 260 else (2, 2)
        if flap_at is not None and flap_at <= t < flap_at + 20:
            target = 1  # a scale-down asked for, then undone
        samples.append(Sample(float(t), running, target))
    return samples


def saturation_requests() -> list[Request]:
    requests = [Request(float(t), t + 4.0, 3.0 if t < 260 else 0.1) for t in range(200, 400)]
    return requests + [Request(300.0, 301.0, None, "APIConnectionError")]


def test_the_saturation_policy_scaled_waits_fell_and_nothing_flapped():
    found = saturation_findings(ongoing_phase(), (saturation_samples(), saturation_requests(), 200.0, 400.0))
    assert (found.ongoing.replicas_max, found.ongoing.changes) == (1, 0)
    assert found.ongoing.waits.p90_s == 2.0
    assert (found.scale_up_decided_s, found.second_replica_running_s) == (30.0, 60.0)
    assert found.saturation.replicas_max == 2 and found.saturation.changes == 2  # target up, then running up
    assert found.before_scale_up.p90_s == 3.0
    assert found.before_scale_up.requests == 260 - 200 - int(SETTLE_S)  # the first SETTLE_S left out
    assert found.steady is not None and found.steady.waits.p90_s == 0.1 and found.steady.waits.errors == 1
    assert found.p90_fell is True and found.flapping is False


def test_a_target_that_moves_in_the_steady_phase_is_flapping():
    found = saturation_findings(ongoing_phase(), (saturation_samples(flap_at=330), saturation_requests(), 200.0, 400.0))
    assert found.steady is not None and found.steady.changes == 2
    assert found.flapping is True


def test_no_second_replica_means_no_steady_phase_and_no_verdict():
    samples = [Sample(float(t), 1, 1) for t in range(200, 400)]
    found = saturation_findings(ongoing_phase(), (samples, saturation_requests(), 200.0, 400.0))
    assert found.second_replica_running_s is None and found.steady is None
    assert found.p90_fell is None and found.flapping is None


def test_a_sample_reads_running_replicas_and_serves_target_from_serve_details():
    details = {
        "applications": {
            "tiny-saturation": {
                "deployments": {
                    "LLMServer:tiny-saturation": {
                        "target_num_replicas": 2,
                        "replicas": [{"state": "RUNNING"}, {"state": "STARTING"}],
                    }
                }
            }
        }
    }
    assert replica_sample(details, "LLMServer:tiny-saturation", 5.0) == Sample(5.0, 1, 2)
    assert replica_sample(details, "LLMServer:other", 5.0) == Sample(5.0, 0, None)
