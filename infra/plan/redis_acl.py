"""Redis ACL users: one for the gateway, one for Ray GCS, one for Serve's autoscaler, each
limited to its own keys and commands.

Ray pods run tenant-supplied input through vLLM, so a compromised Ray pod must not be able to
read, mint or un-revoke API keys. The gateway's key records, limiter state and usage all live
under `llmstack:` (serving.gateway.auth.keys, serving.gateway.limits.limiter); Ray GCS keeps everything in
`RAY<namespace>@<table>` hashes. Each user may touch only its own prefix.

Ray's user gets exactly the commands Ray's C++ GCS client issues (ray-project/ray,
src/ray/gcs/store_client/redis_store_client.cc and redis_context.cc):
  - connecting: AUTH (always allowed), INFO SENTINEL and INFO CLUSTER (what kind of Redis),
    DEL DUMMY (finds the primary; an error other than MOVED is fatal), hence key `DUMMY`;
  - the store: HSET, HSETNX, HGET, HMGET, HDEL, HSCAN, HEXISTS on `RAY<ns>@<table>`, INCRBY on
    `RAY<ns>@JobCounter`, PING for its health check;
  - KubeRay's Redis cleanup job (`RedisDelKeyPrefixSync`): SCAN MATCH `RAY<ns>@*`, then DEL (or
    UNLINK with RAY_redis_namespace_cleanup_use_unlink=1) each key.
The namespace is the RayCluster's UID (KubeRay sets RAY_external_storage_namespace), which a
NewCluster upgrade changes, so the pattern is `RAY*`; gateway keys never start with `RAY`.

The gateway's user gets every command outside `@dangerous` (no KEYS, FLUSHALL, CONFIG, DEBUG,
...) on `llmstack:*`: its own code evolves, and the boundary that matters is the key prefix. It
gets INFO back (in `@dangerous`): it reads `INFO memory` to export how full Redis is and whether
it would evict (serving.gateway.telemetry.redis_memory); Ray's user has INFO too.
It also publishes and subscribes on the fair queue's wake-up channels (serving.gateway.queue.fair_queue):
Redis 7 starts users with `resetchannels`, so without `&llmstack:fq:wake:*` the queue's script
fails on PUBLISH. Ray's user gets no channel.

Serve's controller (on the Ray head) gets a third user when a model scales on saturation
(serving.autoscaling.gateway_queue): it reads the gateway's fair queue figures for the model, and
nothing else. Exactly the commands `gateway_queue.read_figures` sends, ZCARD, HGET and GET (in one
non-transactional pipeline: no MULTI), on the fair queue's keys only. On connect redis-py sends
AUTH (always allowed: a user must be able to sign in) and, unless told not to, CLIENT SETINFO,
whose refusal it swallows; `gateway_queue` tells it not to, so nothing it sends is refused (and
nothing lands in `ACL LOG`). No HELLO: redis-py sends it only for RESP3, which the reader does
not ask for. The queue's keys share the hash tag `{fq:<model>}` (serving.gateway.queue.fair_queue,
serving.gateway.capacity.store); in a Redis glob `{` is an ordinary character (only `*`, `?`,
`[...]` and a backslash are special), so `llmstack:{fq:*` matches them and no API key, limiter, usage or
spend key (`llmstack:{key:...`, `llmstack:{tenant:...`, ...). Read-only and key-bound: a compromised
head learns queue sizes and, by HGET with a guessed field, whether a guessed tenant has state in a
queue; it lists nothing (no ZRANGE, HGETALL, SCAN) and changes nothing.

The same rules go into the in-cluster Redis ACL file and into ElastiCache RBAC access strings,
which spell the gateway's channels `&*`, the only channel form ElastiCache documents
(`access_string`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from serving.gateway.queue.fair_queue import CHANNEL_PREFIX

GATEWAY_USER = "llmstack-gateway"
RAY_USER = "llmstack-ray"
AUTOSCALER_USER = "llmstack-autoscaler"
GATEWAY_KEY_PATTERNS = ("llmstack:*",)
GATEWAY_CHANNEL_PATTERNS = (CHANNEL_PREFIX + "*",)
RAY_KEY_PATTERNS = ("RAY*", "DUMMY")
RAY_COMMANDS = (
    "ping",
    "info",
    "hset",
    "hsetnx",
    "hget",
    "hmget",
    "hdel",
    "hscan",
    "hexists",
    "incrby",
    "scan",
    "del",
    "unlink",
)

# The fair queue's keys all start with the hash tag `{fq:<model>}` (queue_keys, capacity_key).
FAIR_QUEUE_KEY_PATTERNS = ("llmstack:{fq:*",)
AUTOSCALER_COMMANDS = ("zcard", "hget", "get")  # gateway_queue.read_figures, and nothing else


@dataclass(frozen=True)
class AclUser:
    name: str
    key_patterns: tuple[str, ...]
    commands: str
    """Redis ACL command rules, e.g. `-@all +ping`."""
    channel_patterns: tuple[str, ...] = ()

    def rules(self) -> str:
        """The user's rules without its password: keys, pub/sub channels, then commands."""
        return " ".join(
            [*(f"~{p}" for p in self.key_patterns), *(f"&{p}" for p in self.channel_patterns), self.commands]
        )


