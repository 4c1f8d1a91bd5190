"""Runbooks name only commands that work with this code.

Every shell command in a ```bash block of every file in ops/runbooks/ (including runbooks
added later) is checked:
- `llmctl`: parsed by the real CLI (typer/click) without running it; unknown subcommands fail. `plan`,
  `render` and `scale` run for real, `scale` on a copy of the stack: an example value that
  `llmctl plan` would refuse fails the test.
- `make`: `make -n` (dry run) of the target.
- `kubectl`: known verbs and kinds, the `llmstack` namespaces, names of objects that
  `llmctl render` or the Pulumi program create, labels KubeRay and llmstack set.
- `aws`: service, operation and parameters exist in botocore's API models (what the AWS CLI
  is built on); `pulumi`: known subcommands and this program's stack outputs.
"""

from __future__ import annotations

import ast
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from typer._click.exceptions import UsageError  # typer vendors its own click
from typer.main import get_command
from typer.testing import CliRunner

from infra.render import common as names
from infra.render import render_stack
from infra.render.dcgm import DCGM_COMPONENT
from infra.spec.stack_file import PROJECT_ROOT, available_stacks, load_stack

RUNBOOKS = PROJECT_ROOT / "ops" / "runbooks"
SHELL_TOOLS = {"curl", "grep", "head", "export", "echo", "jq", "docker"}
REQUIRED_SECTIONS = ("symptoms", "checks", "actions", "verify recovery")


def runbook_files() -> list[Path]:
    return sorted(RUNBOOKS.glob("*.md"))


def commands(markdown: str) -> list[list[str]]:
    """Each simple command (argv) of the ```bash blocks; `$(...)` contents count as commands."""
    found: list[list[str]] = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            for inner in re.findall(r"\$\(([^()]*)\)", line):
                found += _split(inner)
            found += _split(re.sub(r"\$\([^()]*\)", "SUBSTITUTED", line))
    return found


def _split(line: str) -> list[list[str]]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    argv_list, argv = [], []
    for token in lexer:
        if token in ("|", "&&", "||", ";"):
            argv_list.append(argv)
            argv = []
        else:
            argv.append(token)
    argv_list.append(argv)
    # drop empty commands and plain variable assignments (X=value)
    return [a for a in argv_list if a and not all(re.match(r"^[A-Za-z_]\w*=", t) for t in a)]


ALL = [(path.name, argv) for path in runbook_files() for argv in commands(path.read_text())]


def test_there_are_runbooks_with_commands():
    assert len(runbook_files()) >= 11 and len(ALL) > 50


@pytest.mark.parametrize("path", runbook_files(), ids=lambda p: p.name)
def test_structure_and_links(path: Path):
    text = path.read_text()
    if path.name != "README.md":
        headings = [h.strip().lower() for h in re.findall(r"^## (.+)$", text, re.MULTILINE)]
        missing = [s for s in REQUIRED_SECTIONS if not any(h.startswith(s) for h in headings)]
        assert not missing, f"{path.name} lacks sections {missing}"
    for target in re.findall(r"\]\(([^)#:]+\.md)\)", text):
        assert (path.parent / target).is_file(), f"{path.name} links {target}, which does not exist"


def test_index_lists_every_runbook():
    index = (RUNBOOKS / "README.md").read_text()
    unlisted = [p.name for p in runbook_files() if p.name != "README.md" and f"]({p.name})" not in index]
    assert not unlisted, f"ops/runbooks/README.md does not list {unlisted}"


@pytest.mark.parametrize("source, argv", ALL, ids=[f"{s}:{' '.join(a)[:60]}" for s, a in ALL])
def test_command_is_real(source: str, argv: list[str], tmp_path, monkeypatch):
    program = argv[0]
    if program == "llmctl":
        check_llmctl(argv[1:], tmp_path, monkeypatch)
    elif program == "make":
        result = subprocess.run(["make", "-n", *argv[1:]], cwd=PROJECT_ROOT, capture_output=True, text=True)
        assert result.returncode == 0, f"{source}: `{' '.join(argv)}`: {result.stderr.strip()}"
    elif program == "kubectl":
        check_kubectl(argv[1:])
    elif program == "aws":
        check_aws(argv[1:])
    elif program == "pulumi":
        check_pulumi(argv[1:])
    else:
        assert program in SHELL_TOOLS, f"{source}: unknown program {program!r} in `{' '.join(argv)}`"


