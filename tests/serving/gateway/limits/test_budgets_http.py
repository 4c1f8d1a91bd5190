"""Cost through the real gateway: the usage ledger and monthly budgets in dollars, over HTTP with
the official `openai` client, a real redis-server and the vLLM-like upstream that reports exact
usage (tests.support.vllm_upstream). The showback report is `llmctl cost report` run as an
operator runs it (a subprocess); the shared budget is charged by two gateway processes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path

import httpx
import openai
import pytest
import redis

from infra.spec.stack_file import PROJECT_ROOT
from ops.harness.processes import free_port, terminate, wait_for_http
from ops.llmctl.bench.stats import BenchReport, RequestResult, summarise
from serving.gateway.auth.keys import create_key_sync
from serving.gateway.limits.budgets import REFUSAL_CODE, cost_nano_usd, month_of, seconds_until_next_month, spend_key
from serving.gateway.limits.tenants import key_daily_key
from serving.gateway.limits.usage_ledger import parse_usage_hash, usage_key
from serving.gateway.metering.output_bound import output_bound
from serving.gateway.metering.reservation import reserve
from tests.support.gateway import GENEROUS
from tests.support.gateway_process import gateway_process
from tests.support.servers import HANG_BOUND_S
from tests.support.stacks import stack_document, write_stack
from tests.support.vllm_upstream import daily_used, directive, key_id_of, running_gateway
from tests.support.waiting import eventually

# The test stack (tests.support.stacks) serves "llama" on one L4 group. $72 per node-hour over a
# bench of 20 total tokens/s is $1,000 per 1M tokens: one token costs a tenth of a cent, so a few
# hundred tokens show up in a report in whole cents, and the gateway charges budgets at that rate.
RATE = Decimal("1000")
PER_TOKEN = RATE / 1_000_000


def chat(url: str, key: str, rid: str, tokens: int, *, max_tokens: int = 50) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
    try:
        return client.chat.completions.create(
            model="llama",
            max_tokens=max_tokens,
            messages=[{"role": "user", "content": directive(id=rid, tokens=tokens) + "\nHow big is a KV cache?"}],
        )
    finally:
        client.close()


def bench(path: Path) -> Path:
    """`llmctl bench --out` of the test model: 10 prompt + 10 output tokens/s at concurrency 1."""
    results = [
        RequestResult(
            start=0.0,
            end=1.0,
            first_token=0.1,
            chunk_times=[0.1, 1.0],
            prompt_tokens=1,
            output_tokens=1,
            requested_output_tokens=1,
        )
        for _ in range(10)
    ]
    report = BenchReport(
        command="llmctl bench",
        started_at="2026-11-20T10:00:00+00:00",
        base_url="http://gw/v1",
        model="llama",
        api="chat",
        mode="concurrency",
        prompt_tokens="fixed:1",
        output_tokens="fixed:1",
        requests_per_level=10,
        duration_s_per_level=None,
        ignore_eos=True,
        seed=0,
        levels=[summarise(results, "concurrency", 1)],
    )
    path.write_text(report.model_dump_json(indent=2))
    return path


def most_reserved() -> int:
    """Tokens one request of the budget test reserves at most (serving.gateway.metering.reservation): its
    prompt bound from a body no shorter than the client sends, plus its max_tokens."""
    document = {
        "model": "llama",
        "max_tokens": 30,
        "messages": [{"role": "user", "content": directive(id="budget-99", tokens=30) + "\nHow big is a KV cache?"}],
    }
    body_size = len(json.dumps(document).encode())  # spaced JSON: longer than the client's compact body
    output = output_bound(document, "/v1/chat/completions", context_length=None, ceiling=10**6)  # max_tokens: 30
    return reserve(
        document, body_size, "/v1/chat/completions", output=output, context_length=None, template_tokens=0
    ).total


def ledger(url: str, tenant: str) -> dict[str, tuple[int, int, int]]:
    """Today's ledger of a tenant: key_id -> (prompt, completion, requests) for model llama."""
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        today = datetime.fromtimestamp(int(client.time()[0]), timezone.utc).date()
        rows = parse_usage_hash(tenant, today, client.hgetall(usage_key(tenant, today)))
    finally:
        client.close()
    return {r.key_id: (r.prompt_tokens, r.completion_tokens, r.requests) for r in rows if r.model == "llama"}


