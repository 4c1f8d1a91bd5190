"""`llmctl status --stack NAME`: is the stack serving, and if not, why and what to open.

Reads only; decisions live in `ops.llmctl.status.report`.
- local stack: the `make dev` of this checkout (its lock file says where): Serve's own
  details from its Ray, a Redis PING, the gateway's /readyz, and per model the capacity per
  replica the gateway allows now (adapted to the latency target), what is in flight and queued
  (the fair queue's keys in Redis) and the mean queue wait (the gateway's /metrics).
- cloud stack: the Kubernetes API through the official client and your kubeconfig (as
  kubectl uses it): the RayService and its conditions, Ray pods per worker group, GPU nodes,
  pending pods with the scheduler's reason, the gateway Deployment.
- both, for models with `lora:`: which adapters each replica holds, from Serve's multiplexing
  gauge (local: every Ray node's metrics export, at the ports `ray.nodes()` lists; cloud: the
  Prometheus that scrapes the Ray pods, through the API server's service proxy, or `--prometheus`).
  Not the Ray pods' metrics port directly: the stack's NetworkPolicy admits only the Prometheus
  namespace there, and admitting the API server's proxy would mean admitting its source
  addresses, which on EKS are ENIs in the cluster's own subnets, where every pod's address is too.

Exit codes: 0 healthy, 1 degraded or down, 2 stack file unusable, 3 cluster unreachable.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.table import Table

from infra.render.common import GATEWAY_NAME, NAMESPACE, NODE_GROUP_LABEL, RAYSERVICE_NAME
from infra.spec.schema import GpuNodeGroup, StackSpec
from ops.llmctl.console import ExitCode, err, load_spec, out
from ops.llmctl.status.report import (
    LOADED_ADAPTERS_QUERY,
    Check,
    Health,
    MetricsScrape,
    ModelQueueRow,
    PrometheusRead,
    StatusReport,
    adapter_rows,
    adapter_table,
    adapters_from_query,
    crash_loop_checks,
    deployment_check,
    model_queue_row,
    node_checks,
    node_rows,
    pending_pods,
    queue_wait_means,
    ray_metrics_targets,
    rayservice_checks,
    rayservice_rows,
    runbook,
    serve_checks,
    serve_rows,
    worker_bound_checks,
    worker_group_rows,
)

HTTP_TIMEOUT_S = 5
# What the service proxy's refusal usually means when llmctl status asks the stack's Prometheus.
PROXY_REFUSALS = {
    403: "needs get on services/proxy in {namespace}",
    404: "no Service {service} in {namespace}: set observability.prometheus_service in {stack_file}, "
    "or pass --prometheus URL",
    503: "the Service has no ready Prometheus pod",
}


class Unreachable(Exception):
    """Nothing to report on: the stack's control plane does not answer. `str()` says why."""

    def __init__(self, message: str, label: str = "cluster unreachable") -> None:
        super().__init__(message)
        self.label = label


