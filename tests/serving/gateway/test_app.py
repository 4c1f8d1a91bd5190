"""The gateway in isolation: real redis-server, real uvicorn servers, the official openai client.

The upstream here is a small real ASGI app under uvicorn that answers like Ray Serve's OpenAI
ingress (/v1/models, /v1/chat/completions with and without SSE streaming, a final usage
chunk) and records what reaches it, so these tests can see what the gateway forwards, when
chunks leave the upstream, and whether a stream was cancelled. The end-to-end path through
real Ray Serve + CPU vLLM is covered by tests/e2e/test_devstack.py; this module isolates the
gateway so a failure here points at the gateway alone.

No test asserts a wall-clock duration: ordering is shown with events and timestamps from one
monotonic clock, and waits have generous deadlines that only bound a hang.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import openai
import pytest
import redis

from infra.render.gateway import gateway_objects
from infra.stack_file import PROJECT_ROOT
from ops.devstack.local_redis import start_redis
from ops.harness.processes import free_port
from serving.gateway.admission import presented_key, requested_model
from serving.gateway.app import create_app
from serving.gateway.key_format import KEY_PREFIX, hash_key
from serving.gateway.keys import MemoryKeyStore, RedisKeyStore, create_key_sync
from serving.gateway.proxy import FORWARDED_UP, forwardable
from serving.gateway.settings import SettingsError, load_settings
from tests.support.openai_fakes import USAGE, WORDS, FakeUpstream, client, serving_gateway, settings_for
from tests.support.servers import HANG_BOUND_S, serving

REPO_ROOT = PROJECT_ROOT


# --- a stand-in for Ray Serve's OpenAI ingress ------------------------------------------------






# --- servers -----------------------------------------------------------------------------










@pytest.fixture(scope="module")
def upstream():
    fake = FakeUpstream()
    with serving(fake.app()) as url:
        fake.url = url
        yield fake


@pytest.fixture(scope="module")
def gateway(redis_server, upstream) -> Iterator[str]:
    settings = settings_for(upstream.url, redis_server.url)
    with serving(create_app(settings, RedisKeyStore(redis_server.url))) as url:
        yield url


@pytest.fixture(scope="module")
def api_key(redis_server) -> str:
    return create_key_sync(redis_server.url, "acme", "tests")




def chat(llm: openai.OpenAI, model: str = "tiny", **kwargs):
    return llm.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is a KV cache?"}],
                                       **kwargs)


def key_id_of(key: str) -> str:
    return key.removeprefix(KEY_PREFIX).split("_", 1)[0]


# --- keys ------------------------------------------------------------------------------------


def test_key_format_and_storage_is_hash_only(redis_server, api_key):
    assert re.fullmatch(r"sk-llm-[A-Za-z0-9]{10}_[A-Za-z0-9_-]{43}", api_key)
    stored = redis.Redis.from_url(redis_server.url, decode_responses=True)
    names = list(stored.scan_iter("*"))
    assert f"llmstack:{{key:{hash_key(api_key)}}}" in names
    secret = api_key.split("_", 1)[1]
    for name in names:
        assert secret not in name and secret not in (stored.get(name) or "")
    stored.close()


@pytest.mark.parametrize("store_kind", ["redis", "memory"])
def test_store_verify_revoke_expire_list(redis_server, store_kind):
    async def scenario():
        store = RedisKeyStore(redis_server.url) if store_kind == "redis" else MemoryKeyStore()
        try:
            key, record = await store.create("acme", "lifecycle")
            assert (await store.verify(key)) == record
            assert await store.verify(key[:-1] + ("A" if key[-1] != "A" else "B")) is None
            assert await store.verify("not-a-key") is None
            past = datetime.now(timezone.utc) - timedelta(minutes=1)
            expired, _ = await store.create("acme", "old", expires_at=past)
            assert await store.verify(expired) is None
            assert await store.revoke(record.key_id) and not await store.revoke("nosuchkey0")
            assert await store.verify(key) is None
            listed = {r.key_id: r for r in await store.list()}
            assert listed[record.key_id].revoked
        finally:
            await store.aclose()

    asyncio.run(scenario())


def test_create_key_sync_refuses_the_in_memory_store():
    with pytest.raises(ValueError, match="LLMSTACK_REDIS_URL"):
        create_key_sync(None, "acme", "x")


# --- authentication and admission ---------------------------------------------------------------


def test_chat_and_models_pass_through(gateway, api_key):
    llm = client(gateway, api_key)
    assert chat(llm).choices[0].message.content == "".join(WORDS)
    assert {m.id for m in llm.models.list()} == {"tiny", "other"}


def test_wrong_key_is_401_in_openai_shape(gateway, api_key):
    with pytest.raises(openai.AuthenticationError) as caught:
        chat(client(gateway, api_key[:-4] + "abcd"))
    assert caught.value.code == "invalid_api_key" and caught.value.type == "invalid_request_error"


def test_missing_key_is_401(gateway):
    response = httpx.post(f"{gateway}/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert response.status_code == 401
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert "API key" in error["message"]


def test_other_paths_and_methods_answer_in_openai_shape(gateway, api_key):
    assert httpx.get(f"{gateway}/admin").json()["error"]["code"] == "unknown_url"
    refused = httpx.delete(f"{gateway}/v1/models", headers={"X-API-Key": api_key})
    assert refused.status_code == 405 and refused.json()["error"]["type"] == "invalid_request_error"


def test_x_api_key_header_works(gateway, api_key):
    response = httpx.get(f"{gateway}/v1/models", headers={"X-API-Key": api_key})
    assert response.status_code == 200 and response.json()["object"] == "list"


def test_revoked_and_expired_keys_are_401(gateway, redis_server):
    revoked = create_key_sync(redis_server.url, "acme", "to-revoke")
    chat(client(gateway, revoked))  # works before
    store = RedisKeyStore(redis_server.url)

    async def revoke() -> bool:
        try:
            return await store.revoke(key_id_of(revoked))
        finally:
            await store.aclose()

    assert asyncio.run(revoke())
    expired = create_key_sync(redis_server.url, "acme", "expired",
                              expires_at=datetime.now(timezone.utc) - timedelta(seconds=1))
    for key in (revoked, expired):
        with pytest.raises(openai.AuthenticationError):
            chat(client(gateway, key))


def test_allowed_models_are_enforced(gateway, redis_server):
    llm = client(gateway, create_key_sync(redis_server.url, "acme", "tiny-only", allowed_models=["tiny"]))
    assert chat(llm, "tiny").choices
    with pytest.raises(openai.PermissionDeniedError) as caught:
        chat(llm, "other")
    assert caught.value.status_code == 403 and caught.value.code == "model_not_allowed"
    assert llm.models.list().data  # no model named: not model-scoped


def test_body_too_large_is_413(gateway, api_key):
    with pytest.raises(openai.APIStatusError) as caught:
        client(gateway, api_key).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x" * 10_000}])
    assert caught.value.status_code == 413
    chunked = httpx.post(f"{gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {api_key}"},
                         content=iter([b"{" + b" " * 3000, b" " * 3000 + b"}"]))  # no Content-Length
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"


def test_a_restricted_key_must_name_its_model(gateway, redis_server):
    key = create_key_sync(redis_server.url, "acme", "restricted", allowed_models=["tiny"])
    nameless = httpx.post(f"{gateway}/v1/chat/completions", headers={"X-API-Key": key}, json={"messages": []})
    assert nameless.status_code == 403 and nameless.json()["error"]["code"] == "model_not_allowed"
    unreadable = httpx.post(f"{gateway}/v1/chat/completions", headers={"X-API-Key": key}, content=b"not json")
    assert unreadable.status_code == 400 and unreadable.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize(("headers", "expected"), [
    ({"authorization": "Bearer sk-llm-a"}, "sk-llm-a"),
    ({"authorization": "bearer  sk-llm-a "}, "sk-llm-a"),
    ({"x-api-key": "sk-llm-b"}, "sk-llm-b"),
    ({"authorization": "Basic abc", "x-api-key": "sk-llm-b"}, "sk-llm-b"),
    ({"authorization": "Bearer "}, None),
    ({}, None),
])
def test_presented_key(headers, expected):
    assert presented_key(headers) == expected


def test_requested_model_reads_only_string_models():
    assert requested_model({"model": "tiny", "messages": []}) == "tiny"
    assert requested_model({"model": 7}) is None
    assert requested_model(None) is None


def test_header_forwarding_rules():
    kept = forwardable([("Authorization", "Bearer k"), ("X-API-Key", "k"), ("Connection", "keep-alive, accept"),
                        ("Accept", "*/*"), ("Content-Type", "application/json"), ("Host", "gw"),
                        ("X-Vllm-Priority", "-100")], FORWARDED_UP)
    assert kept == [("content-type", "application/json")]  # accept: named by Connection, so hop-by-hop


# --- proxying ----------------------------------------------------------------------------------


def test_client_credentials_are_not_forwarded(gateway, upstream, api_key):
    client(gateway, api_key).models.list()
    httpx.get(f"{gateway}/v1/models", headers={"X-API-Key": api_key})
    for headers in upstream.seen_headers[-2:]:
        assert "authorization" not in headers and "x-api-key" not in headers
        assert api_key not in json.dumps(headers)
        assert headers["accept-encoding"] == "identity"  # relayed bytes stay plain


def test_request_id_is_always_the_gateways_own_and_forwarded(gateway, upstream, api_key):
    auth = {"Authorization": f"Bearer {api_key}"}
    given = httpx.get(f"{gateway}/v1/models", headers={**auth, "x-request-id": "req-42"})
    ours = given.headers["x-request-id"]
    assert ours != "req-42" and ours == upstream.seen_headers[-1]["x-request-id"]  # the caller's stays here
    made = httpx.get(f"{gateway}/v1/models", headers=auth)
    assert made.headers["x-request-id"] not in ("", ours)
    assert made.headers["x-request-id"] == upstream.seen_headers[-1]["x-request-id"]


def test_stream_arrives_incrementally(gateway, upstream, api_key):
    upstream.client_has_first_chunk.clear()
    stream = chat(client(gateway, api_key), stream=True, stream_options={"include_usage": True},
                  extra_headers={"x-test-scenario": "gated"})
    first_arrived_at, text, usage = None, "", None
    for piece in stream:
        if first_arrived_at is None:
            first_arrived_at = time.monotonic()
            upstream.client_has_first_chunk.set()
        text += "".join(c.delta.content or "" for c in piece.choices)
        usage = piece.usage or usage
    assert upstream.gate_released_by_client is True  # the upstream held back until we had chunk 1
    assert first_arrived_at < upstream.last_chunk_sent_at
    assert text == "".join(WORDS) and usage.total_tokens == USAGE["total_tokens"]


def test_client_disconnect_cancels_the_upstream_stream(gateway, upstream, api_key):
    upstream.endless_ended.clear()
    stream = chat(client(gateway, api_key), stream=True, extra_headers={"x-test-scenario": "endless"})
    next(iter(stream))
    stream.close()
    assert upstream.endless_ended.wait(HANG_BOUND_S), "upstream generator was never closed"
    assert not upstream.endless_finished


def test_upstream_down_is_503_with_retry_after(redis_server, api_key):
    dead_upstream = f"http://127.0.0.1:{free_port()}"
    with serving(create_app(settings_for(dead_upstream, redis_server.url), RedisKeyStore(redis_server.url))) as gw:
        with pytest.raises(openai.InternalServerError) as caught:
            chat(client(gw, api_key))
    assert caught.value.status_code == 503 and caught.value.response.headers["retry-after"] == "1"
    assert caught.value.type == "server_error"


# --- probes and logs ---------------------------------------------------------------------------


@pytest.mark.parametrize("fail_mode", ["closed", "local"])
def test_redis_outage_readyz_and_key_cache(upstream, fail_mode):
    own_redis = start_redis()
    try:
        used, unused = (create_key_sync(own_redis.url, "acme", name) for name in ("used", "unused"))
        settings = settings_for(upstream.url, own_redis.url, limiter_fail_mode=fail_mode)
        with serving_gateway(settings, RedisKeyStore(own_redis.url)) as (gw, admin):
            assert httpx.get(f"{admin}/readyz").json() == {"status": "ready"}
            client(gw, used).models.list()  # verified in Redis: remembered for key_cache_ttl_s
            port = own_redis.port
            own_redis.stop()
            ready = httpx.get(f"{admin}/readyz")
            assert httpx.get(f"{gw}/healthz").json() == {"status": "ok"}  # liveness ignores Redis
            with pytest.raises(openai.InternalServerError) as caught:  # never verified: 503, not 401
                client(gw, unused).models.list()
            assert caught.value.code == "key_store_unavailable"
            if fail_mode == "closed":
                assert ready.status_code == 503 and ready.json()["reason"]
                with pytest.raises(openai.InternalServerError) as refused:  # a cached key, but no limits
                    chat(client(gw, used))
                assert refused.value.status_code == 503 and refused.value.code == "limiter_unavailable"
                assert refused.value.response.headers["retry-after"] == "1"
            else:  # degraded, still in the Service: recently verified keys under local limits
                assert ready.status_code == 200 and ready.json()["status"] == "degraded"
                assert chat(client(gw, used)).choices[0].message.content
                assert "llmstack_gateway_degraded 1.0" in httpx.get(f"{admin}/metrics").text
            own_redis = start_redis(port)  # back (empty, like a failed-over replica): recovery needs no restart
            assert httpx.get(f"{admin}/readyz").json() == {"status": "ready"}
            assert "llmstack_gateway_degraded 0.0" in httpx.get(f"{admin}/metrics").text  # Redis answers again
            with pytest.raises(openai.AuthenticationError):  # the new Redis does not know the key: Redis wins
                client(gw, used).models.list()
    finally:
        own_redis.stop()


def test_access_log_has_key_id_never_key_or_prompt(gateway, api_key, caplog, monkeypatch):
    # Other tests in this session import vLLM, whose logging dictConfig disables loggers that
    # already exist; the gateway process never imports it, so undo that here.
    access = logging.getLogger("llmstack.gateway.access")
    monkeypatch.setattr(access, "disabled", False)
    monkeypatch.setattr(access, "propagate", True)
    caplog.set_level(logging.INFO, logger="llmstack.gateway.access")
    client(gateway, api_key).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "secret prompt text"}])
    # The access line is written after the last body byte is sent, so the client can finish
    # first: wait for it (bounded), rather than racing the server thread.
    mine: list[dict] = []
    for _ in range(100):
        lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "llmstack.gateway.access"]
        mine = [line for line in lines if line["key_id"] == key_id_of(api_key)]
        if mine:
            break
        time.sleep(0.05)
    assert mine and mine[-1]["tenant"] == "acme" and mine[-1]["status"] == 200
    assert mine[-1]["path"] == "/v1/chat/completions" and mine[-1]["latency_ms"] >= 0
    assert api_key not in caplog.text and "secret prompt text" not in caplog.text
    caplog.clear()
    huge = "m" * 3000  # a model name is body data: the log keeps 200 characters of it
    httpx.post(f"{gateway}/v1/chat/completions", json={"model": huge, "messages": []},
               headers={"Authorization": f"Bearer {api_key}"})
    for _ in range(100):
        logged = [json.loads(r.getMessage())["model"] for r in caplog.records if r.name == "llmstack.gateway.access"]
        if logged:
            break
        time.sleep(0.05)
    assert logged == ["m" * 200]


# --- settings and packaging --------------------------------------------------------------------


def test_the_rendered_deployment_env_loads(example_stack):
    """The contract with infra/render/gateway.py: the env it renders is what the gateway accepts."""
    deployment = next(o for o in gateway_objects(example_stack) if o["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert not any("value" in e for e in container["env"] if e["name"] == "LLMSTACK_REDIS_URL")  # a Secret
    settings = load_settings({**env, "LLMSTACK_REDIS_URL": "redis://redis:6379/0"})
    assert settings.metrics_port == example_stack.gateway.metrics_port == container["ports"][0]["containerPort"]
    assert settings.models == [m.model_name for m in example_stack.models]
    assert settings.default_limits.model_dump() == example_stack.gateway.default_limits.model_dump()


@pytest.mark.parametrize(("env", "named"), [
    ({}, "LLMSTACK_UPSTREAM_URL"),
    ({"LLMSTACK_UPSTREAM_URL": "serve:8000"}, "LLMSTACK_UPSTREAM_URL"),
    ({"LLMSTACK_UPSTREAM_URL": "http://s", "LLMSTACK_GATEWAY_SETTINGS": "{port: 1"}, "LLMSTACK_GATEWAY_SETTINGS"),
    ({"LLMSTACK_UPSTREAM_URL": "http://s", "LLMSTACK_GATEWAY_SETTINGS": '{"prot": 1}'}, "'prot'"),
    ({"LLMSTACK_UPSTREAM_URL": "http://s", "LLMSTACK_GATEWAY_SETTINGS": '{"redis_url": "redis://x"}'},
     "LLMSTACK_REDIS_URL"),
    ({"LLMSTACK_UPSTREAM_URL": "http://s", "LLMSTACK_GATEWAY_PORT": "eighty"}, "LLMSTACK_GATEWAY_PORT"),
    ({"LLMSTACK_UPSTREAM_URL": "http://s", "LLMSTACK_REDIS_URL": "http://not-redis"}, "LLMSTACK_REDIS_URL"),
    ({"LLMSTACK_UPSTREAM_URL": "http://serve:8000/v1"}, "LLMSTACK_UPSTREAM_URL"),
])
def test_bad_settings_name_the_variable(env, named):
    with pytest.raises(SettingsError, match=re.escape(named)) as caught:
        load_settings(env)
    assert "\n" not in str(caught.value)


def test_gateway_imports_without_ray_vllm_torch_pulumi_or_our_other_packages():
    poison = "import sys\nfor m in ('ray', 'vllm', 'torch', 'pulumi', 'infra', 'ops'): sys.modules[m] = None\n"
    code = poison + "import serving.gateway.app, serving.gateway.__main__\nprint('ok')"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


# --- the command line, as the Deployment runs it ----------------------------------------------------


@contextmanager
def gateway_process(env: dict[str, str], log: Path, *args: str) -> Iterator[subprocess.Popen]:
    full_env = {**os.environ, **env}
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "serving.gateway", *args], cwd=REPO_ROOT, env=full_env,
                                   stdout=out, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(HANG_BOUND_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_healthy(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + HANG_BOUND_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/healthz").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.05)
    raise AssertionError(f"gateway did not become healthy (exit code {process.poll()})")


def test_cli_serves_from_env_and_finishes_streams_on_sigterm(redis_server, upstream, tmp_path):
    port = free_port()
    env = {"LLMSTACK_UPSTREAM_URL": upstream.url, "LLMSTACK_REDIS_URL": redis_server.url,
           "LLMSTACK_GATEWAY_SETTINGS": json.dumps({"port": port, "models": ["tiny"], "max_body_bytes": 100_000}),
           "LLMSTACK_GATEWAY_HOST": "127.0.0.1"}
    made = subprocess.run([sys.executable, "-m", "serving.gateway", "create-key", "--tenant", "cli", "--name", "n"],
                          cwd=REPO_ROOT, env={**os.environ, **env}, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    log_path = tmp_path / "gateway.log"
    with gateway_process(env, log_path) as process:
        gateway = f"http://127.0.0.1:{port}"
        wait_healthy(gateway, process)
        upstream.client_has_first_chunk.clear()
        stream = chat(client(gateway, key), stream=True, extra_headers={"x-test-scenario": "gated"})
        chunks = iter(stream)
        text = "".join(c.delta.content or "" for c in next(chunks).choices)
        process.terminate()  # SIGTERM mid-stream, as Kubernetes does on a rollout
        deadline = time.monotonic() + HANG_BOUND_S
        while "Shutting down" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "Shutting down" in log_path.read_text()
        upstream.client_has_first_chunk.set()  # only now let the upstream finish the answer
        text += "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)
        assert text == "".join(WORDS)  # the in-flight stream finished during graceful shutdown
        # uvicorn shuts down gracefully, then re-raises SIGTERM so the exit status reports it.
        assert process.wait(HANG_BOUND_S) in (0, -15)
    log = log_path.read_text()
    assert "Application shutdown complete" in log
    assert key not in log and '"tenant": "cli"' in log


def test_cli_in_memory_mode_warns_and_writes_a_dev_key(upstream, tmp_path):
    port = free_port()
    env = {"LLMSTACK_UPSTREAM_URL": upstream.url, "LLMSTACK_REDIS_URL": "", "LLMSTACK_GATEWAY_PORT": str(port)}
    refused = subprocess.run([sys.executable, "-m", "serving.gateway", "create-key", "--tenant", "t", "--name", "n"],
                             cwd=REPO_ROOT, env={**os.environ, **env}, capture_output=True, text=True)
    assert refused.returncode == 2 and "LLMSTACK_REDIS_URL" in refused.stderr
    key_file = tmp_path / "dev.key"
    with gateway_process(env, tmp_path / "gateway.log", "--dev-key-file", str(key_file)) as process:
        wait_healthy(f"http://127.0.0.1:{port}", process)
        assert chat(client(f"http://127.0.0.1:{port}", key_file.read_text().strip())).choices
    assert "KEYS ARE IN MEMORY" in (tmp_path / "gateway.log").read_text()
    assert key_file.stat().st_mode & 0o077 == 0


def test_client_leaving_while_sending_its_body_is_logged_as_499(gateway, api_key, caplog):
    import socket

    logging.getLogger("llmstack.gateway.access").disabled = False
    caplog.set_level(logging.INFO, logger="llmstack.gateway.access")
    host, port = gateway.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:  # promises 1000 bytes, sends 10, leaves
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {api_key}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\":".encode())
        time.sleep(0.2)
    deadline = time.monotonic() + HANG_BOUND_S
    while time.monotonic() < deadline and not any('"status": 499' in r.getMessage() for r in caplog.records):
        time.sleep(0.05)
    assert any('"status": 499' in r.getMessage() for r in caplog.records)
    assert not any("Exception in ASGI" in r.getMessage() for r in caplog.records)
