"""`llmctl keys create|list|show|set|revoke|rotate`: API keys in the gateway's Redis, and
`llmctl tenants list|show|set`: limits shared by all keys of a tenant.

Which Redis: `--redis-url`, else `LLMSTACK_REDIS_URL`, else (for the local stack) the Redis
of the `make dev` running in this checkout. For a cloud stack, reach its Redis first (for
example `kubectl port-forward`) and pass that URL; keys are never stored anywhere else. The
password never goes on the command line (every user of the machine can read it with `ps`):
it comes from `LLMSTACK_REDIS_PASSWORD`, or the file `--redis-password-file` names.

The gateway reads a key's record (and its tenant's limits) from Redis on every request, so a
change takes effect on every gateway replica at the next request. Every change is atomic.

LoRA adapters (`--adapter`, on keys and tenants): `<base>:<adapter>` names or fnmatch patterns on
them (`tiny-chat:*`); a key uses its own list when it has one, else its tenant's; none: no adapter
(serving.gateway.auth.adapter_access).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

import typer
from pydantic import ValidationError
from rich.table import Table

from ops.llmctl.console import ExitCode, err, out
from serving.gateway.auth.adapter_access import checked_patterns
from serving.gateway.auth.key_format import KeyRecord
from serving.gateway.auth.keys import RedisKeyStore
from serving.gateway.config.gateway_policy import TenantLimits
from serving.gateway.limits.tenants import TenantStore

app = typer.Typer(help="Create, list, show, change, revoke and rotate API keys.", no_args_is_help=True)
tenants_app = typer.Typer(help="Limits shared by all keys of a tenant: list, show, set.", no_args_is_help=True)
# Piped output (CI logs, README examples) gets a fixed width instead of 80 columns.
T = TypeVar("T")

PASSWORD_VAR = "LLMSTACK_REDIS_PASSWORD"
RedisOption = Annotated[
    str | None,
    typer.Option(
        "--redis-url",
        help=f"Redis the gateway uses, without its password (that comes from {PASSWORD_VAR} or --redis-password-file).",
    ),
]
PasswordFileOption = Annotated[
    Path | None,
    typer.Option(
        "--redis-password-file", envvar="LLMSTACK_REDIS_PASSWORD_FILE", help="File holding the Redis password."
    ),
]
StackOption = Annotated[str, typer.Option("--stack", "-s", help="Stack (local: the running make dev).")]
LIMIT_FIELDS = (
    "requests_per_minute",
    "tokens_per_minute",
    "daily_token_budget",
    "max_concurrent_requests",
    "monthly_budget_usd",
)
BudgetOption = Annotated[
    Decimal | None,
    typer.Option(
        "--monthly-budget-usd",
        min=0.01,
        help="Dollars per calendar month (UTC) at the models' rate card (llmctl cost).",
    ),
]
TierOption = Annotated[str | None, typer.Option(help="Queue tier (gateway.queue.tiers of the stack), e.g. batch.")]
WeightOption = Annotated[
    float | None, typer.Option(min=0.001, max=1000, help="Share of a saturated model within its tier (default 1).")
]
AdapterOption = Annotated[
    list[str] | None,
    typer.Option(
        "--adapter",
        help="LoRA adapter it may use, <base>:<adapter> or a pattern like tiny-chat:* (repeat). "
        "Replaces the list; none given: unchanged.",
    ),
]


def _grants(adapters: list[str] | None, *, none: bool = False) -> list[str] | None:
    """Adapter grants as typed, checked before any Redis call; [] with `none` (--no-adapters)."""
    if none:
        if adapters:
            raise typer.BadParameter("give --adapter or --no-adapters, not both", param_hint="--adapter")
        return []
    if not adapters:
        return None
    try:
        return checked_patterns(adapters)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--adapter") from None


def _adapters_cell(grants: list[str] | None, inherited: str = "tenant's") -> str:
    if grants is None:
        return inherited
    return ", ".join(grants) or "none"


def resolve_redis_url(explicit: str | None, stack: str, environ: dict[str, str], dev_redis_url: str | None) -> str:
    """The Redis to use, or `typer.BadParameter` saying how to give one. `dev_redis_url`: the
    running `make dev`'s private redis-server, if any."""
    if explicit:
        if urlsplit(explicit).password is not None:
            raise typer.BadParameter(
                f"the URL carries a password, which every user of this machine can read with `ps`: give the URL "
                f"without it and the password in {PASSWORD_VAR} or a file (--redis-password-file)",
                param_hint="--redis-url",
            )
        return explicit
    if environ.get("LLMSTACK_REDIS_URL"):
        return environ["LLMSTACK_REDIS_URL"]
    if stack == "local" and dev_redis_url:
        return dev_redis_url
    hint = (
        "start `make dev` (it runs a private redis-server)"
        if stack == "local"
        else f"port-forward the stack's Redis and pass --redis-url redis[s]://127.0.0.1:<port>/0 with the password in "
        f"{PASSWORD_VAR}"
    )
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
            raise typer.BadParameter(
                f"cannot read {password_file}: {exc.strerror}", param_hint="--redis-password-file"
            ) from None
    return environ.get(PASSWORD_VAR) or None


