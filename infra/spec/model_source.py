"""Where a model's weights come from: a hub id, or a folder on disk.

Relative folder paths in a stack file are relative to the project root, so the `local`
stack can point at the tiny models under `.cache/` on any clone. Resolving a source never
creates anything: the dev stack builds the tiny models (`ops.devstack.local_models`) before
it plans or renders a stack that names them.
"""

from __future__ import annotations

from pathlib import Path

from infra.spec.stack_file import PROJECT_ROOT


def is_local_path(source: str) -> bool:
    """Hub ids look like `org/name`; folders start with `/`, `.` or `~`."""
    return source.startswith(("/", ".", "~"))


def local_folder(source: str) -> Path:
    """The absolute folder a local source names (relative paths from the project root)."""
    path = Path(source).expanduser()
    if not path.is_absolute():
        path = PROJECT_ROOT / path
    return path.resolve()


def resolve_local_source(source: str) -> str:
    """Absolute folder for a local source; hub ids pass through unchanged."""
    return str(local_folder(source)) if is_local_path(source) else source
