"""`llmctl models sync|ls`: the stack's S3 model cache (layout: `infra.plan.cache_layout`).

Which bucket: `llmstack:model_cache.bucket` from the stack file, else the name made from
the stack and the AWS account of the current credentials (one STS call). Credentials and
region: the standard AWS chain; the region is the stack's.

boto3 is imported inside the commands: `llmctl plan` and `render` need only the core install.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from infra.plan.cache_layout import adapter_prefix, bucket_name, model_prefix
from infra.spec.model_source import is_local_path, resolve_local_source
from infra.spec.schema import AwsCloud, StackSpec
from infra.spec.stack_file import StackFileError, load_stack
from ops.llmctl.console import ExitCode, StackOption, err, fail, out
from ops.llmctl.models.manifest import SyncPlan, verify_against_manifest

MIB = 1024 * 1024

app = typer.Typer(help="The stack's S3 model cache: upload a model folder, list what is cached.", no_args_is_help=True)


def _cloud_stack(stack: str) -> tuple[StackSpec, AwsCloud]:
    try:
        spec = load_stack(stack)
    except StackFileError as exc:
        raise fail(str(exc), 2) from None
    if not isinstance(spec.cloud, AwsCloud):
        raise fail(
            f"stack {spec.name} is a local stack (Pulumi.{spec.name}.yaml: llmstack:cloud.provider local): "
            "it loads models from their source folders and has no model cache; use an AWS stack",
            2,
        )
    return spec, spec.cloud


def _bucket(spec: StackSpec, session) -> str:
    from ops.llmctl import aws

    return bucket_name(spec, None if spec.model_cache.bucket else aws.account_id(session))


def _source_folder(spec: StackSpec, model_id: str, explicit: Path | None) -> Path:
    try:
        model = spec.model(model_id)
    except KeyError as exc:
        raise fail(f"Pulumi.{spec.name}.yaml: {exc.args[0]}", 2) from None
    if explicit is not None:
        return explicit
    if is_local_path(model.source):
        return Path(resolve_local_source(model.source))
    raise fail(
        f"model {model_id}'s source {model.source} is a hub id: download it to a folder first "
        "(for example with `hf download`) and pass that folder with --from DIR",
        2,
    )


@app.command()
def sync(
    stack: StackOption,
    model: Annotated[str, typer.Option("--model", "-m", help="Model id in the stack.")],
    from_dir: Annotated[
        Path | None,
        typer.Option("--from", help="Local Hugging Face folder; default: the model's source when that is a folder."),
    ] = None,
    part_size_mib: Annotated[int, typer.Option(min=5, help="Multipart part size, MiB.")] = 64,
    max_concurrency: Annotated[int, typer.Option(min=1, help="Parallel S3 requests.")] = 16,
    only_adapters: Annotated[
        bool, typer.Option("--only-adapters", help="Upload the model's LoRA adapters only, not its weights.")
    ] = False,
) -> None:
    """Upload a model folder to the cache: only files S3 does not already hold byte for byte. Then
    the model's LoRA adapters (its `lora:` block), each checked against the model first, beside it."""
    from ops.llmctl import aws
    from ops.llmctl.models.sync import ModelFolderError, SyncSettings

    spec, cloud = _cloud_stack(stack)
    folder = None if only_adapters else _source_folder(spec, model, from_dir)  # also: the model is in the stack
    session = aws.session(cloud.region)
    settings = SyncSettings(part_size=part_size_mib * MIB, max_concurrency=max_concurrency)
    try:
        bucket = _bucket(spec, session)
        s3 = aws.client(session, "s3")
        if folder is not None:
            _sync_weights(spec, model, folder, s3, bucket, settings)
        _sync_adapters(spec, model, s3, bucket, settings, folder_synced=folder is not None)
    except ModelFolderError as exc:
        raise fail(f"--from {exc}", 2) from None
    except aws.AwsProblem as exc:
        raise fail(str(exc)) from None
    except KeyboardInterrupt:
        raise fail("interrupted: files already uploaded are kept; run the same command to resume", 130) from None


