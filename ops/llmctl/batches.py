"""`llmctl batches ls|show|cancel`: the Batch API's batches, read from the gateway's Redis.

Which Redis, and its password: as `llmctl keys` (ops.llmctl.keys). Cancelling here does what a
tenant's `POST /v1/batches/{id}/cancel` does: the batch turns `cancelling`, no new line of it
starts, and a gateway's sweeper finalizes it with what completed (a running gateway is needed
for that last step).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any

import typer
from rich.table import Table

from ops.llmctl.console import ExitCode, err, out
from ops.llmctl.keys import PasswordFileOption, RedisOption, StackOption, _run, _store_url
from serving.gateway.batch.objects import BatchRecord
from serving.gateway.batch.store import BatchStore, now
from serving.gateway.protocol.routes import BATCH_ID
from serving.gateway.redis.client import redis_client

app = typer.Typer(help="Batches of the Batch API (/v1/batches): list, show, cancel.", no_args_is_help=True)
PAGE = 1000


class _Admin:
    """The gateway's batch store over a Redis client of its own (what `_run` opens and closes)."""

    def __init__(self, redis_url: str) -> None:
        self.redis = redis_client(redis_url, decode_responses=True)
        self.store = BatchStore(self.redis)

    async def aclose(self) -> None:
        await self.redis.aclose()


async def _batches(admin: _Admin, tenant: str | None, active: bool) -> list[tuple[BatchRecord, tuple[int, int]]]:
    if active:
        ids = await admin.store.active()
    else:
        tenants = (
            [tenant]
            if tenant
            else [
                name.rsplit(":", 1)[1]
                async for name in admin.redis.scan_iter(match="llmstack:batches:tenant:*", count=500)
            ]
        )
        ids = [
            batch_id
            for t in tenants
            for batch_id in await admin.redis.zrevrange(f"llmstack:batches:tenant:{t}", 0, PAGE - 1)
        ]
    rows = []
    for batch_id in ids:
        record = await admin.store.batch(batch_id, tenant)
        if record is not None:
            rows.append((record, await admin.store.counts(batch_id)))
    return sorted(rows, key=lambda row: row[0].seq, reverse=True)


def _when(timestamp: int | None) -> str:
    return "" if timestamp is None else datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d %H:%M")


def _check_id(batch_id: str) -> None:
    if not BATCH_ID.fullmatch(batch_id):
        raise typer.BadParameter("a batch id looks like batch_<24 hex digits>", param_hint="BATCH_ID")


@app.command("ls")
def list_batches(
    stack: StackOption = "local",
    redis_url: RedisOption = None,
    redis_password_file: PasswordFileOption = None,
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's batches.")] = None,
    active: Annotated[bool, typer.Option("--active", help="Only batches not yet finished.")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Batches, newest first: status, lines done and failed of the total, when made and when they expire."""
    rows = _run(_store_url(redis_url, stack, redis_password_file), lambda a: _batches(a, tenant, active), _Admin)
    if as_json:
        print(
            json.dumps(
                [record.api(counts) | {"tenant": record.tenant, "key_id": record.key_id} for record, counts in rows],
                indent=2,
            )
        )
        return
    table = Table()
    table.add_column("batch id", no_wrap=True)  # copied into `show` and `cancel`: never broken over lines
    for title in ("tenant", "status", "completed", "failed", "total", "created", "expires"):
        table.add_column(title)
    for record, counts in rows:
        answer = record.api(counts)["request_counts"]
        table.add_row(
            record.id,
            record.tenant,
            record.status,
            str(answer["completed"]),
            str(answer["failed"]),
            str(answer["total"]),
            _when(record.created_at),
            _when(record.expires_at),
        )
    out.print(table)


async def _show(admin: _Admin, batch_id: str) -> dict[str, Any] | None:
    record = await admin.store.batch(batch_id)
    if record is None:
        return None
    running = await admin.store.running(batch_id, 0)
    return record.api(await admin.store.counts(batch_id)) | {
        "tenant": record.tenant,
        "key_id": record.key_id,
        "lines_running": running,
        "lines_waiting": await admin.store.lines_waiting(batch_id),
        "ending": record.ending,
        "stop_code": record.stop_code,
    }


@app.command()
def show(
    batch_id: str,
    stack: StackOption = "local",
    redis_url: RedisOption = None,
    redis_password_file: PasswordFileOption = None,
) -> None:
    """One batch as its tenant sees it, plus its tenant and key, lines running and waiting now and why it stopped."""
    _check_id(batch_id)
    shown = _run(_store_url(redis_url, stack, redis_password_file), lambda a: _show(a, batch_id), _Admin)
    if shown is None:
        err.print(f"no batch {batch_id}")
        raise typer.Exit(ExitCode.FAILED)
    print(json.dumps(shown, indent=2))


async def _cancel(admin: _Admin, batch_id: str) -> str | None:
    if await admin.store.transition(batch_id, ("validating", "in_progress"), status="cancelling", cancelling_at=now()):
        return "cancelling"
    return await admin.store.status(batch_id)


@app.command()
def cancel(
    batch_id: str,
    stack: StackOption = "local",
    redis_url: RedisOption = None,
    redis_password_file: PasswordFileOption = None,
) -> None:
    """Stop a batch: no new line starts; a gateway finalizes it with what completed."""
    _check_id(batch_id)
    status = _run(_store_url(redis_url, stack, redis_password_file), lambda a: _cancel(a, batch_id), _Admin)
    if status is None:
        err.print(f"no batch {batch_id}")
        raise typer.Exit(ExitCode.FAILED)
    if status not in ("cancelling", "cancelled"):
        err.print(f"batch {batch_id} is {status}: only a validating or in-progress batch can be cancelled")
        raise typer.Exit(ExitCode.FAILED)
    err.print(f"batch {batch_id} is {status}; a gateway finalizes it within seconds (llmctl batches show)")
