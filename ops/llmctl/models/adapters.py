"""A model's LoRA adapters in its stack's bucket: uploaded beside the base, and checked there.

`sync_adapters` puts each adapter of a model under `loras/<model id>/<adapter id>/`
(`infra.plan.cache_layout`), where Ray Serve LLM fetches it on the first request that names it. An
adapter is checked against its model first (`infra.plan.lora_adapters`): a bad one is refused
before any byte is uploaded, so none reaches a replica. A local folder is uploaded file by file,
only what the bucket does not already hold byte for byte (the model sync's own digests and plan);
an adapter already in S3 elsewhere is copied server side.

`llmctl doctor` checks the bucket holds them (ops/llmctl/doctor/adapters.py).

`make dev` calls `sync_adapters` against its local S3, so the local stack loads adapters the way
the cluster does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from infra.plan.cache_layout import adapter_prefix
from infra.plan.lora_adapters import CONFIG_FILE, UnreadableAdapter, adapter_problems, read_local_adapter
from infra.plan.model_arch import architecture_for
from infra.spec.model_source import is_local_path, local_folder
from infra.spec.schema import LoraAdapter, ModelSpec, StackSpec
from ops.llmctl.aws import AwsProblem, describe_aws_error
from ops.llmctl.models.sync import (
    DEFAULT_CACHE_DIR,
    SyncSettings,
    digest_folder,
    plan_sync,
    remote_objects,
    upload_files,
)


class AdapterRefused(Exception):
    """An adapter that its model cannot serve; `str()` names the stack file, the adapter and the fix."""


def _refusal(spec: StackSpec, model: ModelSpec, adapter: LoraAdapter, problems: list[str]) -> AdapterRefused:
    return AdapterRefused(
        f"Pulumi.{spec.name}.yaml, model {model.id!r}, lora adapter {adapter.id!r}: " + "; ".join(problems)
    )


def sync_adapters(
    s3: Any,
    *,
    spec: StackSpec,
    model: ModelSpec,
    bucket: str,
    settings: SyncSettings | None = None,
    cache_dir: Path = DEFAULT_CACHE_DIR,
    on_adapter: Callable[[str, int], None] = lambda adapter_id, uploaded: None,
) -> None:
    """Check, then upload (or copy) every adapter of `model`; `on_adapter(id, files uploaded)` after each."""
    if model.lora is None:
        return
    settings = settings or SyncSettings()
    arch = architecture_for(model)
    local = [a for a in model.lora.adapters if is_local_path(a.source)]
    for adapter in local:  # every local adapter checked before the first upload
        try:
            problems = adapter_problems(model, arch, adapter, read_local_adapter(adapter.source))
        except UnreadableAdapter as exc:
            problems = [str(exc)]
        if problems:
            raise _refusal(spec, model, adapter, problems)
    for adapter in model.lora.adapters:
        prefix = adapter_prefix(model.id, adapter.id)
        if adapter in local:
            folder = local_folder(adapter.source)
            files = digest_folder(folder, settings, cache_dir, marker=CONFIG_FILE)
            plan = plan_sync(files, remote_objects(s3, bucket, prefix, only={f.path for f in files}))
            upload_files(s3, bucket, prefix, folder, plan.upload, settings)
            on_adapter(adapter.id, len(plan.upload))
        else:
            on_adapter(adapter.id, _copy_prefix(s3, adapter.source, bucket, prefix))


def _copy_prefix(s3: Any, source: str, bucket: str, prefix: str) -> int:
    """Server-side copy of every object under an s3:// prefix; returns how many."""
    source_bucket, _, source_prefix = source.removeprefix("s3://").partition("/")
    source_prefix = source_prefix.rstrip("/") + "/"
    copied = 0
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=source_bucket, Prefix=source_prefix):
            for item in page.get("Contents", []):
                relative = item["Key"].removeprefix(source_prefix)
                s3.copy({"Bucket": source_bucket, "Key": item["Key"]}, bucket, prefix + relative)
                copied += 1
    except (BotoCoreError, ClientError) as exc:
        raise AwsProblem(describe_aws_error(exc, doing=f"copying {source} to s3://{bucket}/{prefix}")) from None
    if not copied:
        raise AwsProblem(f"{source} holds no objects: give the S3 prefix of the adapter's PEFT folder")
    return copied
