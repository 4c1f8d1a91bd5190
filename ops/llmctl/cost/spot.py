"""Spot node prices from EC2's spot price history (boto3), for the stack's spot node groups.

One `DescribeSpotPriceHistory` query per instance type (paginated), Linux, limited to the
stack's zones, over the period priced; `infra.plan.cost.spot_price` averages it. EC2 keeps 90 days of
history. Without credentials, or when the call fails, each spot group gets the reason instead
of a price, and `infra.plan.cost.node_prices` falls back to the catalog's on-demand price with it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

from botocore.exceptions import BotoCoreError, ClientError

from infra.plan.cost import NodePrice, SpotPricePoint, spot_price
from infra.spec.schema import AwsCloud, CapacityType, GpuNodeGroup, StackSpec
from ops.llmctl import aws

HISTORY_DAYS = 90
PRODUCT = "Linux/UNIX"  # EKS nodes run Linux in a VPC; EC2 files those prices under this name


def spot_groups(spec: StackSpec) -> list[GpuNodeGroup]:
    return [g for g in spec.node_groups if isinstance(g, GpuNodeGroup) and g.capacity_type is CapacityType.SPOT]


def spot_prices(spec: StackSpec, start: datetime, end: datetime, *, session=None) -> dict[str, NodePrice | str]:
    """Node group -> its average spot price over [start, end], or why there is none."""
    groups = spot_groups(spec)
    if not groups or not isinstance(spec.cloud, AwsCloud):
        return {}
    oldest = datetime.now(UTC) - timedelta(days=HISTORY_DAYS - 1)
    start = max(start, oldest)
    if start >= end:
        return {g.name: f"the period is older than EC2's {HISTORY_DAYS} days of spot price history" for g in groups}
    session = session or aws.session(spec.cloud.region)
    if session.get_credentials() is None:
        return {g.name: f"no AWS credentials ({aws.LOGIN_HINT})" for g in groups}
    ec2 = aws.client(session, "ec2")
    found: dict[str, NodePrice | str] = {}
    for instance_type in sorted({g.instance.instance_type for g in groups}):
        try:
            points = _history(ec2, instance_type, spec.cloud.availability_zones, start, end)
        except (BotoCoreError, ClientError) as exc:
            reason = aws.describe_aws_error(exc, doing=f"reading the spot price history of {instance_type}")
            for g in groups:
                if g.instance_type == instance_type:
                    found[g.name] = reason
            continue
        price = spot_price(points, spec.cloud.availability_zones, start, end)
        for g in groups:
            if g.instance_type == instance_type:
                found[g.name] = price or f"EC2 has no spot price for {instance_type} in the stack's zones"
    return found


def _history(ec2, instance_type: str, zones: list[str], start: datetime, end: datetime) -> list[SpotPricePoint]:
    pages = ec2.get_paginator("describe_spot_price_history").paginate(
        InstanceTypes=[instance_type],
        ProductDescriptions=[PRODUCT],
        StartTime=start,
        EndTime=end,
        Filters=[{"Name": "availability-zone", "Values": list(zones)}],
    )
    return [
        SpotPricePoint(
            zone=item["AvailabilityZone"], usd_per_hour=Decimal(item["SpotPrice"]), timestamp=item["Timestamp"]
        )
        for page in pages
        for item in page["SpotPriceHistory"]
    ]
