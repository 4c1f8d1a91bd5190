"""The model cache as `pulumi up` declares it (under Pulumi's mocks) and as the spec names it."""

from __future__ import annotations

import json

import pytest
import yaml

from infra.plan.cache_layout import MAX_BUCKET_NAME, bucket_name
from infra.spec.stack_file import PROJECT_ROOT, StackFileError, spec_from_document
from tests.support.pulumi_program import MOCK_ACCOUNT, example_run, mock_arn, run_program
from tests.support.stacks import stack_document, write_stack

BUCKET = "aws:s3/bucket:Bucket"
RAYSERVICE = "kubernetes:ray.io/v1:RayService"


def cached_stack(tmp_path, **overrides):
    doc = stack_document(
        models=[
            {
                "id": "llama",
                "source": "meta-llama/Llama-3.1-8B-Instruct",
                "node_group": "l4",
                "max_model_len": 8192,
                "cached": True,
            }
        ],
        **overrides,
    )
    write_stack(tmp_path, "cached", doc)
    return run_program("cached", root=tmp_path)


def test_every_cloud_stack_gets_a_private_encrypted_bucket_named_from_stack_and_account():
    run = example_run("prod")
    [bucket] = run.of_type(BUCKET)
    assert bucket.inputs["bucket"] == f"llmstack-prod-models-{MOCK_ACCOUNT}" == run.outputs["model_cache_bucket"]
    [block] = run.of_type("aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock")
    assert all(
        block.inputs[k] is True
        for k in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets")
    )
    [sse] = run.of_type("aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration")
    assert sse.inputs["rules"][0]["applyServerSideEncryptionByDefault"]["sseAlgorithm"] == "AES256"
    [owner] = run.of_type("aws:s3/bucketOwnershipControls:BucketOwnershipControls")
    assert owner.inputs["rule"]["objectOwnership"] == "BucketOwnerEnforced"
    [policy] = run.of_type("aws:s3/bucketPolicy:BucketPolicy")
    [deny] = json.loads(policy.inputs["policy"])["Statement"]
    assert deny["Effect"] == "Deny" and deny["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    [lifecycle] = run.of_type("aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration")
    assert lifecycle.inputs["rules"][0]["abortIncompleteMultipartUpload"]["daysAfterInitiation"] == 1


def test_ray_pods_read_the_cache_through_a_read_only_irsa_role():
    run = example_run("prod")
    role = run.one("aws:iam/role:Role", "model-cache-reader")
    [trust] = json.loads(role.inputs["assumeRolePolicy"])["Statement"]
    assert (
        trust["Condition"]["StringEquals"]["oidc.eks.us-east-1.amazonaws.com/id/ABC:sub"]
        == "system:serviceaccount:llmstack:llmstack-ray"
    )
    policy = json.loads(run.one("aws:iam/rolePolicy:RolePolicy", "model-cache-reader").inputs["policy"])
    actions = {a for s in policy["Statement"] for a in s["Action"]}
    assert actions == {"s3:ListBucket", "s3:GetObject"}
    bucket = f"llmstack-prod-models-{MOCK_ACCOUNT}"
    resources = {
        r for s in policy["Statement"] for r in ([s["Resource"]] if isinstance(s["Resource"], str) else s["Resource"])
    }
    # The models and, beside them, the LoRA adapters Ray Serve LLM fetches (lora_config.dynamic_lora_loading_path).
    assert resources == {f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/models/*", f"arn:aws:s3:::{bucket}/loras/*"}
    [listing] = [s for s in policy["Statement"] if s["Action"] == ["s3:ListBucket"]]
    assert listing["Condition"]["StringLike"]["s3:prefix"] == ["models/*", "loras/*"]
    account = run.one("kubernetes:core/v1:ServiceAccount", "llmstack-ray").inputs
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] == mock_arn("model-cache-reader")
    [rayservice] = run.of_type(RAYSERVICE)
    cluster = rayservice.inputs["spec"]["rayClusterConfig"]
    # Workers have their own account and reader role (tests/infra/aws/test_pod_access.py).
    assert cluster["headGroupSpec"]["template"]["spec"]["serviceAccountName"] == "llmstack-ray"
    assert {g["template"]["spec"]["serviceAccountName"] for g in cluster["workerGroupSpecs"]} == {"llmstack-ray-worker"}
    for account in ("llmstack-ray", "llmstack-ray-worker"):
        assert run.waits_for(rayservice, run.one("kubernetes:core/v1:ServiceAccount", account))


def test_a_cached_model_is_served_from_the_stack_bucket(tmp_path):
    run = cached_stack(tmp_path)
    [rayservice] = run.of_type(RAYSERVICE)
    spec = rayservice.inputs["spec"]
    [config] = yaml.safe_load(spec["serveConfigV2"])["applications"][0]["args"]["llm_configs"]
    assert config["model_loading_config"] == {
        "model_id": "llama",
        "model_source": {"bucket_uri": f"s3://llmstack-cached-models-{MOCK_ACCOUNT}/models/llama"},
    }


def test_a_configured_bucket_name_wins(tmp_path):
    run = cached_stack(tmp_path, model_cache={"bucket": "acme-llm-weights"})
    assert run.one(BUCKET, "model-cache").inputs["bucket"] == "acme-llm-weights"
    [rayservice] = run.of_type(RAYSERVICE)
    assert "s3://acme-llm-weights/models/llama" in rayservice.inputs["spec"]["serveConfigV2"]


def test_long_stack_names_still_give_valid_unique_bucket_names():
    doc = stack_document()
    names = {}
    for stack in ("a" * 40, "a" * 39 + "b", "short"):
        spec = spec_from_document(doc, name=stack, file_label="t")
        names[stack] = bucket_name(spec, "123456789012")
        assert len(names[stack]) <= MAX_BUCKET_NAME and names[stack].endswith("-models-123456789012")
    assert len(set(names.values())) == 3 and names["short"] == "llmstack-short-models-123456789012"
    with pytest.raises(ValueError, match="model_cache.bucket"):
        bucket_name(spec_from_document(doc, name="x", file_label="t"), None)


def test_local_stacks_cannot_use_the_cache():
    local = yaml.safe_load((PROJECT_ROOT / "Pulumi.local.yaml").read_text())
    local["config"]["llmstack:models"][0]["cached"] = True
    with pytest.raises(StackFileError, match="remove cached"):
        spec_from_document(local, name="local", file_label="Pulumi.local.yaml")


def test_bad_bucket_name_names_the_key(tmp_path):
    with pytest.raises(StackFileError) as error:
        spec_from_document(stack_document(model_cache={"bucket": "Bad_Name"}), name="t", file_label="Pulumi.t.yaml")
    assert "llmstack:model_cache.bucket" in str(error.value) and "Pulumi.t.yaml" in str(error.value)


def test_the_gateway_keeps_batch_files_under_batches_with_its_own_irsa_role():
    run = example_run("prod")
    bucket = f"llmstack-prod-models-{MOCK_ACCOUNT}"
    role = run.one("aws:iam/role:Role", "model-cache-batch-files")
    [trust] = json.loads(role.inputs["assumeRolePolicy"])["Statement"]
    assert (
        trust["Condition"]["StringEquals"]["oidc.eks.us-east-1.amazonaws.com/id/ABC:sub"]
        == "system:serviceaccount:llmstack:llmstack-gateway"
    )
    [grant] = json.loads(run.one("aws:iam/rolePolicy:RolePolicy", "model-cache-batch-files").inputs["policy"])[
        "Statement"
    ]
    assert set(grant["Action"]) == {"s3:GetObject", "s3:PutObject", "s3:DeleteObject"}
    assert grant["Resource"] == f"arn:aws:s3:::{bucket}/batches/*"  # never models/: the gateway cannot touch weights
    account = run.one("kubernetes:core/v1:ServiceAccount", "llmstack-gateway").inputs
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] == mock_arn("model-cache-batch-files")
    gateway = run.one("kubernetes:apps/v1:Deployment", "deployment-llmstack-gateway")
    pod = gateway.inputs["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "llmstack-gateway" and pod["automountServiceAccountToken"] is False
    [container] = [c for c in pod["containers"] if c["name"] == "gateway"]
    settings = json.loads(next(e["value"] for e in container["env"] if e["name"] == "LLMSTACK_GATEWAY_SETTINGS"))
    assert settings["batch_storage_url"] == f"s3://{bucket}/batches"
    assert run.waits_for(gateway, run.one("kubernetes:core/v1:ServiceAccount", "llmstack-gateway"))
    [lifecycle] = run.of_type("aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration")
    [expiry] = [r for r in lifecycle.inputs["rules"] if r["id"] == "expire-batch-files"]
    assert expiry["filter"] == {"prefix": "batches/"} and expiry["expiration"] == {"days": 30}
