"""`llmctl status`: the interpretation on realistic objects (the repository's own rendered
RayService with KubeRay-shaped status, pods made from its worker-group templates), and the
cloud path end to end through the official Kubernetes client against a stand-in API server.
The local path against a real `make dev` is in tests/e2e/test_llmctl_live.py."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx
import pytest

from infra.render import render_stack
from infra.render.common import NODE_GROUP_LABEL
from infra.spec.stack_file import PROJECT_ROOT, load_stack
from ops.devstack.lock import parse_lock
from ops.llmctl.status import report as sm
from ops.llmctl.status.cli import interpret_cloud
from tests.support.prometheus import exports_served, prometheus_scraping


def rendered(kind: str, stack: str = "dev") -> dict:
    return copy.deepcopy(next(o for o in render_stack(load_stack(stack)) if o["kind"] == kind))


def ready_rayservice(stack: str = "dev") -> dict:
    obj = rendered("RayService", stack)
    obj["status"] = {
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "NonZeroServeEndpoints",
                "message": "Number of serve endpoints is greater than 0",
                "lastTransitionTime": "2026-11-30T08:00:00Z",
            },
            {
                "type": "UpgradeInProgress",
                "status": "False",
                "reason": "NoPendingCluster",
                "message": "Active Ray cluster exists and no pending Ray cluster",
                "lastTransitionTime": "2026-11-30T08:00:00Z",
            },
        ],
        "numServeEndpoints": 1,
        "activeServiceStatus": {
            "rayClusterName": "llmstack-abcde",
            "applicationStatuses": {
                "llm": {
                    "status": "RUNNING",
                    "serveDeploymentStatuses": {
                        "LLMServer:llama-3_1-8b-instruct": {"status": "HEALTHY"},
                        "OpenAiIngress": {"status": "HEALTHY"},
                    },
                }
            },
        },
    }
    return obj


def worker_pod(rayservice: dict, group: str, phase: str, **status) -> dict:
    spec = next(g for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == group)
    template = copy.deepcopy(spec["template"])
    labels = {
        **template["metadata"]["labels"],
        "ray.io/group": group,
        "ray.io/node-type": "worker",
        "ray.io/cluster": "llmstack-abcde",
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"llmstack-abcde-{group}-worker-{phase.lower()[:5]}",
            "namespace": "llmstack",
            "labels": labels,
        },
        "spec": template["spec"],
        "status": {"phase": phase, **status},
    }


def unschedulable(message: str) -> dict:
    return {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}]}


def gpu_node(name: str, group: str, gpus: int) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {NODE_GROUP_LABEL: group, "node.kubernetes.io/instance-type": "g6.2xlarge"},
        },
        "status": {
            "allocatable": {"cpu": "8", "nvidia.com/gpu": str(gpus)},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def gateway(ready: int) -> dict:
    obj = rendered("Deployment")
    # A live Deployment's replicas are the HPA's (the rendered one leaves them to it).
    obj["spec"]["replicas"] = rendered("HorizontalPodAutoscaler")["spec"]["minReplicas"]
    obj["status"] = {"replicas": obj["spec"]["replicas"], "readyReplicas": ready}
    return obj


def live_cluster(rayservice: dict, **bounds: tuple[int, int]) -> dict:
    """The RayCluster KubeRay made from the RayService (name from its status), with the
    worker-group bounds it has now."""
    spec = copy.deepcopy(rayservice["spec"]["rayClusterConfig"])
    for group in spec["workerGroupSpecs"]:
        if group["groupName"] in bounds:
            group["minReplicas"], group["maxReplicas"] = bounds[group["groupName"]]
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "spec": spec,
        "metadata": {"name": rayservice["status"]["activeServiceStatus"]["rayClusterName"], "namespace": "llmstack"},
    }


def test_worker_bounds_kuberay_did_not_copy_are_shown_with_the_patch():
    rs = ready_rayservice("prod")  # l40s is the second group: index 1
    wanted = next(g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == "l40s")
    checks = sm.worker_bound_checks(rs, live_cluster(rs, l40s=(1, 2)))
    [check] = checks
    assert check.component == "worker group l40s" and check.health is sm.Health.DEGRADED
    patch = json.loads(check.detail.split("-p '")[1].rstrip("'"))
    assert patch == [
        {"op": "replace", "path": "/spec/workerGroupSpecs/1/minReplicas", "value": wanted["minReplicas"]},
        {"op": "replace", "path": "/spec/workerGroupSpecs/1/maxReplicas", "value": wanted["maxReplicas"]},
    ]
    assert "kubectl -n llmstack patch raycluster llmstack-abcde --type=json" in check.detail
    assert sm.worker_bound_checks(rs, live_cluster(rs)) == []


def test_healthy_cloud_stack_is_ok():
    rs = ready_rayservice()
    report = interpret_cloud(
        load_stack("dev"),
        where="t",
        rayservice=rs,
        nodes=[gpu_node("ip-1", "l4", 1)],
        pods=[worker_pod(rs, "l4", "Running")],
        events=[],
        gateway=gateway(1),
    )
    assert report.health is sm.Health.OK, report.checks
    rows = [(g.group, g.min_pods, g.max_pods, g.running, g.pending) for g in report.worker_groups]
    assert rows == [("l4", 1, 2, 1, 0)]
    assert {d.deployment for d in report.deployments} == {"LLMServer:llama-3_1-8b-instruct", "OpenAiIngress"}


@pytest.mark.parametrize(
    "message, expect",
    [
        (
            "0/3 nodes are available: 1 Insufficient nvidia.com/gpu, 2 node(s) didn't match Pod's node "
            "affinity/selector.",
            "no free GPU",
        ),
        ("0/2 nodes are available: 2 node(s) had untolerated taint {nvidia.com/gpu: true}.", "taint"),
        ("0/2 nodes are available: 2 node(s) didn't match Pod's node affinity/selector.", "llmstack.dev/node-group"),
    ],
)
def test_pending_gpu_pods_get_the_scheduler_reason_and_a_hint(message, expect):
    rs = ready_rayservice()
    pod = worker_pod(rs, "l4", "Pending", **unschedulable(message))
    report = interpret_cloud(
        load_stack("dev"), where="t", rayservice=rs, nodes=[], pods=[pod], events=[], gateway=gateway(1)
    )
    [pending] = report.pending_pods
    assert pending.group == "l4" and pending.reason == message and expect in pending.hint
    assert report.health is sm.Health.DEGRADED
    assert any(c.runbook == "ops/runbooks/pods-pending-on-gpus.md" for c in report.checks)


def test_autoscaler_refusal_is_shown_from_events():
    rs = ready_rayservice()
    pod = worker_pod(rs, "l4", "Pending", **unschedulable("0/1 nodes are available: 1 Insufficient nvidia.com/gpu."))
    event = {
        "involvedObject": {"kind": "Pod", "name": pod["metadata"]["name"]},
        "reason": "NotTriggerScaleUp",
        "message": "pod didn't trigger scale-up: 1 max node group size reached",
    }
    [pending] = sm.pending_pods([pod], [event])
    assert "max node group size reached" in pending.reason and "max_size" in pending.hint


def test_not_ready_and_crash_looping_replicas_are_down():
    rs = ready_rayservice()
    rs["status"]["conditions"][0] = {
        "type": "Ready",
        "status": "False",
        "reason": "ZeroServeEndpoints",
        "message": "Number of serve endpoints dropped to 0",
    }
    app = rs["status"]["activeServiceStatus"]["applicationStatuses"]["llm"]
    app["status"] = "UNHEALTHY"
    app["serveDeploymentStatuses"]["LLMServer:llama-3_1-8b-instruct"] = {
        "status": "UNHEALTHY",
        "message": "The deployment failed to start 3 times in a row.",
    }
    pod = worker_pod(
        rs,
        "l4",
        "Running",
        containerStatuses=[
            {
                "name": "ray-worker",
                "restartCount": 7,
                "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}},
            }
        ],
    )
    report = interpret_cloud(
        load_stack("dev"),
        where="t",
        rayservice=rs,
        nodes=[gpu_node("ip-1", "l4", 1)],
        pods=[pod],
        events=[],
        gateway=gateway(1),
    )
    down = {c.component: c for c in report.checks if c.health is sm.Health.DOWN}
    assert "ZeroServeEndpoints" in down["rayservice llmstack"].detail
    assert "failed to start 3 times" in down["deployment LLMServer:llama-3_1-8b-instruct"].detail
    assert "OOMKilled 137" in down[f"pod {pod['metadata']['name']}"].detail
    assert down[f"pod {pod['metadata']['name']}"].runbook == "ops/runbooks/replica-crash-loop.md"


def test_gpu_node_without_device_plugin_and_upgrade_in_progress():
    rs = ready_rayservice("prod")
    rs["status"]["conditions"][1] = {
        "type": "UpgradeInProgress",
        "status": "True",
        "reason": "BothActivePendingClustersExist",
        "message": "",
    }
    rs["status"]["pendingServiceStatus"] = {"rayClusterName": "llmstack-fghij"}
    report = interpret_cloud(
        load_stack("prod"),
        where="t",
        rayservice=rs,
        pods=[],
        events=[],
        gateway=gateway(3),
        nodes=[gpu_node("ip-2", "l40s", 0)],
    )
    details = " ".join(c.detail for c in report.checks)
    assert "no nvidia.com/gpu" in details and "llmstack-fghij" in details
    assert {g.group for g in report.worker_groups} == {"a100", "l40s", "a10g-spot"}


def test_missing_rayservice_and_gateway_say_deploy():
    report = interpret_cloud(load_stack("dev"), where="t", rayservice=None, pods=[], nodes=[], events=[], gateway=None)
    assert report.health is sm.Health.DOWN
    assert "make deploy STACK=dev" in report.checks[0].detail


def test_local_serve_details_rows_and_failures():
    details = {
        "applications": {
            "llm": {
                "status": "DEPLOYING",
                "message": "",
                "deployments": {
                    "LLMServer:tiny-chat": {
                        "status": "UPDATING",
                        "message": "Deploying new version.",
                        "target_num_replicas": 2,
                        "deployment_config": {"autoscaling_config": {"min_replicas": 2, "max_replicas": 2}},
                        "replicas": [{"state": "RUNNING"}, {"state": "STARTING"}],
                    },
                    "LLMServer:tiny-chat-ngram": {
                        "status": "DEPLOY_FAILED",
                        "message": "Replica crashed: engine died",
                        "replicas": [],
                    },
                },
            }
        }
    }
    rows = sm.serve_rows(details)
    assert rows[0].replicas == {"RUNNING": 1, "STARTING": 1} and (rows[0].min_replicas, rows[0].target) == (2, 2)
    checks = {c.component: c for c in sm.serve_checks(details["applications"], where="local")}
    assert checks["serve app llm"].health is sm.Health.DEGRADED
    assert checks["deployment LLMServer:tiny-chat-ngram"].health is sm.Health.DOWN
    assert "engine died" in checks["deployment LLMServer:tiny-chat-ngram"].detail


def test_lock_file_of_a_gone_make_dev_is_not_a_running_stack():
    text = json.dumps({"pid": 4242, "base_url": "http://127.0.0.1:1/v1", "ray_address": "10.0.0.1:6379"})
    assert parse_lock(text, pid_alive=lambda pid: False) is None
    assert parse_lock(text, pid_alive=lambda pid: True).gateway_root == "http://127.0.0.1:1"
    assert parse_lock('{"pid": 1}', pid_alive=lambda pid: True) is None  # still starting: no endpoints yet
    assert parse_lock("", pid_alive=lambda pid: True) is None


# --- the CLI, through the official client -------------------------------------------------------


class FakeApiServer:
    """Answers the GETs `llmctl status` makes, with Kubernetes-shaped JSON. A route may instead be
    a function of the query string returning JSON text: what a service proxy passes through from
    the Service behind it (here a real Prometheus). `authorizations` holds each request's
    Authorization header."""

    def __init__(self, routes: dict[str, dict | Callable[[str], str]]) -> None:
        routes_, authorizations = routes, []
        self.authorizations: list[str | None] = authorizations

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                authorizations.append(self.headers.get("Authorization"))
                url = urlsplit(self.path)
                body = routes_.get(unquote(url.path))
                data = body(url.query) if callable(body) else json.dumps(body or {"kind": "Status", "code": 404})
                self.send_response(200 if body else 404)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(data.encode())

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def kubeconfig(tmp_path: Path, server: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "t",
                "clusters": [{"name": "t", "cluster": {"server": server}}],
                "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}],
                "users": [{"name": "t", "user": {"token": "not-a-real-token"}}],
            }
        )
    )
    return path


def llmctl_status(stack: str, kube: Path, *options: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBECONFIG": str(kube)}
    return subprocess.run(
        [str(Path(sys.executable).parent / "llmctl"), "status", "--stack", stack, "--json", *options],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        env=env,
        timeout=60,
    )


def test_cloud_status_through_the_kubernetes_client(tmp_path):
    rs = ready_rayservice()
    pending = worker_pod(
        rs, "l4", "Pending", **unschedulable("0/1 nodes are available: 1 Insufficient nvidia.com/gpu.")
    )
    server = FakeApiServer(
        {
            "/apis/ray.io/v1/namespaces/llmstack/rayservices/llmstack": rs,
            "/api/v1/namespaces/llmstack/pods": {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {},
                "items": [worker_pod(rs, "l4", "Running"), pending],
            },
            "/api/v1/nodes": {
                "kind": "NodeList",
                "apiVersion": "v1",
                "metadata": {},
                "items": [gpu_node("ip-1", "l4", 1)],
            },
            "/api/v1/namespaces/llmstack/events": {
                "kind": "EventList",
                "apiVersion": "v1",
                "metadata": {},
                "items": [],
            },
            "/apis/apps/v1/namespaces/llmstack/deployments/llmstack-gateway": gateway(1),
            "/apis/ray.io/v1/namespaces/llmstack/rayclusters/llmstack-abcde": live_cluster(rs, l4=(1, 1)),
        }
    )
    result = llmctl_status("dev", kubeconfig(tmp_path, server.url))
    assert result.returncode == 1, result.stderr  # degraded: one pod pending
    report = json.loads(result.stdout)
    assert report["health"] == "degraded"
    assert report["worker_groups"] == [{"group": "l4", "min_pods": 1, "max_pods": 2, "running": 1, "pending": 1}]
    assert "Insufficient nvidia.com/gpu" in report["pending_pods"][0]["reason"]
    assert report["gpu_nodes"][0]["gpus"] == 1
    [drift] = [c for c in report["checks"] if c["component"] == "worker group l4"]
    assert "allows 1-1 pods, the RayService asks 1-2" in drift["detail"]
    server.server.shutdown()


def lora_dev_stack(tmp_path: Path) -> tuple[Path, str]:
    """Pulumi.dev.yaml with LoRA adapters on its model, written to tmp_path; and the served name."""
    import yaml

    document = yaml.safe_load((PROJECT_ROOT / "Pulumi.dev.yaml").read_text())
    [model] = document["config"]["llmstack:models"]
    model["lora"] = {
        "max_loras": 2,
        "adapters": [
            {"id": "sql", "source": "s3://adapters/sql", "base_model": model["source"]},
            {"id": "pirate", "source": "s3://adapters/pirate", "base_model": model["source"]},
        ],
    }
    stack_file = tmp_path / "Pulumi.dev.yaml"
    stack_file.write_text(yaml.safe_dump(document))
    return stack_file, model["served_name"]


def cluster_routes(rs: dict, pods: list[dict]) -> dict[str, dict | Callable[[str], str]]:
    return {
        "/apis/ray.io/v1/namespaces/llmstack/rayservices/llmstack": rs,
        "/api/v1/namespaces/llmstack/pods": {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": pods},
        "/api/v1/nodes": {"kind": "NodeList", "apiVersion": "v1", "metadata": {}, "items": []},
        "/api/v1/namespaces/llmstack/events": {"kind": "EventList", "metadata": {}, "items": []},
        "/apis/apps/v1/namespaces/llmstack/deployments/llmstack-gateway": gateway(1),
    }


PROMETHEUS_QUERY = "/api/v1/namespaces/monitoring/services/prometheus-server:80/proxy/api/v1/query"


def test_cloud_status_asks_the_stacks_prometheus_which_adapters_each_ray_pod_holds(tmp_path):
    """The Ray pods' own metrics port admits only the Prometheus namespace (our NetworkPolicy), so
    the cloud read goes to that Prometheus, through the API server's service proxy (or straight to
    a URL given with --prometheus). Real Prometheus, scraping two pods' verbatim Ray exports."""
    stack_file, served = lora_dev_stack(tmp_path)
    data = Path(__file__).parent / "data"
    exports = {
        pod: (data / f"node_{x}.prom").read_text().replace("tiny-chat", served)
        for pod, x in (("llmstack-abcde-head", "a"), ("llmstack-abcde-l4-worker-1", "b"))
    }
    rs = ready_rayservice()
    with exports_served(exports) as targets, prometheus_scraping(targets, tmp_path / "prometheus") as prometheus:
        routes = cluster_routes(rs, [worker_pod(rs, "l4", "Running")])
        routes[PROMETHEUS_QUERY] = lambda query: httpx.get(f"{prometheus}/api/v1/query?{query}", timeout=5).text
        server = FakeApiServer(routes)
        try:
            through_proxy = llmctl_status(str(stack_file), kubeconfig(tmp_path, server.url))
            direct = llmctl_status(str(stack_file), kubeconfig(tmp_path, server.url), "--prometheus", prometheus)
        finally:
            server.server.shutdown()
    expected = [
        {"model": served, "adapter": "pirate", "replica": "8redenjb", "node": "llmstack-abcde-l4-worker-1"},
        {"model": served, "adapter": "sql", "replica": "r1abc", "node": "llmstack-abcde-head"},
        {"model": served, "adapter": "sql", "replica": "8redenjb", "node": "llmstack-abcde-l4-worker-1"},
    ]  # not the head's `pirate`: its replica unloaded it (0)
    for result in (through_proxy, direct):
        report = json.loads(result.stdout)
        assert (report["adapters"], report["adapters_note"]) == (expected, None), result.stderr
    assert set(server.authorizations) == {"Bearer not-a-real-token"}  # the proxy read used the kubeconfig's


