"""`llmctl keys create|list|show|set|revoke|rotate`: API keys in the gateway's Redis, and
`llmctl tenants list|show|set`: limits shared by all keys of a tenant.

Which Redis: `--redis-url`, else `LLMSTACK_REDIS_URL`, else (for the local stack) the Redis
of the `make dev` running in this checkout. For a cloud stack, reach its Redis first (for
example `kubectl port-forward`) and pass that URL; keys are never stored anywhere else. The
password never goes on the command line (every user of the machine can read it with `ps`):
it comes from `LLMSTACK_REDIS_PASSWORD`, or the file `--redis-password-file` names.

The gateway reads a key's record (and its tenant's limits) from Redis on every request, so a
change takes effect on every gateway replica at the next request. Every change is atomic.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Annotated, Any, TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

import typer
from rich.console import Console
from rich.table import Table

from serving.gateway.key_format import KeyRecord
from serving.gateway.keys import RedisKeyStore
from serving.gateway.tenants import TenantStore

app = typer.Typer(help="Create, list, show, change, revoke and rotate API keys.", no_args_is_help=True)
tenants_app = typer.Typer(help="Limits shared by all keys of a tenant: list, show, set.", no_args_is_help=True)
# Piped output (CI logs, README examples) gets a fixed width instead of 80 columns.
out = Console(width=None if sys.stdout.isatty() else 150)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 150)
T = TypeVar("T")

PASSWORD_VAR = "LLMSTACK_REDIS_PASSWORD"
RedisOption = Annotated[str | None, typer.Option(
    "--redis-url", help=f"Redis the gateway uses, without its password (that comes from {PASSWORD_VAR} or "
                        "--redis-password-file).")]
PasswordFileOption = Annotated[Path | None, typer.Option(
    "--redis-password-file", envvar="LLMSTACK_REDIS_PASSWORD_FILE", help="File holding the Redis password.")]
StackOption = Annotated[str, typer.Option("--stack", "-s", help="Stack (local: the running make dev).")]
LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "daily_token_budget", "max_concurrent_requests")


def resolve_redis_url(explicit: str | None, stack: str, environ: dict[str, str], lock_text: str | None) -> str:
    """The Redis to use, or `typer.BadParameter` saying how to give one."""
    if explicit:
        if urlsplit(explicit).password is not None:
            raise typer.BadParameter(
                f"the URL carries a password, which every user of this machine can read with `ps`: give the URL "
                f"without it and the password in {PASSWORD_VAR} or a file (--redis-password-file)",
                param_hint="--redis-url")
        return explicit
    if environ.get("LLMSTACK_REDIS_URL"):
        return environ["LLMSTACK_REDIS_URL"]
    if stack == "local" and lock_text and lock_text.startswith("{"):
        url = json.loads(lock_text).get("redis_url")
        if url:
            return url
    hint = "start `make dev` (it runs a private redis-server)" if stack == "local" else \
        "port-forward the stack's Redis and pass --redis-url redis[s]://:<password>@127.0.0.1:<port>/0"
    raise typer.BadParameter(f"no Redis to manage keys in: {hint}, or set LLMSTACK_REDIS_URL", param_hint="--redis-url")


def with_password(url: str, password: str | None) -> str:
    """`url` with `password` in it (percent-encoded); unchanged when there is none to add."""
    if not password:
        return url
    parts = urlsplit(url)
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))


def redis_password(environ: dict[str, str], password_file: Path | None) -> str | None:
    if password_file is not None:
        try:
            return password_file.read_text().strip() or None
        except OSError as exc:
            raise typer.BadParameter(f"cannot read {password_file}: {exc.strerror}",
                                     param_hint="--redis-password-file") from None
    return environ.get(PASSWORD_VAR) or None


def _run(redis_url: str, action: Callable[[Any], Awaitable[T]], store_type: type = RedisKeyStore) -> T:
    async def go() -> T:
        store = store_type(redis_url)
        try:
            return await action(store)
        finally:
            await store.aclose()

    from redis.exceptions import RedisError

    from serving.gateway.keys import KeyStoreUnavailable

    try:
        return asyncio.run(go())
    except (KeyStoreUnavailable, RedisError, OSError) as exc:
        err.print(f"cannot reach Redis: {type(exc).__name__}: {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


def _store_url(redis_url: str | None, stack: str, password_file: Path | None = None) -> str:
    from ops.dev import STATE_DIR

    lock = STATE_DIR / "dev.lock"
    environ = dict(os.environ)
    url = resolve_redis_url(redis_url, stack, environ, lock.read_text() if lock.is_file() else None)
    return with_password(url, redis_password(environ, password_file))


def _limits(**values: int | None) -> dict[str, int]:
    return {name: value for name, value in values.items() if value is not None}


def _describe(record: KeyRecord) -> dict[str, Any]:
    return record.model_dump(mode="json")


@app.command()
def create(
    tenant: Annotated[str, typer.Option(help="Who owns the key (usage rolls up to it).")],
    name: Annotated[str, typer.Option(help="Label, e.g. ci-bot.")],
    stack: StackOption = "local",
    redis_url: RedisOption = None,
    redis_password_file: PasswordFileOption = None,
    model: Annotated[list[str] | None, typer.Option("--model", help="Allowed model (repeat); default all.")] = None,
    expires_in_days: Annotated[int | None, typer.Option(min=1, help="Expire after this many days.")] = None,
    requests_per_minute: Annotated[int | None, typer.Option(min=1)] = None,
    tokens_per_minute: Annotated[int | None, typer.Option(min=1)] = None,
    daily_token_budget: Annotated[int | None, typer.Option(min=1)] = None,
    max_concurrent_requests: Annotated[int | None, typer.Option(min=1)] = None,
    shadow: Annotated[bool, typer.Option(help="Shadow mode: over-limit requests are logged, not refused.")] = False,
) -> None:
    """Make a key. The key is printed once, on stdout; only its hash is stored."""
    expires = datetime.now(timezone.utc) + timedelta(days=expires_in_days) if expires_in_days else None
    limits = _limits(requests_per_minute=requests_per_minute, tokens_per_minute=tokens_per_minute,
                     daily_token_budget=daily_token_budget, max_concurrent_requests=max_concurrent_requests)
    key, record = _run(_store_url(redis_url, stack, redis_password_file), lambda s: s.create(
        tenant, name, expires_at=expires, allowed_models=model or None, limits=limits, shadow=shadow))
    err.print(f"created key {record.key_id} for tenant {tenant} (shown once; store it now)")
    print(key)


@app.command("list")
def list_keys(stack: StackOption = "local", redis_url: RedisOption = None,
              redis_password_file: PasswordFileOption = None,
              as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Every key: id, tenant, name, state, models, limit overrides. Never the key itself."""
    records = _run(_store_url(redis_url, stack, redis_password_file), lambda s: s.list())
    if as_json:
        print(json.dumps([_describe(r) for r in records], indent=2))
        return
    table = Table("key id", "tenant", "name", "created", "state", "models", "limit overrides", "mode")
    now = datetime.now(timezone.utc)
    for r in records:
        state = "revoked" if r.revoked else "expired" if r.expires_at and r.expires_at <= now else "active"
        overrides = ", ".join(f"{f}={getattr(r, f)}" for f in LIMIT_FIELDS if getattr(r, f) is not None)
        table.add_row(r.key_id, r.tenant, r.name, r.created_at.strftime("%Y-%m-%d %H:%M"), state,
                      ", ".join(r.allowed_models or ["all"]), overrides or "-", "shadow" if r.shadow else "enforced")
    out.print(table)


