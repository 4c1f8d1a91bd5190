"""The adaptive capacity in a real redis-server, with two stores as two gateway processes: their
samples merge, one of them runs the law per window, both read the same capacity, and the keys
stay bounded and expiring (safe under noeviction)."""

from __future__ import annotations

import asyncio
import itertools

import redis

from serving.gateway.capacity.histogram import bucket_of
from serving.gateway.capacity.law import Move
from serving.gateway.capacity.recorder import LatencyRecorder, WindowReport
from serving.gateway.capacity.store import RING, AdaptiveCapacity, CapacityStore, capacity_key
from serving.gateway.config.capacity_policy import ModelCapacity
from tests.support.waiting import eventually_async

WINDOW_S = 0.2
TARGETS = ModelCapacity(ttft_ms=400, itl_ms=50, max_slots=64, min_slots=2)
_models = itertools.count()


def fresh_model() -> str:
    return f"cap{next(_models)}"


def slow(ttfts: int, peak: int) -> WindowReport:
    """Samples of an engine twice over its TTFT target (ITLs well within theirs)."""
    return WindowReport({bucket_of(2000): ttfts}, {bucket_of(5): 10 * ttfts}, peak)


NOTHING = WindowReport({}, {}, 0)


def two_gateways(url: str, model: str, **options) -> tuple[CapacityStore, CapacityStore]:
    return (
        CapacityStore(url, {model: TARGETS}, window_s=WINDOW_S, **options),
        CapacityStore(url, {model: TARGETS}, window_s=WINDOW_S, **options),
    )


async def decided(store: CapacityStore, model: str, move: Move) -> bool:
    state = await store.state(model)
    return state is not None and state.move is move


def holding(peak: int) -> WindowReport:
    """No new samples, `peak` requests still in flight: a gateway whose streams have not ended."""
    return WindowReport({}, {}, peak)


async def ticking(stores, model: str, until, what: str, replicas: int = 1, reports=None):
    """Every store ticks with no new samples (or its entry of `reports`) until `until()` holds
    (the windows keep closing)."""

    async def check():
        for store, report in zip(stores, reports or [NOTHING] * len(stores), strict=True):
            await store.tick(model, report, replicas=replicas)
        return await until()

    return await eventually_async(check, what, poll_s=WINDOW_S / 4)


