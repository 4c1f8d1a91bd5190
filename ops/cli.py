"""`llmctl`: the operator's command line. Thin: load the stack, call infra, print.

Exit codes: 0 ok, 1 the stack does not pass its plan, 2 the stack file is unusable.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from infra.planner import plan_stack
from infra.render import RenderRefused, manifest_filename, render_stack, to_yaml
from infra.spec import StackSpec
from infra.stack_file import StackFileError, load_stack
from ops.bench_cli import bench
from ops.keys_cli import app as keys_app
from ops.plan_view import plan_tables, problem_lines

app = typer.Typer(help="Plan, render and operate llmstack stacks.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)
# Piped output (CI logs, README examples) gets a fixed width instead of 80 columns.
app.add_typer(keys_app, name="keys")
app.command("bench")(bench)
out = Console(width=None if sys.stdout.isatty() else 150)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 150)

StackOption = Annotated[str, typer.Option("--stack", "-s", help="Stack name (Pulumi.<name>.yaml) or path.")]


def _load(stack: str) -> StackSpec:
    try:
        return load_stack(stack)
    except StackFileError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


@app.command()
def plan(stack: StackOption, as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Capacity and cost per model; refuses configs that cannot fit (exit 1)."""
    spec = _load(stack)
    result = plan_stack(spec)
    if as_json:
        print(json.dumps({"ok": result.ok, **result.model_dump(mode="json")}, indent=2))
    else:
        for table in plan_tables(result):
            out.print(table)
        for line in problem_lines(result):
            err.print(line, highlight=False, soft_wrap=True)
        if result.ok:
            out.print(f"[green]plan ok[/green]: stack {spec.name} fits.")
    if not result.ok:
        raise typer.Exit(1)


@app.command()
def render(
    stack: StackOption,
    out_dir: Annotated[str, typer.Option("--out", "-o", help="Folder for the YAML files, or - for stdout.")] = "",
) -> None:
    """Kubernetes manifests (RayService, gateway) as YAML, the objects `pulumi up` applies."""
    spec = _load(stack)
    try:
        objects = render_stack(spec)
    except RenderRefused as exc:
        for line in problem_lines(exc.plan):
            err.print(line, highlight=False, soft_wrap=True)
        err.print("[red]not rendered[/red]: fix the plan first (llmctl plan).")
        raise typer.Exit(1) from None
    if out_dir == "-":
        print(to_yaml(objects), end="")
        return
    folder = Path(out_dir or f"build/manifests/{spec.name}")
    folder.mkdir(parents=True, exist_ok=True)
    for obj in objects:
        path = folder / manifest_filename(obj)
        path.write_text(to_yaml([obj]))
        out.print(f"wrote {path}", highlight=False)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
