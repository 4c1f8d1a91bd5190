"""`llmctl cost` and `llmctl cost report`: what each model costs per hour and per token, and
who used what share of it.

Thin: options -> typed inputs (`ops.llmctl.cost.inputs`), prices from the catalog or EC2's spot
history (`ops.llmctl.cost.spot`), usage from the gateway's Redis (`ops.llmctl.cost.usage`); the
arithmetic is `infra.plan.cost` and `infra.plan.showback`. Exit codes: 0 done, 1 the stack does not pass
its plan, 2 unusable options, 3 the gateway's Redis could not be read.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Annotated

import typer

from infra.plan.cost import ModelCost, NodePrice, estimated_throughputs, node_prices, stack_costs
from infra.plan.planner import StackPlan, plan_stack
from infra.plan.showback import GroupCost, assumed_node_hours, model_rates, showback
from infra.spec.schema import StackSpec
from ops.llmctl.console import ExitCode, err, fail, load_spec, out
from ops.llmctl.cost import inputs, views
from ops.llmctl.cost.inputs import CostInputError
from ops.llmctl.plan_view import problem_lines

SPOT_WINDOW = timedelta(days=7)  # `llmctl cost` prices spot groups at their last week's average

app = typer.Typer(no_args_is_help=False)  # the help is cost()'s docstring

BenchOption = Annotated[
    list[str] | None,
    typer.Option(
        "--bench",
        "-b",
        help="`llmctl bench --out` JSON of a model of this stack (repeat per model); "
        "MODEL_ID=FILE when the bench requested another name. Default: a published estimate, if any.",
    ),
]
LevelOption = Annotated[
    float | None,
    typer.Option(
        "--concurrency", "--level", "-c", help="Bench level to price at. Default: its highest output throughput."
    ),
]
ReplicasOption = Annotated[
    int,
    typer.Option("--bench-replicas", min=1, help="Replicas that served the bench: its throughput is divided by this."),
]
PriceOption = Annotated[
    list[str] | None,
    typer.Option(
        "--usd-per-hour",
        help="GROUP=USD per node-hour: your price for a node group (CPU groups have none; "
        "Savings Plans, negotiated rates). Repeat per group.",
    ),
]
OfflineOption = Annotated[bool, typer.Option("--offline", help="Never ask AWS: spot groups at on-demand prices.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON (money as exact decimal strings).")]


def priced(
    spec: StackSpec,
    *,
    bench: list[str] | None,
    level: float | None,
    bench_replicas: int,
    usd_per_hour: list[str] | None,
    offline: bool,
    start: datetime,
    end: datetime,
) -> tuple[StackPlan, dict[str, NodePrice | None], list[ModelCost]]:
    """The plan, a price per node group and each model's cost, or a typer.Exit."""
    plan = plan_stack(spec)
    if not plan.ok:
        for line in problem_lines(plan):
            err.print(line, highlight=False, soft_wrap=True)
        raise fail("the stack does not pass its plan; fix it first (llmctl plan)")
    try:
        given = inputs.group_amounts(spec, usd_per_hour or [], "--usd-per-hour")
        throughputs = {
            **estimated_throughputs(spec),
            **inputs.bench_throughputs(spec, bench or [], level=level, replicas=bench_replicas),
        }
    except CostInputError as exc:
        raise fail(str(exc), ExitCode.UNUSABLE_INPUT) from None
    if offline:
        from ops.llmctl.cost.spot import spot_groups

        spot: dict[str, NodePrice | str] = {g.name: "--offline" for g in spot_groups(spec)}
    else:
        from ops.llmctl.cost.spot import spot_prices

        spot = spot_prices(spec, start, end)
    prices = node_prices(spec, given=given, spot=spot)
    return plan, prices, stack_costs(spec, plan, prices, throughputs)


@app.callback(invoke_without_command=True)
def cost(
    ctx: typer.Context,
    stack: Annotated[str | None, typer.Option("--stack", "-s", help="Stack name (Pulumi.<name>.yaml) or path.")] = None,
    bench: BenchOption = None,
    concurrency: LevelOption = None,
    bench_replicas: ReplicasOption = 1,
    usd_per_hour: PriceOption = None,
    offline: OfflineOption = False,
    as_json: JsonOption = False,
) -> None:
    """Per model: $/hour at min and max replicas (from the plan), and $/1M output and total tokens at a
    throughput measured by `llmctl bench` (--bench) or a published estimate (labelled est.). Spot groups are
    priced from EC2's spot price history when AWS credentials work, else on-demand (said in the notes).

    \b
    Examples:
      llmctl cost --stack dev
      llmctl cost --stack dev --bench build/bench/llama.json -c 16
      llmctl cost report --stack dev --month 2026-11 --csv > showback-2026-11.csv
    """
    if ctx.invoked_subcommand is not None:
        return
    if stack is None:
        raise fail("give --stack, e.g. llmctl cost --stack dev", ExitCode.UNUSABLE_INPUT)
    spec = load_spec(stack)
    now = datetime.now(UTC)
    _, _, costs = priced(
        spec,
        bench=bench,
        level=concurrency,
        bench_replicas=bench_replicas,
        usd_per_hour=usd_per_hour,
        offline=offline,
        start=now - SPOT_WINDOW,
        end=now,
    )
    if as_json:
        print(views.cost_json(spec.name, costs))
        return
    out.print(views.cost_table(spec.name, costs))
    for line in views.cost_notes(costs):
        out.print(f"  {line}", highlight=False, soft_wrap=True)


