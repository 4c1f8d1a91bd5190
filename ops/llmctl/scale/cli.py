"""`llmctl scale`: change one model's replica autoscaling, where the change belongs.

The stack file is the only place intent lives, so scaling is an edit of it (comments and
formatting kept), checked by the capacity plan before it is written: a bound the node group
cannot hold is refused with the plan's reason, not discovered later as pending pods.

Then:
- a cloud stack: `make deploy STACK=<stack>` applies it. Replica bounds are Serve
  `deployments:` overrides in the RayService's `serveConfigV2`, which KubeRay hands to Serve;
  Serve applies them to the running replicas in place (no engine restart). KubeRay leaves
  worker-group bounds out of its cluster hash, so no second cluster is started, but for the
  same reason does not copy changed bounds to the running RayCluster: when the plan's pod
  bounds change, the command says so and `llmctl status` shows the patch.
- the local stack with `make dev` running: the new serve config is applied to it now, the
  same declarative way, and the command waits until Serve reports the new bounds.

Exit codes: 0 done, 1 refused by the plan or the live apply failed, 2 stack file unusable.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from infra.plan.planner import StackPlan, plan_stack
from infra.render.serve_config import SERVING_PATH, ServingPath, app_name, llm_deployment_name
from infra.spec.schema import ModelSpec, StackSpec
from infra.spec.stack_file import StackFileError, resolve_stack, spec_from_text, stack_name
from ops.llmctl.console import ExitCode, err, out
from ops.llmctl.plan_view import plan_tables, problem_lines
from ops.llmctl.scale.stack_edit import set_model_autoscaling

LIVE_APPLY_TIMEOUT_S = 600  # new replicas on CPU load their engine in about a minute here

# Stack-file key each option sets (Ray Serve's own names, as in the stack file).
OPTION_KEYS = {"min": "min_replicas", "max": "max_replicas", "target_ongoing": "target_ongoing_requests"}


def scale_changes(minimum: int | None, maximum: int | None, target: float | None) -> dict[str, int | float]:
    """The autoscaling keys to set, from the options given. Pure."""
    given = {"min": minimum, "max": maximum, "target_ongoing": target}
    return {OPTION_KEYS[k]: (int(v) if float(v).is_integer() else v) for k, v in given.items() if v is not None}


def describe_change(before: ModelSpec, after: ModelSpec) -> str:
    """`tiny-chat: min_replicas 1 -> 2, max_replicas 1 -> 2`; only what changed."""
    parts = [
        f"{key} {getattr(before.autoscaling, key):g} -> {getattr(after.autoscaling, key):g}"
        for key in OPTION_KEYS.values()
        if getattr(before.autoscaling, key) != getattr(after.autoscaling, key)
    ]
    return f"{after.id}: " + (", ".join(parts) if parts else "no change")


def cost_line(before: StackPlan, after: StackPlan) -> str | None:
    """GPU node cost per hour at min and max replicas, before and after; None on CPU stacks."""

    def total(plan: StackPlan) -> tuple[float, float] | None:
        lows = [g.usd_per_hour_at_min for g in plan.node_groups if g.usd_per_hour_at_min is not None]
        highs = [g.usd_per_hour_at_max for g in plan.node_groups if g.usd_per_hour_at_max is not None]
        return (sum(lows), sum(highs)) if lows else None

    old, new = total(before), total(after)
    if old is None or new is None:
        return None
    return (
        f"GPU nodes per hour (min - max replicas): ${old[0]:,.2f} - ${old[1]:,.2f} before, "
        f"${new[0]:,.2f} - ${new[1]:,.2f} after"
    )


def blue_green_changes(before: StackPlan, after: StackPlan) -> list[str]:
    """Node groups whose room for a blue/green (NewCluster) upgrade changes. Pure."""
    old = {g.name: g.blue_green for g in before.node_groups}
    return [
        f"blue/green upgrade in node group {g.name}: {old[g.name]} -> {g.blue_green} "
        "(see ops/runbooks/roll-out-a-model.md)"
        for g in after.node_groups
        if g.name in old and old[g.name] != g.blue_green
    ]


def worker_group_changes(before: StackPlan, after: StackPlan) -> list[str]:
    """Worker groups whose pod bounds change: KubeRay does not copy those to a running
    RayCluster (kuberay#2331), so say how to finish the change. Pure."""
    old = {g.name: (g.nodes_at_min, g.nodes_at_max) for g in before.node_groups}
    return [
        f"worker group {g.name}: pods {old[g.name][0]}-{old[g.name][1]} -> {g.nodes_at_min}-{g.nodes_at_max}; "
        "KubeRay does not copy worker-group bounds to the running RayCluster: after make deploy, "
        "`llmctl status` prints the patch to apply (ops/runbooks/scale-a-model.md)"
        for g in after.node_groups
        if g.name in old and old[g.name] != (g.nodes_at_min, g.nodes_at_max)
    ]


def scale(
    stack: Annotated[str, typer.Option("--stack", "-s", help="Stack name (Pulumi.<name>.yaml) or path.")],
    model: Annotated[str, typer.Option("--model", "-m", help="Model id (llmstack:models[].id).")],
    minimum: Annotated[int | None, typer.Option("--min", min=0, help="autoscaling.min_replicas")] = None,
    maximum: Annotated[int | None, typer.Option("--max", min=1, help="autoscaling.max_replicas")] = None,
    target_ongoing: Annotated[
        float | None,
        typer.Option("--target-ongoing", min=0.001, help="autoscaling.target_ongoing_requests (per replica)"),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show the plan; change nothing.")] = False,
    no_apply: Annotated[
        bool, typer.Option("--no-apply", help="Local stack: do not apply to the running make dev.")
    ] = False,
) -> None:
    """Change a model's min/max replicas or target load: stack file, plan and cost, live on make dev.

    Writes the change into the stack file (comments and formatting kept) only if `llmctl plan`
    passes; on the local stack it applies it to the running `make dev`; on a cloud stack it
    says the follow-up (`make deploy`)."""

    changes = scale_changes(minimum, maximum, target_ongoing)
    if not changes:
        err.print("nothing to change: give --min, --max and/or --target-ongoing")
        raise typer.Exit(ExitCode.UNUSABLE_INPUT)
    try:
        path = resolve_stack(stack)
        text = path.read_text()
        name = stack_name(path)
        before = spec_from_text(text, name=name, file_label=path.name)
        new_text = set_model_autoscaling(text, file_label=path.name, model_id=model, changes=changes)
        after = spec_from_text(new_text, name=name, file_label=path.name)
    except StackFileError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(ExitCode.UNUSABLE_INPUT) from None

    old_plan, new_plan = plan_stack(before), plan_stack(after)
    out.print(describe_change(before.model(model), after.model(model)), highlight=False)
    for table in plan_tables(new_plan):
        out.print(table)
    if line := cost_line(old_plan, new_plan):
        out.print(line, highlight=False)
    for line in blue_green_changes(old_plan, new_plan):
        out.print(line, highlight=False)
    if not new_plan.ok:
        for problem in problem_lines(new_plan):
            err.print(problem, highlight=False, soft_wrap=True)
        err.print(
            f"[red]not changed[/red]: {path.name} would not pass `llmctl plan`; "
            "fix what it says (e.g. raise the node group's max_size) or choose other values"
        )
        raise typer.Exit(ExitCode.FAILED)
    if dry_run:
        out.print(f"dry run: {path.name} not changed")
        return
    _write(path, new_text)
    out.print(f"wrote {path.name}", highlight=False)
    if after.cloud.provider != "local":
        out.print(
            f"next: [bold]make deploy STACK={name}[/bold] (replica bounds are applied in place, "
            f"no engine restart), then [bold]llmctl status --stack {name}[/bold]"
        )
        for line in worker_group_changes(old_plan, new_plan):
            out.print(line, highlight=False)
        return
    if no_apply:
        out.print("not applied (--no-apply): the next `make dev` uses the new values")
        return
    _apply_local(after, model, err=err, out=out)


def _write(path: Path, text: str) -> None:
    """Replace the file in one step, so an interrupted write never leaves half a stack."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _apply_local(spec: StackSpec, model_id: str, *, err: Console, out: Console) -> None:
    from ops.devstack import serve as local_serve
    from ops.devstack.lock import NOT_RUNNING, find_running_dev, lock_path
    from ops.devstack.serve import local_serve_config

    dev = find_running_dev()
    if dev is None or dev.ray_address is None or dev.serve_port is None:
        out.print(
            NOT_RUNNING.format(path=lock_path()) + "; the next `make dev` uses the new values",
            highlight=False,
            soft_wrap=True,
        )
        return
    if dev.stack != spec.name:
        out.print(f"the running make dev serves stack {dev.stack!r}, not {spec.name!r}: not applied", highlight=False)
        return
    if dev.trace_endpoint is not None and not spec.observability.tracing.enabled:
        from ops.devstack.runner import traced

        spec = traced(spec, dev.trace_endpoint)  # as it runs, or Serve would restart every engine
    want = spec.model(model_id)
    deployment = llm_deployment_name(want)
    path = ServingPath(dev.serving_path) if dev.serving_path else SERVING_PATH
    out.print(f"applying to the running make dev (pid {dev.pid}) ...", highlight=False)
    try:
        local_serve.connect(dev.ray_address, dev.ray_auth_mode)
        local_serve.deploy(local_serve_config(spec, dev.serve_port, path))
        local_serve.wait_running(
            app_name(want, path),
            timeout_s=LIVE_APPLY_TIMEOUT_S,
            on_change=lambda line: out.print(line, highlight=False),
            settled=lambda app: applied(app, deployment, want),
        )
    except local_serve.ServeUnreachable as exc:
        err.print(f"[red]cluster unreachable[/red]: {exc}; is make dev (pid {dev.pid}) still starting or stopping?")
        raise typer.Exit(ExitCode.FAILED) from None
    except (RuntimeError, TimeoutError) as exc:
        err.print(f"[red]live apply failed[/red]: {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(ExitCode.FAILED) from None
    out.print(f"[green]applied[/green]: {deployment} runs with the new bounds (llmctl status --stack {spec.name})")


def applied(app: dict[str, Any], deployment: str, model: ModelSpec) -> bool:
    """Serve reports the model's new bounds and its running replicas are within them. Pure."""
    details = app.get("deployments", {}).get(deployment)
    if details is None:
        return False
    config = (details.get("deployment_config") or {}).get("autoscaling_config") or {}
    wanted = model.autoscaling
    running = sum(1 for r in details.get("replicas", []) if r.get("state") == "RUNNING")
    return (
        config.get("min_replicas") == wanted.min_replicas
        and config.get("max_replicas") == wanted.max_replicas
        and float(config.get("target_ongoing_requests", -1)) == float(wanted.target_ongoing_requests)
        and wanted.min_replicas <= running <= wanted.max_replicas
    )
