"""The local stack's LoRA adapters, served the way the cluster serves them: from S3.

Ray Serve LLM 2.60 fetches an adapter only from an object store (`dynamic_lora_loading_path`
must be s3://, gs:// or azure://; a local folder is refused by its LoraConfig), so `make dev`
runs a local S3 (moto's server, `ops.harness.local_s3`) holding the model cache's layout in one
bucket (`infra.plan.cache_layout.LOCAL_BUCKET`), uploads each adapter there with `llmctl models
sync`'s own code (checked against its base first), and points every Ray process's boto3 at it
with the standard `AWS_ENDPOINT_URL_S3` variables. Ray then downloads `tiny-chat:sql` from
`s3://llmstack-local-models/loras/tiny-chat/sql/` on its first request, as a replica in the
cluster downloads from the stack's bucket.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

from infra.plan.cache_layout import LOCAL_BUCKET
from infra.spec.schema import StackSpec


def needs_local_s3(spec: StackSpec) -> bool:
    return any(m.lora is not None for m in spec.models)


def serve_adapters_locally(spec: StackSpec, cleanup: ExitStack, say: Callable[[str], None]) -> dict[str, str]:
    """Start the local S3 (stopped by `cleanup`), upload the stack's adapters; returns the
    environment Ray's processes need to reach it (none when no model serves adapters)."""
    if not needs_local_s3(spec):
        return {}
    import boto3

    from ops.harness.local_s3 import running_s3
    from ops.llmctl.models.adapters import sync_adapters

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
            sync_adapters(client, spec=spec, model=model, bucket=LOCAL_BUCKET)
            ids = ", ".join(f"{model.model_name}:{a.id}" for a in model.lora.adapters)
            say(f"LoRA adapters {ids} in the local S3 ({s3_server.endpoint}, s3://{LOCAL_BUCKET}/loras/)")
    return env
