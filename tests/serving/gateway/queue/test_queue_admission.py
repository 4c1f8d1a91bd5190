"""The fair queue in the gateway, through real HTTP: a saturated model queues and then serves, a
full queue sheds with 429/503 and Retry-After, a slot comes back however the response ends, and
two gateways sharing Redis never have more in flight than the model's capacity.

The upstream here (tests/support/counting_upstream.py) serves any number of requests at once and
counts them: it is the gateway that must hold the line at capacity.
The cut stream comes from the vLLM-like upstream (tests/support/vllm_upstream.py).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import redis

from serving.gateway.auth.keys import create_key_sync
from serving.gateway.capacity.engine_priority import SHARE_BANDS
from serving.gateway.config.queue_policy import ModelQueue, QueuePolicy, QueueTier
from serving.gateway.limits.tenants import counter_keys, tenant_daily_key
from serving.gateway.queue.fair_queue import queue_keys
from tests.support.counting_upstream import USAGE, CountingUpstream
from tests.support.gateway import GENEROUS, gateway_settings, generous_key, serving_gateway
from tests.support.servers import HANG_BOUND_S, serving
from tests.support.vllm_upstream import directive
from tests.support.waiting import eventually


@pytest.fixture(scope="module")
def counting() -> Iterator[CountingUpstream]:
    counting = CountingUpstream()
    with serving(counting.app()) as url:
        counting.url = url
        yield counting


@pytest.fixture
def fresh(counting: CountingUpstream) -> CountingUpstream:
    counting.reset()
    return counting


def queued_gateway(
    upstream,
    redis_url: str,
    model: str,
    capacity: int,
    *,
    max_queue_length: int = 8,
    min_replicas: int = 1,
    keepalive_s: float = 10,
    queue_timeout_s: float = HANG_BOUND_S,
    engine_priority: bool = False,
    **overrides,
):
    policy = QueuePolicy(
        tiers=[QueueTier(name="standard", max_queue_length=max_queue_length, queue_timeout_s=queue_timeout_s)],
        keepalive_s=keepalive_s,
        engine_priority=engine_priority,
    )
    queue = ModelQueue(max_ongoing_requests=capacity, min_replicas=min_replicas, cold_start_timeout_s=HANG_BOUND_S)
    settings = gateway_settings(
        upstream.url,
        redis_url,
        models=[model],
        model_context_lengths={model: 4096},
        queue=policy,
        model_queues={model: queue},
        **overrides,
    )
    return serving_gateway(settings)


def key_for(redis_url: str, tenant: str, **fields) -> str:
    """A key with generous limits; `fields` (tier, weight) set on its record."""
    return generous_key(redis_url, tenant, "queue-test", **fields)


def chat(api: str, key: str, model: str, what: str, **extra) -> httpx.Response:
    return httpx.post(
        f"{api}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": model, "messages": [{"role": "user", "content": what}], **extra},
        timeout=HANG_BOUND_S,
    )


def redis_counts(redis_url: str, model: str) -> tuple[int, int]:
    """(in flight, queued) of a model, as Redis holds them."""
    keys = queue_keys(model, 1)
    client = redis.Redis.from_url(redis_url)
    try:
        return client.zcard(keys.inflight), client.zcard(keys.queues[0])
    finally:
        client.close()


def model_name() -> str:
    return f"m-{uuid.uuid4().hex[:8]}"  # fresh queue keys for each test


def test_a_saturated_model_queues_then_serves(redis_server, fresh):
    model, key = model_name(), key_for(redis_server.url, "acme")
    with queued_gateway(fresh, redis_server.url, model, capacity=2) as (api, _), ThreadPoolExecutor(4) as pool:
        held = [pool.submit(chat, api, key, model, "hold") for _ in range(2)]
        eventually(lambda: fresh.running == 2, "two requests reach the upstream")
        waiting = pool.submit(chat, api, key, model, "hold")
        eventually(lambda: redis_counts(redis_server.url, model) == (2, 1), "the third request waits in the queue")
        assert fresh.running == 2  # the gateway held it back
        fresh.gate.set()
        responses = [f.result() for f in [*held, waiting]]
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert responses[0].headers["x-queue-wait-ms"] == "0"
    assert int(responses[2].headers["x-queue-wait-ms"]) > 0
    assert fresh.peak == 2
    assert redis_counts(redis_server.url, model) == (0, 0)


def test_a_full_queue_sheds_with_429_or_503_and_retry_after(redis_server, fresh):
    model = model_name()
    flooder, other = key_for(redis_server.url, "flooder"), key_for(redis_server.url, "quiet")
    with (
        queued_gateway(fresh, redis_server.url, model, capacity=1, max_queue_length=1) as (api, _),
        ThreadPoolExecutor(4) as pool,
    ):
        running = pool.submit(chat, api, flooder, model, "hold")
        eventually(lambda: fresh.running == 1, "one request runs")
        waiting = pool.submit(chat, api, flooder, model, "hold")
        eventually(lambda: redis_counts(redis_server.url, model) == (1, 1), "one request waits")

        own = chat(api, flooder, model, "hold")  # its tenant already waits: its own share is used up
        assert own.status_code == 429 and int(own.headers["retry-after"]) >= 1
        assert own.json()["error"]["code"] == "tenant_queue_share_exceeded"
        assert "x-queue-wait-ms" in own.headers

        client = openai.OpenAI(base_url=f"{api}/v1", api_key=other, max_retries=0)
        with pytest.raises(openai.InternalServerError) as saturated:  # everyone else's requests fill the model
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hold"}])
        assert saturated.value.status_code == 503 and saturated.value.code == "model_saturated"
        assert int(saturated.value.response.headers["retry-after"]) >= 1
        fresh.gate.set()
        assert running.result().status_code == waiting.result().status_code == 200
    assert fresh.peak == 1
    assert redis_counts(redis_server.url, model) == (0, 0)


def test_the_slot_comes_back_after_a_cut_stream(redis_server, upstream):
    model, key = model_name(), key_for(redis_server.url, "acme")
    cut = {"model": model, "stream": True, "messages": [{"role": "user", "content": directive(id="q1", pause_after=1)}]}
    with queued_gateway(upstream, redis_server.url, model, capacity=1) as (api, _):
        with httpx.stream(
            "POST",
            f"{api}/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json=cut,
            timeout=HANG_BOUND_S,
        ) as stream:
            assert stream.status_code == 200
            chunks = stream.iter_raw()  # held: a dropped iterator would close the response at once
            next(chunks)
            assert redis_counts(redis_server.url, model) == (1, 0)  # the stream holds the model's one slot
        # the client went away mid-stream: the gateway gives the slot back
        eventually(lambda: redis_counts(redis_server.url, model) == (0, 0), "the cut stream's slot is released")
        served = chat(api, key, model, "hello")  # capacity is whole again: no wait
        assert served.status_code == 200 and served.headers["x-queue-wait-ms"] == "0"


def test_the_slot_comes_back_after_an_upstream_error(redis_server, fresh):
    model, key = model_name(), key_for(redis_server.url, "acme")
    with queued_gateway(fresh, redis_server.url, model, capacity=1) as (api, _):
        for _ in range(3):  # a leaked slot would make the second one wait, then time out
            failed = chat(api, key, model, "fail")
            assert failed.status_code == 500 and failed.headers["x-queue-wait-ms"] == "0"
            assert redis_counts(redis_server.url, model) == (0, 0)
        fresh.gate.set()
        served = chat(api, key, model, "hold")
        assert served.status_code == 200 and served.headers["x-queue-wait-ms"] == "0"


QUEUE_OPS = ("try", "admit", "release", "cancel")


class RoundTrips:
    """What the gateway's asyncio Redis connections send, one entry per write (a pipeline is one),
    each the list of its command names, the fair queue's scripts named by their op ("try",
    "release", ...) instead of EVALSHA; left out: the fair queue's lease renewals (a timer) and a new
    connection's handshake (`HELLO`, `CLIENT SETINFO`: once per connection, whenever a pool opens one)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from redis.asyncio.connection import AbstractConnection

        self.sent: list[list[str]] = []
        original = AbstractConnection.send_packed_command
        trips = self

        async def counted(connection, command, check_health=True):
            packed = command if isinstance(command, bytes | str) else b"".join(command)
            packed = packed.encode() if isinstance(packed, str) else packed
            handshake = any(f"\r\n{name}\r\n".encode() in packed for name in ("HELLO", "CLIENT"))
            if b"\r\nrenew\r\n" not in packed and not handshake:
                count = {
                    name: packed.count(f"\r\n{name}\r\n".encode()) for name in ("GET", "EVALSHA", "EVAL", *QUEUE_OPS)
                }
                queue_ops = [op for op in QUEUE_OPS for _ in range(count[op])]
                scripts = count["EVALSHA"] + count["EVAL"] - len(queue_ops)
                trips.sent.append(["GET"] * count["GET"] + ["EVALSHA"] * scripts + queue_ops)
            return await original(connection, command, check_health)

        monkeypatch.setattr(AbstractConnection, "send_packed_command", counted)


