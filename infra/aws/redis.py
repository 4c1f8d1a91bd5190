"""Redis for the gateway (keys, limits, usage) and Ray GCS fault tolerance, per `redis.mode`.

The gateway and Ray sign in as separate ACL users, each allowed only its own key prefix
(`infra.plan.redis_acl`): Ray pods handle tenant input and must not reach API keys. When a model
scales on saturation, Serve's controller (the Ray head) gets a third user, which may only read
the gateway's fair queue figures (`autoscaler_user`), and its URL in the Secret
`llmstack-redis-autoscaler`; without such a model that user and Secret do not exist.

Every mode the stack runs sets `maxmemory-policy noeviction` (serving.gateway.telemetry.redis_memory): a
full Redis refuses writes, and the gateway refuses requests, instead of deleting budget counters,
spend and usage (ElastiCache's default, `volatile-lru`, evicts exactly those: they have TTLs).

- `managed`: ElastiCache replication group in the private subnets, TLS in transit,
  encryption at rest, its own parameter group (noeviction), RBAC: a user group with the two
  (or three) users (passwords from `pulumi_random`) and the `default` user ElastiCache requires in every
  group, switched off.
  A security group lets in port 6379 from the cluster's nodes and nothing else. Failover when
  there are replicas.
- `in_cluster`: one Redis pod on an encrypted volume, `maxmemory` three quarters of its
  memory limit (room for the AOF rewrite's copy-on-write and fragmentation), its users in an ACL file (password
  hashes only) mounted from a Secret, reachable only from gateway and Ray pods
  (NetworkPolicy). For cheap dev stacks.
- `external`: a Redis you run, where you created the users; their passwords come from
  `pulumi config set --secret llmstack:redis_password ...` (the gateway's),
  `llmstack:redis_ray_password` (Ray's) and, with a saturation-scaled model,
  `llmstack:redis_autoscaler_password` (the controller's; `autoscaler_password_required` says
  how to fix its absence).

Every mode ends in the same objects, which the rendered manifests rely on: the Secret
`llmstack-redis` (the gateway's `url`, `username`, `password`), the Secret `llmstack-redis-ray`
(Ray's `username`, `password`), with a saturation-scaled model the Secret
`llmstack-redis-autoscaler` (the controller's `url`), and a Service `llmstack-redis` (an ExternalName for managed and
external Redis). Passwords and URLs are Pulumi secrets throughout.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s
import pulumi_random as random

from infra.catalog.versions import ELASTICACHE_ENGINE_VERSION, IN_CLUSTER_REDIS_IMAGE
from infra.plan.redis_acl import AclUser, access_string, acl_file, autoscaler_user, gateway_user, ray_user
from infra.render.common import (
    COMPONENT_LABEL,
    NAMESPACE,
    NODE_GROUP_LABEL,
    REDIS_AUTOSCALER_SECRET,
    REDIS_RAY_SECRET,
    REDIS_SECRET,
    REDIS_SERVICE,
    labels,
)
from infra.spec.schema import ExternalRedis, InClusterRedis, ManagedRedis
from serving.gateway.telemetry.redis_memory import REQUIRED_POLICY

PORT = 6379
REDIS_UID = 999  # the `redis` user of the official image
IN_CLUSTER_HOST = f"{REDIS_SERVICE}.{NAMESPACE}.svc.cluster.local"
DATA_CLAIM = f"{REDIS_SERVICE}-data"
ACL_SECRET = f"{REDIS_SERVICE}-acl"
ACL_PATH = "/etc/redis-acl/users.acl"
IN_CLUSTER_MEMORY_LIMIT_MIB = 1024
IN_CLUSTER_MAXMEMORY_MIB = IN_CLUSTER_MEMORY_LIMIT_MIB * 3 // 4


def parameter_group_family(engine_version: str) -> str:
    """ElastiCache's parameter group family for a Redis OSS version: redis7 for 7.x."""
    return f"redis{engine_version.split('.')[0]}"


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
    external_passwords: tuple[pulumi.Input[str], pulumi.Input[str]] | None = None
    """External Redis: (the gateway user's password, Ray's user's password)."""
    autoscaler: bool = False
    """Some model scales on saturation: Serve's controller gets its read-only user and URL."""
    external_autoscaler_password: pulumi.Input[str] | None = None
    """External Redis with `autoscaler`: the controller's user's password (required then)."""


