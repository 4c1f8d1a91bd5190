"""What every `llmctl` command shares: its output streams, the `--stack` option, loading a
stack, and the exit codes scripts can rely on."""

from __future__ import annotations

import sys
from enum import IntEnum
from typing import Annotated

import typer
from rich.console import Console

from infra.spec.schema import StackSpec
from infra.spec.stack_file import StackFileError, load_stack


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1  # the stack does not pass its plan, a check failed, or the action did not happen
    UNUSABLE_INPUT = 2  # the stack file or an argument is unusable: nothing was tried
    UNREACHABLE = 3  # the running stack could not be asked (cluster or make dev not reachable)


# Piped output (CI logs, README examples) gets a fixed width instead of 80 columns.
out = Console(width=None if sys.stdout.isatty() else 150)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 150)

StackOption = Annotated[str, typer.Option("--stack", "-s", help="Stack name (Pulumi.<name>.yaml) or path.")]


def fail(message: str, code: int = ExitCode.FAILED) -> typer.Exit:
    """Print `message` as an error; return the Exit to raise. `code`: an ExitCode, or 130 for an
    interrupted command (the shell's code for SIGINT)."""
    err.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def load_spec(stack: str) -> StackSpec:
    """The stack, validated; exit 2 naming the file and key when it is unusable. A local stack's
    tiny models are built first, so the planner can read their config.json."""
    try:
        spec = load_stack(stack)
    except StackFileError as exc:
        raise fail(str(exc), ExitCode.UNUSABLE_INPUT) from None
    if spec.cloud.provider == "local":
        from ops.devstack.local_models import ensure_local_models

        ensure_local_models(spec)
    return spec
