"""`llmctl models sync|ls`: the I/O around `ops.llmctl.models.manifest`'s decisions.

sync, in order:
1. hash the local folder (SHA-256 of each file and of each upload part; results are kept
   in a small cache keyed by path, size and mtime, so an unchanged folder is not re-read);
2. ask S3 what it holds under `models/<model>/` (ListObjectsV2, then HeadObject with
   checksum mode for the files it lists), and upload only what differs;
3. abort multipart uploads that an interrupted earlier run left under that prefix;
4. upload with one boto3 transfer manager for all files (parallel multipart, SHA-256
   checksums that S3 verifies per request), reporting bytes as they go;
5. re-read the uploaded objects' checksums from S3, then write the manifest.

Resuming: files finished before an interruption match in step 2 and are skipped; a file
cut off mid-way starts again (s3transfer cannot continue another process's multipart upload,
and step 3 removes its parts). The bucket's lifecycle rule cleans up the same after a day.
Run one sync per model at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.exceptions import BotoCoreError, ClientError
from s3transfer.subscribers import BaseSubscriber
from s3transfer.utils import ChunksizeAdjuster

from infra.plan.cache_layout import MANIFESTS_PREFIX, manifest_key, model_prefix
from ops.llmctl.aws import AwsProblem, describe_aws_error
from ops.llmctl.models.manifest import FileDigest, Manifest, RemoteObject, SyncPlan, plan_sync, s3_checksum

MIB = 1024 * 1024
READ_BLOCK = 8 * MIB
DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llmstack" / "file-hashes"


@dataclass(frozen=True)
class SyncSettings:
    """Upload shape. 64 MiB parts keep a 5 GB shard at 80 requests (S3 allows 10,000 parts);
    16 parallel requests keep a node's network busy without hitting S3's per-prefix limits."""

    part_size: int = 64 * MIB
    max_concurrency: int = 16

    def transfer_config(self) -> TransferConfig:
        return TransferConfig(
            multipart_threshold=self.part_size,
            multipart_chunksize=self.part_size,
            max_concurrency=self.max_concurrency,
            use_threads=True,
        )

    def part_size_for(self, size: int) -> int:
        """The part size s3transfer will use for a file of this size (it grows parts past 10,000)."""
        return ChunksizeAdjuster().adjust_chunksize(self.part_size, size)


@dataclass
class SyncResult:
    manifest: Manifest
    plan: SyncPlan
    aborted_uploads: int


# --- the local folder --------------------------------------------------------------------


class ModelFolderError(Exception):
    """The folder given to sync is not a usable model folder."""


def model_files(folder: Path, marker: str = "config.json") -> list[Path]:
    """Every file of a Hugging Face folder, hidden ones excluded (`hf download --local-dir`
    keeps its own bookkeeping in `.cache/`; `.git*` files are not model files). `marker`: the
    file that says what the folder is (a LoRA adapter's: adapter_config.json)."""
    if not folder.is_dir():
        raise ModelFolderError(f"{folder}: no such folder")
    if not (folder / marker).is_file():
        raise ModelFolderError(f"{folder}: no {marker}, so not a Hugging Face model folder")
    files = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if path.is_file() and not any(part.startswith(".") for part in relative.parts):
            files.append(path)
    return files


def digest_file(path: Path, part_size: int, multipart_threshold: int) -> tuple[str, str]:
    """(SHA-256 hex of the file, S3's checksum for it uploaded in `part_size` parts)."""
    whole, parts = hashlib.sha256(), []
    part, in_part = hashlib.sha256(), 0
    with path.open("rb") as handle:
        while block := handle.read(min(READ_BLOCK, part_size - in_part)):
            whole.update(block)
            part.update(block)
            in_part += len(block)
            if in_part == part_size:
                parts.append(part.digest())
                part, in_part = hashlib.sha256(), 0
    if in_part or not parts:
        parts.append(part.digest())
    size = path.stat().st_size
    multipart = size >= multipart_threshold
    return whole.hexdigest(), s3_checksum(parts if multipart else [whole.digest()], multipart=multipart)


class HashCache:
    """Digests of a folder's files by (size, mtime, part size): what `git status` and rsync
    trust too. A file rewritten in place keeps neither its mtime nor, usually, its size."""

    def __init__(self, folder: Path, cache_dir: Path) -> None:
        key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
        self.path = cache_dir / f"{key}.json"
        try:
            self.entries: dict[str, dict] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.entries = {}

    def get(self, relative: str, stat: os.stat_result, part_size: int) -> tuple[str, str] | None:
        entry = self.entries.get(relative)
        if entry and (entry["size"], entry["mtime_ns"], entry["part_size"]) == (
            stat.st_size,
            stat.st_mtime_ns,
            part_size,
        ):
            return entry["sha256"], entry["s3_checksum"]
        return None

    def put(self, relative: str, stat: os.stat_result, part_size: int, digests: tuple[str, str]) -> None:
        self.entries[relative] = {
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "part_size": part_size,
            "sha256": digests[0],
            "s3_checksum": digests[1],
        }

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.entries))


