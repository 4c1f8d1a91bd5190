"""Images a cluster cannot pull are refused before anything is created: by the spec, so
`llmctl plan`, `llmctl render` and `pulumi up` all say so, naming the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from infra.aws.program import StackRefused
from infra.catalog.images import missing_registry_problem, parse_image
from infra.spec.stack_file import StackFileError, spec_from_document
from ops.llmctl.main import app
from tests.support.pulumi_program import run_program
from tests.support.stacks import stack_document, write_stack

ECR = "111122223333.dkr.ecr.eu-west-1.amazonaws.com"


@pytest.mark.parametrize(
    ("reference", "registry", "repository", "tag"),
    [
        ("llmstack-gateway:0.1.0", None, "llmstack-gateway", "0.1.0"),
        ("team/llmstack-gateway:0.1.0", None, "team/llmstack-gateway", "0.1.0"),
        (f"{ECR}/llmstack-gateway:0.1.0", ECR, "llmstack-gateway", "0.1.0"),
        ("localhost:5000/gw:1", "localhost:5000", "gw", "1"),
        ("ghcr.io/acme/gw@sha256:" + "a" * 64, "ghcr.io", "acme/gw", None),
        ("registry.example.com:5000/acme/gw", "registry.example.com:5000", "acme/gw", None),
    ],
)
def test_references_split_as_container_runtimes_read_them(reference, registry, repository, tag) -> None:
    image = parse_image(reference)
    assert (image.registry, image.repository, image.tag) == (registry, repository, tag)


def test_ecr_account_and_region_come_from_the_host() -> None:
    image = parse_image(f"{ECR}/llmstack-serving:0.1.0")
    assert (image.ecr_account, image.ecr_region) == ("111122223333", "eu-west-1")
    assert parse_image("ghcr.io/acme/gw:1").ecr_account is None


def test_problems() -> None:
    assert "names no registry host" in missing_registry_problem("llmstack-gateway:0.1.0")
    assert "Docker Hub" in missing_registry_problem("team/gw:1")  # docker.io/team/gw, not ours
    assert "no tag or digest" in missing_registry_problem("ghcr.io/acme/gw")
    assert missing_registry_problem(f"{ECR}/gw:1") is None


def registryless() -> dict:
    return stack_document(versions={"gateway_image": "llmstack-gateway:0.1.0", "serving_image": f"{ECR}/serving:1"})


def test_spec_refuses_an_aws_stack_naming_no_registry() -> None:
    with pytest.raises(StackFileError) as info:
        spec_from_document(registryless(), name="t", file_label="Pulumi.t.yaml")
    message = str(info.value)
    assert message.startswith("Pulumi.t.yaml: 1 problem(s)")
    assert "llmstack:versions.gateway_image: 'llmstack-gateway:0.1.0' names no registry host" in message
    assert "serving_image" not in message


def test_the_default_images_are_refused_on_aws_but_fine_locally() -> None:
    document = stack_document()
    del document["config"]["llmstack:versions"]
    with pytest.raises(StackFileError, match=r"versions.gateway_image.*\n.*versions.serving_image"):
        spec_from_document(document, name="t", file_label="t")
    local = {
        "config": {
            "llmstack:cloud": {"provider": "local"},
            "llmstack:redis": {"mode": "local"},
            "llmstack:node_groups": [{"name": "l", "kind": "cpu", "max_size": 1, "min_size": 1}],
            "llmstack:models": [
                {"id": "m", "source": "meta-llama/Llama-3.1-8B-Instruct", "node_group": "l", "max_model_len": 512}
            ],
        }
    }
    assert spec_from_document(local, name="l", file_label="l").versions.gateway_image == "llmstack-gateway:0.1.0"


@pytest.mark.parametrize("command", ["plan", "render"])
def test_llmctl_refuses_it_naming_file_and_key(tmp_path: Path, command: str) -> None:
    path = write_stack(tmp_path, "noreg", registryless())
    result = CliRunner().invoke(app, [command, "--stack", str(path)])
    assert result.exit_code == 2
    assert "Pulumi.noreg.yaml" in result.output and "llmstack:versions.gateway_image" in result.output


def test_pulumi_up_refuses_it(tmp_path: Path) -> None:
    write_stack(tmp_path, "noreg", registryless())
    with pytest.raises(StackRefused, match=r"Pulumi.noreg.yaml.*\n.*llmstack:versions.gateway_image"):
        run_program("noreg", root=tmp_path)
