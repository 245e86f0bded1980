"""Helm charts pinned by the digests their publishers list, checked by `cluster up` before anything is installed.

No chart repository or registry is reachable here. The publishers' listings are recorded below as their files have
them: aws/eks-charts' gh-pages index.yaml entry for the EFA device plugin (generated 2026-08-03, commit c7f9ea56), and
the two lines Helm's registry client prints as it pulls an OCI chart (helm pkg/registry/client.go, Pull: "Pulled: %s",
"Digest: %s", written to stderr). `helm` is a small script on PATH that writes an archive and prints those lines
(tests/fake_helm.py); the observation runs the real subprocess path."""

from __future__ import annotations

import os
import runpy
import stat
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from trainlift import catalog
from trainlift.config.cluster import parse_cluster_spec
from trainlift.ops import charts
from trainlift.ops.lifecycle import observe_pins
from trainlift.ops.plan import Files, Observed, plan_up
from trainlift.render.helm import digest_line, install_commands, render_helm_releases

ROOT = Path(__file__).resolve().parents[2]
FAKE_HELM = runpy.run_path(str(ROOT / "tests" / "fake_helm.py"))
REFERENCE = yaml.safe_load((ROOT / "examples" / "cluster-reference.yaml").read_text())
EKS_CHARTS_ENTRY = """\
apiVersion: v1
appVersion: v0.5.20
created: '2026-08-03T22:57:26.17434684Z'
description: A Helm chart for EFA device plugin.
digest: 43b3d666f81a40b7f7ac88ee04a64954abaaa061b1e5f54dc7ce4beb3374e32a
home: https://github.com/aws/eks-charts
name: aws-efa-k8s-device-plugin
urls:
- https://aws.github.io/eks-charts/aws-efa-k8s-device-plugin-v0.5.30.tgz
version: v0.5.30
"""
MANIFEST = "sha256:" + "4d" * 32
HELM_OCI_OUTPUT = f"Pulled: registry.k8s.io/kueue/charts/kueue:0.19.2\\nDigest: {MANIFEST}\\n"


def spec(**versions):
    pins = {"nvidia-device-plugin": FAKE_HELM["digest"]("nvidia-device-plugin", "0.20.0")}
    return parse_cluster_spec({**REFERENCE, "versions": {**versions, "chart_digests": {
        **pins, **versions.pop("chart_digests", {})}}})


@pytest.fixture
def helm(tmp_path, monkeypatch):
    """A `helm` that pulls the fake archive and, for an OCI chart, prints what Helm prints."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "helm"
    script.write_text('#!/bin/sh\ncase "$2" in oci://*) printf "' + HELM_OCI_OUTPUT + '" >&2;; esac\n'
                      'case "$1" in version) echo "v3.16.2";; ' + FAKE_HELM["PULL"] + " esac\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path / "cluster"


def pins_step(cluster_spec, root: Path):
    seen = replace(Observed.nothing(), tools={t: t == "helm" for t in ("eksctl", "helm", "kubectl", "aws")})
    seen = replace(seen, **observe_pins(cluster_spec, seen, str(root)))
    [step] = [s for s in plan_up(cluster_spec, seen, {}, Files(str(root))).steps if s.key == "pins"]
    return step


def test_the_catalog_holds_the_digest_eks_charts_lists_and_says_where_it_looked_for_the_others():
    entry = yaml.safe_load(EKS_CHARTS_ENTRY)
    efa = catalog.chart("aws-efa-k8s-device-plugin")
    assert efa.digests[entry["version"]] == "sha256:" + entry["digest"]
    assert "aws/eks-charts" in efa.digest_source and entry["digest"] in efa.digest_source
    # Versions whose digest no checked copy of the publisher's listing held are pinned by version, saying so.
    for name, version in (("aws-efa-k8s-device-plugin", "v0.5.32"), ("kuberay-operator", "1.7.0"),
                          ("kueue", "0.19.2")):
        pin = catalog.chart(name)
        assert pin.version == version and version not in pin.digests
        assert f"pinned {version}" in pin.digest_source and "not found" in pin.digest_source
    releases = {r["name"]: r for r in render_helm_releases(parse_cluster_spec(REFERENCE))}
    assert "pinned by version only: trainlift knows no digest for it (looked up: ray-project/kuberay-helm, branch " \
        "gh-pages, index.yaml" in digest_line(releases["kuberay-operator"])


def test_the_efa_plugin_at_the_listed_version_is_checked_against_eks_charts_digest(helm):
    """The fake archive is not the published one: `cluster up` refuses it before anything is created."""
    step = pins_step(spec(efa_device_plugin="v0.5.30"), helm)
    assert step.action == "blocked"
    assert step.note == ("chart aws-efa-k8s-device-plugin v0.5.30 from https://aws.github.io/eks-charts is "
                         f"{FAKE_HELM['digest']('aws-efa-k8s-device-plugin', 'v0.5.30')}, not the sha256:43b3d666f81a"
                         "40b7f7ac88ee04a64954abaaa061b1e5f54dc7ce4beb3374e32a pinned by trainlift's catalog")
    assert "\n" not in step.note


def test_an_oci_chart_is_checked_by_the_manifest_digest_helm_prints(helm):
    good = pins_step(spec(chart_digests={"kueue": MANIFEST}), helm)
    assert good.action == "nothing" and "2 checked by digest" in good.observed
    other = "sha256:" + "0e" * 32
    bad = pins_step(spec(chart_digests={"kueue": other}), helm)
    assert bad.action == "blocked"
    assert bad.note == (f"chart kueue 0.19.2 from oci://registry.k8s.io/kueue/charts is {MANIFEST}, not the {other} "
                        "pinned by versions.chart_digests")


def test_the_manifest_digest_is_read_from_helms_output_and_the_archive_hash_kept_beside_it():
    assert charts.manifest_digest(HELM_OCI_OUTPUT.replace("\\n", "\n")) == MANIFEST
    assert charts.manifest_digest("Pulled: x\n") is None


def test_the_printed_commands_check_an_oci_chart_by_its_manifest_digest():
    [kueue] = [r for r in render_helm_releases(spec(chart_digests={"kueue": MANIFEST})) if r["name"] == "kueue"]
    pull, install = install_commands(kueue, "helm/kueue.values.yaml").splitlines()
    assert pull == ("helm pull oci://registry.k8s.io/kueue/charts/kueue --version 0.19.2 --destination charts 2>&1 "
                    f"| grep -Fx 'Digest: {MANIFEST}'")
    assert install.startswith("helm upgrade --install kueue charts/kueue-0.19.2.tgz")