def gateway_user(name: str = GATEWAY_USER) -> AclUser:
    return AclUser(
        name=name,
        key_patterns=GATEWAY_KEY_PATTERNS,
        channel_patterns=GATEWAY_CHANNEL_PATTERNS,
        commands="+@all -@dangerous +info",
    )


def ray_user(name: str = RAY_USER) -> AclUser:
    commands = "-@all " + " ".join(f"+{c}" for c in RAY_COMMANDS)
    return AclUser(name=name, key_patterns=RAY_KEY_PATTERNS, commands=commands)


def autoscaler_user(name: str = AUTOSCALER_USER) -> AclUser:
    commands = "-@all " + " ".join(f"+{c}" for c in AUTOSCALER_COMMANDS)
    return AclUser(name=name, key_patterns=FAIR_QUEUE_KEY_PATTERNS, commands=commands)


ELASTICACHE_ALL_CHANNELS = "&*"


def access_string(user: AclUser) -> str:
    """An ElastiCache RBAC access string: enabled, keys, channels, commands.

    Only the grammar ElastiCache documents ("Specifying Permissions Using an Access String",
    docs.aws.amazon.com/AmazonElastiCache/latest/dg/Clusters.RBAC.html#Access-string, in
    awsdocs/amazon-elasticache-docs): `on`/`off`, `~<key pattern>`, `+<command>`, `+@<category>`
    (and their `-` forms), and for channels only `&*` ("access is given to all available
    channels", Redis OSS 6.2+). A channel pattern such as `&llmstack:fq:wake:*` is not documented
    there, and an access string ElastiCache refuses fails `pulumi up` at CreateUser, so a user with
    channel patterns gets `&*` here. That widens nothing that matters: only the gateway's user has
    channels, and Ray's user has no pub/sub command at all. The in-cluster ACL file, read by a real
    redis-server, keeps the exact patterns (`acl_file`)."""
    channels = [ELASTICACHE_ALL_CHANNELS] if user.channel_patterns else []
    return " ".join(["on", *(f"~{p}" for p in user.key_patterns), *channels, user.commands])


def acl_file(passwords: dict[str, str], users: list[AclUser]) -> str:
    """A Redis ACL file (`aclfile`): the default user off, each user on with its password's SHA-256.

    Only hashes are written (`#<sha256>`), so the file itself never holds a password."""
    lines = ["user default off resetkeys -@all"]
    for user in users:
        digest = hashlib.sha256(passwords[user.name].encode()).hexdigest()
        lines.append(f"user {user.name} on #{digest} resetkeys resetchannels {user.rules()}")
    return "\n".join(lines) + "\n"
