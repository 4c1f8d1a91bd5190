"""The stack's model cache: one private S3 bucket per stack, and where things live in it.

Where the bucket name comes from (decided here, used by the Pulumi program, `llmctl models
sync|ls`, `llmctl render` and `llmctl doctor`):

- `llmstack:model_cache.bucket` in the stack file, when set; otherwise
- `llmstack-<stack>-models-<account id>`. Bucket names are global across all AWS accounts,
  so a name made of the stack alone would collide between two teams that cloned this
  blueprint; the account id makes it unique, and every consumer can learn it with one STS
  call on the credentials it already needs. No Pulumi CLI and no stack outputs are involved,
  so `llmctl models sync` works before the first `pulumi up` has finished (and from a
  machine without Pulumi). When the name would pass S3's 63-character limit (stack names
  longer than 28 characters), the stack part is shortened and a hash of the full name keeps
  it unique and stable.

Layout inside the bucket:

    models/<model id>/...          the Hugging Face folder, file for file (what Ray downloads)
    loras/<model id>/<adapter id>/ a LoRA adapter's folder (adapter_config.json, safetensors): Ray
                                   Serve LLM's `dynamic_lora_loading_path` is `loras/<model id>`
    manifests/<model id>.json      written last by `llmctl models sync`: files, sizes, checksums
    batches/<file id>              the gateway's Batch API files (uploads, outputs), expired by a
                                   lifecycle rule after gateway.batch.retention_days

The manifest and the adapters sit outside the model's prefix because Ray Serve LLM downloads
everything under `model_source.bucket_uri` into the model folder.

The local stack has no AWS account: `make dev` runs a local S3 (moto) holding one bucket,
`LOCAL_BUCKET`, with the same layout.
"""

from __future__ import annotations

import hashlib

from infra.spec.schema import ModelSpec, StackSpec

MODELS_PREFIX = "models/"
LORAS_PREFIX = "loras/"
LOCAL_BUCKET = "llmstack-local-models"
MANIFESTS_PREFIX = "manifests/"
BATCHES_PREFIX = "batches/"
MAX_BUCKET_NAME = 63


def bucket_name(spec: StackSpec, account_id: str | None) -> str:
    """The cache bucket of a stack. `account_id` may be None only when the stack names its bucket."""
    if spec.model_cache.bucket:
        return spec.model_cache.bucket
    if not account_id:
        raise ValueError(
            f"the model cache bucket of stack {spec.name} is named after the AWS account; "
            "pass the account id or set llmstack:model_cache.bucket"
        )
    name = f"llmstack-{spec.name}-models-{account_id}"
    if len(name) <= MAX_BUCKET_NAME:
        return name
    digest = hashlib.sha256(spec.name.encode()).hexdigest()[:8]
    room = MAX_BUCKET_NAME - len(f"llmstack--{digest}-models-{account_id}")
    return f"llmstack-{spec.name[:room].rstrip('-')}-{digest}-models-{account_id}"


def model_prefix(model_id: str) -> str:
    """Key prefix of a model's files (ends with `/`)."""
    return f"{MODELS_PREFIX}{model_id}/"


def lora_prefix(model_id: str) -> str:
    """Key prefix of a model's adapters, each in its own folder below (ends with `/`)."""
    return f"{LORAS_PREFIX}{model_id}/"


def adapter_prefix(model_id: str, adapter_id: str) -> str:
    """Key prefix of one adapter's files (ends with `/`)."""
    return f"{lora_prefix(model_id)}{adapter_id}/"


def lora_uri(bucket: str, model: ModelSpec) -> str:
    """Ray Serve LLM's `lora_config.dynamic_lora_loading_path` of a model: it fetches the adapter
    `<model>:<id>` from `<this>/<id>/`."""
    return f"s3://{bucket}/{lora_prefix(model.id).rstrip('/')}"


def manifest_key(model_id: str) -> str:
    return f"{MANIFESTS_PREFIX}{model_id}.json"


def model_uri(bucket: str, model: ModelSpec) -> str:
    """`s3://` URI of a cached model's folder: Ray Serve LLM's `model_source.bucket_uri`."""
    return f"s3://{bucket}/{model_prefix(model.id).rstrip('/')}"


def batches_uri(bucket: str) -> str:
    """Where the gateway keeps Batch API files (its `batch_storage_url`)."""
    return f"s3://{bucket}/{BATCHES_PREFIX.rstrip('/')}"


def needs_bucket_name(spec: StackSpec) -> bool:
    """Whether rendering the stack's serve config needs the cache bucket's name."""
    return spec.cloud.provider != "local" and any(m.cached or m.lora for m in spec.models)
