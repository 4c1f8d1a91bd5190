"""Batch file storage: a local directory, and S3 against a local S3 endpoint (moto's server)."""

from __future__ import annotations

import asyncio

import pytest

from ops.harness.local_s3 import running_s3
from serving.gateway.batch.storage import LocalStorage, S3Storage, StorageError, storage_for


async def round_trip(storage) -> None:
    await storage.put("file-a", b'{"x": 1}\n')
    await storage.put("file-a", b'{"x": 2}\n')  # a redone write replaces
    assert await storage.get("file-a") == b'{"x": 2}\n'
    assert await storage.get_range("file-a", 2, 3) == b'x":'  # one line's body of a lines file
    assert [chunk async for chunk in storage.chunks("file-a", 4)] == [b'{"x"', b": 2}", b"\n"]
    await storage.delete("file-a")
    await storage.delete("file-a")  # already gone: no error
    with pytest.raises(StorageError):
        await storage.get("file-a")
    with pytest.raises(StorageError):
        await storage.get_range("file-a", 0, 1)
    with pytest.raises(StorageError):
        await anext(storage.chunks("file-a", 4))


def test_local_directory(tmp_path) -> None:
    storage = storage_for(f"file://{tmp_path}/files")
    assert isinstance(storage, LocalStorage)
    asyncio.run(round_trip(storage))
    assert [p.name for p in (tmp_path / "files").iterdir()] == []  # no partial files left behind
    with pytest.raises(StorageError):
        asyncio.run(storage.put("../escape", b""))


def test_s3_under_a_prefix(monkeypatch) -> None:
    import boto3

    with running_s3() as s3:
        for name, value in s3.endpoint_env().items():
            monkeypatch.setenv(name, value)
        boto3.client("s3").create_bucket(Bucket="models")
        storage = storage_for("s3://models/batches/")
        assert isinstance(storage, S3Storage)
        asyncio.run(storage.put("file-b", b"line\n"))
        assert [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket="models")["Contents"]] == ["batches/file-b"]
        asyncio.run(round_trip(storage))
        with pytest.raises(StorageError, match="s3://nope/batches/file-c"):
            asyncio.run(storage_for("s3://nope/batches").get("file-c"))


def test_storage_urls_are_checked() -> None:
    for url in ("relative/dir", "file://relative", "s3:///no-bucket", "http://bucket/x"):
        with pytest.raises(ValueError):
            storage_for(url)
