"""What each Ray pod can reach, read from what the Pulumi program declares (under mocks).

For every pod template of the RayService: its service account, whether a Kubernetes API token
is mounted (pod setting first, then the account's), what that token may do in the API, and
what AWS lets it do through the IRSA role its account is annotated with (that role's trust must
name this very account). Kubernetes permissions come from two places: RoleBindings the program
declares (none for Ray) and the Role KubeRay v1.7.0 binds to the head group's service account
for its in-tree autoscaler (ray-project/kuberay@59d663aeec13760646da3db9c1cf8cfe883e30b7,
ray-operator/controllers/ray/common/rbac.go: BuildRole / BuildRoleBinding, subject
utils.GetHeadGroupServiceAccountName = the head template's serviceAccountName).
"""

from __future__ import annotations

import json

import pytest

from tests.support.pulumi_program import MOCK_ACCOUNT, ProgramRun, example_run

RAYSERVICE = "kubernetes:ray.io/v1:RayService"
SERVICE_ACCOUNT = "kubernetes:core/v1:ServiceAccount"
KUBERAY_AUTOSCALER_ROLE = frozenset(
    {
        ("pods", "get"),
        ("pods", "list"),
        ("pods", "watch"),
        ("pods", "patch"),
        ("pods/resize", "patch"),
        ("rayclusters", "get"),
        ("rayclusters", "patch"),
    }
)
NO_TOKEN = frozenset()


def _aws_reach(run: ProgramRun, account: str, annotations: dict[str, str]) -> frozenset[tuple[str, str]]:
    arn = annotations.get("eks.amazonaws.com/role-arn")
    if arn is None:
        return frozenset()
    [role] = [r for r in run.of_type("aws:iam/role:Role") if arn.endswith(f":{r.name}")]
    [trust] = json.loads(role.inputs["assumeRolePolicy"])["Statement"]
    subjects = [v for k, v in trust["Condition"]["StringEquals"].items() if k.endswith(":sub")]
    assert subjects == [f"system:serviceaccount:llmstack:{account}"], f"{role.name} trusts {subjects}, not {account}"
    grants = set()
    for policy in run.of_type("aws:iam/rolePolicy:RolePolicy"):
        if policy.name == role.name:
            for statement in json.loads(policy.inputs["policy"])["Statement"]:
                actions = [statement["Action"]] if isinstance(statement["Action"], str) else statement["Action"]
                resources = [statement["Resource"]] if isinstance(statement["Resource"], str) else statement["Resource"]
                grants |= {(a, r) for a in actions for r in resources}
    return frozenset(grants)


def reach(run: ProgramRun) -> dict[str, dict]:
    """Pod (head, or the worker group's name) -> what it can reach."""
    [rayservice] = run.of_type(RAYSERVICE)
    cluster = rayservice.inputs["spec"]["rayClusterConfig"]
    head_account = cluster["headGroupSpec"]["template"]["spec"]["serviceAccountName"]
    assert not [
        b
        for b in run.of_type("kubernetes:rbac.authorization.k8s.io/v1:RoleBinding")
        + run.of_type("kubernetes:rbac.authorization.k8s.io/v1:ClusterRoleBinding")
        if "ray" in json.dumps(b.inputs.get("subjects", []))
    ]
    pods = {
        "head": cluster["headGroupSpec"]["template"]["spec"],
        **{g["groupName"]: g["template"]["spec"] for g in cluster["workerGroupSpecs"]},
    }
    out = {}
    for pod, spec in pods.items():
        account = spec["serviceAccountName"]
        declared = run.one(SERVICE_ACCOUNT, account).inputs
        token = spec.get("automountServiceAccountToken", declared.get("automountServiceAccountToken", True))
        api = (KUBERAY_AUTOSCALER_ROLE if account == head_account else frozenset()) if token else NO_TOKEN
        out[pod] = {
            "service_account": account,
            "api_token": token,
            "kubernetes_api": api,
            "aws": _aws_reach(run, account, declared["metadata"].get("annotations", {})),
        }
    return out


@pytest.mark.parametrize("stack", ["prod", "karpenter"])
def test_each_ray_pod_reaches_exactly_what_it_needs(stack: str) -> None:
    run = example_run(stack)
    bucket = f"arn:aws:s3:::llmstack-{stack}-models-{MOCK_ACCOUNT}"
    # The models and their LoRA adapters (Ray Serve LLM fetches an adapter on its first request).
    read_models = frozenset(
        {("s3:ListBucket", bucket), ("s3:GetObject", f"{bucket}/models/*"), ("s3:GetObject", f"{bucket}/loras/*")}
    )
    pods = reach(run)
    # The head: KubeRay's autoscaler needs the API (it patches pods and the RayCluster).
    assert pods.pop("head") == {
        "service_account": "llmstack-ray",
        "api_token": True,
        "kubernetes_api": KUBERAY_AUTOSCALER_ROLE,
        "aws": read_models,
    }
    # Workers run tenant input: no Kubernetes API token at all, still the model cache.
    assert pods, "no worker groups"
    for group, worker in pods.items():
        assert worker == {
            "service_account": "llmstack-ray-worker",
            "api_token": False,
            "kubernetes_api": NO_TOKEN,
            "aws": read_models,
        }, group


def test_the_workers_account_itself_mounts_no_token() -> None:
    """Any pod that names the workers' account gets no token, not only the ones we render."""
    declared = example_run("prod").one(SERVICE_ACCOUNT, "llmstack-ray-worker").inputs
    assert declared["automountServiceAccountToken"] is False
