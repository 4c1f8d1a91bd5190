"""Batch state and the work stream in Redis.

    llmstack:{file:<id>}              FileRecord JSON (the bytes are in storage.py's storage)
    llmstack:{batch:<id>}             hash: BatchRecord, one JSON value per field, and `running`
    llmstack:{batch:<id>}:ids         list: every custom_id in file order (the output files' order)
    llmstack:{batch:<id>}:done        hash custom_id -> output line (2xx answers)
    llmstack:{batch:<id>}:failed      hash custom_id -> error line (anything else)
    llmstack:{batch:<id>}:lock        who validates or finalizes it now (SET NX with an expiry)
    llmstack:batches:tenant:<tenant>  sorted set of the tenant's batch ids by creation order
    llmstack:batches:active           set of batches not yet in a final status (the sweeper's list)
    llmstack:batches:work             stream of lines to run (consumer group `workers`)

Exactly once: a line's result is written with one script that refuses a custom_id already in
`done` or `failed`, so a line run twice (its worker died after sending it; a duplicate stream
entry) still has one result, and the output and error files are built from these hashes at the
end. Each batch's keys share one hash tag, so every script touches one Redis Cluster slot.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from serving.gateway.batch.objects import BatchRecord, FileRecord

WORK_STREAM = "llmstack:batches:work"
WORK_GROUP = "workers"
ACTIVE = "llmstack:batches:active"
SEQUENCE = "llmstack:batches:seq"

# Change fields only while the status is one of ARGV[2..ARGV[1]+1] (JSON-encoded, as stored).
TRANSITION_LUA = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return 0 end
local allowed = tonumber(ARGV[1])
local ok = false
for i = 2, allowed + 1 do
  if ARGV[i] == current then ok = true end
end
if not ok then return 0 end
for i = allowed + 2, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
return 1
"""
# One result per custom_id: {written (0|1), completed, failed}.
RECORD_LUA = """
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 or redis.call('HEXISTS', KEYS[3], ARGV[2]) == 1 then
  return {0, redis.call('HLEN', KEYS[2]), redis.call('HLEN', KEYS[3])}
end
if ARGV[1] == 'done' then
  redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
else
  redis.call('HSET', KEYS[3], ARGV[2], ARGV[3])
end
return {1, redis.call('HLEN', KEYS[2]), redis.call('HLEN', KEYS[3])}
"""
RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def now() -> int:
    return int(time.time())


def file_key(file_id: str) -> str:
    return f"llmstack:{{file:{file_id}}}"


def batch_key(batch_id: str, part: str = "") -> str:
    return f"llmstack:{{batch:{batch_id}}}" + (f":{part}" if part else "")


def tenant_batches_key(tenant: str) -> str:
    return f"llmstack:batches:tenant:{tenant}"


def tenant_files_key(tenant: str) -> str:
    return f"llmstack:files:tenant:{tenant}"


def _encode(record: BatchRecord, fields: set[str] | None = None) -> dict[str, str]:
    values = record.model_dump(mode="json", include=fields)
    return {name: json.dumps(value) for name, value in values.items()}


class BatchStore:
    """Records, results and the work stream; `redis` is a redis.asyncio client with decode_responses."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self._transition = redis.register_script(TRANSITION_LUA)
        self._record = redis.register_script(RECORD_LUA)
        self._release = redis.register_script(RELEASE_LUA)
        self._renew = redis.register_script(RENEW_LUA)

    async def ensure_group(self) -> None:
        from redis.exceptions import ResponseError

        try:
            await self.redis.xgroup_create(WORK_STREAM, WORK_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

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

    async def file_page(self, tenant: str, after: str | None, limit: int, *, newest_first: bool,
                        purpose: str | None) -> tuple[list[FileRecord], bool]:
        """The tenant's files (of `purpose`, if given) after the file `after` (OpenAI's cursor); has_more."""
        return await self._page(tenant_files_key(tenant), lambda file_id: self.file(file_id, tenant), after, limit,
                                newest_first=newest_first,
                                keep=lambda record: purpose is None or record.purpose == purpose)

    # --- batches -----------------------------------------------------------------------

    async def next_seq(self) -> int:
        return int(await self.redis.incr(SEQUENCE))

    async def create(self, record: BatchRecord) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(batch_key(record.id), mapping=_encode(record))
            pipe.zadd(tenant_batches_key(record.tenant), {record.id: record.seq})
            pipe.sadd(ACTIVE, record.id)
            await pipe.execute()

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
            args += [name, json.dumps(value.model_dump(mode="json") if hasattr(value, "model_dump") else
                                      [v.model_dump(mode="json") for v in value] if isinstance(value, list) else
                                      value)]
        return bool(await self._transition(keys=[batch_key(batch_id)], args=args))

    async def page(self, tenant: str, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """The tenant's batches, newest first, after the batch `after` (OpenAI's cursor); has_more."""
        return await self._page(tenant_batches_key(tenant), lambda batch_id: self.batch(batch_id, tenant), after,
                                limit)

    async def _page(self, key: str, load: Callable[[str], Awaitable[Any]], after: str | None, limit: int, *,
                    newest_first: bool = True, keep: Callable[[Any], bool] = lambda record: True
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
        """A finished batch's records (and results) are deleted at `expires_at`."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for part in ("", "ids", "done", "failed"):
                pipe.expireat(batch_key(batch_id, part), expires_at)
            await pipe.execute()

    async def active(self) -> list[str]:
        return sorted(await self.redis.smembers(ACTIVE))

    async def retire(self, batch_id: str) -> None:
        await self.redis.srem(ACTIVE, batch_id)

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
                pipe.rpush(key, *custom_ids[start:start + 1000])
            await pipe.execute()

    async def ids(self, batch_id: str) -> list[str]:
        return await self.redis.lrange(batch_key(batch_id, "ids"), 0, -1)

    async def enqueue(self, batch_id: str, tenant: str, lines: list[tuple[str, bytes]]) -> None:
        """Add (custom_id, body) lines to the work stream. Run again after a crash it adds them
        twice; a line already answered is skipped, and `record` keeps one answer."""
        for start in range(0, len(lines), 500):
            async with self.redis.pipeline(transaction=False) as pipe:
                for custom_id, body in lines[start:start + 500]:
                    pipe.xadd(WORK_STREAM, {"batch": batch_id, "tenant": tenant, "custom_id": custom_id,
                                            "body": body.decode()})
                await pipe.execute()

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

    async def record(self, batch_id: str, custom_id: str, line: dict[str, Any], *, ok: bool,
                     ends_running: bool = False) -> tuple[bool, int, int]:
        """Keep `line` as the answer of `custom_id` unless it has one: (written, completed, failed).
        `ends_running`: in the same round trip, the line stops counting as running (see `begin`)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            await self._record(keys=[batch_key(batch_id), batch_key(batch_id, "done"), batch_key(batch_id, "failed")],
                               args=["done" if ok else "failed", custom_id, json.dumps(line, separators=(",", ":"))],
                               client=pipe)
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
