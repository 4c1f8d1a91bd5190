"""Stack files: the examples load, and each kind of mistake gets one clear message."""

from __future__ import annotations

import pytest

from infra.spec.schema import CpuNodeGroup, GpuNodeGroup
from infra.spec.stack_file import StackFileError, load_stack, spec_from_document
from tests.support.stacks import stack_document


def load(document: dict):
    return spec_from_document(document, name="test", file_label="Pulumi.test.yaml")


def error_of(document: dict) -> str:
    with pytest.raises(StackFileError) as info:
        load(document)
    return str(info.value)


def test_examples_load(example_stack):
    assert example_stack.models and example_stack.node_groups


def test_prod_has_several_gpu_classes_and_a_tensor_parallel_70b():
    prod = load_stack("prod")
    classes = {g.gpu_class for g in prod.node_groups if isinstance(g, GpuNodeGroup)}
    assert len(classes) >= 3
    big = prod.model("llama-3-3-70b")
    assert big.tensor_parallel_size > 1 and big.autoscaling.max_replicas > big.autoscaling.min_replicas


def test_local_stack_is_cpu_only():
    local = load_stack("local")
    assert all(isinstance(g, CpuNodeGroup) for g in local.node_groups)


def test_region_defaults_from_aws_region():
    spec = load(stack_document())
    assert spec.cloud.region == "us-east-1"


def test_gpu_class_resolves_to_smallest_instance():
    doc = stack_document(node_groups=[{"name": "l4", "kind": "gpu", "gpu_class": "L4", "max_size": 2}])
    assert load(doc).node_groups[0].instance_type == "g6.xlarge"


def test_missing_key_names_file_and_path():
    doc = stack_document(models=[{"id": "llama", "source": "x/y", "node_group": "l4"}])
    message = error_of(doc)
    assert "Pulumi.test.yaml" in message
    assert "llmstack:models[0].max_model_len: required key is missing" in message


def test_wrong_type_shows_value():
    doc = stack_document(models=[{"id": "llama", "source": "x/y", "node_group": "l4", "max_model_len": "long"}])
    assert "llmstack:models[0].max_model_len" in error_of(doc)
    assert "'long'" in error_of(doc)


def test_unknown_gpu_class_lists_valid_ones():
    doc = stack_document(node_groups=[{"name": "l4", "kind": "gpu", "gpu_class": "T4", "max_size": 2}])
    message = error_of(doc)
    assert "llmstack:node_groups[0].gpu_class" in message and "'L4'" in message and "'T4'" in message


def test_unknown_instance_type_lists_catalog():
    doc = stack_document(node_groups=[{"name": "l4", "kind": "gpu", "instance_type": "g4dn.xlarge", "max_size": 2}])
    message = error_of(doc)
    assert "g4dn.xlarge" in message and "g6.xlarge" in message


def test_typo_key_lists_valid_keys():
    doc = stack_document(
        models=[{"id": "llama", "source": "x/y", "node_group": "l4", "max_model_len": 512, "tensor_paralel_size": 2}]
    )
    message = error_of(doc)
    assert "llmstack:models[0].tensor_paralel_size: unknown key" in message
    assert "tensor_parallel_size" in message


def test_unknown_node_group_reference():
    doc = stack_document(models=[{"id": "llama", "source": "x/y", "node_group": "a100", "max_model_len": 512}])
    assert "node_group 'a100' is not defined" in error_of(doc)


def test_sizes_out_of_order():
    doc = stack_document(node_groups=[{"name": "l4", "kind": "gpu", "gpu_class": "L4", "min_size": 3, "max_size": 2}])
    assert "min_size <= desired_size <= max_size" in error_of(doc)


def test_zones_outside_region():
    doc = stack_document(
        cloud={"provider": "aws", "availability_zones": ["eu-west-1a", "eu-west-1b"], "upgrade_policy": "standard"}
    )
    assert "not in region us-east-1" in error_of(doc)


def test_bfloat16_on_cpu_refused_with_reason():
    doc = load_stack("local").model_dump()
    local = {"config": {f"llmstack:{k}": v for k, v in doc.items() if k not in ("name",)}}
    local["config"]["llmstack:models"][0]["dtype"] = "bfloat16"
    local["config"]["llmstack:models"][0]["speculative_decoding"] = None
    assert "use dtype float32" in error_of(local)


def test_engine_args_cannot_shadow_typed_fields():
    doc = stack_document(
        models=[
            {
                "id": "llama",
                "source": "x/y",
                "node_group": "l4",
                "max_model_len": 512,
                "engine_args": {"tensor_parallel_size": 2},
            }
        ]
    )
    assert "set these with the model's own keys" in error_of(doc)


def test_not_a_stack_file():
    assert "top-level `config:`" in error_of({"something": 1})


def test_missing_stack_file_lists_stacks():
    with pytest.raises(StackFileError, match="stacks here: dev, local, prod"):
        load_stack("nope")


def test_secret_config_values_are_left_to_pulumi():
    doc = stack_document()
    doc["config"]["llmstack:hf_token"] = {"secure": "v1:abc"}
    doc["config"]["llmstack:redis_password"] = {"secure": "v1:def"}
    assert load(doc).models
