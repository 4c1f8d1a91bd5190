"""Where a model's weights come from: a hub id, or a folder on disk.

Relative folder paths in a stack file are relative to the project root, so the `local`
stack can point at the tiny model under `.cache/` on any clone. That tiny model is made on
first use (`serving.tiny_model`), which is why resolving a source may build it.
"""

from __future__ import annotations

from pathlib import Path

from infra.stack_file import PROJECT_ROOT

TINY_MODELS_DIR = PROJECT_ROOT / ".cache" / "llmstack" / "models"


def is_local_path(source: str) -> bool:
    """Hub ids look like `org/name`; folders start with `/`, `.` or `~`."""
    return source.startswith(("/", ".", "~"))


def resolve_local_source(source: str) -> str:
    """Absolute folder for a local source (building the tiny model if that is what it names);
    hub ids pass through unchanged."""
    if not is_local_path(source):
        return source
    path = Path(source).expanduser()
    if not path.is_absolute():
        path = PROJECT_ROOT / path
    if not path.exists() and path.parent == TINY_MODELS_DIR:
        from serving.tiny_model import RECIPES, ensure_tiny_model

        if path.name in RECIPES:
            ensure_tiny_model(TINY_MODELS_DIR, name=path.name)
    return str(path.resolve())