def _sync_adapters(spec: StackSpec, model_id: str, s3, bucket: str, settings, *, folder_synced: bool) -> None:
    from ops.llmctl.models.adapters import AdapterRefused, sync_adapters

    try:
        model = spec.model(model_id)
    except KeyError as exc:
        raise fail(f"Pulumi.{spec.name}.yaml: {exc.args[0]}", 2) from None
    if model.lora is None:
        if not folder_synced:
            raise fail(f"model {model_id} in Pulumi.{spec.name}.yaml has no lora: block: no adapters to upload", 2)
        return
    try:
        sync_adapters(
            s3,
            spec=spec,
            model=model,
            bucket=bucket,
            settings=settings,
            on_adapter=lambda adapter_id, uploaded: out.print(
                f"[green]cached[/green] adapter {model.model_name}:{adapter_id} at "
                f"s3://{bucket}/{adapter_prefix(model.id, adapter_id)} ({uploaded} file(s) uploaded)",
                highlight=False,
                soft_wrap=True,
            ),
        )
    except AdapterRefused as exc:
        raise fail(f"refused (nothing of it uploaded): {exc}", 2) from None


def _sync_weights(spec: StackSpec, model: str, folder: Path, s3, bucket: str, settings) -> None:
    from ops.llmctl.models.sync import sync_model

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err,
        disable=not err.is_terminal,
    ) as progress:
        bar = progress.add_task(f"{model} -> s3://{bucket}/{model_prefix(model)}", total=None)

        def planned(plan: SyncPlan) -> None:
            progress.update(bar, total=plan.upload_bytes)
            for path in plan.changed:
                err.print(f"differs in S3 (will upload again): {path}", highlight=False)
            err.print(
                f"{len(plan.unchanged)} file(s) already cached, {len(plan.upload)} to upload "
                f"({plan.upload_bytes / MIB:.1f} MiB)",
                highlight=False,
            )

        result = sync_model(
            s3,
            stack=spec.name,
            bucket=bucket,
            model_id=model,
            folder=folder,
            settings=settings,
            on_plan=planned,
            on_bytes=lambda n: progress.advance(bar, n),
            on_file=lambda path: err.print(f"uploaded {path}", highlight=False),
        )
    if result.aborted_uploads:
        err.print(f"removed {result.aborted_uploads} unfinished upload(s) left by an interrupted sync", highlight=False)
    manifest = result.manifest
    out.print(
        f"[green]cached[/green] {model}: {len(manifest.files)} files, {manifest.total_bytes / MIB:.1f} MiB "
        f"at {manifest.uri()}",
        highlight=False,
        soft_wrap=True,
    )
    if not spec.model(model).cached:
        out.print(
            f"note: set `cached: true` on model {model} in Pulumi.{spec.name}.yaml to serve it from the cache",
            highlight=False,
            soft_wrap=True,
        )


@app.command("ls")
def list_cached(
    stack: StackOption,
    verify: Annotated[
        bool, typer.Option("--verify", help="Check every object's checksum against its manifest.")
    ] = False,
) -> None:
    """What the cache holds, and which cached models of the stack are missing (exit 1 if any)."""
    from ops.llmctl import aws
    from ops.llmctl.models.sync import cached_manifests, remote_objects

    spec, cloud = _cloud_stack(stack)
    session = aws.session(cloud.region)
    problems: list[str] = []
    try:
        bucket = _bucket(spec, session)
        s3 = aws.client(session, "s3")
        manifests = {m.model_id: m for m in cached_manifests(s3, bucket)}
        table = Table("model", "files", "MiB", "synced (UTC)", "in stack", "state", title=f"s3://{bucket}")
        for model_id, manifest in sorted(manifests.items()):
            state = "ok"
            if verify:
                found = verify_against_manifest(manifest, remote_objects(s3, bucket, manifest.prefix))
                problems += [f"{model_id}: {p}" for p in found]
                state = "ok (verified)" if not found else f"{len(found)} bad file(s)"
            in_stack = next(
                (("cached: true" if m.cached else "cached: false") for m in spec.models if m.id == model_id),
                "not in stack",
            )
            table.add_row(
                model_id,
                str(len(manifest.files)),
                f"{manifest.total_bytes / MIB:.1f}",
                manifest.synced_at.strftime("%Y-%m-%d %H:%M"),
                in_stack,
                state,
            )
        for m in spec.models:
            if m.cached and m.id not in manifests:
                table.add_row(m.id, "-", "-", "-", "cached: true", "[red]not synced[/red]")
                problems.append(
                    f"{m.id}: cached: true but not in the cache; run "
                    f"llmctl models sync --stack {spec.name} --model {m.id} --from DIR"
                )
    except aws.AwsProblem as exc:
        raise fail(str(exc)) from None
    out.print(table)
    for line in problems:
        err.print(f"[red]problem:[/red] {line}", highlight=False, soft_wrap=True)
    if problems:
        raise typer.Exit(ExitCode.FAILED)
