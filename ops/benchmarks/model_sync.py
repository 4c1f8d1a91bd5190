"""Model cache benchmark: `llmctl models sync` against plain boto3, on one local S3 endpoint.

    python -m ops.benchmarks.model_sync [--out build/bench/model_sync.json] [--shard-mib 48] [--repeats 3]

A 10-file Hugging Face-shaped folder (4 safetensors shards and 6 small JSON files) goes to
moto's S3 server on 127.0.0.1 (its own process), three ways, alternating, `--repeats` times:

  baseline   boto3's TransferManager with its defaults (8 MiB parts, 10 threads), every file
             submitted at once: what `aws s3 cp --recursive` does
  sync       `llmctl models sync`'s code path into an empty prefix (hash, list, upload,
             verify, manifest), with a cold hash cache
  rerun      the same sync again with nothing changed (target: under 2 s for 10 files)
  hash       the local hashing pass alone (SHA-256 of each file and part), cold: the part of
             `sync` the baseline does not do

Figures are ratios to the baseline of the same run: the endpoint is moto, a Python server
on the same 2 shared cores, so absolute MiB/s say more about it than about S3.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Annotated

import typer

from ops.harness.local_s3 import running_s3
from ops.llmctl.models.sync import MIB, SyncSettings, digest_folder, sync_model

SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
RERUN_TARGET_S = 2.0

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def make_folder(folder: Path, shard_mib: int) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    for name in SMALL_FILES:
        (folder / name).write_text(json.dumps({"name": name, "padding": "x" * 4096}))
    for i in range(4):
        (folder / f"model-{i + 1:05d}-of-00004.safetensors").write_bytes(os.urandom(shard_mib * MIB))
    return sum(p.stat().st_size for p in folder.iterdir())


def baseline_upload(s3, bucket: str, prefix: str, folder: Path) -> None:
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    with create_transfer_manager(s3, TransferConfig()) as manager:
        futures = [manager.upload(str(p), bucket, prefix + p.name) for p in sorted(folder.iterdir())]
        for future in futures:
            future.result()


def _sync(s3, bucket: str, folder: Path, hashes: Path) -> None:
    sync_model(s3, stack="bench", bucket=bucket, model_id="m", folder=folder, settings=SyncSettings(), cache_dir=hashes)


def _digest(folder: Path, cache_dir: Path) -> None:
    digest_folder(folder, SyncSettings(), cache_dir)


def timed(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


@app.command()
def main(
    out: Annotated[Path, typer.Option(help="JSON results.")] = Path("build/bench/model_sync.json"),
    shard_mib: Annotated[int, typer.Option(min=1, help="Size of each of the 4 shards.")] = 48,
    repeats: Annotated[int, typer.Option(min=1)] = 3,
) -> None:
    import boto3

    with tempfile.TemporaryDirectory() as tmp, running_s3() as server:
        os.environ.update(server.endpoint_env())
        folder = Path(tmp) / "model"
        total = make_folder(folder, shard_mib)
        s3 = boto3.client("s3", region_name="us-east-1")
        times: dict[str, list[float]] = {"baseline": [], "sync": [], "rerun": [], "hash": []}
        for i in range(repeats):
            for bucket in (f"bench-baseline-{i}", f"bench-sync-{i}"):
                s3.create_bucket(Bucket=bucket)
            # Each action is bound to this round's buckets and folders now, not looked up in the loop later.
            times["baseline"].append(timed(partial(baseline_upload, s3, f"bench-baseline-{i}", "models/m/", folder)))
            hashes = Path(tmp) / f"hashes-{i}"  # cold: the first sync of a folder hashes every file
            sync = partial(_sync, s3, f"bench-sync-{i}", folder, hashes)
            times["sync"].append(timed(sync))
            times["rerun"].append(timed(sync))
            times["hash"].append(timed(partial(_digest, folder, Path(tmp) / f"cold-{i}")))
            for bucket in (f"bench-baseline-{i}", f"bench-sync-{i}"):  # keep moto's memory flat
                for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
                    for item in page.get("Contents", []):
                        s3.delete_object(Bucket=bucket, Key=item["Key"])

    median = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "files": 10,
        "total_mib": round(total / MIB, 1),
        "repeats": repeats,
        "seconds": {k: [round(x, 3) for x in v] for k, v in times.items()},
        "median_mib_per_s": {k: round(total / MIB / median[k], 1) for k in ("baseline", "sync")},
        "sync_vs_baseline_throughput": round(median["baseline"] / median["sync"], 2),
        "rerun_median_s": round(median["rerun"], 3),
        "rerun_vs_baseline_reupload": round(median["baseline"] / median["rerun"], 1),
        "hash_share_of_sync": round(median["hash"] / median["sync"], 2),
        "rerun_under_target": median["rerun"] < RERUN_TARGET_S,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    app()
