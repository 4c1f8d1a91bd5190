"""Batch state and the work queue in Redis.

    llmstack:{file:<id>}              FileRecord JSON (the bytes are in storage.py's storage)
    llmstack:{batch:<id>}             hash: BatchRecord, one JSON value per field, and `running`
    llmstack:{batch:<id>}:ids         list: every custom_id in file order (the output files' order)
    llmstack:{batch:<id>}:done        hash custom_id -> output line (2xx answers)
    llmstack:{batch:<id>}:failed      hash custom_id -> error line (anything else)
    llmstack:{batch:<id>}:lock        who validates or finalizes it now (SET NX with an expiry)
    llmstack:batches:tenant:<tenant>  sorted set of the tenant's batch ids by creation order
    llmstack:batches:active           set of batches not yet in a final status (the sweeper's list)
    llmstack:{batches:work}:lines:<id>       stream of the batch's lines to run (consumer group `workers`):
                                             each a custom_id and where its body is in the batch's lines
                                             file in storage (`lines_name`), never the body itself
    llmstack:{batches:work}:later            sorted set: lines put back until a time (ms), rate-limited
    llmstack:{batches:work}:tenants          sorted set: tenants with lines waiting, by their last turn
    llmstack:{batches:work}:tenant:<tenant>  sorted set: that tenant's batches with lines waiting, by last turn
    llmstack:{batches:work}:turn             counter of turns (the scores above)
    llmstack:{batches:work}:bell             stream of one entry, added to when lines are enqueued (wakes workers)

Fair turns: each batch has a stream of its own, and a worker takes one line per claim, from the
tenant whose turn is oldest and that tenant's batch whose turn is oldest (CLAIM_LUA); both then
go to the back. So tenants with lines waiting take turns, then their batches do: a 3-line batch
created behind a 50,000-line one runs alongside it instead of after it. A batch leaves the
rotation when a claim finds nothing new in its stream, and its stream is deleted when it is retired.

Put back, not waited for: a line its key's rate limit refused goes to `later` with the time it
may run again, and its worker takes the next line; the first claim after that time puts it back
in its batch's stream (CLAIM_LUA). So no worker ever sleeps on one tenant's limits.

Bounded: store.ADMIT_LUA creates a batch only within the caps on active batches and on the Redis
bytes their lines hold (serving.gateway.batch.quota), per tenant and for all tenants. A batch's
custom ids and results leave Redis when it ends (they are in its output files then); its record
stays until retention_days.

Exactly once: a line's result is written with one script that refuses a custom_id already in
`done` or `failed`, so a line run twice (its worker died after sending it; a duplicate stream
entry) still has one result, and the output and error files are built from these hashes at the
end. Each batch's keys share one hash tag, so every script on them touches one Redis Cluster slot;
the work queue's keys share `{batches:work}`. CLAIM_LUA names the streams and tenant sets it
visits itself, not in KEYS: fine on the one Redis the stack runs (not Cluster), and all in that slot.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from serving.gateway.batch.objects import BatchRecord, FileRecord
from serving.gateway.redis.scripts import lua

WORK = "llmstack:{batches:work}"
WORK_GROUP = "workers"
WORK_TENANTS = f"{WORK}:tenants"
WORK_TURN = f"{WORK}:turn"
WORK_BELL = f"{WORK}:bell"
WORK_LATER = f"{WORK}:later"
# Before batches took turns, every line was in this one stream; a gateway moves what an earlier
# version left there to the batches' own streams (`adopt_legacy_lines`), under a lock.
LEGACY_STREAM = "llmstack:batches:work"
ACTIVE = "llmstack:batches:active"
SEQUENCE = "llmstack:batches:seq"

# Create a batch within the caps, counting the active batches (and the Redis bytes their lines
# hold, `footprint`) of its tenant and of all tenants: {refused cap or '', count, bytes}.
# KEYS: active set, the new batch's hash, its tenant's index. ARGV: tenant (JSON, as stored),
# footprint, tenant's most batches, tenant's most bytes, all tenants' most batches, most bytes,
# batch id, seq, the batch key prefix, then field/value pairs. It reads the active batches'
# hashes by name (one Redis, not Cluster, as CLAIM_LUA).
ADMIT_LUA = lua("serving.gateway.batch", "admit.lua")
# Change fields only while the status is one of ARGV[2..ARGV[1]+1] (JSON-encoded, as stored).
TRANSITION_LUA = lua("serving.gateway.batch", "transition.lua")
# One result per custom_id: {written (0|1), completed, failed}. None once the batch is final:
# its results are in its files then, and a late worker must not bring the hashes back.
RECORD_LUA = lua("serving.gateway.batch", "record.lua")
# The batch (and its tenant) join the rotation once its lines are in its stream, and the bell rings.
# A claim that found the stream empty and dropped the batch (CLAIM_LUA, atomic) ran either before
# this (which adds it back) or after the lines were taken: no line is left out of the rotation.
READY_LUA = lua("serving.gateway.batch", "ready.lua")
# One new line from the batch whose turn it is: {batch, entry id, fields}; or {'', the bell's last
# entry id} when no batch has one. A tenant or batch with nothing left leaves the rotation, so each
# pass of the loop returns or removes one member: it ends.
# Lines put back whose time has come (`later`) go first to the end of their batch's stream (unless
# the batch was retired: no stream), and the batch and tenant back into the rotation.
# KEYS: tenants, turn, bell, later; ARGV: group, consumer, the work keys' prefix.
CLAIM_LUA = lua("serving.gateway.batch", "claim.lua")
DELETE_EMPTY_LUA = lua("serving.gateway.batch", "delete_empty.lua")
RENEW_LUA = lua("serving.gateway.batch", "renew.lua")
RELEASE_LUA = lua("serving.gateway.batch", "release.lua")


def now() -> int:
    return int(time.time())


def file_key(file_id: str) -> str:
    return f"llmstack:{{file:{file_id}}}"


def batch_key(batch_id: str, part: str = "") -> str:
    return f"llmstack:{{batch:{batch_id}}}" + (f":{part}" if part else "")


def tenant_batches_key(tenant: str) -> str:
    return f"llmstack:batches:tenant:{tenant}"


def work_key(batch_id: str) -> str:
    """The stream of the batch's lines waiting or running (consumer group WORK_GROUP)."""
    return f"{WORK}:lines:{batch_id}"


