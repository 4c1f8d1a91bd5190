"""Pulumi's own mocks (`pulumi.runtime.set_mocks`), recording every resource the program declares.

Every resource reaches the mock monitor with its inputs; the mocks answer with the outputs AWS
or Kubernetes would compute (IDs, ASG names, endpoints, queue URLs). Tests then read the
resource graph: what was declared, with which inputs, and what waits for what (parents,
`depends_on`, and the resources an input comes from), which is the order a real `pulumi up`
creates things in. Runs happen in this process one after another: `set_mocks` installs a fresh
monitor and settings each time, and the config map is replaced before each run.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import pulumi
from pulumi.runtime import rpc
from pulumi.runtime.mocks import MockMonitor
from pulumi.runtime.sync_await import _sync_await

from infra.aws import program
from infra.spec.stack_file import PROJECT_ROOT, load_stack

ELASTICACHE_HOST = "master.llmstack.abc123.use1.cache.amazonaws.com"

CLOUD_STACKS = ("dev", "prod")
KARPENTER_STACK = PROJECT_ROOT / "tests" / "stacks" / "Pulumi.karpenter.yaml"
REDACTED = "<secret>"
NODE_SECURITY_GROUP = "sg-eks-cluster"
MOCK_PASSWORD = "mock-random-password-a1b2c3"
MOCK_ACCOUNT = "111122223333"
DEPLOYER_ARN = f"arn:aws:iam::{MOCK_ACCOUNT}:user/deployer"  # who runs `pulumi up` unless a test says


# --- the harness -------------------------------------------------------------------------


@dataclass
class Created:
    """One resource as the program declared it."""

    type: str
    name: str
    id: str
    inputs: dict[str, Any]
    """Inputs with secrets unwrapped (what the provider would receive)."""
    redacted: dict[str, Any]
    """Inputs with every secret value replaced by REDACTED (what would be shown in plain text)."""
    provider: str | None
    urn: str = ""

    def within(self, component_type: str) -> bool:
        return f"{component_type}$" in self.urn


@dataclass
class ProgramRun:
    stack: str
    resources: list[Created]
    outputs: dict[str, Any]
    secret_outputs: set[str] = field(default_factory=set)
    edges: dict[str, set[str]] = field(default_factory=dict)
    """URN -> URNs it waits for: its parent, `depends_on` and the resources its inputs come from."""

    def waits_for(self, resource: Created, dependency: Created) -> bool:
        seen, todo = set(), [resource.urn]
        while todo:
            urn = todo.pop()
            if urn == dependency.urn:
                return True
            if urn not in seen:
                seen.add(urn)
                todo.extend(self.edges.get(urn, ()))
        return False

    def of_type(self, type_: str) -> list[Created]:
        return [r for r in self.resources if r.type == type_]

    def one(self, type_: str, name: str) -> Created:
        found = [r for r in self.of_type(type_) if r.name == name]
        assert len(found) == 1, f"expected one {type_} named {name}, found {len(found)}"
        return found[0]

    def by_id(self, id_: str) -> Created:
        return next(r for r in self.resources if r.id == id_)


def _split_secrets(value: Any) -> tuple[Any, Any]:
    """(value with secrets unwrapped, value with secrets redacted)."""
    if rpc.is_rpc_secret(value):
        plain, _ = _split_secrets(rpc.unwrap_rpc_secret(value))
        return plain, REDACTED
    if isinstance(value, dict):
        pairs = {k: _split_secrets(v) for k, v in value.items()}
        return {k: p for k, (p, _) in pairs.items()}, {k: r for k, (_, r) in pairs.items()}
    if isinstance(value, list):
        pairs = [_split_secrets(v) for v in value]
        return [p for p, _ in pairs], [r for _, r in pairs]
    return value, value


class RecordingMocks(pulumi.runtime.Mocks):
    """Records each resource; answers with the outputs the program reads, camelCase like providers."""

    def __init__(self, caller_arn: str = DEPLOYER_ARN) -> None:
        self.created: list[Created] = []
        self.caller_arn = caller_arn

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str, dict]:
        plain, redacted = _split_secrets(dict(args.inputs))
        id_ = f"{args.typ.split(':')[-1].lower()}-{args.name}"  # unique: names repeat across types
        self.created.append(Created(args.typ, args.name, id_, plain, redacted, args.provider or None))
        state = dict(args.inputs)
        state.setdefault("arn", mock_arn(args.name))
        state.setdefault("name", args.name)
        if args.typ == "aws:eks/cluster:Cluster":
            state.update(
                endpoint="https://ABC.gr7.us-east-1.eks.amazonaws.com",
                certificateAuthority={"data": "Q0EgZGF0YQ=="},
                identities=[{"oidcs": [{"issuer": "https://oidc.eks.us-east-1.amazonaws.com/id/ABC"}]}],
                vpcConfig={**state.get("vpcConfig", {}), "clusterSecurityGroupId": NODE_SECURITY_GROUP},
            )
        elif args.typ == "aws:eks/nodeGroup:NodeGroup":
            state["resources"] = [{"autoscalingGroups": [{"name": asg_name(args.name)}]}]
        elif args.typ == "aws:ec2/launchTemplate:LaunchTemplate":
            state["latestVersion"] = 1
        elif args.typ == "random:index/randomPassword:RandomPassword":
            state["result"] = MOCK_PASSWORD
        elif args.typ == "aws:elasticache/replicationGroup:ReplicationGroup":
            state["primaryEndpointAddress"] = ELASTICACHE_HOST
        elif args.typ == "kubernetes:core/v1:Service" and args.inputs.get("spec", {}).get("type") == "LoadBalancer":
            state["status"] = {"loadBalancer": {"ingress": [{"hostname": "gw-123.elb.us-east-1.amazonaws.com"}]}}
        elif args.typ == "aws:sqs/queue:Queue":
            state["url"] = f"https://sqs.us-east-1.amazonaws.com/{MOCK_ACCOUNT}/{args.name}"
        return id_, state

    def call(self, args: pulumi.runtime.MockCallArgs) -> tuple[dict, list | None]:
        if args.token == "aws:index/getCallerIdentity:getCallerIdentity":
            return {"accountId": MOCK_ACCOUNT, "arn": self.caller_arn, "userId": "AIDAMOCK", "id": MOCK_ACCOUNT}, []
        raise AssertionError(f"the program made an unexpected provider call: {args.token}")


class RecordingMonitor(MockMonitor):
    """The mock monitor, also keeping what each registration waits for."""

    def __init__(self, mocks: pulumi.runtime.Mocks) -> None:
        super().__init__(mocks)
        self.edges: dict[str, set[str]] = {}

    def RegisterResource(self, request: Any) -> Any:
        response = super().RegisterResource(request)
        waits = {request.parent, *request.dependencies} - {""}
        for dependencies in request.propertyDependencies.values():
            waits |= set(dependencies.urns)
        self.edges[response.urn] = waits
        return response


def mock_arn(name: str) -> str:
    return f"arn:aws:mock:us-east-1:111122223333:{name}"


def asg_name(node_group: str) -> str:
    return f"eks-{node_group}-asg"


def run_program(
    stack: str,
    *,
    root: Path = PROJECT_ROOT,
    config: dict[str, str] | None = None,
    secret_keys: tuple[str, ...] = (),
    caller_arn: str = DEPLOYER_ARN,
) -> ProgramRun:
    """Run `infra.aws.program.main` (what `infra/__main__.py` runs) for a stack, under mocks;
    `caller_arn` is who STS says runs it."""
    # Pulumi's runtime uses the thread's current event loop; earlier tests that used
    # asyncio.run() leave none set, so give each run a fresh one.
    asyncio.set_event_loop(asyncio.new_event_loop())
    mocks = RecordingMocks(caller_arn)
    monitor = RecordingMonitor(mocks)
    pulumi.runtime.set_mocks(mocks, project="llmstack", stack=stack, preview=False, monitor=monitor)
    pulumi.runtime.set_all_config(dict(config or {}), list(secret_keys))
    outputs: dict[str, pulumi.Output] = {}
    resolved: dict[str, Any] = {}

    @pulumi.runtime.test
    def run() -> pulumi.Output:
        with mock.patch.object(program, "load_stack", functools.partial(load_stack, root=root)):
            outputs.update(program.main())
        return pulumi.Output.all(**outputs).apply(resolved.update)

    run()
    urns = {(urn.split("::")[-2].split("$")[-1], urn.split("::")[-1]): urn for urn in monitor.resources}
    for created in mocks.created:
        created.urn = urns.get((created.type, created.name), "")
    secret = {key for key, value in outputs.items() if _sync_await(value.is_secret())}
    return ProgramRun(stack, mocks.created, resolved, secret, monitor.edges)


@functools.cache
def example_run(stack: str) -> ProgramRun:
    """The example stacks (and tests/stacks/Pulumi.karpenter.yaml as "karpenter"), run once per session,
    with the `aws:` settings of their stack files as Pulumi would load them."""
    if stack == "karpenter":
        return run_program("karpenter", root=KARPENTER_STACK.parent, config=aws_config_of(KARPENTER_STACK))
    return run_program(stack, config=aws_config_of(PROJECT_ROOT / f"Pulumi.{stack}.yaml"))


def aws_config_of(path: Path) -> dict[str, str]:
    """The `aws:` keys of a stack file as Pulumi passes config to a program (objects as JSON)."""
    import json

    import yaml

    config = yaml.safe_load(path.read_text())["config"]
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in config.items() if k.startswith("aws:")}
