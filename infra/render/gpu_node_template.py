"""What a GPU node of a stack's node group looks like to Kubernetes, whoever starts it.

Both provisioners call this a node template: Karpenter's NodePool `spec.template`, the Cluster
Autoscaler's `node-template` tags on an Auto Scaling group.

Both node provisioners (managed node groups under the Cluster Autoscaler, or Karpenter
NodePools) give GPU nodes the same labels and taint, so the rendered RayService selects and
tolerates them the same way, and the NVIDIA device plugin (node selector
`nvidia.com/gpu.present`) runs on them.

GPU readiness: a new GPU node registers before the device plugin advertises `nvidia.com/gpu`.
The Cluster Autoscaler treats a node carrying its AWS GPU label (`k8s.amazonaws.com/accelerator`,
kubernetes/autoscaler cloudprovider/aws/aws_cloud_provider.go `GPULabel`) as "GPU not ready yet"
instead of "no GPU", so the label stops it from starting another node for the same pending pod.
"""

from __future__ import annotations

from infra.catalog.gpu_catalog import GpuClass, InstanceType, load_catalog
from infra.render.common import NODE_GROUP_LABEL
from infra.spec.schema import GpuNodeGroup

GPU_CLASS_LABEL = "llmstack.dev/gpu-class"
GPU_PRESENT_LABEL = "nvidia.com/gpu.present"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}
ACCELERATOR_LABEL = "k8s.amazonaws.com/accelerator"
# Label values per GPU class. The autoscaler's AWS provider lists nvidia-tesla-a100, nvidia-a10g,
# nvidia-l4 and nvidia-l40s (aws_cloud_provider.go availableGPUTypes); H100 is not in that list,
# so it gets the same naming scheme. The readiness check keys on the label being present.
ACCELERATOR_VALUES = {
    GpuClass.L4: "nvidia-l4",
    GpuClass.A10G: "nvidia-a10g",
    GpuClass.L40S: "nvidia-l40s",
    GpuClass.A100_40GB: "nvidia-tesla-a100",
    GpuClass.A100_80GB: "nvidia-tesla-a100",
    GpuClass.H100_80GB: "nvidia-h100",
}


def node_labels(group: GpuNodeGroup) -> dict[str, str]:
    return {
        NODE_GROUP_LABEL: group.name,
        GPU_CLASS_LABEL: group.instance.gpu_class.value,
        GPU_PRESENT_LABEL: "true",
        ACCELERATOR_LABEL: ACCELERATOR_VALUES[group.instance.gpu_class],
    }


def fallback_instance_types(group: GpuNodeGroup) -> list[InstanceType]:
    """Instance types that can stand in for the group's own: same GPU class and GPU count (so
    `max_size` still counts nodes, and no GPUs sit idle), at least its vCPUs and memory (the Ray
    worker pod asks for those). The group's type first, then by price: when it is short in a
    zone, Karpenter starts the next one."""
    own = group.instance
    fits = [
        t
        for t in load_catalog().values()
        if t.gpu_class is own.gpu_class
        and t.gpus == own.gpus
        and t.vcpus >= own.vcpus
        and t.memory_gib >= own.memory_gib
    ]
    return sorted(fits, key=lambda t: (t.instance_type != own.instance_type, t.on_demand_usd_per_hour, t.instance_type))
