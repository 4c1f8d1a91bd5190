"""The AWS side of `pulumi up`: one `pulumi.ComponentResource` per concern.

Read them in the order `program.py` builds them:

    network.py              VPC, private subnets (nodes, Redis), public subnets (load balancer only), NAT
    cluster.py              EKS control plane, OIDC provider (IRSA), system node group, kubeconfig
    managed_node_groups.py  one EKS managed node group per GPU group, Cluster Autoscaler tags on its ASG
    addons.py               pinned Helm charts: device plugin, autoscaler, LB controller, KubeRay, ...
    redis.py                ElastiCache, in-cluster Redis or an external one; the `llmstack-redis` Secret
    workloads.py            the namespace, the HF token Secret and the objects `llmctl render` prints

`iam.py` and `launch_template.py` hold the pieces several components share. Nothing here
decides what to deploy: that comes from the stack spec and `infra.render`, which are pure.
"""
