"""What serving costs: node prices, each model's $/hour, and its $/1M tokens at a throughput.

Pure arithmetic on typed inputs: a capacity plan (`infra.plan.planner`), one price per node group
(catalog, spot history or given) and one `Throughput` per model. Money is `Decimal` from the
first step, so figures are the catalog's digits, not binary floats. `ops.llmctl.cost` does the
I/O: reading bench files, asking EC2 for spot prices.

A replica's $/hour is the part of a node it occupies: the node price over the replicas that
fit on one node (or times the nodes one replica spans). Its $/1M tokens is that over the tokens
it serves in an hour, so the figure holds at full use: a replica at half load costs twice as
much per token, which is what `llmctl cost report` shows as idle capacity.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from datetime import datetime
from decimal import Decimal
from enum import Enum

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from infra.catalog.throughput import Throughput, estimate_for
from infra.plan.model_arch import UnknownModelError, architecture_for
from infra.plan.planner import ModelPlan, StackPlan
from infra.spec.schema import CapacityType, GpuNodeGroup, StackSpec

MILLION = Decimal(1_000_000)
SECONDS_PER_HOUR = Decimal(3600)


def money(value: float | str | Decimal) -> Decimal:
    """A price as Decimal with the digits it was written with (0.8048 stays 0.8048)."""
    return value if isinstance(value, Decimal) else Decimal(str(value))


class PriceSource(str, Enum):
    ON_DEMAND = "on-demand (catalog)"
    SPOT = "spot (EC2 price history)"
    GIVEN = "given (--usd-per-hour)"


class NodePrice(BaseModel):
    """What one node of a group costs per hour, and why we believe it."""

    model_config = ConfigDict(frozen=True)

    usd_per_hour: Decimal = Field(ge=0, description="USD per node-hour.")
    source: PriceSource = Field(description="Catalog, spot history, or the operator's figure.")
    note: str | None = Field(default=None, description="Caveats, e.g. a spot group priced on-demand.")


class SpotPricePoint(BaseModel):
    """One entry of EC2's spot price history: from `timestamp` on, this zone's price."""

    model_config = ConfigDict(frozen=True)

    zone: str = Field(description="Availability zone, e.g. us-east-1a.")
    usd_per_hour: Decimal = Field(ge=0, description="Spot price from this time on.")
    timestamp: AwareDatetime = Field(description="When the price took effect.")


def spot_price(
    points: Iterable[SpotPricePoint], zones: Iterable[str], start: datetime, end: datetime
) -> NodePrice | None:
    """The spot price of a node over [start, end]: each zone's time-weighted average (a price
    holds until the next change), then the highest of the stack's zones, since the autoscaler
    may start a node in any of them. None when no zone has a price in the window."""
    by_zone: dict[str, list[SpotPricePoint]] = defaultdict(list)
    wanted = set(zones)
    for point in points:
        if point.zone in wanted:
            by_zone[point.zone].append(point)
    averages = {}
    for zone, history in by_zone.items():
        average = _time_weighted(sorted(history, key=lambda p: p.timestamp), start, end)
        if average is not None:
            averages[zone] = average
    if not averages:
        return None
    highest = max(averages.values())
    spread = ", ".join(f"{z} ${p:.4f}" for z, p in sorted(averages.items()))
    return NodePrice(
        usd_per_hour=highest,
        source=PriceSource.SPOT,
        note=f"average {start:%Y-%m-%d %H:%M} to {end:%Y-%m-%d %H:%M} UTC, highest zone ({spread})",
    )


def _time_weighted(history: list[SpotPricePoint], start: datetime, end: datetime) -> Decimal | None:
    # The last change at or before `start` is the price in effect when the window opens; EC2
    # returns it along with the changes inside the window.
    before = [p for p in history if p.timestamp <= start]
    inside = [p for p in history if start < p.timestamp < end]
    steps = ([before[-1].model_copy(update={"timestamp": start})] if before else []) + inside
    if not steps:
        return None
    total, seconds = Decimal(0), Decimal(0)
    for point, following in zip(steps, [*steps[1:], None]):
        until = following.timestamp if following is not None else end
        span = Decimal(str((until - point.timestamp).total_seconds()))
        total += point.usd_per_hour * span
        seconds += span
    return total / seconds if seconds else steps[-1].usd_per_hour


def node_prices(
    spec: StackSpec, *, given: Mapping[str, Decimal] | None = None, spot: Mapping[str, NodePrice | str] | None = None
) -> dict[str, NodePrice | None]:
    """One price per node group. `given` (the operator's figure) wins; spot groups take their
    spot price when `spot` has one, else the catalog's on-demand price with the reason in the
    note (`spot[group]` may be that reason as a string); CPU groups have no catalog price."""
    given, spot = given or {}, spot or {}
    prices: dict[str, NodePrice | None] = {}
    for group in spec.node_groups:
        if group.name in given:
            prices[group.name] = NodePrice(usd_per_hour=money(given[group.name]), source=PriceSource.GIVEN)
        elif not isinstance(group, GpuNodeGroup):
            prices[group.name] = None
        elif group.capacity_type is CapacityType.SPOT and isinstance(spot_price := spot.get(group.name), NodePrice):
            prices[group.name] = spot_price
        else:
            on_demand = money(group.instance.on_demand_usd_per_hour)
            note = None
            if group.capacity_type is CapacityType.SPOT:
                reason = spot.get(group.name) or "no spot price asked for"
                note = f"spot group priced on-demand: {reason}"
            prices[group.name] = NodePrice(usd_per_hour=on_demand, source=PriceSource.ON_DEMAND, note=note)
    return prices


def estimated_throughputs(spec: StackSpec) -> dict[str, Throughput | None]:
    """The published estimate standing for each model's replica shape (None: nothing matches)."""
    found: dict[str, Throughput | None] = {}
    for model in spec.models:
        group = spec.node_group(model.node_group)
        if not isinstance(group, GpuNodeGroup) or model.pipeline_parallel_size != 1:
            found[model.id] = None
            continue
        try:
            parameters = architecture_for(model).parameters
        except UnknownModelError:
            found[model.id] = None
            continue
        found[model.id] = estimate_for(
            group.instance.gpu_class,
            tensor_parallel_size=model.tensor_parallel_size,
            parameters=parameters,
            quantized=model.quantization is not None,
        )
    return found


class ModelCost(BaseModel):
    """One model's cost: per hour at its replica bounds, and per token at a throughput."""

    model_id: str = Field(description="The model's id in the stack.")
    served_name: str = Field(description="The name clients request (and the gateway meters).")
    node_group: str = Field(description="Node group its replicas run on.")
    capacity_type: str = Field(description="on-demand or spot.")
    node_price: NodePrice | None = Field(description="Per node-hour; None when the group has no price.")
    replica_usd_per_hour: Decimal | None = Field(description="The share of nodes one replica occupies.")
    min_replicas: int
    max_replicas: int
    nodes_at_min: int
    nodes_at_max: int
    usd_per_hour_at_min: Decimal | None = Field(description="Nodes the model needs at min replicas, priced.")
    usd_per_hour_at_max: Decimal | None = Field(description="Nodes the model needs at max replicas, priced.")
    throughput: Throughput | None = Field(description="Tokens/s of one replica; None: unknown.")
    usd_per_million_output_tokens: Decimal | None = Field(description="At full use of a replica.")
    usd_per_million_total_tokens: Decimal | None = Field(description="Prompt + output, at full use.")
    notes: list[str] = Field(default_factory=list, description="Why a figure is missing or approximate.")

    @property
    def usd_per_total_token(self) -> Decimal | None:
        return None if self.usd_per_million_total_tokens is None else self.usd_per_million_total_tokens / MILLION


def replica_usd_per_hour(plan: ModelPlan, node_usd_per_hour: Decimal) -> Decimal:
    """A replica's share of the nodes: 1/k of a node when k replicas fit on one, else the
    whole nodes it spans. A node's GPUs left over by the division are paid by the replicas."""
    if plan.replicas_per_node > 0:
        return node_usd_per_hour / plan.replicas_per_node
    return node_usd_per_hour * plan.nodes_per_replica


def per_million(usd_per_hour: Decimal, tokens_per_s: Decimal) -> Decimal:
    """USD per 1M tokens of a replica costing `usd_per_hour` that serves `tokens_per_s`."""
    return usd_per_hour / (tokens_per_s * SECONDS_PER_HOUR) * MILLION


def model_cost(spec: StackSpec, plan: ModelPlan, price: NodePrice | None, throughput: Throughput | None) -> ModelCost:
    model = spec.model(plan.model_id)
    group = spec.node_group(plan.node_group)
    notes = []
    replica = None if price is None else replica_usd_per_hour(plan, price.usd_per_hour)
    if price is None:
        notes.append(
            f"node group {group.name!r} has no catalog price (CPU nodes): pass --usd-per-hour {group.name}=PRICE"
        )
    elif price.note:
        notes.append(price.note)
    if throughput is None:
        notes.append("no throughput figure for this model and GPU: pass --bench FILE from `llmctl bench`")
    elif throughput.estimate:
        notes.append("throughput is a published estimate, not a measurement of this stack")
    per_output = per_total = None
    if replica is not None and throughput is not None:
        per_output = per_million(replica, throughput.output_tokens_per_s)
        per_total = per_million(replica, throughput.total_tokens_per_s)
    return ModelCost(
        model_id=model.id,
        served_name=model.model_name,
        node_group=group.name,
        capacity_type=group.capacity_type.value,
        node_price=price,
        replica_usd_per_hour=replica,
        min_replicas=plan.min_replicas,
        max_replicas=plan.max_replicas,
        nodes_at_min=plan.nodes_at_min,
        nodes_at_max=plan.nodes_at_max,
        usd_per_hour_at_min=None if price is None else plan.nodes_at_min * price.usd_per_hour,
        usd_per_hour_at_max=None if price is None else plan.nodes_at_max * price.usd_per_hour,
        throughput=throughput,
        usd_per_million_output_tokens=per_output,
        usd_per_million_total_tokens=per_total,
        notes=notes,
    )


def stack_costs(
    spec: StackSpec,
    plan: StackPlan,
    prices: Mapping[str, NodePrice | None],
    throughputs: Mapping[str, Throughput | None],
) -> list[ModelCost]:
    """`model_cost` for every model the plan placed, in stack order."""
    return [model_cost(spec, p, prices.get(p.node_group), throughputs.get(p.model_id)) for p in plan.models]


def rate_card(costs: Iterable[ModelCost]) -> dict[str, Decimal | None]:
    """USD per 1M total tokens by served name, rounded to micro-dollars: what a tenant's token
    costs at full use, the price monthly budgets in dollars are charged at."""
    return {
        c.served_name: None
        if c.usd_per_million_total_tokens is None
        else c.usd_per_million_total_tokens.quantize(Decimal("0.000001"))
        for c in costs
    }
