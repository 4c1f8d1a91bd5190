"""A generated folder kept in a cache: built once per recipe, in a temporary folder beside its
place and renamed into it, so a reader never sees a half-written one and concurrent builders
(two test workers, `make dev` beside a test) cannot corrupt each other; a folder built from
another recipe (or by an older version of the builder) is replaced."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

MARKER_NAME = ".complete"  # holds the recipe's hash, written last


def is_complete(folder: Path, expected_hash: str) -> bool:
    marker = folder / MARKER_NAME
    return marker.is_file() and marker.read_text().strip() == expected_hash


def ensure_built(target: Path, expected_hash: str, build: Callable[[Path], None]) -> Path:
    """`target`, building it with `build(folder)` first unless its marker holds `expected_hash`.
    Concurrent builds are harmless when `build` is deterministic: the first rename wins."""
    if is_complete(target, expected_hash):
        return target
    cache_dir, name = target.parent, target.name
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=cache_dir))
    try:
        build(tmp)
        (tmp / MARKER_NAME).write_text(expected_hash + "\n")
        if is_complete(target, expected_hash):  # a concurrent build finished first
            return target
        if target.exists():  # built from another recipe or by an older version
            stale = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".stale", dir=cache_dir))
            os.replace(target, stale / name)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if not is_complete(target, expected_hash):  # not just a lost race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