def test_cloud_status_says_which_prometheus_it_could_not_read_and_the_key_to_set(tmp_path):
    stack_file, served = lora_dev_stack(tmp_path)
    rs = ready_rayservice()
    server = FakeApiServer(cluster_routes(rs, [worker_pod(rs, "l4", "Running")]))  # no Prometheus Service: 404
    try:
        result = llmctl_status(str(stack_file), kubeconfig(tmp_path, server.url))
    finally:
        server.server.shutdown()
    report = json.loads(result.stdout)
    assert report["adapters"] == [{"model": served, "adapter": None, "replica": None, "node": None}]
    assert report["adapters_note"] == (
        "Prometheus monitoring/prometheus-server:80 not read (HTTP 404 Not Found: no Service prometheus-server:80 "
        "in monitoring: set observability.prometheus_service in Pulumi.dev.yaml, or pass --prometheus URL)"
    )


def test_unreachable_cluster_is_one_clear_line(tmp_path):
    from ops.harness.processes import free_port

    result = llmctl_status("dev", kubeconfig(tmp_path, f"https://127.0.0.1:{free_port()}"))
    assert result.returncode == 3
    assert result.stderr.startswith("cluster unreachable: cannot reach the Kubernetes API at https://127.0.0.1:")
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_no_kubeconfig_says_how_to_get_one(tmp_path):
    result = llmctl_status("prod", tmp_path / "missing")
    assert result.returncode == 3 and "aws eks update-kubeconfig --region us-east-1" in result.stderr