def digest_folder(
    folder: Path, settings: SyncSettings, cache_dir: Path = DEFAULT_CACHE_DIR, marker: str = "config.json"
) -> list[FileDigest]:
    cache = HashCache(folder, cache_dir)
    files = model_files(folder, marker)

    def one(path: Path) -> FileDigest:
        relative, stat = path.relative_to(folder).as_posix(), path.stat()
        part_size = settings.part_size_for(stat.st_size)
        digests = cache.get(relative, stat, part_size)
        if digests is None:
            digests = digest_file(path, part_size, settings.part_size)
            cache.put(relative, stat, part_size, digests)
        return FileDigest(path=relative, size=stat.st_size, sha256=digests[0], s3_checksum=digests[1])

    # hashlib releases the GIL on large blocks, so files hash in parallel.
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(one, files))
    cache.save()
    return digests


# --- S3 ----------------------------------------------------------------------------------


def _aws(doing: str) -> Callable[[BaseException], AwsProblem]:
    return lambda exc: AwsProblem(describe_aws_error(exc, doing=doing))


def remote_objects(s3, bucket: str, prefix: str, *, only: set[str] | None = None) -> dict[str, RemoteObject]:
    """What S3 holds under `prefix`, keyed by path below it, with S3's SHA-256 checksums."""
    try:
        listed = [
            item["Key"][len(prefix) :]
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for item in page.get("Contents", [])
        ]
        wanted = [path for path in listed if only is None or path in only]

        def head(path: str) -> tuple[str, RemoteObject]:
            found = s3.head_object(Bucket=bucket, Key=prefix + path, ChecksumMode="ENABLED")
            return path, RemoteObject(size=found["ContentLength"], s3_checksum=found.get("ChecksumSHA256"))

        with ThreadPoolExecutor(max_workers=16) as pool:
            return dict(pool.map(head, wanted))
    except (BotoCoreError, ClientError) as exc:
        raise _aws(f"reading s3://{bucket}/{prefix}")(exc) from None


def abort_stale_uploads(s3, bucket: str, prefix: str) -> int:
    """Abort multipart uploads an interrupted run left under `prefix`; returns how many."""
    try:
        uploads = [
            u
            for page in s3.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix)
            for u in page.get("Uploads", [])
        ]
        for upload in uploads:
            s3.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        return len(uploads)
    except (BotoCoreError, ClientError) as exc:
        raise _aws(f"cleaning up interrupted uploads in s3://{bucket}/{prefix}")(exc) from None


