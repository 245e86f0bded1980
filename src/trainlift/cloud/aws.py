"""Every AWS call trainlift makes: capacity facts (EC2, Service Quotas), EKS and CloudFormation state, S3 uploads,
ECR digests and on-demand prices (Price List API). What the EKS calls return are the records of `cloud/eks_state.py`.

boto3 is imported lazily, and every client takes the standard AWS configuration
(profiles, AWS_REGION, AWS_ENDPOINT_URL, AWS_MAX_ATTEMPTS, ...). Credentials that are
missing or rejected are one clear error. An API that is not permitted, not offered
in the region or not implemented by the endpoint is `Unknown(reason)`, not a crash.
"""

from __future__ import annotations

from datetime import date
from pathlib import Path
from typing import Any, Callable, Iterable, NoReturn, TypeVar

from trainlift.catalog.prices import Price
from trainlift.cloud.aws_errors import (  # noqa: F401  (callers import CredentialsError from here)
    CredentialsError, error_code, error_message, fatal_error, is_api_error,
)
from trainlift.cloud.capacity import (
    ACTIVE, UPCOMING, CapacityFacts, InstanceInfo, Reservation, Unknown, quota_for, reservation_from_ec2,
)
from trainlift.cloud.eks_state import (
    CLUSTER_STACK, NODEGROUP_STACK, ClusterInfo, ClusterTags, NodeGroupInfo, StackInfo,
)
from trainlift.errors import TrainliftError, UsageError

T = TypeVar("T")


def known_regions() -> set[str]:
    import boto3

    session = boto3.session.Session()
    regions: set[str] = set()
    for partition in session.get_available_partitions():
        regions.update(session.get_available_regions("ec2", partition_name=partition))
    return regions


def default_region() -> str | None:
    """The region the standard AWS configuration names: AWS_REGION (which botocore itself does not read, unlike
    the AWS CLI), else AWS_DEFAULT_REGION or the profile's region."""
    import os

    import boto3

    return os.environ.get("AWS_REGION") or boto3.session.Session().region_name


def check_region(region: str) -> None:
    if region not in known_regions():
        raise UsageError(
            f"unknown AWS region {region!r}",
            hint="e.g. us-east-1, us-east-2, us-west-2; `aws ec2 describe-regions` lists the regions enabled for you",
        )