def chunked(api: str, key: str, model: str, what: str) -> httpx.Response:
    """A body of undeclared length: the limiter takes the slot phase before reading it."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": what}]}).encode()
    return httpx.post(
        f"{api}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        content=iter([body]),
        timeout=HANG_BOUND_S,
    )


@pytest.mark.parametrize("body", ["small", "chunked"])
def test_an_unsaturated_request_pays_no_round_trip_for_the_queue(redis_server, fresh, monkeypatch, body):
    """Key lookup, the limiter's admit with the queue's try for a free slot, then the limiter's
    settle with the slot's release: the same round trips as without the queue. A body of
    undeclared length takes the limiter's slot phase first; its token phase carries the try."""
    model, key = model_name(), key_for(redis_server.url, "acme")
    send = chat if body == "small" else chunked
    trips = RoundTrips(monkeypatch)
    with queued_gateway(fresh, redis_server.url, model, capacity=4) as (api, _):
        fresh.gate.set()
        assert send(api, key, model, "warm").status_code == 200  # connections made, scripts loaded
        eventually(lambda: redis_counts(redis_server.url, model) == (0, 0), "the first slot is released")
        trips.sent.clear()
        served = send(api, key, model, "hi")
        assert served.status_code == 200 and served.headers["x-queue-wait-ms"] == "0"
        eventually(lambda: redis_counts(redis_server.url, model) == (0, 0), "the slot is released")
        sent = list(trips.sent)
    slot_phase = [["EVALSHA"]] if body == "chunked" else []
    assert sent == [["GET"], *slot_phase, ["EVALSHA", "try"], ["EVALSHA", "release"]], sent


