"""The Batch API's HTTP handlers: /v1/files and /v1/batches, answered by the gateway itself.

Every handler authenticates the key first (as admission does), and a key sees only its tenant's
files and batches: another tenant's id is answered exactly like an id that does not exist (404),
so ids cannot be probed across tenants. Uploads are read within gateway.batch.max_file_bytes
before anything is parsed, and must be JSONL (each non-blank line a JSON object, bounded in
depth like request bodies). Creating a batch checks the file's lines as requests there and then:
a batch that cannot fit its key's remaining budgets, or the caps on active batches and on the
Redis bytes their lines hold, is refused (serving.gateway.batch.quota). Uploads and downloads
count the bytes they hold in the process's Batch API memory (serving.gateway.batch.memory), and
downloads are streamed from storage in chunks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from datetime import UTC, datetime
from typing import Any

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartParser
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from serving.gateway.admission.admitter import Admitter
from serving.gateway.admission.body import BodyError, parse_json, read_body_within
from serving.gateway.auth.key_format import KeyRecord
from serving.gateway.batch.lines import CheckedInput, check_input
from serving.gateway.batch.memory import Hold, MemoryBusy
from serving.gateway.batch.objects import (
    COMPLETION_WINDOW,
    ENDPOINTS,
    BatchRecord,
    FileRecord,
    new_batch_id,
    new_file_id,
)
from serving.gateway.batch.quota import batch_need, budget_left, redis_footprint, shortfall
from serving.gateway.batch.runner import BatchRunner
from serving.gateway.batch.storage import FileStorage, StorageError
from serving.gateway.batch.store import BatchStore, Caps, now
from serving.gateway.config.batch_policy import COPIES_IN_MEMORY, DOWNLOAD_CHUNK_BYTES, MULTIPART_OVERHEAD
from serving.gateway.config.settings import GatewaySettings
from serving.gateway.metering.usage_meter import NOTHING_BILLED
from serving.gateway.protocol import errors
from serving.gateway.protocol.routes import ApiRoute
from serving.gateway.redis.client import is_out_of_memory

CREATE_FIELDS = frozenset({"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"})
MAX_METADATA = 16
PAGE_DEFAULT, PAGE_MAX = 20, 100
# OpenAI's file list pages up to 10,000 (its default); the SDK follows `has_more` either way.
FILES_PAGE_DEFAULT, FILES_PAGE_MAX = 1000, 10_000
CREATE_MEMORY_WAIT_S = 10.0  # a create waits this long for room to check its file, then 503


class _InMemoryForm(MultiPartParser):
    """Starlette's multipart parser, keeping the file in memory: its default spools anything over
    1 MB to a temporary file, and the gateway's pod has a read-only root filesystem. The body was
    already read within max_file_bytes, so memory is bounded by it."""

    spool_max_size = 2**31


def _bad(message: str, param: str | None = None, code: str = "invalid_value") -> JSONResponse:
    return errors.response_for(errors.invalid_request(param, message, code))


def _not_found(kind: str, resource: str | None) -> JSONResponse:
    return errors.openai_error(
        404, f"No such {kind}: {str(resource)[:64]!r}.", errors.INVALID_REQUEST, code="not_found"
    )


def jsonl_problem(content: bytes, max_depth: int, max_line_bytes: int) -> str | None:
    """Why `content` is not JSONL (one JSON object per non-blank line), or None."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        return "The file is not UTF-8 text: a batch input file is JSONL, one JSON object per line."
    lines = 0
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        lines += 1
        document = parse_json(line.encode(), max_bytes=max_line_bytes, max_depth=max_depth)
        if isinstance(document, BodyError) or not isinstance(document, dict):
            return f"Line {number} is not a JSON object: a batch input file is JSONL, one JSON object per line."
    return None if lines else "The file has no lines: a batch input file is JSONL, one JSON object per line."


