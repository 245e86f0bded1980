"""A cluster spec's on-demand $/hour (trainlift.estimate.cost): per node group, the total, and what is unknown."""

from __future__ import annotations

from datetime import date
from pathlib import Path

import pytest

from trainlift.catalog import Price
from trainlift.config.cluster import cluster_spec_from_yaml, parse_cluster_spec
from trainlift.estimate.cost import cluster_cost, usd

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def spec(region: str = "us-east-1", **worker):
    return parse_cluster_spec({"name": "c", "region": region, "system": {"instance_type": "m7i.xlarge", "count": 1},
                               "workers": [{"name": "gpu-workers", "instance_type": "g6.12xlarge", "count": 2,
                                            **worker}]})


def test_each_group_is_count_times_price_and_the_total_is_their_sum():
    cost = cluster_cost(spec())
    assert [(g.group, g.count, g.usd_per_hour) for g in cost.groups] == [
        ("system-nodes", 1, 0.2016), ("gpu-workers", 2, pytest.approx(9.2032))]
    assert cost.total_usd_per_hour == pytest.approx(9.4048) and cost.complete
    assert cost.lines() == [
        "cost  system-nodes: 1 × m7i.xlarge × $0.2016/h = $0.2016/h",
        "cost  gpu-workers: 2 × g6.12xlarge × $4.60/h = $9.20/h",
        "cost  total: $9.40/h (catalog on-demand prices for us-east-1: karpenter-2026-02-09, checked 2026-12-06; "
        "--live not used)",
    ]


def test_to_dict_carries_each_group_its_source_and_the_total():
    data = cluster_cost(spec()).to_dict()
    assert data["total_usd_per_hour"] == 9.4048 and data["total_is_lower_bound"] is False and data["unknown"] == []
    assert data["groups"][1] == {
        "group": "gpu-workers", "instance_type": "g6.12xlarge", "count": 2, "usd_per_hour_each": 4.6016,
        "usd_per_hour": 9.2032, "price_source": "karpenter-2026-02-09", "price_as_of": "2026-12-06", "unknown": None}
    assert data["region"] == "us-east-1" and data["currency"] == "USD"


def test_a_group_without_a_catalog_price_makes_the_total_a_lower_bound():
    cost = cluster_cost(spec("us-east-2", instance_type="p5.48xlarge", count=4))
    assert cost.unknown == ["gpu-workers"] and not cost.complete
    assert cost.total_usd_per_hour == 0.2016
    assert cost.lines()[1] == ("cost  gpu-workers: 4 × p5.48xlarge: no catalog price for p5.48xlarge in us-east-2 "
                               "(`trainlift price p5.48xlarge --region us-east-2 --live` asks AWS)")
    assert cost.lines()[2].startswith("cost  total: at least $0.2016/h, not counting gpu-workers (")
    assert cost.to_dict()["total_is_lower_bound"] is True


def test_nothing_known_is_an_unknown_total():
    cost = cluster_cost(spec(), price_of=lambda instance_type, region: None)
    assert cost.total_usd_per_hour is None
    assert cost.lines()[-1] == "cost  total: unknown (no price for system-nodes, gpu-workers)"
    assert cost.to_dict()["total_is_lower_bound"] is False


def test_a_capacity_block_is_not_priced_on_demand():
    cost = cluster_cost(cluster_spec_from_yaml((EXAMPLES / "cluster-p5.yaml").read_text()))
    assert cost.unknown == ["h100"] and cost.unknown_types == ["p5.48xlarge"]  # estimate names the type
    assert "a Capacity Block is paid for when bought" in cost.lines()[1]


def test_a_lookup_can_be_passed_in():
    live = Price(instance_type="g6.12xlarge", region="us-east-1", usd_per_hour=5.0, source="aws-price-list-api",
                 as_of=date(2026, 12, 1))
    cost = cluster_cost(spec(), price_of=lambda t, r: live if t == "g6.12xlarge" else None)
    assert cost.total_usd_per_hour == 10.0 and cost.unknown == ["system-nodes"]
    assert cost.sources() == ["aws-price-list-api, checked 2026-12-01"]


@pytest.mark.parametrize("amount, text", [(0.2016, "$0.2016"), (4.6016, "$4.60"), (113.9328, "$113.93"),
                                          (1234.5, "$1,234.50")])
def test_dollars(amount, text):
    assert usd(amount) == text
