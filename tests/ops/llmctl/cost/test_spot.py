"""Spot prices from EC2's history: the request `llmctl cost` sends (checked against botocore's
API model by its Stubber) and the price it makes of the answer; failures become reasons."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from decimal import Decimal

import boto3
from botocore.stub import ANY, Stubber

from infra.plan.cost import NodePrice, PriceSource
from infra.spec.stack_file import load_stack
from ops.llmctl.cost.spot import spot_prices

NOW = datetime.now(timezone.utc).replace(microsecond=0)


class StubbedSession:
    """A boto3 session whose EC2 client answers from a Stubber (credentials are fake)."""

    def __init__(self) -> None:
        self.session = boto3.session.Session(
            aws_access_key_id="AKIDEXAMPLE", aws_secret_access_key="x", region_name="us-east-1"
        )
        self.ec2 = self.session.client("ec2")
        self.stubber = Stubber(self.ec2)

    def get_credentials(self):
        return self.session.get_credentials()

    def client(self, service: str, config=None):
        assert service == "ec2"
        return self.ec2


def history(*entries: tuple[str, str, timedelta]) -> dict:
    return {
        "SpotPriceHistory": [
            {
                "AvailabilityZone": zone,
                "SpotPrice": price,
                "InstanceType": "g5.2xlarge",
                "ProductDescription": "Linux/UNIX",
                "Timestamp": NOW - ago,
            }
            for zone, price, ago in entries
        ]
    }


def test_prod_spot_group_is_priced_from_the_history():
    spec = load_stack("prod")  # a10g-spot: g5.2xlarge in us-east-1a/b/c
    aws = StubbedSession()
    start = NOW - timedelta(hours=4)
    aws.stubber.add_response(
        "describe_spot_price_history",
        history(
            ("us-east-1a", "0.5000", timedelta(hours=10)),
            ("us-east-1a", "0.7000", timedelta(hours=2)),
            ("us-east-1b", "0.4000", timedelta(days=1)),
        ),
        {
            "InstanceTypes": ["g5.2xlarge"],
            "ProductDescriptions": ["Linux/UNIX"],
            "StartTime": ANY,
            "EndTime": ANY,
            "Filters": [{"Name": "availability-zone", "Values": ["us-east-1a", "us-east-1b", "us-east-1c"]}],
        },
    )
    with aws.stubber:
        prices = spot_prices(spec, start, NOW, session=aws)
    aws.stubber.assert_no_pending_responses()
    price = prices["a10g-spot"]
    assert isinstance(price, NodePrice) and price.source is PriceSource.SPOT
    assert price.usd_per_hour == Decimal("0.6")  # us-east-1a: 2 h at 0.50, 2 h at 0.70; higher than 1b's 0.40
    assert set(prices) == {"a10g-spot"}  # on-demand groups are not asked about


def test_an_aws_error_becomes_the_reason():
    aws = StubbedSession()
    aws.stubber.add_client_error(
        "describe_spot_price_history", service_error_code="UnauthorizedOperation", service_message="not allowed"
    )
    with aws.stubber:
        prices = spot_prices(load_stack("prod"), NOW - timedelta(days=7), NOW, session=aws)
    assert "ec2:DescribeSpotPriceHistory" in prices["a10g-spot"] and "access denied" in prices["a10g-spot"]


def test_periods_beyond_the_history_and_stacks_without_spot_ask_nothing():
    old = spot_prices(load_stack("prod"), NOW - timedelta(days=400), NOW - timedelta(days=200), session=object())
    assert "90 days" in old["a10g-spot"]
    assert spot_prices(load_stack("dev"), NOW - timedelta(days=7), NOW, session=object()) == {}
