"""The usage ledger on a real redis-server: its key scheme (one Cluster slot with the tenant's
limiter counters), the Lua a settle script calls, and reading the hashes back."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import date, datetime, timezone

import redis
from redis.crc import key_slot

from serving.gateway.limits.usage_ledger import (
    LEDGER_LUA,
    RETENTION_DAYS,
    DailyUsage,
    day_pattern,
    expire_at,
    parse_usage_hash,
    parse_usage_key,
    record_call,
    usage_key,
)

NOV_5 = datetime(2026, 11, 5, 13, 30, tzinfo=timezone.utc)

# How a settle script uses the ledger: its own work first, then ledger_record last, so that an
# error in the ledger (a script is not rolled back) can never keep a slot from being freed.
# Here KEYS[1] stands for the limiter's in-flight slots; KEYS[2] and ARGV[2..6] are record_call's.
SETTLE_WITH_LEDGER = (
    LEDGER_LUA
    + """
redis.call('ZREM', KEYS[1], ARGV[1])
ledger_record(KEYS[2], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6])
return 1
"""
)


def settle(
    empty_redis, tenant: str, key_id: str, model: str, prompt: int, completion: int, moment: datetime = NOV_5
) -> None:
    keys, args = record_call(tenant, key_id, model, prompt, completion, moment)
    slots = f"llmstack:{{tenant:{tenant}}}:key:{key_id}:slots"
    empty_redis.zadd(slots, {"slot-1": 1})
    empty_redis.eval(SETTLE_WITH_LEDGER, 2, slots, *keys, "slot-1", *args)


def test_ledger_keys_share_the_slot_of_the_tenants_counters():
    name = usage_key("acme", date(2026, 11, 5))
    assert name == "llmstack:{tenant:acme}:usage:2026-11-05"
    assert key_slot(name.encode()) == key_slot(b"llmstack:{tenant:acme}:key:k1:rpm")
    assert parse_usage_key(name) == ("acme", date(2026, 11, 5))


def test_hostile_tenant_names_stay_inside_their_tag():
    tenant = "evil}:usage:2026-01-01{tenant:acme"
    name = usage_key(tenant, date(2026, 11, 5))
    assert name.count("{") == 1 and name.count("}") == 1
    assert parse_usage_key(name) == (tenant, date(2026, 11, 5))
    assert parse_usage_key("llmstack:{tenant:acme}:spend:2026-11") is None
    assert parse_usage_key("llmstack:{key:abc}:daily") is None


def test_settlement_records_tokens_per_key_and_model(empty_redis):
    settle(empty_redis, "acme", "k1", "llama", 100, 20)
    settle(empty_redis, "acme", "k1", "llama", 5, 0)
    settle(empty_redis, "acme", "k2", "org/model|v2", 7, 3)
    settle(empty_redis, "acme", "k2", "llama", 0, 0)  # nothing billed: nothing recorded
    settle(empty_redis, "beta", "k9", "llama", 10**15, 1)  # large counts stay exact (no exponent notation)
    name = usage_key("acme", NOV_5.date())
    assert empty_redis.zcard("llmstack:{tenant:acme}:key:k1:slots") == 0  # the settle's own work ran too
    assert parse_usage_hash("acme", NOV_5.date(), empty_redis.hgetall(name)) == [
        DailyUsage(NOV_5.date(), "acme", "k1", "llama", 105, 20, 2),
        DailyUsage(NOV_5.date(), "acme", "k2", "org/model|v2", 7, 3, 1),
    ]
    assert empty_redis.hget(usage_key("beta", NOV_5.date()), "k9|prompt|llama") == str(10**15)
    assert empty_redis.expiretime(name) == expire_at(NOV_5.date())
    day_end = int(datetime(2026, 11, 6, tzinfo=timezone.utc).timestamp())
    assert expire_at(NOV_5.date()) == day_end + RETENTION_DAYS * 86400


def test_days_are_separate_hashes_found_by_pattern(empty_redis):
    settle(empty_redis, "acme", "k1", "llama", 1, 1, NOV_5)
    settle(empty_redis, "beta", "k2", "llama", 1, 1, NOV_5)
    settle(empty_redis, "acme", "k1", "llama", 1, 1, datetime(2026, 11, 6, 0, 0, 1, tzinfo=timezone.utc))
    assert sorted(empty_redis.scan_iter(match=day_pattern(NOV_5.date()))) == [
        usage_key("acme", NOV_5.date()),
        usage_key("beta", NOV_5.date()),
    ]


def test_concurrent_settlements_lose_nothing(empty_redis, redis_server):
    def worker(n: int) -> None:
        client = redis.Redis.from_url(redis_server.url)
        script = client.register_script(SETTLE_WITH_LEDGER)
        keys, args = record_call("acme", f"k{n % 2}", "llama", 3, 2, NOV_5)
        for _ in range(100):
            script(keys=["llmstack:{tenant:acme}:slots", *keys], args=["s", *args])
        client.close()

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(worker, range(4)))
    rows = parse_usage_hash("acme", NOV_5.date(), empty_redis.hgetall(usage_key("acme", NOV_5.date())))
    assert [(r.key_id, r.prompt_tokens, r.completion_tokens, r.requests) for r in rows] == [
        ("k0", 600, 400, 200),
        ("k1", 600, 400, 200),
    ]
