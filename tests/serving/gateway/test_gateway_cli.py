"""`python -m serving.gateway` as the Deployment runs it, as its own OS process: settings from the
environment, streams in flight finished on SIGTERM, the in-memory mode's dev key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from infra.spec.stack_file import PROJECT_ROOT
from ops.harness.processes import free_port
from tests.support.gateway_process import gateway_process, wait_answering
from tests.support.openai_fakes import WORDS, chat, client
from tests.support.servers import HANG_BOUND_S

pytestmark = pytest.mark.slow  # starts gateway processes


def test_cli_serves_from_env_and_finishes_streams_on_sigterm(redis_server, fake_upstream, tmp_path):
    port = free_port()
    env = {
        "LLMSTACK_UPSTREAM_URL": fake_upstream.url,
        "LLMSTACK_REDIS_URL": redis_server.url,
        "LLMSTACK_GATEWAY_SETTINGS": json.dumps({"port": port, "models": ["tiny"], "max_body_bytes": 100_000}),
        "LLMSTACK_GATEWAY_HOST": "127.0.0.1",
        "LLMSTACK_GATEWAY_METRICS_PORT": str(free_port()),
    }
    made = subprocess.run(
        [sys.executable, "-m", "serving.gateway", "create-key", "--tenant", "cli", "--name", "n"],
        cwd=PROJECT_ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    log_path = tmp_path / "gateway.log"
    with gateway_process(env, log_path) as process:
        gateway = f"http://127.0.0.1:{port}"
        wait_answering(f"{gateway}/healthz", process)
        fake_upstream.client_has_first_chunk.clear()
        stream = chat(client(gateway, key), stream=True, extra_headers={"x-test-scenario": "gated"})
        chunks = iter(stream)
        text = "".join(c.delta.content or "" for c in next(chunks).choices)
        process.terminate()  # SIGTERM mid-stream, as Kubernetes does on a rollout
        deadline = time.monotonic() + HANG_BOUND_S
        while "Shutting down" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "Shutting down" in log_path.read_text()
        fake_upstream.client_has_first_chunk.set()  # only now let the upstream finish the answer
        text += "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)
        assert text == "".join(WORDS)  # the in-flight stream finished during graceful shutdown
        # uvicorn shuts down gracefully, then re-raises SIGTERM so the exit status reports it.
        assert process.wait(HANG_BOUND_S) in (0, -15)
    log = log_path.read_text()
    assert "Application shutdown complete" in log
    assert key not in log and '"tenant": "cli"' in log


def test_cli_in_memory_mode_warns_and_writes_a_dev_key(fake_upstream, tmp_path):
    port = free_port()
    env = {
        "LLMSTACK_UPSTREAM_URL": fake_upstream.url,
        "LLMSTACK_REDIS_URL": "",
        "LLMSTACK_GATEWAY_PORT": str(port),
        "LLMSTACK_GATEWAY_METRICS_PORT": str(free_port()),
    }  # not the default: tests run side by side
    refused = subprocess.run(
        [sys.executable, "-m", "serving.gateway", "create-key", "--tenant", "t", "--name", "n"],
        cwd=PROJECT_ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "LLMSTACK_REDIS_URL" in refused.stderr
    key_file = tmp_path / "dev.key"
    with gateway_process(env, tmp_path / "gateway.log", "--dev-key-file", str(key_file)) as process:
        wait_answering(f"http://127.0.0.1:{port}/healthz", process)
        assert chat(client(f"http://127.0.0.1:{port}", key_file.read_text().strip())).choices
    assert "KEYS ARE IN MEMORY" in (tmp_path / "gateway.log").read_text()
    assert key_file.stat().st_mode & 0o077 == 0
