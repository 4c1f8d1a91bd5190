"""How a capacity plan looks in a terminal. Pure: returns rich tables and strings."""

from __future__ import annotations

from rich.table import Table

from infra.plan.latency_target import model_capacities
from infra.plan.planner import StackPlan
from infra.spec.schema import StackSpec

GIB = 1024**3


def _size(n: int) -> str:
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    if n >= 1024**2:
        return f"{n / 1024**2:.1f} MiB"
    return f"{n / 1024:.0f} KiB"


def _money(lo: float | None, hi: float | None) -> str:
    return "-" if lo is None or hi is None else f"${lo:,.2f} - ${hi:,.2f}"


def _cold_start(expected: float | None, timeout: float | None, min_replicas: int) -> str:
    """Expected start from zero replicas; with the gateway's wait for it when the model scales to zero."""
    if expected is None:
        return "-"
    shown = f"~{expected / 60:.0f} min" if expected >= 90 else f"~{expected:.0f} s"
    return f"{shown} (waits {timeout / 60:.0f} min)" if min_replicas == 0 and timeout is not None else shown


def plan_tables(plan: StackPlan) -> list[Table]:
    models = Table(title=f"stack {plan.stack}: models (per replica: GPUs, weights, KV cache)", title_justify="left")
    for column in (
        "model",
        "node group",
        "GPUs",
        "weights",
        "KV/token",
        "KV tokens",
        "seqs@max_len",
        "replicas",
        "nodes",
        "$/hour",
        "cold start",
    ):
        models.add_column(column, justify="left" if column in ("model", "node group") else "right")
    for m in plan.models:
        models.add_row(
            m.model_id,
            m.node_group,
            str(m.gpus_per_replica or "-"),
            _size(m.weight_bytes),
            _size(m.kv_bytes_per_token),
            f"{m.kv_tokens_per_replica:,}",
            f"{m.max_concurrent_sequences:,}",
            f"{m.min_replicas} - {m.max_replicas}",
            f"{m.nodes_at_min} - {m.nodes_at_max}",
            _money(m.usd_per_hour_at_min, m.usd_per_hour_at_max),
            _cold_start(m.cold_start_s, m.cold_start_timeout_s, m.min_replicas),
        )
    if any(m.gpu_memory is not None for m in plan.models):
        models.caption = f"GPU KV cache as vLLM {plan.vllm_version} sizes it (the cluster image's release)"
    groups = Table(title=f"stack {plan.stack}: node groups (on-demand prices, us-east-1)", title_justify="left")
    for column in ("node group", "instance", "capacity", "max_size", "nodes", "blue/green upgrade", "$/hour"):
        groups.add_column(column)
    for g in plan.node_groups:
        groups.add_row(
            g.name,
            g.instance_type or "cpu",
            g.capacity_type,
            str(g.max_size),
            f"{g.nodes_at_min} - {g.nodes_at_max}",
            g.blue_green,
            _money(g.usd_per_hour_at_min, g.usd_per_hour_at_max),
        )
    lows = [g.usd_per_hour_at_min for g in plan.node_groups if g.usd_per_hour_at_min is not None]
    highs = [g.usd_per_hour_at_max for g in plan.node_groups if g.usd_per_hour_at_max is not None]
    if lows:
        groups.caption = (
            f"GPU nodes in total: {_money(sum(lows), sum(highs))} per hour (spot groups shown at on-demand price)"
        )
    lora = [lora_table(plan)] if any(m.lora for m in plan.models) else []
    return [models, groups, *lora, *([ingress_table(plan)] if plan.ingress else [])]


def lora_table(plan: StackPlan) -> Table:
    """LoRA adapters' memory per model: the slots vLLM reserves at start, and the host cache."""
    table = Table(title=f"stack {plan.stack}: LoRA adapters (per rank)", title_justify="left")
    for column in ("model", "slot per adapter", "all slots (max_loras)", "host cache at most (max_cpu_loras)"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for m in plan.models:
        if m.lora is not None:
            table.add_row(
                m.model_id,
                _size(m.lora.slot_bytes_per_adapter),
                _size(m.lora.slots_per_rank),
                _size(m.lora.cpu_cache_bytes_max),
            )
    table.caption = "slots are reserved when the engine starts, out of the KV cache's share on a GPU"
    return table


def ingress_table(plan: StackPlan) -> Table:
    """The serving ingress: LLMRouter replicas sized for the stack's estimated peak tokens/s."""
    ingress = plan.ingress
    assert ingress is not None
    table = Table(
        title=f"stack {plan.stack}: serving ingress (estimates: infra/catalog/serving_estimates.yaml)",
        title_justify="left",
    )
    for column in ("model", "out tok/s per replica", "out tok/s at max_replicas", "LLMRouter replicas at peak"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for m in ingress.models:
        table.add_row(
            m.model_id,
            f"~{m.replica_output_tokens_per_s:,}",
            f"~{m.peak_output_tokens_per_s:,}",
            str(m.routers_at_peak),
        )
    table.caption = (
        f"one LLMRouter replica carries ~{ingress.router_output_tokens_per_s:,} output tok/s; "
        f"{ingress.routers_per_node} per model on each of {ingress.proxy_nodes_at_peak} proxy node(s) "
        f"at peak (RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE); stack peak "
        f"~{ingress.peak_output_tokens_per_s:,} output tok/s"
    )
    return table


def latency_targets(spec: StackSpec, plan: StackPlan) -> dict[str, dict[str, object]]:
    """Served model name -> the latency target the gateway keeps and the bounds its capacity per
    replica moves between (what `llmctl plan --json` prints as `latency_targets`)."""
    return {
        name: {
            "ttft_ms": c.ttft_ms,
            "itl_ms": c.itl_ms,
            "percentile": c.percentile,
            "adaptive": c.adaptive,
            "min_slots": c.min_slots,
            "max_slots": c.max_slots,
        }
        for name, c in model_capacities(spec, plan).items()
    }


def latency_table(spec: StackSpec, plan: StackPlan) -> Table | None:
    """Each model's latency target (stated, or derived from the plan: infra/plan/latency_target.py)
    and the capacity per replica the gateway moves to keep it."""
    targets = latency_targets(spec, plan)
    if not targets:
        return None
    table = Table(
        title=f"stack {plan.stack}: latency targets (the gateway's adaptive capacity keeps them)",
        title_justify="left",
    )
    for column in ("model", "TTFT", "ITL", "percentile", "capacity / replica"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for name, t in targets.items():
        bounds = f"{t['min_slots']} - {t['max_slots']}" if t["adaptive"] else f"{t['max_slots']} (fixed)"
        table.add_row(name, f"{t['ttft_ms']:,.0f} ms", f"{t['itl_ms']:,.0f} ms", f"p{t['percentile']:g}", bounds)
    table.caption = "stated in models[].latency_target, else derived from the plan's throughput estimate"
    return table


def problem_lines(plan: StackPlan) -> list[str]:
    return [f"[red]refused[/red] {p.subject}: [bold]{p.reason.value}[/bold]: {p.message}" for p in plan.problems]
