"""Redis for the gateway (keys, limits, usage) and Ray GCS fault tolerance, per `redis.mode`.

- `managed`: ElastiCache replication group in the private subnets, TLS in transit,
  encryption at rest, an AUTH token from `pulumi_random`, and a security group that lets in
  port 6379 from the cluster's nodes and nothing else. Failover when there are replicas.
- `in_cluster`: one Redis pod with a password and an encrypted volume, reachable only from
  gateway and Ray pods (NetworkPolicy). For cheap dev stacks.
- `external`: a Redis you run; its password comes from `pulumi config set --secret
  llmstack:redis_password ...`.

Every mode ends in the same two objects, which the rendered manifests rely on: the Secret
`llmstack-redis` (keys `password` and `url`) and a Service `llmstack-redis` (an ExternalName
for managed and external Redis). The password and URL are Pulumi secrets throughout.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s
import pulumi_random as random

from infra.render.common import (
    COMPONENT_LABEL,
    NAMESPACE,
    NODE_GROUP_LABEL,
    REDIS_SECRET,
    REDIS_SERVICE,
    labels,
    secret_env,
)
from infra.spec import ExternalRedis, InClusterRedis, ManagedRedis

PORT = 6379
ENGINE_VERSION = "7.1"
IMAGE = "redis:7.4.2-alpine"  # in-cluster mode only
REDIS_UID = 999  # the `redis` user of the official image
IN_CLUSTER_HOST = f"{REDIS_SERVICE}.{NAMESPACE}.svc.cluster.local"
DATA_CLAIM = f"{REDIS_SERVICE}-data"


@dataclass
class RedisArgs:
    stack: str
    redis: ManagedRedis | InClusterRedis | ExternalRedis
    k8s_provider: k8s.Provider
    namespace: k8s.core.v1.Namespace
    vpc_id: pulumi.Input[str] | None = None
    subnet_ids: pulumi.Input[list[str]] | None = None
    node_security_group_id: pulumi.Input[str] | None = None
    storage_class: str | None = None
    external_password: pulumi.Input[str] | None = None


class Redis(pulumi.ComponentResource):
    endpoint: pulumi.Output[str]
    """host:port, not secret."""
    url: pulumi.Output[str]
    """redis[s]://:password@host:port/0, a secret."""

    def __init__(self, name: str, args: RedisArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llmstack:aws:Redis", name, None, opts)
        self._name, self._args = name, args
        self._k8s = pulumi.ResourceOptions(parent=self, provider=args.k8s_provider, depends_on=[args.namespace])
        spec = args.redis
        if isinstance(spec, ExternalRedis):
            host, password = pulumi.Output.from_input(spec.host), pulumi.Output.secret(args.external_password)
            scheme, port = ("rediss" if spec.tls else "redis"), spec.port
        else:
            password = random.RandomPassword(f"{name}-password", length=40, special=False,
                                             opts=pulumi.ResourceOptions(parent=self)).result
            if isinstance(spec, ManagedRedis):
                host, scheme, port = self._elasticache(spec, password), "rediss", PORT
            else:
                host, scheme, port = pulumi.Output.from_input(IN_CLUSTER_HOST), "redis", PORT
        self.url = pulumi.Output.secret(pulumi.Output.concat(scheme, "://:", password, "@", host, f":{port}/0"))
        self.endpoint = pulumi.Output.concat(host, f":{port}")
        # Ray GCS speaks TLS to ElastiCache only by its real host name (the certificate's).
        self.gcs_address: pulumi.Output[str] | None = (
            pulumi.Output.concat("rediss://", host, f":{port}") if isinstance(spec, ManagedRedis) else None)
        self.secret = k8s.core.v1.Secret(REDIS_SECRET, metadata=self._metadata(REDIS_SECRET),
                                         string_data={"password": password, "url": self.url}, opts=self._k8s)
        if isinstance(spec, InClusterRedis):
            self._in_cluster(spec)
        else:
            k8s.core.v1.Service(REDIS_SERVICE, metadata=self._metadata(REDIS_SERVICE), spec={
                "type": "ExternalName", "externalName": host, "ports": [{"name": "redis", "port": port}]},
                opts=self._k8s)
        self.register_outputs({"endpoint": self.endpoint})

    def _metadata(self, name: str) -> dict:
        return {"name": name, "namespace": NAMESPACE, "labels": labels("redis", self._args.stack)}

    def _elasticache(self, spec: ManagedRedis, password: pulumi.Output[str]) -> pulumi.Output[str]:
        name, args = self._name, self._args
        child = pulumi.ResourceOptions(parent=self)
        subnets = aws.elasticache.SubnetGroup(name, subnet_ids=args.subnet_ids,
                                              description="llmstack Redis: private subnets only", opts=child)
        firewall = aws.ec2.SecurityGroup(
            name, vpc_id=args.vpc_id, description="llmstack Redis: 6379 from cluster nodes only",
            ingress=[aws.ec2.SecurityGroupIngressArgs(
                protocol="tcp", from_port=PORT, to_port=PORT, security_groups=[args.node_security_group_id],
                description="Redis from EKS nodes")],
            egress=[], opts=child)
        failover = spec.replicas > 0
        group = aws.elasticache.ReplicationGroup(
            name,
            description=f"llmstack {args.stack}: API keys, rate limits, usage, Ray GCS",
            engine="redis",
            engine_version=ENGINE_VERSION,
            node_type=spec.node_type,
            port=PORT,
            num_cache_clusters=1 + spec.replicas,
            automatic_failover_enabled=failover,
            multi_az_enabled=failover,
            transit_encryption_enabled=True,
            at_rest_encryption_enabled=True,
            auth_token=password,
            subnet_group_name=subnets.name,
            security_group_ids=[firewall.id],
            snapshot_retention_limit=7,
            opts=child,
        )
        return group.primary_endpoint_address

    def _in_cluster(self, spec: InClusterRedis) -> None:
        selector = {COMPONENT_LABEL: "redis"}
        claim = k8s.core.v1.PersistentVolumeClaim(DATA_CLAIM, metadata=self._metadata(DATA_CLAIM), spec={
            "accessModes": ["ReadWriteOnce"], "storageClassName": self._args.storage_class,
            "resources": {"requests": {"storage": f"{spec.storage_gib}Gi"}}}, opts=self._k8s)
        container = {
            "name": "redis",
            "image": IMAGE,
            "args": ["--requirepass", "$(REDIS_PASSWORD)", "--appendonly", "yes", "--dir", "/data"],
            "env": [secret_env("REDIS_PASSWORD", REDIS_SECRET, "password")],
            "ports": [{"name": "redis", "containerPort": PORT}],
            "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
            "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        }
        after = pulumi.ResourceOptions.merge(self._k8s, pulumi.ResourceOptions(depends_on=[self.secret, claim]))
        k8s.apps.v1.Deployment(REDIS_SERVICE, metadata=self._metadata(REDIS_SERVICE), spec={
            "replicas": 1,
            "strategy": {"type": "Recreate"},  # one volume, one writer
            "selector": {"matchLabels": selector},
            "template": {"metadata": {"labels": labels("redis", self._args.stack)}, "spec": {
                "securityContext": {"runAsNonRoot": True, "runAsUser": REDIS_UID, "runAsGroup": REDIS_UID,
                                    "fsGroup": REDIS_UID, "seccompProfile": {"type": "RuntimeDefault"}},
                "automountServiceAccountToken": False,
                "nodeSelector": {NODE_GROUP_LABEL: "system"},
                "containers": [container],
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": DATA_CLAIM}}],
            }},
        }, opts=after)
        k8s.core.v1.Service(REDIS_SERVICE, metadata=self._metadata(REDIS_SERVICE), spec={
            "selector": selector, "ports": [{"name": "redis", "port": PORT, "targetPort": "redis"}]}, opts=self._k8s)
        policy = f"{REDIS_SERVICE}-ingress"
        k8s.networking.v1.NetworkPolicy(policy, metadata=self._metadata(policy), spec={
            "podSelector": {"matchLabels": selector},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchExpressions": [
                {"key": COMPONENT_LABEL, "operator": "In", "values": ["gateway", "ray"]}]}}],
                "ports": [{"protocol": "TCP", "port": PORT}]}],
        }, opts=self._k8s)