class BatchApi:
    def __init__(
        self,
        settings: GatewaySettings,
        admitter: Admitter,
        store: BatchStore,
        storage: FileStorage,
        runner: BatchRunner,
    ) -> None:
        self.settings, self.policy = settings, settings.batch
        self.admitter, self.store, self.storage, self.runner = admitter, store, storage, runner
        self._background: set[asyncio.Task[None]] = set()

    async def handle(self, request: Request, route: ApiRoute) -> Response:
        caller = await self.admitter.authenticate(request)
        if isinstance(caller, errors.Refusal):
            return errors.response_for(caller)
        ticket = await self.admitter.admit_call(caller)
        if isinstance(ticket, errors.Refusal):
            return errors.response_for(ticket)
        try:
            return await self._handle(request, route, caller.record)
        finally:
            await ticket.settle(NOTHING_BILLED)  # the call counted; its concurrency slot frees

    async def _handle(self, request: Request, route: ApiRoute, key: KeyRecord) -> Response:
        from redis.exceptions import RedisError  # here: an in-memory gateway (no Batch API) needs no redis package

        handler = getattr(self, str(route.handler).replace(".", "_"))  # resolve() names only these methods
        try:
            response: Response = await handler(request, route, key)
            return response
        except StorageError:
            return errors.openai_error(
                503,
                "The batch file storage cannot be reached right now. Please retry.",
                errors.SERVER_ERROR,
                code="storage_unavailable",
                headers={"Retry-After": "5"},
            )
        except MemoryBusy:
            return errors.openai_error(
                503,
                "The gateway is handling other batch files right now. Please retry.",
                errors.SERVER_ERROR,
                code="batch_memory_busy",
                headers={"Retry-After": "5"},
            )
        except (RedisError, OSError) as exc:
            if is_out_of_memory(exc):
                self.runner.metrics.redis_out_of_memory.labels(component="batch").inc()
            return errors.openai_error(
                503,
                "The gateway cannot reach its batch state right now. Please retry.",
                errors.SERVER_ERROR,
                code="batch_state_unavailable",
                headers={"Retry-After": "5"},
            )

    # --- files -------------------------------------------------------------------------

    async def files_create(self, request: Request, route: ApiRoute, key: KeyRecord) -> Response:
        if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
            return _bad("Upload the file as multipart/form-data with fields 'file' and 'purpose'.", "file")
        hold = Hold(self.runner.memory)
        try:
            return await self._create_file(request, key, hold)
        finally:
            hold.release()

    async def _create_file(self, request: Request, key: KeyRecord, hold: Hold) -> Response:
        limit = self.policy.max_file_bytes
        body = await _read_counted(request, limit + MULTIPART_OVERHEAD, hold)
        if body is None:
            return errors.openai_error(
                413,
                f"The file is larger than this gateway accepts ({limit} bytes, gateway.batch.max_file_bytes).",
                errors.INVALID_REQUEST,
                code="file_too_large",
            )

        async def replay() -> AsyncGenerator[bytes, None]:
            yield body

        try:
            form = await _InMemoryForm(request.headers, replay(), max_files=1, max_fields=8).parse()
        except Exception:  # noqa: BLE001 - starlette's MultiPartException, python-multipart's parse errors
            return _bad("The upload is not valid multipart/form-data.", "file")
        try:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose != "batch":
                return _bad("purpose must be 'batch': this gateway stores batch input files only.", "purpose")
            if not isinstance(upload, UploadFile):
                return _bad("The form has no file in its 'file' field.", "file")
            content = await upload.read(limit + 1)
            filename = (upload.filename or "upload.jsonl")[:256]
        finally:
            await form.close()
        if len(content) > limit:
            return errors.openai_error(
                413,
                f"The file is larger than this gateway accepts ({limit} bytes, gateway.batch.max_file_bytes).",
                errors.INVALID_REQUEST,
                code="file_too_large",
            )
        problem = await asyncio.to_thread(
            jsonl_problem, content, self.settings.max_json_depth + 1, self.settings.max_body_bytes + 4096
        )
        if problem is not None:
            return _bad(problem, "file", code="invalid_file_format")
        record = FileRecord(
            id=new_file_id(),
            tenant=key.tenant,
            bytes=len(content),
            created_at=now(),
            filename=filename,
            purpose="batch",
            expires_at=self.runner.expires_at(),
        )
        await self.storage.put(record.id, content)
        await self.store.put_file(record)
        return JSONResponse(record.api())

    async def files_list(self, request: Request, route: ApiRoute, key: KeyRecord) -> Response:
        params = request.query_params
        limit = _limit(params.get("limit"), FILES_PAGE_DEFAULT, FILES_PAGE_MAX)
        if limit is None:
            return _bad(f"limit must be an integer from 1 to {FILES_PAGE_MAX}.", "limit")
        order = params.get("order", "desc")
        if order not in ("asc", "desc"):
            return _bad("order must be 'asc' or 'desc'.", "order")
        records, has_more = await self.store.file_page(
            key.tenant, params.get("after"), limit, newest_first=order == "desc", purpose=params.get("purpose")
        )
        return _page([record.api() for record in records], has_more)

    async def files_retrieve(self, request: Request, route: ApiRoute, key: KeyRecord) -> Response:
        record = await self.store.file(str(route.resource), key.tenant)
        return _not_found("file", route.resource) if record is None else JSONResponse(record.api())

    async def files_content(self, request: Request, route: ApiRoute, key: KeyRecord) -> Response:
        record = await self.store.file(str(route.resource), key.tenant)
        if record is None:
            return _not_found("file", route.resource)
        chunks = self.storage.chunks(record.id, DOWNLOAD_CHUNK_BYTES)
        first = await anext(chunks, b"")  # a missing file is a 503 now, not a cut response later
        return StreamingResponse(self._counted(first, chunks), media_type="application/octet-stream")

    async def _counted(self, first: bytes, chunks: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
        """The file's chunks, each counted in the Batch API's memory while it is being sent: a
        slow reader holds one chunk, never the file."""
        chunk: bytes | None = first
        try:
            while chunk:
                async with self.runner.memory.holding(len(chunk)):
                    yield chunk
                chunk = await anext(chunks, None)
        finally:
            await chunks.aclose()

    async def files_delete(self, request: Request, route: ApiRoute, key: KeyRecord) -> Response:
        record = await self.store.file(str(route.resource), key.tenant)
        if record is None:
            return _not_found("file", route.resource)
        await self.store.delete_file(record)  # the record first: the file is gone for callers at once
        await self.storage.delete(record.id)
        return JSONResponse({"id": record.id, "object": "file", "deleted": True})

    # --- batches -----------------------------------------------------------------------

    async def batches_create(self, request: Request, route: ApiRoute, key: KeyRecord) -> Response:
        body = await read_body_within(request, self.settings.max_body_bytes)
        if body is None:
            return errors.response_for(errors.body_too_large(self.settings.max_body_bytes))
        document = parse_json(body, max_bytes=self.settings.max_body_bytes, max_depth=self.settings.max_json_depth)
        if isinstance(document, BodyError):
            return _bad(document.message, document.param, document.code)
        if not isinstance(document, dict):
            return _bad("The request body must be a JSON object.", code="invalid_request_body")
        unknown = sorted(set(document) - CREATE_FIELDS)
        if unknown:
            return _bad(
                f"Unrecognized request argument supplied: {unknown[0][:100]}.", unknown[0][:100], "unknown_parameter"
            )
        endpoint, window = document.get("endpoint"), document.get("completion_window")
        if endpoint not in ENDPOINTS:
            return _bad(f"endpoint must be one of {', '.join(ENDPOINTS)}.", "endpoint")
        if window != COMPLETION_WINDOW:
            return _bad(f"completion_window must be {COMPLETION_WINDOW!r}.", "completion_window")
        metadata = document.get("metadata")
        if metadata is not None and not _valid_metadata(metadata):
            return _bad(
                f"metadata holds at most {MAX_METADATA} string pairs (keys up to 64 characters, values up to 512).",
                "metadata",
            )
        file_id = document.get("input_file_id")
        record = await self.store.file(file_id, key.tenant) if isinstance(file_id, str) else None
        if record is None or record.purpose != "batch":
            return _not_found("file", file_id)
        grants = await self.admitter.adapter_grants(key, None, listing=True)
        if isinstance(grants, errors.Refusal):
            return errors.response_for(grants)
        # The lines are checked with the key's effective adapter grants (its own, else its tenant's);
        # each line is admitted again when it runs, with the grants of that moment.
        lines_key = key.model_copy(update={"allowed_adapters": grants})
        async with self.runner.memory.holding(COPIES_IN_MEMORY * record.bytes, CREATE_MEMORY_WAIT_S):
            content = await self.storage.get(record.id)
            checked = await asyncio.to_thread(check_input, content, endpoint, lines_key, self.settings)
            del content
        refusal = await self._over_budget(checked, key)
        if refusal is not None:
            return refusal
        created = now()
        batch = BatchRecord(
            id=new_batch_id(),
            tenant=key.tenant,
            key_id=key.key_id,
            endpoint=endpoint,
            input_file_id=record.id,
            status="validating",
            created_at=created,
            expires_at=created + int(self.policy.completion_window_s),
            seq=await self.store.next_seq(),
            metadata=metadata,
            input_bytes=record.bytes,
            footprint=redis_footprint(checked),
        )
        refused, count, size = await self.store.create(batch, self._caps())
        if refused:
            return _over_cap(refused, count, size, batch.footprint, self.policy)
        # Now, not at the next sweep, and without checking the file again.
        task = asyncio.create_task(self.runner.prepare_soon(batch.id, checked))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return JSONResponse(batch.api((0, 0)))

    def _caps(self) -> Caps:
        policy = self.policy
        return Caps(
            tenant_batches=policy.max_active_batches_per_tenant,
            tenant_bytes=policy.max_queued_bytes_per_tenant,
            gateway_batches=policy.max_active_batches,
            gateway_bytes=policy.max_queued_bytes,
        )

    async def _over_budget(self, checked: CheckedInput, key: KeyRecord) -> JSONResponse | None:
        """The 429 for a batch that cannot complete within what its key or tenant has left today
        or this month (batch.quota); None when it may (or the file fails validation anyway: it
        fails as a batch)."""
        if checked.problems or not checked.lines:
            return None
        left = await budget_left(self.store.redis, key, self.settings, datetime.now(UTC))
        short = shortfall(batch_need(checked, self.settings), left)
        if short is None:
            return None
        return errors.openai_error(
            429, short.message, "tokens", code=short.code, param="input_file_id", headers={"x-should-retry": "false"}
        )

    async def batches_retrieve(self, request: Request, route: ApiRoute, key: KeyRecord) -> Response:
        record = await self.store.batch(str(route.resource), key.tenant)
        if record is None:
            return _not_found("batch", route.resource)
        return JSONResponse(record.api(await self.store.counts(record.id)))

    async def batches_list(self, request: Request, route: ApiRoute, key: KeyRecord) -> Response:
        limit = _limit(request.query_params.get("limit"), PAGE_DEFAULT, PAGE_MAX)
        if limit is None:
            return _bad(f"limit must be an integer from 1 to {PAGE_MAX}.", "limit")
        records, has_more = await self.store.page(key.tenant, request.query_params.get("after"), limit)
        return _page([r.api(await self.store.counts(r.id)) for r in records], has_more)

    async def batches_cancel(self, request: Request, route: ApiRoute, key: KeyRecord) -> Response:
        batch_id = str(route.resource)
        record = await self.store.batch(batch_id, key.tenant)
        if record is None:
            return _not_found("batch", route.resource)
        if await self.store.transition(
            batch_id, ("validating", "in_progress"), status="cancelling", cancelling_at=now()
        ):
            record = await self.store.batch(batch_id, key.tenant)
            assert record is not None
        elif record.status not in ("cancelling", "cancelled"):
            return errors.openai_error(
                409,
                f"Cannot cancel a batch with status {record.status!r}.",
                errors.INVALID_REQUEST,
                code="batch_not_cancellable",
            )
        return JSONResponse(record.api(await self.store.counts(batch_id)))

    async def aclose(self) -> None:
        for task in list(self._background):
            task.cancel()


def _limit(raw: str | None, default: int, most: int) -> int | None:
    """A list's `limit` query parameter: up to 6 ASCII digits (no sign, space, exponent or
    Unicode digit, which int() would refuse or read), 1..most."""
    if raw is None:
        return default
    return int(raw) if len(raw) <= 6 and raw.isascii() and raw.isdigit() and 1 <= int(raw) <= most else None


def _page(data: list[dict[str, Any]], has_more: bool) -> JSONResponse:
    """An OpenAI cursor page: the SDK asks for the next with `after=last_id` while `has_more`."""
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }
    )


