"""Stack documents for tests: a small valid AWS stack with overrides, written as a stack file."""

from __future__ import annotations

from pathlib import Path

from infra.stack_file import PROJECT_ROOT

EXAMPLE_STACKS = ("local", "dev", "prod")
SCHEMAS = PROJECT_ROOT.parent / "shared" / "schemas" / "kuberay-v1.7.0"


def stack_document(**overrides: object) -> dict:
    """A small valid stack document (one L4 group, one 8B model) with `llmstack:` overrides."""
    config: dict = {
        "aws:region": "us-east-1",
        "llmstack:cloud": {"provider": "aws", "availability_zones": ["us-east-1a", "us-east-1b"]},
        "llmstack:node_groups": [{"name": "l4", "kind": "gpu", "instance_type": "g6.xlarge", "max_size": 2}],
        "llmstack:models": [{"id": "llama", "source": "meta-llama/Llama-3.1-8B-Instruct", "node_group": "l4",
                             "max_model_len": 8192}],
        "llmstack:redis": {"mode": "in_cluster"},
    }
    for key, value in overrides.items():
        config[f"llmstack:{key}"] = value
    return {"config": config}


def write_stack(folder: Path, name: str, document: dict) -> Path:
    import yaml

    path = folder / f"Pulumi.{name}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path
