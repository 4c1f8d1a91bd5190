"""Pure decisions of the model cache: S3 checksums, what to upload, and AWS errors as one line."""

from __future__ import annotations

import base64
import hashlib

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

from ops.llmctl.aws import describe_aws_error
from ops.llmctl.models.manifest import FileDigest, RemoteObject, plan_sync, s3_checksum, same_checksum
from ops.llmctl.models.sync import SyncSettings, digest_file


def digest(path: str, data: bytes) -> FileDigest:
    whole = hashlib.sha256(data).digest()
    return FileDigest(path=path, size=len(data), sha256=whole.hex(), s3_checksum=s3_checksum([whole], multipart=False))


def test_composite_checksum_is_the_sha256_of_part_digests(tmp_path):
    data = bytes(range(256)) * 100  # 25,600 bytes
    path = tmp_path / "f"
    path.write_bytes(data)
    sha, single = digest_file(path, part_size=10_000, multipart_threshold=1 << 30)
    assert sha == hashlib.sha256(data).hexdigest()
    assert single == base64.b64encode(hashlib.sha256(data).digest()).decode()
    _, composite = digest_file(path, part_size=10_000, multipart_threshold=10_000)
    parts = b"".join(hashlib.sha256(data[i : i + 10_000]).digest() for i in range(0, len(data), 10_000))
    assert composite == base64.b64encode(hashlib.sha256(parts).digest()).decode() + "-3"


def test_s3_reports_composites_with_or_without_the_part_count():
    assert same_checksum("abc=-3", "abc=-3") and same_checksum("abc=-3", "abc=")
    assert not same_checksum("abc=-3", "abd=") and not same_checksum("abc=", None)


def test_plan_uploads_missing_and_different_files_only():
    a, b, c = digest("a", b"aaa"), digest("b", b"bbb"), digest("c", b"ccc")
    remote = {
        "a": RemoteObject(size=3, s3_checksum=a.s3_checksum),
        "b": RemoteObject(size=3, s3_checksum=digest("b", b"BBB").s3_checksum),  # same size, other bytes
        "stale": RemoteObject(size=1, s3_checksum=None),
    }
    plan = plan_sync([a, b, c], remote)
    assert [f.path for f in plan.unchanged] == ["a"]
    assert [f.path for f in plan.upload] == ["b", "c"] and plan.changed == ["b"] and plan.upload_bytes == 6
    # An object uploaded without a SHA-256 checksum cannot be vouched for: upload it again.
    assert plan_sync([a], {"a": RemoteObject(size=3, s3_checksum=None)}).upload == [a]


def test_part_size_grows_like_s3transfer_for_huge_files():
    settings = SyncSettings(part_size=8 * 1024 * 1024)
    assert settings.part_size_for(10 * 1024**3) == 8 * 1024 * 1024
    assert settings.part_size_for(200 * 1024**3) > 8 * 1024 * 1024  # 10,000 parts at most


def client_error(code: str, operation: str, status: int = 400) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, operation
    )


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (NoCredentialsError(), "no usable AWS credentials: run `aws sso login`"),
        (client_error("ExpiredToken", "GetCallerIdentity"), "AWS credentials are expired or invalid (ExpiredToken)"),
        (
            client_error("AccessDenied", "PutObject", 403),
            "access denied (PutObject): the identity needs the IAM permission s3:PutObject",
        ),
        (client_error("SlowDown", "UploadPart", 503), "AWS throttled UploadPart even after retries (SlowDown)"),
        (client_error("NoSuchBucket", "ListObjectsV2", 404), "the model cache bucket does not exist: `make deploy`"),
        (client_error("InternalError", "HeadObject", 500), "AWS error: HeadObject failed with InternalError: m"),
        (EndpointConnectionError(endpoint_url="https://s3.example"), "cannot reach AWS"),
    ],
)
def test_aws_errors_become_one_line(exc, expected):
    line = describe_aws_error(exc)
    assert line.startswith(expected) and "\n" not in line
    assert "testing" not in line  # never a credential