def _run(redis_url: str, action: Callable[[Any], Awaitable[T]], store_type: type = RedisKeyStore) -> T:
    async def go() -> T:
        store = store_type(redis_url)
        try:
            return await action(store)
        finally:
            await store.aclose()

    from redis.exceptions import RedisError

    from serving.gateway.auth.keys import KeyStoreUnavailable

    try:
        return asyncio.run(go())
    except (KeyStoreUnavailable, RedisError, OSError) as exc:
        err.print(f"cannot reach Redis: {type(exc).__name__}: {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(ExitCode.FAILED) from None


def _store_url(redis_url: str | None, stack: str, password_file: Path | None = None) -> str:
    from ops.devstack.lock import find_running_dev

    dev = find_running_dev() if stack == "local" else None
    environ = dict(os.environ)
    url = resolve_redis_url(redis_url, stack, environ, dev.redis_url if dev else None)
    return with_password(url, redis_password(environ, password_file))


def _limits(**values: int | Decimal | None) -> dict[str, int | Decimal]:
    return {name: value for name, value in values.items() if value is not None}


def _queueing(**values: str | float | None) -> dict[str, Any]:
    """Tier and weight as given, checked against the key record's own rules before any Redis call."""
    from pydantic import TypeAdapter, ValidationError

    given = {name: value for name, value in values.items() if value is not None}
    for name, value in given.items():
        field = KeyRecord.model_fields[name]
        try:
            rule: Any = Annotated[field.annotation, field]  # a type built at run time, from the field
            TypeAdapter(rule).validate_python(value)
        except ValidationError as exc:
            raise typer.BadParameter(exc.errors()[0]["msg"], param_hint=f"--{name}") from None
    return given


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
    monthly_budget_usd: BudgetOption = None,
    shadow: Annotated[bool, typer.Option(help="Shadow mode: over-limit requests are logged, not refused.")] = False,
    tier: TierOption = None,
    weight: WeightOption = None,
    adapter: AdapterOption = None,
    no_adapters: Annotated[bool, typer.Option("--no-adapters", help="No adapter, whatever its tenant's.")] = False,
) -> None:
    """Make a key. The key is printed once, on stdout; only its hash is stored. Without --adapter
    or --no-adapters it may use its tenant's adapters (llmctl tenants set --adapter)."""
    grants = _grants(adapter, none=no_adapters)
    expires = datetime.now(UTC) + timedelta(days=expires_in_days) if expires_in_days else None
    limits = _limits(
        requests_per_minute=requests_per_minute,
        tokens_per_minute=tokens_per_minute,
        daily_token_budget=daily_token_budget,
        max_concurrent_requests=max_concurrent_requests,
        monthly_budget_usd=monthly_budget_usd,
    )
    queueing = _queueing(tier=tier, weight=weight)
    key, record = _run(
        _store_url(redis_url, stack, redis_password_file),
        lambda s: s.create(
            tenant,
            name,
            expires_at=expires,
            allowed_models=model or None,
            limits=limits,
            shadow=shadow,
            allowed_adapters=grants,
            **queueing,
        ),
    )
    err.print(f"created key {record.key_id} for tenant {tenant} (shown once; store it now)")
    print(key)