def test_local_status_without_make_dev_says_so(tmp_path):
    env = {**os.environ, "LLMSTACK_STATE_DIR": str(tmp_path)}
    result = subprocess.run(
        [str(Path(sys.executable).parent / "llmctl"), "status", "--stack", "local"],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        env=env,
        timeout=60,
    )
    assert result.returncode == 3 and result.stderr.startswith("not running: make dev is not running")


def test_deploy_progress_shows_failures_and_scheduling_waits_not_routine_updates():
    from ops.devstack.serve import app_line, deployment_messages

    app = {
        "status": "DEPLOYING",
        "deployments": {
            "LLMServer:a": {"status": "UPDATING", "message": "Deploying new version."},
            "LLMServer:b": {
                "status": "UPSCALING",
                "message": "Deployment 'b' has 1 replicas that have taken more than "
                "30s to be scheduled.\nResources required: {CPU: 2}",
            },
            "LLMServer:c": {"status": "DEPLOY_FAILED", "message": "The deployment failed to start 3 times in a row."},
            "OpenAiIngress": {"status": "HEALTHY", "message": ""},
        },
    }
    assert deployment_messages(app) == {
        "LLMServer:b: Deployment 'b' has 1 replicas that have taken more than 30s to be scheduled.",
        "LLMServer:c: The deployment failed to start 3 times in a row.",
    }
    assert app_line(app) == (
        "deploying (LLMServer:a: updating, LLMServer:b: upscaling, LLMServer:c: deploy_failed, OpenAiIngress: healthy)"
    )