class Aws:
    """The AWS API of one region; clients are made on first use and kept."""

    def __init__(self, region: str):
        self.region = region
        self._clients: dict[str, Any] = {}

    def client(self, service: str, region: str | None = None) -> Any:
        """A client of this region, or of `region` for an API served elsewhere (the Price List API)."""
        key = service if region in (None, self.region) else f"{service}@{region}"
        if key not in self._clients:
            import boto3
            from botocore.config import Config

            config = Config(connect_timeout=10, read_timeout=30)
            session = boto3.session.Session(region_name=region or self.region)
            self._clients[key] = session.client(service, config=config)
        return self._clients[key]

    def _fail(self, what: str, exc: Exception) -> NoReturn:
        fatal = fatal_error(exc, what)
        if fatal is not None:
            raise fatal from None
        if is_api_error(exc):
            raise TrainliftError(f"{what} in {self.region} failed: {error_code(exc)}: {error_message(exc)}") from None
        raise exc

    def _required(self, what: str, call: Callable[[], T]) -> T:
        try:
            return call()
        except Exception as exc:
            self._fail(what, exc)

    def _optional(self, what: str, call: Callable[[], T]) -> T | Unknown:
        try:
            return call()
        except Exception as exc:
            fatal = fatal_error(exc, what)
            if fatal is not None:
                raise fatal from None
            if is_api_error(exc):
                return Unknown(f"{what}: {error_code(exc)}: {error_message(exc)}")
            raise

    # --- identity and capacity -------------------------------------------------------------

    def identity(self) -> dict[str, str]:
        out = self._required("sts:GetCallerIdentity", lambda: self.client("sts").get_caller_identity())
        return {"account": out.get("Account", ""), "arn": out.get("Arn", "")}

    def zones(self) -> dict[str, str]:
        out = self._required("ec2:DescribeAvailabilityZones", lambda: self.client("ec2").describe_availability_zones(
            Filters=[{"Name": "zone-type", "Values": ["availability-zone"]}]))
        return {z["ZoneName"]: z.get("ZoneId", "") for z in out["AvailabilityZones"] if z.get("State") == "available"}

    def instance_info(self, instance_type: str) -> InstanceInfo:
        from botocore.exceptions import ClientError

        try:
            out = self.client("ec2").describe_instance_types(InstanceTypes=[instance_type])
        except ClientError as exc:
            if error_code(exc).startswith("InvalidInstanceType") or error_code(exc) == "InvalidParameterValue":
                raise UsageError(
                    f"instance type {instance_type!r} does not exist in {self.region}",
                    hint="check the spelling, e.g. g6.12xlarge, p5.48xlarge",
                ) from None
            self._fail("ec2:DescribeInstanceTypes", exc)
        except Exception as exc:
            self._fail("ec2:DescribeInstanceTypes", exc)
        if not out["InstanceTypes"]:
            raise UsageError(f"instance type {instance_type!r} does not exist in {self.region}")
        it = out["InstanceTypes"][0]
        gpus = (it.get("GpuInfo") or {}).get("Gpus") or []
        net = it.get("NetworkInfo") or {}
        return InstanceInfo(
            instance_type=instance_type,
            vcpus=int(it["VCpuInfo"]["DefaultVCpus"]),
            gpus=sum(int(g.get("Count", 0)) for g in gpus),
            gpu_model=" ".join(p for p in (gpus[0].get("Manufacturer"), gpus[0].get("Name")) if p) if gpus else None,
            gpu_memory_mib=int((gpus[0].get("MemoryInfo") or {}).get("SizeInMiB", 0)) if gpus else 0,
            efa_supported=bool(net.get("EfaSupported")),
            efa_interfaces=int((net.get("EfaInfo") or {}).get("MaximumEfaInterfaces", 0)),
        )

    def offered_zones(self, instance_type: str) -> list[str] | Unknown:
        def call() -> list[str]:
            pages = self.client("ec2").get_paginator("describe_instance_type_offerings").paginate(
                LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": [instance_type]}])
            return sorted({o["Location"] for page in pages for o in page["InstanceTypeOfferings"]})
        return self._optional("ec2:DescribeInstanceTypeOfferings", call)

    def quota_vcpus(self, code: str) -> float | Unknown:
        from botocore.exceptions import ClientError

        sq = self.client("service-quotas")

        def call() -> float:
            try:
                return float(sq.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"])
            except ClientError as exc:
                if error_code(exc) != "NoSuchResourceException":
                    raise
                first = exc
            # An account that never changed the quota may only have the default value.
            try:
                return float(sq.get_aws_default_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"])
            except ClientError as exc:
                if fatal_error(exc, "") is not None:
                    raise
                raise first from None
        return self._optional("service-quotas:GetServiceQuota", call)

    def vcpus_in_use(self, families: tuple[str, ...]) -> int | Unknown:
        def call() -> int:
            pages = self.client("ec2").get_paginator("describe_instances").paginate(
                Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}])
            counts: dict[str, int] = {}
            total = 0
            for page in pages:
                for res in page["Reservations"]:
                    for inst in res["Instances"]:
                        itype = inst["InstanceType"]
                        quota = quota_for(itype)
                        if quota is None or not set(quota.families) & set(families):
                            continue
                        cpu = inst.get("CpuOptions") or {}
                        if cpu.get("CoreCount") and cpu.get("ThreadsPerCore"):
                            total += int(cpu["CoreCount"]) * int(cpu["ThreadsPerCore"])
                        else:
                            counts[itype] = counts.get(itype, 0) + 1
            if counts:
                out = self.client("ec2").describe_instance_types(InstanceTypes=sorted(counts))
                for it in out["InstanceTypes"]:
                    total += counts[it["InstanceType"]] * int(it["VCpuInfo"]["DefaultVCpus"])
            return total
        return self._optional("ec2:DescribeInstances", call)

    def reservations(self, instance_type: str) -> list[Reservation] | Unknown:
        """Reservations of the type that are active or still to start (a Capacity Block before its start)."""
        states = [ACTIVE, *UPCOMING]

        def call() -> list[Reservation]:
            out = self.client("ec2").describe_capacity_reservations(Filters=[
                {"Name": "instance-type", "Values": [instance_type]}, {"Name": "state", "Values": states}])
            found = [reservation_from_ec2(r) for r in out.get("CapacityReservations", [])]
            return [r for r in found if r.state in states]
        return self._optional("ec2:DescribeCapacityReservations", call)

    def reservation(self, reservation_id: str) -> Reservation | Unknown:
        """One reservation by id, in any state; UsageError when the region has no such reservation."""
        from botocore.exceptions import ClientError

        def call() -> Reservation:
            try:
                out = self.client("ec2").describe_capacity_reservations(CapacityReservationIds=[reservation_id])
            except ClientError as exc:
                if error_code(exc).startswith("InvalidCapacityReservationId"):
                    raise UsageError(f"capacity reservation {reservation_id} does not exist in {self.region}",
                                     hint="check capacity_reservation_id and the spec's region") from None
                raise
            return reservation_from_ec2(out["CapacityReservations"][0])
        return self._optional("ec2:DescribeCapacityReservations", call)

    def spot_scores(self, instance_type: str, count: int, zones: dict[str, str]) -> dict[str, int] | Unknown:
        by_id = {zid: name for name, zid in zones.items()}

        def call() -> dict[str, int]:
            out = self.client("ec2").get_spot_placement_scores(
                InstanceTypes=[instance_type], TargetCapacity=count, TargetCapacityUnitType="units",
                SingleAvailabilityZone=True, RegionNames=[self.region])
            return {by_id.get(s.get("AvailabilityZoneId", ""), s.get("AvailabilityZoneId", "?")): int(s["Score"])
                    for s in out.get("SpotPlacementScores", []) if s.get("AvailabilityZoneId")}
        return self._optional("ec2:GetSpotPlacementScores", call)

    def capacity(self, instance_type: str, count: int) -> CapacityFacts:
        info = self.instance_info(instance_type)
        zones = self.zones()
        quota = quota_for(instance_type)
        return CapacityFacts(
            region=self.region,
            count=count,
            info=info,
            zones=zones,
            offered=self.offered_zones(instance_type),
            quota=quota,
            quota_vcpus=self.quota_vcpus(quota.code) if quota else Unknown("no quota mapping"),
            vcpus_in_use=self.vcpus_in_use(quota.families) if quota else Unknown("no quota mapping"),
            reservations=self.reservations(instance_type),
            spot_scores=self.spot_scores(instance_type, count, zones),
        )

    # --- prices ------------------------------------------------------------------------------

    def on_demand_price(self, instance_type: str) -> Price:
        """The on-demand Linux USD/hour the Price List API states now for the type in this region."""
        from trainlift.cloud import pricing

        endpoint = pricing.price_list_region(self.region)
        try:
            out = self.client("pricing", region=endpoint).get_products(
                ServiceCode="AmazonEC2", Filters=pricing.product_filters(instance_type, self.region), MaxResults=100)
        except Exception as exc:
            failure = pricing.price_api_error(exc, endpoint)
            if failure is None:
                raise
            raise failure from None
        price_list = out.get("PriceList") or []
        usd = pricing.on_demand_usd(price_list, what=f"{instance_type} in {self.region}")
        return Price(instance_type=instance_type, region=self.region, usd_per_hour=usd, source=pricing.LIVE_SOURCE,
                     as_of=pricing.publication_date(price_list) or date.today())

    # --- EKS --------------------------------------------------------------------------------

    def cluster(self, name: str) -> ClusterInfo | None:
        """The EKS control plane, or None when it does not exist."""
        from botocore.exceptions import ClientError

        try:
            c = self.client("eks").describe_cluster(name=name)["cluster"]
        except ClientError as exc:
            if error_code(exc) == "ResourceNotFoundException":
                return None
            self._fail("eks:DescribeCluster", exc)
        except Exception as exc:
            self._fail("eks:DescribeCluster", exc)
        return ClusterInfo(name, c["status"], c.get("version"), c.get("endpoint"),
                           (c.get("certificateAuthority") or {}).get("data"),
                           tuple((c.get("resourcesVpcConfig") or {}).get("publicAccessCidrs") or ()))

    def addon_configuration(self, cluster: str, addon: str) -> str | None | Unknown:
        """An EKS add-on's configuration values (JSON text, "" for the defaults); None when it is not installed."""
        from botocore.exceptions import ClientError

        def call() -> str | None:
            try:
                found = self.client("eks").describe_addon(clusterName=cluster, addonName=addon)["addon"]
            except ClientError as exc:
                if error_code(exc) == "ResourceNotFoundException":
                    return None
                raise
            return found.get("configurationValues") or ""
        return self._optional("eks:DescribeAddon", call)

    def nodegroups(self, cluster: str) -> dict[str, NodeGroupInfo]:
        eks = self.client("eks")

        def call() -> dict[str, NodeGroupInfo]:
            names = [n for page in eks.get_paginator("list_nodegroups").paginate(clusterName=cluster)
                     for n in page["nodegroups"]]
            groups = [eks.describe_nodegroup(clusterName=cluster, nodegroupName=n)["nodegroup"] for n in names]
            subnets = sorted({s for g in groups for s in g.get("subnets", [])})
            zone_of = self._subnet_zones(subnets)
            return {
                g["nodegroupName"]: NodeGroupInfo(
                    g["nodegroupName"], g["status"], (g.get("scalingConfig") or {}).get("desiredSize"),
                    tuple(g.get("instanceTypes") or ()),
                    tuple(sorted({zone_of[s] for s in g.get("subnets", []) if s in zone_of})),
                    tuple(f"{i.get('code')}: {i.get('message')}" for i in (g.get("health") or {}).get("issues", [])),
                )
                for g in groups
            }
        return self._required("eks:ListNodegroups", call)

    def _subnet_zones(self, subnets: list[str]) -> dict[str, str]:
        if not subnets:
            return {}
        found = self._optional("ec2:DescribeSubnets", lambda: self.client("ec2").describe_subnets(SubnetIds=subnets))
        if isinstance(found, Unknown):
            return {}
        return {s["SubnetId"]: s["AvailabilityZone"] for s in found["Subnets"]}

    # --- S3 -----------------------------------------------------------------------------------

    def put_file(self, path: Path, bucket: str, key: str) -> None:
        self._required(f"s3:PutObject s3://{bucket}/{key}",
                       lambda: self.client("s3").put_object(Bucket=bucket, Key=key, Body=path.read_bytes()))

    # --- CloudFormation stacks and cluster tags: who created a cluster, what a failed create left ---

    def _stack(self, name: str) -> StackInfo | None:
        from botocore.exceptions import ClientError

        try:
            stacks = self.client("cloudformation").describe_stacks(StackName=name)["Stacks"]
        except ClientError as exc:
            if error_code(exc) == "ValidationError" and "does not exist" in error_message(exc):
                return None
            raise
        live = [s for s in stacks if s.get("StackStatus") != "DELETE_COMPLETE"]
        if not live:
            return None
        tags = {t["Key"]: t["Value"] for t in live[0].get("Tags") or []}
        return StackInfo(name, live[0]["StackStatus"], tags)

    def cluster_stack(self, cluster: str) -> StackInfo | None | Unknown:
        """eksctl's CloudFormation stack of the control plane; None when there is none."""
        return self._optional("cloudformation:DescribeStacks",
                              lambda: self._stack(CLUSTER_STACK.format(name=cluster)))

    def nodegroup_stacks(self, cluster: str, groups: Iterable[str]) -> dict[str, StackInfo] | Unknown:
        """eksctl's CloudFormation stacks of these node groups, by group; a group without one is left out.
        One DescribeStacks by name per group: ListStacks would page through every stack of the region."""
        def call() -> dict[str, StackInfo]:
            found = {g: self._stack(NODEGROUP_STACK.format(cluster=cluster, group=g)) for g in groups}
            return {g: stack for g, stack in found.items() if stack is not None}
        return self._optional("cloudformation:DescribeStacks", call)

    def cluster_tags(self, cluster: str) -> ClusterTags | None | Unknown:
        """The EKS cluster's ARN and tags; None when the cluster does not exist."""
        from botocore.exceptions import ClientError

        def call() -> ClusterTags | None:
            try:
                c = self.client("eks").describe_cluster(name=cluster)["cluster"]
            except ClientError as exc:
                if error_code(exc) == "ResourceNotFoundException":
                    return None
                raise
            return ClusterTags(c.get("arn", ""), dict(c.get("tags") or {}))
        return self._optional("eks:DescribeCluster", call)

    def pull_through_rule(self, prefix: str) -> str | None | Unknown:
        """The upstream registry of this region's ECR pull-through cache rule for `prefix`; None when there is none."""
        from botocore.exceptions import ClientError

        def call() -> str | None:
            try:
                rules = self.client("ecr").describe_pull_through_cache_rules(
                    ecrRepositoryPrefixes=[prefix])["pullThroughCacheRules"]
            except ClientError as exc:
                if error_code(exc) == "PullThroughCacheRuleNotFoundException":
                    return None
                raise
            return rules[0].get("upstreamRegistryUrl", "") if rules else None
        return self._optional("ecr:DescribePullThroughCacheRules", call)

    def tag_cluster(self, arn: str, tags: dict[str, str]) -> None:
        self._required("eks:TagResource", lambda: self.client("eks").tag_resource(resourceArn=arn, tags=tags))
