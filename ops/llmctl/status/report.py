"""What `llmctl status` concludes from what it reads. Pure: plain dicts in, typed report out.

Inputs are the objects as their sources serialize them: Ray Serve's `ServeInstanceDetails`
(local), and Kubernetes objects in their API (camelCase) form, which is what the official
client's `sanitize_for_serialization` returns and what `kubectl get -o json` prints. So the
tests feed these functions objects built from the repository's own rendered manifests.

Each finding says how healthy something is, why, and which runbook to open.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from enum import Enum
from typing import Any

from pydantic import BaseModel, Field

RUNBOOKS = "ops/runbooks"
OK_DEPLOYMENT_STATES = {"HEALTHY", "UPSCALING", "DOWNSCALING"}


class Health(str, Enum):
    OK = "ok"
    DEGRADED = "degraded"
    DOWN = "down"

    @property
    def rank(self) -> int:
        return [Health.OK, Health.DEGRADED, Health.DOWN].index(self)


class Check(BaseModel):
    component: str = Field(description="What was checked, e.g. `redis` or `rayservice llmstack`.")
    health: Health
    detail: str = Field(description="What was seen, in one line.")
    runbook: str | None = Field(default=None, description="Runbook to open when it is not ok.")


class DeploymentRow(BaseModel):
    app: str
    deployment: str
    status: str
    replicas: dict[str, int] = Field(default_factory=dict, description="Replica count per state (local only).")
    target: int | None = Field(default=None, description="Replicas Serve aims for now.")
    min_replicas: int | None = None
    max_replicas: int | None = None


class WorkerGroupRow(BaseModel):
    group: str
    min_pods: int
    max_pods: int
    running: int
    pending: int


class NodeRow(BaseModel):
    name: str
    group: str
    instance_type: str
    gpus: int = Field(description="nvidia.com/gpu the node offers (allocatable).")
    ready: bool


class PendingPod(BaseModel):
    name: str
    group: str | None
    reason: str = Field(description="The scheduler's or kubelet's own words.")
    hint: str = Field(description="What it usually means here and what to check.")


class ModelQueueRow(BaseModel):
    """A served model's capacity and queue, as the gateway's Redis and metrics hold them."""

    model: str = Field(description="The served model name (what requests name).")
    max_per_replica: int = Field(description="autoscaling.max_ongoing_requests: the capacity's ceiling per replica.")
    capacity_per_replica: int = Field(
        description="Requests in flight per replica the gateway allows now: the adapted capacity, or the ceiling "
        "while the model is not adaptive or not yet measured."
    )
    move: str = Field(
        description="The adaptation's last decision: down, up, in_band, idle, unmeasured, or fixed (adaptive off)."
    )
    in_flight: int = Field(description="Requests holding a slot of the model, across every gateway replica.")
    queued: int = Field(description="Requests waiting in the model's fair queue, all tiers.")
    queue_wait_s: float | None = Field(
        default=None,
        description="Mean wait for a slot of the requests admitted since the gateway started (its "
        "llmstack_gateway_queue_wait_seconds); None: no request yet, or no metrics read.",
    )


class AdapterRow(BaseModel):
    """A LoRA adapter loaded on a Serve replica, or a model with LoRA that has none loaded yet."""

    model: str = Field(description="The base model's served name.")
    adapter: str | None = Field(
        description="The adapter's id (clients ask for `<model>:<adapter>`); None: no replica holds an adapter of "
        "this model yet (each is fetched on the first request that names it)."
    )
    replica: str | None = Field(default=None, description="The Serve replica holding it (Ray Serve's replica tag).")
    node: str | None = Field(
        default=None, description="Where that replica runs: the Ray node's address (local) or the Ray pod (cloud)."
    )


class MetricsScrape(BaseModel):
    """One Ray node's Prometheus export as read (or not) by the I/O shell."""

    node: str = Field(description="The Ray node's address (local) or pod name (cloud).")
    text: str | None = Field(default=None, description="The exposition text; None when it could not be read.")
    error: str | None = Field(default=None, description="Why it could not be read, in one line.")


class PrometheusRead(BaseModel):
    """One instant query's answer from a Prometheus (as /api/v1/query returns it), or why not."""

    source: str = Field(description="Which Prometheus, as the report names it.")
    answer: dict[str, Any] | None = Field(default=None, description="The JSON answer; None when not read.")
    error: str | None = Field(default=None, description="Why it could not be read, in one line.")


