"""The Redis ACL users, enforced by a real redis-server loading the ACL file we generate.

Written as the attack: Ray's user (what a compromised Ray pod holds) tries to read, mint and
un-revoke API keys and to wipe the store; the gateway's user tries to reach Ray's state; the
autoscaler's (what a compromised Ray head holds) tries to write, to read beyond the fair queue's
figures and to run scripts. All users then do their real work: the gateway's own key store and
limiter code, every command Ray's GCS client and KubeRay's cleanup job issue (infra.plan.redis_acl
lists them with their source), and the autoscaler's `read_figures` on its own client.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import subprocess
import threading
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path

import pytest
import redis

from infra.plan.redis_acl import (
    AUTOSCALER_COMMANDS,
    AUTOSCALER_USER,
    GATEWAY_USER,
    RAY_USER,
    access_string,
    acl_file,
    autoscaler_user,
    gateway_user,
    ray_user,
)
from infra.spec.stack_file import PROJECT_ROOT
from ops.devstack.local_redis import redis_server_path
from ops.harness.processes import die_with_parent, free_port
from serving.autoscaling.gateway_queue import connect, read_figures
from serving.gateway.auth.keys import RedisKeyStore, create_key_sync
from serving.gateway.capacity.store import capacity_key
from serving.gateway.config.gateway_policy import KeyLimits, TenantLimits
from serving.gateway.config.queue_policy import ModelQueue, QueuePolicy, QueueTier
from serving.gateway.limits.budgets import month_of, spend_key
from serving.gateway.limits.limiter import Limiter
from serving.gateway.limits.ticket import Who
from serving.gateway.limits.usage_ledger import usage_key
from serving.gateway.metering.usage_meter import Usage
from serving.gateway.queue.fair_queue import CHANNEL_PREFIX, FairQueue, QueueRefused, queue_keys
from tests.serving.autoscaling.test_gateway_queue import source, with_waiters
from tests.support.fair_queue import POLICY, fresh_model

# ElastiCache's documented access-string grammar (infra.plan.redis_acl.access_string has the source).
ELASTICACHE_DOCUMENTED = re.compile(r"on|off|~\S+|&\*|[+-]@?[a-z|_-]+")
PASSWORDS = {
    GATEWAY_USER: "gateway-secret-0123456789",
    RAY_USER: "ray-secret-0123456789",
    AUTOSCALER_USER: "autoscaler-secret-0123456789",
}
USERS = [gateway_user(), ray_user(), autoscaler_user()]
# Only in the test's ACL file: to read ACL LOG (what Redis refused, and to whom).
ADMIN, ADMIN_PASSWORD = "test-admin", "admin-secret-0123456789"
NAMESPACE = "864b004c-6305-42e3-ac46-adfa8eb6f752"  # a RayCluster UID, as KubeRay sets it
TABLE = f"RAY{NAMESPACE}@NODE"


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory):
    folder: Path = tmp_path_factory.mktemp("redis-acl")
    admin = f"user {ADMIN} on >{ADMIN_PASSWORD} ~* &* +@all\n"
    (folder / "users.acl").write_text(acl_file(PASSWORDS, USERS) + admin)
    port = free_port()
    process = subprocess.Popen(
        [
            redis_server_path(),
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(folder),
            "--aclfile",
            str(folder / "users.acl"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=die_with_parent,
    )
    try:
        client = redis.Redis(port=port, username=GATEWAY_USER, password=PASSWORDS[GATEWAY_USER])
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if process.poll() is not None:
                    raise RuntimeError(f"redis-server refused the ACL file: {process.stderr.read().decode()}")
                asyncio.run(asyncio.sleep(0.05))
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


def url(port: int, user: str) -> str:
    return f"redis://{user}:{PASSWORDS[user]}@127.0.0.1:{port}/0"


def as_user(port: int, user: str) -> redis.Redis:
    return redis.Redis(port=port, username=user, password=PASSWORDS[user], decode_responses=True)


# --- the attack --------------------------------------------------------------------------


def test_ray_cannot_touch_api_keys(acl_redis: int) -> None:
    key = create_key_sync(url(acl_redis, GATEWAY_USER), "acme", "victim")
    gateway = as_user(acl_redis, GATEWAY_USER)
    [record_name] = [n for n in gateway.scan_iter(match="llmstack:*") if "by-id" not in n]
    ray = as_user(acl_redis, RAY_USER)
    attacks = [
        lambda: ray.get(record_name),  # read a key record
        lambda: ray.set(record_name, '{"revoked_at": null}'),  # un-revoke / rewrite it
        lambda: ray.set("llmstack:{key:forged}", "{}"),  # mint one
        lambda: ray.delete(record_name),  # delete it
        lambda: ray.eval("return redis.call('GET', KEYS[1])", 1, record_name),
        lambda: ray.keys("*"),
        lambda: ray.flushall(),
        lambda: ray.config_set("appendonly", "no"),
        lambda: ray.acl_setuser(RAY_USER, commands=["+@all"]),
    ]
    for attack in attacks:
        with pytest.raises(redis.exceptions.NoPermissionError):
            attack()
    assert asyncio.run(RedisKeyStore(url(acl_redis, GATEWAY_USER)).verify(key)) is not None  # untouched


def test_residual_risk_ray_lists_the_gateways_key_names_and_reads_none_of_them(acl_redis: int) -> None:
    """KubeRay's cleanup job needs SCAN, and SCAN takes no key: no ACL key pattern limits which
    names it lists. The threat model (docs/deploying.md) states this residual risk; this pins both sides of it."""
    gateway = as_user(acl_redis, GATEWAY_USER)
    gateway.set("llmstack:{tenant:acme}:spend", "1")
    ray = as_user(acl_redis, RAY_USER)
    listed = set(ray.scan_iter(match="llmstack:*"))
    assert "llmstack:{tenant:acme}:spend" in listed  # the leak: names (key hashes, tenants, models)
    for name in listed:  # never a value, a type or a TTL
        for attack in (
            lambda: ray.get(name),
            lambda: ray.type(name),
            lambda: ray.ttl(name),
            lambda: ray.hgetall(name),
            lambda: ray.dump(name),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attack()
    # Of Ray's commands that take no key, only SCAN reveals anything about keys (PING, INFO do not).
    keyless = [
        c
        for c in ray_user().commands.split()
        if c.startswith("+") and c[1:] in ("scan", "keys", "randomkey", "info", "ping")
    ]
    assert keyless == ["+ping", "+info", "+scan"]
    threat_model = " ".join((PROJECT_ROOT / "docs" / "deploying.md").read_text().split())
    assert "SCAN lists every key name" in threat_model and "`+scan`" in threat_model


def test_the_gateway_cannot_touch_ray_state(acl_redis: int) -> None:
    as_user(acl_redis, RAY_USER).hset(TABLE, "node-1", "alive")
    gateway = as_user(acl_redis, GATEWAY_USER)
    for attack in (
        lambda: gateway.hget(TABLE, "node-1"),
        lambda: gateway.delete(TABLE),
        lambda: gateway.flushall(),
        lambda: gateway.keys("*"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attack()


def test_the_default_user_is_off(acl_redis: int) -> None:
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=acl_redis, password=PASSWORDS[GATEWAY_USER]).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=acl_redis).ping()


# --- the real work -----------------------------------------------------------------------


def test_the_gateway_does_its_work_as_its_user(acl_redis: int) -> None:
    gateway_url = url(acl_redis, GATEWAY_USER)
    key = create_key_sync(gateway_url, "acme", "ci")

    async def work() -> None:
        store = RedisKeyStore(gateway_url)
        record = await store.verify(key)
        assert record is not None
        assert [r.key_id for r in await store.list()] and await store.get(record.key_id)
        errors: list[str] = []
        limiter = Limiter(gateway_url, "closed", request_timeout_s=60, on_redis_error=lambda: errors.append("x"))
        who = Who(key_id=record.key_id, tenant=record.tenant, limits=KeyLimits(), tenant_defaults=TenantLimits())
        # Priced, so the scripts also charge the month's spend and write the usage ledger.
        ticket = await limiter.admit(who, 100, model="tiny", usd_per_million_tokens=Decimal("2"))
        assert ticket.decision.allowed and not errors  # EVALSHA of the limiter scripts, TIME inside them
        await ticket.settle(Usage(30, 10))
        assert not errors
        # The settle script swallows errors of its cost writes (so a slot is always freed): check them.
        written = redis.Redis.from_url(gateway_url, decode_responses=True)
        today = datetime.now(timezone.utc)
        assert written.hgetall(usage_key("acme", today.date()))[f"{record.key_id}|completion|tiny"] == "10"
        assert written.hget(spend_key("acme", month_of(today)), "tenant") == "80000"  # 40 tokens at $2/1M
        written.close()
        assert await store.revoke(record.key_id)
        assert await store.verify(key) is None
        await limiter.aclose()
        await store.aclose()

    asyncio.run(work())


def test_the_fair_queue_works_as_the_gateway_user(acl_redis: int) -> None:
    """Admission, a waiter woken over pub/sub (the script PUBLISHes, the process SUBSCRIBEs), release."""
    policy = QueuePolicy(tiers=[QueueTier(name="standard", max_queue_length=1, queue_timeout_s=10)])

    async def work() -> None:
        queue = FairQueue(
            url(acl_redis, GATEWAY_USER),
            policy,
            {"acl-model": ModelQueue(max_ongoing_requests=1)},
            lease_s=60,
            heartbeat_s=20,
        )  # a heartbeat this slow cannot be what wakes the waiter
        await queue.start()
        try:
            first = await queue.acquire("acl-model", "acme")
            waiting = asyncio.create_task(queue.acquire("acl-model", "acme"))
            while (await queue.status("acl-model"))["queued"]["standard"] == 0:
                await asyncio.sleep(0.01)
            with pytest.raises(QueueRefused):  # the one place in the queue is taken
                await queue.acquire("acl-model", "other")
            await first.release()
            second = await asyncio.wait_for(waiting, 5)
            await second.release()
            assert (await queue.status("acl-model"))["in_flight"] == 0
            # The gateway's own path: the try in the limiter's admit, the release in its settle.
            limiter = Limiter(
                url(acl_redis, GATEWAY_USER),
                "closed",
                request_timeout_s=60,
                on_redis_error=lambda: pytest.fail("the limiter's Redis failed"),
            )
            who = Who(key_id="acl-key", tenant="acme", limits=KeyLimits(), tenant_defaults=TenantLimits())
            attempt = queue.try_slot("acl-model", "acme")
            ticket = await limiter.admit(who, 10, along=attempt.call)
            slot = queue.tried(attempt)
            assert ticket.allowed and slot is not None
            release = slot.release_call()
            await ticket.settle(Usage(5, 5), along=release)
            await slot.finish_release(release)
            assert release.sent and (await queue.status("acl-model"))["in_flight"] == 0
            await limiter.aclose()
        finally:
            await queue.aclose()

    asyncio.run(work())


def test_ray_cannot_forge_or_read_queue_wake_ups(acl_redis: int) -> None:
    ray = as_user(acl_redis, RAY_USER)
    with pytest.raises(redis.exceptions.NoPermissionError):
        ray.publish(CHANNEL_PREFIX + "some-gateway", "token|A|1")  # would admit a waiter past capacity
    pubsub = ray.pubsub()
    with pytest.raises(redis.exceptions.NoPermissionError):
        pubsub.psubscribe(CHANNEL_PREFIX + "*")
        pubsub.get_message(timeout=1)


def test_ray_gcs_and_kuberay_cleanup_commands_work_as_rays_user(acl_redis: int) -> None:
    ray = as_user(acl_redis, RAY_USER)
    # Connecting (redis_context.cc): what kind of Redis, then the primary probe.
    assert isinstance(ray.execute_command("INFO", "SENTINEL"), (dict, str))
    assert ray.execute_command("INFO", "CLUSTER") is not None
    assert ray.execute_command("DEL", "DUMMY") == 0
    assert ray.ping()
    # The store (redis_store_client.cc).
    assert ray.execute_command("HSET", TABLE, "a", "1") == 1
    assert ray.execute_command("HSETNX", TABLE, "a", "2") == 0
    assert ray.execute_command("HGET", TABLE, "a") == "1"
    assert ray.execute_command("HMGET", TABLE, "a", "b") == ["1", None]
    assert ray.execute_command("HEXISTS", TABLE, "a") == 1
    cursor, items = ray.execute_command("HSCAN", TABLE, "0", "MATCH", "a*", "COUNT", "1000")
    assert (items if isinstance(items, dict) else dict(zip(items[::2], items[1::2]))) == {"a": "1"}
    assert ray.execute_command("INCRBY", f"RAY{NAMESPACE}@JobCounter", "1") == 1
    assert ray.execute_command("HDEL", TABLE, "a") == 1
    # KubeRay's cleanup job (RedisDelKeyPrefixSync): SCAN the namespace, DEL (or UNLINK) each key.
    ray.execute_command("HSET", f"RAY{NAMESPACE}@KV", "k", "v")
    cursor, names = ray.execute_command("SCAN", "0", "MATCH", f"RAY{NAMESPACE}@*", "COUNT", "1000")
    assert {f"RAY{NAMESPACE}@KV", f"RAY{NAMESPACE}@JobCounter"} <= set(names)
    assert all(n.startswith(f"RAY{NAMESPACE}@") for n in names)
    assert ray.execute_command("DEL", f"RAY{NAMESPACE}@KV") == 1
    assert ray.execute_command("UNLINK", f"RAY{NAMESPACE}@JobCounter") == 1


def test_elasticache_access_strings_are_the_same_rules_in_documented_grammar() -> None:
    assert access_string(gateway_user()) == "on ~llmstack:* &* +@all -@dangerous +info"
    assert access_string(ray_user()).startswith("on ~RAY* ~DUMMY -@all +ping +info ")
    assert access_string(autoscaler_user()) == "on ~llmstack:{fq:* -@all +zcard +hget +get"
    for user in USERS:
        undocumented = [t for t in access_string(user).split() if not ELASTICACHE_DOCUMENTED.fullmatch(t)]
        assert not undocumented, f"{user.name}: {undocumented} is not in ElastiCache's documented access-string grammar"


@pytest.fixture(scope="module")
def elasticache_rules_redis(tmp_path_factory: pytest.TempPathFactory):
    """A real redis-server whose users carry exactly the ElastiCache access strings (the default
    user switched off, as the program's user group does)."""
    port = free_port()
    process = subprocess.Popen(
        [
            redis_server_path(),
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path_factory.mktemp("redis-elasticache")),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=die_with_parent,
    )
    try:
        admin = redis.Redis(port=port)
        for _ in range(100):
            try:
                admin.ping()
                break
            except redis.ConnectionError:
                asyncio.run(asyncio.sleep(0.05))
        for user in USERS:
            admin.execute_command(
                "ACL", "SETUSER", user.name, "reset", f">{PASSWORDS[user.name]}", *access_string(user).split()
            )
        admin.execute_command("ACL", "SETUSER", "default", "off")
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_elasticache_rules_still_let_the_gateway_wake_its_queue_and_keep_ray_out(elasticache_rules_redis) -> None:
    gateway, ray = as_user(elasticache_rules_redis, GATEWAY_USER), as_user(elasticache_rules_redis, RAY_USER)
    assert gateway.publish(CHANNEL_PREFIX + "gw-1", "token|A|1") == 0
    gateway.set("llmstack:key:abc", "1")
    with pytest.raises(redis.exceptions.NoPermissionError):
        ray.publish(CHANNEL_PREFIX + "gw-1", "token|A|1")
    with pytest.raises(redis.exceptions.NoPermissionError):
        ray.get("llmstack:key:abc")
    assert ray.execute_command("HSET", TABLE, "a", "1") == 1


def test_the_deploying_guide_gives_external_redis_the_same_rules() -> None:
    from infra.spec.stack_file import PROJECT_ROOT

    guide = " ".join((PROJECT_ROOT / "docs" / "deploying.md").read_text().split())
    for user in USERS:
        assert f"ACL SETUSER {user.name} on >PASSWORD {user.rules()}" in guide


# --- the autoscaler's user: Serve's controller on the Ray head reads the queue's figures ----


def admin(port: int) -> redis.Redis:
    return redis.Redis(port=port, username=ADMIN, password=ADMIN_PASSWORD, decode_responses=True)


def test_the_autoscaler_cannot_write_nor_read_beyond_the_queue_nor_run_scripts(acl_redis: int) -> None:
    """What a compromised Ray head holds. The gateway's keys, limiter, spend, usage and its queue
    (state, waiters, capacity) all exist; each attack is refused and changes nothing."""
    gateway_url = url(acl_redis, GATEWAY_USER)
    create_key_sync(gateway_url, "acme", "victim")
    gateway = as_user(acl_redis, GATEWAY_USER)
    [record] = [n for n in gateway.scan_iter(match="llmstack:*") if "by-id" not in n and "{fq:" not in n][:1]
    model = fresh_model()
    keys = queue_keys(model, len(POLICY.tiers))
    gateway.hset(keys.state, "svc_us", 1000)
    gateway.zadd(keys.queues[0], {"waiter-1": 1})
    gateway.set(keys.replicas, 1)
    gateway.hset(capacity_key(model), "slots", 2)
    today = datetime.now(timezone.utc)
    gateway.hset(usage_key("acme", today.date()), "k|completion|m", 10)
    gateway.hset(spend_key("acme", month_of(today)), "tenant", 80000)
    gateway.set("llmstack:{tenant:acme}:limiter", "5")
    before = {n: gateway.dump(n) for n in gateway.scan_iter(match="llmstack:*")}

    head = as_user(acl_redis, AUTOSCALER_USER)
    attacks = {
        # write the queue: admit past capacity, drop waiters, fake a free replica
        "set replicas": lambda: head.set(keys.replicas, 100),
        "hset svc_us": lambda: head.hset(keys.state, "svc_us", 0),
        "zrem waiter": lambda: head.zrem(keys.queues[0], "waiter-1"),
        "zadd waiter": lambda: head.zadd(keys.queues[0], {"forged": 0}),
        "del queue": lambda: head.delete(keys.queues[0]),
        "hset capacity": lambda: head.hset(capacity_key(model), "slots", 100),
        "incr": lambda: head.incr(keys.replicas),
        "expire": lambda: head.expire(keys.state, 1),
        # read past the three figures: who waits, and anything outside the queue
        "zrange waiters": lambda: head.zrange(keys.queues[0], 0, -1),
        "hgetall state": lambda: head.hgetall(keys.state),
        "get key record": lambda: head.get(record),
        "hget spend": lambda: head.hget(spend_key("acme", month_of(today)), "tenant"),
        "hget usage": lambda: head.hget(usage_key("acme", today.date()), "k|completion|m"),
        "get limiter": lambda: head.get("llmstack:{tenant:acme}:limiter"),
        "get key prefix": lambda: head.get("llmstack:key:abc"),
        "scan": lambda: head.scan(0, match="llmstack:*"),
        "keys": lambda: head.keys("*"),
        "type": lambda: head.type(record),
        "dump queue": lambda: head.dump(keys.state),
        # scripts and functions run any command on any key they are given
        "eval": lambda: head.eval("return redis.call('GET', KEYS[1])", 1, keys.replicas),
        "eval_ro": lambda: head.eval_ro("return redis.call('GET', KEYS[1])", 1, keys.replicas),
        "script load": lambda: head.script_load("return 1"),
        "fcall": lambda: head.fcall("f", 0),
        # pub/sub: a forged wake-up admits a waiter past capacity
        "publish": lambda: head.publish(CHANNEL_PREFIX + "gw-1", "token|A|1"),
        # the server itself
        "flushall": lambda: head.flushall(),
        "config": lambda: head.config_set("appendonly", "no"),
        "acl setuser": lambda: head.acl_setuser(AUTOSCALER_USER, commands=["+@all"]),
        "multi/exec": lambda: head.pipeline(transaction=True).get(keys.replicas).execute(),
    }
    allowed = []
    for name, attack in attacks.items():
        try:
            attack()
            allowed.append(name)
        except redis.exceptions.NoPermissionError:
            pass
        except redis.exceptions.ExecAbortError:  # MULTI refused inside the transaction
            pass
    assert allowed == []
    assert {n: gateway.dump(n) for n in gateway.scan_iter(match="llmstack:*")} == before


def test_the_autoscaler_reads_the_queue_figures_and_nothing_it_sends_is_refused(acl_redis: int) -> None:
    """`read_figures` on the controller's own client (`gateway_queue.connect`), while the gateway's
    fair queue holds real waiters: the figures match what the gateway's user reads, and ACL LOG,
    where Redis records every refused command (CLIENT SETINFO on connect included), stays empty."""
    admin(acl_redis).acl_log_reset()
    model = fresh_model()
    seen = {}

    def check() -> None:
        head = connect(url(acl_redis, AUTOSCALER_USER), timeout_s=5)
        seen["head"] = read_figures(head, source(model))
        head.close()
        gateway = redis.Redis.from_url(url(acl_redis, GATEWAY_USER))
        seen["gateway"] = read_figures(gateway, source(model))
        gateway.close()

    asyncio.run(with_waiters(url(acl_redis, GATEWAY_USER), model, 2, check))
    assert seen["head"].depth == 2 and seen["head"].expected_wait_s is not None
    assert seen["head"] == seen["gateway"]
    refused = [(e["username"], e["object"]) for e in admin(acl_redis).acl_log() if e["username"] == AUTOSCALER_USER]
    assert refused == []


class RecordingProxy:
    """A TCP proxy in front of redis-server that keeps what clients send: the commands on the wire,
    whatever the server does with them (a refused or unknown command reaches neither MONITOR nor,
    before Redis 7.2 knew CLIENT SETINFO, ACL LOG)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port, self.sent = upstream_port, bytearray()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
                threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
                threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, record: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if record:
                    self.sent += data
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def commands(self) -> list[str]:
        """The command name of each RESP array sent (with its subcommand for CLIENT)."""
        words = [w.decode() for w in bytes(self.sent).split(b"\r\n")]
        names = []
        for i, word in enumerate(words):
            if word.startswith("*") and i + 2 < len(words):
                name = words[i + 2].upper()
                names.append(f"{name} {words[i + 4].upper()}" if name == "CLIENT" else name)
        return names

    def close(self) -> None:
        self.listener.close()


def test_on_the_wire_the_autoscaler_sends_auth_and_its_three_reads_only(acl_redis: int) -> None:
    """What `read_figures` on `gateway_queue.connect`'s client sends, connection set-up included,
    is what `autoscaler_user` grants (AUTH is always allowed)."""
    model = fresh_model()
    keys = queue_keys(model, len(POLICY.tiers))
    as_user(acl_redis, GATEWAY_USER).zadd(keys.queues[0], {"w1": 1})
    proxy = RecordingProxy(acl_redis)
    try:
        head = connect(f"redis://{AUTOSCALER_USER}:{PASSWORDS[AUTOSCALER_USER]}@127.0.0.1:{proxy.port}/0", 5)
        assert read_figures(head, source(model)).depth == 1
        head.close()
    finally:
        proxy.close()
    granted = {c.upper() for c in AUTOSCALER_COMMANDS}
    assert set(proxy.commands()) == {"AUTH"} | granted


def test_elasticache_rules_let_the_autoscaler_read_its_figures_only(elasticache_rules_redis) -> None:
    model = fresh_model()
    gateway = as_user(elasticache_rules_redis, GATEWAY_USER)
    keys = queue_keys(model, len(POLICY.tiers))
    gateway.zadd(keys.queues[1], {"w1": 1, "w2": 2})
    gateway.hset(keys.state, "svc_us", 500_000)
    gateway.set("llmstack:key:abc", "1")
    head = connect(url(elasticache_rules_redis, AUTOSCALER_USER), timeout_s=5)
    figures = read_figures(head, source(model))
    assert figures.depth == 2 and figures.expected_wait_s == pytest.approx(2 * 0.5 / 1)
    reader = as_user(elasticache_rules_redis, AUTOSCALER_USER)
    for attack in (
        lambda: reader.get("llmstack:key:abc"),
        lambda: reader.set(keys.replicas, 5),
        lambda: reader.zrange(keys.queues[1], 0, -1),
        lambda: reader.eval("return 1", 0),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attack()
    head.close()
