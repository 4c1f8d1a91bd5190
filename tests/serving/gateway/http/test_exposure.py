"""What the public port exposes: the OpenAI routes and /healthz, never /metrics (tenant names,
usage) or /readyz (a Redis PING per call); those are on the metrics port. And the dev key
file: owner-only, never written through a symlink. The gateway runs as its pod runs it:
`python -m serving.gateway`.
"""

from __future__ import annotations

import json
import stat

import httpx
import pytest

from ops.harness.processes import free_port
from tests.support.gateway_process import gateway_process, wait_answering
from tests.support.servers import HANG_BOUND_S

pytestmark = pytest.mark.slow  # starts gateway processes


def env_for(upstream: str, redis_url: str, port: int, metrics_port: int) -> dict[str, str]:
    return {
        "LLMSTACK_UPSTREAM_URL": upstream,
        "LLMSTACK_REDIS_URL": redis_url,
        "LLMSTACK_GATEWAY_HOST": "127.0.0.1",
        "LLMSTACK_GATEWAY_PORT": str(port),
        "LLMSTACK_GATEWAY_METRICS_PORT": str(metrics_port),
        "LLMSTACK_GATEWAY_SETTINGS": json.dumps({"models": ["tiny"]}),
    }


def test_metrics_and_readiness_are_only_on_the_metrics_port(recording_upstream, redis_server, key, tmp_path):
    port, metrics_port = free_port(), free_port()
    env = env_for(recording_upstream.url, redis_server.url, port, metrics_port)
    with gateway_process(env, tmp_path / "gw.log") as process:
        public, private = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}"
        wait_answering(f"{public}/healthz", process)
        assert httpx.get(f"{public}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        for path in ("/metrics", "/readyz"):  # the old gateway answered both here, to the internet
            refused = httpx.get(f"{public}{path}")
            assert refused.status_code == 404 and refused.json()["error"]["code"] == "unknown_url"
        metrics = httpx.get(f"{private}/metrics")
        assert metrics.status_code == 200 and 'tenant="acme"' in metrics.text
        assert httpx.get(f"{private}/readyz").json() == {"status": "ready"}
        assert httpx.get(f"{private}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 404


def test_a_metrics_port_in_use_stops_the_start_naming_it(recording_upstream, redis_server, tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = env_for(recording_upstream.url, redis_server.url, free_port(), taken.getsockname()[1])
        with gateway_process(env, tmp_path / "gw.log") as process:
            assert process.wait(HANG_BOUND_S) == 1
    assert "metrics_port" in (tmp_path / "gw.log").read_text()


def dev_env(upstream: str, port: int) -> dict[str, str]:
    return {
        "LLMSTACK_UPSTREAM_URL": upstream,
        "LLMSTACK_REDIS_URL": "",
        "LLMSTACK_GATEWAY_PORT": str(port),
        "LLMSTACK_GATEWAY_METRICS_PORT": str(free_port()),
    }


def test_the_dev_key_file_is_never_written_through_a_symlink(recording_upstream, tmp_path):
    elsewhere = tmp_path / "world-readable.txt"
    elsewhere.write_text("untouched\n")
    elsewhere.chmod(0o644)
    key_file = tmp_path / "dev.key"
    key_file.symlink_to(elsewhere)
    with gateway_process(
        dev_env(recording_upstream.url, free_port()), tmp_path / "gw.log", "--dev-key-file", str(key_file)
    ) as process:
        assert process.wait(HANG_BOUND_S) == 2
    assert elsewhere.read_text() == "untouched\n"  # the old gateway wrote the key through the link
    assert "symlink" in (tmp_path / "gw.log").read_text()


def test_an_existing_dev_key_file_becomes_owner_only(recording_upstream, tmp_path):
    key_file = tmp_path / "dev.key"
    key_file.write_text("an old key\n")
    key_file.chmod(0o644)
    port = free_port()
    with gateway_process(
        dev_env(recording_upstream.url, port), tmp_path / "gw.log", "--dev-key-file", str(key_file)
    ) as process:
        wait_answering(f"http://127.0.0.1:{port}/healthz", process)
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600  # the old gateway kept 0644
        assert key_file.read_text().startswith("sk-llm-")


def test_a_websocket_upgrade_is_answered_as_plain_http(recorded, redis_server, key, tmp_path):
    """The gateway speaks HTTP only. An Upgrade: websocket request, with a valid key or without,
    gets the path's ordinary HTTP answer: no handshake, no server error, nothing upstream."""
    import websockets.sync.client
    from websockets.exceptions import InvalidStatus

    port, metrics_port = free_port(), free_port()
    env = env_for(recorded.url, redis_server.url, port, metrics_port)
    log = tmp_path / "gw.log"
    with gateway_process(env, log) as process:
        wait_answering(f"http://127.0.0.1:{port}/healthz", process)
        for path, headers, plain_http_status in (
            ("/v1/chat/completions", {"Authorization": f"Bearer {key}"}, 405),  # a GET there
            ("/v1/models", {}, 401),
            ("/nowhere", {"Authorization": f"Bearer {key}"}, 404),
            ("/healthz", {}, 200),
        ):
            with pytest.raises(InvalidStatus) as refused:  # any answer but 101 Switching Protocols
                websockets.sync.client.connect(
                    f"ws://127.0.0.1:{port}{path}", additional_headers=headers, open_timeout=HANG_BOUND_S
                )
            assert refused.value.response.status_code == plain_http_status, path
    assert "Traceback" not in log.read_text()
    assert recorded.seen == []