class _Report(BaseSubscriber):
    def __init__(self, path: str, on_bytes: Callable[[int], None], on_file: Callable[[str], None]) -> None:
        self.path, self.on_bytes, self.on_file = path, on_bytes, on_file

    def on_progress(self, future, bytes_transferred: int, **kwargs) -> None:
        self.on_bytes(bytes_transferred)

    def on_done(self, future, **kwargs) -> None:
        if future.meta.size is not None and not _failed(future):
            self.on_file(self.path)


def _failed(future) -> bool:
    try:
        future.result()
    except BaseException:  # noqa: BLE001 - only asking whether it failed; the caller re-raises
        return True
    return False


def upload_files(
    s3,
    bucket: str,
    prefix: str,
    folder: Path,
    files: list[FileDigest],
    settings: SyncSettings,
    *,
    on_bytes: Callable[[int], None] = lambda n: None,
    on_file: Callable[[str], None] = lambda p: None,
) -> None:
    """Upload files in parallel (one transfer manager, parts of several files at once)."""
    try:
        with create_transfer_manager(s3, settings.transfer_config()) as manager:
            futures = [
                manager.upload(
                    str(folder / f.path),
                    bucket,
                    prefix + f.path,
                    extra_args={"ChecksumAlgorithm": "SHA256", "Metadata": {"sha256": f.sha256}},
                    subscribers=[_Report(f.path, on_bytes, on_file)],
                )
                for f in files
            ]
            for future in futures:
                future.result()
    except (BotoCoreError, ClientError) as exc:
        raise _aws(f"uploading to s3://{bucket}/{prefix}")(exc) from None


def sync_model(
    s3,
    *,
    stack: str,
    bucket: str,
    model_id: str,
    folder: Path,
    settings: SyncSettings = SyncSettings(),
    cache_dir: Path = DEFAULT_CACHE_DIR,
    on_plan: Callable[[SyncPlan], None] = lambda p: None,
    on_bytes: Callable[[int], None] = lambda n: None,
    on_file: Callable[[str], None] = lambda p: None,
) -> SyncResult:
    prefix = model_prefix(model_id)
    local = digest_folder(folder, settings, cache_dir)
    remote = remote_objects(s3, bucket, prefix, only={f.path for f in local})
    plan = plan_sync(local, remote)
    on_plan(plan)
    aborted = abort_stale_uploads(s3, bucket, prefix) if plan.upload else 0
    upload_files(s3, bucket, prefix, folder, plan.upload, settings, on_bytes=on_bytes, on_file=on_file)
    if plan.upload:
        after = remote_objects(s3, bucket, prefix, only={f.path for f in plan.upload})
        still = plan_sync(plan.upload, after).upload
        if still:
            raise AwsProblem(
                f"S3 does not hold what was uploaded for {', '.join(f.path for f in still)} "
                f"(checksum mismatch after upload); run the sync again"
            )
    manifest = Manifest(
        stack=stack,
        model_id=model_id,
        bucket=bucket,
        prefix=prefix,
        files=local,
        synced_at=datetime.now(UTC),
        total_bytes=sum(f.size for f in local),
    )
    try:
        s3.put_object(
            Bucket=bucket,
            Key=manifest_key(model_id),
            Body=manifest.model_dump_json(indent=2).encode(),
            ContentType="application/json",
            ChecksumAlgorithm="SHA256",
        )
    except (BotoCoreError, ClientError) as exc:
        raise _aws(f"writing the manifest s3://{bucket}/{manifest_key(model_id)}")(exc) from None
    return SyncResult(manifest=manifest, plan=plan, aborted_uploads=aborted)


def cached_manifests(s3, bucket: str) -> list[Manifest]:
    """Every model's manifest in the bucket."""
    try:
        keys = [
            item["Key"]
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=MANIFESTS_PREFIX)
            for item in page.get("Contents", [])
        ]
        return [
            Manifest.model_validate_json(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
            for key in keys
            if key.endswith(".json")
        ]
    except (BotoCoreError, ClientError) as exc:
        raise _aws(f"listing s3://{bucket}/{MANIFESTS_PREFIX}")(exc) from None
