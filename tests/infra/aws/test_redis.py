"""Redis users under Pulumi's mocks: ElastiCache RBAC for managed Redis, an ACL file for the
in-cluster one, and Ray GCS signing in as its own user, over TLS with the CA it needs.
(tests/infra/plan/test_redis_acl.py runs the same rules on a real redis-server.)"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from infra.plan.redis_acl import access_string, autoscaler_user, gateway_user, ray_user
from tests.support.pulumi_program import ELASTICACHE_HOST, MOCK_PASSWORD, REDACTED, example_run, run_program
from tests.support.stacks import stack_document, write_stack


def test_elasticache_has_one_user_per_component_and_the_default_user_off() -> None:
    run = example_run("prod")
    users = {u.inputs["userName"]: u for u in run.of_type("aws:elasticache/user:User")}
    assert set(users) == {"default", "llmstack-gateway", "llmstack-ray"}
    assert users["llmstack-gateway"].inputs["accessString"] == access_string(gateway_user())
    assert users["llmstack-ray"].inputs["accessString"] == access_string(ray_user())
    assert users["default"].inputs["accessString"].startswith("off ")
    for user in users.values():
        assert user.inputs["authenticationMode"]["type"] == "password"
        assert MOCK_PASSWORD not in str(user.redacted)  # the passwords reach the provider as secrets
    [group] = run.of_type("aws:elasticache/userGroup:UserGroup")
    assert sorted(group.inputs["userIds"]) == sorted(u.inputs["userId"] for u in users.values())
    [replication] = run.of_type("aws:elasticache/replicationGroup:ReplicationGroup")
    assert replication.inputs["userGroupIds"] == [group.inputs["userGroupId"]]
    assert "authToken" not in replication.inputs  # no shared password left


def test_every_elasticache_access_string_uses_only_documented_grammar() -> None:
    """ElastiCache refuses what it does not support at CreateUser, halfway through `pulumi up`."""
    from tests.infra.plan.test_redis_acl import ELASTICACHE_DOCUMENTED

    for user in example_run("prod").of_type("aws:elasticache/user:User"):
        tokens = user.inputs["accessString"].split()
        assert tokens[0] in ("on", "off")
        assert [t for t in tokens if not ELASTICACHE_DOCUMENTED.fullmatch(t)] == [], user.inputs["userName"]


def test_in_cluster_redis_acl_file_holds_hashes_of_each_users_password() -> None:
    run = example_run("dev")
    acl = run.one("kubernetes:core/v1:Secret", "llmstack-redis-acl").inputs["stringData"]["users.acl"]
    digest = hashlib.sha256(MOCK_PASSWORD.encode()).hexdigest()
    assert acl.splitlines() == [
        "user default off resetkeys -@all",
        f"user llmstack-gateway on #{digest} resetkeys resetchannels {gateway_user().rules()}",
        f"user llmstack-ray on #{digest} resetkeys resetchannels {ray_user().rules()}",
    ]
    deployment = run.one("kubernetes:apps/v1:Deployment", "llmstack-redis").inputs["spec"]["template"]["spec"]
    [volume] = [v for v in deployment["volumes"] if v["name"] == "acl"]
    assert volume["secret"] == {"secretName": "llmstack-redis-acl", "defaultMode": 0o440}


@pytest.mark.parametrize("stack", ["dev", "prod", "karpenter"])
def test_ray_gcs_signs_in_as_its_own_user(stack: str) -> None:
    run = example_run(stack)
    [rayservice] = run.of_type("kubernetes:ray.io/v1:RayService")
    options = rayservice.inputs["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    for field, key in (("redisUsername", "username"), ("redisPassword", "password")):
        assert options[field] == {"valueFrom": {"secretKeyRef": {"name": "llmstack-redis-ray", "key": key}}}
    # And the gateway uses the other user.
    deployment = run.one("kubernetes:apps/v1:Deployment", "deployment-llmstack-gateway").inputs
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["LLMSTACK_REDIS_URL"]["valueFrom"]["secretKeyRef"]["name"] == "llmstack-redis"


def head_env(stack: str) -> dict[str, str]:
    [rayservice] = example_run(stack).of_type("kubernetes:ray.io/v1:RayService")
    head = rayservice.inputs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in head["env"]}


def test_tls_gcs_gets_the_ca_bundle_and_the_elasticache_host() -> None:
    """Without RAY_REDIS_CA_CERT Ray's C++ client cannot verify ElastiCache's certificate and the
    head never starts (kuberay#1640, ray#41161); KubeRay's cleanup Job copies the head template."""
    [rayservice] = example_run("prod").of_type("kubernetes:ray.io/v1:RayService")
    address = rayservice.inputs["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]["redisAddress"]
    assert address == f"rediss://{ELASTICACHE_HOST}:6379"
    env = head_env("prod")
    assert env["RAY_REDIS_CA_CERT"] == "/etc/ssl/certs/ca-certificates.crt"
    assert env["RAY_REDIS_SERVER_NAME"] == ELASTICACHE_HOST


def test_plain_in_cluster_redis_gets_no_tls_variables() -> None:
    env = head_env("dev")
    assert "RAY_REDIS_CA_CERT" not in env and "RAY_REDIS_SERVER_NAME" not in env


# --- memory: full means refuse, never evict ----------------------------------------------


def test_elasticache_never_evicts() -> None:
    # ElastiCache's default policy, volatile-lru, evicts keys with a TTL first: the gateway's
    # daily counters, monthly spend and usage ledger. The stack's own parameter group says noeviction.
    run = example_run("prod")
    [parameters] = run.of_type("aws:elasticache/parameterGroup:ParameterGroup")
    assert parameters.inputs["family"] == "redis7"
    assert parameters.inputs["parameters"] == [{"name": "maxmemory-policy", "value": "noeviction"}]
    [replication] = run.of_type("aws:elasticache/replicationGroup:ReplicationGroup")
    assert replication.inputs["parameterGroupName"] == parameters.inputs.get("name", parameters.name)


def test_in_cluster_redis_never_evicts_and_fits_its_memory_limit() -> None:
    run = example_run("dev")
    [container] = run.one("kubernetes:apps/v1:Deployment", "llmstack-redis").inputs["spec"]["template"]["spec"][
        "containers"
    ]
    args = container["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    maxmemory_mib = int(args[args.index("--maxmemory") + 1].removesuffix("mb"))
    limit_mib = int(container["resources"]["limits"]["memory"].removesuffix("Mi"))
    assert 0.5 * limit_mib <= maxmemory_mib < limit_mib  # below the limit: Redis refuses before the kernel kills it


# --- Serve's controller: its own read-only user, only when a model scales on saturation ---


SATURATION = {"policy": "saturation"}
AUTOSCALER_SECRETS = {
    "llmstack:redis_password": "ext-pass",
    "llmstack:redis_ray_password": "ext-ray-pass",
    "llmstack:redis_autoscaler_password": "ext-autoscaler-pass",
}


def saturation_run(tmp_path: Path, redis: dict, config: dict[str, str] | None = None):
    document = stack_document(redis=redis)
    [model] = document["config"]["llmstack:models"]
    model["autoscaling"] = SATURATION
    write_stack(tmp_path, "sat", document)
    given = config or {}
    return run_program("sat", root=tmp_path, config=given, secret_keys=tuple(given))


def ray_containers(run) -> tuple[dict, list[dict]]:
    [rayservice] = run.of_type("kubernetes:ray.io/v1:RayService")
    cluster = rayservice.inputs["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    return head, [g["template"]["spec"]["containers"][0] for g in cluster["workerGroupSpecs"]]


URL_ENV = {
    "name": "LLMSTACK_AUTOSCALING_REDIS_URL",
    "valueFrom": {"secretKeyRef": {"name": "llmstack-redis-autoscaler", "key": "url"}},
}


@pytest.mark.parametrize("stack", ["dev", "prod", "karpenter"])
def test_no_saturation_model_no_autoscaler_user_secret_or_variable(stack: str) -> None:
    run = example_run(stack)
    assert not [s for s in run.of_type("kubernetes:core/v1:Secret") if s.name == "llmstack-redis-autoscaler"]
    assert "llmstack-autoscaler" not in {u.inputs["userName"] for u in run.of_type("aws:elasticache/user:User")}
    head, workers = ray_containers(run)
    assert all(e["name"] != URL_ENV["name"] for c in (head, *workers) for e in c["env"])


def test_managed_redis_gives_the_controller_its_elasticache_user_and_url(tmp_path: Path) -> None:
    run = saturation_run(tmp_path, {"mode": "managed"})
    users = {u.inputs["userName"]: u for u in run.of_type("aws:elasticache/user:User")}
    assert users["llmstack-autoscaler"].inputs["accessString"] == access_string(autoscaler_user())
    [group] = run.of_type("aws:elasticache/userGroup:UserGroup")
    assert users["llmstack-autoscaler"].inputs["userId"] in group.inputs["userIds"]
    secret = run.one("kubernetes:core/v1:Secret", "llmstack-redis-autoscaler")
    assert secret.inputs["stringData"] == {
        "url": f"rediss://llmstack-autoscaler:{MOCK_PASSWORD}@{ELASTICACHE_HOST}:6379/0"
    }
    assert secret.redacted["stringData"] == REDACTED
    head, workers = ray_containers(run)
    assert URL_ENV in head["env"]
    assert all(e["name"] != URL_ENV["name"] for w in workers for e in w["env"])


def test_in_cluster_redis_gives_the_controller_an_acl_line_and_url(tmp_path: Path) -> None:
    run = saturation_run(tmp_path, {"mode": "in_cluster"})
    acl = run.one("kubernetes:core/v1:Secret", "llmstack-redis-acl").inputs["stringData"]["users.acl"]
    digest = hashlib.sha256(MOCK_PASSWORD.encode()).hexdigest()
    assert f"user llmstack-autoscaler on #{digest} resetkeys resetchannels {autoscaler_user().rules()}" in (
        acl.splitlines()
    )
    url = run.one("kubernetes:core/v1:Secret", "llmstack-redis-autoscaler").inputs["stringData"]["url"]
    assert url == f"redis://llmstack-autoscaler:{MOCK_PASSWORD}@llmstack-redis.llmstack.svc.cluster.local:6379/0"
    head, _ = ray_containers(run)
    assert URL_ENV in head["env"]


def test_external_redis_takes_the_controllers_password_from_secret_config(tmp_path: Path) -> None:
    run = saturation_run(tmp_path, {"mode": "external", "host": "redis.internal.example.com"}, AUTOSCALER_SECRETS)
    secret = run.one("kubernetes:core/v1:Secret", "llmstack-redis-autoscaler")
    assert secret.inputs["stringData"] == {
        "url": "rediss://llmstack-autoscaler:ext-autoscaler-pass@redis.internal.example.com:6379/0"
    }
    assert secret.redacted["stringData"] == REDACTED


def test_external_redis_without_the_controllers_password_is_refused_naming_file_key_and_fix(tmp_path: Path) -> None:
    given = {k: v for k, v in AUTOSCALER_SECRETS.items() if k != "llmstack:redis_autoscaler_password"}
    with pytest.raises(Exception) as refused:
        saturation_run(tmp_path, {"mode": "external", "host": "redis.internal.example.com"}, given)
    message = str(refused.value)
    assert "Pulumi.sat.yaml" in message
    assert "pulumi config set --secret --stack sat llmstack:redis_autoscaler_password" in message
    assert "autoscaling.policy: ongoing" in message