class StatusReport(BaseModel):
    stack: str
    where: str = Field(description="`make dev (pid N)` or the kube context.")
    checks: list[Check] = Field(default_factory=list)
    deployments: list[DeploymentRow] = Field(default_factory=list)
    worker_groups: list[WorkerGroupRow] = Field(default_factory=list)
    gpu_nodes: list[NodeRow] = Field(default_factory=list)
    pending_pods: list[PendingPod] = Field(default_factory=list)
    models: list[ModelQueueRow] = Field(default_factory=list)
    adapters: list[AdapterRow] = Field(
        default_factory=list, description="LoRA adapters loaded per replica (models with `lora:` only)."
    )
    adapters_note: str | None = Field(
        default=None,
        description="Why the adapter table may be incomplete: Ray nodes (local) or the Prometheus (cloud) not read.",
    )

    @property
    def health(self) -> Health:
        return max((c.health for c in self.checks), key=lambda h: h.rank, default=Health.OK)


def runbook(name: str) -> str:
    return f"{RUNBOOKS}/{name}.md"


# --- the gateway's capacity and queue per model (Redis, and the gateway's /metrics) ------------


def queue_wait_means(metrics_text: str) -> dict[str, float]:
    """Model -> mean queue wait in seconds (all tiers), from a gateway's Prometheus exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "llmstack_gateway_queue_wait_seconds":
            continue
        for sample in family.samples:
            model = sample.labels.get("model", "")
            if sample.name.endswith("_sum"):
                sums[model] = sums.get(model, 0.0) + sample.value
            elif sample.name.endswith("_count"):
                counts[model] = counts.get(model, 0.0) + sample.value
    return {model: sums.get(model, 0.0) / n for model, n in counts.items() if n > 0}


def model_queue_row(
    model: str,
    *,
    max_per_replica: int,
    adaptive: bool,
    in_flight: int,
    queued: int,
    adapted_slots: str | None,
    adapted_move: str | None,
    queue_wait_s: float | None,
) -> ModelQueueRow:
    """A model's row from its Redis reads (`adapted_*`: the capacity hash's `slots` and `move`,
    None when absent), the capacity as fair_queue.lua reads it: the adapted figure, at least 1 and
    never past the ceiling."""
    if not adaptive:
        capacity, move = max_per_replica, "fixed"
    elif adapted_slots is None or not adapted_slots.lstrip("-").isdigit() or int(adapted_slots) < 0:
        capacity, move = max_per_replica, "unmeasured"
    else:
        capacity = min(max_per_replica, max(1, int(adapted_slots)))
        move = adapted_move or "unmeasured"
    return ModelQueueRow(
        model=model,
        max_per_replica=max_per_replica,
        capacity_per_replica=capacity,
        move=move,
        in_flight=in_flight,
        queued=queued,
        queue_wait_s=queue_wait_s,
    )


# --- LoRA adapters loaded per replica (Ray's metrics export on every node) -------------------------

# Ray Serve LLM loads adapters through Serve's model multiplexing, which sets this gauge per replica
# and adapter: 1 while loaded, 0 once unloaded (ray/serve/multiplex.py). Ray exports it on every
# node's metrics port with the `ray_` prefix and Serve's `replica`, `deployment`, `application`
# tags (ray/serve/metrics.py); the value lags a load by Ray's metrics report interval (seconds).
# A local stack's nodes are read directly; a cloud stack's through the Prometheus that scrapes the
# Ray pods (their metrics port admits only its namespace), with this instant query.
LOADED_ADAPTER_METRIC = "ray_serve_registered_multiplexed_model_id"
LOADED_ADAPTERS_QUERY = f"{LOADED_ADAPTER_METRIC} == 1"


def loaded_adapters(metrics_text: str, node: str) -> list[AdapterRow]:
    """The adapters a node's replicas hold, from one Ray metrics export. The multiplexed model id is
    `<base>:<adapter>`, split at the first colon as Ray Serve LLM does (lora_utils.get_base_model_id)."""
    from prometheus_client.parser import text_string_to_metric_families

    rows = []
    for family in text_string_to_metric_families(metrics_text):
        if family.name != LOADED_ADAPTER_METRIC:
            continue
        for sample in family.samples:
            model_id = sample.labels.get("model_id", "")
            if sample.value != 1 or ":" not in model_id:
                continue
            base, adapter = model_id.split(":", 1)
            rows.append(AdapterRow(model=base, adapter=adapter, replica=sample.labels.get("replica"), node=node))
    return rows


def adapters_from_query(answer: dict[str, Any]) -> list[AdapterRow]:
    """The adapters loaded per replica from Prometheus' answer to `LOADED_ADAPTERS_QUERY` (its
    /api/v1/query JSON: a vector of series with their labels). The node is the series' `pod` label,
    which the Prometheus community chart's `kubernetes-pods` job sets from the pod's name, else the
    scrape target (`instance`)."""
    rows = []
    for series in (answer.get("data") or {}).get("result") or []:
        labels = series.get("metric") or {}
        value = (series.get("value") or [None, "0"])[1]
        model_id = labels.get("model_id", "")
        if float(value) != 1 or ":" not in model_id:
            continue
        base, adapter = model_id.split(":", 1)
        node = labels.get("pod") or labels.get("instance")
        rows.append(AdapterRow(model=base, adapter=adapter, replica=labels.get("replica"), node=node))
    return rows


def adapter_table(
    lora_models: Sequence[str], loaded: Sequence[AdapterRow], note: str | None
) -> tuple[list[AdapterRow], str | None]:
    """The table's rows: every loaded adapter of `lora_models` (served names of the models with
    `lora:`), one row per replica holding it, and a row without adapter for a model none of whose
    adapters is loaded anywhere; `note` says why the table may be incomplete."""
    if not lora_models:
        return [], None
    rows = [row for row in loaded if row.model in lora_models]
    held = {r.model for r in rows}
    rows += [AdapterRow(model=m, adapter=None) for m in lora_models if m not in held]
    rows.sort(key=lambda r: (r.model, r.adapter is None, r.adapter or "", r.node or "", r.replica or ""))
    return rows, note


def adapter_rows(lora_models: Sequence[str], scrapes: Sequence[MetricsScrape]) -> tuple[list[AdapterRow], str | None]:
    """The table from every Ray node's own export (a local stack), with a note naming the nodes whose
    metrics were not read (the table may miss theirs)."""
    loaded = [row for scrape in scrapes if scrape.text is not None for row in loaded_adapters(scrape.text, scrape.node)]
    unread = [f"{s.node} ({s.error})" for s in scrapes if s.text is None]
    if not scrapes:
        note: str | None = "no Ray node to read the loaded adapters from"
    else:
        note = ("Ray metrics not read from " + "; ".join(unread)) if unread else None
    return adapter_table(lora_models, loaded, note)


def ray_metrics_targets(nodes: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """(node address, metrics URL) of each live Ray node, from `ray.nodes()`: its NodeManagerAddress
    and MetricsExportPort, the targets Ray's own Prometheus service discovery writes
    (ray/_private/metrics_agent.py)."""
    targets = []
    for node in nodes:
        port = node.get("MetricsExportPort")
        alive = node.get("Alive", node.get("alive"))  # ray.nodes() carries both spellings
        if alive is True and node.get("NodeManagerAddress") and isinstance(port, int) and port > 0:
            address = node["NodeManagerAddress"]
            host = f"[{address}]" if ":" in address else address
            targets.append((address, f"http://{host}:{port}/metrics"))
    return sorted(targets)


# --- Ray Serve (local: ServeInstanceDetails; cloud: the RayService's status) -------------------


def serve_rows(details: dict[str, Any]) -> list[DeploymentRow]:
    """One row per deployment, with replica counts by state and the autoscaling bounds."""
    rows = []
    for app_name, app in sorted(details.get("applications", {}).items()):
        for name, d in sorted(app.get("deployments", {}).items()):
            counts: dict[str, int] = {}
            for replica in d.get("replicas", []):
                state = str(replica.get("state"))
                counts[state] = counts.get(state, 0) + 1
            scaling = (d.get("deployment_config") or {}).get("autoscaling_config") or {}
            rows.append(
                DeploymentRow(
                    app=app_name,
                    deployment=name,
                    status=str(d.get("status")),
                    replicas=counts,
                    target=d.get("target_num_replicas"),
                    min_replicas=scaling.get("min_replicas"),
                    max_replicas=scaling.get("max_replicas"),
                )
            )
    return rows


def serve_checks(applications: dict[str, Any], *, where: str) -> list[Check]:
    """Applications and deployments that are not serving normally. `applications` maps app
    name to `{status, message, deployments|serveDeploymentStatuses: {name: {status, message}}}`
    (Serve's details and KubeRay's applicationStatuses share these fields)."""
    if not applications:
        return [
            Check(
                component=f"serve ({where})",
                health=Health.DOWN,
                detail="no Serve application is deployed",
                runbook=runbook("replica-crash-loop"),
            )
        ]
    checks = []
    for app_name, app in sorted(applications.items()):
        status = str(app.get("status"))
        deployments = app.get("deployments") or app.get("serveDeploymentStatuses") or {}
        if status == "RUNNING":
            checks.append(
                Check(
                    component=f"serve app {app_name}",
                    health=Health.OK,
                    detail=f"running, {len(deployments)} deployments",
                )
            )
        elif status in ("DEPLOYING", "NOT_STARTED"):
            checks.append(
                Check(
                    component=f"serve app {app_name}",
                    health=Health.DEGRADED,
                    detail=f"{status.lower()}: engines are loading",
                )
            )
        else:
            checks.append(
                Check(
                    component=f"serve app {app_name}",
                    health=Health.DOWN,
                    detail=f"{status.lower()}: {_first_line(app.get('message'))}",
                    runbook=runbook("replica-crash-loop"),
                )
            )
        for name, d in sorted(deployments.items()):
            d_status = str(d.get("status"))
            if d_status in OK_DEPLOYMENT_STATES:
                continue
            health = Health.DEGRADED if d_status == "UPDATING" else Health.DOWN
            checks.append(
                Check(
                    component=f"deployment {name}",
                    health=health,
                    detail=f"{d_status.lower()}: {_first_line(d.get('message')) or 'no message'}",
                    runbook=None if health is Health.DEGRADED else runbook("replica-crash-loop"),
                )
            )
    return checks


# --- Kubernetes ---------------------------------------------------------------------------------


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == kind), None)


def rayservice_checks(rayservice: dict[str, Any]) -> list[Check]:
    """KubeRay's verdict (`Ready`, `UpgradeInProgress`) and the active cluster's Serve state."""
    name = f"rayservice {rayservice['metadata']['name']}"
    ready = _condition(rayservice, "Ready")
    checks = []
    if ready is None:
        checks.append(
            Check(
                component=name,
                health=Health.DEGRADED,
                detail="no Ready condition yet: KubeRay has not reconciled it (is the operator running?)",
            )
        )
    elif ready.get("status") == "True":
        checks.append(Check(component=name, health=Health.OK, detail=f"Ready ({ready.get('reason')})"))
    else:
        reason = ready.get("reason", "")
        health = Health.DEGRADED if reason == "Initializing" else Health.DOWN
        book = "pods-pending-on-gpus" if reason in ("Initializing", "InitializingTimeout") else "replica-crash-loop"
        checks.append(
            Check(
                component=name,
                health=health,
                detail=f"not Ready ({reason}): {_first_line(ready.get('message'))}",
                runbook=runbook(book),
            )
        )
    upgrade = _condition(rayservice, "UpgradeInProgress")
    if upgrade is not None and upgrade.get("status") == "True":
        pending = ((rayservice.get("status") or {}).get("pendingServiceStatus") or {}).get("rayClusterName", "?")
        checks.append(
            Check(
                component=f"{name} upgrade",
                health=Health.DEGRADED,
                detail=f"NewCluster upgrade in progress: pending cluster {pending} must become ready "
                "before traffic moves",
                runbook=runbook("roll-out-a-model"),
            )
        )
    active = (rayservice.get("status") or {}).get("activeServiceStatus") or {}
    if ready is not None:
        checks += serve_checks(active.get("applicationStatuses") or {}, where=active.get("rayClusterName", "active"))
    return checks


def rayservice_rows(rayservice: dict[str, Any]) -> list[DeploymentRow]:
    active = (rayservice.get("status") or {}).get("activeServiceStatus") or {}
    return [
        DeploymentRow(app=app_name, deployment=name, status=str(d.get("status")))
        for app_name, app in sorted((active.get("applicationStatuses") or {}).items())
        for name, d in sorted((app.get("serveDeploymentStatuses") or {}).items())
    ]


def worker_group_rows(rayservice: dict[str, Any], pods: list[dict[str, Any]]) -> list[WorkerGroupRow]:
    """Desired bounds per worker group (from the RayService) against the pods KubeRay made."""
    rows = []
    for group in rayservice["spec"]["rayClusterConfig"].get("workerGroupSpecs", []):
        mine = [p for p in pods if (p["metadata"].get("labels") or {}).get("ray.io/group") == group["groupName"]]
        rows.append(
            WorkerGroupRow(
                group=group["groupName"],
                min_pods=group.get("minReplicas", 0),
                max_pods=group.get("maxReplicas", 0),
                running=sum(1 for p in mine if (p.get("status") or {}).get("phase") == "Running"),
                pending=sum(1 for p in mine if (p.get("status") or {}).get("phase") == "Pending"),
            )
        )
    return rows


def worker_bound_checks(rayservice: dict[str, Any], raycluster: dict[str, Any] | None) -> list[Check]:
    """Worker-group bounds the RayService asks for but the running RayCluster does not have.

    KubeRay leaves min/max replicas out of its cluster hash and, on purpose, does not copy
    changed bounds to a running RayCluster (the Ray autoscaler also edits it; kuberay#2331,
    #4568). So after a scale that changes them, the live cluster keeps its old bounds until
    patched; the detail carries the patch.
    """
    if raycluster is None:
        return []
    name = raycluster["metadata"]["name"]
    live = {g["groupName"]: (i, g) for i, g in enumerate(raycluster["spec"].get("workerGroupSpecs", []))}
    checks = []
    for wanted in rayservice["spec"]["rayClusterConfig"].get("workerGroupSpecs", []):
        index, group = live.get(wanted["groupName"], (None, None))
        if group is None:
            continue
        want = (wanted.get("minReplicas", 0), wanted.get("maxReplicas", 0))
        have = (group.get("minReplicas", 0), group.get("maxReplicas", 0))
        if want != have:
            ops = [
                {"op": "replace", "path": f"/spec/workerGroupSpecs/{index}/{key}", "value": value}
                for key, value in zip(("minReplicas", "maxReplicas"), want)
            ]
            patch = json.dumps(ops, separators=(",", ":"))
            namespace = raycluster["metadata"].get("namespace", "llmstack")
            checks.append(
                Check(
                    component=f"worker group {wanted['groupName']}",
                    health=Health.DEGRADED,
                    runbook=runbook("scale-a-model"),
                    detail=f"RayCluster {name} allows {have[0]}-{have[1]} pods, the RayService asks "
                    f"{want[0]}-{want[1]} "
                    f"(KubeRay does not copy bounds to a running cluster): kubectl -n {namespace} "
                    f"patch raycluster {name} --type=json -p '{patch}'",
                )
            )
    return checks


def node_rows(nodes: list[dict[str, Any]], group_label: str) -> list[NodeRow]:
    rows = []
    for node in nodes:
        labels = node["metadata"].get("labels") or {}
        status = node.get("status") or {}
        ready: dict[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
        rows.append(
            NodeRow(
                name=node["metadata"]["name"],
                group=labels.get(group_label, "-"),
                instance_type=labels.get("node.kubernetes.io/instance-type", "?"),
                gpus=int((status.get("allocatable") or {}).get("nvidia.com/gpu", 0)),
                ready=ready.get("status") == "True",
            )
        )
    return rows


def node_checks(rows: list[NodeRow], gpu_groups: set[str]) -> list[Check]:
    """GPU nodes that joined but offer no GPU: the NVIDIA device plugin is not running there."""
    checks = []
    for row in rows:
        if row.group in gpu_groups and row.gpus == 0:
            checks.append(
                Check(
                    component=f"node {row.name}",
                    health=Health.DOWN,
                    detail=f"GPU node of group {row.group} offers no nvidia.com/gpu: the NVIDIA device "
                    "plugin is not running on it",
                    runbook=runbook("pods-pending-on-gpus"),
                )
            )
        elif not row.ready:
            checks.append(
                Check(
                    component=f"node {row.name}",
                    health=Health.DEGRADED,
                    detail="node is not Ready",
                    runbook=runbook("pods-pending-on-gpus"),
                )
            )
    return checks


# Scheduler and autoscaler messages -> what they mean on this stack. First match wins.
_PENDING_HINTS: list[tuple[str, str]] = [
    (
        r"max node group size reached",
        "the node group is at max_size: raise node_groups[].max_size (llmctl plan shows the need), then make deploy",
    ),
    (
        r"didn't trigger scale-up|NotTriggerScaleUp",
        "the Cluster Autoscaler will not add a node: check the ASG's scale-from-zero tags, the group's max_size "
        "and your EC2 GPU quota",
    ),
    (
        r"Insufficient nvidia\.com/gpu",
        "no free GPU on any node: the Cluster Autoscaler should add one (a few minutes); if none comes, check "
        "its logs and your EC2 GPU quota",
    ),
    (r"untolerated taint", "the pod does not tolerate a node's taint (GPU nodes carry nvidia.com/gpu=true:NoSchedule)"),
    (
        r"didn't match Pod's node affinity|node\(s\) didn't match node selector",
        "no node carries the pod's llmstack.dev/node-group label: the node group is missing or at zero nodes",
    ),
    (r"Insufficient (cpu|memory)", "no node has the CPU or memory the pod requests"),
    (r"ImagePullBackOff|ErrImagePull", "the image cannot be pulled: check versions.serving_image and registry access"),
]


def pending_hint(message: str) -> str:
    for pattern, hint in _PENDING_HINTS:
        if re.search(pattern, message, re.IGNORECASE):
            return hint
    return "see `kubectl describe pod` events"


def pending_pods(pods: list[dict[str, Any]], events: Sequence[dict[str, Any]] = ()) -> list[PendingPod]:
    """Pods stuck in Pending, with the scheduler's reason (or the autoscaler's, from events)."""
    found = []
    for pod in pods:
        status = pod.get("status") or {}
        if status.get("phase") != "Pending":
            continue
        name = pod["metadata"]["name"]
        scheduled: dict[str, Any] = next(
            (c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), {}
        )
        waiting = [(cs.get("state") or {}).get("waiting") or {} for cs in status.get("containerStatuses") or []]
        reason = scheduled.get("message") if scheduled.get("status") == "False" else None
        reason = reason or next((w.get("reason") for w in waiting if w.get("reason")), None) or "Pending"
        autoscaler = [
            e.get("message", "")
            for e in events
            if (e.get("involvedObject") or {}).get("name") == name and e.get("reason") == "NotTriggerScaleUp"
        ]
        if autoscaler:
            reason = f"{reason}; autoscaler: {autoscaler[-1]}"
        found.append(
            PendingPod(
                name=name,
                group=(pod["metadata"].get("labels") or {}).get("ray.io/group"),
                reason=reason,
                hint=pending_hint(reason),
            )
        )
    return found


def crash_loop_checks(pods: list[dict[str, Any]]) -> list[Check]:
    checks = []
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") == "CrashLoopBackOff":
                last = (cs.get("lastState") or {}).get("terminated") or {}
                checks.append(
                    Check(
                        component=f"pod {pod['metadata']['name']}",
                        health=Health.DOWN,
                        detail=f"CrashLoopBackOff after {cs.get('restartCount', 0)} restarts "
                        f"(last exit: {last.get('reason', '?')} {last.get('exitCode', '')})".strip(),
                        runbook=runbook("replica-crash-loop"),
                    )
                )
    return checks


def deployment_check(deployment: dict[str, Any] | None, name: str) -> Check:
    """A Kubernetes Deployment (the gateway): ready replicas against desired."""
    if deployment is None:
        return Check(component=name, health=Health.DOWN, detail="Deployment not found: deploy the stack")
    want = (deployment.get("spec") or {}).get("replicas", 1)
    ready = (deployment.get("status") or {}).get("readyReplicas", 0) or 0
    health = Health.OK if ready >= want else Health.DOWN if ready == 0 else Health.DEGRADED
    return Check(
        component=name,
        health=health,
        detail=f"{ready}/{want} pods ready",
        runbook=None if health is Health.OK else runbook("redis-outage"),
    )


def _first_line(text: Any) -> str:
    return str(text or "").strip().splitlines()[0][:300] if str(text or "").strip() else ""
