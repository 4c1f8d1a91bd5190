"""docs/stack-file.md: every key of a stack file, generated from the spec's own models.

The types, defaults, bounds and descriptions are read from the pydantic models in
`infra.spec.schema` (and the gateway policy it extends), so the reference says what validation
enforces. `python -m ops.docs.stack_reference` rewrites the file; `--check` exits 1 when the
checked-in file is not what the models produce (a test runs the same comparison).
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from enum import Enum
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from infra.spec.schema import StackSpec
from infra.spec.stack_file import NAMESPACE, PROJECT_ROOT, SECRET_KEYS

REFERENCE = PROJECT_ROOT / "docs" / "stack-file.md"
REGENERATE = "python -m ops.docs.stack_reference"
# Not a key of the file: the stack's name is the file's (`Pulumi.<name>.yaml`).
DERIVED_FIELDS = {"name"}
# Secrets are read by the Pulumi program through Pulumi's config API, not by the spec's models,
# so their meaning is stated here; `secret_rows` refuses a secret key without one.
SECRET_NOTES = {
    "hf_token": "Hugging Face token, for gated models (`source:` a hub id that needs one).",
    "redis_password": "Password of the gateway's Redis user, for `redis.mode: external`.",
    "redis_ray_password": "Password of Ray GCS's Redis user, for `redis.mode: external`.",
    "redis_autoscaler_password": "Password of Serve's controller's read-only Redis user, for `redis.mode: "
    "external` when a model uses `autoscaling.policy: saturation`.",
}


@dataclass(frozen=True)
class Row:
    key: str  # as written under its parent
    path: str  # the whole key path, e.g. llmstack:gateway.queue.tiers[].name
    type: str
    default: str
    description: str
    bounds: str = ""

    @property
    def meaning(self) -> str:
        return self.description + (f" ({self.bounds})" if self.bounds else "")


@dataclass(frozen=True)
class Section:
    path: str
    title: str
    doc: str
    rows: list[Row]


def _model_variants(annotation: Any) -> list[type[BaseModel]]:
    """The models a field holds: itself, the items of a list, or each member of a union."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _model_variants(get_args(annotation)[0])
    if origin in (list, dict):
        return _model_variants(get_args(annotation)[-1])
    if origin in (Union, types.UnionType):
        return [m for arg in get_args(annotation) for m in _model_variants(arg)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin is Annotated:
        return type_name(args[0])
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return " \\| ".join(names) + (" \\| `null`" if type(None) in args else "")
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"map of {type_name(args[0])} to {type_name(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return " \\| ".join(f"`{m.value}`" for m in annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            return "its keys' defaults"
    elif field.default is PydanticUndefined:
        return "**required**"
    else:
        value = field.default
    return f"`{json.dumps(_plain(value), separators=(', ', ': '))}`"


def bounds_text(field: FieldInfo) -> str:
    """The numeric and length bounds validation enforces, as the reader would write them."""
    bounds = (
        (annotated_types.Ge, "ge", ">= {}"),
        (annotated_types.Gt, "gt", "> {}"),
        (annotated_types.Le, "le", "<= {}"),
        (annotated_types.Lt, "lt", "< {}"),
        (annotated_types.MinLen, "min_length", "length >= {}"),
        (annotated_types.MaxLen, "max_length", "length <= {}"),
    )
    parts = []
    for item in field.metadata:
        parts += [form.format(getattr(item, attr)) for kind, attr, form in bounds if isinstance(item, kind)]
        pattern = getattr(item, "pattern", None)
        if pattern:
            parts.append(f"matches `{pattern}`")
    return "; ".join(parts)


def _discriminator_value(model: type[BaseModel], discriminator: str | None) -> str | None:
    if discriminator is None or discriminator not in model.model_fields:
        return None
    return str(get_args(model.model_fields[discriminator].annotation)[0])


def sections(model: type[BaseModel], path: str, title: str) -> Iterator[Section]:
    """`model`'s own keys, then each nested model's, depth first in field order."""
    rows, nested = [], []
    for name, field in model.model_fields.items():
        if path == NAMESPACE and name in DERIVED_FIELDS:
            continue
        key = f"{path}:{name}" if path == NAMESPACE else f"{path}.{name}"
        variants = _model_variants(field.annotation)
        listed = get_origin(field.annotation) is list
        child_path = key + ("[]" if listed else "")
        discriminator = field.discriminator if isinstance(field.discriminator, str) else None
        if discriminator is None:
            discriminator = _discriminator_in(field.annotation)
        kind = type_name(field.annotation)
        if len(variants) > 1:
            kind = ("list of objects" if listed else "object") + f", {len(variants)} kinds by `{discriminator}`"
        elif variants and listed:
            kind = "list of objects"
        rows.append(
            Row(name, key, kind, default_text(field), " ".join((field.description or "").split()), bounds_text(field))
        )
        for variant in variants:
            value = _discriminator_value(variant, discriminator) if len(variants) > 1 else None
            child_title = f"`{child_path}`" + (f" with `{discriminator}: {value}`" if value else "")
            nested.append((variant, child_path, child_title))
    yield Section(path, title, " ".join((model.__doc__ or "").split()), rows)
    for variant, child_path, child_title in nested:
        yield from sections(variant, child_path, child_title)


def _discriminator_in(annotation: Any) -> str | None:
    """The discriminator of a union nested in `annotation` (a list's items, an optional's value)."""
    if get_origin(annotation) is Annotated:
        for meta in get_args(annotation)[1:]:
            discriminator = getattr(meta, "discriminator", None)
            if isinstance(discriminator, str):
                return discriminator
    for arg in get_args(annotation):
        found = _discriminator_in(arg)
        if found:
            return found
    return None


def undocumented() -> list[str]:
    """Keys whose model gives no description: the reference shows them with none."""
    return [r.path for s in sections(StackSpec, NAMESPACE, f"`{NAMESPACE}:`") for r in s.rows if not r.description]


def secret_rows() -> list[Row]:
    missing = sorted(SECRET_KEYS - SECRET_NOTES.keys())
    if missing:
        raise ValueError(f"secret keys {missing} have no note in ops/docs/stack_reference.py SECRET_NOTES")
    return [Row(key, f"{NAMESPACE}:{key}", "string (secret)", "none", SECRET_NOTES[key]) for key in sorted(SECRET_KEYS)]


def _table(rows: list[Row]) -> list[str]:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    return lines + [f"| `{r.key}` | {r.type} | {r.default} | {_escape_pipes(r.meaning)} |" for r in rows]


def _escape_pipes(text: str) -> str:
    """A `|` inside a table cell would end the cell."""
    return text.replace("|", "\\|")


def render() -> str:
    lines = [
        "# Stack file reference",
        "",
        f"<!-- Generated from infra/spec/schema.py by `{REGENERATE}`; do not edit by hand. -->",
        "",
        "Every key llmstack reads from a stack file (`Pulumi.<stack>.yaml`), under `config:` as",
        f"`{NAMESPACE}:<key>`, with the type, default, bounds and meaning that validation enforces.",
        "Unknown keys are refused (a typo is an error). A worked example and how to read `llmctl plan`",
        "are in [stacks.md](stacks.md). The stack's name is not a key: it is the file's",
        "(`Pulumi.<name>.yaml`); `aws:region` is the default for `llmstack:cloud.region`.",
        "",
    ]
    for section in sections(StackSpec, NAMESPACE, f"`{NAMESPACE}:`"):
        lines += [f"## {section.title}", ""]
        if section.doc:
            lines += [section.doc, ""]
        lines += [*_table(section.rows), ""]
    lines += [
        "## Secrets",
        "",
        f"Set with `pulumi config set --secret {NAMESPACE}:<key> VALUE --stack <stack>`; stored",
        "encrypted in the stack file, read only by the Pulumi program.",
        "",
        *_table(secret_rows()),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/stack-file.md is not current")
    parser.add_argument("--undocumented", action="store_true", help="list keys without a description")
    args = parser.parse_args(argv)
    if args.undocumented:
        print("\n".join(undocumented()))
        return 0
    text = render()
    if args.check:
        current = REFERENCE.read_text() if REFERENCE.is_file() else ""
        if current != text:
            print(f"{REFERENCE.relative_to(PROJECT_ROOT)} is not current: run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    REFERENCE.write_text(text)
    print(f"wrote {REFERENCE.relative_to(PROJECT_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
