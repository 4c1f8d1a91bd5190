"""`llmctl models sync|ls` against a real S3 HTTP endpoint (moto's server) with real boto3 clients.

The cache folder, stack and bucket are made per test; the endpoint is one server per module.
Checksums are compared with what S3 itself reports, so a test that corrupts an object
changes bytes only, never names, sizes or metadata.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

import boto3
import pytest
from typer.testing import CliRunner

from infra.plan.cache_layout import bucket_name, manifest_key, model_prefix
from infra.render.serve_config import llm_config
from infra.spec.stack_file import load_stack
from ops.harness.local_s3 import MOTO_ACCOUNT
from ops.llmctl.main import app
from ops.llmctl.models.manifest import Manifest
from ops.llmctl.models.sync import MIB, SyncSettings, sync_model
from tests.support.stacks import stack_document, write_stack

PART = 5 * MIB  # S3's smallest part: files above it go multipart
SETTINGS = SyncSettings(part_size=PART, max_concurrency=4)


@pytest.fixture
def stack(tmp_path, aws_env):
    """A cloud stack whose model is cached, its bucket (as `pulumi up` would make it), and a client."""
    name = f"cache-{uuid.uuid4().hex[:8]}"  # one bucket per test on the shared server
    doc = stack_document(
        models=[
            {
                "id": "llama",
                "source": "meta-llama/Llama-3.1-8B-Instruct",
                "node_group": "l4",
                "max_model_len": 8192,
                "cached": True,
            }
        ]
    )
    path = write_stack(tmp_path, name, doc)
    spec = load_stack(path)
    bucket = bucket_name(spec, MOTO_ACCOUNT)
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    return path, spec, bucket, s3


def make_model(folder: Path, *, files: int = 10) -> Path:
    """A Hugging Face-shaped folder: config, tokenizer, and shards (two of them multipart)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"vocab": {"a": 0}}}))
    for i in range(files - 2):
        size = 11 * MIB + i if i < 2 else 64 * 1024 + i  # two shards in three parts each
        (folder / f"model-{i:05d}.safetensors").write_bytes(
            hashlib.sha256(str(i).encode()).digest() * (size // 32) + os.urandom(size % 32)
        )
    (folder / ".cache").mkdir(exist_ok=True)
    (folder / ".cache" / "download-state").write_text("hf bookkeeping, not a model file")
    return folder


def objects(s3, bucket: str, prefix: str) -> dict[str, bytes]:
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix) :]: s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listed}


def run_sync(spec, bucket, s3, folder, tmp_path, **hooks):
    return sync_model(
        s3,
        stack=spec.name,
        bucket=bucket,
        model_id="llama",
        folder=folder,
        settings=SETTINGS,
        cache_dir=tmp_path / "hashes",
        **hooks,
    )


def test_cli_sync_uploads_every_file_and_writes_the_manifest(stack, tmp_path):
    path, spec, bucket, s3 = stack
    folder = make_model(tmp_path / "llama")
    result = CliRunner().invoke(
        app, ["models", "sync", "--stack", str(path), "--model", "llama", "--from", str(folder), "--part-size-mib", "5"]
    )
    assert result.exit_code == 0, result.output
    assert "0 file(s) already cached, 10 to upload" in result.output
    assert f"s3://{bucket}/models/llama" in result.output

    stored = objects(s3, bucket, model_prefix("llama"))
    local = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    assert stored == local  # byte for byte; the hidden .cache folder is not uploaded
    manifest = Manifest.model_validate_json(s3.get_object(Bucket=bucket, Key=manifest_key("llama"))["Body"].read())
    assert {f.path: (f.size, f.sha256) for f in manifest.files} == {
        name: (len(data), hashlib.sha256(data).hexdigest()) for name, data in local.items()
    }
    assert manifest.total_bytes == sum(map(len, local.values())) and manifest.uri() == f"s3://{bucket}/models/llama"
    assert sum(f.s3_checksum.endswith("-3") for f in manifest.files) == 2  # the two multipart shards

    listing = CliRunner().invoke(app, ["models", "ls", "--stack", str(path), "--verify"])
    assert listing.exit_code == 0, listing.output
    assert "llama" in listing.output and "ok (verified)" in listing.output


def test_rerun_skips_unchanged_files_and_uploads_a_changed_one(stack, tmp_path):
    _, spec, bucket, s3 = stack
    folder = make_model(tmp_path / "llama")
    first = run_sync(spec, bucket, s3, folder, tmp_path)
    assert len(first.plan.upload) == 10
    uploaded: list[str] = []
    again = run_sync(spec, bucket, s3, folder, tmp_path, on_file=uploaded.append)
    assert (len(again.plan.upload), len(again.plan.unchanged), uploaded) == (0, 10, [])

    (folder / "tokenizer.json").write_text('{"version": "1.1"}')
    changed = run_sync(spec, bucket, s3, folder, tmp_path, on_file=uploaded.append)
    assert [f.path for f in changed.plan.upload] == ["tokenizer.json"] and changed.plan.changed == ["tokenizer.json"]
    assert uploaded == ["tokenizer.json"]
    assert objects(s3, bucket, model_prefix("llama"))["tokenizer.json"] == b'{"version": "1.1"}'


