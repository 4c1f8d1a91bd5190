"""`make preview|deploy|destroy STACK=name`: the Pulumi CLI, with llmstack's checks first.

Before Pulumi touches an account: the stack must be a cloud stack, the Pulumi CLI and AWS
credentials must be there (one line each saying what to install or set), and `llmctl plan`
must pass (destroy skips the plan: a broken stack file must still be removable). `deploy`
then runs `llmctl doctor --strict` (AWS identity, zones, GPU quotas, instance offerings) and
stops on any failure or any check it could not run, before anything is created.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import typer

from infra.plan.planner import plan_stack
from infra.spec.stack_file import PROJECT_ROOT, StackFileError, load_stack
from ops.llmctl.doctor.checks import PULUMI_INSTALL

ACTIONS = {"preview": ["preview", "--diff"], "deploy": ["up"], "destroy": ["destroy"]}

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def aws_credentials_hint(environ: dict[str, str], home: Path) -> str | None:
    """None when some standard AWS credential source is configured, else what to set.

    This only looks for a source (env keys, a profile, web identity, container credentials,
    the shared files); whether the credentials work is for `llmctl doctor` to check.
    """
    sources = (
        "AWS_ACCESS_KEY_ID",
        "AWS_PROFILE",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    )
    if any(environ.get(name) for name in sources):
        return None
    if (home / ".aws" / "credentials").is_file() or (home / ".aws" / "config").is_file():
        return None
    return (
        "no AWS credentials found: run `aws configure` or `aws sso login`, "
        "or set AWS_PROFILE (or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
    )


def preflight(action: str, stack: str, *, environ: dict[str, str], home: Path) -> str | None:
    """The first reason not to run Pulumi, or None. Pure apart from reading the stack file."""
    try:
        spec = load_stack(stack)
    except StackFileError as exc:
        return str(exc)
    if spec.cloud.provider == "local":
        return (
            f"stack {spec.name} is the local CPU stack: there is nothing to provision. "
            "Run it with `make dev`; deploy a cloud stack with STACK=dev or STACK=prod"
        )
    if shutil.which("pulumi", path=environ.get("PATH")) is None:
        return f"the Pulumi CLI is not installed: see {PULUMI_INSTALL}"
    hint = aws_credentials_hint(environ, home)
    if hint:
        return hint
    if action != "destroy":
        plan = plan_stack(spec)
        if not plan.ok:
            reasons = "; ".join(f"{p.subject}: {p.message}" for p in plan.problems)
            return f"stack {spec.name} does not pass `llmctl plan`: {reasons}"
    return None


@app.command()
def main(
    action: str = typer.Argument(..., help="preview, deploy or destroy"),
    stack: str = typer.Option(..., "--stack", "-s", help="Stack name (Pulumi.<name>.yaml)."),
) -> None:
    if action not in ACTIONS:
        typer.echo(f"unknown action {action!r}; use one of {', '.join(ACTIONS)}", err=True)
        raise typer.Exit(2)
    problem = preflight(action, stack, environ=dict(os.environ), home=Path.home())
    if problem:
        typer.echo(f"make {action}: {problem}", err=True)
        raise typer.Exit(1)
    if action == "preview":
        subprocess.run(
            [sys.executable, "-m", "ops.llmctl.main", "plan", "--stack", stack], check=True, cwd=PROJECT_ROOT
        )
    if action == "deploy":
        doctor = subprocess.run(
            [sys.executable, "-m", "ops.llmctl.main", "doctor", "--stack", stack, "--strict"], cwd=PROJECT_ROOT
        )
        if doctor.returncode:
            typer.echo("make deploy: stopped by llmctl doctor (see above); nothing was created", err=True)
            raise typer.Exit(1)
    # `pulumi stack select --create` makes the stack on first use and keeps Pulumi.<stack>.yaml.
    subprocess.run(["pulumi", "stack", "select", "--create", stack], check=True, cwd=PROJECT_ROOT)
    result = subprocess.run(["pulumi", *ACTIONS[action], "--stack", stack], cwd=PROJECT_ROOT)
    raise typer.Exit(result.returncode)


if __name__ == "__main__":
    app()