def holders(redis_url: str, model: str) -> dict[bytes, bytes]:
    """Tenant -> slots it holds of a model, as Redis counts them."""
    client = redis.Redis.from_url(redis_url)
    try:
        return client.hgetall(queue_keys(model, 1).holders)
    finally:
        client.close()


def test_a_rate_limited_request_holds_no_slot_and_pushes_no_waiter_out(redis_server, fresh, monkeypatch):
    """The try for a free slot goes out before the limiter's verdict: a refused request gives the
    slot it took straight back (one more round trip, on refusals only), and a busy try queued
    nothing, so the queue is as it was."""
    model, other = model_name(), key_for(redis_server.url, "other")
    capped = create_key_sync(redis_server.url, "capped", "queue-test", limits={**GENEROUS, "requests_per_minute": 1})
    trips = RoundTrips(monkeypatch)
    with (
        queued_gateway(fresh, redis_server.url, model, capacity=2, max_queue_length=1) as (api, _),
        ThreadPoolExecutor(3) as pool,
    ):
        assert chat(api, capped, model, "hi").status_code == 200  # its one request of the minute
        held = pool.submit(chat, api, other, model, "hold")
        eventually(lambda: fresh.running == 1, "one request runs")
        trips.sent.clear()
        refused = chat(api, capped, model, "hi")  # a slot is free: its try takes it
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert redis_counts(redis_server.url, model) == (1, 0) and holders(redis_server.url, model) == {b"other": b"1"}
        assert trips.sent == [["GET"], ["EVALSHA", "try"], ["release"]], trips.sent

        running = pool.submit(chat, api, other, model, "hold")
        eventually(lambda: fresh.running == 2, "the model saturated")
        waiting = pool.submit(chat, api, other, model, "hold")
        eventually(lambda: redis_counts(redis_server.url, model) == (2, 1), "the queue full")
        trips.sent.clear()
        # Queued, this idle tenant's request would push the waiter out (fair queuing serves it first).
        assert chat(api, capped, model, "hi").status_code == 429
        assert redis_counts(redis_server.url, model) == (2, 1) and holders(redis_server.url, model) == {b"other": b"2"}
        assert trips.sent == [["GET"], ["EVALSHA", "try"]], trips.sent  # busy: nothing to give back
        fresh.gate.set()
        assert [f.result().status_code for f in (held, running, waiting)] == [200, 200, 200]
    assert redis_counts(redis_server.url, model) == (0, 0) and holders(redis_server.url, model) == {}