# --- llmctl ------------------------------------------------------------------------------------


def check_llmctl(args: list[str], tmp_path: Path, monkeypatch) -> None:
    from ops.llmctl.main import app

    group = get_command(app)
    path, parent, rest = ["llmctl"], None, list(args)
    params = None
    while hasattr(group, "resolve_command"):  # a command group (llmctl, llmctl keys)
        ctx = group.make_context(path[-1], rest, parent=parent)
        rest = [*ctx._protected_args, *ctx.args]
        if not rest and group.invoke_without_command:  # a group that is a command too (`llmctl cost`)
            params = ctx.params
            break
        name, command, rest = group.resolve_command(ctx, rest)  # UsageError on an unknown subcommand
        group, parent = command, ctx
        path.append(name)
    if params is None:
        params = group.make_context(path[-1], rest, parent=parent).params  # options, types, required
    stack = params.get("stack")
    if stack is not None:
        assert stack in available_stacks(), f"--stack {stack}: no Pulumi.{stack}.yaml"
    if path[1] in ("plan", "render"):
        result = CliRunner().invoke(
            app, [*args, *(["--out", str(tmp_path)] if path[1] == "render" and "--out" not in args else [])]
        )
        assert result.exit_code == 0, result.output
    if path[1] == "scale":
        copy = tmp_path / f"Pulumi.{stack}.yaml"
        shutil.copy(PROJECT_ROOT / f"Pulumi.{stack}.yaml", copy)
        monkeypatch.setenv("LLMSTACK_STATE_DIR", str(tmp_path / "no-make-dev"))  # never touch a running make dev
        runs = [*args]
        runs[runs.index("--stack") + 1] = str(copy)
        result = CliRunner().invoke(app, runs)
        assert result.exit_code == 0, f"`llmctl {' '.join(args)}` fails on Pulumi.{stack}.yaml: {result.output}"


# --- kubectl -----------------------------------------------------------------------------------

KINDS = {
    **dict.fromkeys(["pod", "pods", "po"], "Pod"),
    **dict.fromkeys(["node", "nodes", "no"], "Node"),
    **dict.fromkeys(["rayservice", "rayservices", "rayservices.ray.io"], "RayService"),
    **dict.fromkeys(["raycluster", "rayclusters", "rayclusters.ray.io"], "RayCluster"),
    **dict.fromkeys(["deployment", "deployments", "deploy"], "Deployment"),
    **dict.fromkeys(["service", "services", "svc"], "Service"),
    **dict.fromkeys(["hpa", "horizontalpodautoscaler", "horizontalpodautoscalers"], "HorizontalPodAutoscaler"),
    **dict.fromkeys(["pdb", "poddisruptionbudget", "poddisruptionbudgets"], "PodDisruptionBudget"),
    **dict.fromkeys(["networkpolicy", "networkpolicies", "netpol"], "NetworkPolicy"),
    **dict.fromkeys(["secret", "secrets"], "Secret"),
    **dict.fromkeys(["event", "events", "ev"], "Event"),
    **dict.fromkeys(["daemonset", "daemonsets", "ds"], "DaemonSet"),
}
VERBS_WITH_RESOURCES = {"get", "describe", "logs", "delete", "edit", "top", "exec", "patch"}
VERBS = VERBS_WITH_RESOURCES | {"rollout", "cordon", "uncordon", "drain", "port-forward", "cluster-info", "patch"}
NAMESPACES = {names.NAMESPACE, names.KUBERAY_NAMESPACE, "kube-system"}
LABEL_KEYS = {
    "ray.io/node-type",
    "ray.io/group",
    "ray.io/cluster",
    names.NODE_GROUP_LABEL,
    names.COMPONENT_LABEL,
    "app.kubernetes.io/instance",
    "app.kubernetes.io/name",
}
FLAGS_WITH_VALUE = {
    "-n",
    "--namespace",
    "-l",
    "--selector",
    "-o",
    "--output",
    "-c",
    "--container",
    "--context",
    "--sort-by",
    "--tail",
    "--since",
    "--field-selector",
    "-p",
    "--patch",
    "--type",
}