def test_corrupted_object_is_found_by_checksum_and_replaced(stack, tmp_path):
    path, spec, bucket, s3 = stack
    folder = make_model(tmp_path / "llama")
    run_sync(spec, bucket, s3, folder, tmp_path)
    key = model_prefix("llama") + "model-00000.safetensors"
    original = (folder / "model-00000.safetensors").read_bytes()
    head = s3.head_object(Bucket=bucket, Key=key)
    # Same size, same metadata (it still claims the original sha256), one byte flipped.
    corrupt = original[:100] + bytes([original[100] ^ 0xFF]) + original[101:]
    s3.put_object(Bucket=bucket, Key=key, Body=corrupt, Metadata=head["Metadata"])

    listing = CliRunner().invoke(app, ["models", "ls", "--stack", str(path), "--verify"])
    assert listing.exit_code == 1
    assert "model-00000.safetensors: checksum differs from the manifest" in listing.output

    repaired = run_sync(spec, bucket, s3, folder, tmp_path)
    assert repaired.plan.changed == ["model-00000.safetensors"] and len(repaired.plan.upload) == 1
    assert objects(s3, bucket, model_prefix("llama"))["model-00000.safetensors"] == original


class Interrupted(Exception):
    """Stands in for the operator's Ctrl-C or a dropped connection, part-way through."""


def test_interrupted_sync_resumes_without_uploading_finished_files_again(stack, tmp_path):
    _, spec, bucket, s3 = stack
    folder = make_model(tmp_path / "llama")
    finished: list[str] = []
    sent = 0

    def cut_off(n: int) -> None:
        nonlocal sent
        sent += n
        if sent > 12 * MIB:  # the small files and part of the large shards are through
            raise Interrupted

    settings = SyncSettings(part_size=PART, max_concurrency=2)
    with pytest.raises(Interrupted):
        sync_model(
            s3,
            stack=spec.name,
            bucket=bucket,
            model_id="llama",
            folder=folder,
            settings=settings,
            cache_dir=tmp_path / "hashes",
            on_bytes=cut_off,
            on_file=finished.append,
        )
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket, Prefix="manifests/")  # no manifest: not complete
    stored = set(objects(s3, bucket, model_prefix("llama")))
    assert finished and set(finished) <= stored and len(stored) < 10

    resumed: list[str] = []
    result = sync_model(
        s3,
        stack=spec.name,
        bucket=bucket,
        model_id="llama",
        folder=folder,
        settings=settings,
        cache_dir=tmp_path / "hashes",
        on_file=resumed.append,
    )
    assert not set(resumed) & set(finished)
    assert {f.path for f in result.plan.unchanged} == stored
    assert set(resumed) | stored == {p.name for p in folder.iterdir() if p.is_file()}
    assert not s3.list_multipart_uploads(Bucket=bucket).get("Uploads")  # no orphaned parts left to pay for
    assert len(result.manifest.files) == 10


def test_rendered_llm_config_of_a_cached_model_validates_with_ray_serve_llm(stack):
    from ray.llm._internal.common.utils.cloud_utils import CloudMirrorConfig
    from ray.serve.llm import LLMConfig

    _, spec, bucket, _ = stack
    config = LLMConfig.model_validate(llm_config(spec.model("llama"), spec, bucket))
    source = config.model_loading_config.model_source
    assert isinstance(source, CloudMirrorConfig) and source.storage_type == "s3"
    assert source.bucket_uri == f"s3://{bucket}/models/llama"
    assert config.model_id == "llama"
    with pytest.raises(ValueError, match="model cache bucket"):
        llm_config(spec.model("llama"), spec, None)


def test_ray_downloads_the_synced_folder_from_the_cache(stack, tmp_path):
    """Ray Serve LLM's own S3 downloader (boto3 on the replica's node) reads what sync wrote."""
    from ray.llm._internal.common.utils.cloud_utils import CloudFileSystem

    _, spec, bucket, s3 = stack
    folder = make_model(tmp_path / "llama", files=4)
    run_sync(spec, bucket, s3, folder, tmp_path)
    target = tmp_path / "downloaded"
    CloudFileSystem.download_files(path=str(target), bucket_uri=f"s3://{bucket}/models/llama")
    assert {p.name: p.read_bytes() for p in target.iterdir()} == {
        p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()
    }


def test_aws_errors_are_one_line_without_a_traceback(stack, tmp_path, monkeypatch):
    path, _, _, _ = stack
    folder = make_model(tmp_path / "llama", files=3)
    args = ["models", "sync", "--stack", str(path), "--model", "llama", "--from", str(folder)]

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "no usable AWS credentials" in result.output and "aws sso login" in result.output

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "cannot reach AWS" in result.output


def test_bad_input_names_the_file_key_and_fix(stack, tmp_path):
    path, _, _, _ = stack
    runner = CliRunner()
    result = runner.invoke(app, ["models", "sync", "--stack", str(path), "--model", "nope", "--from", str(tmp_path)])
    assert result.exit_code == 2 and "no model 'nope'" in result.output and path.name in result.output
    result = runner.invoke(app, ["models", "sync", "--stack", str(path), "--model", "llama"])
    assert result.exit_code == 2 and "is a hub id" in result.output and "--from DIR" in result.output
    result = runner.invoke(app, ["models", "sync", "--stack", str(path), "--model", "llama", "--from", str(tmp_path)])
    assert result.exit_code == 2 and "no config.json" in result.output
    result = runner.invoke(app, ["models", "ls", "--stack", "local"])
    assert result.exit_code == 2 and "local stack" in result.output
