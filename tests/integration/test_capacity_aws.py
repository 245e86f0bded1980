"""The capacity finder against a real AWS-API-compatible server (moto) over HTTP."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
from typer.testing import CliRunner

from trainlift.cli import app
from trainlift.cloud.aws import Aws
from trainlift.cloud.capacity import assess

h = runpy.run_path(str(Path(__file__).with_name("conftest_aws.py")))["load"]()  # the session's moto server


@pytest.fixture
def aws_env(tmp_path, monkeypatch):
    yield h.use(monkeypatch, tmp_path)
    h.reject_credentials(False)


def _server_truth(region: str, instance_type: str) -> tuple[list[str], dict]:
    ec2 = boto3.client("ec2", region_name=region)
    offers = ec2.describe_instance_type_offerings(
        LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": [instance_type]}])
    info = ec2.describe_instance_types(InstanceTypes=[instance_type])["InstanceTypes"][0]
    return sorted(o["Location"] for o in offers["InstanceTypeOfferings"]), info


@pytest.mark.parametrize("instance_type, gpus, model, efa", [
    ("g6.12xlarge", 4, "NVIDIA L4", 1),
    ("p5.48xlarge", 8, "NVIDIA H100", 32),
])
def test_capacity_matches_the_servers_offerings_and_instance_data(aws_env, instance_type, gpus, model, efa):
    offered, info = _server_truth("us-east-2", instance_type)
    report = assess(Aws("us-east-2").capacity(instance_type, 2))
    facts = report.facts
    assert facts.offered == offered and offered
    assert facts.info.vcpus == info["VCpuInfo"]["DefaultVCpus"]
    assert (facts.info.gpus, facts.info.gpu_model, facts.info.efa_interfaces) == (gpus, model, efa)
    assert facts.info.efa_supported is info["NetworkInfo"]["EfaSupported"] is True
    assert report.needed_vcpus == 2 * facts.info.vcpus
    assert report.ok and report.recommended == offered[0]


def test_apis_the_server_lacks_are_unknown_not_fatal(aws_env):
    report = assess(Aws("us-east-2").capacity("g6.12xlarge", 2))
    assert report.facts.quota.code == "L-DB2E81BA"
    assert "NoSuchResourceException" in report.unknown["quota_vcpus"]
    assert "DescribeCapacityReservations" in report.unknown["reservations"]
    assert "GetSpotPlacementScores" in report.unknown["spot_scores"]
    assert report.free_vcpus is None and report.ok


def test_vcpus_in_use_count_only_the_quota_family(aws_env):
    ec2 = boto3.client("ec2", region_name="eu-west-1")
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    ec2.run_instances(ImageId=image, InstanceType="g6.xlarge", MinCount=2, MaxCount=2)
    ec2.run_instances(ImageId=image, InstanceType="m7i.large", MinCount=1, MaxCount=1)
    facts = Aws("eu-west-1").capacity("g6.12xlarge", 2)
    assert facts.vcpus_in_use == 8
    assert Aws("eu-west-1").capacity("m7i.xlarge", 1).vcpus_in_use == 2


def test_capacity_cli_json(aws_env):
    result = CliRunner().invoke(app, ["capacity", "p5.48xlarge", "--region", "us-east-2", "--count", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["instance"]["gpus"] == 8 and data["instance"]["efa_interfaces"] == 32
    assert data["recommended_zone"] == "us-east-2a" and data["quota"]["code"] == "L-417A185B"
    assert data["offered_zones"] == ["us-east-2a", "us-east-2b", "us-east-2c"]
    assert (data["usd_per_hour"], data["price_source"], data["price_as_of"]) == (None, None, None)


def test_capacity_cli_prints_the_catalog_price(aws_env):
    result = CliRunner().invoke(app, ["capacity", "g6.12xlarge", "--region", "us-east-2", "--count", "2"])
    assert result.exit_code == 0, result.output
    assert "price    $4.60/h on demand (skypilot-before-2025-06, checked 2026-12-06); 2 × $4.60/h = $9.20/h" in (
        result.stdout)
    assert "recommended AZ: us-east-2a" in result.stdout and "2 × $4.60/h = $9.20/h on demand" in result.stdout


def _cli(args: list[str], env: dict[str, str], drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in h.CLEARED and k not in drop}
    full = {**base, **{k: v for k, v in env.items() if k not in drop}}
    return subprocess.run([sys.executable, "-m", "trainlift", *args], env=full, capture_output=True, text=True,
                          timeout=60)


def _one_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert result.stdout == ""
    return lines[0]


def test_unknown_region_is_one_line(aws_env):
    result = _cli(["capacity", "g6.12xlarge", "--region", "mars-east-1"], aws_env)
    assert result.returncode == 2 and "unknown AWS region 'mars-east-1'" in _one_line(result)


def test_unknown_instance_type_is_one_line(aws_env):
    result = _cli(["capacity", "g6.bogus", "--region", "us-east-2"], aws_env)
    assert result.returncode == 2 and "instance type 'g6.bogus' does not exist in us-east-2" in _one_line(result)


def test_missing_credentials_is_one_line(aws_env):
    result = _cli(["capacity", "g6.12xlarge", "--region", "us-east-2"], aws_env,
                  drop=("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"))
    assert result.returncode == 1 and "no AWS credentials found" in _one_line(result)


def test_rejected_credentials_is_one_line(aws_env):
    h.reject_credentials(True)
    result = _cli(["capacity", "g6.12xlarge", "--region", "us-east-2"], aws_env)
    line = _one_line(result)
    assert result.returncode == 1 and "AWS rejected the credentials (InvalidClientTokenId" in line
    assert "testing" not in line


def test_region_comes_from_aws_region_when_not_given(aws_env):
    result = _cli(["capacity", "p5.48xlarge", "--json"], {**aws_env, "AWS_REGION": "us-east-2"})
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["region"] == "us-east-2" and data["offered_zones"] == ["us-east-2a", "us-east-2b", "us-east-2c"]


def test_no_region_anywhere_is_one_line(aws_env):
    result = _cli(["capacity", "p5.48xlarge"], aws_env)
    assert result.returncode == 2 and "no AWS region" in _one_line(result)
