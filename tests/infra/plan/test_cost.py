"""Cost arithmetic with figures a reader can check by hand: catalog prices, replica shares of a
node, $/1M tokens at a known throughput, spot prices averaged over time, the rate card."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest

from infra.catalog.throughput import Throughput
from infra.plan.cost import (
    NodePrice,
    PriceSource,
    SpotPricePoint,
    estimated_throughputs,
    model_cost,
    node_prices,
    per_million,
    rate_card,
    replica_usd_per_hour,
    spot_price,
    stack_costs,
)
from infra.plan.planner import plan_stack
from infra.spec.schema import StackSpec
from infra.spec.stack_file import PROJECT_ROOT, load_stack, spec_from_document
from tests.support.stacks import stack_document

SIX = Decimal("0.000001")


def spec_of(**overrides: object) -> StackSpec:
    return spec_from_document(stack_document(**overrides), name="costs", file_label="Pulumi.costs.yaml")


def measured(output: str, total: str) -> Throughput:
    return Throughput(
        output_tokens_per_s=Decimal(output), total_tokens_per_s=Decimal(total), estimate=False, source="a bench"
    )


def test_g6_xlarge_at_the_catalog_price_and_a_known_throughput():
    spec = spec_of()  # one g6.xlarge group, one 8B model, 1 replica
    plan = plan_stack(spec)
    prices = node_prices(spec)
    assert prices["l4"] == NodePrice(usd_per_hour=Decimal("0.8048"), source=PriceSource.ON_DEMAND)
    cost = stack_costs(spec, plan, prices, {"llama": measured("1000", "2000")})[0]
    assert cost.replica_usd_per_hour == Decimal("0.8048")
    assert cost.usd_per_hour_at_min == cost.usd_per_hour_at_max == Decimal("0.8048")
    # $0.8048 per hour / (1000 tokens/s x 3600 s) x 1e6 = $0.22355... per 1M output tokens
    assert cost.usd_per_million_output_tokens == Decimal("0.8048") / Decimal("3.6")
    assert cost.usd_per_million_output_tokens.quantize(SIX) == Decimal("0.223556")
    assert cost.usd_per_million_total_tokens.quantize(SIX) == Decimal("0.111778")
    assert rate_card([cost]) == {"llama": Decimal("0.111778")}
    assert not cost.notes


def test_replicas_pay_their_share_of_a_node():
    four_gpus = [{"name": "l4", "kind": "gpu", "instance_type": "g6.12xlarge", "max_size": 2}]
    model = {
        "id": "llama",
        "source": "meta-llama/Llama-3.1-8B-Instruct",
        "node_group": "l4",
        "max_model_len": 8192,
        "autoscaling": {"min_replicas": 1, "max_replicas": 5},
    }
    spec = spec_of(node_groups=four_gpus, models=[model])
    plan = plan_stack(spec).models[0]
    assert replica_usd_per_hour(plan, Decimal("4.6016")) == Decimal("1.1504")  # 4 replicas per node
    cost = model_cost(spec, plan, node_prices(spec)["l4"], None)
    assert (cost.usd_per_hour_at_min, cost.usd_per_hour_at_max) == (Decimal("4.6016"), Decimal("9.2032"))
    assert cost.usd_per_million_total_tokens is None and "--bench" in cost.notes[0]
    tp2 = spec_of(node_groups=four_gpus, models=[{**model, "tensor_parallel_size": 2}])
    assert replica_usd_per_hour(plan_stack(tp2).models[0], Decimal("4.6016")) == Decimal("2.3008")


def test_per_million_is_price_over_tokens_per_hour():
    assert per_million(Decimal("3.6"), Decimal("1")) == Decimal("1000")  # 3,600 tokens an hour for $3.60
    assert per_million(Decimal("0.8048"), Decimal("513.20")).quantize(Decimal("0.0001")) == Decimal("0.4356")


T0 = datetime(2026, 11, 10, tzinfo=timezone.utc)


def point(zone: str, usd: str, hours: float) -> SpotPricePoint:
    return SpotPricePoint(zone=zone, usd_per_hour=Decimal(usd), timestamp=T0 + timedelta(hours=hours))


def test_spot_price_is_time_weighted_and_the_highest_zone():
    history = [
        point("us-east-1a", "0.30", -1),
        point("us-east-1a", "0.60", 1),  # 1 h at 0.30, 3 h at 0.60
        point("us-east-1b", "0.40", -5),
        point("us-east-1c", "9.99", 0),
    ]  # not a zone of the stack
    price = spot_price(history, ["us-east-1a", "us-east-1b"], T0, T0 + timedelta(hours=4))
    assert price.usd_per_hour == Decimal("0.525") and price.source is PriceSource.SPOT
    assert "us-east-1a $0.5250" in price.note and "us-east-1b $0.4000" in price.note
    assert spot_price(history, ["us-west-2a"], T0, T0 + timedelta(hours=4)) is None
    # A zone whose history starts inside the window is averaged over the part it covers.
    late = spot_price([point("us-east-1a", "0.20", 2)], ["us-east-1a"], T0, T0 + timedelta(hours=4))
    assert late.usd_per_hour == Decimal("0.20")


def test_node_prices_spot_given_and_cpu():
    spec = load_stack("prod")
    spot = NodePrice(usd_per_hour=Decimal("0.4"), source=PriceSource.SPOT, note="average")
    assert node_prices(spec, spot={"a10g-spot": spot})["a10g-spot"] == spot
    fallback = node_prices(spec, spot={"a10g-spot": "no AWS credentials"})["a10g-spot"]
    assert fallback.usd_per_hour == Decimal("1.212") and fallback.source is PriceSource.ON_DEMAND
    assert fallback.note == "spot group priced on-demand: no AWS credentials"
    assert node_prices(spec, given={"a100": Decimal("20")})["a100"].source is PriceSource.GIVEN
    assert node_prices(spec)["l40s"].note is None  # an on-demand group needs no note
    local = load_stack("local")
    assert node_prices(local) == {"local": None}
    assert node_prices(local, given={"local": Decimal("0.11592")})["local"].usd_per_hour == Decimal("0.11592")


def test_estimates_match_by_gpu_parallelism_and_size():
    assert estimated_throughputs(load_stack("dev"))["llama-3-1-8b"].estimate  # L4, 8B, tp 1
    assert set(estimated_throughputs(load_stack("prod")).values()) == {None}  # 70B, L40S, A10G tp 1
    assert estimated_throughputs(load_stack("local")) == {"tiny-chat": None, "tiny-chat-ngram": None}
    quantized = spec_of(
        models=[
            {
                "id": "llama",
                "source": "meta-llama/Llama-3.1-8B-Instruct",
                "node_group": "l4",
                "max_model_len": 8192,
                "quantization": "awq",
            }
        ]
    )
    assert estimated_throughputs(quantized) == {"llama": None}


def test_dev_stack_at_the_l4_estimate():
    spec = load_stack("dev")
    cost = stack_costs(spec, plan_stack(spec), node_prices(spec), estimated_throughputs(spec))[0]
    # g6.2xlarge $0.9776/h over 513.20 output / 1,071.71 total tokens/s (throughput_estimates.yaml)
    assert cost.usd_per_million_output_tokens.quantize(Decimal("0.0001")) == Decimal("0.5291")
    assert cost.usd_per_million_total_tokens.quantize(Decimal("0.0001")) == Decimal("0.2534")
    assert cost.throughput.estimate and "estimate" in cost.notes[0]


@pytest.mark.parametrize("bad", [{"output_tokens_per_s": 0}, {"total_tokens_per_s": 1}])
def test_throughput_is_validated(bad):
    with pytest.raises(ValueError):
        Throughput(**{"output_tokens_per_s": 10, "total_tokens_per_s": 20, "estimate": False, "source": "x", **bad})


def test_benchmarks_worked_example_for_the_local_cpu_stack():
    """The benchmarks log's worked example (m7a.large over the local stack's measured throughput, run 1,
    c=32 and c=1; 64 input / 64 output tokens, so total = 2 x output), recomputed from the figures
    as the page states them: a changed throughput or price there must come with its costs."""
    text = (PROJECT_ROOT / "docs" / "benchmarks-log.md").read_text()
    section = text[text.index("What `llmctl cost` computes, done by hand") : text.index("## Cold start of `make dev`")]
    [price] = re.findall(r"\$(\d+\.\d+) per hour Linux On-Demand", section)
    rows = re.findall(
        r"^\| (full path \(gateway\)|bare vLLM) \| ([\d,]+) \| ([\d,]+) \| \$([\d.]+) \| \$([\d.]+) \|$",
        section,
        re.MULTILINE,
    )
    [(single, single_cost)] = re.findall(r"full path's (\d+) output tokens/s cost \$([\d.]+) per 1M", section)
    assert [row[0] for row in rows] == ["full path (gateway)", "bare vLLM"]
    places = Decimal("0.0001")
    for _, output, per_hour, output_cost, total_cost in rows:
        tokens_per_s = Decimal(output.replace(",", ""))
        assert Decimal(per_hour.replace(",", "")) == tokens_per_s * 3600
        assert per_million(Decimal(price), tokens_per_s).quantize(places) == Decimal(output_cost)
        assert per_million(Decimal(price), 2 * tokens_per_s).quantize(places) == Decimal(total_cost)
    assert per_million(Decimal(price), Decimal(single)).quantize(places) == Decimal(single_cost)
    # BENCHMARKS.md's table of current figures quotes the same $/1M output tokens.
    summary = (PROJECT_ROOT / "BENCHMARKS.md").read_text()
    [row] = [line for line in summary.splitlines() if line.startswith("| [Worked example")]
    assert all(f"${output_cost}" in row for _, _, _, output_cost, _ in rows)
