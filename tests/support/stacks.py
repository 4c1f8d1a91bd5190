"""Stack documents for tests: a small valid AWS stack with overrides, written as a stack file."""

from __future__ import annotations

from pathlib import Path

from infra.spec.stack_file import PROJECT_ROOT

EXAMPLE_STACKS = ("local", "dev", "prod")
# Stacks under tests/stacks/ that run on AWS: checked like the example cloud stacks.
TEST_CLOUD_STACKS = (PROJECT_ROOT / "tests" / "stacks" / "Pulumi.karpenter.yaml",)
# The shared/ folder beside the checkout (main) or beside the worktrees' folder (a worktree).
_SHARED = [base / "shared" for base in (PROJECT_ROOT.parent, PROJECT_ROOT.parent.parent)]
SCHEMAS = next((s for s in _SHARED if s.is_dir()), _SHARED[0]) / "schemas" / "kuberay-v1.7.0"
# Karpenter v1.9.0's CRDs and its getting-started CloudFormation (the controller policy), unchanged.
KARPENTER_SCHEMAS = SCHEMAS.parent / "karpenter-v1.9.0"


def stack_document(**overrides: object) -> dict:
    """A small valid stack document (one L4 group, one 8B model) with `llmstack:` overrides."""
    config: dict = {
        "aws:region": "us-east-1",
        "llmstack:cloud": {
            "provider": "aws",
            "availability_zones": ["us-east-1a", "us-east-1b"],
            "upgrade_policy": "standard",
        },
        "llmstack:versions": {
            "gateway_image": "111122223333.dkr.ecr.us-east-1.amazonaws.com/llmstack-gateway:0.1.0",
            "serving_image": "111122223333.dkr.ecr.us-east-1.amazonaws.com/llmstack-serving:0.1.0",
        },
        "llmstack:gateway": {"allow_plaintext": True},
        "llmstack:node_groups": [{"name": "l4", "kind": "gpu", "instance_type": "g6.xlarge", "max_size": 2}],
        "llmstack:models": [
            {"id": "llama", "source": "meta-llama/Llama-3.1-8B-Instruct", "node_group": "l4", "max_model_len": 8192}
        ],
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