def autoscaler_password_required(stack: str) -> str:
    """Why `pulumi up` stops when an external Redis lacks the controller's password, and the fix."""
    return (
        f"Pulumi.{stack}.yaml: a model has `autoscaling.policy: saturation` and `redis.mode: external`, "
        "but the secret config value `llmstack:redis_autoscaler_password` is not set. Serve's controller "
        "reads the gateway's queue as its own read-only Redis user: create it in your Redis "
        "(docs/deploying.md gives the ACL SETUSER line), then "
        f"`pulumi config set --secret --stack {stack} llmstack:redis_autoscaler_password <password>`; "
        "or set the model's `autoscaling.policy: ongoing`."
    )


class Redis(pulumi.ComponentResource):
    endpoint: pulumi.Output[str]
    """host:port, not secret."""
    url: pulumi.Output[str]
    """The gateway's redis[s]://user:password@host:port/0, a secret."""

    def __init__(self, name: str, args: RedisArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llmstack:aws:Redis", name, None, opts)
        self._name, self._args = name, args
        self._k8s = pulumi.ResourceOptions(parent=self, provider=args.k8s_provider, depends_on=[args.namespace])
        spec = args.redis
        users: dict[AclUser, pulumi.Output[str]] = {}
        if isinstance(spec, ExternalRedis):
            gateway, ray = gateway_user(spec.gateway_user), ray_user(spec.ray_user)
            autoscaler = autoscaler_user(spec.autoscaler_user)
            assert args.external_passwords is not None
            gateway_password, ray_password = (_secret(p) for p in args.external_passwords)
            if args.autoscaler:
                # The program refuses the stack before anything is declared (autoscaler_password_required).
                assert args.external_autoscaler_password is not None
                users[autoscaler] = _secret(args.external_autoscaler_password)
            host = pulumi.Output.from_input(spec.host)
            scheme, port = ("rediss" if spec.tls else "redis"), spec.port
        else:
            gateway, ray, autoscaler = gateway_user(), ray_user(), autoscaler_user()
            gateway_password, ray_password = (self._password(f"{name}-{user.name}") for user in (gateway, ray))
            users = {gateway: gateway_password, ray: ray_password}
            if args.autoscaler:
                users[autoscaler] = self._password(f"{name}-{autoscaler.name}")
            if isinstance(spec, ManagedRedis):
                host, scheme, port = self._elasticache(spec, users), "rediss", PORT
            else:
                host, scheme, port = pulumi.Output.from_input(IN_CLUSTER_HOST), "redis", PORT

        def url_of(user: AclUser, password: pulumi.Output[str]) -> pulumi.Output[str]:
            return _secret(pulumi.Output.concat(scheme, "://", user.name, ":", password, "@", host, f":{port}/0"))

        self.url = url_of(gateway, gateway_password)
        self.endpoint = pulumi.Output.concat(host, f":{port}")
        # Ray GCS speaks TLS to ElastiCache only by its real host name (the certificate's).
        self.gcs_address: pulumi.Output[str] | None = (
            pulumi.Output.concat("rediss://", host, f":{port}") if isinstance(spec, ManagedRedis) else None
        )
        self.secret = k8s.core.v1.Secret(
            REDIS_SECRET,
            metadata=self._metadata(REDIS_SECRET),
            string_data={"url": self.url, "username": gateway.name, "password": _secret(gateway_password)},
            opts=self._k8s,
        )
        self.ray_secret = k8s.core.v1.Secret(
            REDIS_RAY_SECRET,
            metadata=self._metadata(REDIS_RAY_SECRET),
            string_data={"username": ray.name, "password": _secret(ray_password)},
            opts=self._k8s,
        )
        # Only the controller's URL: the head pod's other processes (and the KubeRay cleanup Job,
        # which copies the head's pod template) see the variable, and it can read queue figures only.
        self.autoscaler_secret = (
            k8s.core.v1.Secret(
                REDIS_AUTOSCALER_SECRET,
                metadata=self._metadata(REDIS_AUTOSCALER_SECRET),
                string_data={"url": url_of(autoscaler, users[autoscaler])},
                opts=self._k8s,
            )
            if autoscaler in users
            else None
        )
        if isinstance(spec, InClusterRedis):
            self._in_cluster(spec, users)
        else:
            k8s.core.v1.Service(
                REDIS_SERVICE,
                metadata=self._metadata(REDIS_SERVICE),
                spec={"type": "ExternalName", "externalName": host, "ports": [{"name": "redis", "port": port}]},
                opts=self._k8s,
            )
        self.register_outputs({"endpoint": self.endpoint})

    def _password(self, name: str) -> pulumi.Output[str]:
        # No punctuation: ElastiCache refuses some of it in passwords, and it would need
        # escaping in the gateway's URL.
        return _secret(
            random.RandomPassword(name, length=40, special=False, opts=pulumi.ResourceOptions(parent=self)).result
        )

    def _metadata(self, name: str) -> dict:
        return {"name": name, "namespace": NAMESPACE, "labels": labels("redis", self._args.stack)}

    def _elasticache(self, spec: ManagedRedis, passwords: dict[AclUser, pulumi.Output[str]]) -> pulumi.Output[str]:
        name, args = self._name, self._args
        child = pulumi.ResourceOptions(parent=self)
        subnets = aws.elasticache.SubnetGroup(
            name, subnet_ids=args.subnet_ids, description="llmstack Redis: private subnets only", opts=child
        )
        firewall = aws.ec2.SecurityGroup(
            name,
            vpc_id=args.vpc_id,
            description="llmstack Redis: 6379 from cluster nodes only",
            ingress=[
                aws.ec2.SecurityGroupIngressArgs(
                    protocol="tcp",
                    from_port=PORT,
                    to_port=PORT,
                    security_groups=[args.node_security_group_id],
                    description="Redis from EKS nodes",
                )
            ],
            egress=[],
            opts=child,
        )
        # User IDs are unique per account and region, hence the stack in each.
        users = [
            aws.elasticache.User(
                f"{name}-{user.name}",
                user_id=f"llmstack-{args.stack}-{user.name.removeprefix('llmstack-')}",
                user_name=user.name,
                engine="redis",
                access_string=access_string(user),
                authentication_mode={"type": "password", "passwords": [password]},
                opts=child,
            )
            for user, password in passwords.items()
        ]
        # ElastiCache requires a user named `default` in every user group: this one is off.
        default = aws.elasticache.User(
            f"{name}-default",
            user_id=f"llmstack-{args.stack}-default",
            user_name="default",
            engine="redis",
            access_string="off -@all",
            authentication_mode={"type": "password", "passwords": [self._password(f"{name}-default")]},
            opts=child,
        )
        group = aws.elasticache.UserGroup(
            name,
            user_group_id=f"llmstack-{args.stack}",
            engine="redis",
            user_ids=[default.user_id, *(u.user_id for u in users)],
            opts=child,
        )
        parameters = aws.elasticache.ParameterGroup(
            name,
            family=parameter_group_family(ELASTICACHE_ENGINE_VERSION),
            description="llmstack: never evict (budgets, spend and usage have TTLs)",
            parameters=[aws.elasticache.ParameterGroupParameterArgs(name="maxmemory-policy", value=REQUIRED_POLICY)],
            opts=child,
        )
        failover = spec.replicas > 0
        replication = aws.elasticache.ReplicationGroup(
            name,
            description=f"llmstack {args.stack}: API keys, rate limits, usage, Ray GCS",
            engine="redis",
            engine_version=ELASTICACHE_ENGINE_VERSION,
            node_type=spec.node_type,
            port=PORT,
            num_cache_clusters=1 + spec.replicas,
            automatic_failover_enabled=failover,
            multi_az_enabled=failover,
            transit_encryption_enabled=True,
            at_rest_encryption_enabled=True,
            user_group_ids=[group.user_group_id],
            subnet_group_name=subnets.name,
            security_group_ids=[firewall.id],
            snapshot_retention_limit=7,
            parameter_group_name=parameters.name,
            opts=child,
        )
        return replication.primary_endpoint_address

    def _in_cluster(self, spec: InClusterRedis, passwords: dict[AclUser, pulumi.Output[str]]) -> None:
        selector = {COMPONENT_LABEL: "redis"}
        users = list(passwords)
        acl = pulumi.Output.all(*passwords.values()).apply(
            lambda values: acl_file({u.name: v for u, v in zip(users, values)}, users)
        )
        acl_secret = k8s.core.v1.Secret(
            ACL_SECRET, metadata=self._metadata(ACL_SECRET), string_data={"users.acl": _secret(acl)}, opts=self._k8s
        )
        claim = k8s.core.v1.PersistentVolumeClaim(
            DATA_CLAIM,
            metadata=self._metadata(DATA_CLAIM),
            spec={
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": self._args.storage_class,
                "resources": {"requests": {"storage": f"{spec.storage_gib}Gi"}},
            },
            opts=self._k8s,
        )
        container = {
            "name": "redis",
            "image": IN_CLUSTER_REDIS_IMAGE,
            "args": [
                "--aclfile",
                ACL_PATH,
                "--appendonly",
                "yes",
                "--dir",
                "/data",
                "--maxmemory",
                f"{IN_CLUSTER_MAXMEMORY_MIB}mb",
                "--maxmemory-policy",
                REQUIRED_POLICY,
            ],
            "ports": [{"name": "redis", "containerPort": PORT}],
            "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
            "resources": {
                "requests": {"cpu": "100m", "memory": "256Mi"},
                "limits": {"memory": f"{IN_CLUSTER_MEMORY_LIMIT_MIB}Mi"},
            },
            "volumeMounts": [
                {"name": "data", "mountPath": "/data"},
                {"name": "acl", "mountPath": ACL_PATH.rsplit("/", 1)[0], "readOnly": True},
            ],
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        }
        after = pulumi.ResourceOptions.merge(self._k8s, pulumi.ResourceOptions(depends_on=[acl_secret, claim]))
        k8s.apps.v1.Deployment(
            REDIS_SERVICE,
            metadata=self._metadata(REDIS_SERVICE),
            spec={
                "replicas": 1,
                "strategy": {"type": "Recreate"},  # one volume, one writer
                "selector": {"matchLabels": selector},
                "template": {
                    "metadata": {"labels": labels("redis", self._args.stack)},
                    "spec": {
                        "securityContext": {
                            "runAsNonRoot": True,
                            "runAsUser": REDIS_UID,
                            "runAsGroup": REDIS_UID,
                            "fsGroup": REDIS_UID,
                            "seccompProfile": {"type": "RuntimeDefault"},
                        },
                        "automountServiceAccountToken": False,
                        "nodeSelector": {NODE_GROUP_LABEL: "system"},
                        "containers": [container],
                        "volumes": [
                            {"name": "data", "persistentVolumeClaim": {"claimName": DATA_CLAIM}},
                            # 0440, group redis: readable by the server, nobody else.
                            {"name": "acl", "secret": {"secretName": ACL_SECRET, "defaultMode": 0o440}},
                        ],
                    },
                },
            },
            opts=after,
        )
        k8s.core.v1.Service(
            REDIS_SERVICE,
            metadata=self._metadata(REDIS_SERVICE),
            spec={"selector": selector, "ports": [{"name": "redis", "port": PORT, "targetPort": "redis"}]},
            opts=self._k8s,
        )
        policy = f"{REDIS_SERVICE}-ingress"
        k8s.networking.v1.NetworkPolicy(
            policy,
            metadata=self._metadata(policy),
            spec={
                "podSelector": {"matchLabels": selector},
                "policyTypes": ["Ingress"],
                "ingress": [
                    {
                        "from": [
                            {
                                "podSelector": {
                                    "matchExpressions": [
                                        {"key": COMPONENT_LABEL, "operator": "In", "values": ["gateway", "ray"]}
                                    ]
                                }
                            }
                        ],
                        "ports": [{"protocol": "TCP", "port": PORT}],
                    }
                ],
            },
            opts=self._k8s,
        )


def _secret(value: pulumi.Input[str]) -> pulumi.Output[str]:
    """`value` marked secret (encrypted in the Pulumi state). Typed for str: in a dict display
    mypy solves `Output.secret`'s `Input[U]` for an Output[str] as Never."""
    return pulumi.Output.secret(value)
