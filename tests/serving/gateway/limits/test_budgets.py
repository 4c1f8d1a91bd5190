"""Monthly budgets in dollars: calendar months in UTC, dollars <-> tokens at a rate, and the Lua
an admit/settle script calls, on a real redis-server, including two gateway processes charging
one budget at once (the budget is shared, never multiplied by the replicas)."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import datetime, timezone
from decimal import Decimal

import pytest

from infra.spec.stack_file import PROJECT_ROOT
from serving.gateway.limits.budget_metrics import BudgetUsage
from serving.gateway.limits.budgets import (
    BUDGET_LUA,
    cost_nano_usd,
    month_of,
    month_window,
    nano_usd,
    seconds_until_next_month,
    spend_expire_at,
    spend_key,
    tokens_for_usd,
    used_ratio,
)

UTC = timezone.utc
# How an admit script uses the budget: check, refuse with the scope, or charge the reservation.
# KEYS[1]: spend_key; ARGV: key_id, cost, key budget, tenant budget (nano-USD), expire_at.
ADMIT = (
    BUDGET_LUA
    + """
local r = budget_check(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
if r[1] ~= '' then return {0, r[1], r[2], r[3]} end
budget_charge(KEYS[1], ARGV[1], ARGV[2], ARGV[5])
return {1, '', r[2], r[3]}
"""
)
# Settlement: billed cost minus reserved cost (negative refunds), into the month charged.
SETTLE = BUDGET_LUA + "budget_charge(KEYS[1], ARGV[1], ARGV[2], ARGV[3]) return 1"
RATE = Decimal("0.25")  # USD per 1M tokens


def test_calendar_months_in_utc():
    assert month_window("2026-12") == (datetime(2026, 12, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC))
    assert month_window("2028-02")[1] == datetime(2028, 3, 1, tzinfo=UTC)
    assert month_of(datetime(2026, 11, 30, 23, 59, 59, tzinfo=UTC)) == "2026-11"
    assert month_of(datetime.fromisoformat("2026-12-01T00:30:00+02:00")) == "2026-11"  # still November in UTC
    assert seconds_until_next_month(datetime(2026, 11, 30, 23, 59, 0, tzinfo=UTC)) == 60
    assert spend_key("acme", "2026-11") == "llmstack:{tenant:acme}:spend:2026-11"
    assert spend_expire_at("2026-11") == int(datetime(2027, 1, 5, tzinfo=UTC).timestamp())
    with pytest.raises(ValueError, match="YYYY-MM"):
        month_window("2026-13")


def test_dollars_and_tokens_at_a_rate():
    assert cost_nano_usd(1_000_000, RATE) == 250_000_000  # 1M tokens at $0.25/1M: $0.25
    assert cost_nano_usd(1, Decimal("0.000001")) == 1  # a fraction of a nano-dollar rounds up: never free
    assert tokens_for_usd(Decimal("10"), RATE) == 40_000_000
    assert tokens_for_usd(Decimal("1"), Decimal("0.3")) == 3_333_333  # whole tokens, rounded down
    assert nano_usd(Decimal("12.5")) == 12_500_000_000
    assert used_ratio(800_000_000, Decimal("1")) == 0.8
    with pytest.raises(ValueError, match="rate"):
        tokens_for_usd(Decimal("1"), Decimal("0"))


def admit(empty_redis, key_id: str, tokens: int, key_budget_usd: str = "0", tenant_budget_usd: str = "0") -> list:
    return empty_redis.eval(
        ADMIT,
        1,
        spend_key("acme", "2026-11"),
        key_id,
        cost_nano_usd(tokens, RATE),
        nano_usd(Decimal(key_budget_usd)),
        nano_usd(Decimal(tenant_budget_usd)),
        spend_expire_at("2026-11"),
    )


def test_key_budget_refuses_then_settlement_refunds(empty_redis):
    # $1 at $0.25/1M tokens buys 4M tokens: four 1M-token reservations fit, a fifth does not.
    assert [admit(empty_redis, "k1", 1_000_000, "1")[0] for _ in range(5)] == [1, 1, 1, 1, 0]
    assert admit(empty_redis, "k1", 1_000_000, "1")[1:] == ["key", "1000000000", "1000000000"]
    # One request used only half its reservation: the refund makes room for half a million tokens.
    refund = cost_nano_usd(500_000, RATE) - cost_nano_usd(1_000_000, RATE)
    empty_redis.eval(SETTLE, 1, spend_key("acme", "2026-11"), "k1", refund, spend_expire_at("2026-11"))
    assert admit(empty_redis, "k1", 500_000, "1")[0] == 1
    assert admit(empty_redis, "k1", 1, "1")[0] == 0
    assert empty_redis.expiretime(spend_key("acme", "2026-11")) == spend_expire_at("2026-11")


def test_tenant_budget_covers_all_its_keys_and_zero_means_none(empty_redis):
    assert admit(empty_redis, "k1", 3_000_000, tenant_budget_usd="1")[0] == 1
    assert admit(empty_redis, "k2", 2_000_000, tenant_budget_usd="1")[:2] == [0, "tenant"]
    assert admit(empty_redis, "k2", 1_000_000, tenant_budget_usd="1")[0] == 1
    assert admit(empty_redis, "k3", 10**9)[0] == 1  # no budget at all


def test_usd_to_nano_reads_a_stored_decimal(empty_redis):
    script = BUDGET_LUA + "return string.format('%.0f', usd_to_nano(ARGV[1]))"
    assert empty_redis.eval(script, 0, "12.5") == "12500000000"
    assert empty_redis.eval(script, 0, "250.10") == "250100000000"
    assert empty_redis.eval(script, 0, "") == "0"


CHARGER = """
import sys, redis
from serving.gateway.limits.budgets import BUDGET_LUA, spend_expire_at
client = redis.Redis.from_url(sys.argv[1])
script = client.register_script(BUDGET_LUA + '''
local r = budget_check(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
if r[1] ~= '' then return 0 end
budget_charge(KEYS[1], ARGV[1], ARGV[2], ARGV[5])
return 1''')
client.incr('ready')
client.blpop(['go'], timeout=30)  # start together with the other process
args = ['k1', 250_000_000, 10_000_000_000, 0, spend_expire_at('2026-11')]
admitted = sum(script(keys=[sys.argv[2]], args=args) for _ in range(60))
print(admitted)
"""


def test_two_gateway_processes_share_one_budget(empty_redis, redis_server):
    # Two processes race 60 admissions each of $0.25 against one $10 budget: exactly 40 fit.
    key = spend_key("acme", "2026-11")
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", CHARGER, redis_server.url, key], cwd=PROJECT_ROOT, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    deadline = time.monotonic() + 60
    while empty_redis.get("ready") != "2" and time.monotonic() < deadline:
        time.sleep(0.05)
    empty_redis.rpush("go", 1, 2)
    admitted = [int(run.communicate(timeout=60)[0]) for run in runs]
    assert sum(admitted) == 40, admitted
    assert empty_redis.hget(key, "key:k1") == empty_redis.hget(key, "tenant") == str(10_000_000_000)


def test_budget_gauge_shows_only_the_current_month():
    now = {"t": datetime(2026, 11, 20, tzinfo=UTC).timestamp()}
    gauge = BudgetUsage(now=lambda: now["t"])
    gauge.observe("acme", "k1", 900_000_000, Decimal("1"), datetime(2026, 11, 20, tzinfo=UTC))
    gauge.observe("acme", "", 100_000_000, Decimal("1"), datetime(2026, 11, 20, tzinfo=UTC))
    samples = {tuple(s.labels.values()): s.value for family in gauge.collect() for s in family.samples}
    assert samples == {("acme", "k1"): 0.9, ("acme", ""): 0.1}
    now["t"] = datetime(2026, 12, 1, 0, 0, 1, tzinfo=UTC).timestamp()  # renewed: stop alerting at once
    assert [s for family in gauge.collect() for s in family.samples] == []
