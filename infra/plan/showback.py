"""Showback: who used what share of the serving bill, with idle capacity kept apart.

Inputs: what each node group cost over a period (node-hours x price), each model's rate at full
use ($/token from `infra.plan.cost`), and the tokens each tenant's keys were billed per model (the
gateway's usage ledger). Per model:

    cost        = its share of its node group's cost (by the GPU/CPU slots of its min replicas)
    attributed  = min(cost, (tokens + overhead) x rate)   split over (tenant, key) rows and the
                                                      overhead row by token share
    idle        = cost - attributed                   its own row: never spread over the tenants

So a tenant pays its tokens at the rate card, and capacity nobody used stays visible as idle.
`overhead` is the work the gateway had done again to resume streams whose replica died (the
ledger's overhead fields: the prompt and answer so far prefilled again, tokens generated again
at the seam): the platform's cost, one `overhead` row per model, never a tenant's.
A model without a throughput figure has no rate: its whole cost is one `unpriced` row.

Exact arithmetic (fractions) until the end; then every total is cut into cents with the
largest-remainder method, so rows add up to their model, models to their group and groups to
the total, to the cent.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from infra.plan.cost import ModelCost
from infra.plan.planner import StackPlan

CENT = Decimal("0.01")


class Usage(BaseModel):
    """Tokens one key of one tenant was billed for one model over the period."""

    model_config = ConfigDict(frozen=True)

    tenant: str
    key_id: str
    model: str = Field(description="Served model name as the gateway metered it (`<base>:<adapter>` for an adapter).")
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    requests: int = Field(ge=0, default=0)
    overhead_prompt_tokens: int = Field(
        ge=0, default=0, description="Prefilled again to resume this key's streams: the platform's, not billed."
    )
    overhead_completion_tokens: int = Field(
        ge=0, default=0, description="Generated again at a resumed stream's seam: the platform's, not billed."
    )

    @property
    def total_tokens(self) -> int:
        """The tokens billed (the overhead is not)."""
        return self.prompt_tokens + self.completion_tokens

    @property
    def overhead_tokens(self) -> int:
        return self.overhead_prompt_tokens + self.overhead_completion_tokens


class GroupCost(BaseModel):
    """A node group's bill for the period."""

    model_config = ConfigDict(frozen=True)

    node_group: str
    node_hours: Decimal = Field(ge=0, description="Node-hours the group ran in the period.")
    usd_per_node_hour: Decimal | None = Field(description="None: no price known; the group counts $0.")
    assumed_hours: bool = Field(default=False, description="Node-hours assumed from the plan, not measured.")

    @property
    def usd(self) -> Decimal:
        if self.usd_per_node_hour is None:
            return Decimal(0)
        return (self.node_hours * self.usd_per_node_hour).quantize(CENT, rounding=ROUND_HALF_UP)


class ModelRate(BaseModel):
    """A model as showback needs it: where it runs, its weight in the group, its rate."""

    model_config = ConfigDict(frozen=True)

    model: str = Field(description="Served name (what usage is keyed by).")
    node_group: str
    weight: int = Field(ge=0, description="Share of the group's cost: slots it holds at min replicas.")
    usd_per_token: Decimal | None = Field(description="USD per total token at full use; None: unknown.")


RowKind = Literal["usage", "overhead", "idle", "unpriced", "unserved"]


class CostRow(BaseModel):
    kind: RowKind = Field(
        description="usage: a key's tokens; overhead: the model's work done again to resume streams (the "
        "platform's, in the token columns); idle: capacity nobody used; unpriced: a model with no rate; "
        "unserved: tokens of a model this stack does not price."
    )
    tenant: str | None
    key_id: str | None
    model: str
    node_group: str | None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    requests: int = 0
    usd: Decimal = Field(description="Whole cents.")


class ModelTotal(BaseModel):
    model: str
    node_group: str
    usd: Decimal
    attributed_usd: Decimal = Field(description="The tenants' rows and the overhead row.")
    overhead_usd: Decimal = Field(default=Decimal("0.00"), description="Its overhead row: resumed streams.")
    idle_usd: Decimal
    utilisation: Decimal | None = Field(description="tokens x rate / cost; above 1 the inputs disagree.")


class TenantTotal(BaseModel):
    tenant: str
    prompt_tokens: int
    completion_tokens: int
    usd: Decimal