def spent(url: str, tenant: str, field: str = "tenant") -> int:
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        return int(client.hget(spend_key(tenant, month_of(datetime.now(timezone.utc))), field) or 0)
    finally:
        client.close()


def test_two_tenants_are_billed_and_reported_in_proportion(redis_server, upstream, tmp_path):
    stack = write_stack(tmp_path, "costs", stack_document())
    keys = {
        name: create_key_sync(redis_server.url, tenant, name, limits=GENEROUS)
        for name, tenant in (("a1", "team-a"), ("a2", "team-a"), ("b1", "team-b"))
    }
    sent = {"a1": [("p-a1-1", 120), ("p-a1-2", 80)], "a2": [("p-a2-1", 40)], "b1": [("p-b1-1", 60)]}
    with running_gateway(
        upstream.url, redis_server.url, models=["llama"], model_usd_per_million_tokens={"llama": RATE}
    ) as url:
        for name, requests in sent.items():
            for rid, tokens in requests:
                answer = chat(url, keys[name], rid, tokens, max_tokens=tokens)
                generated = upstream.generated[rid]
                assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (
                    generated["prompt"],
                    generated["completion"],
                ) and generated["completion"] == tokens

    def used(name: str) -> tuple[int, int]:
        rids = [rid for rid, _ in sent[name]]
        generated = [upstream.generated[r] for r in rids]
        return sum(g["prompt"] for g in generated), sum(g["completion"] for g in generated)

    # The ledger holds exactly what the upstream generated, per key; spend is its cost at the rate.
    for name, tenant in (("a1", "team-a"), ("a2", "team-a"), ("b1", "team-b")):
        assert ledger(redis_server.url, tenant)[key_id_of(keys[name])] == (*used(name), len(sent[name]))
    tokens = {"team-a": sum(used("a1")) + sum(used("a2")), "team-b": sum(used("b1"))}
    assert spent(redis_server.url, "team-a") == sum(cost_nano_usd(sum(used(n)), RATE) for n in ("a1", "a2"))

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "ops.llmctl.main",
            "cost",
            "report",
            "--stack",
            str(stack),
            "--month",
            month_of(datetime.now(timezone.utc)),
            "--json",
            "--redis-url",
            redis_server.url,
            "--offline",
            "--usd-per-hour",
            "l4=72",
            "--node-hours",
            "l4=10",
            "--bench",
            str(bench(tmp_path / "bench.json")),
        ],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    tenants = {t["tenant"]: t for t in report["tenants"]}
    for tenant, total in tokens.items():
        assert tenants[tenant]["prompt_tokens"] + tenants[tenant]["completion_tokens"] == total
        # Each tenant pays its tokens at the model's rate, in whole cents: shares in proportion to tokens.
        assert Decimal(tenants[tenant]["usd"]) == (total * PER_TOKEN).quantize(Decimal("0.01"))
    rows = {(r["tenant"], r["key_id"]): r for r in report["rows"] if r["kind"] == "usage"}
    assert rows[("team-a", key_id_of(keys["a1"]))]["completion_tokens"] == 200
    idle = sum(Decimal(r["usd"]) for r in report["rows"] if r["kind"] == "idle")
    assert Decimal(report["total_usd"]) == Decimal("720.00") == idle + sum(Decimal(t["usd"]) for t in tenants.values())


@contextmanager
def budget_gateway_process(upstream_url: str, redis_url: str, log: Path) -> Iterator[str]:
    """`python -m serving.gateway` as a pod runs it (settings from the environment)."""
    port, metrics_port = free_port(), free_port()
    # No chat-template allowance: the reservation stays close to what a request bills.
    settings = {
        "models": ["llama"],
        "model_usd_per_million_tokens": {"llama": str(RATE)},
        "upstream_idle_timeout_s": 30,
        "chat_template_tokens": 0,
    }
    env = {
        "LLMSTACK_UPSTREAM_URL": upstream_url,
        "LLMSTACK_REDIS_URL": redis_url,
        "LLMSTACK_GATEWAY_SETTINGS": json.dumps(settings),
        "LLMSTACK_GATEWAY_PORT": str(port),
        "LLMSTACK_GATEWAY_METRICS_PORT": str(metrics_port),
        "PYTHONPATH": str(PROJECT_ROOT),
    }
    with gateway_process({**os.environ, **env}, log) as process:
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for_http(f"{url}/healthz", process, timeout_s=HANG_BOUND_S)
            yield url
        finally:
            terminate(process, grace_s=10)


