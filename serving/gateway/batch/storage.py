"""Where file bytes live: a local directory (make dev, tests) or S3 (the stack's model-cache bucket,
under `batches/`). Redis holds only the records and the work queue's references; the bytes of an
upload, of a batch's checked request bodies and of a result file are here. Readers take a byte
range (one request body) or a stream of bounded chunks (a download), never more than they need.

`storage_for(url)`: `file:///abs/dir` or `s3://bucket/prefix`. S3 uses boto3 on the standard
credential chain (the pod's IRSA role) and its standard endpoint variables
(`AWS_ENDPOINT_URL_S3`), run in a thread so the event loop never waits on it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit


class StorageError(RuntimeError):
    """The storage could not be read or written; the message names where."""


class FileStorage(Protocol):
    async def put(self, name: str, data: bytes) -> None: ...

    async def get(self, name: str) -> bytes:
        """The bytes stored under `name`; `StorageError` if there are none."""

    async def get_range(self, name: str, start: int, length: int) -> bytes:
        """`length` bytes of `name` from offset `start`; `StorageError` if there are none."""

    def chunks(self, name: str, size: int) -> AsyncGenerator[bytes, None]:
        """The bytes of `name` in chunks of at most `size`; `StorageError` (at the first chunk)
        if there are none."""

    async def delete(self, name: str) -> None:
        """Remove `name`; nothing happens when it is already gone."""


class LocalStorage:
    """One file per name in `root`. Names are file and batch ids (checked against their pattern
    before any lookup), so they never hold a path separator."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, name: str) -> Path:
        if "/" in name or name.startswith("."):
            raise StorageError(f"not a storage name: {name!r}")
        return self.root / name

    async def put(self, name: str, data: bytes) -> None:
        await asyncio.to_thread(self._put, self._path(name), data)

    def _put(self, path: Path, data: bytes) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.part")
        partial.write_bytes(data)
        partial.replace(path)  # whole or absent: a reader never sees half a file

    async def get(self, name: str) -> bytes:
        try:
            return await asyncio.to_thread(self._path(name).read_bytes)
        except OSError as exc:
            raise StorageError(f"cannot read {name} in {self.root}: {exc.strerror}") from None

    async def get_range(self, name: str, start: int, length: int) -> bytes:
        def read() -> bytes:
            with self._path(name).open("rb") as file:
                file.seek(start)
                return file.read(length)

        try:
            return await asyncio.to_thread(read)
        except OSError as exc:
            raise StorageError(f"cannot read {name} in {self.root}: {exc.strerror}") from None

    async def chunks(self, name: str, size: int) -> AsyncGenerator[bytes, None]:
        try:
            file = await asyncio.to_thread(self._path(name).open, "rb")
        except OSError as exc:
            raise StorageError(f"cannot read {name} in {self.root}: {exc.strerror}") from None
        try:
            while chunk := await asyncio.to_thread(file.read, size):
                yield chunk
        finally:
            file.close()

    async def delete(self, name: str) -> None:
        await asyncio.to_thread(self._path(name).unlink, True)


class S3Storage:
    def __init__(self, bucket: str, prefix: str) -> None:
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self._client: Any = None

    def _s3(self) -> Any:
        if self._client is None:
            import boto3  # here: a gateway with local storage needs no boto3

            self._client = boto3.client("s3")
        return self._client

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    async def put(self, name: str, data: bytes) -> None:
        await self._call("put_object", name, Body=data)

    async def get(self, name: str) -> bytes:
        response = await self._call("get_object", name)
        return await asyncio.to_thread(response["Body"].read)

    async def get_range(self, name: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        response = await self._call("get_object", name, Range=f"bytes={start}-{start + length - 1}")
        return await asyncio.to_thread(response["Body"].read)

    async def chunks(self, name: str, size: int) -> AsyncGenerator[bytes, None]:
        from botocore.exceptions import BotoCoreError

        body = (await self._call("get_object", name))["Body"]
        try:
            while True:
                try:
                    chunk = await asyncio.to_thread(body.read, size)
                except BotoCoreError as exc:
                    raise StorageError(
                        f"s3://{self.bucket}/{self._key(name)}: read failed: {type(exc).__name__}"
                    ) from None
                if not chunk:
                    return
                yield chunk
        finally:
            body.close()

    async def delete(self, name: str) -> None:
        await self._call("delete_object", name)

    async def _call(self, operation: str, name: str, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        key = self._key(name)
        try:
            return await asyncio.to_thread(getattr(self._s3(), operation), Bucket=self.bucket, Key=key, **kwargs)
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(f"s3://{self.bucket}/{key}: {operation} failed: {type(exc).__name__}") from None


def storage_for(url: str) -> FileStorage:
    parts = urlsplit(url)
    if parts.scheme == "file" and parts.path.startswith("/"):
        return LocalStorage(Path(unquote(parts.path)))
    if parts.scheme == "s3" and parts.netloc:
        return S3Storage(parts.netloc, parts.path)
    raise ValueError(f"must be file:///absolute/dir or s3://bucket/prefix, got {url!r}")
