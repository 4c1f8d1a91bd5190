"""The VPC under Pulumi's mocks: S3 traffic from the private subnets skips the NAT gateway."""

from __future__ import annotations

import pytest

from tests.support.pulumi_program import CLOUD_STACKS, example_run


@pytest.mark.parametrize("stack", [*CLOUD_STACKS, "karpenter"])
def test_s3_gateway_endpoint_on_the_private_route_table(stack: str) -> None:
    run = example_run(stack)
    [endpoint] = run.of_type("aws:ec2/vpcEndpoint:VpcEndpoint")
    region = "us-west-2" if stack == "karpenter" else "us-east-1"
    assert endpoint.inputs["serviceName"] == f"com.amazonaws.{region}.s3"
    assert endpoint.inputs["vpcEndpointType"] == "Gateway"  # free; interface endpoints bill per hour and GB
    [private_table] = [t for t in run.of_type("aws:ec2/routeTable:RouteTable") if t.name == "network-private"]
    assert endpoint.inputs["routeTableIds"] == [private_table.id]
    # The private subnets are the ones on that table: nodes and their weight downloads.
    associations = [
        a
        for a in run.of_type("aws:ec2/routeTableAssociation:RouteTableAssociation")
        if a.inputs["routeTableId"] == private_table.id
    ]
    assert {run.by_id(a.inputs["subnetId"]).name for a in associations} == {
        s.name for s in run.of_type("aws:ec2/subnet:Subnet") if "private" in s.name
    }
