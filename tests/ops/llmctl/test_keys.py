"""`llmctl keys` against a real redis-server, checked with the gateway's own key store."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
import redis
import typer

from infra.spec.stack_file import PROJECT_ROOT
from ops.llmctl.keys import resolve_redis_url
from serving.gateway.auth.keys import RedisKeyStore


@pytest.fixture(scope="module")
def redis_url(redis_server):
    return redis_server.url


def llmctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # `python -m` from the checkout: the `llmctl` script of an editable install runs whichever
    # checkout was installed, not necessarily this one.
    return subprocess.run(
        [sys.executable, "-m", "ops.llmctl.main", "keys", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=PROJECT_ROOT,
        env={**os.environ, **(env or {})},
        check=False,
    )


def verify(url: str, key: str):
    async def go():
        store = RedisKeyStore(url)
        try:
            return await store.verify(key)
        finally:
            await store.aclose()

    return asyncio.run(go())


def test_create_list_show_revoke(redis_url):
    made = llmctl(
        "create",
        "--tenant",
        "acme",
        "--name",
        "ci",
        "--model",
        "tiny-chat",
        "--requests-per-minute",
        "30",
        "--redis-url",
        redis_url,
    )
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    record = verify(redis_url, key)
    assert record.tenant == "acme" and record.allowed_models == ["tiny-chat"] and record.requests_per_minute == 30
    listed = json.loads(llmctl("list", "--json", "--redis-url", redis_url).stdout)
    assert record.key_id in [r["key_id"] for r in listed]
    assert key not in llmctl("list", "--redis-url", redis_url).stdout  # ids only, never keys
    shown = json.loads(llmctl("show", record.key_id, "--redis-url", redis_url).stdout)
    assert shown["name"] == "ci"
    assert llmctl("revoke", record.key_id, "--redis-url", redis_url).returncode == 0
    assert verify(redis_url, key) is None


def test_key_is_stored_only_as_a_hash(redis_url):
    key = llmctl("create", "--tenant", "t", "--name", "n", "--redis-url", redis_url).stdout.strip()
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    everything = " ".join(f"{name} {client.get(name)}" for name in client.scan_iter() if client.type(name) == "string")
    assert key not in everything and key.split("_", 1)[1] not in everything


def test_rotate_keeps_settings_and_revokes_old(redis_url):
    old = llmctl(
        "create", "--tenant", "t", "--name", "bot", "--tokens-per-minute", "500", "--redis-url", redis_url
    ).stdout.strip()
    old_id = verify(redis_url, old).key_id
    rotated = llmctl("rotate", old_id, "--redis-url", redis_url)
    assert rotated.returncode == 0, rotated.stderr
    new = rotated.stdout.strip()
    assert verify(redis_url, old) is None
    record = verify(redis_url, new)
    assert record.name == "bot" and record.tokens_per_minute == 500 and record.key_id != old_id


def test_unknown_key_id_exits_1(redis_url):
    for command in ("show", "revoke", "rotate"):
        result = llmctl(command, "nosuchkey1", "--redis-url", redis_url)
        assert result.returncode == 1 and "no key with id" in result.stderr


def test_redis_url_resolution():
    assert resolve_redis_url("redis://x", "prod", {}, None) == "redis://x"
    assert resolve_redis_url(None, "prod", {"LLMSTACK_REDIS_URL": "redis://env"}, None) == "redis://env"
    assert resolve_redis_url(None, "local", {}, "redis://dev") == "redis://dev"
    with pytest.raises(typer.BadParameter, match="port-forward"):
        resolve_redis_url(None, "prod", {}, None)
    with pytest.raises(typer.BadParameter, match="make dev"):
        resolve_redis_url(None, "local", {}, None)


def test_unreachable_redis_is_one_clear_line():
    result = llmctl("list", "--redis-url", "redis://127.0.0.1:1/0")
    assert result.returncode == 1 and "cannot reach Redis" in result.stderr and "Traceback" not in result.stderr


def test_set_changes_limits_and_mode_and_rotate_keeps_shadow(redis_url):
    key = llmctl("create", "--tenant", "acme", "--name", "tuning", "--shadow", "--redis-url", redis_url).stdout.strip()
    record = verify(redis_url, key)
    assert record.shadow
    changed = llmctl("set", record.key_id, "--enforce", "--requests-per-minute", "7", "--redis-url", redis_url)
    assert changed.returncode == 0, changed.stderr
    record = verify(redis_url, key)
    assert not record.shadow and record.requests_per_minute == 7
    nothing = llmctl("set", record.key_id, "--redis-url", redis_url)
    assert nothing.returncode == 2 and "nothing to change" in nothing.stderr
    llmctl("set", record.key_id, "--shadow", "--redis-url", redis_url)
    rotated = llmctl("rotate", record.key_id, "--redis-url", redis_url).stdout.strip()
    new = verify(redis_url, rotated)
    assert new.shadow and new.requests_per_minute == 7 and verify(redis_url, key) is None


def test_monthly_budget_in_dollars_is_stored_and_survives_rotation(redis_url):
    from infra.spec.stack_file import PROJECT_ROOT

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "ops.llmctl.main", "keys", *args, "--redis-url", redis_url],
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    made = run("create", "--tenant", "acme", "--name", "budgeted", "--monthly-budget-usd", "250.50")
    assert made.returncode == 0, made.stderr
    record = verify(redis_url, made.stdout.strip())
    assert str(record.monthly_budget_usd) == "250.50"
    assert run("set", record.key_id, "--monthly-budget-usd", "300").returncode == 0
    assert "monthly_budget_usd=300" in run("list").stdout
    rotated = run("rotate", record.key_id)
    assert str(verify(redis_url, rotated.stdout.strip()).monthly_budget_usd) == "300"
    refused = run("set", record.key_id, "--monthly-budget-usd", "0")
    assert refused.returncode == 2 and "monthly-budget-usd" in refused.stderr


def test_tier_and_weight_are_set_at_creation_changed_kept_on_rotation_and_checked(redis_url):
    from typer.testing import CliRunner

    from ops.llmctl.keys import app

    runner = CliRunner()
    made = runner.invoke(
        app,
        [
            "create",
            "--tenant",
            "acme",
            "--name",
            "batch-bot",
            "--tier",
            "batch",
            "--weight",
            "2",
            "--redis-url",
            redis_url,
        ],
    )
    assert made.exit_code == 0, made.output
    key = made.stdout.strip().splitlines()[-1]
    record = verify(redis_url, key)
    assert (record.tier, record.weight) == ("batch", 2.0)
    changed = runner.invoke(app, ["set", record.key_id, "--tier", "interactive", "--redis-url", redis_url])
    assert changed.exit_code == 0, changed.output
    assert (verify(redis_url, key).tier, verify(redis_url, key).weight) == ("interactive", 2.0)
    rotated = runner.invoke(app, ["rotate", record.key_id, "--redis-url", redis_url])
    new = verify(redis_url, rotated.stdout.strip().splitlines()[-1])
    assert (new.tier, new.weight) == ("interactive", 2.0)
    bad = runner.invoke(app, ["set", new.key_id, "--tier", "Gold Tier", "--redis-url", redis_url])
    assert bad.exit_code == 2 and "--tier" in bad.output
    assert verify(redis_url, rotated.stdout.strip().splitlines()[-1]).tier == "interactive"


@pytest.fixture
def guarded_redis():
    """A private redis-server that requires a password (AUTH), as a cloud stack's does."""
    from ops.devstack.local_redis import start_redis

    server = start_redis()
    try:
        redis.Redis.from_url(server.url).config_set("requirepass", "s3cret/pass")
        yield server
    finally:
        server.stop()