@app.command()
def show(key_id: str, stack: StackOption = "local", redis_url: RedisOption = None,
         redis_password_file: PasswordFileOption = None) -> None:
    """One key's record, as JSON."""
    record = _run(_store_url(redis_url, stack, redis_password_file), lambda s: s.get(key_id))
    if record is None:
        err.print(f"no key with id {key_id!r} (llmctl keys list shows them)")
        raise typer.Exit(1)
    print(json.dumps(_describe(record), indent=2))


@app.command()
def revoke(key_id: str, stack: StackOption = "local", redis_url: RedisOption = None,
           redis_password_file: PasswordFileOption = None) -> None:
    """Refuse the key from the next request on, on every gateway replica."""
    if not _run(_store_url(redis_url, stack, redis_password_file), lambda s: s.revoke(key_id)):
        err.print(f"no key with id {key_id!r} (llmctl keys list shows them)")
        raise typer.Exit(1)
    err.print(f"revoked {key_id}")


@app.command("set")
def set_key(
    key_id: str,
    stack: StackOption = "local",
    redis_url: RedisOption = None,
    redis_password_file: PasswordFileOption = None,
    requests_per_minute: Annotated[int | None, typer.Option(min=1)] = None,
    tokens_per_minute: Annotated[int | None, typer.Option(min=1)] = None,
    daily_token_budget: Annotated[int | None, typer.Option(min=1)] = None,
    max_concurrent_requests: Annotated[int | None, typer.Option(min=1)] = None,
    shadow: Annotated[bool | None, typer.Option("--shadow/--enforce", help="Log over-limit requests / refuse them.")
                      ] = None,
) -> None:
    """Change a key's limits or mode; every gateway replica applies it from the next request."""
    changes: dict[str, Any] = _limits(requests_per_minute=requests_per_minute, tokens_per_minute=tokens_per_minute,
                                      daily_token_budget=daily_token_budget,
                                      max_concurrent_requests=max_concurrent_requests)
    if shadow is not None:
        changes["shadow"] = shadow
    if not changes:
        err.print("nothing to change: give a limit option (e.g. --requests-per-minute 30) or --shadow/--enforce")
        raise typer.Exit(2)
    record = _run(_store_url(redis_url, stack, redis_password_file), lambda s: s.update(key_id, **changes))
    if record is None:
        err.print(f"no key with id {key_id!r} (llmctl keys list shows them)")
        raise typer.Exit(1)
    err.print(f"updated {key_id}: " + ", ".join(f"{k}={v}" for k, v in changes.items()))


