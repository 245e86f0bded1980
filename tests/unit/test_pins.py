"""Pins are checked before anything billable: `cluster up` pulls each pinned chart version and asks each tool for
its version, and blocks the plan (nothing is created) on a missing chart, a chart archive whose digest is not the
pinned one, or a tool below its floor.

No Helm repository or registry is reachable here: `helm`, `kubectl` and `eksctl` are small scripts on PATH that
print what the real tools print (recorded output: `helm version --short`, `kubectl version --client -o json`,
`eksctl version`, and Helm's errors for a chart version missing from an HTTP repository and from an OCI registry);
their `helm pull` writes a small archive of known digest (tests/fake_helm.py). The observation runs the real
subprocess path."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import replace
from pathlib import Path

import runpy

import pytest
import yaml

from trainlift.config.cluster import parse_cluster_spec
from trainlift.ops.lifecycle import observe_pins
from trainlift.ops.pins import tool_version
from trainlift.ops.plan import Files, Observed, plan_up

ROOT = Path(__file__).resolve().parents[2]
FAKE_HELM = runpy.run_path(str(ROOT / "tests" / "fake_helm.py"))
REFERENCE = yaml.safe_load((ROOT / "examples" / "cluster-reference.yaml").read_text())
CATALOG_SPEC = parse_cluster_spec(REFERENCE)
# The fake archive cannot have the catalog's digest for the NVIDIA chart: the spec pins the fake's instead.
SPEC = parse_cluster_spec({**REFERENCE, "versions": {"chart_digests": {
    "nvidia-device-plugin": FAKE_HELM["digest"]("nvidia-device-plugin", "0.20.0")}}})
KUBECTL_1_34 = json.dumps({"clientVersion": {"major": "1", "minor": "34", "gitVersion": "v1.34.1",
                                             "platform": "linux/amd64"}, "kustomizeVersion": "v5.7.1"})
EFA_MISSING = ('Error: chart "aws-efa-k8s-device-plugin" version "v0.5.32" not found in '
               "https://aws.github.io/eks-charts repository")
KUEUE_MISSING = "Error: registry.k8s.io/kueue/charts/kueue:0.19.2: not found"


def tool(bin_dir: Path, name: str, script: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def tools_on_path(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir


def found(*names: str) -> Observed:
    return replace(Observed.nothing(), tools={t: t in names for t in ("eksctl", "helm", "kubectl", "aws")})


def pins(seen: Observed, spec=SPEC):
    plan = plan_up(spec, seen, {}, Files(".trainlift/ray-train"))
    [step] = [s for s in plan.steps if s.key == "pins"]
    assert [s.key for s in plan.steps][:2] == ["tools", "pins"]  # before the control plane and any node group
    return step


def test_every_pin_found_and_new_enough_tools_let_the_plan_go_on(tools_on_path, tmp_path):
    tool(tools_on_path, "helm", 'case "$1" in version) echo "v3.16.2+g13654a5";; ' + FAKE_HELM["PULL"] + ' esac\n')
    tool(tools_on_path, "kubectl", "echo '" + KUBECTL_1_34.replace("v1.34.1", "v1.36.0") + "'\n")
    tool(tools_on_path, "eksctl", 'echo "0.231.0"\n')
    seen = found("eksctl", "helm", "kubectl", "aws")
    seen = replace(seen, **observe_pins(SPEC, seen, str(tmp_path)))
    assert seen.tool_versions == {"helm": "3.16.2", "eksctl": "0.231.0", "kubectl": "1.36.0"}
    assert seen.charts == {"kuberay-operator": "", "nvidia-device-plugin": "", "aws-efa-k8s-device-plugin": "",
                           "kueue": ""}
    step = pins(seen)
    assert step.action == "nothing" and "4 of 4 chart versions found, 1 checked by digest" in step.observed


def test_a_chart_version_the_repository_lacks_blocks_the_plan_with_helms_words(tools_on_path, tmp_path):
    tool(tools_on_path, "helm", 'case "$*" in *aws-efa*) echo \'' + EFA_MISSING + '\' >&2; exit 1;;\n'
         '  *kueue*) echo \'' + KUEUE_MISSING + '\' >&2; exit 1;; esac\n'
         'case "$1" in version) echo "v3.16.2";; ' + FAKE_HELM["PULL"] + ' esac\n')
    seen = found("helm")
    seen = replace(seen, **observe_pins(SPEC, seen, str(tmp_path)))
    step = pins(seen)
    assert step.action == "blocked"
    assert ("chart aws-efa-k8s-device-plugin v0.5.32 not found in https://aws.github.io/eks-charts: " + EFA_MISSING
            ) in step.note
    assert "chart kueue 0.19.2 not found in oci://registry.k8s.io/kueue/charts" in step.note
    assert "pin a aws-efa-k8s-device-plugin version that exists" in step.fix


def test_an_unreachable_repository_blocks_instead_of_failing_after_the_nodes_exist(tools_on_path, tmp_path):
    tool(tools_on_path, "helm", 'case "$1" in version) echo "v3.16.2";; pull) echo \'Error: looks like '
         '"https://aws.github.io/eks-charts" is not a valid chart repository or cannot be reached: dial tcp: lookup '
         "aws.github.io: no such host' >&2; exit 1;; esac\n")
    seen = found("helm")
    seen = replace(seen, **observe_pins(SPEC, seen, str(tmp_path)))
    step = pins(seen)
    assert step.action == "blocked" and "could not ask for the pinned charts" in step.note


def test_tools_older_than_their_floor_block_the_plan(tools_on_path, tmp_path):
    tool(tools_on_path, "helm", 'case "$1" in version) echo "v3.7.2+g663a896";; ' + FAKE_HELM["PULL"] + ' esac\n')
    tool(tools_on_path, "kubectl", "echo '" + KUBECTL_1_34 + "'\n")
    seen = found("helm", "kubectl")
    step = pins(replace(seen, **observe_pins(SPEC, seen, str(tmp_path))))
    assert step.action == "blocked"
    assert "helm 3.7.2 is older than 3.8.0: OCI charts (Kueue's, from oci://registry.k8s.io) need Helm 3.8.0" in step.note
    assert "kubectl 1.34.1 is older than 1.35.0" in step.note and "(Kubernetes 1.36)" in step.note
    assert "upgrade helm to 3.8.0 or later" in step.fix


def test_version_outputs_are_read_as_each_tool_prints_them():
    assert tool_version("helm", "v3.16.2+g13654a5\n") == "3.16.2"
    assert tool_version("eksctl", "0.230.0\n") == "0.230.0"
    assert tool_version("kubectl", KUBECTL_1_34) == "1.34.1"
    assert tool_version("kubectl", "not json") is None


def test_a_chart_re_released_under_its_pinned_version_is_refused_before_anything_is_created(
        tools_on_path, tmp_path, monkeypatch):
    tool(tools_on_path, "helm", 'case "$1" in version) echo "v3.16.2";; ' + FAKE_HELM["PULL"] + ' esac\n')
    seen = found("helm")
    first = replace(seen, **observe_pins(SPEC, seen, str(tmp_path)))
    assert pins(first).action == "nothing"
    recorded = json.loads((tmp_path / "charts" / "digests.json").read_text())
    assert recorded == {"aws-efa-k8s-device-plugin@v0.5.32": FAKE_HELM["digest"]("aws-efa-k8s-device-plugin", "v0.5.32"),
                        "kuberay-operator@1.7.0": FAKE_HELM["digest"]("kuberay-operator", "1.7.0"),
                        "kueue@0.19.2": FAKE_HELM["digest"]("kueue", "0.19.2")}
    assert (tmp_path / "charts" / "kueue-0.19.2.tgz").read_text() == "chart kueue 0.19.2"
    assert [p.name for p in (tmp_path / "charts").iterdir() if p.name.startswith(".")] == []

    again = replace(seen, **observe_pins(SPEC, seen, str(tmp_path)))
    assert "4 of 4 chart versions found, 4 checked by digest" in pins(again).observed

    monkeypatch.setenv("FAKE_CHART_CHANGE", " re-released")
    changed = pins(replace(seen, **observe_pins(SPEC, seen, str(tmp_path))))
    assert changed.action == "blocked"
    assert (f"chart kuberay-operator 1.7.0 from https://ray-project.github.io/kuberay-helm/ is "
            f"{FAKE_HELM['digest']('kuberay-operator', '1.7.0', ' re-released')}, not the "
            f"{FAKE_HELM['digest']('kuberay-operator', '1.7.0')} pinned by charts/digests.json, recorded when first "
            "pulled") in changed.note
    assert "chart nvidia-device-plugin 0.20.0" in changed.note and "pinned by versions.chart_digests" in changed.note
    assert "pin its new digest in versions.chart_digests" in changed.fix


def test_the_catalogs_digest_for_a_pinned_chart_is_checked(tools_on_path, tmp_path):
    tool(tools_on_path, "helm", 'case "$1" in version) echo "v3.16.2";; ' + FAKE_HELM["PULL"] + ' esac\n')
    seen = found("helm")
    step = pins(replace(seen, **observe_pins(CATALOG_SPEC, seen, str(tmp_path))), CATALOG_SPEC)
    assert step.action == "blocked"
    assert (f"chart nvidia-device-plugin 0.20.0 from https://nvidia.github.io/k8s-device-plugin is "
            f"{FAKE_HELM['digest']('nvidia-device-plugin', '0.20.0')}, not the sha256:9e5642bcdd3805c6e931f9d3ca542677d1"
            "f714d68c14c1364892011e67d9a606 pinned by trainlift's catalog") in step.note


def test_helm_installs_the_archive_the_pins_step_checked():
    plan = plan_up(SPEC, Observed.nothing(), {}, Files(".trainlift/ray-train"))
    [install] = [c for s in plan.steps if s.key == "helm/nvidia-device-plugin" for o in s.ops
                 for c in [" ".join(o.argv)] if "upgrade" in c]
    assert install.startswith("helm upgrade --install nvidia-device-plugin "
                              ".trainlift/ray-train/charts/nvidia-device-plugin-0.20.0.tgz --namespace kube-system")
    assert "--repo" not in install and "--version" not in install