@pytest.mark.slow  # starts two gateway processes
def test_a_monthly_budget_is_shared_by_two_gateway_processes(redis_server, upstream, tmp_path):
    """$1 buys 1,000 tokens at the rate; 40 requests of about 45 tokens need twice that. Two
    replicas that each kept their own count would serve them all; sharing one count in Redis,
    the replicas together stop at the budget."""
    budget = Decimal("1.00")
    key = create_key_sync(redis_server.url, "team-c", "tiny-budget", limits={**GENEROUS, "monthly_budget_usd": budget})
    with ExitStack() as stack:
        urls = [
            stack.enter_context(budget_gateway_process(upstream.url, redis_server.url, tmp_path / f"gw{i}.log"))
            for i in range(2)
        ]

        def send(n: int) -> tuple[int, str, httpx.Response | None]:
            rid = f"budget-{n}"
            try:
                chat(urls[n % 2], key, rid, 30, max_tokens=30)
            except openai.RateLimitError as refused:
                return n, rid, refused.response
            return n, rid, None

        with ThreadPoolExecutor(max_workers=6) as pool:
            outcomes = list(pool.map(send, range(40)))
        admitted = [rid for _, rid, refusal in outcomes if refusal is None]
        refusals = [refusal for _, _, refusal in outcomes if refusal is not None]
        served_by = {n % 2 for n, _, refusal in outcomes if refusal is None}

        billed = sum(
            cost_nano_usd(upstream.generated[r]["prompt"] + upstream.generated[r]["completion"], RATE) for r in admitted
        )
        # Every admission fit the budget with its whole reservation, and no request bills more than
        # it reserved: the two replicas together never spend more than the budget. And they stop only
        # when one more reservation no longer fits (the requests after the run are refused): what
        # is left of the budget is less than one request's reservation, a few hundred tokens of
        # the 1,000 the budget buys (a budget that refused too early bills far less).
        assert budget * 10**9 - cost_nano_usd(most_reserved(), RATE) < billed <= budget * 10**9
        assert served_by == {0, 1} and len(admitted) < 40
        assert spent(redis_server.url, "team-c", f"key:{key_id_of(key)}") == billed
        for refusal in refusals:
            error = refusal.json()["error"]
            assert error["code"] == REFUSAL_CODE and refusal.headers["x-should-retry"] == "false"
            wait = int(refusal.headers["retry-after"])
            assert abs(wait - seconds_until_next_month(datetime.now(timezone.utc))) < 120
            assert "monthly budget of this API key ($1.00)" in error["message"]
        # After it, either replica refuses.
        for url in urls:
            with pytest.raises(openai.RateLimitError) as refused:
                chat(url, key, f"after-{url}", 30, max_tokens=30)
            assert refused.value.response.json()["error"]["code"] == REFUSAL_CODE


def test_the_ledger_is_written_by_the_settlement_itself(redis_server, upstream):
    """The ledger and the limiter's daily counter are written by one settle script: whatever a
    request ends as (whole, streamed, cut), they agree, and a request is never in one without
    the other. An unwritable ledger (a key of another type) cannot keep a slot taken."""
    key = create_key_sync(redis_server.url, "team-d", "ledger", limits={**GENEROUS, "max_concurrent_requests": 1})
    key_id = key_id_of(key)
    with running_gateway(
        upstream.url, redis_server.url, models=["llama"], model_usd_per_million_tokens={"llama": RATE}
    ) as url:
        chat(url, key, "l-1", 7)
        body = {
            "model": "llama",
            "max_tokens": 20,
            "stream": True,
            "messages": [{"role": "user", "content": directive(id="l-2", tokens=12, pause_after=3)}],
        }
        with httpx.stream(
            "POST",
            f"{url}/v1/chat/completions",
            json=body,
            timeout=HANG_BOUND_S,
            headers={"authorization": f"Bearer {key}"},
        ) as cut:
            for n, _ in enumerate(cut.iter_lines()):
                if n >= 4:
                    break  # the client goes away mid-stream
        eventually(lambda: ledger(redis_server.url, "team-d").get(key_id, (0, 0, 0))[2] == 2, "the cut stream settled")
        prompt, completion, requests = ledger(redis_server.url, "team-d")[key_id]
        assert prompt + completion == daily_used(redis_server.url, key_daily_key("team-d", key_id))
        assert completion >= 7 + 3  # the cut stream is billed at least what it sent

        # A ledger that cannot be written (here: today's key holds a string) must not stop the
        # settlement: with one concurrent request allowed, a slot left taken would refuse the next.
        client = redis.Redis.from_url(redis_server.url, decode_responses=True)
        today = datetime.fromtimestamp(int(client.time()[0]), timezone.utc).date()
        client.delete(usage_key("team-d", today))
        client.set(usage_key("team-d", today), "not a hash")
        for n in range(3):
            chat(url, key, f"l-broken-{n}", 5)
        assert client.get(usage_key("team-d", today)) == "not a hash"
        client.close()
        # ...and the script did not fail: the gateway saw no limiter error (it counts each one).
        metrics = httpx.get(f"{url.metrics}/metrics").text
    assert 'llmstack_gateway_redis_errors_total{component="limiter"} 0.0' in metrics