def test_a_saturated_model_serves_its_waiters_in_fair_order(redis_server, fresh):
    """Tenant A's backlog waits; tenant B's one request, arriving last, goes second: start-time
    fair queuing, not first come first served."""
    model = model_name()
    a, b = key_for(redis_server.url, "a"), key_for(redis_server.url, "b")
    with queued_gateway(fresh, redis_server.url, model, capacity=1) as (api, _), ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(chat, api, a, model, "hold", user="a0")]
        eventually(lambda: fresh.running == 1, "A's first request runs")
        for n, (key, user) in enumerate([(a, "a1"), (a, "a2"), (b, "b1")], start=1):
            futures.append(pool.submit(chat, api, key, model, "hold", user=user))
            eventually(lambda n=n: redis_counts(redis_server.url, model) == (1, n), f"{n} waiting")
        fresh.gate.set()
        assert [f.result().status_code for f in futures] == [200] * 4
    assert fresh.arrivals == ["a0", "a1", "b1", "a2"]
    assert fresh.peak == 1


def test_settle_and_release_survive_a_redis_that_forgot_the_scripts(redis_server, fresh):
    """A Redis restart empties its script cache: the pipelined EVALSHAs get NOSCRIPT (they did not
    run), and each runs again alone, so the usage is billed once and the slot comes back; and the
    next admission (the limiter's admit with the queue's try) is charged once and takes one slot."""
    model, tenant = model_name(), f"t-{uuid.uuid4().hex[:8]}"
    key = key_for(redis_server.url, tenant)
    client = redis.Redis.from_url(redis_server.url)
    try:
        with queued_gateway(fresh, redis_server.url, model, capacity=1) as (api, _), ThreadPoolExecutor(1) as pool:
            held = pool.submit(chat, api, key, model, "hold")
            eventually(lambda: fresh.running == 1, "the request reaches the upstream")
            client.script_flush()
            fresh.gate.set()
            assert held.result().status_code == 200
            eventually(lambda: redis_counts(redis_server.url, model) == (0, 0), "the slot is released")
            assert client.zcard(counter_keys(tenant, "any")[6]) == 0  # the tenant's concurrency slot too
            assert int(client.hget(tenant_daily_key(tenant), "used")) == USAGE["total_tokens"]  # billed what ran
            client.script_flush()
            served = chat(api, key, model, "hi")  # the one slot is free again
            assert served.status_code == 200 and served.headers["x-queue-wait-ms"] == "0"
            eventually(lambda: redis_counts(redis_server.url, model) == (0, 0), "the second slot is released")
            assert holders(redis_server.url, model) == {}
            assert int(client.hget(tenant_daily_key(tenant), "used")) == 2 * USAGE["total_tokens"]
    finally:
        client.close()


def test_two_gateways_never_exceed_the_models_capacity(redis_server, fresh):
    model, key = model_name(), key_for(redis_server.url, "acme")
    with (
        queued_gateway(fresh, redis_server.url, model, capacity=2, max_queue_length=16) as (first, _),
        queued_gateway(fresh, redis_server.url, model, capacity=2, max_queue_length=16) as (second, _),
        ThreadPoolExecutor(12) as pool,
    ):
        futures = [pool.submit(chat, api, key, model, "sleep") for api in [first, second] * 6]
        statuses = [f.result().status_code for f in futures]
    assert statuses == [200] * 12
    # Never more than the capacity, and the capacity used: twelve at once keep both slots busy (a
    # queue that let one request through at a time would also stay under 2).
    assert fresh.served == 12 and fresh.peak == 2
    assert redis_counts(redis_server.url, model) == (0, 0)


