"""What `llmctl models sync` records and decides, as pure functions over typed records.

Checksums are S3's own. Every object is uploaded with `ChecksumAlgorithm=SHA256`: S3 checks
each request against it and keeps a SHA-256 checksum of the object that it computed from the
bytes it stored. For a single-request upload that is the SHA-256 of the file; for a multipart
upload it is the SHA-256 of the parts' SHA-256 digests (S3's "composite" checksum, reported
as `<base64>-<parts>`). We compute the same value locally, from the same part layout the
transfer manager uses, and compare it with what S3 reports for the object. So an object
that differs from the local file in any byte (a corrupted, truncated or replaced object)
does not match and is uploaded again, whatever its name, size or metadata say.

The manifest (`manifests/<model>.json`) is written last, so a model with a manifest is a
model whose every file was uploaded and verified.
"""

from __future__ import annotations

import base64
import hashlib
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field


class FileDigest(BaseModel):
    """One file of a model folder, as synced."""

    model_config = ConfigDict(frozen=True)

    path: str = Field(description="Path inside the model folder, `/`-separated.")
    size: int = Field(ge=0, description="Bytes.")
    sha256: str = Field(description="SHA-256 of the whole file, hex (what `sha256sum` prints).")
    s3_checksum: str = Field(description="S3's ChecksumSHA256 for the object, base64 (composite: `<b64>-<parts>`).")


class RemoteObject(BaseModel):
    """What S3 reports about one object (HeadObject with checksum mode enabled)."""

    model_config = ConfigDict(frozen=True)

    size: int
    s3_checksum: str | None = Field(description="None when the object has no SHA-256 checksum.")


class Manifest(BaseModel):
    """`manifests/<model>.json`: one cached model."""

    stack: str
    model_id: str
    bucket: str
    prefix: str = Field(description="Key prefix of the model's files; ends with `/`.")
    files: list[FileDigest]
    synced_at: datetime
    total_bytes: int

    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix.rstrip('/')}"


class SyncPlan(BaseModel):
    upload: list[FileDigest] = Field(description="Missing in S3, or different from the local file.")
    unchanged: list[FileDigest] = Field(description="Already in S3 with the same size and checksum.")
    changed: list[str] = Field(description="Paths present in S3 whose content differs (included in upload).")

    @property
    def upload_bytes(self) -> int:
        return sum(f.size for f in self.upload)


def s3_checksum(part_digests: list[bytes], *, multipart: bool) -> str:
    """S3's ChecksumSHA256 for an object uploaded in these parts (one digest if not multipart)."""
    if not multipart:
        [whole] = part_digests
        return base64.b64encode(whole).decode()
    combined = hashlib.sha256(b"".join(part_digests)).digest()
    return f"{base64.b64encode(combined).decode()}-{len(part_digests)}"


def same_checksum(expected: str, reported: str | None) -> bool:
    """HeadObject reports a composite checksum with or without its `-<parts>` suffix."""
    if reported is None:
        return False
    if "-" in expected and "-" not in reported:
        return expected.split("-", 1)[0] == reported
    return expected == reported


def plan_sync(local: list[FileDigest], remote: dict[str, RemoteObject]) -> SyncPlan:
    """Which files to upload: those S3 does not hold byte for byte. Pure."""
    upload, unchanged, changed = [], [], []
    for digest in local:
        found = remote.get(digest.path)
        if found is not None and found.size == digest.size and same_checksum(digest.s3_checksum, found.s3_checksum):
            unchanged.append(digest)
            continue
        upload.append(digest)
        if found is not None:
            changed.append(digest.path)
    return SyncPlan(upload=upload, unchanged=unchanged, changed=changed)


def verify_against_manifest(manifest: Manifest, remote: dict[str, RemoteObject]) -> list[str]:
    """Problems with a cached model: files the manifest lists that S3 lacks or holds differently."""
    problems = []
    for digest in manifest.files:
        found = remote.get(digest.path)
        if found is None:
            problems.append(f"{digest.path}: missing")
        elif found.size != digest.size:
            problems.append(f"{digest.path}: {found.size} bytes in S3, {digest.size} in the manifest")
        elif not same_checksum(digest.s3_checksum, found.s3_checksum):
            problems.append(f"{digest.path}: checksum differs from the manifest (corrupted or replaced)")
    return problems