def known_objects() -> dict[str, set[str]]:
    """(kind -> names) of everything `llmctl render` produces for the example stacks, plus the
    objects the Pulumi program and KubeRay name from infra.render.common."""
    known: dict[str, set[str]] = {}
    for stack in ("dev", "prod"):
        for obj in render_stack(load_stack(stack)):
            known.setdefault(obj["kind"], set()).add(obj["metadata"]["name"])
    known.setdefault("Service", set()).update({names.SERVE_SERVICE, names.REDIS_SERVICE})
    known.setdefault("Secret", set()).update({names.REDIS_SECRET, names.HF_TOKEN_SECRET})
    return known


def label_values() -> dict[str, set[str]]:
    groups = {g.name for s in available_stacks() for g in load_stack(s).node_groups}
    return {
        "ray.io/group": groups,
        names.NODE_GROUP_LABEL: groups,
        names.COMPONENT_LABEL: {"ray", "gateway", DCGM_COMPONENT},
        "ray.io/node-type": {"head", "worker"},
    }


def check_kubectl(args: list[str]) -> None:
    if "--" in args:
        args = args[: args.index("--")]  # the command run inside the container is not kubectl's
    positional, flags, i = [], {}, 0
    while i < len(args):
        token = args[i]
        if token.startswith("-"):
            key, _, value = token.partition("=")
            if key in FLAGS_WITH_VALUE and not value:
                value, i = args[i + 1], i + 1
            flags.setdefault(key, []).append(value)
        else:
            positional.append(token)
        i += 1
    verb, *rest = positional
    assert verb in VERBS, f"kubectl {verb}: not a verb the runbooks should need"
    for ns in flags.get("-n", []) + flags.get("--namespace", []):
        assert ns in NAMESPACES, f"namespace {ns!r} is not one llmstack uses"
    for selector in flags.get("-l", []) + flags.get("--selector", []):
        for term in selector.split(","):
            key, _, value = term.partition("=")
            assert key in LABEL_KEYS, f"label {key!r} is set by neither KubeRay nor llmstack"
            if value and key in label_values():
                assert value in label_values()[key], f"{key}={value}: no such value in the example stacks"
    if "-c" in flags:
        assert set(flags["-c"]) <= {"ray-head", "ray-worker", "gateway"}, f"container {flags['-c']}"
    if verb == "rollout":
        assert rest[0] in ("restart", "status", "undo", "history"), f"kubectl rollout {rest[0]}"
        rest = rest[1:]
    if verb in VERBS_WITH_RESOURCES | {"rollout"} and rest:
        check_resource(rest)


def check_resource(rest: list[str]) -> None:
    known = known_objects()
    first, *more = rest
    kind_token, _, name = first.partition("/")
    if not name and kind_token.lower() not in KINDS:  # `logs NAME` / `exec NAME`: a pod name
        assert kind_token.startswith("$"), f"{first!r}: neither KIND/NAME nor a pod variable"
        return
    kind = KINDS.get(kind_token.lower())
    assert kind, f"unknown resource kind {kind_token!r}"
    name = name or (more[0] if more else "")
    if name and not name.startswith("$") and kind in known:
        assert name in known[kind], f"{kind} {name!r} is not an object llmstack creates ({sorted(known[kind])})"


# --- aws and pulumi ----------------------------------------------------------------------------

AWS_GLOBAL = {"--region", "--output", "--query", "--profile", "--no-cli-pager"}
# AWS CLI customizations, not API operations.
AWS_CLI_ONLY = {("eks", "update-kubeconfig"), ("eks", "get-token"), ("ecr", "get-login-password")}


