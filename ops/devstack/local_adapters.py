"""The local stack's LoRA adapters, served the way the cluster serves them: from S3.

Ray Serve LLM 2.60 fetches an adapter only from an object store (`dynamic_lora_loading_path`
must be s3://, gs:// or azure://; a local folder is refused by its LoraConfig), so `make dev`
runs a local S3 (moto's server, `ops.harness.local_s3`) holding the model cache's layout in one
bucket (`infra.plan.cache_layout.LOCAL_BUCKET`), uploads each adapter's files there (checked
against its base first, as `llmctl models sync` checks them; a fresh bucket each start, so no
digests are compared), and points every Ray process's boto3 at it with the standard
`AWS_ENDPOINT_URL_S3` variables. Ray then downloads `tiny-chat:sql` from
`s3://llmstack-local-models/loras/tiny-chat/sql/` on its first request, as a replica in the
cluster downloads from the stack's bucket.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from infra.plan.cache_layout import LOCAL_BUCKET, adapter_prefix
from infra.plan.lora_adapters import UnreadableAdapter, adapter_problems, read_local_adapter
from infra.plan.model_arch import architecture_for
from infra.spec.model_source import local_folder
from infra.spec.schema import ModelSpec, StackSpec


class LocalAdapterRefused(Exception):
    """A local adapter its model cannot serve; `str()` names the stack file, the adapter and the fix."""


def needs_local_s3(spec: StackSpec) -> bool:
    return any(m.lora is not None for m in spec.models)


def serve_adapters_locally(spec: StackSpec, cleanup: ExitStack, say: Callable[[str], None]) -> dict[str, str]:
    """Start the local S3 (stopped by `cleanup`), upload the stack's adapters; returns the
    environment Ray's processes need to reach it (none when no model serves adapters)."""
    if not needs_local_s3(spec):
        return {}
    import boto3

    from ops.harness.local_s3 import running_s3

    s3_server = cleanup.enter_context(running_s3())
    env = s3_server.endpoint_env()
    client = boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint,
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )
    client.create_bucket(Bucket=LOCAL_BUCKET)
    for model in spec.models:
        if model.lora is not None:
            upload_adapters(client, spec, model)
            ids = ", ".join(f"{model.model_name}:{a.id}" for a in model.lora.adapters)
            say(f"LoRA adapters {ids} in the local S3 ({s3_server.endpoint}, s3://{LOCAL_BUCKET}/loras/)")
    return env


def check_local_adapters(spec: StackSpec) -> None:
    """Refuse the first adapter its model cannot serve (`infra.plan.lora_adapters`), before anything starts."""
    for model in spec.models:
        if model.lora is None:
            continue
        arch = architecture_for(model)
        for adapter in model.lora.adapters:
            try:
                problems = adapter_problems(model, arch, adapter, read_local_adapter(adapter.source))
            except UnreadableAdapter as exc:
                problems = [str(exc)]
            if problems:
                raise LocalAdapterRefused(
                    f"Pulumi.{spec.name}.yaml, model {model.id!r}, lora adapter {adapter.id!r}: " + "; ".join(problems)
                )


def upload_adapters(s3: Any, spec: StackSpec, model: ModelSpec) -> None:
    """Put each file of each adapter of `model` under `loras/<model>/<adapter>/` (checked already)."""
    assert model.lora is not None
    for adapter in model.lora.adapters:
        folder = local_folder(adapter.source)
        for path in sorted(folder.iterdir()):
            if path.is_file() and not path.name.startswith("."):
                s3.upload_file(str(path), LOCAL_BUCKET, adapter_prefix(model.id, adapter.id) + path.name)
