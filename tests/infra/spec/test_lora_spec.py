"""The `lora:` block of a model: each mistake refused with the file, the key and the fix."""

from __future__ import annotations

import pytest

from infra.spec.stack_file import StackFileError, spec_from_document
from tests.support.stacks import stack_document

BASE = "meta-llama/Llama-3.1-8B-Instruct"


def document(**lora: object) -> dict:
    block = {"adapters": [{"id": "support", "source": "s3://adapters/support", "base_model": BASE}], **lora}
    return stack_document(
        models=[{"id": "llama", "source": BASE, "node_group": "l4", "max_model_len": 8192, "lora": block}]
    )


def error_of(doc: dict) -> str:
    with pytest.raises(StackFileError) as info:
        spec_from_document(doc, name="test", file_label="Pulumi.test.yaml")
    return str(info.value)


def test_a_valid_block_loads_with_vllms_defaults():
    spec = spec_from_document(document(), name="test", file_label="Pulumi.test.yaml")
    lora = spec.model("llama").lora
    assert lora is not None
    assert (lora.max_loras, lora.max_lora_rank, lora.cpu_loras, lora.max_adapters_per_replica) == (1, 16, 1, 16)
    assert [a.id for a in lora.adapters] == ["support"]


def test_a_rank_vllm_does_not_take_is_refused_with_the_one_to_use():
    message = error_of(document(max_lora_rank=24))
    assert "Pulumi.test.yaml" in message and "llmstack:models[0].lora.max_lora_rank" in message
    assert "use 32" in message


def test_max_cpu_loras_below_max_loras_is_refused():
    message = error_of(document(max_loras=4, max_cpu_loras=2))
    assert "llmstack:models[0].lora" in message and "raise max_cpu_loras to 4" in message


def test_an_adapter_id_twice_is_refused():
    doc = document()
    adapters = doc["config"]["llmstack:models"][0]["lora"]["adapters"]
    adapters.append(dict(adapters[0]))
    assert "['support'] appear twice" in error_of(doc)


def test_an_adapter_trained_on_another_base_is_refused_at_its_key():
    doc = document()
    doc["config"]["llmstack:models"][0]["lora"]["adapters"][0]["base_model"] = "Qwen/Qwen3-8B"
    message = error_of(doc)
    assert "llmstack:models[0].lora.adapters[0].base_model" in message
    assert "trained on 'Qwen/Qwen3-8B'" in message and BASE in message


def test_an_adapter_trained_on_a_local_copy_of_the_base_is_accepted():
    doc = document()
    doc["config"]["llmstack:models"][0]["lora"]["adapters"][0]["base_model"] = "/data/llama-3.1-8b-instruct/"
    assert spec_from_document(doc, name="test", file_label="Pulumi.test.yaml").model("llama").lora


def test_an_adapter_id_that_is_not_one_key_segment_is_refused():
    doc = document()
    doc["config"]["llmstack:models"][0]["lora"]["adapters"][0]["id"] = "team/support"
    assert "llmstack:models[0].lora.adapters[0].id" in error_of(doc)


def test_lora_engine_args_belong_to_the_lora_block():
    doc = stack_document(
        models=[
            {"id": "llama", "source": BASE, "node_group": "l4", "max_model_len": 8192, "engine_args": {"max_loras": 4}}
        ]
    )
    assert "set these with the model's own keys" in error_of(doc)


def test_two_models_may_not_serve_adapters_of_one_id():
    """Ray Serve LLM keeps a downloaded adapter in a node folder named by its id alone."""
    doc = document()
    [llama] = doc["config"]["llmstack:models"]
    other = {**llama, "id": "llama-2", "served_name": "llama-2"}
    doc["config"]["llmstack:models"].append(other)
    message = error_of(doc)
    assert "llmstack:models[1].lora.adapters[0].id" in message
    assert "model 'llama' already serves an adapter 'support'" in message