def tenant_work_key(tenant: str) -> str:
    return f"{WORK}:tenant:{tenant}"


def lines_name(batch_id: str) -> str:
    """The batch's checked request bodies in storage, one after another; stream entries point into it."""
    return f"{batch_id}.lines"


def tenant_files_key(tenant: str) -> str:
    return f"llmstack:files:tenant:{tenant}"


@dataclass(frozen=True)
class Caps:
    """Most active batches, and most Redis bytes their lines hold, per tenant and for all tenants."""

    tenant_batches: int = 2**31
    tenant_bytes: int = 2**62
    gateway_batches: int = 2**31
    gateway_bytes: int = 2**62


def _encode(record: BatchRecord, fields: set[str] | None = None) -> dict[str, str]:
    values = record.model_dump(mode="json", include=fields)
    return {name: json.dumps(value) for name, value in values.items()}


class BatchStore:
    """Records, results and the work queue; `redis` is a redis.asyncio client with decode_responses."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self._transition = redis.register_script(TRANSITION_LUA)
        self._record = redis.register_script(RECORD_LUA)
        self._release = redis.register_script(RELEASE_LUA)
        self._renew = redis.register_script(RENEW_LUA)
        self._ready = redis.register_script(READY_LUA)
        self._claim = redis.register_script(CLAIM_LUA)
        self._delete_empty = redis.register_script(DELETE_EMPTY_LUA)
        self._admit = redis.register_script(ADMIT_LUA)

    # --- files -------------------------------------------------------------------------

    async def put_file(self, record: FileRecord) -> None:
        """Store the record and list it under its tenant, in creation order (a file stored again,
        as a batch's result when a finalize is retried, keeps its place)."""
        expiry = {} if record.expires_at is None else {"exat": record.expires_at}
        seq = await self.next_seq()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(file_key(record.id), record.model_dump_json(), **expiry)
            pipe.zadd(tenant_files_key(record.tenant), {record.id: seq}, nx=True)
            await pipe.execute()

    async def file(self, file_id: str, tenant: str) -> FileRecord | None:
        """The file if it exists and belongs to `tenant`: another tenant's file does not exist for it."""
        raw = await self.redis.get(file_key(file_id))
        record = None if raw is None else FileRecord.model_validate_json(raw)
        return record if record is not None and record.tenant == tenant else None

    async def delete_file(self, record: FileRecord) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(file_key(record.id))
            pipe.zrem(tenant_files_key(record.tenant), record.id)
            await pipe.execute()

    async def file_page(
        self, tenant: str, after: str | None, limit: int, *, newest_first: bool, purpose: str | None
    ) -> tuple[list[FileRecord], bool]:
        """The tenant's files (of `purpose`, if given) after the file `after` (OpenAI's cursor); has_more."""
        return await self._page(
            tenant_files_key(tenant),
            lambda file_id: self.file(file_id, tenant),
            after,
            limit,
            newest_first=newest_first,
            keep=lambda record: purpose is None or record.purpose == purpose,
        )

    # --- batches -----------------------------------------------------------------------

    async def next_seq(self) -> int:
        return int(await self.redis.incr(SEQUENCE))

    async def create(self, record: BatchRecord, caps: Caps | None = None) -> tuple[str, int, int]:
        """Create the batch unless a cap refuses it: ('', ...) when created, else (the cap that
        refused: tenant_batches, tenant_bytes, gateway_batches, gateway_bytes; the active
        batches and bytes it counted)."""
        caps = caps or Caps()
        fields = [value for pair in _encode(record).items() for value in pair]
        refused, count, size = await self._admit(
            keys=[ACTIVE, batch_key(record.id), tenant_batches_key(record.tenant)],
            args=[
                json.dumps(record.tenant),
                record.footprint,
                caps.tenant_batches,
                caps.tenant_bytes,
                caps.gateway_batches,
                caps.gateway_bytes,
                record.id,
                record.seq,
                "llmstack:{batch:",
                *fields,
            ],
        )
        return refused, int(count), int(size)

    async def batch(self, batch_id: str, tenant: str | None = None) -> BatchRecord | None:
        """The batch; with `tenant`, only if it is that tenant's."""
        raw = await self.redis.hgetall(batch_key(batch_id))
        if "status" not in raw:  # none, or only a stray `running` count left after its records expired
            return None
        record = BatchRecord.model_validate({name: json.loads(value) for name, value in raw.items()})
        return record if tenant is None or record.tenant == tenant else None

    async def status(self, batch_id: str) -> str | None:
        raw = await self.redis.hget(batch_key(batch_id), "status")
        return None if raw is None else json.loads(raw)

    async def counts(self, batch_id: str) -> tuple[int, int]:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hlen(batch_key(batch_id, "done"))
            pipe.hlen(batch_key(batch_id, "failed"))
            done, failed = await pipe.execute()
        return int(done), int(failed)

    async def transition(self, batch_id: str, allowed: tuple[str, ...], **fields: Any) -> bool:
        """Set `fields` only while the batch's status is one of `allowed`, atomically."""
        args: list[str] = [str(len(allowed)), *(json.dumps(status) for status in allowed)]
        for name, value in fields.items():
            args += [
                name,
                json.dumps(
                    value.model_dump(mode="json")
                    if hasattr(value, "model_dump")
                    else [v.model_dump(mode="json") for v in value]
                    if isinstance(value, list)
                    else value
                ),
            ]
        return bool(await self._transition(keys=[batch_key(batch_id)], args=args))

    async def page(self, tenant: str, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """The tenant's batches, newest first, after the batch `after` (OpenAI's cursor); has_more."""
        return await self._page(tenant_batches_key(tenant), lambda batch_id: self.batch(batch_id, tenant), after, limit)

    async def _page(
        self,
        key: str,
        load: Callable[[str], Awaitable[Any]],
        after: str | None,
        limit: int,
        *,
        newest_first: bool = True,
        keep: Callable[[Any], bool] = lambda record: True,
    ) -> tuple[list[Any], bool]:
        """Records of the index `key` (ids scored by creation) that `keep` accepts, after the id
        `after`, up to `limit`; and whether more follow. Ids whose records expired (after
        retention_days) leave the index as the listing meets them."""
        bound = "+inf" if newest_first else "-inf"
        if after is not None:
            score = await self.redis.zscore(key, after)
            if score is None:
                return [], False
            bound = f"({int(score)}"
        found: list[Any] = []
        while True:
            if newest_first:
                ids = await self.redis.zrevrangebyscore(key, bound, "-inf", start=0, num=limit + 1, withscores=True)
            else:
                ids = await self.redis.zrangebyscore(key, bound, "+inf", start=0, num=limit + 1, withscores=True)
            gone = []
            for item_id, _ in ids:
                record = await load(item_id)
                if record is None:
                    gone.append(item_id)
                elif keep(record):
                    found.append(record)
                    if len(found) > limit:
                        break
            if gone:
                await self.redis.zrem(key, *gone)
            if len(found) > limit or len(ids) <= limit:
                return found[:limit], len(found) > limit
            bound = f"({int(ids[-1][1])}"

    async def keep_until(self, batch_id: str, expires_at: int) -> None:
        """A finished batch's record is deleted at `expires_at` (its results were in Redis only
        until its files were written: `retire` deleted them)."""
        await self.redis.expireat(batch_key(batch_id), expires_at)

    async def active(self) -> list[str]:
        return sorted(await self.redis.smembers(ACTIVE))

    async def retire(self, batch_id: str, tenant: str | None = None) -> None:
        """The batch is done with (final, or its records gone): off the sweeper's list, its lines'
        stream, custom ids and results deleted (a final batch's are in its files) and, with its
        `tenant`, out of the rotation (else a claim drops it there)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.srem(ACTIVE, batch_id)
            pipe.delete(
                work_key(batch_id),
                batch_key(batch_id, "ids"),
                batch_key(batch_id, "done"),
                batch_key(batch_id, "failed"),
            )
            if tenant is not None:
                pipe.zrem(tenant_work_key(tenant), batch_id)
            await pipe.execute()

    # --- locks (validation, finalization) ----------------------------------------------

    async def lock(self, batch_id: str, owner: str, ttl_s: float) -> bool:
        return bool(await self.redis.set(batch_key(batch_id, "lock"), owner, nx=True, px=int(ttl_s * 1000)))

    async def renew(self, batch_id: str, owner: str, ttl_s: float) -> bool:
        return bool(await self._renew(keys=[batch_key(batch_id, "lock")], args=[owner, int(ttl_s * 1000)]))

    async def unlock(self, batch_id: str, owner: str) -> None:
        await self._release(keys=[batch_key(batch_id, "lock")], args=[owner])

    # --- lines -------------------------------------------------------------------------

    async def set_ids(self, batch_id: str, custom_ids: list[str]) -> None:
        key = batch_key(batch_id, "ids")
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            for start in range(0, len(custom_ids), 1000):
                pipe.rpush(key, *custom_ids[start : start + 1000])
            await pipe.execute()

    async def ids(self, batch_id: str) -> list[str]:
        custom_ids: list[str] = await self.redis.lrange(batch_key(batch_id, "ids"), 0, -1)
        return custom_ids

    async def enqueue(self, batch_id: str, tenant: str, lines: list[dict[str, str]]) -> None:
        """Add lines (their stream fields: custom_id and where the body is) to the batch's
        stream, then the batch to the rotation. Run
        again after a crash it adds them twice; a line already answered is skipped, and `record`
        keeps one answer."""
        from redis.exceptions import ResponseError

        if not lines:
            return
        try:
            await self.redis.xgroup_create(work_key(batch_id), WORK_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        for start in range(0, len(lines), 500):
            async with self.redis.pipeline(transaction=False) as pipe:
                for fields in lines[start : start + 500]:
                    pipe.xadd(work_key(batch_id), fields)
                await pipe.execute()
        await self._ready(keys=[WORK_TURN, tenant_work_key(tenant), WORK_TENANTS, WORK_BELL], args=[batch_id, tenant])

    async def claim(self, consumer: str) -> tuple[tuple[str, str, dict[str, str]] | None, str]:
        """A new line, from the batch whose turn it is: ((batch id, entry id, fields), ""); or
        (None, the bell's last entry id) when none waits, for `wait_for_lines`."""
        found = await self._claim(
            keys=[WORK_TENANTS, WORK_TURN, WORK_BELL, WORK_LATER], args=[WORK_GROUP, consumer, WORK]
        )
        if not found[0]:
            return None, found[1]
        batch_id, entry_id, flat = found
        return (batch_id, entry_id, dict(zip(flat[::2], flat[1::2], strict=True))), ""

    async def wait_for_lines(self, bell: str, block_ms: int) -> None:
        """Until lines are enqueued after the bell's entry `bell`, or `block_ms` passed."""
        await self.redis.xread({WORK_BELL: bell}, count=1, block=block_ms)

    async def reclaim(
        self, consumer: str, batch_ids: list[str], idle_ms: int
    ) -> tuple[str, str, dict[str, str]] | None:
        """A line of one of `batch_ids` whose worker has not renewed its claim for `idle_ms` (it
        died), now `consumer`'s: (batch id, entry id, fields)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for batch_id in batch_ids:
                pipe.xpending_range(work_key(batch_id), WORK_GROUP, "-", "+", 1, idle=idle_ms)
            pending = await pipe.execute(raise_on_error=False)  # a batch without a stream: an error
        for batch_id, found in zip(batch_ids, pending, strict=True):
            if isinstance(found, list) and found:
                _, claimed, gone = await self.redis.xautoclaim(
                    work_key(batch_id), WORK_GROUP, consumer, idle_ms, start_id="0-0", count=1
                )
                if gone:
                    await self.redis.xack(work_key(batch_id), WORK_GROUP, *gone)
                if claimed:
                    return batch_id, claimed[0][0], claimed[0][1]
        return None

    async def adopt_legacy_lines(self, owner: str) -> int:
        """Move the lines of active batches out of LEGACY_STREAM into their own streams, and drop
        the rest (batches already final); then the stream itself. Lines an earlier gateway still
        runs may run again here: `record` keeps one answer. How many lines moved."""
        if not await self.redis.exists(LEGACY_STREAM) or not await self.redis.set(
            f"{LEGACY_STREAM}:adopting", owner, nx=True, px=60_000
        ):
            return 0
        moved = 0
        try:
            while entries := await self.redis.xrange(LEGACY_STREAM, count=500):
                active = set(await self.redis.smembers(ACTIVE))
                lines: dict[tuple[str, str], list[dict[str, str]]] = {}
                for _, fields in entries:
                    line = tuple(fields.get(name) for name in ("batch", "tenant", "custom_id", "body"))
                    if None not in line and line[0] in active:
                        lines.setdefault((line[0], line[1]), []).append({"custom_id": line[2], "body": line[3]})
                for (batch_id, tenant), todo in lines.items():
                    await self.enqueue(batch_id, tenant, todo)
                    moved += len(todo)
                await self.redis.xdel(LEGACY_STREAM, *(entry_id for entry_id, _ in entries))
            await self._delete_empty(keys=[LEGACY_STREAM])  # unless an earlier gateway added lines since
        finally:
            await self._release(keys=[f"{LEGACY_STREAM}:adopting"], args=[owner])
        return moved

    async def put_back(
        self, batch_id: str, tenant: str, entry_id: str, fields: dict[str, str], not_before_ms: int
    ) -> None:
        """The line runs again from `not_before_ms` (epoch, Redis's clock), at the end of its
        batch's stream; its entry now is done with (the caller's `line_done`)."""
        member = json.dumps(
            {"batch": batch_id, "tenant": tenant, "entry": entry_id, "fields": fields},
            separators=(",", ":"),
            sort_keys=True,
        )
        await self.redis.zadd(WORK_LATER, {member: not_before_ms})

    async def clock_ms(self) -> int:
        seconds, micros = await self.redis.time()
        return int(seconds) * 1000 + int(micros) // 1000

    async def renew_line(self, batch_id: str, consumer: str, entry_id: str) -> None:
        """Still running it: the line's idle time starts again (XCLAIM ... JUSTID)."""
        await self.redis.xclaim(work_key(batch_id), WORK_GROUP, consumer, 0, [entry_id], justid=True)

    async def line_done(self, batch_id: str, entry_id: str) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xack(work_key(batch_id), WORK_GROUP, entry_id)
            pipe.xdel(work_key(batch_id), entry_id)
            await pipe.execute()

    async def lines_waiting(self, batch_id: str) -> int:
        """Lines of the batch no worker has taken yet (processed lines leave the stream)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xlen(work_key(batch_id))
            pipe.xpending(work_key(batch_id), WORK_GROUP)
            length, pending = await pipe.execute(raise_on_error=False)
        if not isinstance(length, int) or not isinstance(pending, dict):
            return 0
        return max(0, length - int(pending.get("pending", 0)))

    async def consumers(self, batch_id: str) -> list[dict[str, Any]]:
        from redis.exceptions import ResponseError

        try:
            consumers: list[dict[str, Any]] = await self.redis.xinfo_consumers(work_key(batch_id), WORK_GROUP)
            return consumers
        except ResponseError:  # no stream (not enqueued yet, or retired)
            return []

    async def forget_consumer(self, batch_id: str, consumer: str) -> None:
        await self.redis.xgroup_delconsumer(work_key(batch_id), WORK_GROUP, consumer)

    async def running(self, batch_id: str, delta: int) -> int:
        """Lines of the batch being sent now (a worker that dies leaves its count behind: callers
        wait for zero at most lease_s)."""
        return int(await self.redis.hincrby(batch_key(batch_id), "running", delta))

    async def begin(self, batch_id: str, custom_id: str) -> tuple[str | None, bool]:
        """One round trip before a line is sent: the batch's status, whether the line has its
        answer already, and the line counted as running (the caller gives it back)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hget(batch_key(batch_id), "status")
            pipe.hexists(batch_key(batch_id, "done"), custom_id)
            pipe.hexists(batch_key(batch_id, "failed"), custom_id)
            pipe.hincrby(batch_key(batch_id), "running", 1)
            status, done, failed, _ = await pipe.execute()
        return (None if status is None else json.loads(status)), bool(done or failed)

    async def answered(self, batch_id: str, custom_id: str) -> bool:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hexists(batch_key(batch_id, "done"), custom_id)
            pipe.hexists(batch_key(batch_id, "failed"), custom_id)
            done, failed = await pipe.execute()
        return bool(done or failed)

    async def record(
        self, batch_id: str, custom_id: str, line: dict[str, Any], *, ok: bool, ends_running: bool = False
    ) -> tuple[bool, int, int]:
        """Keep `line` as the answer of `custom_id` unless it has one: (written, completed, failed).
        `ends_running`: in the same round trip, the line stops counting as running (see `begin`)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            await self._record(
                keys=[batch_key(batch_id), batch_key(batch_id, "done"), batch_key(batch_id, "failed")],
                args=["done" if ok else "failed", custom_id, json.dumps(line, separators=(",", ":"))],
                client=pipe,
            )
            if ends_running:
                pipe.hincrby(batch_key(batch_id), "running", -1)
            (written, done, failed), *_ = await pipe.execute()
        return bool(written), int(done), int(failed)

    async def results(self, batch_id: str) -> tuple[dict[str, str], dict[str, str]]:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(batch_key(batch_id, "done"))
            pipe.hgetall(batch_key(batch_id, "failed"))
            done, failed = await pipe.execute()
        return done, failed
