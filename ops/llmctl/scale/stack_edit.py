"""Edit a stack file the way a person would: change the values asked for and nothing else.

A stack file is reviewed like code, and its comments explain choices (why 6 logical CPUs,
why a spot group). So edits go through ruamel.yaml's round-trip mode, which keeps comments,
key order, quoting and flow/block style, with the file's own indentation (guessed from the
file). The result is validated as a stack before anyone writes it.
"""

from __future__ import annotations

import io
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap
from ruamel.yaml.util import load_yaml_guess_indent

from infra.spec.stack_file import NAMESPACE, StackFileError

MODELS_KEY = f"{NAMESPACE}:models"


def _round_trip(text: str) -> tuple[YAML, Any]:
    """A round-trip loader/dumper set to the file's own indentation.

    ruamel guesses the sequence indent and the dash offset; mappings can be indented
    differently from sequences (our stack files: 2 and 4), so the mapping indent is read
    from the first key nested under `config:`.
    """
    _, sequence_indent, dash_offset = load_yaml_guess_indent(text)
    yaml = YAML()  # round-trip mode
    yaml.preserve_quotes = True
    yaml.width = 4096  # never re-wrap a long line someone wrote
    yaml.indent(mapping=_mapping_indent(text), sequence=sequence_indent or 2, offset=dash_offset or 0)
    return yaml, yaml.load(text)


def _mapping_indent(text: str) -> int:
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    for above, line in zip(lines, lines[1:]):
        if above.rstrip().endswith(":") and not above.startswith(" "):
            return (len(line) - len(line.lstrip(" "))) or 2
    return 2


def set_model_autoscaling(text: str, *, file_label: str, model_id: str, changes: dict[str, int | float]) -> str:
    """The stack file `text` with `llmstack:models[id=model_id].autoscaling.<key>` set for
    each of `changes`; creates the `autoscaling:` block when the model has none. Pure."""
    yaml, data = _round_trip(text)
    config = data.get("config") if isinstance(data, dict) else None
    models = config.get(MODELS_KEY) if isinstance(config, dict) else None
    if not isinstance(models, list):
        raise StackFileError(f"{file_label}: no `{MODELS_KEY}` list under `config:`; add the model there first")
    model = next((m for m in models if isinstance(m, dict) and m.get("id") == model_id), None)
    if model is None:
        known = ", ".join(str(m.get("id")) for m in models if isinstance(m, dict)) or "none"
        raise StackFileError(f"{file_label}: {MODELS_KEY} has no model with id {model_id!r} (models: {known})")
    scaling = model.get("autoscaling")
    if scaling is None:
        scaling = model["autoscaling"] = CommentedMap()
    elif not isinstance(scaling, dict):
        index = models.index(model)
        raise StackFileError(
            f"{file_label}: {MODELS_KEY}[{index}].autoscaling must be a mapping, "
            f"got {scaling!r}; write it as `autoscaling: {{min_replicas: 1}}`"
        )
    for key, value in changes.items():
        scaling[key] = value
    out = io.StringIO()
    yaml.dump(data, out)
    return out.getvalue()


def model_autoscaling(text: str, model_id: str) -> dict[str, Any]:
    """The autoscaling keys a model sets in the file (not the defaults), for before/after."""
    _, data = _round_trip(text)
    for m in data.get("config", {}).get(MODELS_KEY, []) or []:
        if isinstance(m, dict) and m.get("id") == model_id:
            return dict(m.get("autoscaling") or {})
    return {}
