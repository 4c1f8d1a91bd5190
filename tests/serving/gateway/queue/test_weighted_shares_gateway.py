"""Key weights share a saturated model, through the real gateway: a `python -m serving.gateway`
process over real HTTP, one redis-server, and a streaming upstream (tests.support.loaded_upstream).

Four tenants of the standard tier whose keys weigh 1, 1, 2 and 4 each keep more streams going than
the model's whole capacity, every stream followed at once by the next (a closed loop, as clients
do): the fair queue decides who runs. Counted over a stretch of completions after a warm-up, each
tenant's part of them must follow its weight: the weight-4 tenant about half (its ideal 4/8),
the weight-2 one about a quarter, each weight-1 one about an eighth.

What broke it: on a saturated model every slot that frees leaves capacity - 1 in
flight, inside the reserve, so the reserve's rule decided every hand-over, and its share was the
capacity split EQUALLY among the tenants holding slots: every tenant ended up with the same
slots, whatever its key's weight. Capacity 10 keeps one slot of reserve (the default 0.1).
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ops.harness.processes import free_port, wait_for_http
from ops.harness.stub_gateway import gateway_env
from tests.support.gateway import generous_key
from tests.support.gateway_process import gateway_process
from tests.support.loaded_upstream import LoadedUpstream
from tests.support.servers import HANG_BOUND_S, serving
from tests.support.stream_load import StreamingClients
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow  # starts a gateway process and saturates it for a few hundred requests

CAPACITY = 10  # max_ongoing_requests, one replica: the default reserve_share leaves 1 slot of reserve
STREAMS = 12  # each tenant's streams at once: more than the whole capacity, so every tenant stays backlogged
WEIGHTS = {"w1a": 1.0, "w1b": 1.0, "w2": 2.0, "w4": 4.0}
WARM_UP = 40  # completions before counting: the first CAPACITY slots go first come, first served
COUNTED = 240  # completions counted


@contextmanager
def queue_gateway(upstream: str, redis_url: str, model: str, log: Path) -> Iterator[str]:
    port = free_port()
    settings = {
        "models": [model],
        "model_context_lengths": {model: 4096},
        "queue": {"tiers": [{"name": "standard", "max_queue_length": 64, "queue_timeout_s": 120}], "keepalive_s": 60},
        "model_queues": {model: {"max_ongoing_requests": CAPACITY}},
    }
    env = gateway_env(upstream=upstream, redis_url=redis_url, port=port, settings=settings)
    with gateway_process(env, log) as process:
        wait_for_http(f"http://127.0.0.1:{port}/healthz", process, timeout_s=60)
        yield f"http://127.0.0.1:{port}"


def test_key_weights_give_weighted_shares_of_a_saturated_model(redis_server, tmp_path):
    model = f"m-{uuid.uuid4().hex[:8]}"
    keys = {
        tenant: generous_key(redis_server.url, tenant, "weights", weight=weight) for tenant, weight in WEIGHTS.items()
    }
    # Long enough a request (about 100 ms at capacity) that the gateway, not the clients, is the queue.
    engine = LoadedUpstream(ms_per_stream=10.0, itl_ms=5.0, tokens=4)
    with (
        serving(engine.app()) as upstream,
        queue_gateway(upstream, redis_server.url, model, tmp_path / "gw.log") as api,
        StreamingClients([(tenant, api, key) for tenant, key in keys.items() for _ in range(STREAMS)], model) as load,
    ):

        def completed() -> list[str]:  # the tenant of each completed request, in the order they ended
            return [answer.client for answer in load.answers() if answer.status == 200]

        enough = WARM_UP + COUNTED
        eventually(lambda: len(completed()) >= enough, "the tenants' requests complete", bound_s=HANG_BOUND_S * 4)
        counted = Counter(completed()[WARM_UP : WARM_UP + COUNTED])
    # Before the fix (the reserve's share split equally): w1a 0.2, w1b 0.2, w2 0.3, w4 0.3.
    share = {tenant: counted[tenant] / COUNTED for tenant in WEIGHTS}
    total = sum(WEIGHTS.values())
    statuses = Counter(answer.status for answer in load.answers())
    seen = (share, dict(statuses))  # statuses: under a starved machine, Redis timeouts answer 503
    assert 0.4 <= share["w4"] <= 0.6, seen  # its ideal: 4/8
    for tenant, weight in WEIGHTS.items():
        ideal = weight / total  # w2: 0.25, w1a and w1b: 0.125
        assert 0.75 * ideal <= share[tenant] <= 1.25 * ideal, (tenant, seen)
    assert engine.peak <= CAPACITY
