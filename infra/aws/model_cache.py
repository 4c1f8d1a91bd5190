"""The stack's model cache: a private, encrypted S3 bucket and the role Ray pods read it with.

- The bucket: every public access setting blocked, objects owned by the bucket owner (no
  ACLs), encrypted at rest (SSE-S3 with a bucket key), TLS-only by bucket policy, and a
  lifecycle rule that removes multipart uploads left behind by an interrupted
  `llmctl models sync` after a day (S3 charges for their parts until then), and one that
  deletes the gateway's Batch API files under `batches/` after gateway.batch.retention_days
  (the gateway expires their Redis records at the same age).
- The readers: an IRSA role per Ray service account (the head's `llmstack-ray`, the workers'
  `llmstack-ray-worker`), each assumable by that one account only, allowed to list the
  `models/` and `loras/` prefixes and get their objects, nothing else. The service accounts are created here
  because their annotation is the role's ARN, known only once the role exists; the rendered Ray
  pods name them (`infra.render.rayservice`). The workers' account mounts no Kubernetes API
  token (its pods say so too).
- The batch files role: an IRSA role only the `llmstack-gateway` service account can assume,
  allowed to get, put and delete objects under `batches/` (the gateway's Batch API), nothing
  else; the rendered gateway pods name that service account (`infra.render.gateway`).

Naming and layout of the bucket: `infra.plan.cache_layout`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from infra.aws.iam import irsa_role
from infra.plan.cache_layout import BATCHES_PREFIX, LORAS_PREFIX, MODELS_PREFIX
from infra.render.common import (
    GATEWAY_SERVICE_ACCOUNT,
    NAMESPACE,
    RAY_SERVICE_ACCOUNT,
    RAY_WORKER_SERVICE_ACCOUNT,
    labels,
)

ABORT_INCOMPLETE_UPLOADS_AFTER_DAYS = 1


def reader_policy(bucket: str) -> str:
    """Read-only access to the cached models and their LoRA adapters: list `models/` and `loras/`,
    get objects under them."""
    arn = f"arn:aws:s3:::{bucket}"
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Sid": "ListModels",
                    "Effect": "Allow",
                    "Action": ["s3:ListBucket"],
                    "Resource": arn,
                    "Condition": {"StringLike": {"s3:prefix": [f"{MODELS_PREFIX}*", f"{LORAS_PREFIX}*"]}},
                },
                {
                    "Sid": "ReadModels",
                    "Effect": "Allow",
                    "Action": ["s3:GetObject"],
                    "Resource": [f"{arn}/{MODELS_PREFIX}*", f"{arn}/{LORAS_PREFIX}*"],
                },
            ],
        }
    )


def batch_files_policy(bucket: str) -> str:
    """The gateway's Batch API files: get, put and delete under `batches/`; no listing, no other prefix."""
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Sid": "BatchFiles",
                    "Effect": "Allow",
                    "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
                    "Resource": f"arn:aws:s3:::{bucket}/{BATCHES_PREFIX}*",
                },
            ],
        }
    )


def tls_only_policy(bucket: str) -> str:
    arn = f"arn:aws:s3:::{bucket}"
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Sid": "DenyPlainHttp",
                    "Effect": "Deny",
                    "Principal": "*",
                    "Action": "s3:*",
                    "Resource": [arn, f"{arn}/*"],
                    "Condition": {"Bool": {"aws:SecureTransport": "false"}},
                }
            ],
        }
    )


@dataclass
class ModelCacheArgs:
    stack: str
    bucket: str
    """`infra.plan.cache_layout.bucket_name(spec, account_id)`."""
    oidc_provider_arn: pulumi.Input[str]
    oidc_issuer: pulumi.Input[str]
    k8s_provider: k8s.Provider
    namespace: k8s.core.v1.Namespace
    batch_retention_days: int = 30
    """`gateway.batch.retention_days` of the stack: Batch API files older than this are deleted."""


