"""End to end: a model scaled to zero serves a burst of first requests through the gateway.

On the session's shared dev stack (tests/e2e/conftest.py), `llmctl scale` takes tiny-chat-ngram
to `min_replicas: 0` (its stack entry: Serve stops the idle replica after 5 s; 4 requests fill a
replica). Once Ray's REST API reports no running replica (as the gateway's replica feed reads it:
its model_replicas gauge), N concurrent first requests, streamed and not, go through the gateway
with the official openai client: the gateway holds them in the fair queue while Serve starts a
replica (more of them than one replica takes at once), and all are served, none 5xx, each answer
with x-queue-wait-ms. The model's bounds are put back afterwards.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.support.devstack import SCALE_TO_ZERO_AUTOSCALING, SCALE_TO_ZERO_MODEL

pytestmark = pytest.mark.slow

MODEL = SCALE_TO_ZERO_MODEL
BURST = 6  # more than the model's max_ongoing_requests: some wait in the gateway's queue
SCALE_DOWN_BOUND_S = 300  # only bounds a hang: Serve's downscale delay is 5 s in the stack
assert BURST > SCALE_TO_ZERO_AUTOSCALING["max_ongoing_requests"]


def gateway_metric(metrics_url: str, name: str) -> float | None:
    for line in httpx.get(f"{metrics_url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def replicas_reported(metrics_url: str) -> float | None:
    """RUNNING replicas at the gateway's last successful poll of Ray's REST API (None: none yet)."""
    return gateway_metric(metrics_url, f'llmstack_gateway_model_replicas{{model="{MODEL}"}}')


def wait_reported(metrics_url: str, replicas: int, deadline: float, what: str) -> None:
    while replicas_reported(metrics_url) != replicas:
        assert time.monotonic() < deadline, what
        time.sleep(1)


def one(client: openai.OpenAI, n: int, stream: bool) -> tuple[int, str | None, str]:
    """(status, x-queue-wait-ms, text) of one first request."""
    messages = [{"role": "user", "content": f"first request {n}"}]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=4, stream=stream)
    wait = raw.headers.get("x-queue-wait-ms")
    if stream:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices)
    else:
        text = raw.parse().choices[0].message.content or ""
    return raw.status_code, wait, text


def test_a_burst_of_first_requests_to_a_model_at_zero_is_served(dev_stack, e2e_stack_file, restore_autoscaling):
    ready = dev_stack.ready
    deadline = time.monotonic() + SCALE_DOWN_BOUND_S
    wait_reported(ready["metrics_url"], 1, deadline, "the gateway never saw the model's one replica")
    restore_autoscaling(MODEL)
    scaled = dev_stack.llmctl("scale", "--stack", str(e2e_stack_file), "--model", MODEL, "--min", "0", "--max", "1")
    assert scaled.returncode == 0, scaled.stdout + scaled.stderr
    # Idle for the downscale delay, Serve stops the replica; 0 is read only after the scale above.
    wait_reported(ready["metrics_url"], 0, deadline, "Serve never reported the model at zero replicas")

    client = openai.OpenAI(base_url=ready["base_url"], api_key=ready["api_key"], max_retries=0, timeout=600)
    started = time.monotonic()
    with ThreadPoolExecutor(BURST) as pool:
        results = list(pool.map(lambda n: one(client, n, stream=n % 2 == 0), range(BURST)))
    elapsed = time.monotonic() - started
    print(
        f"{BURST} first requests to a model at zero served in {elapsed:.0f} s; "
        f"x-queue-wait-ms {[wait for _, wait, _ in results]}"
    )
    assert [status for status, _, _ in results] == [200] * BURST
    assert all(wait is not None and wait.isdigit() for _, wait, _ in results)
    assert all(text for _, _, text in results)
    # the feed follows the replica Serve started
    wait_reported(ready["metrics_url"], 1, deadline + elapsed, "the gateway never saw the new replica")
