"""docs/stack-file.md is generated from the spec's models; a stale copy misleads every reader."""

from ops.docs import stack_reference


def test_the_checked_in_stack_file_reference_is_current():
    current = stack_reference.REFERENCE.read_text()
    assert current == stack_reference.render(), (
        f"docs/stack-file.md is not what infra/spec/schema.py says: run `{stack_reference.REGENERATE}` and commit it"
    )


def test_the_reference_names_every_key_with_a_meaning():
    text = stack_reference.render()
    for key in (
        "`llmstack:models[].autoscaling`",
        "`llmstack:gateway.queue.tiers[]`",
        "`llmstack:redis` with `mode: external`",
        "| `max_model_len` | int | **required** |",
        "| `hf_token` |",
    ):
        assert key in text
    assert stack_reference.undocumented() == []