def test_two_gateways_merge_their_samples_and_read_the_same_capacity(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        a, b = two_gateways(redis_server.url, model)
        try:
            # Five slow TTFTs are too few for a percentile (min_samples 8): alone, A's move nothing.
            await a.tick(model, slow(5, peak=20), replicas=1)
            await ticking([a, b], model, lambda: decided(a, model, Move.UNMEASURED), "a decision without B's samples")
            assert await a.slots(model) == TARGETS.max_slots
            # B's five more make ten in Redis: the law cuts, from the 40 in flight (20 + 20) by half.
            # A's 20 are still in flight when B reports (A says so each tick): the window holding B's
            # samples holds both peaks, whichever window A's samples fell in.
            await b.tick(model, slow(5, peak=20), replicas=1)
            await ticking(
                [a, b], model, lambda: decided(b, model, Move.DOWN), "the cut", reports=[holding(20), holding(20)]
            )
            assert await a.slots(model) == await b.slots(model) == 20
            assert await a.tick(model, NOTHING, replicas=1) == await b.tick(model, NOTHING, replicas=1) == 20
            assert a.last_slots(model) == b.last_slots(model) == 20
        finally:
            await a.aclose()
            await b.aclose()

    asyncio.run(scenario())


def test_the_in_flight_peak_is_read_per_replica_of_the_model(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        a, b = two_gateways(redis_server.url, model)
        try:
            await a.tick(model, slow(5, peak=30), replicas=2)
            await b.tick(model, slow(5, peak=30), replicas=2)
            await ticking([a, b], model, lambda: decided(a, model, Move.DOWN), "the cut", replicas=2)
            assert await a.slots(model) == 15  # 60 in flight over 2 replicas, halved
        finally:
            await a.aclose()
            await b.aclose()

    asyncio.run(scenario())


def test_a_gateway_reporting_twice_in_a_window_counts_its_peak_once(redis_server):
    """A process reports twice per window (its loop ticks every half window): the window's peak is
    each process's largest report, summed over processes, not the sum of every report."""

    async def scenario() -> None:
        model = fresh_model()
        a, b = two_gateways(redis_server.url, model)
        try:
            await a.tick(model, slow(5, peak=20), replicas=1)
            await a.tick(model, slow(5, peak=20), replicas=1)  # the same 20 streams, half a window later
            await ticking([a, b], model, lambda: decided(a, model, Move.DOWN), "the cut")
            assert await a.slots(model) == 10  # 20 in flight, halved (not 40 halved)
        finally:
            await a.aclose()
            await b.aclose()

    asyncio.run(scenario())


def test_one_gateway_runs_the_law_per_window_and_only_the_lease_holder_stores(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        a, b = two_gateways(redis_server.url, model, lease_s=60)  # a claimant that stalls keeps it
        try:
            # Ticks in the same window: the first claims the closed window, the other is told no.
            replies = await asyncio.gather(
                a._call(model, "tick", 0, a.owner, 60_000, 8), b._call(model, "tick", 0, b.owner, 60_000, 8)
            )
            assert sorted(int(r[0]) for r in replies) == [0, 1]
            winner, loser = (a, b) if int(replies[0][0]) == 1 else (b, a)
            closed = int(next(r for r in replies if int(r[0]) == 1)[5])
            # The other cannot store a capacity for that window; the holder can, once.
            assert int((await loser._call(model, "decide", loser.owner, closed, 3, closed, "down"))[0]) == 0
            assert int((await winner._call(model, "decide", winner.owner, closed, 40, closed, "down"))[0]) == 1
            assert int((await winner._call(model, "decide", winner.owner, closed, 3, closed, "down"))[0]) == 0
            assert await a.slots(model) == await b.slots(model) == 40
        finally:
            await a.aclose()
            await b.aclose()

    asyncio.run(scenario())


def test_a_claimant_that_dies_holds_the_decision_back_only_for_its_lease(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        dead = CapacityStore(redis_server.url, {model: TARGETS}, window_s=WINDOW_S, lease_s=0.3)
        alive = CapacityStore(redis_server.url, {model: TARGETS}, window_s=WINDOW_S, lease_s=0.3)
        try:
            await alive.tick(model, slow(10, peak=16), replicas=1)
            await asyncio.sleep(WINDOW_S)  # the window closes
            claimed = await dead._call(model, "tick", 0, dead.owner, 300, 8)  # claims, then never decides
            assert int(claimed[0]) == 1
            await ticking([alive], model, lambda: decided(alive, model, Move.DOWN), "the survivor's cut")
            assert await alive.slots(model) == 8
        finally:
            await dead.aclose()
            await alive.aclose()

    asyncio.run(scenario())


def test_the_keys_are_bounded_and_all_expire(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        a, b = two_gateways(redis_server.url, model)
        try:
            for _ in range(3 * RING):  # more windows than the ring holds
                await a.tick(model, slow(2, peak=4), replicas=1)
                await b.tick(model, slow(2, peak=4), replicas=1)
                await asyncio.sleep(WINDOW_S / 2)
        finally:
            await a.aclose()
            await b.aclose()
        client = redis.Redis.from_url(redis_server.url)
        keys = list(client.scan_iter(match=capacity_key(model) + "*"))
        assert 1 < len(keys) <= 2 + RING  # the state, the lease, the ring: never one key per window
        # None lives forever under noeviction: each has a TTL, or has expired since the scan
        # (the lease lives one window: -2, gone), never -1 (no expiry).
        assert all(client.pttl(key) != -1 for key in keys)
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"

    asyncio.run(scenario())


def test_the_recorder_times_first_tokens_and_gaps_of_served_models_only():
    recorder = LatencyRecorder(["llama"])
    first, second = recorder.start("llama", 10.0), recorder.start("llama", 10.1)
    unknown = recorder.start("not-served", 10.0)
    first.chunk(10.5)  # TTFT 500 ms
    first.chunk(10.55)  # ITL 50 ms
    second.chunk(10.3)  # TTFT 200 ms
    unknown.chunk(11.0)
    assert recorder.in_flight("llama") == 2
    first.end()
    first.end()  # twice counts once
    report = recorder.take("llama")
    assert report.ttft == {bucket_of(500): 1, bucket_of(200): 1}
    assert report.itl == {bucket_of(50): 1}
    assert report.peak_in_flight == 2
    second.end()
    assert recorder.take("llama") == WindowReport({}, {}, 1)  # the peak restarts from what was in flight
    assert recorder.take("llama").empty


def test_two_gateway_processes_timing_slow_streams_agree_on_a_lower_capacity(redis_server):
    """What the relay and the fair queue will call: stream timers in, capacity per replica out."""

    async def scenario() -> None:
        model = fresh_model()
        gateways = [
            AdaptiveCapacity(redis_server.url, {model: TARGETS}, replicas=lambda _: 1, window_s=WINDOW_S)
            for _ in range(2)
        ]
        for gateway in gateways:
            await gateway.start()
        try:
            assert gateways[0].per_replica("not-served") is None
            clock = 0.0
            for gateway in gateways:  # 12 streams each, 2 s to first token (target 400 ms), 20 ms gaps
                timers = [gateway.timer(model, clock) for _ in range(12)]
                for timer in timers:
                    timer.chunk(clock + 2.0)
                    timer.chunk(clock + 2.02)
                    timer.end()

            async def agreed() -> bool:
                slots = {gateway.per_replica(model) for gateway in gateways}
                return len(slots) == 1 and None not in slots and slots.pop() < TARGETS.max_slots

            await eventually_async(agreed, "both gateways reading the cut capacity", poll_s=WINDOW_S / 4)
            assert gateways[0].per_replica(model) == 12  # 24 in flight at the peak, halved
        finally:
            for gateway in gateways:
                await gateway.aclose()

    asyncio.run(scenario())