def test_the_password_comes_from_env_or_a_file_never_the_command_line(guarded_redis, tmp_path):
    url = guarded_redis.url  # no password in it
    with_password = url.replace("redis://", "redis://:s3cret%2Fpass@")
    refused = llmctl("list", "--redis-url", with_password)
    assert refused.returncode == 2 and "LLMSTACK_REDIS_PASSWORD" in refused.stderr and "s3cret" not in refused.stderr
    assert llmctl("list", "--redis-url", url).returncode == 1  # no password: Redis says no
    by_env = llmctl(
        "create", "--tenant", "t", "--name", "env", "--redis-url", url, env={"LLMSTACK_REDIS_PASSWORD": "s3cret/pass"}
    )
    assert by_env.returncode == 0, by_env.stderr
    password_file = tmp_path / "redis-password"
    password_file.write_text("s3cret/pass\n")
    listed = llmctl("list", "--json", "--redis-url", url, "--redis-password-file", str(password_file))
    assert listed.returncode == 0, listed.stderr
    assert [r["name"] for r in json.loads(listed.stdout)] == ["env"]
    from_env_file = llmctl(
        "list", "--json", "--redis-url", url, env={"LLMSTACK_REDIS_PASSWORD_FILE": str(password_file)}
    )
    assert from_env_file.returncode == 0, from_env_file.stderr