@app.command("list")
def list_keys(
    stack: StackOption = "local",
    redis_url: RedisOption = None,
    redis_password_file: PasswordFileOption = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Every key: id, tenant, name, state, models, limit overrides. Never the key itself."""
    records = _run(_store_url(redis_url, stack, redis_password_file), lambda s: s.list())
    if as_json:
        print(json.dumps([_describe(r) for r in records], indent=2))
        return
    table = Table(
        "key id", "tenant", "name", "created", "state", "models", "adapters", "limit overrides", "mode", "queue"
    )
    now = datetime.now(UTC)
    for r in records:
        state = "revoked" if r.revoked else "expired" if r.expires_at and r.expires_at <= now else "active"
        overrides = ", ".join(f"{f}={getattr(r, f)}" for f in LIMIT_FIELDS if getattr(r, f) is not None)
        table.add_row(
            r.key_id,
            r.tenant,
            r.name,
            r.created_at.strftime("%Y-%m-%d %H:%M"),
            state,
            ", ".join(r.allowed_models or ["all"]),
            _adapters_cell(r.allowed_adapters),
            overrides or "-",
            "shadow" if r.shadow else "enforced",
            f"{r.tier or 'default'} x{r.weight or 1:g}",
        )
    out.print(table)


@app.command()
def show(
    key_id: str,
    stack: StackOption = "local",
    redis_url: RedisOption = None,
    redis_password_file: PasswordFileOption = None,
) -> None:
    """One key's record, as JSON."""
    record = _run(_store_url(redis_url, stack, redis_password_file), lambda s: s.get(key_id))
    if record is None:
        err.print(f"no key with id {key_id!r} (llmctl keys list shows them)")
        raise typer.Exit(ExitCode.FAILED)
    print(json.dumps(_describe(record), indent=2))


@app.command()
def revoke(
    key_id: str,
    stack: StackOption = "local",
    redis_url: RedisOption = None,
    redis_password_file: PasswordFileOption = None,
) -> None:
    """Refuse the key from the next request on, on every gateway replica."""
    if not _run(_store_url(redis_url, stack, redis_password_file), lambda s: s.revoke(key_id)):
        err.print(f"no key with id {key_id!r} (llmctl keys list shows them)")
        raise typer.Exit(ExitCode.FAILED)
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
    monthly_budget_usd: BudgetOption = None,
    shadow: Annotated[
        bool | None, typer.Option("--shadow/--enforce", help="Log over-limit requests / refuse them.")
    ] = None,
    tier: TierOption = None,
    weight: WeightOption = None,
    adapter: AdapterOption = None,
    no_adapters: Annotated[bool, typer.Option("--no-adapters", help="No adapter, whatever its tenant's.")] = False,
    tenant_adapters: Annotated[
        bool, typer.Option("--tenant-adapters", help="Drop the key's own adapter list: its tenant's applies.")
    ] = False,
) -> None:
    """Change a key's limits, mode, tier, weight or adapters; every gateway replica applies it from the next request."""
    grants = _grants(adapter, none=no_adapters)
    if tenant_adapters and grants is not None:
        raise typer.BadParameter("--tenant-adapters drops the key's list: give no --adapter/--no-adapters with it")
    changes: dict[str, Any] = _limits(
        requests_per_minute=requests_per_minute,
        tokens_per_minute=tokens_per_minute,
        daily_token_budget=daily_token_budget,
        max_concurrent_requests=max_concurrent_requests,
        monthly_budget_usd=monthly_budget_usd,
    )
    if shadow is not None:
        changes["shadow"] = shadow
    changes.update(_queueing(tier=tier, weight=weight))
    if grants is not None or tenant_adapters:
        changes["allowed_adapters"] = grants
    if not changes:
        err.print(
            "nothing to change: give a limit option (e.g. --requests-per-minute 30), --shadow/--enforce, "
            "--tier, --weight, --adapter, --no-adapters or --tenant-adapters"
        )
        raise typer.Exit(ExitCode.UNUSABLE_INPUT)
    record = _run(_store_url(redis_url, stack, redis_password_file), lambda s: s.update(key_id, **changes))
    if record is None:
        err.print(f"no key with id {key_id!r} (llmctl keys list shows them)")
        raise typer.Exit(ExitCode.FAILED)
    err.print(f"updated {key_id}: " + ", ".join(f"{k}={v}" for k, v in changes.items()))


@app.command()
def rotate(
    key_id: str,
    stack: StackOption = "local",
    redis_url: RedisOption = None,
    redis_password_file: PasswordFileOption = None,
) -> None:
    """A new key with the same tenant, name, models, expiry, limits, tier and weight; the old one is revoked."""

    async def swap(store: RedisKeyStore) -> tuple[str, KeyRecord] | None:
        old = await store.get(key_id)
        if old is None:
            return None
        limits = {f: getattr(old, f) for f in LIMIT_FIELDS if getattr(old, f) is not None}
        made = await store.create(
            old.tenant,
            old.name,
            expires_at=old.expires_at,
            allowed_models=old.allowed_models,
            limits=limits,
            shadow=old.shadow,
            allowed_adapters=old.allowed_adapters,
            tier=old.tier,
            weight=old.weight,
        )
        await store.revoke(key_id)
        return made

    made = _run(_store_url(redis_url, stack, redis_password_file), swap)
    if made is None:
        err.print(f"no key with id {key_id!r} (llmctl keys list shows them)")
        raise typer.Exit(ExitCode.FAILED)
    err.print(f"rotated {key_id} -> {made[1].key_id}; {key_id} is revoked (shown once; store it now)")
    print(made[0])