def _valid_metadata(metadata: Any) -> bool:
    return (
        isinstance(metadata, dict)
        and len(metadata) <= MAX_METADATA
        and all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items()
        )
    )


async def _read_counted(request: Request, limit: int, hold: Hold) -> bytes | None:
    """The body (None past `limit`), each chunk counted in `hold` as it arrives, times the copies
    parsing and checking make: a slow sender holds only what it sent. MemoryBusy when the
    process's Batch API memory has no room for it (refused now: waiting would hold what it sent)."""

    def count(chunk: bytes, size: int) -> None:
        if not hold.grow(COPIES_IN_MEMORY * len(chunk)):
            raise MemoryBusy(f"no room for {size} bytes of upload")

    return await read_body_within(request, limit, on_chunk=count)


def _over_cap(refused: str, count: int, size: int, footprint: int, policy: Any) -> JSONResponse:
    """The answer to a batch a cap refused: the tenant's own caps are 429 (its batches must end
    first), the gateway's are 503 (everyone's batches fill it; retry later)."""
    if refused == "tenant_batches":
        return errors.openai_error(
            429,
            f"This tenant has {count} batches not yet finished, the most it may have "
            f"(gateway.batch.max_active_batches_per_tenant). Wait for one to end or cancel one.",
            "requests",
            code="too_many_active_batches",
            headers={"x-should-retry": "false"},
        )
    if refused == "tenant_bytes":
        return errors.openai_error(
            429,
            f"The batch's lines need {footprint} bytes of queue; this tenant's unfinished batches hold {size} of "
            f"the {policy.max_queued_bytes_per_tenant} it may use (gateway.batch.max_queued_bytes_per_tenant). "
            "Wait for a batch to end, or split this one.",
            "requests",
            code="batch_queue_full",
            headers={"x-should-retry": "false"},
        )
    return errors.openai_error(
        503,
        "The gateway's batch queue is full (gateway.batch.max_active_batches / max_queued_bytes). Please retry later.",
        errors.SERVER_ERROR,
        code="batch_capacity_full",
        headers={"Retry-After": "60"},
    )


def batches_unavailable(why: str) -> errors.Refusal:
    return errors.refusal(404, f"This gateway serves no Batch API: {why}", errors.INVALID_REQUEST, code="unknown_url")