def check_aws(args: list[str]) -> None:
    service, operation, *rest = args
    options = {t.split("=")[0] for t in rest if t.startswith("--")} - AWS_GLOBAL
    if (service, operation) in AWS_CLI_ONLY:
        return
    import botocore.session
    from botocore import xform_name

    session = botocore.session.get_session()
    assert service in session.get_available_services(), f"aws {service}: no such service"
    model = session.get_service_model(service)
    operations = {xform_name(op, "-"): op for op in model.operation_names}
    assert operation in operations, f"aws {service} {operation}: no such operation"
    shape = model.operation_model(operations[operation]).input_shape
    members = {f"--{xform_name(m, '-')}": m for m in (shape.members if shape else {})}
    assert options <= members.keys(), f"aws {service} {operation}: unknown options {options - members.keys()}"
    required = {f"--{xform_name(m, '-')}" for m in (shape.required_members if shape else [])}
    assert required <= options, f"aws {service} {operation}: missing {required - options}"


def stack_outputs() -> set[str]:
    tree = ast.parse((PROJECT_ROOT / "infra" / "aws" / "program.py").read_text())
    build = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "build")
    returned = next(n.value for n in ast.walk(build) if isinstance(n, ast.Return) and isinstance(n.value, ast.Dict))
    return {k.value for k in returned.keys if isinstance(k, ast.Constant)}


def check_pulumi(args: list[str]) -> None:
    assert args[0] in {"stack", "config", "preview", "up", "destroy", "login"}, f"pulumi {args[0]}"
    if args[:2] == ["stack", "output"]:
        output = next((a for a in args[2:] if not a.startswith("-") and a not in available_stacks()), None)
        assert output in stack_outputs(), f"pulumi stack output {output}: the program exports {stack_outputs()}"


def test_the_checks_can_fail():
    """The checkers refuse what does not exist (so a green run means something)."""
    for bad in (
        ["kubectl", "-n", "llmstack", "get", "deployment/llmstack-gatewy"],
        ["kubectl", "-n", "default", "get", "pods"],
        ["kubectl", "get", "pods", "-l", "ray.io/group=h100"],
        ["aws", "service-quotas", "get-service-quota", "--service-code", "ec2"],
        ["aws", "ec2", "describe-gpus"],
        ["pulumi", "stack", "output", "gpu_count"],
    ):
        checker = {"kubectl": check_kubectl, "aws": check_aws, "pulumi": check_pulumi}[bad[0]]
        with pytest.raises(AssertionError):
            checker(bad[1:])
    with pytest.raises(UsageError):
        check_llmctl(["scale", "--stack", "prod", "--model", "x", "--min", "two"], Path("/nonexistent"), None)
    with pytest.raises(UsageError):
        check_llmctl(["stauts", "--stack", "prod"], Path("/nonexistent"), None)
    assert commands("```bash\nA=$(llmctl plan --stack dev) && kubectl get pods | head -n 1  # c\n```") == [
        ["llmctl", "plan", "--stack", "dev"],
        ["kubectl", "get", "pods"],
        ["head", "-n", "1"],
    ]
    assert shlex.split("x")  # shlex kept for the reader: commands are split the way a shell would


def test_the_first_deploy_runbook_names_every_doctor_check_and_the_new_account_prerequisites() -> None:
    """What `llmctl doctor` can fail on, the first-deploy runbook explains; what a new account
    needs once (the spot service-linked role among it), the runbook says how to get."""
    from infra.catalog.versions import KUBERNETES_VERSION
    from ops.llmctl.doctor.checks import (
        ADMINS_CHECK,
        BASE_IMAGE_CHECK,
        CREATE_SPOT_ROLE,
        SPOT_ROLE_CHECK,
        gpu_ami_check_name,
    )

    runbook = (RUNBOOKS / "first-deploy-of-a-new-stack.md").read_text()
    for check in (ADMINS_CHECK, SPOT_ROLE_CHECK, BASE_IMAGE_CHECK, gpu_ami_check_name(KUBERNETES_VERSION)):
        assert f"`{check} ... fail`" in runbook, check
    assert CREATE_SPOT_ROLE in runbook and "iam:CreateServiceLinkedRole" in runbook
    assert "Leave that identity itself out" in runbook  # cloud.admin_principal_arns
