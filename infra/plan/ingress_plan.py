"""How many LLMRouter replicas the serving ingress needs so that it never caps the stack.

On the direct serving path (`infra.render.serve_config`) tokens stream from each model
replica's own vLLM HTTP app through HAProxy (C, multi-threaded); the one Python process a
request passes through besides the replica is its model's `LLMRouter`, which picks the replica
once per request. Ray runs `RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE` routers per model on
every node with a proxy (the head, and each node with a replica: `proxy_location: EveryNode`).

Sizing, all from `infra/catalog/serving_estimates.yaml` (estimates, see there):

    peak tokens/s of a model  = max_replicas x output tokens/s of one replica
    one router's tokens/s     = 1000 / router CPU-ms per token x target utilization
    routers per proxy node    = max over models of ceil(peak / one router / proxy nodes at peak)

Traffic reaches every proxy node (KubeRay's Serve Service spreads it over the pods whose proxy
is healthy), so the routers a model needs at peak are split over the nodes running then; at
lower load fewer nodes carry less traffic.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from infra.catalog.gpu_catalog import load_catalog
from infra.catalog.serving_estimates import ServingEstimates, load_estimates

if TYPE_CHECKING:
    from infra.plan.planner import ModelPlan, NodeGroupPlan


class ModelIngress(BaseModel):
    model_id: str
    replica_output_tokens_per_s: int = Field(description="Estimate for one replica.")
    peak_output_tokens_per_s: int = Field(description="At max_replicas.")
    routers_at_peak: int = Field(description="LLMRouter replicas this model needs at its peak.")


class IngressPlan(BaseModel):
    router_output_tokens_per_s: int = Field(description="What one LLMRouter replica is planned to carry.")
    proxy_nodes_at_peak: int = Field(description="Nodes running a proxy (and routers) at max replicas.")
    routers_per_node: int = Field(description="RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE.")
    models: list[ModelIngress]

    @property
    def peak_output_tokens_per_s(self) -> int:
        return sum(m.peak_output_tokens_per_s for m in self.models)


def replica_output_tokens_per_s(model: ModelPlan, estimates: ServingEstimates) -> float:
    if model.instance_type is None:
        return estimates.replica_output_tokens_per_s["cpu"]
    gpu_class = load_catalog()[model.instance_type].gpu_class.value
    per_gpu = estimates.replica_output_tokens_per_s[gpu_class]
    return per_gpu * model.gpus_per_replica * estimates.reference_weight_bytes / model.weight_bytes


def plan_ingress(
    models: list[ModelPlan], node_groups: list[NodeGroupPlan], *, local: bool, estimates: ServingEstimates | None = None
) -> IngressPlan:
    """The ingress of a stack whose models and node groups are planned. Pure."""
    estimates = estimates or load_estimates()
    router = 1000 / estimates.router_cpu_ms_per_output_token * estimates.router_target_utilization
    # The head runs a proxy too; a local stack is one machine, one node.
    proxy_nodes = 1 if local else 1 + sum(g.nodes_at_max for g in node_groups)
    planned = []
    for m in models:
        replica = replica_output_tokens_per_s(m, estimates)
        peak = replica * m.max_replicas
        planned.append(
            ModelIngress(
                model_id=m.model_id,
                replica_output_tokens_per_s=round(replica),
                peak_output_tokens_per_s=round(peak),
                routers_at_peak=max(1, math.ceil(peak / router)),
            )
        )
    per_node = max((math.ceil(m.routers_at_peak / proxy_nodes) for m in planned), default=1)
    return IngressPlan(
        router_output_tokens_per_s=round(router),
        proxy_nodes_at_peak=proxy_nodes,
        routers_per_node=max(1, per_node),
        models=planned,
    )
