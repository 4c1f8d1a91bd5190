"""The gateway's Lua scripts, read from the .lua files beside the modules that run them.

Each script is a .lua file in its package, so it reads as Lua (an editor highlights it, a diff
shows it) and ships in the wheel as package data (pyproject's `package-data`). Scripts that share
functions name the files to join, in order: Lua needs a local function defined before its use.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable

SUFFIX = ".lua"


@cache
def lua(package: str, *files: str) -> str:
    """The text of `files` (names in `package`, e.g. "serving.gateway.limits") joined in order."""
    return "".join((resources.files(package) / name).read_text(encoding="utf-8") for name in files)


def shipped(package: str = "serving.gateway") -> dict[str, list[str]]:
    """Every .lua file under `package`, as {package: [file names]}: what the wheel must hold."""
    found: dict[str, list[str]] = {}

    def walk(folder: Traversable, name: str) -> None:
        for entry in sorted(folder.iterdir(), key=lambda e: e.name):
            if entry.is_dir() and entry.name != "__pycache__":
                walk(entry, f"{name}.{entry.name}")
            elif entry.name.endswith(SUFFIX):
                found.setdefault(name, []).append(entry.name)

    walk(resources.files(package), package)
    return found
