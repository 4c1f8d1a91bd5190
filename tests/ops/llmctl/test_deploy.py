"""`make preview|deploy|destroy`: the checks that run before the Pulumi CLI."""

from __future__ import annotations

import subprocess

from infra.spec.stack_file import PROJECT_ROOT
from ops.llmctl.deploy import aws_credentials_hint, preflight
from tests.support.stacks import stack_document, write_stack

ROOT = PROJECT_ROOT


def test_local_stack_refuses_and_says_why(tmp_path):
    problem = preflight("deploy", "local", environ={"PATH": ""}, home=tmp_path)
    assert "local CPU stack" in problem and "make dev" in problem


def test_make_deploy_local_refuses():
    result = subprocess.run(["make", "-s", "deploy", "STACK=local"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode != 0 and "nothing to provision" in result.stdout + result.stderr


def test_missing_cli_is_one_line(tmp_path):
    problem = preflight("deploy", "dev", environ={"PATH": str(tmp_path)}, home=tmp_path)
    assert problem.startswith("the Pulumi CLI is not installed") and "\n" not in problem


def test_missing_credentials_is_one_line(tmp_path, fake_pulumi):
    problem = preflight("preview", "dev", environ={"PATH": fake_pulumi}, home=tmp_path)
    assert problem.startswith("no AWS credentials found") and "\n" not in problem


def test_credential_sources_are_recognised(tmp_path):
    assert aws_credentials_hint({"AWS_PROFILE": "prod"}, tmp_path) is None
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws" / "config").write_text("[default]\n")
    assert aws_credentials_hint({}, tmp_path) is None


def test_failing_plan_stops_before_pulumi(tmp_path, fake_pulumi):
    doc = stack_document(
        models=[{"id": "m", "source": "meta-llama/Llama-3.1-8B-Instruct", "node_group": "l4", "max_model_len": 131072}]
    )
    path = write_stack(tmp_path, "tight", doc)
    env = {"PATH": fake_pulumi, "AWS_PROFILE": "x"}
    problem = preflight("deploy", str(path), environ=env, home=tmp_path)
    assert "does not pass `llmctl plan`" in problem and "no_room" not in problem
    assert "less than one max_model_len" in problem
    assert preflight("destroy", str(path), environ=env, home=tmp_path) is None


def test_ready_cloud_stack_passes(tmp_path, fake_pulumi):
    assert preflight("deploy", "prod", environ={"PATH": fake_pulumi, "AWS_PROFILE": "x"}, home=tmp_path) is None
