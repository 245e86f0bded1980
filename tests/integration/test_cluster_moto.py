"""`trainlift cluster up | status | down` against a moto server: dry runs change nothing, state is
observed through the EKS API, a run that fails part way is continued by the next one.

eksctl is replaced by a small script that makes the same EKS calls against the server (tagging the
cluster with the ClusterConfig's metadata.tags, as eksctl does). Like eksctl it keeps a CloudFormation
stack per node group, leaves it behind when the create fails, skips a group whose stack exists and
deletes the stack with the group (moto cannot roll a stack back: what it leaves is CREATE_COMPLETE).
helm and kubectl are stand-ins that cannot reach a Kubernetes API server, so their observations are
unknown and applying stops at helm.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import boto3
import pytest
import yaml
from typer.testing import CliRunner

from trainlift.cli import app
from trainlift.errors import TrainliftError
from trainlift.ops.run import CommandFailed

h = runpy.run_path(str(Path(__file__).with_name("conftest_aws.py")))["load"]()  # the session's moto server
ROOT = Path(__file__).resolve().parents[2]
FAKE_HELM_PULL = runpy.run_path(str(ROOT / "tests" / "fake_helm.py"))
# The reference cluster, its catalog-pinned charts pinned instead to what the stand-in `helm pull` writes.
REFERENCE = Path(tempfile.mkdtemp(prefix="trainlift-test-spec-")) / "cluster-reference.yaml"
REFERENCE.write_text(yaml.safe_dump(FAKE_HELM_PULL["with_fake_chart_digests"](
    yaml.safe_load((ROOT / "examples" / "cluster-reference.yaml").read_text()))))

FAKE_EKSCTL = '''#!{python}
"""eksctl stand-in: the EKS calls eksctl would make, against the test server."""
import os, sys, boto3, yaml
args = sys.argv[1:]
def opt(name):
    return args[args.index(name) + 1] if name in args else None
if args == ["version"]:
    sys.exit(print("0.230.0"))
log = os.environ.get("FAKE_EKSCTL_LOG")
if log:
    open(log, "a").write(" ".join(args) + "\\n")
verb = " ".join(args[:2])
if verb in ("create cluster", "create nodegroup"):
    cfg = yaml.safe_load(open(opt("-f")))
    meta = cfg["metadata"]
    eks, ec2 = (boto3.client(s, region_name=meta["region"]) for s in ("eks", "ec2"))
    vpc = ec2.describe_vpcs()["Vpcs"][0]["VpcId"]
    def subnet(az):
        found = ec2.describe_subnets(Filters=[{{"Name": "availability-zone", "Values": [az]}}])["Subnets"]
        return found[0]["SubnetId"]
    if verb == "create cluster":
        eks.create_cluster(name=meta["name"], version=meta["version"], roleArn="arn:aws:iam::123456789012:role/eks",
                           resourcesVpcConfig={{"subnetIds": [subnet(z) for z in cfg["availabilityZones"]]}},
                           tags=meta.get("tags", {{}}))
    else:
        name = opt("--include")
        cfn = boto3.client("cloudformation", region_name=meta["region"])
        stack = "eksctl-" + meta["name"] + "-nodegroup-" + name
        if any(s["StackName"] == stack and s["StackStatus"] != "DELETE_COMPLETE"
               for s in cfn.list_stacks()["StackSummaries"]):
            sys.stderr.write("1 existing nodegroup(s) (" + name + ") will be excluded\\n")
            sys.exit(0)
        cfn.create_stack(StackName=stack, TemplateBody='{{"Resources": {{"T": {{"Type": "AWS::SNS::Topic"}}}}}}',
                         Tags=[{{"Key": "alpha.eksctl.io/nodegroup-name", "Value": name}}])
        if os.environ.get("FAKE_EKSCTL_FAIL") == name:
            sys.stderr.write("Error: waiting for nodegroup: AsgInstanceLaunchFailures: "
                             "InsufficientInstanceCapacity in " + name + "\\n")
            sys.exit(1)
        ng = next(g for g in cfg["managedNodeGroups"] if g["name"] == name)
        zones = ng.get("availabilityZones") or cfg["availabilityZones"][:1]
        eks.create_nodegroup(clusterName=meta["name"], nodegroupName=name, instanceTypes=[ng["instanceType"]],
                             subnets=[subnet(z) for z in zones], nodeRole="arn:aws:iam::123456789012:role/node",
                             scalingConfig={{"minSize": ng["minSize"], "maxSize": ng["maxSize"],
                                            "desiredSize": ng["desiredCapacity"]}})
elif verb == "delete nodegroup":
    eks, cfn = (boto3.client(s, region_name=opt("--region")) for s in ("eks", "cloudformation"))
    if opt("--name") in eks.list_nodegroups(clusterName=opt("--cluster"))["nodegroups"]:
        eks.delete_nodegroup(clusterName=opt("--cluster"), nodegroupName=opt("--name"))
    cfn.delete_stack(StackName="eksctl-" + opt("--cluster") + "-nodegroup-" + opt("--name"))
elif verb == "delete cluster":
    eks, cfn = (boto3.client(s, region_name=opt("--region")) for s in ("eks", "cloudformation"))
    if opt("--name") in eks.list_clusters()["clusters"]:
        eks.delete_cluster(name=opt("--name"))
    cfn.delete_stack(StackName="eksctl-" + opt("--name") + "-cluster")
else:
    sys.exit("unexpected eksctl call: " + " ".join(args))
'''


@pytest.fixture
def aws_env(tmp_path, monkeypatch):
    yield h.use(monkeypatch, tmp_path)
    h.reject_credentials(False)


def _world(region: str) -> dict:
    """Everything in the server that costs money or is created by a cluster."""
    eks, ec2 = boto3.client("eks", region_name=region), boto3.client("ec2", region_name=region)
    cfn = boto3.client("cloudformation", region_name=region)
    return {
        "clusters": eks.list_clusters()["clusters"],
        "instances": [i for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]],
        "stacks": cfn.list_stacks()["StackSummaries"],
        "vpcs": sorted(v["VpcId"] for v in ec2.describe_vpcs()["Vpcs"]),
    }


def _spec_in(tmp_path: Path, region: str) -> Path:
    data = yaml.safe_load(REFERENCE.read_text())
    data.update(region=region, availability_zones=[f"{region}a", f"{region}b"])
    data["workers"][0]["availability_zones"] = [f"{region}a"]
    path = tmp_path / f"cluster-{region}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _cli(args: list[str], env: dict[str, str], tools: Path, extra: dict[str, str] | None = None,
         drop: tuple[str, ...] = ()):
    base = {k: v for k, v in os.environ.items() if k not in h.CLEARED and k not in drop}
    env = {k: v for k, v in env.items() if k not in drop}
    path = os.pathsep.join([str(tools), str(Path(sys.executable).parent)])
    return subprocess.run([sys.executable, "-m", "trainlift", *args], capture_output=True, text=True, timeout=120,
                          env={**base, **env, **(extra or {}), "PATH": path})


# kubectl and helm without a reachable API server: every read fails; kubectl's writes are accepted.
# Versions and chart pulls need no API server: they answer as the real tools do when every pin exists (the pulled
# archive is a stand-in of known digest, tests/fake_helm.py).
FAKE_KUBECTL = """#!/bin/sh
case " $* " in *" version "*) echo '{"clientVersion": {"gitVersion": "v1.36.0"}}'; exit 0;; esac
case " $* " in *" get "*) echo 'error: You must be logged in to the server (Unauthorized)' >&2; exit 1;; esac
exit 0
"""
FAKE_HELM = """#!/bin/sh
case "$1 $2" in "version --short") echo 'v3.16.2+g13654a5'; exit 0;; esac
case "$1" in """ + FAKE_HELM_PULL["PULL"] + """ esac
echo 'Error: Kubernetes cluster unreachable: the server has asked for the client to provide credentials' >&2
exit 1
"""


def _tool_dir(path: Path, scripts: dict[str, str]) -> Path:
    path.mkdir()
    for name, text in scripts.items():
        (path / name).write_text(text)
        (path / name).chmod(0o755)
    return path


@pytest.fixture
def tools(tmp_path) -> Path:
    """A PATH directory with the eksctl, kubectl, helm and aws stand-ins."""
    return _tool_dir(tmp_path / "bin", {"eksctl": FAKE_EKSCTL.format(python=sys.executable), "kubectl": FAKE_KUBECTL,
                                        "helm": FAKE_HELM, "aws": "#!/bin/sh\nexit 0\n"})


@pytest.fixture
def on_path(tools, monkeypatch) -> Path:
    monkeypatch.setenv("PATH", os.pathsep.join([str(tools), str(Path(sys.executable).parent)]))
    return tools


def test_dry_run_prints_the_full_plan_and_changes_nothing(aws_env, tmp_path, on_path):
    before = _world("us-east-2")
    out_dir = tmp_path / "out"
    result = CliRunner().invoke(app, ["cluster", "up", str(REFERENCE), "--dry-run", "--dir", str(out_dir)])
    assert result.exit_code == 0, result.output
    text = result.stdout
    for expected in (
        "capacity  gpu-workers: us-east-2a (pinned in the spec; offered there)",
        f"eksctl create cluster -f {out_dir}/eksctl.yaml --without-nodegroup",
        f"eksctl create nodegroup -f {out_dir}/eksctl.yaml --include system-nodes --install-nvidia-plugin=false",
        f"eksctl create nodegroup -f {out_dir}/eksctl.yaml --include gpu-workers --install-nvidia-plugin=false",
        "helm upgrade --install nvidia-device-plugin", "helm upgrade --install aws-efa-k8s-device-plugin",
        "helm upgrade --install kuberay-operator",
        f"apply --server-side --field-manager=trainlift -f {out_dir}/k8s/20-raycluster.yaml",
        "wait until head-ready", "wait until workers-running=2", "wait until nodes/gpu-workers",
        "trainlift doctor --address http://127.0.0.1:18265 --expect-fabric efa",
        "cost  gpu-workers: 2 × g6.12xlarge × $4.60/h = $9.20/h",
        "cost  total: $9.40/h (catalog on-demand prices for us-east-2",
    ):
        assert expected in text, expected
    assert _world("us-east-2") == before and before["clusters"] == [] and before["instances"] == []
    rendered = yaml.safe_load((out_dir / "k8s" / "20-raycluster.yaml").read_text())
    assert rendered["metadata"]["annotations"]["trainlift.io/spec-sha256"]
    eksctl_cfg = yaml.safe_load((out_dir / "eksctl.yaml").read_text())
    assert eksctl_cfg["managedNodeGroups"][1]["availabilityZones"] == ["us-east-2a"]
    assert eksctl_cfg["metadata"]["tags"] == {"trainlift.io/cluster": "ray-train"}


def test_dry_run_json_and_an_unpinned_group_gets_the_recommended_az(aws_env, tmp_path, on_path):
    data = yaml.safe_load(REFERENCE.read_text())
    data["availability_zones"] = []
    data["workers"][0]["availability_zones"] = []
    spec = tmp_path / "unpinned.yaml"
    spec.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, ["cluster", "up", str(spec), "--dry-run", "--json", "--dir", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["blocked"] is False and plan["verb"] == "up"
    assert plan["cost"]["total_usd_per_hour"] == 9.4048 and plan["cost"]["groups"][1]["usd_per_hour_each"] == 4.6016
    group = next(s for s in plan["steps"] if s["key"] == "nodegroup/gpu-workers")
    assert "AZ us-east-2a: offered in 3 AZs" in group["observed"]
    cfg = yaml.safe_load((tmp_path / "o" / "eksctl.yaml").read_text())
    assert cfg["availabilityZones"] == ["us-east-2a", "us-east-2b"]


def _subnets(region: str) -> None:
    ec2 = boto3.client("ec2", region_name=region)
    vpc = ec2.describe_vpcs()["Vpcs"][0]["VpcId"]
    for i, az in enumerate((f"{region}a", f"{region}b")):
        ec2.create_subnet(VpcId=vpc, CidrBlock=f"172.31.{200 + i}.0/24", AvailabilityZone=az)


def test_up_with_a_tool_missing_creates_nothing(aws_env, tmp_path, tools, monkeypatch):
    (tools / "helm").unlink()
    monkeypatch.setenv("PATH", os.pathsep.join([str(tools), str(Path(sys.executable).parent)]))
    spec = str(_spec_in(tmp_path, "us-west-2"))
    _subnets("us-west-2")
    before = _world("us-west-2")
    result = CliRunner().invoke(app, ["cluster", "up", spec, "--yes", "--dir", str(tmp_path / "state")])
    assert result.exit_code == 1 and isinstance(result.exception, TrainliftError)
    assert "blocked at command-line tools" in result.exception.one_line() and "helm" in result.exception.one_line()
    assert _world("us-west-2") == before and before["clusters"] == []


def test_failed_up_is_continued_by_the_next_run(aws_env, tmp_path, on_path, monkeypatch):
    spec, out = str(_spec_in(tmp_path, "us-west-2")), str(tmp_path / "state")
    _subnets("us-west-2")
    log = tmp_path / "eksctl.log"
    monkeypatch.setenv("FAKE_EKSCTL_LOG", str(log))
    monkeypatch.setenv("FAKE_EKSCTL_FAIL", "gpu-workers")
    eks = boto3.client("eks", region_name="us-west-2")

    def cli(*args: str):
        return CliRunner().invoke(app, ["cluster", *args, spec, "--dir", out])

    first = cli("up", "--yes")
    assert first.exit_code == 1 and isinstance(first.exception, CommandFailed)
    message = first.exception.one_line()
    assert f"`eksctl create nodegroup -f {out}/eksctl.yaml --include gpu-workers --install-nvidia-plugin=false` exited 1" in message
    assert "InsufficientInstanceCapacity" in message

    status = cli("status", "--json")
    assert status.exit_code == 0, status.output
    plan = {s["key"]: s for s in json.loads(status.stdout)["steps"]}
    assert plan["ownership"]["observed"] == "tagged"
    assert plan["control-plane"]["action"] == "nothing" and plan["nodegroup/system-nodes"]["action"] == "nothing"
    group = plan["nodegroup/gpu-workers"]
    assert group["action"] == "create"
    # The stack the failed create left would make eksctl skip the group: it is deleted first.
    assert "absent; stack eksctl-ray-train-nodegroup-gpu-workers CREATE_COMPLETE" in group["observed"]
    assert group["commands"] == [
        "eksctl delete nodegroup --cluster ray-train --region us-west-2 --name gpu-workers --wait",
        f"eksctl create nodegroup -f {out}/eksctl.yaml --include gpu-workers --install-nvidia-plugin=false"]
    assert "Unauthorized" in plan["namespace"]["observed"]
    assert "Kubernetes cluster unreachable" in plan["helm/kuberay-operator"]["observed"]

    monkeypatch.delenv("FAKE_EKSCTL_FAIL")
    second = cli("up", "--yes")
    assert isinstance(second.exception, CommandFailed) and "Kubernetes cluster unreachable" in second.exception.message
    assert second.exception.result.cmd[:4] == ("helm", "upgrade", "--install", "nvidia-device-plugin")
    calls = [" ".join(c.split()[:2]) + " " + (c.split("--include ")[1].split()[0] if "--include" in c else "")
             for c in log.read_text().splitlines()]
    assert calls == ["create cluster ", "create nodegroup system-nodes", "create nodegroup gpu-workers",
                     "delete nodegroup ", "create nodegroup gpu-workers"]
    assert sorted(eks.list_nodegroups(clusterName="ray-train")["nodegroups"]) == ["gpu-workers", "system-nodes"]

    down = cli("down", "--yes")
    assert down.exit_code == 0, down.output
    assert "eksctl delete nodegroup --cluster ray-train --region us-west-2 --name gpu-workers --wait" in down.stdout
    assert eks.list_clusters()["clusters"] == []
    again = cli("down", "--yes")
    assert again.exit_code == 0 and "0 with work to do" in again.stdout


def test_down_deletes_only_a_cluster_trainlift_created(aws_env, tmp_path, on_path):
    _subnets("us-east-2")
    eks = boto3.client("eks", region_name="us-east-2")
    subnets = [s["SubnetId"] for s in boto3.client("ec2", region_name="us-east-2").describe_subnets()["Subnets"]][:2]
    eks.create_cluster(name="ray-train", roleArn="arn:aws:iam::123456789012:role/eks",
                       resourcesVpcConfig={"subnetIds": subnets}, tags={"team": "search"})
    args = ["cluster", "down", str(REFERENCE), "--yes", "--dir", str(tmp_path / "o")]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 1 and "pass --force to delete it anyway" in refused.exception.one_line()
    assert eks.list_clusters()["clusters"] == ["ray-train"]
    forced = CliRunner().invoke(app, [*args, "--force"])
    assert forced.exit_code == 0, forced.output
    assert eks.list_clusters()["clusters"] == []


def test_a_stack_left_by_a_failed_create_is_seen_and_deleted(aws_env, tmp_path, on_path):
    cfn = boto3.client("cloudformation", region_name="us-east-2")
    template = {"Resources": {"Topic": {"Type": "AWS::SNS::Topic"}}}
    cfn.create_stack(StackName="eksctl-ray-train-cluster", TemplateBody=json.dumps(template),
                     Tags=[{"Key": "trainlift.io/cluster", "Value": "ray-train"}])
    out = str(tmp_path / "o")
    up = CliRunner().invoke(app, ["cluster", "up", str(REFERENCE), "--dry-run", "--json", "--dir", out])
    control = next(s for s in json.loads(up.stdout)["steps"] if s["key"] == "control-plane")
    assert "stack eksctl-ray-train-cluster CREATE_COMPLETE" in control["observed"]
    assert control["commands"][0] == "eksctl delete cluster --name ray-train --region us-east-2 --wait"
    down = CliRunner().invoke(app, ["cluster", "down", str(REFERENCE), "--yes", "--dir", out])
    assert down.exit_code == 0, down.output
    assert [s["StackStatus"] for s in cfn.list_stacks()["StackSummaries"]] == ["DELETE_COMPLETE"]


def test_bad_input_is_one_line(aws_env, tmp_path, tools):
    data = yaml.safe_load(REFERENCE.read_text())
    data.update(region="xx-north-9", availability_zones=["xx-north-9a", "xx-north-9b"])
    data["workers"][0]["availability_zones"] = ["xx-north-9a"]
    spec = tmp_path / "bad-region.yaml"
    spec.write_text(yaml.safe_dump(data))
    result = _cli(["cluster", "up", str(spec), "--dry-run"], aws_env, tools)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "unknown AWS region 'xx-north-9'" in result.stderr
    result = _cli(["cluster", "status", str(REFERENCE)], aws_env, tools,
                  drop=("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"))
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "no AWS credentials found" in result.stderr