def test_a_tenant_budget_set_with_llmctl_covers_all_its_keys(redis_server, upstream):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "ops.llmctl.main",
            "tenants",
            "set",
            "team-e",
            "--redis-url",
            redis_server.url,
            "--monthly-budget-usd",
            "0.50",
        ],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    first, second = (create_key_sync(redis_server.url, "team-e", name, limits=GENEROUS) for name in ("e1", "e2"))
    with running_gateway(
        upstream.url,
        redis_server.url,
        models=["llama"],
        chat_template_tokens=0,
        model_usd_per_million_tokens={"llama": RATE},
    ) as url:
        served = 0
        with pytest.raises(openai.RateLimitError) as refused:
            while served < 40:
                chat(url, first, f"e-{served}", 30, max_tokens=30)
                served += 1
        error = refused.value.response.json()["error"]
        assert (
            error["code"] == REFUSAL_CODE
            and "this API key's tenant (all its keys together) ($0.50)" in error["message"]
        )
        assert 0 < served < 40 and spent(redis_server.url, "team-e") <= 500_000_000
        with pytest.raises(openai.RateLimitError):  # the tenant's other key draws on the same budget
            chat(url, second, "e-other", 30, max_tokens=30)
        metrics = httpx.get(f"{url.metrics}/metrics").text
    assert 'llmstack_gateway_model_usd_per_million_tokens{model="llama"} 1000.0' in metrics
    assert 'llmstack_gateway_rate_limited_total{limit="monthly_budget",mode="enforced"} 2.0' in metrics
    ratio = next(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith('llmstack_gateway_budget_used_ratio{key_id="",tenant="team-e"}')
    )
    # As the last admission saw it: the refused one, after every earlier request had settled.
    assert ratio == pytest.approx(spent(redis_server.url, "team-e") / 500_000_000) and ratio > 0.5


def test_a_shadow_key_over_its_budget_is_served_and_still_billed(redis_server, upstream):
    from serving.gateway.auth.keys import RedisKeyStore

    async def make() -> str:
        store = RedisKeyStore(redis_server.url)
        try:
            key, _ = await store.create(
                "team-f", "trial", limits={**GENEROUS, "monthly_budget_usd": Decimal("0.10")}, shadow=True
            )
            return key
        finally:
            await store.aclose()

    key = asyncio.run(make())
    with running_gateway(
        upstream.url,
        redis_server.url,
        models=["llama"],
        chat_template_tokens=0,
        model_usd_per_million_tokens={"llama": RATE},
    ) as url:
        for n in range(5):
            chat(url, key, f"f-{n}", 30, max_tokens=30)  # never refused: shadow mode only counts
        metrics = httpx.get(f"{url.metrics}/metrics").text
    billed = sum(upstream.generated[f"f-{n}"]["prompt"] + upstream.generated[f"f-{n}"]["completion"] for n in range(5))
    assert spent(redis_server.url, "team-f", f"key:{key_id_of(key)}") == cost_nano_usd(billed, RATE) > 100_000_000
    assert ledger(redis_server.url, "team-f")[key_id_of(key)][2] == 5
    assert 'llmstack_gateway_rate_limited_total{limit="monthly_budget",mode="shadow"}' in metrics