class ModelCache(pulumi.ComponentResource):
    bucket: pulumi.Output[str]
    reader_role_arn: pulumi.Output[str]
    batch_files_role_arn: pulumi.Output[str]

    def __init__(self, name: str, args: ModelCacheArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llmstack:aws:ModelCache", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        bucket = aws.s3.Bucket(name, bucket=args.bucket, opts=child)
        on_bucket = pulumi.ResourceOptions(parent=bucket)
        blocked = aws.s3.BucketPublicAccessBlock(
            name,
            bucket=bucket.id,
            block_public_acls=True,
            block_public_policy=True,
            ignore_public_acls=True,
            restrict_public_buckets=True,
            opts=on_bucket,
        )
        aws.s3.BucketOwnershipControls(
            name, bucket=bucket.id, rule={"object_ownership": "BucketOwnerEnforced"}, opts=on_bucket
        )
        aws.s3.BucketServerSideEncryptionConfiguration(
            name,
            bucket=bucket.id,
            rules=[
                {"apply_server_side_encryption_by_default": {"sse_algorithm": "AES256"}, "bucket_key_enabled": True}
            ],
            opts=on_bucket,
        )
        aws.s3.BucketLifecycleConfiguration(
            name,
            bucket=bucket.id,
            rules=[
                {
                    "id": "abort-incomplete-uploads",
                    "status": "Enabled",
                    "filter": {"prefix": ""},
                    "abort_incomplete_multipart_upload": {"days_after_initiation": ABORT_INCOMPLETE_UPLOADS_AFTER_DAYS},
                },
                {
                    "id": "expire-batch-files",
                    "status": "Enabled",
                    "filter": {"prefix": BATCHES_PREFIX},
                    "expiration": {"days": args.batch_retention_days},
                },
            ],
            opts=on_bucket,
        )
        # S3 rejects a bucket policy while the public access block is being applied.
        aws.s3.BucketPolicy(
            name,
            bucket=bucket.id,
            policy=tls_only_policy(args.bucket),
            opts=pulumi.ResourceOptions(parent=bucket, depends_on=[blocked]),
        )

        readers = {}
        for suffix, account, api_token in (
            ("reader", RAY_SERVICE_ACCOUNT, True),
            ("worker-reader", RAY_WORKER_SERVICE_ACCOUNT, False),
        ):
            readers[account] = irsa_role(
                f"{name}-{suffix}",
                oidc_provider_arn=args.oidc_provider_arn,
                oidc_issuer=args.oidc_issuer,
                namespace=NAMESPACE,
                service_account=account,
                policy=reader_policy(args.bucket),
                opts=child,
            )
            k8s.core.v1.ServiceAccount(
                account,
                metadata={
                    "name": account,
                    "namespace": NAMESPACE,
                    "labels": labels("ray", args.stack),
                    "annotations": {"eks.amazonaws.com/role-arn": readers[account].arn},
                },
                automount_service_account_token=api_token,
                opts=pulumi.ResourceOptions(parent=self, provider=args.k8s_provider, depends_on=[args.namespace]),
            )
        role = readers[RAY_SERVICE_ACCOUNT]

        batch_role = irsa_role(
            f"{name}-batch-files",
            oidc_provider_arn=args.oidc_provider_arn,
            oidc_issuer=args.oidc_issuer,
            namespace=NAMESPACE,
            service_account=GATEWAY_SERVICE_ACCOUNT,
            policy=batch_files_policy(args.bucket),
            opts=child,
        )
        k8s.core.v1.ServiceAccount(
            GATEWAY_SERVICE_ACCOUNT,
            metadata={
                "name": GATEWAY_SERVICE_ACCOUNT,
                "namespace": NAMESPACE,
                "labels": labels("gateway", args.stack),
                "annotations": {"eks.amazonaws.com/role-arn": batch_role.arn},
            },
            opts=pulumi.ResourceOptions(parent=self, provider=args.k8s_provider, depends_on=[args.namespace]),
        )

        self.bucket = bucket.bucket
        self.reader_role_arn = role.arn
        self.batch_files_role_arn = batch_role.arn
        self.register_outputs(
            {
                "bucket": self.bucket,
                "reader_role_arn": self.reader_role_arn,
                "batch_files_role_arn": self.batch_files_role_arn,
            }
        )