def test_the_engine_priority_is_the_keys_tier_and_never_the_clients(redis_server, recorded, start_gateway, make_key):
    key = make_key()  # no tier in its record: the default tier, "standard", rank 1
    with start_gateway(queue=QueuePolicy(engine_priority=True)) as (api, _):
        served = chat(api, key, "tiny", "hello")
        assert served.status_code == 200
        # Tier rank 1; the gateway queues no model here, so no share is known: the tier's last band.
        assert json.loads(recorded.seen[-1].body)["priority"] == 1 * SHARE_BANDS + SHARE_BANDS - 1
        sent = len(recorded.seen)
        own = chat(api, key, "tiny", "hello", priority=-100)  # a tenant jumping the engine's queue
        assert own.status_code == 400 and len(recorded.seen) == sent
    with pytest.raises(ValueError, match="priority"):  # nor can a stack let clients set it
        gateway_settings(recorded.url, redis_server.url, allowed_body_extensions=["priority"])


@pytest.mark.parametrize(("min_replicas", "status"), [(0, 200), (1, 504)])
def test_a_model_that_may_be_cold_gets_its_cold_start_as_first_byte_timeout(redis_server, fresh, min_replicas, status):
    model, key = model_name(), key_for(redis_server.url, "acme")
    with queued_gateway(
        fresh, redis_server.url, model, capacity=1, min_replicas=min_replicas, upstream_idle_timeout_s=0.5
    ) as (api, _):
        assert chat(api, key, model, "slow").status_code == status


@pytest.mark.parametrize(("fail_mode", "status"), [("local", 200), ("closed", 503)])
def test_without_redis_the_queue_follows_the_limiters_fail_mode(fresh, fail_mode, status):
    from ops.devstack.local_redis import running_redis

    model = model_name()
    with running_redis() as own_redis:
        key = key_for(own_redis.url, "acme")
        with queued_gateway(fresh, own_redis.url, model, capacity=1, limiter_fail_mode=fail_mode) as (api, metrics):
            assert chat(api, key, model, "hello").status_code == 200  # the key is now recently verified
            own_redis.stop()
            assert chat(api, key, model, "hello").status_code == status
            exposition = httpx.get(f"{metrics}/metrics", timeout=HANG_BOUND_S).text
    if fail_mode == "local":  # the limiter fell back to local limits, then the queue could not answer either
        assert 'llmstack_gateway_redis_errors_total{component="queue"} 1.0' in exposition


# --- streams that wait: keep-alive comments on a response that has begun ---------------------------


def stream_request(api: str, key: str, model: str, text: str):
    return httpx.stream(
        "POST",
        f"{api}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": model, "stream": True, "messages": [{"role": "user", "content": text}]},
        timeout=HANG_BOUND_S,
    )


@pytest.mark.parametrize("outcome", ["served", "refused", "client_left"])
def test_a_waiting_stream_gets_keep_alives_then_its_answer_or_its_refusal(redis_server, upstream, outcome):
    model, key = model_name(), key_for(redis_server.url, "acme")
    timeout = 1.0 if outcome == "refused" else HANG_BOUND_S
    with queued_gateway(upstream, redis_server.url, model, capacity=1, keepalive_s=0.2, queue_timeout_s=timeout) as (
        api,
        _,
    ):
        with stream_request(api, key, model, directive(id=f"hold-{model}", pause_after=1)) as holder:
            held = holder.iter_lines()
            next(held)  # the holder has the model's only slot
            with stream_request(api, key, model, "hello") as waiting:
                assert waiting.status_code == 200 and "x-queue-wait-ms" in waiting.headers
                lines = waiting.iter_lines()
                assert next(lines).startswith(": queued")  # sent before any slot freed
                if outcome == "client_left":
                    pass  # leaving the block closes the connection while it waits
                elif outcome == "refused":
                    rest = [line for line in lines if line and not line.startswith(":")]
                    error = json.loads(rest[-2].removeprefix("data: "))["error"]
                    assert rest[-3] == "event: error" and rest[-1] == "data: [DONE]"
                    assert error["code"] == "model_saturated" and error["status"] == 503
                else:
                    holder.close()  # the slot frees: the waiting stream is served on the same response
                    rest = [line for line in lines if line and not line.startswith(":")]
                    assert rest[-1] == "data: [DONE]" and any('"content"' in line for line in rest)
        eventually(lambda: redis_counts(redis_server.url, model) == (0, 0), "no slot or place left behind")


