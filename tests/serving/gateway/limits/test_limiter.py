"""Limits beyond one key's own: tenants, the admission day, shadow keys' slots, and admission
order (what is checked before a body is read).

Real redis-server, the real gateway under uvicorn with the real proxy, the vLLM-like upstream
of conftest; the limiter's own scripts where a clock must be moved (UTC midnight).
"""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
import redis

from serving.gateway.auth.keys import create_key_sync
from serving.gateway.config.gateway_policy import KeyLimits, TenantLimits
from serving.gateway.limits.limiter import Limiter
from serving.gateway.limits.local_limiter import LocalLimiter
from serving.gateway.limits.tenants import TenantStore, counter_keys, tenant_daily_key
from serving.gateway.limits.ticket import Phase, Ticket, Who
from serving.gateway.metering.usage_meter import Usage
from serving.gateway.redis.client import ScriptCall
from tests.support.servers import HANG_BOUND_S
from tests.support.vllm_upstream import daily_used, directive, key_id_of, running_gateway
from tests.support.waiting import eventually


@pytest.fixture(scope="module")
def shadow_limited_gateway(redis_server, upstream):
    with running_gateway(upstream.url, redis_server.url, shadow_max_concurrent_requests=2) as url:
        yield url


def chat(shadow_limited_gateway: str, key: str, text: str = "hi", **fields) -> httpx.Response:
    body = json.dumps({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": text}], **fields})
    return httpx.post(
        f"{shadow_limited_gateway}/v1/chat/completions",
        content=body,
        timeout=HANG_BOUND_S,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )


def set_tenant(redis_url: str, tenant: str, **limits: int) -> None:
    async def go() -> None:
        store = TenantStore(redis_url)
        try:
            await store.set(tenant, limits)
        finally:
            await store.aclose()

    asyncio.run(go())


class HeldStream:
    """A streamed request the upstream pauses after its first chunk, holding a concurrency slot
    until closed."""

    def __init__(self, shadow_limited_gateway: str, key: str, rid: str) -> None:
        body = json.dumps(
            {
                "model": "tiny",
                "stream": True,
                "max_tokens": 5,
                "messages": [{"role": "user", "content": directive(id=rid, pause_after=1)}],
            }
        )
        self._client = httpx.Client(timeout=HANG_BOUND_S)
        self._stream = self._client.stream(
            "POST",
            f"{shadow_limited_gateway}/v1/chat/completions",
            content=body,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        self.response = self._stream.__enter__()

    def close(self) -> None:
        self._stream.__exit__(None, None, None)
        self._client.close()


# --- tenants -------------------------------------------------------------------------------------


def test_a_tenants_keys_share_its_limits(shadow_limited_gateway, redis_server):
    """The attack: a tenant with k keys had k times every limit."""
    set_tenant(redis_server.url, "shared", requests_per_minute=3)
    keys = [create_key_sync(redis_server.url, "shared", f"k{i}", limits={"requests_per_minute": 100}) for i in range(3)]
    other = create_key_sync(redis_server.url, "another", "k", limits={"requests_per_minute": 100})
    statuses = [chat(shadow_limited_gateway, keys[i % 3]).status_code for i in range(4)]
    assert statuses == [200, 200, 200, 429]
    refused = chat(shadow_limited_gateway, keys[0])
    assert refused.status_code == 429 and "tenant" in refused.json()["error"]["message"]
    assert refused.json()["error"]["type"] == "requests" and int(refused.headers["retry-after"]) >= 1
    assert chat(shadow_limited_gateway, other).status_code == 200  # other tenants are untouched


def test_default_tenant_limits_apply_to_every_tenant(redis_server, upstream):
    with running_gateway(upstream.url, redis_server.url, default_tenant_limits={"max_concurrent_requests": 1}) as gw:
        first, second = (create_key_sync(redis_server.url, "defaulted", n) for n in ("a", "b"))
        held = HeldStream(gw, first, "tenant-slot")
        try:
            refused = chat(gw, second)
            assert refused.status_code == 429 and "tenant" in refused.json()["error"]["message"]
            assert chat(gw, create_key_sync(redis_server.url, "elsewhere", "c")).status_code == 200
        finally:
            held.close()
        eventually(lambda: chat(gw, second).status_code == 200, "the tenant's slot was not freed")


def test_a_tenant_refusal_charges_neither_the_key_nor_the_tenant(shadow_limited_gateway, redis_server):
    set_tenant(redis_server.url, "budgeted", daily_token_budget=2_000)
    key = create_key_sync(redis_server.url, "budgeted", "k")
    names = counter_keys("budgeted", key_id_of(key))
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        before = {name: client.dump(name) for name in names}
        refused = chat(shadow_limited_gateway, key, max_tokens=3_000)  # reserves more than the tenant's whole day
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "daily_token_budget_exceeded"
        assert refused.headers["x-should-retry"] == "false"
        assert {name: client.dump(name) for name in names} == before
    finally:
        client.close()


# --- the admission day ---------------------------------------------------------------------------


def who(key_id: str, tenant: str = "night") -> Who:
    return Who(key_id=key_id, tenant=tenant, limits=KeyLimits(), tenant_defaults=TenantLimits())


def test_settling_after_utc_midnight_refunds_the_day_that_was_charged(redis_server):
    """A request admitted yesterday and settled today used to subtract its refund from today's
    counter, handing out today's budget twice. Redis's clock cannot be set, so "yesterday" is the
    day before the one both admissions were charged to; should a real UTC midnight fall between
    the two, the scenario runs again under a fresh tenant (it cannot happen twice in a row)."""

    async def go(tenant: str) -> tuple[int, int]:
        limiter = Limiter(redis_server.url, "closed", request_timeout_s=60, on_redis_error=lambda: None)
        try:
            yesterday = await limiter.admit(who("midnight", tenant), 1_000)
            today = await limiter.admit(who("midnight", tenant), 300)
            yesterday.day -= 1  # as if admitted before midnight: the counter now holds today's usage
            await yesterday.settle(Usage(10, 0))
            await today.settle(Usage(100, 200))
        finally:
            await limiter.aclose()
        return yesterday.day + 1, today.day

    for tenant in ("night", "night-again"):
        day, today_day = asyncio.run(go(tenant))
        if day == today_day:
            break
    assert day == today_day
    # Today's counter holds today's reservation plus the request "from yesterday" as charged at
    # admission: nothing of its 990-token refund belongs to today.
    assert daily_used(redis_server.url, counter_keys(tenant, "midnight")[3]) == 1_000 + 300
    assert daily_used(redis_server.url, tenant_daily_key(tenant)) == 1_000 + 300


def test_the_local_limiter_carries_the_admission_day_too():
    clock = [86_400 * 20_000 - 1.0]  # one second before a UTC midnight
    local = LocalLimiter(slot_ttl_s=60, concurrency_wait_s=1.0, clock=lambda: clock[0])
    budget = Who(
        key_id="local", tenant="night", limits=KeyLimits(daily_token_budget=1_300), tenant_defaults=TenantLimits()
    )

    def admit(reserved: int) -> tuple[Ticket, bool]:
        ticket = Ticket(who=budget, reserved=reserved, slot_id=str(reserved))
        ticket.apply(Phase.ALL, asyncio.run(local.admit(ticket, Phase.ALL, TenantLimits())))
        return ticket, ticket.allowed

    before, _ = admit(1_000)
    clock[0] += 2  # past midnight: a new day's budget
    assert admit(300)[1]
    asyncio.run(local.settle(before, Usage(4, 6), give_back_request=False))  # yesterday's 990 refund: not today's
    assert not admit(1_001)[1]  # 300 + 1,001 > 1,300; had the refund hit today's counter, it would fit
    assert admit(1_000)[1]


def test_an_admit_carries_another_script_in_its_round_trip_only_when_redis_decides(redis_server):
    """The fair queue's try rides along the limiter's admit, whatever the verdict; the local
    limiter sends nothing, and the caller then sees the call unsent."""
    import redis.asyncio

    counter = "limits-test:along"

    async def go() -> list[tuple[bool, object, bool]]:
        client = redis.asyncio.Redis.from_url(redis_server.url)
        script = client.register_script("return redis.call('INCR', KEYS[1])")
        in_redis = Limiter(redis_server.url, "closed", request_timeout_s=60, on_redis_error=lambda: None)
        local = Limiter(None, "local", request_timeout_s=60, on_redis_error=lambda: None)
        capped = Who(
            key_id="along", tenant="along", limits=KeyLimits(requests_per_minute=1), tenant_defaults=TenantLimits()
        )
        seen = []
        try:
            for limiter, phases in [(in_redis, "all"), (in_redis, "slot+tokens"), (in_redis, "all"), (local, "all")]:
                call = ScriptCall(script, [counter], [])
                if phases == "all":
                    ticket = await limiter.admit(capped, 10, along=call)
                else:
                    ticket = await limiter.admit_slot(who("along-2"))
                    await limiter.admit_tokens(ticket, 10, along=call)
                seen.append((call.sent, call.result, ticket.allowed))
        finally:
            await in_redis.aclose()
            await local.aclose()
            await client.aclose()
        return seen

    redis.Redis.from_url(redis_server.url).delete(counter)
    # The third admit is refused (one request a minute): the script still ran, for its owner to undo.
    assert asyncio.run(go()) == [(True, 1, True), (True, 2, True), (True, 3, False), (False, None, True)]


# --- shadow mode -----------------------------------------------------------------------------------


def test_shadow_keys_hold_slots_and_stay_bounded(shadow_limited_gateway, redis_server, access_lines):
    """Shadow keys used to skip concurrency slots entirely: any number of requests in flight."""
    key = create_key_sync(redis_server.url, "acme", "shadow", limits={"max_concurrent_requests": 1})
    asyncio.run(_update(redis_server.url, key_id_of(key), shadow=True))
    # the second is over the key's limit
    held = [HeldStream(shadow_limited_gateway, key, f"shadow-{i}") for i in range(2)]
    try:
        assert [h.response.status_code for h in held] == [200, 200]
        # past shadow_max_concurrent_requests (2): refused even in shadow mode
        refused = chat(shadow_limited_gateway, key)
        assert refused.status_code == 429 and "shadow" in refused.json()["error"]["message"]
        shadow_lines = eventually(lambda: access_lines.of(key_id_of(key), "shadow_rate_limited"), "no shadow line")
        assert shadow_lines[0]["limit"] == "concurrency"
    finally:
        for h in held:
            h.close()
    eventually(lambda: chat(shadow_limited_gateway, key).status_code == 200, "the shadow key's slots were not freed")


async def _update(redis_url: str, key_id: str, **changes) -> None:
    from serving.gateway.auth.keys import RedisKeyStore

    store = RedisKeyStore(redis_url)
    try:
        assert await store.update(key_id, **changes) is not None
    finally:
        await store.aclose()


# --- admission order -------------------------------------------------------------------------------


def send_headers(shadow_limited_gateway: str, key: str, length: int) -> socket.socket:
    """Open a request that promises a `length`-byte body and send none of it."""
    host, port = shadow_limited_gateway.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=HANG_BOUND_S)
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n".encode()
    )
    return sock


def test_a_large_body_waits_for_its_keys_slot_before_it_is_read(shadow_limited_gateway, redis_server):
    """Slow uploads from one key used to be read (and held in memory) however many it sent. A
    large body is now read only once its key has a concurrency slot for it: the second answer
    comes while its body has not been sent at all."""
    key = create_key_sync(redis_server.url, "acme", "uploader", limits={"max_concurrent_requests": 1})
    first = send_headers(shadow_limited_gateway, key, 500_000)  # holds the key's only slot while "uploading"
    try:
        eventually(lambda: _slots(redis_server.url, key) == 1, "the first upload took no slot")
        second = send_headers(shadow_limited_gateway, key, 500_000)
        with second:
            answer = second.recv(4096).decode()
        assert answer.startswith("HTTP/1.1 429"), answer
        assert '"concurrency' in answer or "concurrent requests" in answer
    finally:
        first.close()
    eventually(lambda: _slots(redis_server.url, key) == 0, "the abandoned upload kept its slot")


def test_a_refusal_after_the_slot_phase_gives_everything_back(shadow_limited_gateway, redis_server):
    key = create_key_sync(redis_server.url, "acme", "refused-late", limits={"requests_per_minute": 5})
    names = counter_keys("acme", key_id_of(key))
    client = redis.Redis.from_url(redis_server.url)
    try:
        before = {name: client.dump(name) for name in names}
        big = "x" * 100_000  # past the early-read size: the slot phase runs first
        refused = chat(shadow_limited_gateway, key, big, n=100)  # then the policy refuses it
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"
        assert {name: client.dump(name) for name in names} == before
    finally:
        client.close()


def _slots(redis_url: str, key: str) -> int:
    client = redis.Redis.from_url(redis_url)
    try:
        return client.zcard(counter_keys("acme", key_id_of(key))[2])
    finally:
        client.close()
