"""`llmctl doctor`: does the model cache hold every LoRA adapter the stack names, and are they good?

For each adapter, `loras/<model id>/<adapter id>/` must hold adapter_config.json and
adapter_model.safetensors, and the config must pass the checks of `infra.plan.lora_adapters`
(the base it was trained on, its rank, its target modules, the features vLLM refuses). The
tensors were checked when `llmctl models sync` uploaded them; doctor reads no weights.
"""

from __future__ import annotations

import json
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from infra.plan.cache_layout import adapter_prefix
from infra.plan.lora_adapters import CONFIG_FILE, WEIGHTS_FILE, AdapterFiles, adapter_problems
from infra.plan.model_arch import UnknownModelError, architecture_for
from infra.spec.schema import StackSpec
from ops.llmctl.aws import AwsProblem, describe_aws_error


def bucket_adapter_problems(s3: Any, *, spec: StackSpec, bucket: str) -> list[str]:
    """What the bucket lacks or holds wrong of the stack's adapters, one line per adapter, each
    naming the stack file, the adapter and the fix."""
    lines = []
    for model in spec.models:
        if model.lora is None:
            continue
        try:
            arch = architecture_for(model)
        except UnknownModelError:
            continue  # the plan check says so
        for adapter in model.lora.adapters:
            prefix = adapter_prefix(model.id, adapter.id)
            where = f"s3://{bucket}/{prefix}"
            try:
                held = {
                    item["Key"].removeprefix(prefix)
                    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
                    for item in page.get("Contents", [])
                }
                config = None
                if CONFIG_FILE in held:
                    loaded = json.loads(s3.get_object(Bucket=bucket, Key=prefix + CONFIG_FILE)["Body"].read())
                    config = loaded if isinstance(loaded, dict) else None
            except (BotoCoreError, ClientError) as exc:
                raise AwsProblem(describe_aws_error(exc, doing=f"reading {where}")) from None
            except ValueError:
                config = None
            files = AdapterFiles(where=where, config=config, has_weights=WEIGHTS_FILE in held, tensors=None)
            problems = adapter_problems(model, arch, adapter, files)
            if problems:
                lines.append(
                    f"Pulumi.{spec.name}.yaml, model {model.id!r}, lora adapter {adapter.id!r}: "
                    + "; ".join(problems)
                    + f"; then `llmctl models sync --stack {spec.name} --model {model.id} --only-adapters`"
                )
    return lines