def test_a_stream_that_waited_with_its_response_open_gets_the_priority_of_the_slot_it_got(redis_server, upstream):
    # The stream's response began while it waited; its body upstream is built when its slot comes,
    # from the share the fair queue answered then. Alone on one slot, each tenant holds twice its
    # share (never more than half of the capacity): band 2. Built before the slot, the gateway
    # would know no share and send the tier's last band, 3.
    model = model_name()
    first, second = key_for(redis_server.url, "first"), key_for(redis_server.url, "second")
    with queued_gateway(upstream, redis_server.url, model, capacity=1, keepalive_s=0.2, engine_priority=True) as (
        api,
        _,
    ):
        with stream_request(api, first, model, directive(id=f"hold-{model}", pause_after=1)) as holder:
            held = holder.iter_lines()
            next(held)  # the holder has the model's only slot
            with stream_request(api, second, model, "hello") as waiting:
                lines = waiting.iter_lines()
                assert next(lines).startswith(": queued")
                holder.close()
                rest = [line for line in lines if line and not line.startswith(":")]
                assert rest[-1] == "data: [DONE]"
    ours = [body for body in upstream.bodies if body.get("model") == model]
    assert [body["priority"] for body in ours] == [2, 2]


def test_the_openai_sdk_raises_a_refusal_that_comes_after_keep_alives(redis_server, upstream):
    model, key = model_name(), key_for(redis_server.url, "acme")
    gateway = queued_gateway(upstream, redis_server.url, model, capacity=1, keepalive_s=0.2, queue_timeout_s=1.0)
    with gateway as (api, _):
        with stream_request(api, key, model, directive(id=f"hold-{model}", pause_after=1)) as holder:
            held = holder.iter_lines()
            next(held)
            client = openai.OpenAI(base_url=f"{api}/v1", api_key=key, max_retries=0)
            stream = client.chat.completions.create(
                model=model, stream=True, messages=[{"role": "user", "content": "hello"}]
            )
            with pytest.raises(openai.APIError) as refused:
                list(stream)
            assert refused.value.body["code"] == "model_saturated"


def test_the_engine_priority_puts_a_tenant_under_its_weighted_share_ahead_of_one_over_it(redis_server, fresh):
    # Eight slots, held one request at a time so the fair queue's answer is known at each step;
    # one tier (rank 0), so the priority is the band: 0 under the tenant's share, 1 up to twice it.
    model = model_name()
    heavy = key_for(redis_server.url, "heavy", weight=3.0)
    keys = {"heavy": heavy, "b": key_for(redis_server.url, "b"), "c": key_for(redis_server.url, "c")}
    sequence = ["c", "b", "b", "heavy", "heavy", "heavy", "heavy", "b"]
    with (
        queued_gateway(fresh, redis_server.url, model, capacity=8, engine_priority=True) as (api, _),
        ThreadPoolExecutor(len(sequence)) as pool,
    ):
        held = []
        for n, tenant in enumerate(sequence, start=1):
            held.append(pool.submit(chat, api, keys[tenant], model, "hold", user=f"{tenant}-{n}"))
            eventually(lambda n=n: fresh.running == n, f"request {n} reaches the upstream")
        fresh.gate.set()
        assert [f.result().status_code for f in held] == [200] * len(sequence)
    # Shares of 8 slots by weight, never more than half: c, then b, hold less than theirs; heavy
    # (weight 3 of 5: 4.8, capped at 4) is under its share with 3 and at it with 4, while b
    # (weight 1 of 5: 1.6 slots) is over its share with 3. Unweighted, heavy's 3rd would be over
    # (3 of 8 / 3 tenants = 2.7) and sent behind.
    assert fresh.priorities == [
        ("c-1", 0),
        ("b-2", 0),
        ("b-3", 0),
        ("heavy-4", 0),
        ("heavy-5", 0),
        ("heavy-6", 0),
        ("heavy-7", 1),
        ("b-8", 1),
    ]
