"""Showback arithmetic: tenants pay their tokens at the rate, idle capacity is its own row, and
every total adds up to the cent (checked on hand-made figures and on random ones)."""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infra.plan.showback import GroupCost, ModelRate, Usage, apportion, assumed_node_hours, model_rates, showback
from tests.support.hypothesis import examples

PER_MILLION = Decimal("0.000001")


def usage(tenant: str, key: str, tokens: int, model: str = "m", prompt: int = 0) -> Usage:
    return Usage(tenant=tenant, key_id=key, model=model, prompt_tokens=prompt, completion_tokens=tokens - prompt)


def group(hours: str = "10", price: str | None = "1.00", name: str = "g") -> GroupCost:
    return GroupCost(
        node_group=name, node_hours=Decimal(hours), usd_per_node_hour=None if price is None else Decimal(price)
    )


def rate(usd_per_million: str | None = "1", model: str = "m", weight: int = 1, node_group: str = "g") -> ModelRate:
    return ModelRate(
        model=model,
        node_group=node_group,
        weight=weight,
        usd_per_token=None if usd_per_million is None else Decimal(usd_per_million) * PER_MILLION,
    )


def by_kind(report, kind: str) -> list:
    return [r for r in report.rows if r.kind == kind]


def test_tenants_pay_their_tokens_and_idle_is_the_rest():
    # 10 node-hours at $1 = $10. At $1 per 1M tokens: a's 3M tokens are $3, b's 1M are $1, idle $6.
    report = showback(
        [usage("a", "k1", 2_000_000, prompt=500_000), usage("a", "k2", 1_000_000), usage("b", "k3", 1_000_000)],
        [group()],
        [rate()],
    )
    assert [(r.tenant, r.key_id, r.usd) for r in by_kind(report, "usage")] == [
        ("a", "k1", Decimal("2.00")),
        ("a", "k2", Decimal("1.00")),
        ("b", "k3", Decimal("1.00")),
    ]
    assert [r.usd for r in by_kind(report, "idle")] == [Decimal("6.00")]
    assert [(t.tenant, t.usd, t.prompt_tokens) for t in report.tenants] == [
        ("a", Decimal("3.00"), 500_000),
        ("b", Decimal("1.00"), 0),
    ]
    assert report.total_usd == Decimal("10.00") and report.idle_usd == Decimal("6.00")
    model = report.models[0]
    assert (model.usd, model.attributed_usd, model.idle_usd, model.utilisation) == (
        Decimal("10.00"),
        Decimal("4.00"),
        Decimal("6.00"),
        Decimal("0.4000"),
    )


def test_resumed_streams_work_done_again_is_the_platforms_overhead_row_never_a_tenants():
    # $10 of cost at $1 per 1M tokens. a was billed 3M tokens; resuming its streams made the engine
    # prefill 1.5M tokens again and generate 0.5M again: $2 of overhead, its own row, not a's.
    resumed = Usage(
        tenant="a",
        key_id="k1",
        model="m",
        prompt_tokens=1_000_000,
        completion_tokens=2_000_000,
        overhead_prompt_tokens=1_500_000,
        overhead_completion_tokens=500_000,
    )
    report = showback([resumed, usage("b", "k2", 1_000_000)], [group()], [rate()])
    assert [(r.tenant, r.usd) for r in by_kind(report, "usage")] == [("a", Decimal("3.00")), ("b", Decimal("1.00"))]
    [overhead] = by_kind(report, "overhead")
    assert (overhead.tenant, overhead.model, overhead.usd) == (None, "m", Decimal("2.00"))
    assert (overhead.prompt_tokens, overhead.completion_tokens) == (1_500_000, 500_000)
    assert [r.usd for r in by_kind(report, "idle")] == [Decimal("4.00")]
    assert [(t.tenant, t.usd, t.prompt_tokens, t.completion_tokens) for t in report.tenants] == [
        ("a", Decimal("3.00"), 1_000_000, 2_000_000),
        ("b", Decimal("1.00"), 0, 1_000_000),
    ]
    assert (report.overhead_usd, report.idle_usd, report.total_usd) == (
        Decimal("2.00"),
        Decimal("4.00"),
        Decimal("10.00"),
    )
    model = report.models[0]
    assert (model.attributed_usd, model.overhead_usd, model.idle_usd) == (
        Decimal("6.00"),
        Decimal("2.00"),
        Decimal("4.00"),
    )


def test_no_resumes_no_overhead_row():
    report = showback([usage("a", "k1", 1_000_000)], [group()], [rate()])
    assert by_kind(report, "overhead") == [] and report.overhead_usd == Decimal("0.00")


def test_thirds_round_to_the_cent_and_still_add_up():
    # $1 of attributed cost over three equal tenants: 33, 33 and 34 cents, never 99 or 101.
    report = showback([usage(t, t, 1) for t in "abc"], [group("1", "1.00")], [rate("1000000")])
    cents = sorted(r.usd for r in by_kind(report, "usage"))
    assert cents == [Decimal("0.33"), Decimal("0.33"), Decimal("0.34")]
    assert sum(r.usd for r in report.rows) == report.total_usd == Decimal("1.00")
    assert by_kind(report, "idle")[0].usd == Decimal("0.00")


def test_more_tokens_than_capacity_splits_the_whole_cost_by_tokens_and_says_so():
    report = showback([usage("a", "k", 30_000_000), usage("b", "k", 10_000_000)], [group()], [rate()])
    assert [r.usd for r in by_kind(report, "usage")] == [Decimal("7.50"), Decimal("2.50")]
    assert by_kind(report, "idle")[0].usd == Decimal("0.00")
    assert any("400%" in note and "too low" in note for note in report.notes)