def status(
    stack: Annotated[str, typer.Option("--stack", "-s", help="Stack name (Pulumi.<name>.yaml) or path.")],
    context: Annotated[str | None, typer.Option(help="kubeconfig context (cloud stacks); default: current.")] = None,
    prometheus: Annotated[
        str | None,
        typer.Option(
            help="Prometheus base URL to read the loaded LoRA adapters from (cloud stacks), e.g. "
            "http://localhost:9090 after `kubectl port-forward`; default: the stack's "
            "observability.prometheus_service through the Kubernetes API server."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Is the stack serving? Serve deployments and replicas, Redis, gateway, the LoRA adapters each
    replica holds, and on a cloud stack RayService conditions, worker groups, GPU nodes and pending
    pods with their reason."""

    spec = load_spec(stack)
    try:
        report = local_report(spec) if spec.cloud.provider == "local" else cloud_report(spec, context, prometheus)
    except Unreachable as exc:
        err.print(f"[red]{exc.label}[/red]: {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(ExitCode.UNREACHABLE) from None
    if as_json:
        print(json.dumps({"health": report.health.value, **report.model_dump(mode="json")}, indent=2))
    else:
        for table in tables(report):
            out.print(table)
        colour = {"ok": "green", "degraded": "yellow", "down": "red"}[report.health.value]
        out.print(f"[{colour}]{report.health.value}[/{colour}]: stack {spec.name} ({report.where})", highlight=False)
    if report.health is not Health.OK:
        raise typer.Exit(ExitCode.FAILED)


# --- local ----------------------------------------------------------------------------------------


def local_report(spec: StackSpec) -> StatusReport:
    from ops.devstack import serve as local_serve
    from ops.devstack.lock import NOT_RUNNING, find_running_dev, lock_path

    dev = find_running_dev()
    if dev is None or dev.stack != spec.name:
        raise Unreachable(NOT_RUNNING.format(path=lock_path()), label="not running")
    report = StatusReport(stack=spec.name, where=f"make dev, pid {dev.pid}")
    report.checks.append(_gateway_check(dev.metrics_url or dev.gateway_root))  # /readyz: on the metrics port
    report.checks.append(_redis_check(dev.redis_url))
    report.models = model_queues(spec, dev.redis_url, dev.metrics_url)
    if dev.ray_address is None:
        raise Unreachable(f"make dev (pid {dev.pid}) recorded no Ray address; restart it with this version")
    try:
        local_serve.connect(dev.ray_address, dev.ray_auth_mode)
        details = local_serve.details()
    except local_serve.ServeUnreachable as exc:
        raise Unreachable(f"{exc}; make dev (pid {dev.pid}) may be stopping") from None
    report.checks += serve_checks(details.get("applications", {}), where="local Ray")
    report.deployments = serve_rows(details)
    lora_models = _lora_models(spec)
    if lora_models:
        scrapes = [_scrape(node, url) for node, url in ray_metrics_targets(local_serve.ray_nodes())]
        report.adapters, report.adapters_note = adapter_rows(lora_models, scrapes)
    return report


def _lora_models(spec: StackSpec) -> list[str]:
    return [m.model_name for m in spec.models if m.lora is not None]


def _scrape(node: str, url: str) -> MetricsScrape:
    import httpx

    try:
        response = httpx.get(url, timeout=HTTP_TIMEOUT_S)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        return MetricsScrape(node=node, error=f"{url}: {type(exc).__name__}")
    return MetricsScrape(node=node, text=response.text)


def _gateway_check(root: str) -> Check:
    import httpx

    try:
        response = httpx.get(f"{root}/readyz", timeout=HTTP_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return Check(component="gateway", health=Health.DOWN, detail=f"{root} does not answer: {exc}")
    body = _json_or_empty(response)
    if response.status_code == 200 and body.get("status") == "degraded":  # serving without Redis
        return Check(
            component="gateway",
            health=Health.DEGRADED,
            runbook=runbook("redis-outage"),
            detail=f"{root}/readyz: degraded ({body.get('reason', 'no reason given')})",
        )
    if response.status_code == 200:
        return Check(component="gateway", health=Health.OK, detail=f"{root}/readyz: ready")
    return Check(
        component="gateway",
        health=Health.DOWN,
        runbook=runbook("redis-outage"),
        detail=f"{root}/readyz: {response.status_code} {response.text[:200]}",
    )


def model_queues(spec: StackSpec, redis_url: str | None, metrics_url: str | None) -> list[ModelQueueRow]:
    """Each served model's capacity and queue, from the keys the fair queue and the adaptive
    capacity keep in Redis (read only) and the gateway's queue-wait histogram. Nothing without
    Redis (the in-memory gateway has no queue) or when it does not answer (its check says so)."""
    if redis_url is None or not spec.gateway.queue.enabled:
        return []
    import httpx
    import redis

    from serving.gateway.queue.fair_queue import queue_keys

    waits: dict[str, float] = {}
    if metrics_url is not None:
        try:
            waits = queue_wait_means(httpx.get(f"{metrics_url}/metrics", timeout=HTTP_TIMEOUT_S).text)
        except (httpx.HTTPError, ValueError):
            waits = {}
    client = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2, decode_responses=True)
    rows = []
    try:
        for model in spec.models:
            name = model.model_name
            keys = queue_keys(name, len(spec.gateway.queue.tiers), adaptive=True)
            with client.pipeline(transaction=False) as pipe:
                pipe.zcard(keys.inflight)
                for queue in keys.queues:
                    pipe.zcard(queue)
                pipe.hmget(keys.capacity, "slots", "move")
                in_flight, *queued, (slots, move) = pipe.execute()
            ceiling = model.autoscaling.max_ongoing_requests
            rows.append(
                model_queue_row(
                    name,
                    max_per_replica=ceiling,
                    adaptive=model.latency_target.adaptive,
                    in_flight=int(in_flight),
                    queued=sum(int(n) for n in queued),
                    adapted_slots=slots,
                    adapted_move=move,
                    queue_wait_s=waits.get(name),
                )
            )
    except redis.RedisError:
        return []
    finally:
        client.close()
    return rows


def _json_or_empty(response: Any) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _redis_check(url: str | None) -> Check:
    if url is None:
        return Check(
            component="redis",
            health=Health.DEGRADED,
            detail="no redis-server: the gateway keeps keys and limits in its own memory",
        )
    import redis

    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        client.ping()
        return Check(component="redis", health=Health.OK, detail=f"PING ok ({_redact(url)})")
    except redis.RedisError as exc:
        return Check(
            component="redis",
            health=Health.DOWN,
            runbook=runbook("redis-outage"),
            detail=f"{_redact(url)}: {type(exc).__name__}: {exc}",
        )
    finally:
        client.close()


def _redact(url: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}:{parts.port}"


# --- cloud ----------------------------------------------------------------------------------------


def cloud_report(spec: StackSpec, context: str | None, prometheus_url: str | None = None) -> StatusReport:
    """Read the stack's objects with the official Kubernetes client and interpret them."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise Unreachable(
            "llmctl status on a cloud stack needs the Kubernetes client: pip install -e '.[ops]'",
            label="missing dependency",
        ) from None
    from kubernetes.client.rest import ApiException
    from kubernetes.config.config_exception import ConfigException
    from urllib3.exceptions import HTTPError

    try:
        config.load_kube_config(context=context)
    except (ConfigException, FileNotFoundError, OSError) as exc:
        raise Unreachable(
            f"no usable kubeconfig ({exc}); write one with `aws eks update-kubeconfig --region "
            f"{getattr(spec.cloud, 'region', '<region>')} --name $(pulumi stack output cluster_name --stack "
            f"{spec.name})`"
        ) from None
    configuration = client.Configuration.get_default_copy()
    configuration.retries = 0  # a dead endpoint should fail in seconds, not after urllib3's retries
    api = client.ApiClient(configuration)
    host = configuration.host
    plain = api.sanitize_for_serialization

    def read(call: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, _request_timeout=10, **kwargs)
        except ApiException as exc:
            if exc.status == 404:
                return None
            if exc.status in (401, 403):
                raise Unreachable(
                    f"{host} refused the credentials (HTTP {exc.status}): refresh them "
                    "(e.g. `aws sso login`) and check your EKS access entry"
                ) from None
            raise Unreachable(f"{host} answered HTTP {exc.status} {exc.reason}") from None
        except (HTTPError, OSError) as exc:
            raise Unreachable(
                f"cannot reach the Kubernetes API at {host} ({type(exc).__name__}); "
                "check the VPN/network and `kubectl cluster-info`"
            ) from None

    core, apps, custom = client.CoreV1Api(api), client.AppsV1Api(api), client.CustomObjectsApi(api)
    rayservice = read(custom.get_namespaced_custom_object, "ray.io", "v1", NAMESPACE, "rayservices", RAYSERVICE_NAME)
    active = ((rayservice or {}).get("status") or {}).get("activeServiceStatus", {}).get("rayClusterName")
    raycluster = (
        read(custom.get_namespaced_custom_object, "ray.io", "v1", NAMESPACE, "rayclusters", active) if active else None
    )
    pods = plain(read(core.list_namespaced_pod, NAMESPACE).items)
    nodes = plain(read(core.list_node, label_selector=NODE_GROUP_LABEL).items)
    events = plain(read(core.list_namespaced_event, NAMESPACE, field_selector="reason=NotTriggerScaleUp").items)
    gateway = read(apps.read_namespaced_deployment, GATEWAY_NAME, NAMESPACE)

    loaded_adapters: PrometheusRead | None = None
    if _lora_models(spec):
        loaded_adapters = (
            _query_prometheus_url(prometheus_url, LOADED_ADAPTERS_QUERY)
            if prometheus_url
            else _query_prometheus_service(api, spec, LOADED_ADAPTERS_QUERY)
        )
    return interpret_cloud(
        spec,
        where=f"context {context or 'current'}, {host}",
        rayservice=rayservice,
        pods=pods,
        nodes=nodes,
        events=events,
        gateway=plain(gateway) if gateway is not None else None,
        raycluster=raycluster,
        loaded_adapters=loaded_adapters,
    )


def _query_prometheus_service(api: Any, spec: StackSpec, query: str) -> PrometheusRead:
    """An instant query to the stack's Prometheus through the API server's service proxy (what
    `kubectl get --raw /api/v1/namespaces/NS/services/NAME:PORT/proxy/api/v1/query?query=...` does),
    with the kubeconfig's credentials."""
    from kubernetes.client.rest import ApiException
    from urllib3.exceptions import HTTPError

    namespace, service = spec.gateway.metrics_namespace, spec.observability.prometheus_service
    source = f"Prometheus {namespace}/{service}"
    try:
        response = api.call_api(
            f"/api/v1/namespaces/{namespace}/services/{service}/proxy/api/v1/query",
            "GET",
            query_params=[("query", query)],
            auth_settings=["BearerToken"],
            _preload_content=False,
            _return_http_data_only=True,
            _request_timeout=10,
        )
        return PrometheusRead(source=source, answer=json.loads(response.data))
    except ApiException as exc:
        why = PROXY_REFUSALS.get(exc.status, "").format(
            namespace=namespace, service=service, stack_file=f"Pulumi.{spec.name}.yaml"
        )
        return PrometheusRead(source=source, error=f"HTTP {exc.status} {exc.reason}" + (f": {why}" if why else ""))
    except (HTTPError, OSError, ValueError) as exc:
        return PrometheusRead(source=source, error=type(exc).__name__)


def _query_prometheus_url(base_url: str, query: str) -> PrometheusRead:
    """An instant query to a Prometheus the caller reaches directly (a port-forward, a VPN)."""
    import httpx

    source = f"Prometheus {base_url}"
    try:
        response = httpx.get(f"{base_url.rstrip('/')}/api/v1/query", params={"query": query}, timeout=HTTP_TIMEOUT_S)
        response.raise_for_status()
        return PrometheusRead(source=source, answer=response.json())
    except httpx.HTTPStatusError as exc:
        return PrometheusRead(source=source, error=f"HTTP {exc.response.status_code}")
    except (httpx.HTTPError, ValueError) as exc:
        return PrometheusRead(source=source, error=type(exc).__name__)


def interpret_cloud(
    spec: StackSpec,
    *,
    where: str,
    rayservice: dict[str, Any] | None,
    pods: list[dict[str, Any]],
    nodes: list[dict[str, Any]],
    events: list[dict[str, Any]],
    gateway: dict[str, Any] | None,
    raycluster: dict[str, Any] | None = None,
    loaded_adapters: PrometheusRead | None = None,
) -> StatusReport:
    """The cloud report from plain objects (what the API returned) and the Prometheus answer on
    the loaded adapters (asked for models with `lora:`). Pure."""
    report = StatusReport(stack=spec.name, where=where)
    if rayservice is None:
        report.checks.append(
            Check(
                component=f"rayservice {RAYSERVICE_NAME}",
                health=Health.DOWN,
                detail=f"not found in namespace {NAMESPACE}: deploy it with `make deploy STACK={spec.name}`",
            )
        )
    else:
        report.checks += rayservice_checks(rayservice)
        report.deployments = rayservice_rows(rayservice)
        report.worker_groups = worker_group_rows(rayservice, pods)
        report.checks += worker_bound_checks(rayservice, raycluster)
    report.gpu_nodes = node_rows(nodes, NODE_GROUP_LABEL)
    gpu_groups = {g.name for g in spec.node_groups if isinstance(g, GpuNodeGroup)}
    report.checks += node_checks(report.gpu_nodes, gpu_groups)
    report.pending_pods = pending_pods(pods, events)
    if report.pending_pods:
        report.checks.append(
            Check(
                component="pods",
                health=Health.DEGRADED,
                detail=f"{len(report.pending_pods)} pending",
                runbook=runbook("pods-pending-on-gpus"),
            )
        )
    report.checks += crash_loop_checks(pods)
    report.checks.append(deployment_check(gateway, f"gateway {GATEWAY_NAME}"))
    if loaded_adapters is None or loaded_adapters.answer is None:
        why = loaded_adapters.error if loaded_adapters else "not asked"
        note = f"{loaded_adapters.source if loaded_adapters else 'Prometheus'} not read ({why})"
        report.adapters, report.adapters_note = adapter_table(_lora_models(spec), [], note)
    else:
        report.adapters, report.adapters_note = adapter_table(
            _lora_models(spec), adapters_from_query(loaded_adapters.answer), None
        )
    return report


# --- view -----------------------------------------------------------------------------------------


def tables(report: StatusReport) -> list[Table]:
    checks = Table(
        "component", "health", "detail", "runbook", title=f"stack {report.stack}: checks", title_justify="left"
    )
    for c in report.checks:
        colour = {"ok": "green", "degraded": "yellow", "down": "red"}[c.health.value]
        checks.add_row(c.component, f"[{colour}]{c.health.value}[/{colour}]", c.detail, c.runbook or "")
    result = [checks]
    if report.deployments:
        serve = Table(
            "app",
            "deployment",
            "status",
            "replicas",
            "target",
            "min - max",
            title="Serve deployments",
            title_justify="left",
        )
        for d in report.deployments:
            replicas = ", ".join(f"{n} {s.lower()}" for s, n in sorted(d.replicas.items())) or "-"
            bounds = "-" if d.min_replicas is None else f"{d.min_replicas} - {d.max_replicas}"
            serve.add_row(d.app, d.deployment, d.status.lower(), replicas, str(d.target or "-"), bounds)
        result.append(serve)
    if report.worker_groups:
        groups = Table(
            "worker group", "pods min - max", "running", "pending", title="Ray worker groups", title_justify="left"
        )
        for g in report.worker_groups:
            groups.add_row(g.group, f"{g.min_pods} - {g.max_pods}", str(g.running), str(g.pending))
        result.append(groups)
    if report.gpu_nodes:
        nodes = Table("node", "group", "instance", "GPUs", "ready", title="nodes", title_justify="left")
        for n in report.gpu_nodes:
            nodes.add_row(n.name, n.group, n.instance_type, str(n.gpus), "yes" if n.ready else "no")
        result.append(nodes)
    if report.models:
        result.append(models_table(report))
    if report.adapters:
        result.append(adapters_table(report))
    if report.pending_pods:
        pending = Table("pod", "group", "reason", "what to check", title="pending pods", title_justify="left")
        for p in report.pending_pods:
            pending.add_row(p.name, p.group or "-", p.reason, p.hint)
        result.append(pending)
    return result


def adapters_table(report: StatusReport) -> Table:
    table = Table(
        "model",
        "adapter",
        "replica",
        "node",
        title="LoRA adapters loaded",
        title_justify="left",
        caption=report.adapters_note,
    )
    for a in report.adapters:
        if a.adapter is None:
            table.add_row(a.model, "none loaded yet", "-", "-")
        else:
            table.add_row(a.model, a.adapter, a.replica or "-", a.node or "-")
    return table


def models_table(report: StatusReport) -> Table:
    table = Table(
        "model",
        "capacity / replica",
        "last move",
        "in flight",
        "queued",
        "mean queue wait",
        title="models: the gateway's capacity and queue",
        title_justify="left",
        caption="capacity follows each model's latency target (llmctl plan); runbook: " + runbook("ttft-over-target"),
    )
    for m in report.models:
        wait = "-" if m.queue_wait_s is None else f"{m.queue_wait_s * 1000:.0f} ms"
        table.add_row(
            m.model,
            f"{m.capacity_per_replica} of {m.max_per_replica}",
            m.move,
            str(m.in_flight),
            str(m.queued),
            wait,
        )
    return table