def _tenant_row(limits: Any) -> str:
    values = {f: getattr(limits, f, None) for f in LIMIT_FIELDS}
    return ", ".join(f"{f}={value}" for f, value in values.items() if value is not None) or "-"


@tenants_app.command("list")
def list_tenants(
    stack: StackOption = "local",
    redis_url: RedisOption = None,
    redis_password_file: PasswordFileOption = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Every tenant with limits or adapters of its own (the others get the stack's gateway.default_tenant_limits
    and no adapters)."""

    async def read(store: TenantStore) -> dict[str, tuple[Any, list[str] | None]]:
        return {t: (limits, await store.adapters(t)) for t, limits in (await store.list()).items()}

    tenants = _run(_store_url(redis_url, stack, redis_password_file), read, TenantStore)
    if as_json:
        print(
            json.dumps(
                {
                    t: {
                        **limits.model_dump(mode="json", exclude_none=True),
                        **({"adapters": grants} if grants is not None else {}),
                    }
                    for t, (limits, grants) in tenants.items()
                },
                indent=2,
            )
        )
        return
    table = Table("tenant", "own limits", "adapters")
    for tenant, (limits, grants) in tenants.items():
        table.add_row(tenant, _tenant_row(limits), _adapters_cell(grants, inherited="none"))
    out.print(table)


@tenants_app.command("show")
def show_tenant(
    tenant: str,
    stack: StackOption = "local",
    redis_url: RedisOption = None,
    redis_password_file: PasswordFileOption = None,
) -> None:
    """A tenant's own limits, its adapter grants (null: none) and the tokens its keys were billed today, as JSON."""

    async def read(store: TenantStore) -> dict[str, Any]:
        limits = await store.get(tenant)
        return {
            "tenant": tenant,
            "limits": limits.model_dump(mode="json", exclude_none=True),
            "adapters": await store.adapters(tenant),
            "tokens_today": await store.used_today(tenant),
        }

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
    monthly_budget_usd: Annotated[
        Decimal | None,
        typer.Option(
            "--monthly-budget-usd",
            min=0,
            help="Dollars per calendar month (UTC) at the models' rate card; 0: back to the default.",
        ),
    ] = None,
    adapter: AdapterOption = None,
    no_adapters: Annotated[bool, typer.Option("--no-adapters", help="Remove the tenant's adapter list.")] = False,
) -> None:
    """Set limits shared by all the tenant's keys, on top of each key's own (0 removes one), and the
    LoRA adapters its keys may use when they have no list of their own."""
    grants = _grants(adapter, none=no_adapters)
    given = {
        "requests_per_minute": requests_per_minute,
        "tokens_per_minute": tokens_per_minute,
        "daily_token_budget": daily_token_budget,
        "max_concurrent_requests": max_concurrent_requests,
        "monthly_budget_usd": monthly_budget_usd,
    }
    changes = {name: (value or None) for name, value in given.items() if value is not None}
    if not changes and grants is None:
        err.print("nothing to change: give a limit option (e.g. --requests-per-minute 600), --adapter or --no-adapters")
        raise typer.Exit(2)
    try:
        TenantLimits(**{name: value for name, value in changes.items() if value is not None})
    except ValidationError as exc:
        problem = exc.errors()[0]
        err.print(f"--{str(problem['loc'][0]).replace('_', '-')}: {problem['msg']}", highlight=False)
        raise typer.Exit(ExitCode.UNUSABLE_INPUT) from None

    async def write(store: TenantStore) -> tuple[Any, list[str] | None]:
        limits = await store.set(tenant, changes) if changes else await store.get(tenant)
        if grants is not None:
            await store.set_adapters(tenant, grants or None)  # --no-adapters: the list is removed
        return limits, await store.adapters(tenant)

    limits, stored = _run(_store_url(redis_url, stack, redis_password_file), write, TenantStore)
    err.print(f"tenant {tenant}: {_tenant_row(limits)}; adapters: {_adapters_cell(stored, inherited='none')}")