def test_a_model_without_a_rate_is_one_unpriced_row_not_smeared():
    report = showback([usage("a", "k", 5)], [group()], [rate(None)])
    assert [r.usd for r in by_kind(report, "usage")] == [Decimal("0.00")]
    assert [r.usd for r in by_kind(report, "unpriced")] == [Decimal("10.00")]
    assert report.idle_usd == Decimal("10.00") and any("--bench" in n for n in report.notes)


def test_groups_split_by_weight_and_unused_groups_are_idle():
    groups = [group("3", "1.00", "shared"), group("5", "2.00", "spare"), group("9", None, "cpu")]
    rates = [
        rate("1", "big", weight=2, node_group="shared"),
        rate("1", "small", weight=1, node_group="shared"),
        rate("1", "cpu-model", node_group="cpu"),
    ]
    report = showback([usage("a", "k", 1_000_000, model="small"), usage("a", "k", 7, model="cpu-model")], groups, rates)
    assert [(m.model, m.usd) for m in report.models] == [
        ("big", Decimal("2.00")),
        ("small", Decimal("1.00")),
        ("cpu-model", Decimal("0.00")),
    ]
    spare = [r for r in by_kind(report, "idle") if r.node_group == "spare"]
    assert spare[0].usd == Decimal("10.00") and spare[0].model == ""
    assert report.total_usd == Decimal("13.00") == sum(r.usd for r in report.rows)
    assert any("'cpu' has no price" in n for n in report.notes)


def test_tokens_of_models_the_stack_does_not_price_are_listed_at_zero():
    report = showback([usage("a", "k", 10, model="other")], [group()], [rate()])
    assert [(r.kind, r.usd) for r in report.rows if r.model == "other"] == [("unserved", Decimal("0.00"))]
    assert report.tenants[0].usd == Decimal("0.00")


def test_apportion_refuses_shares_that_do_not_add_up():
    assert apportion(100, [Fraction(100, 3)] * 3) == [34, 33, 33]  # ties go to the earlier share
    with pytest.raises(ValueError):
        apportion(100, [Fraction(50), Fraction(49)])


def test_model_rates_and_assumed_hours_come_from_the_plan(example_stack):
    from infra.plan.cost import estimated_throughputs, node_prices, stack_costs
    from infra.plan.planner import plan_stack

    plan = plan_stack(example_stack)
    costs = stack_costs(example_stack, plan, node_prices(example_stack), estimated_throughputs(example_stack))
    rates = model_rates(plan, costs)
    assert [r.model for r in rates] == [m.model_name for m in example_stack.models]
    assert all(r.weight > 0 for r in rates)  # min_replicas 0 still weighs by max_replicas
    hours = assumed_node_hours(plan, Decimal(720))
    assert hours == {g.name: g.nodes_at_min * Decimal(720) for g in plan.node_groups}


tokens = st.integers(min_value=0, max_value=10**12)


@settings(max_examples=examples(fast=100, deep=300))
@given(
    rows=st.lists(
        st.tuples(
            st.sampled_from("abcd"),
            st.sampled_from(["k1", "k2"]),
            st.sampled_from(["m1", "m2"]),
            tokens,
            tokens,
            tokens,
        ),
        max_size=12,
    ),
    hours=st.decimals(min_value=0, max_value=10**5, places=3),
    price=st.decimals(min_value=0, max_value=100, places=6),
    rates=st.tuples(
        st.decimals(min_value="0.000001", max_value=1000, places=6),
        st.decimals(min_value="0.000001", max_value=1000, places=6),
    ),
    weights=st.tuples(st.integers(0, 8), st.integers(0, 8)),
)
def test_rows_always_add_up_to_the_bill_to_the_cent(rows, hours, price, rates, weights):
    merged: dict[tuple[str, str, str], tuple[int, int, int]] = {}
    for tenant, key, model, prompt, completion, overhead in rows:
        merged[(tenant, key, model)] = (prompt, completion, overhead)
    use = [
        Usage(tenant=t, key_id=k, model=m, prompt_tokens=p, completion_tokens=c, overhead_prompt_tokens=o)
        for (t, k, m), (p, c, o) in merged.items()
    ]
    report = showback(
        use,
        [GroupCost(node_group="g", node_hours=hours, usd_per_node_hour=price)],
        [rate(str(rates[0]), "m1", weights[0]), rate(str(rates[1]), "m2", weights[1])],
    )
    assert report.total_usd == (hours * price).quantize(Decimal("0.01"), rounding="ROUND_HALF_UP")
    assert sum(r.usd for r in report.rows) == report.total_usd
    assert all(r.usd >= 0 and r.usd == r.usd.quantize(Decimal("0.01")) for r in report.rows)
    assert sum(t.usd for t in report.tenants) + report.overhead_usd + report.idle_usd == report.total_usd
    for model in report.models:
        rows_of_model = [r for r in report.rows if r.model == model.model]
        assert sum(r.usd for r in rows_of_model) == model.usd
        assert model.attributed_usd + model.idle_usd == model.usd
        used = sum(r.prompt_tokens + r.completion_tokens for r in rows_of_model)
        at_rate = Decimal(used) * Decimal(str(rates[0] if model.model == "m1" else rates[1])) * PER_MILLION
        # idle is the cost not attributed: the tokens at the rate, capped at the cost, off by less
        # than the one cent the idle row's own rounding can move
        assert abs(model.attributed_usd - min(model.usd, at_rate)) < Decimal("0.01")
