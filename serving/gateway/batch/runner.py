"""The batch workers and sweeper: asyncio tasks inside every gateway process.

Workers take lines one at a time, fairly across batches: each batch's lines are in a stream of
its own (one consumer group for all gateway processes), and each claim takes a line from the
tenant, then the batch of that tenant, whose turn is oldest (store.CLAIM_LUA). So a small batch
runs alongside a big one created before it, not after it. Each line runs through the gateway's
own public app, in process: the same route check, admission, limits, fair queue, proxy and
metering as an online request, with the batch's key as the caller (`BATCH_CALLER` in the ASGI
scope, which no client can set) at the queue's lowest tier. So a line is billed to its key and
tenant like any request, waits behind interactive traffic when the model is saturated, and shows
up in the access log and metrics.

A line a limit refuses for now (the key's rate, a saturated model) is put back with the time it
may run again (store.put_back), and an upstream failure is retried the same way: the worker takes
the next line at once. A worker never sleeps on one tenant's limits, so one throttled tenant's
big batch cannot hold the workers while other tenants' lines wait.

Line bodies are read from the batch's lines file in storage when the line runs (one byte range);
Redis holds only references to them.

A worker renews its claim on a line every lease_s / 3 (XCLAIM ... JUSTID resets the entry's idle
time); a line whose worker died is claimed again by another one after lease_s (XAUTOCLAIM on the
streams of the active batches). Its result is kept once per custom_id (store.record), so redoing
it cannot duplicate output. A retired batch's stream is deleted with whatever it still held.

The sweeper, in each process every sweep_interval_s, moves batches along: validates new ones,
enqueues their lines, expires those past their window, finalizes cancelled, stopped and finished
ones. Each of those steps holds the batch's lock and can be redone whole after a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from starlette.types import ASGIApp, Message

from serving.gateway.admission.batch_caller import BATCH_CALLER, BatchCaller
from serving.gateway.auth.key_format import is_usable
from serving.gateway.auth.keys import KeyStore
from serving.gateway.batch.lines import CheckedInput, check_input
from serving.gateway.batch.memory import MemoryBudget
from serving.gateway.batch.objects import (
    ENDING_CODE,
    ENDING_MESSAGE,
    TERMINAL,
    BatchRecord,
    FileRecord,
    LineError,
    error_line,
    output_line,
)
from serving.gateway.batch.storage import FileStorage, StorageError
from serving.gateway.batch.store import BatchStore, lines_name, now
from serving.gateway.config.batch_policy import COPIES_IN_MEMORY
from serving.gateway.config.settings import GatewaySettings
from serving.gateway.limits.budgets import REFUSAL_CODE
from serving.gateway.redis.client import raise_if_cancel_was_lost, stop_loops
from serving.gateway.telemetry.metrics import GatewayMetrics

log = logging.getLogger("llmstack.gateway.batch")

READ_BLOCK_MS = 1000  # an idle worker's wait for new lines; below the Redis client's 2 s socket timeout
# A quota, not a rate: waiting minutes cannot help, so the batch stops and its other lines fail.
QUOTA_CODES = frozenset({"daily_token_budget_exceeded", REFUSAL_CODE})
# The model or the gateway is full: wait as long as the batch may run, without counting attempts.
BUSY_CODES = frozenset({"model_saturated", "tenant_queue_share_exceeded", "gateway_busy"})
MAX_WAIT_S = 30.0  # the longest a line is put back for at once (it is refused again if still too early)
TIDY_INTERVAL_S = 600.0
STATIC_RECORDS = 1024  # batches whose fixed fields a process keeps; past it, the cache starts over
GONE_CONSUMER_MS = 3_600_000  # an hour without reading: that process is gone (a live one reads every second)
FINAL_STATUS = {"completed": "completed", "stopped": "completed", "cancelled": "cancelled", "expired": "expired"}
FINAL_TIME = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}


@dataclass(frozen=True)
class Later:
    """Not now: run the line again in `wait_s`, its `attempts` at the upstream so far."""

    wait_s: float
    attempts: int


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return {
                "error": {
                    "message": self.body.decode("utf-8", "replace")[:2000],
                    "type": "server_error",
                    "param": None,
                    "code": None,
                }
            }

    @property
    def error_code(self) -> str | None:
        error = self.json().get("error") if isinstance(self.json(), dict) else None
        return error.get("code") if isinstance(error, dict) else None

    def retry_after_s(self, default: float) -> float:
        try:
            return min(MAX_WAIT_S, max(0.1, float(self.headers.get("retry-after", default))))
        except ValueError:
            return default


async def call_app(app: ASGIApp, path: str, body: bytes, caller: BatchCaller) -> Answer:
    """POST `body` to `path` of `app` in this process, as an HTTP request from `caller`."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "client": ("batch", 0),
        "server": ("batch", 0),
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        BATCH_CALLER: caller,
    }
    sent = False
    never = asyncio.Event()
    status, headers, parts = 500, {}, []

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()  # the "client" never leaves; the response ends by itself
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status = message["status"]
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            parts.append(message.get("body", b""))

    await app(scope, receive, send)
    return Answer(status, headers, b"".join(parts))