@app.command()
def report(
    stack: Annotated[str, typer.Option("--stack", "-s", help="Stack name (Pulumi.<name>.yaml) or path.")],
    since: Annotated[
        str | None, typer.Option("--since", help="The last N UTC days, today included: 30d. Default 30d.")
    ] = None,
    month: Annotated[str | None, typer.Option("--month", help="A calendar month (UTC), e.g. 2026-11.")] = None,
    node_hours: Annotated[
        list[str] | None,
        typer.Option(
            "--node-hours",
            help="GROUP=HOURS the group's nodes ran in the period (from the AWS bill or Cost "
            "Explorer). Default: its min-replica nodes for the whole period (a floor).",
        ),
    ] = None,
    bench: BenchOption = None,
    concurrency: LevelOption = None,
    bench_replicas: ReplicasOption = 1,
    usd_per_hour: PriceOption = None,
    offline: OfflineOption = False,
    redis_url: Annotated[
        str | None,
        typer.Option(
            "--redis-url", help="The gateway's Redis. Default: $LLMSTACK_REDIS_URL, or the running make dev's."
        ),
    ] = None,
    as_json: JsonOption = False,
    as_csv: Annotated[
        bool, typer.Option("--csv", help="Print the rows as CSV (for a spreadsheet or archive).")
    ] = False,
) -> None:
    """Showback: each tenant's and key's tokens by model and their share of the serving cost (node-hours x
    price, split by tokens at each model's rate); capacity nobody used is an `idle` row of its own.
    Usage comes from the gateway's usage ledger in Redis."""
    if as_json and as_csv:
        raise fail("give --json or --csv, not both", ExitCode.UNUSABLE_INPUT)
    spec = load_spec(stack)
    now = datetime.now(UTC)
    try:
        start, end = inputs.report_window(since, month, now)
        given_hours = inputs.group_amounts(spec, node_hours or [], "--node-hours")
    except CostInputError as exc:
        raise fail(str(exc), ExitCode.UNUSABLE_INPUT) from None
    plan, prices, costs = priced(
        spec,
        bench=bench,
        level=concurrency,
        bench_replicas=bench_replicas,
        usd_per_hour=usd_per_hour,
        offline=offline,
        start=start,
        end=end,
    )
    hours = Decimal(str((end - start).total_seconds())) / 3600
    assumed = assumed_node_hours(plan, hours)
    groups = [
        GroupCost(
            node_group=g.name,
            node_hours=given_hours.get(g.name, assumed[g.name]),
            usd_per_node_hour=None if (price := prices[g.name]) is None else price.usd_per_hour,
            assumed_hours=g.name not in given_hours,
        )
        for g in spec.node_groups
    ]
    usage = _usage(redis_url, stack, spec, inputs.days_in(start, end))
    result = showback(usage, groups, model_rates(plan, costs))
    if as_json:
        print(views.report_json(spec.name, result, start, end))
    elif as_csv:
        print(views.report_csv(result, start, end), end="")
    else:
        for table in views.report_tables(spec.name, result, start, end):
            out.print(table)
        for line in result.notes + [line for line in views.cost_notes(costs) if "throughput" in line]:
            out.print(f"  {line}", highlight=False, soft_wrap=True)


def _usage(redis_url: str | None, stack: str, spec: StackSpec, days: list) -> list:
    from redis.exceptions import RedisError

    from ops.devstack.lock import find_running_dev
    from ops.llmctl.cost.usage import read_usage, total_usage
    from ops.llmctl.keys import resolve_redis_url

    dev = find_running_dev() if spec.cloud.provider == "local" else None
    try:
        url = resolve_redis_url(
            redis_url,
            "local" if spec.cloud.provider == "local" else stack,
            dict(os.environ),
            dev.redis_url if dev else None,
        )
    except typer.BadParameter as exc:
        raise fail(f"--redis-url: {exc.message}", ExitCode.UNUSABLE_INPUT) from None
    try:
        return total_usage(read_usage(url, days))
    except (RedisError, OSError) as exc:
        raise fail(
            f"cannot read the usage ledger from Redis: {type(exc).__name__}: {exc}", ExitCode.UNREACHABLE
        ) from None
