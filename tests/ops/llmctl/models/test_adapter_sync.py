"""A model's LoRA adapters in the model cache, against a real S3 endpoint (moto's server): `llmctl
models sync` uploads them beside the base (a bad one is refused before any byte is uploaded) and
`llmctl doctor` finds what the bucket lacks."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import boto3
import pytest
from typer.testing import CliRunner

from infra.plan.cache_layout import bucket_name
from infra.spec.stack_file import PROJECT_ROOT, load_stack
from ops.devstack.tiny_adapter import RECIPES, write_adapter
from ops.harness.local_s3 import MOTO_ACCOUNT
from ops.llmctl.doctor.adapters import bucket_adapter_problems
from ops.llmctl.main import app
from tests.support.stacks import stack_document, write_stack

TINY = str(PROJECT_ROOT / ".cache" / "llmstack" / "models" / "tiny-llama")


@pytest.fixture
def stack(tmp_path, aws_env):
    adapters = {}
    for adapter_id, recipe in (("sql", "tiny-llama-sql"), ("pirate", "tiny-llama-pirate")):
        adapters[adapter_id] = tmp_path / adapter_id
        write_adapter(adapters[adapter_id], RECIPES[recipe])
    lora = {
        "adapters": [
            {"id": adapter_id, "source": str(folder), "base_model": "tiny-llama"}
            for adapter_id, folder in adapters.items()
        ]
    }
    model = {"id": "tiny", "source": TINY, "node_group": "l4", "max_model_len": 512, "lora": lora}
    path = write_stack(tmp_path, f"lora-{uuid.uuid4().hex[:8]}", stack_document(models=[model]))
    spec = load_stack(path)
    bucket = bucket_name(spec, MOTO_ACCOUNT)
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    return path, spec, bucket, s3, adapters


def keys(s3, bucket: str) -> list[str]:
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", []))


def sync(path: Path):
    return CliRunner().invoke(app, ["models", "sync", "--stack", str(path), "--model", "tiny", "--only-adapters"])


def test_adapters_are_uploaded_beside_the_base_once_and_doctor_finds_them(stack):
    path, spec, bucket, s3, _ = stack
    first = sync(path)
    assert first.exit_code == 0, first.output
    assert keys(s3, bucket) == [
        f"loras/tiny/{a}/{f}" for a in ("pirate", "sql") for f in ("adapter_config.json", "adapter_model.safetensors")
    ]
    assert "tiny:sql" in first.output and "(2 file(s) uploaded)" in first.output
    again = sync(path)
    assert again.exit_code == 0 and again.output.count("(0 file(s) uploaded)") == 2, again.output
    assert bucket_adapter_problems(s3, spec=spec, bucket=bucket) == []


def test_a_bad_adapter_is_refused_and_nothing_is_uploaded(stack):
    path, _, bucket, s3, adapters = stack
    config = adapters["pirate"] / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "r": 64}))
    refused = sync(path)
    assert refused.exit_code == 2
    assert "lora adapter 'pirate'" in refused.output and "rank 64 is above lora.max_lora_rank 16" in refused.output
    assert keys(s3, bucket) == []


def test_doctor_names_each_adapter_the_bucket_lacks(stack):
    path, spec, bucket, s3, _ = stack
    assert sync(path).exit_code == 0
    s3.delete_object(Bucket=bucket, Key="loras/tiny/sql/adapter_model.safetensors")
    s3.delete_object(Bucket=bucket, Key="loras/tiny/pirate/adapter_config.json")
    problems = bucket_adapter_problems(s3, spec=spec, bucket=bucket)
    assert len(problems) == 2
    [pirate, sql] = sorted(problems, key=lambda p: "sql" in p)
    assert f"lora adapter 'pirate': s3://{bucket}/loras/tiny/pirate/ has no readable adapter_config.json" in pirate
    assert f"lora adapter 'sql': s3://{bucket}/loras/tiny/sql/ has no adapter_model.safetensors" in sql
    assert all(p.startswith(f"Pulumi.{spec.name}.yaml") and "--only-adapters" in p for p in problems)
