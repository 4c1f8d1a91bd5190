"""Read `Pulumi.<stack>.yaml` into a validated `StackSpec`, or fail with one clear message.

Pulumi stack files keep configuration under `config:` as `<namespace>:<key>` entries.
Ours are `llmstack:<key>` (structured values are allowed, and `pulumi config get
--path` reads them). Other namespaces (`aws:region`, ...) belong to providers; we only
borrow `aws:region` as the default for `llmstack:cloud.region`.

Every error names the file, the key path as written in the file, the bad value and what
would be valid, because the person reading it is editing that file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from infra.spec.schema import SpecError, StackSpec

NAMESPACE = "llmstack"
# Secret config values (`pulumi config set --secret llmstack:<key>`), stored encrypted as
# `{secure: ...}`: only the Pulumi program reads them, through Pulumi's config API.
SECRET_KEYS = frozenset({"hf_token", "redis_password", "redis_ray_password", "redis_autoscaler_password"})
PROJECT_ROOT = Path(__file__).resolve().parents[2]


class StackFileError(Exception):
    """A stack file that cannot be used. `str()` is the whole user-facing message."""


def stack_path(stack: str, root: Path = PROJECT_ROOT) -> Path:
    return root / f"Pulumi.{stack}.yaml"


def available_stacks(root: Path = PROJECT_ROOT) -> list[str]:
    return sorted(p.name[len("Pulumi.") : -len(".yaml")] for p in root.glob("Pulumi.*.yaml"))


def resolve_stack(stack: str | Path, root: Path = PROJECT_ROOT) -> Path:
    """The file of a stack given by name (`prod`) or by path (`path/Pulumi.prod.yaml`)."""
    path = Path(stack) if str(stack).endswith((".yaml", ".yml")) else stack_path(str(stack), root)
    if not path.is_file():
        known = ", ".join(available_stacks(root)) or "none"
        raise StackFileError(f"{path}: no such stack file (stacks here: {known})")
    return path


def stack_name(path: Path) -> str:
    return path.name.removeprefix("Pulumi.").rsplit(".", 1)[0]


def load_stack(stack: str | Path, root: Path = PROJECT_ROOT) -> StackSpec:
    """Load a stack by name (`prod`) or by path (`path/Pulumi.prod.yaml`)."""
    path = resolve_stack(stack, root)
    return spec_from_text(path.read_text(), name=stack_name(path), file_label=path.name)


def spec_from_text(text: str, *, name: str, file_label: str) -> StackSpec:
    try:
        document = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise StackFileError(f"{file_label}: not valid YAML: {exc}") from None
    return spec_from_document(document, name=name, file_label=file_label)


def spec_from_document(document: Any, *, name: str, file_label: str) -> StackSpec:
    """Validate the parsed YAML of a stack file. Pure: tests call it with dicts."""
    if not isinstance(document, dict) or not isinstance(document.get("config"), dict):
        raise StackFileError(f"{file_label}: expected a top-level `config:` mapping with `{NAMESPACE}:` keys")
    config = document["config"]
    raw: dict[str, Any] = {"name": name}
    for key, value in config.items():
        namespace, _, field = str(key).partition(":")
        if namespace == NAMESPACE and field not in SECRET_KEYS:
            raw[field] = value
    cloud = raw.get("cloud")
    if isinstance(cloud, dict) and cloud.get("provider") == "aws" and "region" not in cloud and "aws:region" in config:
        raw["cloud"] = {**cloud, "region": config["aws:region"]}
    try:
        return StackSpec.model_validate(raw)
    except ValidationError as exc:
        raise StackFileError(_describe(exc, raw, file_label)) from None


def _describe(exc: ValidationError, raw: dict[str, Any], file_label: str) -> str:
    lines = []
    for error in exc.errors():
        cause = error.get("ctx", {}).get("error")
        if isinstance(cause, SpecError):  # problems across sections, each with its own key path
            lines += [f"  {NAMESPACE}:{key}: {message}" for key, message in cause.problems]
            continue
        path, value, found = _walk(raw, error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown key (a typo?); " + _valid_keys_hint(path)
        elif error["type"] == "missing":
            message = "required key is missing"
        shown = f" (got {value!r})" if found and error["type"] not in ("extra_forbidden",) else ""
        if error["type"] == "model_type" or isinstance(value, (dict, list)):
            shown = ""
        lines.append(f"  {path or '(top level)'}: {message}{shown}")
    return "\n".join([f"{file_label}: {len(lines)} problem(s) in the stack config:", *lines])


def _walk(raw: Any, loc: tuple[Any, ...]) -> tuple[str, Any, bool]:
    """Turn a pydantic error location into the key path a user sees in the file.

    Tagged unions insert the tag (`aws`, `gpu`, ...) into the location; it is not a key in
    the file, so it is skipped when the current node has no such key.
    """
    node: Any = raw
    parts: list[str] = []
    found = True
    for i, part in enumerate(loc):
        if isinstance(part, int):
            parts.append(f"[{part}]")
            node = node[part] if isinstance(node, list) and part < len(node) else None
            continue
        if isinstance(node, dict) and part not in node and _is_union_tag(node, part):
            continue
        if not parts:
            parts.append(f"{NAMESPACE}:{part}" if part != "name" else "(file name)")
        else:
            parts.append(f".{part}")
        if isinstance(node, dict) and part in node:
            node = node[part]
        else:
            node, found = None, i < len(loc) - 1
    return "".join(parts), node, found


def _is_union_tag(node: dict[str, Any], part: str) -> bool:
    return part in {node.get("provider"), node.get("kind"), node.get("mode"), node.get("method")}


def _valid_keys_hint(path: str) -> str:
    model = _model_at(path)
    if model is None:
        return "valid keys: docs/stack-file.md"
    return "valid keys here: " + ", ".join(model.model_fields)


def _model_at(path: str) -> type[BaseModel] | None:
    """Best-effort: the spec model a dotted key path points into (for 'valid keys' hints)."""
    from infra.spec import schema as spec

    tops = {
        "cloud": None,
        "node_groups": None,
        "models": spec.ModelSpec,
        "redis": None,
        "gateway": spec.Gateway,
        "versions": spec.Versions,
        "model_cache": spec.ModelCache,
    }
    head, *rest = path.removeprefix(f"{NAMESPACE}:").replace("[", ".[").split(".")
    keys = [k for k in rest if not k.startswith("[")][:-1]
    model: type[BaseModel] | None = tops.get(head.split("[")[0])
    for key in keys:
        if model is None:
            return None
        annotation = model.model_fields[key].annotation if key in model.model_fields else None
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return model