def result_file_id(batch_id: str, kind: str) -> str:
    """The output or error file's id: the same on every try, so a redone finalization overwrites, never adds."""
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


class BatchRunner:
    def __init__(
        self,
        settings: GatewaySettings,
        key_store: KeyStore,
        store: BatchStore,
        storage: FileStorage,
        metrics: GatewayMetrics,
    ) -> None:
        self.settings, self.policy = settings, settings.batch
        self.key_store, self.store, self.storage, self.metrics = key_store, store, storage, metrics
        self.tier = settings.queue.tiers[-1].name
        self.consumer = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.app: ASGIApp | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # Uploads, validations, finalizations and downloads share the memory the pod's limit
        # allows for them (gateway.batch.memory_bytes()), each counting what it holds.
        self.memory = MemoryBudget(self.policy.memory_bytes(), on_change=metrics.batch_memory.set)
        self._next_reclaim = 0.0
        self._records: dict[str, BatchRecord] = {}
        self._next_tidy = 0.0

    def expires_at(self) -> int:
        """When what is made now (a file, a finished batch) is deleted: gateway.batch.retention_days."""
        return now() + self.policy.retention_days * 86_400

    async def start(self, app: ASGIApp) -> None:
        self.app = app
        self._tasks = [asyncio.create_task(self._forever("sweeper", self._sweep, self.policy.sweep_interval_s))]
        self._tasks += [
            asyncio.create_task(self._forever("worker", self._work_one, 0)) for _ in range(self.policy.workers)
        ]

    async def aclose(self) -> None:
        await stop_loops(self._tasks)
        self._tasks = []

    async def _forever(self, name: str, step: Callable[[], Awaitable[None]], pause_s: float) -> None:
        while True:
            wait_s = pause_s
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis or storage away: log, wait, go on (a crash stops all batches)
                raise_if_cancel_was_lost()  # the cancel may come back as the library's own error
                log.warning("batch %s failed: %s: %s", name, type(exc).__name__, exc)
                wait_s = max(pause_s, 1.0)
            # A Redis call can return normally with aclose()'s cancel eaten (Python 3.11): a loop
            # that went on would outlive the gateway's shutdown, and aclose() would wait for it.
            raise_if_cancel_was_lost()
            if wait_s:
                await asyncio.sleep(wait_s)

    async def prepare_soon(self, batch_id: str, checked: CheckedInput | None = None) -> None:
        """`prepare` for a batch just created (its input as create checked it); a failure is
        logged and left to the sweeper."""
        try:
            await self.prepare(batch_id, checked)
        except Exception as exc:  # noqa: BLE001 - whatever failed, the sweeper retries the batch
            log.warning("batch %s validation failed (the sweeper retries): %s: %s", batch_id, type(exc).__name__, exc)

    # --- the sweeper -------------------------------------------------------------------

    async def _sweep(self) -> None:
        if time.monotonic() >= self._next_tidy:
            if moved := await self.store.adopt_legacy_lines(self.consumer):
                log.info("batch lines moved from the single work stream of an earlier version: %d", moved)
            await self._forget_gone_consumers()
            self._next_tidy = time.monotonic() + TIDY_INTERVAL_S
        for batch_id in await self.store.active():
            record = await self.store.batch(batch_id)
            if record is None or record.status in TERMINAL:
                await self._retire(batch_id, None if record is None else record.tenant)
            elif record.status in ("validating", "in_progress") and now() >= record.expires_at:
                # No line of it starts from here on; the ones running get lease_s to finish.
                await self.store.transition(
                    batch_id, ("validating", "in_progress"), status="finalizing", finalizing_at=now(), ending="expired"
                )
            elif record.status == "validating" or (record.status == "in_progress" and not record.enqueued):
                await self.prepare(batch_id)
            elif record.status == "cancelling" and await self._drained(batch_id, record.cancelling_at):
                await self.finalize(batch_id, "cancelled")
            elif record.status == "finalizing" and (
                record.ending in (None, "completed") or await self._drained(batch_id, record.finalizing_at)
            ):
                await self.finalize(batch_id, record.ending or "completed")
            elif record.status == "in_progress" and sum(await self.store.counts(batch_id)) >= record.total:
                await self._finish(batch_id)

    async def _forget_gone_consumers(self) -> None:
        """Each gateway process joins the group of a batch's stream under a name of its own; the
        names of processes long gone, holding no line, are dropped so a long batch's group does
        not grow with every restart (a retired batch's stream goes with its group)."""
        for batch_id in await self.store.active():
            for consumer in await self.store.consumers(batch_id):
                if (
                    consumer["pending"] == 0
                    and consumer["idle"] > GONE_CONSUMER_MS
                    and consumer["name"] != self.consumer
                ):
                    await self.store.forget_consumer(batch_id, consumer["name"])

    async def _drained(self, batch_id: str, since: int | None) -> bool:
        """No line of a stopping batch is still being sent (or lease_s passed: a worker that died
        leaves its count behind), so what completed is in before the files are written."""
        return await self.store.running(batch_id, 0) <= 0 or now() - (since or 0) >= self.policy.lease_s

    @contextlib.asynccontextmanager
    async def _locked(self, batch_id: str) -> AsyncIterator[bool]:
        """The batch's lock for one step (True), or False when another process holds it. Held
        for lease_s and renewed every lease_s / 3, so a process that dies holding it blocks the
        step for lease_s at most."""
        owner, ttl_s = uuid.uuid4().hex, self.policy.lease_s
        if not await self.store.lock(batch_id, owner, ttl_s):
            yield False
            return

        async def renew() -> None:
            while True:
                await asyncio.sleep(ttl_s / 3)
                with contextlib.suppress(Exception):
                    await self.store.renew(batch_id, owner, ttl_s)
                # The renewal can return with the step's cancel eaten (Python 3.11): renewing on
                # would hold the batch's lock for good.
                raise_if_cancel_was_lost()

        renewing = asyncio.create_task(renew())
        try:
            yield True
        finally:
            renewing.cancel()
            await self.store.unlock(batch_id, owner)

    async def prepare(self, batch_id: str, checked: CheckedInput | None = None) -> None:
        """Check the input file (unless `checked`), store its checked bodies and enqueue its
        lines: validating -> in_progress (or failed)."""
        record = await self.store.batch(batch_id)
        size = COPIES_IN_MEMORY * (record.input_bytes if record is not None else 0)
        async with self.memory.holding(size), self._locked(batch_id) as mine:
            if mine:
                await self._prepare(batch_id, checked)

    async def _prepare(self, batch_id: str, checked: CheckedInput | None) -> None:
        """A batch's validation steps in order, each resumable after a crash: its key and input
        checked, its refused lines answered, its lines' bodies stored and queued."""
        record = await self.store.batch(batch_id)
        if record is None or record.status not in ("validating", "in_progress") or record.enqueued:
            return
        checked = await self._checked(record, checked)
        if checked is None:
            return
        fresh = record.status == "validating"
        if fresh and not await self._start(record, checked):
            return  # cancelled or expired meanwhile
        todo = await self._store_lines(record, checked, fresh=fresh)
        await self.store.enqueue(batch_id, record.tenant, todo)
        self.metrics.batch_lines.labels(tenant=record.tenant, outcome="queued").inc(len(todo))
        await self.store.transition(batch_id, ("in_progress", "cancelling", "finalizing"), enqueued=True)
        if not todo:
            await self._finish(batch_id)

    async def _checked(self, record: BatchRecord, checked: CheckedInput | None) -> CheckedInput | None:
        """The batch's input checked against its key (read again: a revoked key stops it), or None
        when the batch failed for it."""
        key = await self.key_store.get(record.key_id)
        if key is None or not is_usable(key, _utcnow()):
            await self._fail(record, "invalid_api_key", "The API key that created this batch was revoked or expired.")
            return None
        if checked is None:
            try:
                content = await self.storage.get(record.input_file_id)
            except StorageError:
                await self._fail(record, "file_not_found", f"The input file {record.input_file_id} cannot be read.")
                return None
            checked = await asyncio.to_thread(check_input, content, record.endpoint, key, self.settings)
            del content
        if checked.problems:
            await self._fail(record, errors=checked.problems)
            return None
        return checked

    async def _start(self, record: BatchRecord, checked: CheckedInput) -> bool:
        """A fresh batch: its ids listed, its refused lines answered, then in progress (False: it
        was cancelled or expired meanwhile)."""
        batch_id = record.id
        await self.store.set_ids(batch_id, checked.custom_ids)
        for rejected in checked.rejected:
            answer = output_line(rejected.custom_id, rejected.status, None, rejected.body)
            if (await self.store.record(batch_id, rejected.custom_id, answer, ok=False))[0]:
                self.metrics.batch_lines.labels(tenant=record.tenant, outcome="failed").inc()
        return await self.store.transition(
            batch_id, ("validating",), status="in_progress", in_progress_at=now(), total=len(checked.custom_ids)
        )

    async def _store_lines(self, record: BatchRecord, checked: CheckedInput, *, fresh: bool) -> list[dict[str, str]]:
        """The bodies go to storage, one after another; each line's stream entry says where its is.
        Redone after a crash, lines may have answers already; a fresh batch has none but its refusals."""
        todo, at, bodies = [], 0, []
        for line in checked.lines:
            if fresh or not await self.store.answered(record.id, line.custom_id):
                todo.append({"custom_id": line.custom_id, "at": str(at), "len": str(len(line.body))})
            bodies.append(line.body)
            at += len(line.body)
        if todo:
            await self.storage.put(lines_name(record.id), b"".join(bodies))
        return todo

    async def _retire(self, batch_id: str, tenant: str | None) -> None:
        await self.store.retire(batch_id, tenant)
        await self.storage.delete(lines_name(batch_id))

    async def _fail(
        self,
        record: BatchRecord,
        code: str | None = None,
        message: str | None = None,
        *,
        errors: list[LineError] | None = None,
    ) -> None:
        errors = errors or [LineError(code=code or "invalid_batch", message=message or "")]
        await self.store.transition(
            record.id, ("validating", "in_progress"), status="failed", failed_at=now(), errors=errors
        )
        await self._retire(record.id, record.tenant)

    async def _finish(self, batch_id: str) -> None:
        if await self.store.transition(
            batch_id, ("in_progress",), status="finalizing", finalizing_at=now(), ending="completed"
        ):
            await self.finalize(batch_id, "completed")

    async def stop(self, batch_id: str, code: str, message: str) -> None:
        """A quota refused a line: no more lines run; the unfinished ones fail with `code`."""
        if await self.store.transition(
            batch_id,
            ("in_progress",),
            status="finalizing",
            finalizing_at=now(),
            ending="stopped",
            stop_code=code,
            stop_message=message,
        ):
            log.warning("batch %s stopped: %s", batch_id, code)  # the sweeper finalizes it once drained

    async def finalize(self, batch_id: str, ending: str) -> None:
        """Fail the lines without an answer (cancelled, expired, stopped), write the output and
        error files, and set the final status. Redone whole if this process dies half way."""
        record = await self.store.batch(batch_id)
        size = COPIES_IN_MEMORY * (record.input_bytes if record is not None else 0)
        async with self.memory.holding(size), self._locked(batch_id) as mine:
            if not mine:
                return
            record = await self.store.batch(batch_id)
            if record is None or record.status in TERMINAL:
                await self._retire(batch_id, None if record is None else record.tenant)
                return
            await self._write_results(record, ending)

    async def _write_results(self, record: BatchRecord, ending: str) -> None:
        batch_id = record.id
        ids = await self.store.ids(batch_id)
        done, failed = await self.store.results(batch_id)
        code = record.stop_code if ending == "stopped" else ENDING_CODE.get(ending, "batch_incomplete")
        message = (
            record.stop_message
            if ending == "stopped"
            else ENDING_MESSAGE.get(ending, "This request did not run before the batch finished.")
        )
        for custom_id in ids:
            if custom_id not in done and custom_id not in failed:
                written, _, _ = await self.store.record(
                    batch_id, custom_id, error_line(custom_id, code or "", message or ""), ok=False
                )
                if written:
                    self.metrics.batch_lines.labels(tenant=record.tenant, outcome="failed").inc()
        done, failed = await self.store.results(batch_id)  # now final: every custom_id has its one answer
        files = {}
        for kind, answers in (("output", done), ("error", failed)):
            if answers:
                content = "".join(answers[c] + "\n" for c in ids if c in answers).encode()
                file_id = result_file_id(batch_id, kind)
                await self.storage.put(file_id, content)
                await self.store.put_file(
                    FileRecord(
                        id=file_id,
                        tenant=record.tenant,
                        bytes=len(content),
                        created_at=now(),
                        filename=f"{batch_id}_{kind}.jsonl",
                        purpose="batch_output",
                        expires_at=self.expires_at(),
                    )
                )
                files[f"{kind}_file_id"] = file_id
        allowed = ("validating", "in_progress", "finalizing", "cancelling")
        final = {FINAL_TIME.get(ending, "completed_at"): now()}
        await self.store.transition(
            batch_id,
            allowed,
            status=FINAL_STATUS[ending],
            total=len(ids),
            completed=len(done),
            failed=len(failed),
            **files,
            **final,
        )
        await self.store.keep_until(batch_id, self.expires_at())
        await self._retire(batch_id, record.tenant)
        log.info("batch %s %s: %d completed, %d failed", batch_id, FINAL_STATUS[ending], len(done), len(failed))

    # --- the workers -------------------------------------------------------------------

    async def _claim(self) -> tuple[str, str, dict[str, str]] | None:
        """A line whose worker stopped renewing its claim, else a new one by turns (waits up to
        READ_BLOCK_MS for one): (batch id, entry id, fields). Abandoned lines are looked for at
        most every lease_s / 4 per process, until none is left."""
        if time.monotonic() >= self._next_reclaim:
            claimed = await self.store.reclaim(
                self.consumer, await self.store.active(), int(self.policy.lease_s * 1000)
            )
            if claimed:
                return claimed
            self._next_reclaim = time.monotonic() + self.policy.lease_s / 4
        claimed, bell = await self.store.claim(self.consumer)
        if claimed is None:
            await self.store.wait_for_lines(bell, READ_BLOCK_MS)
        return claimed

    async def _work_one(self) -> None:
        claimed = await self._claim()
        if claimed is None:
            return
        batch_id, entry_id, fields = claimed
        custom_id = fields.get("custom_id")
        if custom_id is None or not ("body" in fields or {"at", "len"} <= fields.keys()):
            log.warning("batch %s work entry %s is not a line: dropped", batch_id, entry_id)  # nothing to run or redo
        else:
            heartbeat = asyncio.create_task(self._renew(batch_id, entry_id))
            try:
                later = await self._run_line(batch_id, custom_id, fields)
                if later is not None:
                    record = await self._static_record(batch_id)
                    fields = {**fields, "attempts": str(later.attempts)}
                    if record is not None:
                        not_before = await self.store.clock_ms() + int(later.wait_s * 1000)
                        await self.store.put_back(batch_id, record.tenant, entry_id, fields, not_before)
            finally:
                heartbeat.cancel()
        await self.store.line_done(batch_id, entry_id)

    async def _renew(self, batch_id: str, entry_id: str) -> None:
        while True:
            await asyncio.sleep(self.policy.lease_s / 3)
            with contextlib.suppress(Exception):  # a missed renewal costs at most a redone line
                await self.store.renew_line(batch_id, self.consumer, entry_id)
            raise_if_cancel_was_lost()  # as in _locked's renew: a line's lease renewed for good

    async def _run_line(self, batch_id: str, custom_id: str, fields: dict[str, str]) -> Later | None:
        """Run the line; a `Later` when it is to be put back."""
        record = await self._static_record(batch_id)
        if record is None:
            return None  # its records expired (retention_days): nothing to run it for
        status, answered = await self.store.begin(batch_id, custom_id)
        recorded = False
        try:
            if status != "in_progress" or now() >= record.expires_at or answered:
                return None  # cancelled, expired, stopped or done: the finalizer answers what never ran
            if "body" in fields:  # enqueued by an earlier version, body and all
                body = fields["body"].encode()
            else:
                body = await self.storage.get_range(lines_name(batch_id), int(fields["at"]), int(fields["len"]))
            outcome = await self._answer(record, custom_id, body, int(fields.get("attempts", "0")))
            if isinstance(outcome, Later):
                return outcome
            recorded = outcome
            return None
        finally:
            if not recorded:
                await self.store.running(batch_id, -1)

    async def _static_record(self, batch_id: str) -> BatchRecord | None:
        """The batch's fields that never change once it runs (key, tenant, endpoint, expiry,
        total), kept per process; the status is read fresh for every line (`store.begin`)."""
        record = self._records.get(batch_id)
        if record is None:
            record = await self.store.batch(batch_id)
            if record is not None and record.status != "validating":
                if len(self._records) >= STATIC_RECORDS:
                    self._records.clear()
                self._records[batch_id] = record
        return record

    async def _answer(self, record: BatchRecord, custom_id: str, body: bytes, attempts: int) -> bool | Later:
        """Send the line and keep its answer; True when that write also ended its running count,
        a `Later` when the line is to run again later."""
        batch_id, tenant = record.id, record.tenant
        answer = await self._send(record, body, attempts)
        if isinstance(answer, Later):
            return answer
        if answer.status == 401:
            await self.stop(batch_id, "invalid_api_key", "The API key that created this batch was revoked or expired.")
            return False
        if answer.status == 429 and answer.error_code in QUOTA_CODES:
            message = str(answer.json()["error"].get("message", ""))
            await self.stop(batch_id, str(answer.error_code), f"The batch stopped: {message}")
            return False
        ok = 200 <= answer.status < 300
        line = output_line(custom_id, answer.status, answer.headers.get("x-request-id"), answer.json())
        written, done, failed = await self.store.record(batch_id, custom_id, line, ok=ok, ends_running=True)
        if written:
            self.metrics.batch_lines.labels(tenant=tenant, outcome="completed" if ok else "failed").inc()
        if done + failed >= record.total:
            await self._finish(batch_id)
        return True

    async def _send(self, record: BatchRecord, body: bytes, attempts: int) -> Answer | Later:
        """The line's answer, or when to try it again: rate limits and a saturated model are
        waited out for as long as the batch may run (without counting attempts); upstream
        failures are tried up to max_attempts. The wait is the line's, never the worker's."""
        assert self.app is not None
        answer = await call_app(self.app, record.endpoint, body, BatchCaller(key_id=record.key_id, tier=self.tier))
        return retry_or_answer(answer, attempts, self.policy.max_attempts)


def retry_or_answer(answer: Answer, attempts: int, max_attempts: int) -> Answer | Later:
    """The answer to keep, or a `Later` for a refusal that waiting can help (a rate, a busy
    model) and for an upstream failure with attempts left."""
    transient = (
        answer.status == 429
        and answer.error_code not in QUOTA_CODES
        and answer.headers.get("x-should-retry") != "false"
    )
    busy = transient or (answer.status == 503 and answer.error_code in BUSY_CODES)
    attempts += 0 if busy else 1
    if not (busy or (answer.status >= 500 and attempts < max_attempts)):
        return answer
    return Later(answer.retry_after_s(float(attempts or 1)), attempts)


def _utcnow() -> datetime:
    return datetime.now(UTC)
