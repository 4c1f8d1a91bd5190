"""The VPC: private subnets for nodes and Redis, public subnets for the load balancer only.

Per availability zone one private subnet (a /19: the VPC CNI gives every pod a VPC address)
and one public /24. Nothing but the gateway's NLB and the NAT gateway lives in the public
subnets, and they do not hand out public IPs. Nodes reach the internet (image pulls, the
Hugging Face hub) through one NAT gateway: a zone outage cuts egress, but not serving, and
one NAT costs a third of three. Subnet tags tell the AWS Load Balancer Controller which
subnets are which (`kubernetes.io/role/elb` public, `.../internal-elb` private).

An S3 gateway endpoint on the private route table sends the nodes' S3 traffic (model weights
from the stack's cache: 141 GB for a 70B model on every new node; ECR image layers, which ECR
serves from S3) around the NAT gateway, which bills per GB. Gateway endpoints cost nothing.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

VPC_CIDR = "10.0.0.0/16"
PRIVATE_PREFIX = 19  # 8,190 addresses per zone: pods take VPC addresses
PUBLIC_PREFIX = 24


@dataclass
class NetworkArgs:
    cluster_name: str
    region: str
    availability_zones: list[str]
    cidr: str = VPC_CIDR


def subnet_cidrs(cidr: str, zones: int) -> tuple[list[str], list[str]]:
    """Private /19s from the bottom of the VPC range, public /24s from its top /19."""
    network = ipaddress.ip_network(cidr)
    blocks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = list(network.subnets(new_prefix=PRIVATE_PREFIX))
    if zones > len(blocks) - 1:
        raise ValueError(f"{cidr} holds at most {len(blocks) - 1} zones")
    public = list(blocks[-1].subnets(new_prefix=PUBLIC_PREFIX))
    return [str(b) for b in blocks[:zones]], [str(b) for b in public[:zones]]


class Network(pulumi.ComponentResource):
    vpc_id: pulumi.Output[str]
    private_subnet_ids: pulumi.Output[list[str]]
    public_subnet_ids: pulumi.Output[list[str]]

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llmstack:aws:Network", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        cluster_tag = {f"kubernetes.io/cluster/{args.cluster_name}": "shared"}

        vpc = aws.ec2.Vpc(
            name,
            cidr_block=args.cidr,
            enable_dns_hostnames=True,
            enable_dns_support=True,
            tags={"Name": args.cluster_name},
            opts=child,
        )
        igw = aws.ec2.InternetGateway(name, vpc_id=vpc.id, tags={"Name": args.cluster_name}, opts=child)
        # The VPC's default security group allows all traffic between its members; nothing
        # should use it, so take its rules away.
        aws.ec2.DefaultSecurityGroup(name, vpc_id=vpc.id, ingress=[], egress=[], opts=child)

        private_cidrs, public_cidrs = subnet_cidrs(args.cidr, len(args.availability_zones))
        public, private = [], []
        for zone, private_cidr, public_cidr in zip(args.availability_zones, private_cidrs, public_cidrs):
            public.append(
                aws.ec2.Subnet(
                    f"{name}-public-{zone}",
                    vpc_id=vpc.id,
                    availability_zone=zone,
                    cidr_block=public_cidr,
                    map_public_ip_on_launch=False,
                    tags={"Name": f"{args.cluster_name}-public-{zone}", "kubernetes.io/role/elb": "1", **cluster_tag},
                    opts=child,
                )
            )
            private.append(
                aws.ec2.Subnet(
                    f"{name}-private-{zone}",
                    vpc_id=vpc.id,
                    availability_zone=zone,
                    cidr_block=private_cidr,
                    map_public_ip_on_launch=False,
                    tags={
                        "Name": f"{args.cluster_name}-private-{zone}",
                        "kubernetes.io/role/internal-elb": "1",
                        **cluster_tag,
                    },
                    opts=child,
                )
            )

        nat_ip = aws.ec2.Eip(f"{name}-nat", domain="vpc", tags={"Name": f"{args.cluster_name}-nat"}, opts=child)
        nat = aws.ec2.NatGateway(
            f"{name}-nat",
            allocation_id=nat_ip.id,
            subnet_id=public[0].id,
            tags={"Name": args.cluster_name},
            opts=pulumi.ResourceOptions(parent=self, depends_on=[igw]),
        )

        self._route_table(f"{name}-public", vpc, public, gateway_id=igw.id)
        private_table = self._route_table(f"{name}-private", vpc, private, nat_gateway_id=nat.id)
        self.s3_endpoint = aws.ec2.VpcEndpoint(
            f"{name}-s3",
            vpc_id=vpc.id,
            service_name=f"com.amazonaws.{args.region}.s3",
            vpc_endpoint_type="Gateway",
            route_table_ids=[private_table.id],
            tags={"Name": f"{args.cluster_name}-s3"},
            opts=child,
        )

        self.vpc_id = vpc.id
        self.private_subnet_ids = pulumi.Output.all(*[s.id for s in private])
        self.public_subnet_ids = pulumi.Output.all(*[s.id for s in public])
        self.register_outputs(
            {
                "vpc_id": self.vpc_id,
                "private_subnet_ids": self.private_subnet_ids,
                "public_subnet_ids": self.public_subnet_ids,
            }
        )

    def _route_table(
        self, name: str, vpc: aws.ec2.Vpc, subnets: list[aws.ec2.Subnet], **target: pulumi.Output[str]
    ) -> aws.ec2.RouteTable:
        table = aws.ec2.RouteTable(
            name,
            vpc_id=vpc.id,
            routes=[aws.ec2.RouteTableRouteArgs(cidr_block="0.0.0.0/0", **target)],
            tags={"Name": name},
            opts=pulumi.ResourceOptions(parent=self),
        )
        for i, subnet in enumerate(subnets):
            aws.ec2.RouteTableAssociation(
                f"{name}-{i}", route_table_id=table.id, subnet_id=subnet.id, opts=pulumi.ResourceOptions(parent=table)
            )
        return table
