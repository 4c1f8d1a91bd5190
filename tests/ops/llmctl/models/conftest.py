"""A real S3 endpoint (moto's server) for the model cache tests, and this process's AWS clients
pointed at it and at nothing else: no profile, config or credentials file of the machine."""

from __future__ import annotations

import pytest

from ops.harness.local_s3 import LocalS3, running_s3


@pytest.fixture(scope="module")
def local_s3():
    """One server per test module; each test makes its own bucket on it."""
    with running_s3() as server:
        yield server


@pytest.fixture
def aws_env(local_s3, monkeypatch, tmp_path) -> LocalS3:
    """boto3 (ours and Ray's) on `local_s3` with its dummy keys, and llmctl's caches (file
    hashes) under this test's tmp_path."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in local_s3.endpoint_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    return local_s3