class Showback(BaseModel):
    rows: list[CostRow]
    models: list[ModelTotal]
    tenants: list[TenantTotal]
    groups: list[GroupCost]
    total_usd: Decimal
    idle_usd: Decimal
    overhead_usd: Decimal = Field(default=Decimal("0.00"), description="The overhead rows: the platform's.")
    notes: list[str]


def model_rates(plan: StackPlan, costs: Iterable[ModelCost]) -> list[ModelRate]:
    """Each planned model's weight (slots x min replicas; x max replicas for a model that may
    scale to zero, so it still carries a share) and its rate at full use (`infra.plan.cost`)."""
    by_id = {c.model_id: c for c in costs}
    return [
        ModelRate(
            model=by_id[m.model_id].served_name,
            node_group=m.node_group,
            weight=m.slots_per_replica * (m.min_replicas or m.max_replicas),
            usd_per_token=by_id[m.model_id].usd_per_total_token,
        )
        for m in plan.models
    ]


def assumed_node_hours(plan: StackPlan, hours: Decimal) -> dict[str, Decimal]:
    """Node-hours if every group ran its min-replica nodes for the whole period: the floor of
    the bill. Real figures (Cost Explorer, the AWS bill) replace it when given."""
    return {g.name: g.nodes_at_min * hours for g in plan.node_groups}


def apportion(total_cents: int, shares: Sequence[Fraction]) -> list[int]:
    """Whole cents per share adding up to exactly `total_cents` (largest remainder: each gets
    its floor, the cents left go to the largest fractional parts, earlier first on ties).
    `shares` are exact cents and must add up to `total_cents`."""
    if sum(shares, Fraction(0)) != total_cents:
        raise ValueError(f"shares add up to {float(sum(shares, Fraction(0)))} cents, not {total_cents}")
    floors = [math.floor(s) for s in shares]
    left = total_cents - sum(floors)
    order = sorted(range(len(shares)), key=lambda i: (-(shares[i] - floors[i]), i))
    for i in order[:left]:
        floors[i] += 1
    return floors


def _weighted(total_cents: int, weights: Sequence[int]) -> list[int]:
    if not weights:
        return []
    if sum(weights) == 0:
        weights = [1] * len(weights)
    whole = sum(weights)
    return apportion(total_cents, [Fraction(total_cents * w, whole) for w in weights])


def _cents(usd: Decimal) -> int:
    return int(usd / CENT)


def _decimal(value: Fraction) -> Decimal:
    return (Decimal(value.numerator) / Decimal(value.denominator)).quantize(Decimal("0.0001"))


def _usd(cents: int) -> Decimal:
    return (Decimal(cents) * CENT).quantize(CENT)


def served_base(model: str) -> str:
    """The base model of a metered name: a LoRA adapter is metered as `<base>:<adapter>` (Ray Serve
    LLM's name for it) and runs on its base's replicas, so its tokens are priced at the base's rate
    and split from the base's cost, each adapter on rows of its own."""
    return model.split(":", 1)[0]


def showback(usage: Iterable[Usage], groups: Iterable[GroupCost], models: Iterable[ModelRate]) -> Showback:
    usage, groups, models = list(usage), list(groups), list(models)
    notes: list[str] = []
    by_model: dict[str, list[Usage]] = defaultdict(list)
    for u in usage:
        by_model[served_base(u.model)].append(u)  # an adapter's tokens share its base's cost, row by row
    rows: list[CostRow] = []
    totals: list[ModelTotal] = []
    for group in groups:
        members = [m for m in models if m.node_group == group.node_group]
        if group.usd_per_node_hour is None:
            notes.append(
                f"node group {group.node_group!r} has no price: its models count $0 "
                f"(give one with --usd-per-hour {group.node_group}=PRICE)"
            )
        if group.assumed_hours:
            notes.append(
                f"node group {group.node_group!r}: node-hours assumed from the plan (min nodes all "
                f"period); pass --node-hours {group.node_group}=HOURS from the bill for real figures"
            )
        if not members:
            if group.usd:
                rows.append(
                    CostRow(kind="idle", tenant=None, key_id=None, model="", node_group=group.node_group, usd=group.usd)
                )
            continue
        for model, cents in zip(members, _weighted(_cents(group.usd), [m.weight for m in members])):
            model_rows, model_total = _split_model(model, cents, by_model.pop(model.model, []), notes)
            rows += model_rows
            totals.append(model_total)
    for model_name, leftover in sorted(by_model.items()):
        notes.append(f"model {model_name!r}: tokens metered but not served by this stack's plan; listed at $0")
        rows += [_usage_row(u, "unserved", None, 0) for u in leftover]
    tenants: dict[str, list[CostRow]] = defaultdict(list)
    for row in rows:
        if row.tenant is not None:
            tenants[row.tenant].append(row)
    tenant_totals = [
        TenantTotal(
            tenant=t,
            prompt_tokens=sum(r.prompt_tokens for r in rs),
            completion_tokens=sum(r.completion_tokens for r in rs),
            usd=sum((r.usd for r in rs), Decimal(0)).quantize(CENT),
        )
        for t, rs in sorted(tenants.items())
    ]
    total = sum((g.usd for g in groups), Decimal(0)).quantize(CENT)
    idle = sum((r.usd for r in rows if r.kind in ("idle", "unpriced")), Decimal(0)).quantize(CENT)
    overhead = sum((r.usd for r in rows if r.kind == "overhead"), Decimal(0)).quantize(CENT)
    return Showback(
        rows=rows,
        models=totals,
        tenants=tenant_totals,
        groups=groups,
        total_usd=total,
        idle_usd=idle,
        overhead_usd=overhead,
        notes=notes,
    )


