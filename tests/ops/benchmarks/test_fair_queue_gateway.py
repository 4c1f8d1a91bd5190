"""The gateway fair-queue benchmark's pure parts: which phase of a switching load a moment falls in,
the scenarios it runs, and the probe's "loaded" and "alone" halves in the summary."""

from __future__ import annotations

import pytest

from ops.benchmarks.fair_queue_gateway import phase, scenarios, summarize

SWITCHING = {"on_s": 10.0, "off_s": 10.0, "settle_s": 4.0}


@pytest.mark.parametrize(
    ("t", "expected"),
    [
        (0.0, "settling"),
        (3.9, "settling"),
        (4.0, "on"),
        (9.9, "on"),
        (10.0, "settling"),
        (13.9, "settling"),
        (14.0, "off"),
        (19.9, "off"),
        (20.0, "settling"),
        (25.0, "on"),
    ],
)
def test_a_switching_load_has_settling_on_and_off_phases(t, expected):
    assert phase(t, SWITCHING) == expected


def test_a_load_that_never_switches_is_always_on():
    assert phase(123.0, {"kind": "open"}) == "on"


def test_the_probes_switch_against_the_flood_and_the_batch_load():
    plan = scenarios(capacity=8, service_s=0.5, interactive_s=240)
    assert {"b_alone", "noisy_fcfs", "noisy_fair", "jain", "interactive", "noisy_switching"} == set(plan)
    batch, interactive = plan["interactive"]["loads"]
    assert batch["tier"] == "batch" and "on_s" in batch and interactive["tier"] == "interactive"
    flood, b = plan["noisy_switching"]["loads"]
    assert flood["rate"] == pytest.approx(32.0) and "on_s" in flood and b["rate"] == pytest.approx(1.6)
    assert plan["interactive"]["probe"] == "interactive" and plan["noisy_switching"]["probe"] == "b"


def test_the_summary_splits_the_probe_by_phase_and_leaves_settling_out():
    records = [
        {"tenant": "b", "status": 200, "ttft": 0.1, "wait": 0.0, "done": 5.0, "phase": "off"},
        {"tenant": "b", "status": 200, "ttft": 0.4, "wait": 0.3, "done": 6.0, "phase": "on"},
        {"tenant": "b", "status": 200, "ttft": 9.0, "wait": 8.0, "done": 7.0, "phase": "settling"},
    ]
    summary = summarize(records, ["b"], (0.0, 30.0), probe="b")
    assert summary["b"]["ok"] == 3
    assert summary["b_alone"]["ttft_p99_s"] == 0.1 and summary["b_loaded"]["ttft_p99_s"] == 0.4
    assert summary["b_loaded"]["queued_share"] == 1.0
