"""Streams outlive their replica on the real stack: the session's `make dev` (Ray Serve, CPU vLLM,
Redis, the gateway with `gateway.stream_resume` on: tests/support/devstack.py), tiny-chat scaled
live to two replicas, greedy streams read by the official openai client, and the replica serving
them SIGKILLed (its Ray worker process, found among the stack's processes) while they run.

Every stream must end whole (finish reason, usage, no error), byte-identical to the same request
run without a kill (the tiny model is deterministic under greedy decoding on CPU: the reference
run is taken first), in one stream id with one role chunk; the tenant's usage ledger must hold
each prompt once and every output token once, and the gateway must have resumed at least one
stream (a kill that hit nothing proves nothing). The kill lands in the middle of the answers. A
kill during the prefill is not here: the tiny model's prefill on CPU ends before a watcher can
see the requests on a replica (tried: the kill point never came), so that case (Serve's ingress
sends no header before the first chunk: a 502, sent once more) is tested against the stub in
tests/serving/gateway/upstream/test_stream_resume.py. The replica bounds are put back
afterwards, once Serve has replaced the killed replica.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from ops.benchmarks.stream_resume import ReplicaKiller, StreamResult, compare, run_streams
from serving.gateway.auth.keys import create_key_sync
from serving.gateway.limits.usage_ledger import parse_usage_hash, usage_key
from tests.support.devstack import DevStack

# Opt-in until the kill point stops depending on the machine's timing: in three CI runs on
# 2026-12-04 the kill came after every answer had ended (twice "0 streams in flight at the kill",
# once "the kill point never came") while it passed for its author; the adaptive capacity queues
# some of the 12 streams in the gateway, so which ones run at once changes with the load.
# Run it on a quiet machine: LLMSTACK_E2E_LIVE_KILL=1 pytest tests/e2e/test_stream_resume_live.py
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("LLMSTACK_E2E_LIVE_KILL") != "1",
        reason="the live replica kill is opt-in (LLMSTACK_E2E_LIVE_KILL=1): its kill point depends on timing",
    ),
]
MODEL = "tiny-chat"
DEPLOYMENT = f"LLMServer:{MODEL}"
STREAMS = 12  # what two CPU replicas on this 2-core machine serve at once without starving
LIMITS = {"requests_per_minute": 10_000, "tokens_per_minute": 10_000_000, "max_concurrent_requests": 100}


def running_replicas(dev: DevStack, stack_file: Path) -> int:
    result = dev.llmctl("status", "--stack", str(stack_file), "--json")  # exits 1 while a replica is down
    report = json.loads(result.stdout)
    tiny = next(d for d in report["deployments"] if d["deployment"] == DEPLOYMENT)
    return int(tiny["replicas"].get("RUNNING", 0))


def wait_for_replicas(dev: DevStack, stack_file: Path, count: int, timeout_s: float = 600) -> None:
    """Until Serve runs `count` replicas of tiny-chat (a killed one is replaced in about a minute here)."""
    deadline = time.monotonic() + timeout_s
    while running_replicas(dev, stack_file) != count:
        assert time.monotonic() < deadline, f"{MODEL} did not get back to {count} running replicas"
        time.sleep(5)


@pytest.fixture
def two_replicas(dev_stack, e2e_stack_file, restore_autoscaling):
    restore_autoscaling(MODEL)
    result = dev_stack.llmctl("scale", "--stack", str(e2e_stack_file), "--model", MODEL, "--min", "2", "--max", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    wait_for_replicas(dev_stack, e2e_stack_file, 2)
    yield
    wait_for_replicas(dev_stack, e2e_stack_file, 2)  # the killed one replaced, before the bounds go back


def gateway_count(dev: DevStack, name: str) -> float:
    text = httpx.get(f"{dev.ready['metrics_url']}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and sample.labels.get("model") == MODEL
    )


def ledger_totals(dev: DevStack, tenant: str) -> tuple[int, int, int]:
    """(prompt, completion, requests) the usage ledger holds for `tenant` today."""
    today = datetime.now(UTC).date()
    with redis.Redis.from_url(dev.ready["redis_url"], decode_responses=True) as connection:
        rows = parse_usage_hash(tenant, today, connection.hgetall(usage_key(tenant, today)))
    return (
        sum(r.prompt_tokens for r in rows),
        sum(r.completion_tokens for r in rows),
        sum(r.requests for r in rows),
    )


def fresh_key(dev: DevStack) -> tuple[str, str]:
    tenant = f"resume-{uuid.uuid4().hex[:8]}"
    return tenant, create_key_sync(dev.ready["redis_url"], tenant, "resume-e2e", limits=LIMITS)


def test_greedy_streams_survive_a_killed_replica_byte_identical_and_billed_once(
    dev_stack, e2e_stack_file, two_replicas
):
    kill_after, max_tokens, padding = 5, 440, 0  # the answers' 5th chunk; 440 of max_model_len 512
    counter = "llmstack_gateway_stream_resumes_total"
    base_url = dev_stack.ready["base_url"]
    _, reference_key = fresh_key(dev_stack)
    reference = run_streams(base_url, reference_key, MODEL, STREAMS, max_tokens, padding=padding)
    assert all(r.whole and r.usage is not None and r.usage[1] == max_tokens for r in reference), [
        r.error for r in reference
    ]

    tenant, key = fresh_key(dev_stack)
    killer = ReplicaKiller(dev_stack.process.pid, MODEL)

    def at_kill_point(results: list[StreamResult]) -> bool:
        # Mid-answer and before any answer ends. Not "every stream at its 5th chunk": the
        # gateway's adaptive capacity may hold some streams in its queue until others finish,
        # and then the kill came after every answer had ended (seen in two CI runs).
        started = [r for r in results if r.chunk_times]
        return any(len(r.chunk_times) >= kill_after for r in started) and not any(r.finish_reason for r in results)

    before = gateway_count(dev_stack, counter)
    killed = run_streams(base_url, key, MODEL, STREAMS, max_tokens, padding=padding, when=at_kill_point, then=killer)
    assert killer.killed, "the kill point never came: the streams ended first"
    findings = compare(reference, killed, killer.killed["at"])

    assert findings["cut"] == 0 and findings["errors"] == [], findings
    assert findings["byte_identical"] == STREAMS, findings
    assert findings["one_id_one_role"] == STREAMS, findings
    assert findings["usage_equal_to_reference"] == STREAMS, findings
    assert 1 <= findings["in_flight_at_kill"] <= STREAMS, findings
    assert gateway_count(dev_stack, counter) - before >= 1, "the kill hit no stream"
    # Billed once: each prompt once and every output token once, one request per stream.
    prompt = sum(r.usage[0] for r in reference if r.usage)
    assert ledger_totals(dev_stack, tenant) == (prompt, STREAMS * max_tokens, STREAMS)
