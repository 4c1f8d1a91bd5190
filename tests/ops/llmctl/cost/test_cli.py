"""`llmctl cost` and `llmctl cost report` as an operator runs them: exact figures from a bench
file and a catalog price, estimates labelled, showback from a real Redis usage ledger adding up
to the cent, and one-line errors with exit codes."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from decimal import Decimal

import pytest
from typer.testing import CliRunner

from infra.spec.stack_file import PROJECT_ROOT
from ops.harness.processes import free_port
from ops.llmctl.main import app
from serving.gateway.limits.usage_ledger import LEDGER_LUA, record_call
from tests.support.stacks import stack_document, write_stack

SIX = Decimal("0.000001")


def llmctl(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture
def stack(tmp_path):
    return str(write_stack(tmp_path, "costs", stack_document()))  # one g6.xlarge ($0.8048/h), model "llama"


def test_exact_price_per_million_tokens_from_a_bench_file(stack, bench_file):
    bench = bench_file("llama", {1: (400, 400), 4: (1000, 1000)})  # c=4: 1000 output, 2000 total tok/s
    result = llmctl("cost", "--stack", stack, "--bench", str(bench), "--json")
    assert result.exit_code == 0, result.output
    model = json.loads(result.stdout)["models"][0]
    assert Decimal(model["usd_per_million_output_tokens"]).quantize(SIX) == Decimal("0.223556")  # 0.8048 / 3.6
    assert Decimal(model["usd_per_million_total_tokens"]).quantize(SIX) == Decimal("0.111778")
    assert Decimal(model["usd_per_hour_at_min"]) == Decimal("0.8048")
    assert (
        model["throughput"]["estimate"] is False
        and "concurrency 4 (highest output throughput)" in model["throughput"]["source"]
    )
    at_c1 = json.loads(llmctl("cost", "--stack", stack, "--bench", str(bench), "-c", "1", "--json").stdout)
    assert Decimal(at_c1["models"][0]["usd_per_million_output_tokens"]).quantize(SIX) == Decimal("0.558889")
    halved = json.loads(
        llmctl("cost", "--stack", stack, "--bench", str(bench), "--bench-replicas", "2", "--json").stdout
    )
    assert Decimal(halved["models"][0]["usd_per_million_output_tokens"]).quantize(SIX) == Decimal("0.447111")


def test_estimates_are_labelled():
    result = llmctl("cost", "--stack", "dev", "--offline")
    assert result.exit_code == 0, result.output
    assert "$0.5291 est." in result.stdout and "$0.2534 est." in result.stdout
    assert "throughput ESTIMATE" in result.stdout and "llm-price-compass" in result.stdout


def test_a_cpu_stack_needs_a_given_price(bench_file):
    plain = llmctl("cost", "--stack", "local", "--offline")
    assert plain.exit_code == 0 and "--usd-per-hour local=PRICE" in plain.stdout
    bench = bench_file("tiny-chat", {32: (977, 977)})
    priced = json.loads(
        llmctl(
            "cost", "--stack", "local", "--usd-per-hour", "local=0.11592", "--bench", f"tiny-chat={bench}", "--json"
        ).stdout
    )
    tiny = priced["models"][0]
    assert tiny["node_price"] == {"usd_per_hour": "0.11592", "source": "given (--usd-per-hour)", "note": None}
    assert tiny["usd_per_million_output_tokens"] is not None and priced["models"][1]["throughput"] is None
    # BENCHMARKS.md's worked example: the plan counts 3 replicas per local node; the bench's one
    # replica had the machine to itself, so --bench-replicas 3 prices it at the whole machine.
    whole = json.loads(
        llmctl(
            "cost",
            "--stack",
            "local",
            "--usd-per-hour",
            "local=0.11592",
            "--bench",
            f"tiny-chat={bench}",
            "--bench-replicas",
            "3",
            "--json",
        ).stdout
    )["models"][0]
    assert Decimal(whole["usd_per_million_output_tokens"]).quantize(Decimal("0.0001")) == Decimal("0.0330")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--usd-per-hour", "gpu=1"], "no node group 'gpu'"),
        (["--usd-per-hour", "l4=cheap"], "is not a number"),
        (["--bench", "/nonexistent.json"], "cannot read it"),
        (["--bench", "nosuch=/nonexistent.json"], "cannot read it"),
    ],
)
def test_unusable_options_exit_2(stack, args, message):
    result = llmctl("cost", "--stack", stack, *args)
    assert result.exit_code == 2 and message in result.output, result.output


def test_a_bench_of_another_model_or_level_exits_2(stack, bench_file):
    bench = bench_file("mistral", {4: (100, 100)})
    result = llmctl("cost", "--stack", stack, "--bench", str(bench))
    assert result.exit_code == 2 and "measured model 'mistral'" in result.output and "MODEL_ID=" in result.output
    named = llmctl("cost", "--stack", stack, "--bench", f"llama={bench}", "-c", "8")
    assert named.exit_code == 2 and "has no successful level 8; it has 4" in named.output


def test_spot_groups_without_credentials_are_priced_on_demand_and_say_why(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_EC2_METADATA_DISABLED="true",
    )
    run = subprocess.run(
        [sys.executable, "-m", "ops.llmctl.main", "cost", "--stack", "prod", "--json"],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    mistral = next(m for m in json.loads(run.stdout)["models"] if m["model_id"] == "mistral-7b")
    assert mistral["node_price"]["usd_per_hour"] == "1.212" and mistral["node_price"]["source"] == "on-demand (catalog)"
    assert mistral["node_price"]["note"].startswith("spot group priced on-demand: no AWS credentials")


# --- report ----------------------------------------------------------------------------------


@pytest.fixture
def ledger(empty_redis):
    client = empty_redis
    script = client.register_script(LEDGER_LUA + "ledger_record(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])")

    def settle(tenant: str, key_id: str, model: str, prompt: int, completion: int) -> None:
        keys, args = record_call(tenant, key_id, model, prompt, completion, datetime.now(timezone.utc))
        script(keys=keys, args=args)

    yield settle


def report(stack: str, bench, redis_url: str, *extra: str):
    # $3.60 per node-hour over 1,000 total tokens/s: $1 per 1M tokens. 10 node-hours: $36.
    return llmctl(
        "cost",
        "report",
        "--stack",
        stack,
        "--since",
        "2d",
        "--node-hours",
        "l4=10",
        "--usd-per-hour",
        "l4=3.6",
        "--bench",
        str(bench),
        "--redis-url",
        redis_url,
        *extra,
    )


def test_report_attributes_tokens_in_proportion_and_keeps_idle_apart(stack, bench_file, ledger, redis_server):
    bench = bench_file("llama", {8: (500, 500)})
    ledger("team-a", "k1", "llama", 1_000_000, 1_000_000)
    ledger("team-a", "k2", "llama", 500_000, 500_000)
    ledger("team-b", "k3", "llama", 400_000, 600_000)
    ledger("team-b", "k3", "other", 5, 5)
    result = report(stack, bench, redis_server.url, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    usd = {(r["tenant"], r["key_id"], r["model"], r["kind"]): Decimal(r["usd"]) for r in data["rows"]}
    assert usd[("team-a", "k1", "llama", "usage")] == Decimal("2.00")
    assert usd[("team-a", "k2", "llama", "usage")] == Decimal("1.00")
    assert usd[("team-b", "k3", "llama", "usage")] == Decimal("1.00")
    assert usd[(None, None, "llama", "idle")] == Decimal("32.00")
    assert usd[("team-b", "k3", "other", "unserved")] == Decimal("0.00")
    assert {t["tenant"]: Decimal(t["usd"]) for t in data["tenants"]} == {
        "team-a": Decimal("3.00"),
        "team-b": Decimal("1.00"),
    }
    assert Decimal(data["total_usd"]) == sum(usd.values()) == Decimal("36.00")
    assert Decimal(data["idle_usd"]) == Decimal("32.00")

    rows = list(csv.DictReader(io.StringIO(report(stack, bench, redis_server.url, "--csv").stdout)))
    assert sum(Decimal(r["usd"]) for r in rows) == Decimal("36.00") and {r["kind"] for r in rows} >= {"usage", "idle"}
    table = report(stack, bench, redis_server.url).stdout
    assert "team-a" in table and "(idle)" in table and "total $36.00" in table


def test_report_shows_each_adapter_on_rows_of_its_own_priced_as_its_base(stack, bench_file, ledger, redis_server):
    # The gateway meters a LoRA adapter as `<base>:<adapter>`; it runs on the base's replicas.
    bench = bench_file("llama", {8: (500, 500)})
    ledger("team-a", "k1", "llama:support", 1_000_000, 1_000_000)
    ledger("team-a", "k1", "llama", 500_000, 500_000)
    ledger("team-b", "k2", "llama:legal", 400_000, 600_000)
    result = report(stack, bench, redis_server.url, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    usd = {(r["tenant"], r["key_id"], r["model"], r["kind"]): Decimal(r["usd"]) for r in data["rows"]}
    assert usd[("team-a", "k1", "llama:support", "usage")] == Decimal("2.00")
    assert usd[("team-a", "k1", "llama", "usage")] == Decimal("1.00")
    assert usd[("team-b", "k2", "llama:legal", "usage")] == Decimal("1.00")
    assert usd[(None, None, "llama", "idle")] == Decimal("32.00")
    assert not [r for r in data["rows"] if r["kind"] == "unserved"]


def test_report_without_given_hours_assumes_min_nodes_and_says_so(stack, bench_file, ledger, redis_server):
    ledger("team-a", "k1", "llama", 10, 10)
    bench = bench_file("llama", {8: (500, 500)})
    result = llmctl(
        "cost",
        "report",
        "--stack",
        stack,
        "--month",
        datetime.now(timezone.utc).strftime("%Y-%m"),
        "--bench",
        str(bench),
        "--redis-url",
        redis_server.url,
        "--json",
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["groups"][0]["assumed_hours"] is True
    assert any("node-hours assumed from the plan" in n for n in data["notes"])


def test_report_with_redis_down_exits_3(stack, bench_file):
    result = report(stack, bench_file("llama", {8: (500, 500)}), f"redis://127.0.0.1:{free_port()}/0")
    assert result.exit_code == 3 and "cannot read the usage ledger" in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--since", "thirty"], "--since"),
        (["--month", "2026-13"], "YYYY-MM"),
        (["--since", "1d", "--month", "2026-11"], "not both"),
        (["--node-hours", "gpu=3"], "no node group 'gpu'"),
    ],
)
def test_report_unusable_options_exit_2(stack, args, message):
    result = llmctl("cost", "report", "--stack", stack, "--redis-url", "redis://127.0.0.1:1/0", *args)
    assert result.exit_code == 2 and message in result.output, result.output