def _usage_row(u: Usage, kind: RowKind, node_group: str | None, cents: int) -> CostRow:
    return CostRow(
        kind=kind,
        tenant=u.tenant,
        key_id=u.key_id,
        model=u.model,
        node_group=node_group,
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        requests=u.requests,
        usd=_usd(cents),
    )


def _overhead_row(model: ModelRate, used: list[Usage], cents: int) -> list[CostRow]:
    """The model's overhead row (none without overhead): the resumed streams' work done again."""
    prompt, completion = sum(u.overhead_prompt_tokens for u in used), sum(u.overhead_completion_tokens for u in used)
    if not prompt and not completion:
        return []
    return [
        CostRow(
            kind="overhead",
            tenant=None,
            key_id=None,
            model=model.model,
            node_group=model.node_group,
            prompt_tokens=prompt,
            completion_tokens=completion,
            usd=_usd(cents),
        )
    ]


def _split_model(model: ModelRate, cents: int, used: list[Usage], notes: list[str]) -> tuple[list[CostRow], ModelTotal]:
    used = sorted(used, key=lambda u: (u.tenant, u.key_id))
    billed = sum(u.total_tokens for u in used)
    overhead = sum(u.overhead_tokens for u in used)
    tokens = billed + overhead
    if model.usd_per_token is None:
        notes.append(
            f"model {model.model!r} has no throughput figure, so no rate: its whole cost is one "
            "`unpriced` row (pass --bench)"
        )
        rows = [_usage_row(u, "usage", model.node_group, 0) for u in used] + _overhead_row(model, used, 0)
        rows.append(
            CostRow(
                kind="unpriced",
                tenant=None,
                key_id=None,
                model=model.model,
                node_group=model.node_group,
                usd=_usd(cents),
            )
        )
        return rows, ModelTotal(
            model=model.model,
            node_group=model.node_group,
            usd=_usd(cents),
            attributed_usd=Decimal("0.00"),
            idle_usd=_usd(cents),
            utilisation=None,
        )
    cost = Fraction(cents)  # in cents
    at_rate = Fraction(model.usd_per_token) * tokens * 100
    attributed = min(cost, at_rate)
    utilisation = at_rate / cost if cost else None
    if utilisation is not None and utilisation > 1:
        notes.append(
            f"model {model.model!r}: tokens at its rate come to {float(utilisation):.0%} of its cost: "
            "the throughput figure or the node-hours are too low; its whole cost is split by token share"
        )
    shares = [attributed * u.total_tokens / tokens for u in used] if tokens else []
    overhead_share = attributed * overhead / tokens if tokens else Fraction(0)
    split = apportion(cents, [*shares, overhead_share, cost - attributed])
    rows = [_usage_row(u, "usage", model.node_group, c) for u, c in zip(used, split)]
    rows += _overhead_row(model, used, split[-2])
    rows.append(
        CostRow(
            kind="idle", tenant=None, key_id=None, model=model.model, node_group=model.node_group, usd=_usd(split[-1])
        )
    )
    return rows, ModelTotal(
        model=model.model,
        node_group=model.node_group,
        usd=_usd(cents),
        attributed_usd=_usd(cents - split[-1]),
        overhead_usd=_usd(split[-2]),
        idle_usd=_usd(split[-1]),
        utilisation=None if utilisation is None else _decimal(utilisation),
    )
