"""The usage ledger: tokens billed per tenant, key, model and UTC day, kept in Redis for showback.

One Redis hash per tenant and day, written by the settle script in the same step that settles
a request's limits (so the ledger and the limits can never disagree about a request):

    llmstack:{tenant:<tenant>}:usage:<YYYY-MM-DD>     (<tenant> percent-encoded)
        <key_id>|prompt|<model>       prompt tokens billed
        <key_id>|completion|<model>   completion tokens billed
        <key_id>|requests|<model>     requests billed (with at least one token)
        <key_id>|overhead_prompt|<model>      tokens prefilled again to resume this key's streams
        <key_id>|overhead_completion|<model>  tokens generated again at a resumed stream's seam

The overhead fields are the platform's cost, never the tenant's bill (serving.gateway.resume:
a continuation re-reads the prompt and the answer so far on another replica): `llmctl cost`
lists them per model as one `overhead` line, apart from the tenants' rows.

The `{tenant:...}` hash tag is the one the limiter's tenant and key counters carry, so the
settle script touches a single Redis Cluster slot. `<model>` is the metrics label (a served
model name, or `other`), so a caller cannot create fields at will; it comes last in the field
because it is the only part that may contain `|`.

Retention: each day's hash expires `RETENTION_DAYS` after the day ends (long enough to report
on the two calendar months before the current one). Fields per day: keys x models x 3, about
60 bytes each. Export older months with `llmctl cost report --month ... --csv`.

The day is the gateway's UTC date when it settles (the caller passes the key): a request
settled at midnight lands on one side of it, which is all a daily ledger needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from functools import lru_cache
from urllib.parse import quote, unquote

from serving.gateway.redis.scripts import lua

RETENTION_DAYS = 100
KINDS = ("prompt", "completion", "requests", "overhead_prompt", "overhead_completion")
_TAG_PREFIX = "llmstack:{tenant:"
_USAGE = ":usage:"

# Adds one settled request to its day's hash. All arguments are strings (ARGV values): Redis
# would print a Lua number above 1e14 in exponent notation, which HINCRBY refuses.
LEDGER_LUA = lua("serving.gateway.limits", "usage_ledger.lua")


@lru_cache(maxsize=4096)  # every admission and settlement names several keys of its tenant
def tenant_tag(tenant: str) -> str:
    """`llmstack:{tenant:<tenant>}`: the hash tag of every Redis key of one tenant. Percent-
    encoding keeps a tenant name from closing the tag or reaching another tenant's keys."""
    return f"{_TAG_PREFIX}{quote(tenant, safe='')}}}"


def usage_key(tenant: str, day: date) -> str:
    return f"{tenant_tag(tenant)}{_USAGE}{day.isoformat()}"


def day_pattern(day: date) -> str:
    """SCAN pattern for every tenant's hash of one day."""
    return f"{_TAG_PREFIX}*}}{_USAGE}{day.isoformat()}"


@lru_cache(maxsize=64)  # once a day, not once a request
def expire_at(day: date) -> int:
    """Epoch seconds when the day's hash is dropped: `RETENTION_DAYS` after the day ends."""
    end = datetime.combine(day + timedelta(days=1), time(), tzinfo=UTC)
    return int((end + timedelta(days=RETENTION_DAYS)).timestamp())


def utc_day(moment: datetime) -> date:
    return moment.astimezone(UTC).date()


def record_call(
    tenant: str,
    key_id: str,
    model: str,
    prompt: int,
    completion: int,
    moment: datetime,
    *,
    overhead: tuple[int, int] = (0, 0),
) -> tuple[list[str], list[str]]:
    """(KEYS, ARGV) for `ledger_record` of one settled request: the settle script appends the
    key to its KEYS and the values to its ARGV, and calls ledger_record with them. `overhead`:
    the (prompt, completion) tokens a resumed stream had done again, the platform's."""
    day = utc_day(moment)
    values = [key_id, model, str(int(prompt)), str(int(completion)), str(expire_at(day))]
    return [usage_key(tenant, day)], [*values, str(int(overhead[0])), str(int(overhead[1]))]


@dataclass(frozen=True)
class DailyUsage:
    """One key's use of one model on one UTC day."""

    day: date
    tenant: str
    key_id: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    requests: int
    overhead_prompt_tokens: int = 0  # the platform's: re-done work of this key's resumed streams
    overhead_completion_tokens: int = 0


def parse_usage_key(name: str) -> tuple[str, date] | None:
    """(tenant, day) of a ledger hash name; None for any other key."""
    if not name.startswith(_TAG_PREFIX) or _USAGE not in name:
        return None
    tag_end = name.find("}", len(_TAG_PREFIX))
    if tag_end < 0 or not name[tag_end + 1 :].startswith(_USAGE):
        return None
    try:
        day = date.fromisoformat(name[tag_end + 1 + len(_USAGE) :])
    except ValueError:
        return None
    return unquote(name[len(_TAG_PREFIX) : tag_end]), day


def parse_usage_hash(tenant: str, day: date, fields: Mapping[str | bytes, str | bytes | int]) -> list[DailyUsage]:
    """The rows of one day's hash (HGETALL), one per key and model; unknown fields are skipped."""
    counts: dict[tuple[str, str], dict[str, int]] = {}
    for raw_field, raw_value in fields.items():
        field = raw_field.decode() if isinstance(raw_field, bytes) else raw_field
        key_id, _, rest = field.partition("|")
        kind, _, model = rest.partition("|")
        if not key_id or kind not in KINDS:
            continue
        counts.setdefault((key_id, model), dict.fromkeys(KINDS, 0))[kind] += int(raw_value)
    return [
        DailyUsage(
            day=day,
            tenant=tenant,
            key_id=key_id,
            model=model,
            prompt_tokens=c["prompt"],
            completion_tokens=c["completion"],
            requests=c["requests"],
            overhead_prompt_tokens=c["overhead_prompt"],
            overhead_completion_tokens=c["overhead_completion"],
        )
        for (key_id, model), c in sorted(counts.items())
    ]
