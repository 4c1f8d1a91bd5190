"""boto3 for `llmctl`: clients on the standard credential chain, and AWS errors as one line.

Credentials come from wherever the AWS CLI finds them (environment, profile, SSO, web
identity, instance or container role); endpoints honour `AWS_ENDPOINT_URL[_<SERVICE>]`,
which is how the tests point S3 and STS at a local server. Retries are botocore's
`standard` mode (throttling and transient errors back off and retry), so nothing here
retries by hand.

`describe_aws_error` turns what boto3 raises into the single line an operator sees: what
failed and what to do about it. Credentials never appear in it.
"""

from __future__ import annotations

from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
    TokenRetrievalError,
)

RETRIES = Config(retries={"mode": "standard", "max_attempts": 5}, connect_timeout=5, read_timeout=60)

EXPIRED = {
    "ExpiredToken",
    "ExpiredTokenException",
    "RequestExpired",
    "InvalidClientTokenId",
    "UnrecognizedClientException",
    "SignatureDoesNotMatch",
    "InvalidToken",
}
DENIED = {"AccessDenied", "AccessDeniedException", "UnauthorizedOperation", "Forbidden", "403"}
THROTTLED = {
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "SlowDown",
    "TooManyRequestsException",
    "RequestThrottled",
    "503",
}
# The IAM permission each call we make needs, for the access-denied hint.
PERMISSIONS = {
    "GetCallerIdentity": "sts:GetCallerIdentity",
    "GetServiceQuota": "servicequotas:GetServiceQuota",
    "GetAWSDefaultServiceQuota": "servicequotas:GetAWSDefaultServiceQuota",
    "DescribeAvailabilityZones": "ec2:DescribeAvailabilityZones",
    "DescribeInstanceTypeOfferings": "ec2:DescribeInstanceTypeOfferings",
    "DescribeSpotPriceHistory": "ec2:DescribeSpotPriceHistory",
    "DescribeImages": "ecr:DescribeImages",
    "GetRole": "iam:GetRole",
    "GetParameter": "ssm:GetParameter",
    "HeadObject": "s3:GetObject",
    "GetObject": "s3:GetObject",
    "ListObjectsV2": "s3:ListBucket",
    "PutObject": "s3:PutObject",
    "CreateMultipartUpload": "s3:PutObject",
    "UploadPart": "s3:PutObject",
    "CompleteMultipartUpload": "s3:PutObject",
    "ListMultipartUploads": "s3:ListBucketMultipartUploads",
    "AbortMultipartUpload": "s3:AbortMultipartUpload",
    "HeadBucket": "s3:ListBucket",
}
LOGIN_HINT = "run `aws sso login` or `aws configure`, or set AWS_PROFILE"


class AwsProblem(Exception):
    """An AWS failure already described for the operator: `str()` is the whole message."""


def session(region: str) -> boto3.session.Session:
    return boto3.session.Session(region_name=region)


def client(aws: boto3.session.Session, service: str) -> Any:
    # boto3-stubs types a client by its service name as a literal; callers here name it in a str.
    return aws.client(service, config=RETRIES)  # type: ignore[call-overload]


def is_unreachable(exc: BaseException) -> bool:
    """No answer from AWS at all (offline, DNS, proxy): the checks that need it cannot run."""
    return isinstance(exc, (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError))


def describe_aws_error(exc: BaseException, *, doing: str = "") -> str:
    """One line: what failed and the fix. `doing` says what we were doing (`reading the quota ...`)."""
    where = f" {doing}" if doing else ""
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        return f"no usable AWS credentials{where}: {LOGIN_HINT}"
    if isinstance(exc, TokenRetrievalError):
        return f"the AWS SSO session has expired{where}: run `aws sso login` and retry"
    if is_unreachable(exc):
        return f"cannot reach AWS{where} ({exc}): check the network, proxy or AWS_ENDPOINT_URL"
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code, message = str(error.get("Code", "")), error.get("Message") or ""
        operation = exc.operation_name
        if code in EXPIRED:
            return f"AWS credentials are expired or invalid ({code}){where}: {LOGIN_HINT}, then retry"
        if code in DENIED:
            permission = PERMISSIONS.get(operation, operation)
            return f"access denied{where} ({operation}): the identity needs the IAM permission {permission}"
        if code == "NoSuchBucket":
            return (
                f"the model cache bucket does not exist{where}: `make deploy` creates it "
                "(or check llmstack:model_cache.bucket in the stack file)"
            )
        if code in THROTTLED:
            return f"AWS throttled {operation}{where} even after retries ({code}): wait a minute and retry"
        return f"AWS error{where}: {operation} failed with {code}: {message}".rstrip(": ")
    if isinstance(exc, BotoCoreError):
        return f"AWS client error{where}: {exc}"
    raise TypeError(f"not an AWS error: {exc!r}")


def account_id(aws: boto3.session.Session) -> str:
    """The account of the current credentials (STS), or AwsProblem."""
    try:
        return client(aws, "sts").get_caller_identity()["Account"]
    except (BotoCoreError, ClientError) as exc:
        raise AwsProblem(describe_aws_error(exc, doing="asking STS who we are")) from None
