"""`ops.llmctl.scale.stack_edit`: a scale edit changes exactly the asked-for lines of a real stack file."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest
import yaml

from infra.spec.stack_file import PROJECT_ROOT, StackFileError, spec_from_text
from ops.llmctl.scale.stack_edit import set_model_autoscaling

STACK_FILES = sorted([*PROJECT_ROOT.glob("Pulumi.*.yaml"), *(PROJECT_ROOT / "tests" / "stacks").glob("Pulumi.*.yaml")])


def changed_lines(before: str, after: str) -> tuple[list[str], list[str]]:
    diff = list(difflib.unified_diff(before.splitlines(), after.splitlines(), n=0, lineterm=""))
    removed = [line[1:] for line in diff if line.startswith("-") and not line.startswith("---")]
    added = [line[1:] for line in diff if line.startswith("+") and not line.startswith("+++")]
    return removed, added


@pytest.mark.parametrize("path", [p for p in STACK_FILES if p.name != "Pulumi.yaml"], ids=lambda p: p.name)
def test_only_the_changed_values_change_comments_kept(path: Path):
    text = path.read_text()
    models = yaml.safe_load(text)["config"]["llmstack:models"]
    model = models[-1]
    scaling = model.get("autoscaling") or {}
    new_max = scaling.get("max_replicas", 1) + 1
    after = set_model_autoscaling(text, file_label=path.name, model_id=model["id"], changes={"max_replicas": new_max})
    removed, added = changed_lines(text, after)
    if "max_replicas" in scaling:
        assert [r.strip() for r in removed] == [f"max_replicas: {scaling['max_replicas']}"]
        assert [a.strip() for a in added] == [f"max_replicas: {new_max}"]
        assert added[0].replace(str(new_max), str(scaling["max_replicas"])) == removed[0]  # same indentation
    else:  # a new block, added to the model's own entry
        assert removed == [] and [a.strip() for a in added if a.strip()][-1] == f"max_replicas: {new_max}"
    comments = [line for line in text.splitlines() if "#" in line]
    assert comments == [line for line in after.splitlines() if "#" in line]  # every comment, in place
    spec = spec_from_text(after, name="x", file_label=path.name)
    assert spec.model(model["id"]).autoscaling.max_replicas == new_max


def test_creates_the_autoscaling_block_in_the_files_indentation(tmp_path):
    text = (PROJECT_ROOT / "tests" / "stacks" / "Pulumi.draft.yaml").read_text()
    model_id = yaml.safe_load(text)["config"]["llmstack:models"][0]["id"]
    after = set_model_autoscaling(
        text,
        file_label="Pulumi.draft.yaml",
        model_id=model_id,
        changes={"min_replicas": 0, "target_ongoing_requests": 4.5},
    )
    block = after.splitlines()[
        after.splitlines().index(next(line for line in after.splitlines() if line.strip() == "autoscaling:")) :
    ][:3]
    key_indent = len(block[0]) - len(block[0].lstrip())
    assert [len(line) - len(line.lstrip()) for line in block[1:]] == [key_indent + 2, key_indent + 2]
    scaling = spec_from_text(after, name="draft", file_label="x").model(model_id).autoscaling
    assert scaling.target_ongoing_requests == 4.5


def test_unknown_model_names_the_file_and_the_models():
    text = (PROJECT_ROOT / "Pulumi.dev.yaml").read_text()
    expected = r"Pulumi.dev.yaml: llmstack:models has no model with id 'nope' \(models: llama-3-1-8b\)"
    with pytest.raises(StackFileError, match=expected):
        set_model_autoscaling(text, file_label="Pulumi.dev.yaml", model_id="nope", changes={"max_replicas": 2})
