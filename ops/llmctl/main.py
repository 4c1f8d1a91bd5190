"""`llmctl`: the operator's command line. Thin: load the stack, call infra, print.

Exit codes: `ops.llmctl.console.ExitCode`.
"""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path
from typing import Annotated

import typer

from infra.plan.cache_layout import bucket_name, needs_bucket_name
from infra.plan.planner import plan_stack
from infra.render import RenderRefused, manifest_filename, render_stack, to_yaml
from infra.spec.schema import StackSpec
from infra.spec.stack_warnings import stack_warnings
from ops.llmctl.batches import app as batches_app
from ops.llmctl.bench.cli import bench
from ops.llmctl.console import ExitCode, StackOption, err, load_spec, out
from ops.llmctl.cost.cli import app as cost_app
from ops.llmctl.keys import app as keys_app
from ops.llmctl.keys import tenants_app
from ops.llmctl.models.cli import app as models_app
from ops.llmctl.plan_view import latency_table, latency_targets, plan_tables, problem_lines
from ops.llmctl.scale.cli import scale
from ops.llmctl.status.cli import status
from ops.llmctl.trace import trace

app = typer.Typer(
    help="Plan, render and operate llmstack stacks.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(keys_app, name="keys")
app.add_typer(tenants_app, name="tenants")
app.add_typer(batches_app, name="batches")
app.add_typer(models_app, name="models")
app.add_typer(cost_app, name="cost")
app.command()(status)
app.command()(scale)
app.command("bench")(bench)
app.command()(trace)


def _cache_bucket(spec: StackSpec) -> str | None:
    """The cache bucket, when a cached model needs it in the serve config or the gateway keeps
    Batch API files in it. Named after the AWS account unless the stack names it
    (`infra.plan.cache_layout`), so this may ask STS. Only cached models make it required: without
    AWS credentials the gateway is rendered without the Batch API's storage, and that is said."""
    cached = needs_bucket_name(spec)
    if spec.cloud.provider != "aws" or not (cached or spec.gateway.batch.enabled):
        return None
    if spec.model_cache.bucket:
        return spec.model_cache.bucket
    from ops.llmctl import aws

    try:
        return bucket_name(spec, aws.account_id(aws.session(spec.cloud.region)))
    except aws.AwsProblem as exc:
        if not cached:
            err.print(
                f"[yellow]note:[/yellow] the gateway's Batch API keeps its files in the model cache bucket, "
                f"named after the AWS account ({exc}): rendered without it, where `pulumi up` sets it; or set "
                f"llmstack:model_cache.bucket in Pulumi.{spec.name}.yaml",
                highlight=False,
                soft_wrap=True,
            )
            return None
        err.print(
            f"[red]error:[/red] the stack has cached models, so its bucket name is needed and it comes from the "
            f"AWS account: {exc}; or set llmstack:model_cache.bucket in Pulumi.{spec.name}.yaml",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(ExitCode.FAILED) from None


@app.command()
def plan(stack: StackOption, as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Capacity and cost per model; refuses configs that cannot fit (exit 1)."""
    spec = load_spec(stack)
    result = plan_stack(spec)
    warnings = stack_warnings(spec, date.today())
    if as_json:
        print(
            json.dumps(
                {
                    "ok": result.ok,
                    **result.model_dump(mode="json"),
                    "latency_targets": latency_targets(spec, result),
                    "warnings": [w.model_dump() for w in warnings],
                },
                indent=2,
            )
        )
    else:
        for table in plan_tables(result):
            out.print(table)
        latency = latency_table(spec, result)
        if latency is not None:
            out.print(latency)
        for line in problem_lines(result):
            err.print(line, highlight=False, soft_wrap=True)
        for warning in warnings:
            err.print(
                f"[yellow]warning[/yellow] llmstack:{warning.key}: {warning.message}", highlight=False, soft_wrap=True
            )
        if result.ok:
            out.print(f"[green]plan ok[/green]: stack {spec.name} fits.")
    if not result.ok:
        raise typer.Exit(ExitCode.FAILED)


@app.command()
def render(
    stack: StackOption,
    out_dir: Annotated[str, typer.Option("--out", "-o", help="Folder for the YAML files, or - for stdout.")] = "",
) -> None:
    """Kubernetes manifests (RayService, gateway, DCGM exporter) as YAML, the objects `pulumi up` applies."""
    spec = load_spec(stack)
    try:
        objects = render_stack(spec, model_cache_bucket=_cache_bucket(spec))
    except RenderRefused as exc:
        for line in problem_lines(exc.plan):
            err.print(line, highlight=False, soft_wrap=True)
        err.print("[red]not rendered[/red]: fix the plan first (llmctl plan).")
        raise typer.Exit(ExitCode.FAILED) from None
    if out_dir == "-":
        print(to_yaml(objects), end="")
        return
    folder = Path(out_dir or f"build/manifests/{spec.name}")
    folder.mkdir(parents=True, exist_ok=True)
    for obj in objects:
        path = folder / manifest_filename(obj)
        path.write_text(to_yaml([obj]))
        out.print(f"wrote {path}", highlight=False)


@app.command()
def doctor(
    stack: StackOption,
    offline: Annotated[bool, typer.Option("--offline", help="Only the checks that need no network.")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="A check that could not run fails (make deploy).")] = False,
) -> None:
    """Preflight: plan, tools, AWS identity and admins, zones, GPU quotas, offerings, images, spot role, GPU AMI."""
    from ops.llmctl.doctor.checks import Status, exit_code
    from ops.llmctl.doctor.cli import doctor_table, run_doctor

    spec = load_spec(stack)
    checks = run_doctor(spec, offline=offline)
    out.print(doctor_table(spec.name, checks))
    code = exit_code(checks, strict=strict)
    not_run = [c.name for c in checks if c.status is Status.NOT_RUN]
    if not_run:
        err.print(f"could not run: {', '.join(not_run)}", highlight=False, soft_wrap=True)
    if code:
        err.print("[red]doctor: not ready to deploy[/red]; fix the failures above")
        raise typer.Exit(code)
    out.print(f"[green]doctor ok[/green]: stack {spec.name}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
