"""Capacity Blocks for ML: the node group eksctl needs, the lookup that sees a future block, the AZ check.

moto does not model EC2 capacity reservations, so the lookup runs against recorded
describe_capacity_reservations responses (tests/fixtures/recorded/README.md names their sources)
served by a stand-in client; the request it sends is validated against botocore's EC2 model.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import botocore.session
import pytest
from botocore.validate import validate_parameters

from trainlift.cloud.aws import Aws
from trainlift.cloud.capacity import (
    CapacityFacts, InstanceInfo, Reservation, assess, quota_for,
)
from trainlift.config.cluster import parse_cluster_spec
from trainlift.errors import SpecError
from trainlift.render import render_cluster
from trainlift.render.validate import eksctl_problems

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "recorded"
BLOCK_ID = "cr-02168da1478b509e0"
BASE: dict[str, Any] = {
    "name": "train",
    "region": "us-east-2",
    "availability_zones": ["us-east-2a", "us-east-2b"],
    "workers": [{"name": "p5", "instance_type": "p5.48xlarge", "count": 2, "availability_zones": ["us-east-2a"],
                 "capacity_reservation_id": BLOCK_ID, "capacity_block": True}],
}


def spec(**worker: Any):
    data = copy.deepcopy(BASE)
    data["workers"][0].update(worker)
    return parse_cluster_spec(data)


def block(**changes: Any) -> Reservation:
    base = dict(id=BLOCK_ID, zone="us-east-2a", available=0, total=2, end="2026-07-02T11:30:00+00:00",
                instance_type="p5.48xlarge", state="scheduled", kind="capacity-block",
                start="2026-07-01T11:30:00+00:00")
    return Reservation(**{**base, **changes})


def worker_group(manifests) -> dict[str, Any]:
    eksctl = next(m for m in manifests if m.path == "eksctl.yaml")
    return eksctl.body["managedNodeGroups"][1]


def test_a_capacity_block_group_is_rendered_for_eksctl_and_validates():
    manifests = render_cluster(spec())
    group = worker_group(manifests)
    assert group["instanceMarketOptions"] == {"marketType": "capacity-block"}
    assert group["capacityReservation"] == {"capacityReservationTarget": {"capacityReservationID": BLOCK_ID}}
    assert eksctl_problems(next(m.body for m in manifests if m.path == "eksctl.yaml")) == []


def test_a_block_not_known_to_be_active_starts_the_group_at_zero():
    for facts in (None, {BLOCK_ID: block()}):
        manifests = render_cluster(spec(), reservations=facts)
        group = worker_group(manifests)
        assert (group["desiredCapacity"], group["minSize"], group["maxSize"]) == (0, 0, 2)
        comment = next(m.comment for m in manifests if m.path == "eksctl.yaml")
        assert "eksctl scale nodegroup --cluster train --name p5 --nodes 2" in comment


def test_an_active_block_gets_its_nodes():
    group = worker_group(render_cluster(spec(), reservations={BLOCK_ID: block(state="active", available=2)}))
    assert (group["desiredCapacity"], group["minSize"], group["maxSize"]) == (2, 0, 2)


def test_an_on_demand_reservation_keeps_a_fixed_size_and_no_market_type():
    group = worker_group(render_cluster(spec(capacity_block=False)))
    assert "instanceMarketOptions" not in group
    assert (group["desiredCapacity"], group["minSize"], group["maxSize"]) == (2, 2, 2)


def test_capacity_block_needs_a_reservation_id():
    with pytest.raises(SpecError, match=r"^workers\[0\]\.capacity_block: needs capacity_reservation_id"):
        render_cluster(spec(capacity_reservation_id=None))


def test_a_reservation_group_must_pin_one_az():
    data = copy.deepcopy(BASE)
    data["fabric"], data["workers"][0]["availability_zones"] = "socket", []
    with pytest.raises(SpecError, match=r"^workers\[0\]\.availability_zones: .*cr-02168da1478b509e0"):
        render_cluster(parse_cluster_spec(data))


def test_the_reservation_az_must_be_the_groups_az_in_one_line():
    with pytest.raises(SpecError) as info:
        render_cluster(spec(), reservations={BLOCK_ID: block(zone="us-east-2b")})
    line = info.value.one_line()
    assert "\n" not in line
    assert line.startswith(f"workers[0].availability_zones: {BLOCK_ID} is in us-east-2b; this group is in us-east-2a")
    assert "availability_zones: [us-east-2b]" in line


@pytest.mark.parametrize("facts, flag, expected", [
    (dict(kind="default", state="active"), True, "is an On-Demand Capacity Reservation, not a Capacity Block"),
    (dict(), False, "is a Capacity Block; set capacity_block: true"),
    (dict(instance_type="p4d.24xlarge"), True, "reserves p4d.24xlarge; this group runs p5.48xlarge"),
    (dict(state="expired"), True, "is expired"),
    (dict(total=1), True, "holds 1 instance(s); count is 2"),
])
def test_reservation_facts_that_cannot_launch_the_group(facts, flag, expected):
    with pytest.raises(SpecError) as info:
        render_cluster(spec(capacity_block=flag), reservations={BLOCK_ID: block(**facts)})
    assert expected in info.value.message


class RecordedEc2:
    """Serves one recorded DescribeCapacityReservations response; keeps the requests it was sent."""

    def __init__(self, name: str):
        self.response = json.loads((RECORDED / name).read_text())
        self.requests: list[dict[str, Any]] = []
        self._input = botocore.session.get_session().get_service_model("ec2").operation_model(
            "DescribeCapacityReservations").input_shape

    def describe_capacity_reservations(self, **params: Any) -> dict[str, Any]:
        validate_parameters(params, self._input)
        self.requests.append(params)
        return self.response


def recorded_aws(name: str) -> tuple[Aws, RecordedEc2]:
    aws, ec2 = Aws("us-east-2"), RecordedEc2(name)
    aws._clients["ec2"] = ec2
    return aws, ec2


def test_the_lookup_sees_a_block_before_it_starts():
    aws, ec2 = recorded_aws("ec2-describe-capacity-reservations-capacity-block.json")
    found = aws.reservations("t2.micro")
    states = next(f["Values"] for f in ec2.requests[0]["Filters"] if f["Name"] == "state")
    assert "active" in states and "scheduled" in states and "pending" in states
    assert found == [Reservation(BLOCK_ID, "us-east-2a", 0, 4, "2023-11-21T11:30:00+00:00", "t2.micro", "pending",
                                 "capacity-block", "2023-11-20T11:30:00+00:00")]


def test_the_lookup_by_id_reads_zone_type_and_state():
    aws, ec2 = recorded_aws("ec2-describe-capacity-reservations-capacity-block.json")
    found = aws.reservation(BLOCK_ID)
    assert ec2.requests == [{"CapacityReservationIds": [BLOCK_ID]}]
    assert (found.zone, found.kind, found.state, found.total) == ("us-east-2a", "capacity-block", "pending", 4)


def test_the_lookup_drops_ended_reservations_and_reads_on_demand_ones():
    aws, _ = recorded_aws("ec2-describe-capacity-reservations.json")
    found = aws.reservations("a1.medium")
    assert [(r.id, r.zone, r.state, r.kind, r.available, r.total) for r in found] == [
        ("cr-1234abcd56EXAMPLE", "eu-west-1a", "active", "default", 1, 1)]


def test_capacity_shows_a_future_block_and_recommends_its_az():
    facts = CapacityFacts(
        region="us-east-2", count=2, info=InstanceInfo("p5.48xlarge", vcpus=192, gpus=8),
        zones={"us-east-2a": "use2-az1", "us-east-2b": "use2-az2", "us-east-2c": "use2-az3"},
        offered=["us-east-2a", "us-east-2b", "us-east-2c"], quota=quota_for("p5.48xlarge"), quota_vcpus=384.0,
        vcpus_in_use=0, reservations=[block(zone="us-east-2b")], spot_scores={"us-east-2c": 9})
    report = assess(facts)
    assert report.recommended == "us-east-2b"
    assert "Capacity Block" in report.reason and "2026-07-01T11:30:00+00:00" in report.reason
    assert [r.upcoming for r in report.rows] == [0, 2, 0]
    assert report.to_dict()["reservations"][0]["state"] == "scheduled"
