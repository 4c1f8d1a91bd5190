"""Node metadata service under Pulumi's mocks: pods cannot borrow the node role."""

from __future__ import annotations

import pytest

from tests.support.pulumi_program import CLOUD_STACKS, example_run


@pytest.mark.parametrize("stack", [*CLOUD_STACKS, "karpenter"])
def test_imds_hop_limit_is_one_on_every_node(stack: str) -> None:
    """A pod is one network hop further from IMDS than its node: with a hop limit of 1 its
    requests never get an answer, so only IRSA roles reach AWS from pods."""
    run = example_run(stack)
    templates = run.of_type("aws:ec2/launchTemplate:LaunchTemplate")
    assert templates
    for template in templates:
        options = template.inputs["metadataOptions"]
        assert (options["httpTokens"], options["httpPutResponseHopLimit"]) == ("required", 1)
    for node_class in run.of_type("kubernetes:karpenter.k8s.aws/v1:EC2NodeClass"):
        options = node_class.inputs["spec"]["metadataOptions"]
        assert (options["httpTokens"], options["httpPutResponseHopLimit"]) == ("required", 1)
    # Whatever needs AWS from a pod has its own role instead.
    roles = {r.name for r in run.of_type("aws:iam/role:Role")}
    assert {"addons-lb-controller", "addons-ebs-csi", "model-cache-reader"} <= roles
