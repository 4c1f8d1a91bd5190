"""The DCGM exporter: on every GPU node and nowhere else, holding no GPU, mapping GPUs to pods, and
scraped (with Ray's metrics) by the stack's Prometheus only. The objects are also validated as
Kubernetes objects with every other rendered one (test_render.py)."""

from __future__ import annotations

import csv
import io

import pytest

from infra.catalog import versions
from infra.render import render_stack
from infra.render.dcgm import COUNTERS_DIR, COUNTERS_FILE, DCGM_METRICS_PORT, FIELDS, counters_csv, dcgm_objects
from infra.render.gpu_node_template import GPU_TAINT, node_labels
from infra.render.karpenter import node_pool
from infra.render.rayservice import RAY_METRICS_PORT
from infra.spec.schema import GpuNodeGroup
from infra.spec.stack_file import load_stack


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def tolerates(tolerations: list[dict], taint: dict) -> bool:
    """Kubernetes' toleration matching, for the operators we render (Exists, Equal)."""
    for t in tolerations:
        if t.get("effect") not in (None, "", taint["effect"]) or t.get("key") != taint["key"]:
            continue
        if t.get("operator") == "Exists" or t.get("value") == taint.get("value"):
            return True
    return False


def exporter_pod(objects: list[dict]) -> dict:
    [daemon_set] = by_kind(objects, "DaemonSet")
    return daemon_set["spec"]["template"]


def test_the_exporter_lands_on_every_gpu_node_of_either_provisioner(example_stack):
    gpu_groups = [g for g in example_stack.node_groups if isinstance(g, GpuNodeGroup)]
    objects = dcgm_objects(example_stack)
    if not gpu_groups:
        assert objects == []  # `make dev` and CPU-only stacks: no GPU, no exporter
        return
    pod = exporter_pod(objects)["spec"]
    for group in gpu_groups:
        # Managed node groups get node_labels and GPU_TAINT; Karpenter's NodePool template is checked too.
        assert pod["nodeSelector"].items() <= node_labels(group).items(), group.name
        assert tolerates(pod["tolerations"], GPU_TAINT)
        template = node_pool(example_stack, group)["spec"]["template"]
        assert pod["nodeSelector"].items() <= template["metadata"]["labels"].items()
        assert all(tolerates(pod["tolerations"], taint) for taint in template["spec"]["taints"])


def test_a_cpu_node_does_not_take_the_exporter():
    spec = load_stack("prod")
    pod = exporter_pod(dcgm_objects(spec))["spec"]
    cpu_node_labels = {"llmstack.dev/node-group": "system", "kubernetes.io/os": "linux"}
    assert not pod["nodeSelector"].items() <= cpu_node_labels.items()
    assert not tolerates(pod["tolerations"], {"key": "dedicated", "value": "x", "effect": "NoSchedule"})


def test_the_exporter_maps_gpus_to_pods_without_holding_one():
    pod = exporter_pod(dcgm_objects(load_stack("dev")))
    [container] = pod["spec"]["containers"]
    assert container["image"] == versions.DCGM_EXPORTER_IMAGE
    env = {e["name"]: e for e in container["env"]}
    assert env["DCGM_EXPORTER_KUBERNETES"]["value"] == "true"
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}  # the Hostname label
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    socket_dir = "/var/lib/kubelet/pod-resources"
    assert mounts[socket_dir]["readOnly"] is True
    assert volumes[mounts[socket_dir]["name"]]["hostPath"]["path"] == socket_dir
    # A GPU request would take a GPU away from Ray; the nvidia runtime hands it all of them instead.
    assert "nvidia.com/gpu" not in str(container["resources"])
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert container["args"] == ["-f", f"{COUNTERS_DIR}/{COUNTERS_FILE}"] and mounts[COUNTERS_DIR]["readOnly"]
    assert container["securityContext"]["capabilities"] == {"add": ["SYS_ADMIN"], "drop": ["ALL"]}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_the_counters_file_is_what_the_exporter_parses():
    rows = [r for r in csv.reader(io.StringIO(counters_csv()), skipinitialspace=True) if r and not r[0].startswith("#")]
    assert [r[0] for r in rows] == [f.name for f in FIELDS]
    assert all(len(r) == 3 and r[1] in ("gauge", "counter") and r[2] for r in rows)
    assert len({f.name for f in FIELDS}) == len(FIELDS)
    [config_map] = by_kind(dcgm_objects(load_stack("dev")), "ConfigMap")
    assert config_map["data"][COUNTERS_FILE] == counters_csv()


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_gpu_and_ray_metrics_are_scraped_by_the_stacks_prometheus_only(stack):
    spec = load_stack(stack)
    objects = render_stack(spec)
    namespace = spec.gateway.metrics_namespace
    prometheus = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}]
    policies = {p["metadata"]["name"]: p["spec"] for p in by_kind(objects, "NetworkPolicy")}

    template = exporter_pod(objects)
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == str(DCGM_METRICS_PORT)
    assert template["spec"]["containers"][0]["ports"] == [{"name": "metrics", "containerPort": DCGM_METRICS_PORT}]
    exporter = policies["llmstack-dcgm-exporter-ingress"]
    assert exporter["podSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert exporter["ingress"] == [{"from": prometheus, "ports": [{"protocol": "TCP", "port": DCGM_METRICS_PORT}]}]

    [rayservice] = by_kind(objects, "RayService")
    cluster = rayservice["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        assert group["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(RAY_METRICS_PORT)
    ray = policies["llmstack-ray-ingress"]
    metrics_rules = [r for r in ray["ingress"] if {"protocol": "TCP", "port": RAY_METRICS_PORT} in r.get("ports", [])]
    assert metrics_rules == [{"from": prometheus, "ports": [{"protocol": "TCP", "port": RAY_METRICS_PORT}]}]