@app.command()
def rotate(key_id: str, stack: StackOption = "local", redis_url: RedisOption = None,
           redis_password_file: PasswordFileOption = None) -> None:
    """A new key with the same tenant, name, models, expiry and limits; the old one is revoked."""
    async def swap(store: RedisKeyStore) -> tuple[str, KeyRecord] | None:
        old = await store.get(key_id)
        if old is None:
            return None
        limits = {f: getattr(old, f) for f in LIMIT_FIELDS if getattr(old, f) is not None}
        made = await store.create(old.tenant, old.name, expires_at=old.expires_at,
                                  allowed_models=old.allowed_models, limits=limits, shadow=old.shadow)
        await store.revoke(key_id)
        return made

    made = _run(_store_url(redis_url, stack, redis_password_file), swap)
    if made is None:
        err.print(f"no key with id {key_id!r} (llmctl keys list shows them)")
        raise typer.Exit(1)
    err.print(f"rotated {key_id} -> {made[1].key_id}; {key_id} is revoked (shown once; store it now)")
    print(made[0])


def _tenant_row(limits: Any) -> str:
    return ", ".join(f"{f}={getattr(limits, f)}" for f in LIMIT_FIELDS if getattr(limits, f) is not None) or "-"


@tenants_app.command("list")
def list_tenants(stack: StackOption = "local", redis_url: RedisOption = None,
                 redis_password_file: PasswordFileOption = None,
                 as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Every tenant with limits of its own (the others get the stack's gateway.default_tenant_limits)."""
    tenants = _run(_store_url(redis_url, stack, redis_password_file), lambda s: s.list(), TenantStore)
    if as_json:
        print(json.dumps({t: limits.model_dump(exclude_none=True) for t, limits in tenants.items()}, indent=2))
        return
    table = Table("tenant", "own limits")
    for tenant, limits in tenants.items():
        table.add_row(tenant, _tenant_row(limits))
    out.print(table)


@tenants_app.command("show")
def show_tenant(tenant: str, stack: StackOption = "local", redis_url: RedisOption = None,
                redis_password_file: PasswordFileOption = None) -> None:
    """A tenant's own limits and the tokens its keys were billed today, as JSON."""
    async def read(store: TenantStore) -> dict[str, Any]:
        limits = await store.get(tenant)
        return {"tenant": tenant, "limits": limits.model_dump(exclude_none=True),
                "tokens_today": await store.used_today(tenant)}

    print(json.dumps(_run(_store_url(redis_url, stack, redis_password_file), read, TenantStore), indent=2))


@tenants_app.command("set")
def set_tenant(
    tenant: str,
    stack: StackOption = "local",
    redis_url: RedisOption = None,
    redis_password_file: PasswordFileOption = None,
    requests_per_minute: Annotated[int | None, typer.Option(min=0, help="0: back to the default.")] = None,
    tokens_per_minute: Annotated[int | None, typer.Option(min=0, help="0: back to the default.")] = None,
    daily_token_budget: Annotated[int | None, typer.Option(min=0, help="0: back to the default.")] = None,
    max_concurrent_requests: Annotated[int | None, typer.Option(min=0, help="0: back to the default.")] = None,
) -> None:
    """Set limits shared by all the tenant's keys, on top of each key's own (0 removes one)."""
    given = {"requests_per_minute": requests_per_minute, "tokens_per_minute": tokens_per_minute,
             "daily_token_budget": daily_token_budget, "max_concurrent_requests": max_concurrent_requests}
    changes = {name: (value or None) for name, value in given.items() if value is not None}
    if not changes:
        err.print("nothing to change: give a limit option (e.g. --requests-per-minute 600)")
        raise typer.Exit(2)
    limits = _run(_store_url(redis_url, stack, redis_password_file), lambda s: s.set(tenant, changes), TenantStore)
    err.print(f"tenant {tenant}: {_tenant_row(limits)}")
