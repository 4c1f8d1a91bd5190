"""A gateway killed mid-batch loses no line and duplicates none: `python -m serving.gateway`
processes (real uvicorn, real redis-server, the stub upstream in its own process) SIGKILLed at
random points, three times over a few-hundred-line batch, each time replaced by a fresh one.
Deadlines only bound hangs; nothing here asserts a time."""

from __future__ import annotations

import json
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import openai
import pytest
import redis

from ops.harness.processes import background, free_port, wait_for_http
from ops.harness.stub_gateway import gateway_env
from serving.gateway.auth.keys import create_key_sync
from tests.support.gateway import GENEROUS
from tests.support.gateway_process import gateway_process

HANG_BOUND_S = 120
LINES = 400
KILLS = 3
pytestmark = pytest.mark.slow


@contextmanager
def stub_upstream(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    with background(
        [sys.executable, "-m", "ops.harness.stub_upstream", "--port", str(port)], tmp_path / "upstream.log"
    ) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(f"{url}/v1/models", proc, HANG_BOUND_S)
        yield url


def start_gateway(stack: ExitStack, tmp_path: Path, upstream: str, redis_url: str, n: int):
    port = free_port()
    settings = {
        "models": ["tiny"],
        "batch_storage_url": f"file://{tmp_path / 'files'}",
        "batch": {"workers": 4, "lease_s": 1, "sweep_interval_s": 0.1},
    }
    env = gateway_env(upstream=upstream, redis_url=redis_url, port=port, settings=settings)
    proc = stack.enter_context(gateway_process(env, tmp_path / f"gateway-{n}.log"))
    url = f"http://127.0.0.1:{port}"
    wait_for_http(f"{url}/healthz", proc, HANG_BOUND_S)
    return proc, url


def test_sigkilled_gateways_leave_every_custom_id_exactly_once(tmp_path, redis_server) -> None:
    key = create_key_sync(redis_server.url, "crashy-co", "batch", limits=GENEROUS)
    lines = [
        {
            "custom_id": f"k-{n}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny",
                "messages": [{"role": "user", "content": '#stub {"chunks": 4, "interval_ms": 10} hello'}],
            },
        }
        for n in range(LINES)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    chaos = random.Random()
    with stub_upstream(tmp_path) as upstream, ExitStack() as stack:
        proc, url = start_gateway(stack, tmp_path, upstream, redis_server.url, 0)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)
        uploaded = client.files.create(file=("in.jsonl", content), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        at_kill: list[str] = []
        for n in range(1, KILLS + 1):
            time.sleep(chaos.uniform(0.1, 1.0))
            proc.send_signal(signal.SIGKILL)
            proc.wait(HANG_BOUND_S)
            at_kill.append(
                json.loads(redis.Redis.from_url(redis_server.url).hget(f"llmstack:{{batch:{batch.id}}}", "status"))
            )
            proc, url = start_gateway(stack, tmp_path, upstream, redis_server.url, n)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)
        deadline = time.monotonic() + HANG_BOUND_S
        while (done := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired"):
            assert time.monotonic() < deadline, done
            time.sleep(0.1)
        output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        errors = (
            [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
            if done.error_file_id
            else []
        )
    assert at_kill == ["in_progress"] * KILLS  # every kill landed mid-batch
    assert done.status == "completed", done
    assert errors == []
    seen = Counter(line["custom_id"] for line in output)
    assert set(seen) == {line["custom_id"] for line in lines} and set(seen.values()) == {1}
    assert all(line["response"]["status_code"] == 200 for line in output)
    assert done.request_counts is not None and (done.request_counts.completed, done.request_counts.total) == (
        LINES,
        LINES,
    )
