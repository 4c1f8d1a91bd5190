"""The fair queue's pure decisions: tags, capacity, wait budgets, Retry-After, 429 versus 503,
and the queue policy model."""

from __future__ import annotations

import heapq

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from serving.gateway.config.queue_policy import ModelQueue, QueuePolicy, QueueTier
from serving.gateway.queue.fair_share import (
    MAX_RETRY_AFTER_S,
    capacity,
    drain_time_s,
    may_be_cold,
    refusal,
    retry_after_s,
    start_tag,
    tag_increment,
    wait_budget_s,
)


def sfq_order(backlog: dict[str, tuple[int, float]], served: int) -> list[str]:
    """The first `served` tenants admitted from a backlog {tenant: (requests, weight)}, by the
    tag rules alone (a reference for what fair_queue.lua does)."""
    heap, finish, seq = [], {}, 0
    for tenant, (count, weight) in backlog.items():
        for _ in range(count):
            start = start_tag(0.0, finish.get(tenant, 0.0))
            finish[tenant] = start + tag_increment(1, weight)
            heapq.heappush(heap, (start, seq, tenant))
            seq += 1
    return [heapq.heappop(heap)[2] for _ in range(served)]


def test_weights_set_the_shares_of_a_backlog():
    order = sfq_order({"a": (100, 2.0), "b": (100, 1.0)}, 60)
    assert (order.count("a"), order.count("b")) == (40, 20)


@given(st.lists(st.integers(min_value=1, max_value=4), min_size=2, max_size=5))
def test_backlogged_shares_follow_any_weights(weights):
    backlog = {f"t{i}": (200, float(w)) for i, w in enumerate(weights)}
    served = 10 * sum(weights)
    order = sfq_order(backlog, served)
    for i, w in enumerate(weights):
        assert abs(order.count(f"t{i}") - 10 * w) <= 1


def test_an_idle_tenant_starts_at_the_virtual_time():
    # Virtual time 5 (the flood's request being served started there); the flood's own tag is far ahead.
    assert start_tag(5.0, 0.0) == 5.0
    assert start_tag(5.0, 42.0) == 42.0


@pytest.mark.parametrize("cost, weight", [(0, 1), (1, 0), (-1, 1)])
def test_tags_need_positive_cost_and_weight(cost, weight):
    with pytest.raises(ValueError):
        tag_increment(cost, weight)


def test_capacity_follows_live_replicas_and_wakes_a_model_at_zero():
    assert capacity(None, default_replicas=4, per_replica=48) == 192
    assert capacity(2, default_replicas=4, per_replica=48) == 96
    assert capacity(0, default_replicas=4, per_replica=48) == 48


def test_cold_when_no_replica_runs_or_may_not():
    scale_to_zero, always_on = ModelQueue(max_ongoing_requests=8, min_replicas=0), ModelQueue(max_ongoing_requests=8)
    assert may_be_cold(None, scale_to_zero) and not may_be_cold(None, always_on)
    assert may_be_cold(0, always_on) and not may_be_cold(1, scale_to_zero)
    assert wait_budget_s(30, cold=True, cold_start_timeout_s=600) == 600
    assert wait_budget_s(30, cold=False, cold_start_timeout_s=600) == 30
    assert wait_budget_s(900, cold=True, cold_start_timeout_s=600) == 900


def test_retry_after_is_the_drain_time_in_whole_seconds_within_bounds():
    assert drain_time_s(ahead=99, capacity_=10, mean_service_s=2.0) == pytest.approx(20.0)
    assert retry_after_s(ahead=99, capacity_=10, mean_service_s=2.0) == 20
    assert retry_after_s(ahead=0, capacity_=100, mean_service_s=0.5) == 1
    assert retry_after_s(ahead=10**6, capacity_=1, mean_service_s=5.0) == MAX_RETRY_AFTER_S
    assert retry_after_s(ahead=9, capacity_=10, mean_service_s=None) >= 1  # nothing measured yet


def test_a_tenant_waiting_behind_its_own_requests_gets_429_everyone_else_503():
    common = {"ahead": 40, "capacity_": 8, "mean_service_s": 2.0, "model": "llama", "tier": "standard"}
    own = refusal("timeout", tenant_waiting=3, **common)
    saturated = refusal("timeout", tenant_waiting=0, **common)
    pushed = refusal("pushed_out", tenant_waiting=0, **common)
    assert (own.status, own.code) == (429, "tenant_queue_share_exceeded")
    assert (saturated.status, saturated.code) == (503, "model_saturated")
    assert pushed.status == 429
    assert own.retry_after_s == saturated.retry_after_s == 11
    assert "llama" in own.message and "3 other request" in own.message


def test_policy_ranks_tiers_and_sends_unknown_names_to_the_default():
    policy = QueuePolicy()
    assert [t.name for t in policy.tiers] == ["interactive", "standard", "batch"]
    assert policy.rank("interactive") == 0 and policy.rank("batch") == 2
    assert policy.rank(None) == policy.rank("retired-tier") == policy.rank("standard") == 1
    assert policy.tier("nope").name == "standard"
    assert [t.capacity_share for t in policy.tiers] == [1.0, 1.0, 0.75]  # batch leaves a quarter free


def test_policy_refuses_a_default_tier_it_does_not_define_and_duplicate_tiers():
    with pytest.raises(ValidationError, match="default_tier"):
        QueuePolicy(tiers=[QueueTier(name="gold")], default_tier="standard")
    with pytest.raises(ValidationError, match="unique"):
        QueuePolicy(tiers=[QueueTier(name="gold"), QueueTier(name="gold")], default_tier="gold")
    with pytest.raises(ValidationError, match="capacity_share"):
        QueuePolicy(tiers=[QueueTier(name="gold", capacity_share=0.5), QueueTier(name="bulk")], default_tier="bulk")
    with pytest.raises(ValidationError):
        ModelQueue(max_ongoing_requests=8, min_replicas=3, max_replicas=2)


def test_the_fair_queue_imports_in_the_slim_gateway_image():
    """The gateway image has no Ray, vLLM, torch, Pulumi, infra or ops; its Lua ships as package data."""
    import subprocess
    import sys
    from pathlib import Path

    poison = "import sys\nfor m in ('ray', 'vllm', 'torch', 'pulumi', 'infra', 'ops'): sys.modules[m] = None\n"
    code = poison + (
        "import serving.gateway.queue.fair_queue as fq\nassert 'local function promote' in fq.LUA\nprint('ok')"
    )
    root = Path(__file__).resolve().parents[4]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=False)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
