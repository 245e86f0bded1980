"""The capacity verdict, pure: quotas, reservations, placement scores, offerings and unknowns."""

from __future__ import annotations

from trainlift.cloud.capacity import (
    CapacityFacts, InstanceInfo, Reservation, Unknown, assess, family, quota_for,
)

ZONES = {"us-east-2a": "use2-az1", "us-east-2b": "use2-az2", "us-east-2c": "use2-az3"}
G6 = InstanceInfo("g6.12xlarge", vcpus=48, gpus=4, gpu_model="NVIDIA L4", gpu_memory_mib=22888,
                  efa_supported=True, efa_interfaces=1)


def facts(**over) -> CapacityFacts:
    base = dict(region="us-east-2", count=2, info=G6, zones=ZONES, offered=list(ZONES),
                quota=quota_for("g6.12xlarge"), quota_vcpus=192.0, vcpus_in_use=0, reservations=[], spot_scores={})
    base.update(over)
    return CapacityFacts(**base)


def test_quota_families():
    assert quota_for("g6.12xlarge").code == "L-DB2E81BA"
    assert quota_for("vt1.3xlarge").code == "L-DB2E81BA"
    assert quota_for("p5.48xlarge").code == "L-417A185B"
    assert quota_for("p5en.48xlarge").code == "L-417A185B"
    assert quota_for("trn2.48xlarge").code == "L-2C3B7624"
    assert quota_for("inf2.48xlarge").code == "L-1945791B"
    assert quota_for("m7i.xlarge").code == "L-1216C47A"
    assert quota_for("im4gn.large").code == "L-1216C47A"
    assert family("u-6tb1.metal") == "u" and quota_for("u-6tb1.metal").code == "L-43DA4232"


def test_enough_of_everything_recommends_the_first_az():
    report = assess(facts())
    assert report.ok and report.recommended == "us-east-2a" and report.free_vcpus == 192
    assert "first in region order" in report.reason
    assert report.needed_vcpus == 96


def test_quota_shortfall_states_the_gap_and_the_command():
    report = assess(facts(quota_vcpus=64.0, vcpus_in_use=16))
    assert not report.ok and report.recommended is None
    assert "needs 96 vCPUs" in report.problems[0] and "48 vCPUs short" in report.problems[0]
    assert report.fixes == [
        "aws service-quotas request-service-quota-increase --service-code ec2 --quota-code L-DB2E81BA "
        "--desired-value 112 --region us-east-2"
    ]


def test_reservation_that_covers_the_count_wins():
    reservations = [Reservation("cr-0abc", "us-east-2c", available=2, total=4)]
    report = assess(facts(reservations=reservations, spot_scores={"us-east-2b": 9}))
    assert report.recommended == "us-east-2c" and "reservations hold 2" in report.reason
    assert [r.reserved for r in report.rows] == [0, 0, 2]


def test_spot_score_breaks_the_tie():
    report = assess(facts(spot_scores={"us-east-2a": 3, "us-east-2b": 9, "us-east-2c": 5}))
    assert report.recommended == "us-east-2b" and "9/10" in report.reason


def test_not_offered_anywhere_is_a_problem():
    report = assess(facts(offered=[]))
    assert not report.ok and "not offered in any AZ of us-east-2" in report.problems[0]


def test_allowed_zones_limit_the_choice():
    report = assess(facts(offered=["us-east-2b", "us-east-2c"]), allowed=["us-east-2a"])
    assert not report.ok and "not offered in us-east-2a" in report.problems[0]
    report = assess(facts(offered=["us-east-2b", "us-east-2c"], spot_scores={"us-east-2b": 9}),
                    allowed=["us-east-2a", "us-east-2c"])
    assert report.recommended == "us-east-2c"


def test_unknown_facts_are_reported_not_fatal():
    report = assess(facts(quota_vcpus=Unknown("AccessDenied"), vcpus_in_use=Unknown("AccessDenied"),
                          reservations=Unknown("not implemented"), spot_scores=Unknown("not implemented")))
    assert report.ok and report.recommended == "us-east-2a" and report.free_vcpus is None
    assert set(report.unknown) == {"quota_vcpus", "vcpus_in_use", "reservations", "spot_scores"}
    data = report.to_dict()
    assert data["quota"]["vcpus"] is None and data["reservations"] is None and data["ok"] is True


def test_unknown_offerings_leave_no_recommendation_unless_pinned():
    report = assess(facts(offered=Unknown("UnauthorizedOperation")))
    assert report.recommended is None and "unknown" in report.reason
    assert assess(facts(offered=Unknown("x")), allowed=["us-east-2b"]).recommended == "us-east-2b"


def test_quota_known_with_usage_unknown_still_catches_a_too_small_quota():
    report = assess(facts(quota_vcpus=32.0, vcpus_in_use=Unknown("denied")))
    assert not report.ok and "64 vCPUs short" in report.problems[0]


def test_the_report_prints_the_catalog_price_beside_the_instance_and_the_az(capsys):
    from trainlift import catalog
    from trainlift.cli import capacity as cli

    report = assess(facts())
    cli._print(report, catalog.on_demand_price("g6.12xlarge", "us-east-2"))
    out = capsys.readouterr().out
    assert ("  price    $4.60/h on demand (skypilot-before-2025-06, checked 2026-12-06); 2 × $4.60/h = $9.20/h"
            in out)
    assert "recommended AZ: us-east-2a (" in out and "; 2 × $4.60/h = $9.20/h on demand" in out


def test_a_type_without_a_catalog_price_says_how_to_ask_aws(capsys):
    from trainlift.cli import capacity as cli

    cli._print(assess(facts()), None)
    assert ("  price    no catalog price for g6.12xlarge in us-east-2 "
            "(`trainlift price g6.12xlarge --region us-east-2 --live` asks AWS)") in capsys.readouterr().out


def test_the_json_price_fields():
    from trainlift import catalog
    from trainlift.cli import capacity as cli

    assert cli._price_fields(catalog.on_demand_price("p5.48xlarge", "us-east-1")) == {
        "usd_per_hour": 55.04, "price_source": "karpenter-2026-02-09", "price_as_of": "2026-12-06"}
    assert cli._price_fields(None) == {"usd_per_hour": None, "price_source": None, "price_as_of": None}