def tenants(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ops.llmctl.main", "tenants", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=PROJECT_ROOT,
        check=False,
    )


def test_tenants_set_show_list(redis_url):
    changed = tenants(
        "set", "acme corp", "--requests-per-minute", "600", "--daily-token-budget", "5000000", "--redis-url", redis_url
    )
    assert changed.returncode == 0, changed.stderr
    assert "requests_per_minute=600" in changed.stderr
    shown = json.loads(tenants("show", "acme corp", "--redis-url", redis_url).stdout)
    assert shown == {
        "tenant": "acme corp",
        "limits": {"requests_per_minute": 600, "daily_token_budget": 5_000_000},
        "adapters": None,
        "tokens_today": 0,
    }
    assert tenants("set", "acme corp", "--requests-per-minute", "0", "--redis-url", redis_url).returncode == 0
    listed = json.loads(tenants("list", "--json", "--redis-url", redis_url).stdout)
    assert listed["acme corp"] == {"daily_token_budget": 5_000_000}  # 0 cleared the tenant's own rate
    nothing = tenants("set", "acme corp", "--redis-url", redis_url)
    assert nothing.returncode == 2 and "nothing to change" in nothing.stderr


def test_tenants_monthly_budget_is_a_decimal_in_dollars(redis_url):
    changed = tenants("set", "budgeted", "--monthly-budget-usd", "1250.50", "--redis-url", redis_url)
    assert changed.returncode == 0 and "monthly_budget_usd=1250.50" in changed.stderr, changed.stderr
    shown = json.loads(tenants("show", "budgeted", "--redis-url", redis_url).stdout)
    assert shown["limits"] == {"monthly_budget_usd": "1250.50"}  # exact, never a float
    assert tenants("set", "budgeted", "--monthly-budget-usd", "0", "--redis-url", redis_url).returncode == 0
    assert "budgeted" not in json.loads(tenants("list", "--json", "--redis-url", redis_url).stdout)
    refused = tenants("set", "budgeted", "--monthly-budget-usd", "0.001", "--redis-url", redis_url)
    assert (
        refused.returncode == 2
        and "--monthly-budget-usd: Decimal input should have no more than 2 decimal places" in refused.stderr
    )


def test_adapter_grants_on_keys_and_tenants(redis_url):
    made = llmctl(
        "create", "--tenant", "lora co", "--name", "a", "--adapter", "tiny-chat:sql", "--redis-url", redis_url
    )
    assert made.returncode == 0, made.stderr
    record = verify(redis_url, made.stdout.strip())
    assert record.allowed_adapters == ["tiny-chat:sql"]
    assert llmctl("set", record.key_id, "--no-adapters", "--redis-url", redis_url).returncode == 0
    assert verify(redis_url, made.stdout.strip()).allowed_adapters == []
    assert llmctl("set", record.key_id, "--tenant-adapters", "--redis-url", redis_url).returncode == 0
    assert verify(redis_url, made.stdout.strip()).allowed_adapters is None
    rotated = llmctl("set", record.key_id, "--adapter", "tiny-chat:*", "--redis-url", redis_url)
    assert rotated.returncode == 0, rotated.stderr
    new = llmctl("rotate", record.key_id, "--redis-url", redis_url).stdout.strip()
    assert verify(redis_url, new).allowed_adapters == ["tiny-chat:*"]  # rotation keeps them
    bad = llmctl("create", "--tenant", "t", "--name", "b", "--adapter", "sql", "--redis-url", redis_url)
    assert bad.returncode == 2 and "must be <base>:<adapter>" in bad.stderr

    granted = tenants("set", "lora co", "--adapter", "tiny-chat:sql", "--adapter", "*:legal", "--redis-url", redis_url)
    assert granted.returncode == 0, granted.stderr
    shown = json.loads(tenants("show", "lora co", "--redis-url", redis_url).stdout)
    assert shown["adapters"] == ["tiny-chat:sql", "*:legal"] and shown["limits"] == {}
    assert json.loads(tenants("list", "--json", "--redis-url", redis_url).stdout)["lora co"] == {
        "adapters": ["tiny-chat:sql", "*:legal"]
    }
    assert tenants("set", "lora co", "--no-adapters", "--redis-url", redis_url).returncode == 0
    assert json.loads(tenants("show", "lora co", "--redis-url", redis_url).stdout)["adapters"] is None
