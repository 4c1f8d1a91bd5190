"""The RayService's Redis side, rendered: Ray's own Redis user, and over TLS the CA bundle and
server name Ray's C++ client needs, validated against KubeRay's v1.7.0 CRD."""

from __future__ import annotations

import jsonschema
import yaml

from infra.plan.drain_budget import SERVE_GRACEFUL_STOP_S, SPOT_NOTICE_S
from infra.render import render_stack, to_yaml
from infra.render.rayservice import RAY_CA_BUNDLE, with_gcs_redis_address
from infra.spec.stack_file import spec_from_document
from tests.support.stacks import SCHEMAS, stack_document


def rayservice_of(redis: dict, **render) -> dict:
    spec = spec_from_document(stack_document(redis=redis), name="t", file_label="Pulumi.t.yaml")
    objects = list(yaml.safe_load_all(to_yaml(render_stack(spec, **render))))
    return next(o for o in objects if o["kind"] == "RayService")


def head_env(rayservice: dict) -> dict[str, str]:
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in head["env"]}


def validate(rayservice: dict) -> None:
    crd = yaml.safe_load((SCHEMAS / "ray.io_rayservices.yaml").read_text())
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
    jsonschema.validate(rayservice, schema)


def test_external_tls_redis_gets_ca_and_server_name() -> None:
    rayservice = rayservice_of({"mode": "external", "host": "redis.example.internal", "port": 6380})
    options = rayservice["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    assert options["redisAddress"] == "rediss://redis.example.internal:6380"
    env = head_env(rayservice)
    assert env["RAY_REDIS_CA_CERT"] == RAY_CA_BUNDLE
    assert env["RAY_REDIS_SERVER_NAME"] == "redis.example.internal"
    validate(rayservice)


def test_external_plain_redis_gets_no_tls_variables() -> None:
    rayservice = rayservice_of({"mode": "external", "host": "redis.example.internal", "tls": False})
    assert (
        rayservice["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]["redisAddress"]
        == "redis.example.internal:6379"
    )
    assert "RAY_REDIS_CA_CERT" not in head_env(rayservice)


def test_managed_redis_is_tls_even_before_its_host_is_known() -> None:
    """Offline renders cannot know ElastiCache's host; they still say TLS, with the CA."""
    rayservice = rayservice_of({"mode": "managed"})
    assert rayservice["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]["redisAddress"].startswith("rediss://")
    assert head_env(rayservice)["RAY_REDIS_CA_CERT"] == RAY_CA_BUNDLE
    validate(rayservice)


def test_swapping_in_the_real_host_moves_the_server_name_too() -> None:
    rendered = rayservice_of({"mode": "managed"})
    swapped = with_gcs_redis_address(rendered["spec"], "rediss://master.abc.cache.amazonaws.com:6379")
    head = swapped["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    names = [e["name"] for e in head["env"]]
    assert names.count("RAY_REDIS_SERVER_NAME") == names.count("RAY_REDIS_CA_CERT") == 1
    assert {e["name"]: e.get("value") for e in head["env"]}["RAY_REDIS_SERVER_NAME"] == "master.abc.cache.amazonaws.com"
    assert (
        rendered["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]["redisAddress"]
        != swapped["rayClusterConfig"]["gcsFaultToleranceOptions"]["redisAddress"]
    )  # a copy, not an edit


def test_ray_uses_its_own_redis_user() -> None:
    options = rayservice_of({"mode": "in_cluster"})["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    for field in ("redisUsername", "redisPassword"):
        assert options[field]["valueFrom"]["secretKeyRef"]["name"] == "llmstack-redis-ray"


def test_every_ray_container_pins_vllms_ray_executor_v2_with_shared_memory_for_it() -> None:
    """RayExecutorV2 talks to the GPU workers of its node over a shared-memory queue: every Ray
    pod pins it and mounts a memory-backed /dev/shm."""
    cluster = rayservice_of({"mode": "in_cluster"})["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]["spec"], *(g["template"]["spec"] for g in cluster["workerGroupSpecs"])]
    for pod in pods:
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["VLLM_USE_RAY_V2_EXECUTOR_BACKEND"] == "1"
        assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]


def test_a_stopping_worker_drains_within_the_spot_notice_and_holds_serves_graceful_stop() -> None:
    """A worker pod asked to stop (Karpenter's spot interruption handling drains at once) must be
    gone before EC2 reclaims the instance, stop its Ray processes itself before the kubelet's
    SIGKILL, and give Serve's graceful stop of its replicas its whole time."""
    cluster = rayservice_of({"mode": "in_cluster"})["spec"]["rayClusterConfig"]
    assert cluster["workerGroupSpecs"]
    for group in cluster["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        grace = pod["terminationGracePeriodSeconds"]
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        ray_drain = float(env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"])
        assert SERVE_GRACEFUL_STOP_S < ray_drain < grace < SPOT_NOTICE_S
    head_env = {e["name"] for e in cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]}
    assert "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S" not in head_env
