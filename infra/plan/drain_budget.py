"""How long a Ray worker pod has between being asked to stop and being killed, and how the stack
spends it: one budget for the pod's `terminationGracePeriodSeconds` and Ray's own drain.

On AWS the tightest case is a spot interruption: EC2 gives a two-minute notice
(`SPOT_NOTICE_S`), EventBridge puts it on the interruption queue, and Karpenter's interruption
handling taints and drains the node at once while it launches a replacement (Karpenter v1.9 docs,
concepts/disruption.md, "Interruption"). Draining evicts the worker pod: the kubelet runs its
stop and sends SIGTERM, and SIGKILLs it when `terminationGracePeriodSeconds` runs out. The same
path serves a node drain, a Karpenter expiry or drift, and a scale-down of worker pods. No
NodePool `terminationGracePeriod` is set, so the pod's own grace is the bound, and EC2 reclaims a
spot instance at the end of its notice whatever is left.

What Ray does with it (Ray 2.60, ray/_private/node.py, `_drain_node_before_shutdown`): on SIGTERM,
`ray start --block` (the container's process) marks its node as draining (reason preemption,
deadline `RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S`, 30 s by default) and waits up to that long for
the raylet to finish. Serve moves the node's replicas (ray/serve/_private/deployment_state.py,
`migrate_replicas_on_draining_nodes`): a replacement starts elsewhere, and once it runs the old
replica stops gracefully (HAProxy stops sending to it for the direct-ingress minimum draining
period, 30 s, then its in-flight requests get the rest of `graceful_shutdown_timeout_s`, floored
at 35 s). Streams still running when the pod dies are cut, and the gateway resumes them on
another replica (serving.gateway.resume; a stream whose engine is stopped under it ends with a
5xx error event, which the gateway also resumes).

Kubernetes' default grace (30 s) with Ray's default drain (30 s) left nothing of Serve's 35 s and
killed the pod as Ray's drain ended. The budget here: the pod gets `WORKER_GRACE_S` (the notice
less `NOTICE_DELIVERY_S` for EventBridge, the queue and Karpenter's eviction), Ray drains for
`RAY_DRAIN_S` (the grace less `RAY_EXIT_S` to stop its processes itself before the SIGKILL), which
holds Serve's whole graceful stop (`SERVE_GRACEFUL_STOP_S`) with room for a replacement that
starts on a node with free capacity. A replacement that needs a new GPU node (minutes) is not
ready within a spot notice: the replica then serves until the drain ends and its remaining
streams are resumed.
"""

from __future__ import annotations

SPOT_NOTICE_S = 120  # EC2's spot interruption notice: the instance is reclaimed two minutes later
NOTICE_DELIVERY_S = 15  # EventBridge -> SQS -> Karpenter -> pod eviction, before the pod's grace starts
WORKER_GRACE_S = SPOT_NOTICE_S - NOTICE_DELIVERY_S  # the worker pod's terminationGracePeriodSeconds
RAY_EXIT_S = 10  # for Ray to stop its processes after its drain, before the kubelet's SIGKILL
RAY_DRAIN_S = WORKER_GRACE_S - RAY_EXIT_S  # RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S
# Ray 2.60: RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S (30) + RAY_SERVE_DIRECT_INGRESS_SHUTDOWN_BUFFER_S (5),
# the floor of a direct-ingress deployment's graceful_shutdown_timeout_s.
SERVE_GRACEFUL_STOP_S = 30 + 5


def worker_drain_env() -> dict[str, str]:
    """What every Ray worker container's environment needs for the budget above."""
    return {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": str(RAY_DRAIN_S)}
