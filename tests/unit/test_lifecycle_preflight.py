"""`cluster up` checks tools, credentials and required Secrets before the first step that costs money.

Planning is pure; the apply tests replace the one subprocess chokepoint and assert it was never reached.
"""

from __future__ import annotations

import json
import runpy
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from trainlift.cli import app
from trainlift.cloud.aws import CredentialsError
from trainlift.config.cluster import cluster_spec_from_yaml
from trainlift.errors import TrainliftError
from trainlift.ops import apply_plan, lifecycle
from trainlift.ops.placement import Placement
from trainlift.ops.plan import Files, Observed, plan_up

REPO = Path(__file__).resolve().parents[2]
FAKE_HELM = runpy.run_path(str(REPO / "tests" / "fake_helm.py"))
SPEC_DATA = FAKE_HELM["with_fake_chart_digests"](yaml.safe_load((REPO / "examples" / "cluster-reference.yaml").read_text()))
SPEC = cluster_spec_from_yaml(yaml.safe_dump(SPEC_DATA))
FILES = Files(".trainlift/ray-train", raycluster_hash="h1")
PLACED = {"gpu-workers": Placement("gpu-workers", "us-east-2a", "pinned in the spec; offered there")}
ALL_TOOLS = {"eksctl": True, "helm": True, "kubectl": True, "aws": True}


def _keys(plan) -> list[str]:
    return [s.key for s in plan.steps]


def test_a_missing_tool_blocks_the_plan_before_anything_is_created():
    seen = replace(Observed.nothing(), tools=dict(ALL_TOOLS, helm=False))
    plan = plan_up(SPEC, seen, PLACED, FILES)
    [blocked] = plan.blocked
    assert blocked.key == "tools" and _keys(plan)[0] == "tools"
    assert blocked.observed == "not found: helm" and "https://helm.sh/docs/intro/install/" in blocked.fix
    assert "eksctl, helm, kubectl, aws" in blocked.title


def test_every_tool_present_does_not_block():
    plan = plan_up(SPEC, replace(Observed.nothing(), tools=ALL_TOOLS), PLACED, FILES)
    assert not plan.blocked and plan.steps[0].observed == "all found"


def test_apply_runs_nothing_when_a_tool_is_missing(monkeypatch, tmp_path):
    ran: list[list[str]] = []
    monkeypatch.setattr(apply_plan, "check", lambda argv, *a, **k: ran.append(argv))
    seen = replace(Observed.nothing(), tools=dict(ALL_TOOLS, helm=False))
    plan = plan_up(SPEC, seen, PLACED, FILES)
    prepared = lifecycle.Prepared(SPEC, seen, {}, PLACED, Files(str(tmp_path)), [], aws=None)  # type: ignore[arg-type]
    with pytest.raises(TrainliftError, match="helm"):
        apply_plan.apply(prepared, plan, echo=lambda line: None)
    assert ran == []


def test_a_required_secret_is_waited_for_before_any_node_group():
    spec = SPEC.model_copy(update={"secrets": [SPEC.secrets[0].model_copy(update={"optional": False})]})
    keys = _keys(plan_up(spec, Observed.nothing(), PLACED, FILES))
    assert keys.index("control-plane") < keys.index("namespace") < keys.index("secret/hf-token")
    assert keys.index("secret/hf-token") < min(keys.index("nodegroup/system-nodes"), keys.index("nodegroup/gpu-workers"))


@pytest.fixture
def tools_on_path(tmp_path, monkeypatch):
    """Stand-ins for eksctl, helm, kubectl and aws: a dry run only looks them up and pulls the pinned charts
    (tests/fake_helm.py), it runs nothing else."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ALL_TOOLS:
        (bin_dir / tool).write_text("#!/bin/sh\n" + ('case "$1" in ' + FAKE_HELM["PULL"] + " esac\n" if tool == "helm"
                                                    else "") + "exit 0\n")
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))


class _NoCredentials:
    region = "us-east-2"

    def identity(self):
        raise CredentialsError("no AWS credentials found", hint="set AWS_PROFILE")


def test_a_dry_run_without_credentials_plans_a_new_cluster_and_says_so(tmp_path, tools_on_path):
    prepared = lifecycle.prepare(SPEC, str(tmp_path), aws=_NoCredentials(), need_credentials=False)  # type: ignore[arg-type]
    plan = plan_up(prepared.spec, prepared.seen, prepared.placements, prepared.files)
    assert not plan.blocked
    control = next(s for s in plan.steps if s.key == "control-plane")
    assert control.action == "create" and control.observed == "not looked up, planned as absent"
    assert prepared.seen.assumed == "not looked up: no AWS credentials found"
    assert (tmp_path / "eksctl.yaml").exists() and (tmp_path / "k8s" / "20-raycluster.yaml").exists()
    with pytest.raises(TrainliftError, match="without observing"):
        apply_plan.apply(prepared, plan, echo=lambda line: None)


def test_without_a_dry_run_missing_credentials_stop_everything(tmp_path):
    with pytest.raises(CredentialsError):
        lifecycle.prepare(SPEC, str(tmp_path), aws=_NoCredentials())  # type: ignore[arg-type]


def test_cli_dry_run_without_credentials(monkeypatch, tmp_path, tools_on_path):
    """The real boto3 credential chain, emptied: no keys, no profile, no config, no instance metadata."""
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
                "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    out = tmp_path / "out"
    spec_file = tmp_path / "cluster.yaml"
    spec_file.write_text(yaml.safe_dump(SPEC_DATA))
    result = CliRunner().invoke(app, ["cluster", "up", str(spec_file), "--dry-run", "--dir", str(out)])
    assert result.exit_code == 0, result.output
    assert "not looked up: no AWS credentials found" in result.stdout
    assert f"eksctl create cluster -f {out}/eksctl.yaml --without-nodegroup" in result.stdout
    assert yaml.safe_load((out / "eksctl.yaml").read_text())["metadata"]["name"] == "ray-train"
    assert "cost  system-nodes: 1 × m7i.xlarge × $0.2016/h = $0.2016/h" in result.stdout
    assert "cost  gpu-workers: 2 × g6.12xlarge × $4.60/h = $9.20/h" in result.stdout
    assert ("cost  total: $9.40/h (catalog on-demand prices for us-east-2: skypilot-before-2025-06, checked "
            "2026-12-06; --live not used)") in result.stdout
    assert result.stdout.index("cost  total") > result.stdout.index("eksctl create cluster")
    json_result = CliRunner().invoke(app, ["cluster", "up", str(spec_file), "--dry-run", "--json", "--dir", str(out)])
    assert json_result.exit_code == 0, json_result.output
    cost = json.loads(json_result.stdout)["cost"]
    assert cost["total_usd_per_hour"] == 9.4048 and cost["unknown"] == []
    assert [(g["group"], g["count"], g["usd_per_hour"]) for g in cost["groups"]] == [
        ("system-nodes", 1, 0.2016), ("gpu-workers", 2, 9.2032)]
