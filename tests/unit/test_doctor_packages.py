"""`doctor --job`: the job's packages beyond trainlift's core, named to every node's probe and judged per node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainlift.config.job import validate_job_spec
from trainlift.doctor.nodes import NodeProbe
from trainlift.doctor.packages import (
    ENV_VAR,
    JobPackages,
    WantedPackage,
    from_env,
    job_package_findings,
    job_packages,
    packages_line,
)
from trainlift.doctor.probe import Facts, installed_version, probe

REPO = Path(__file__).resolve().parents[2]
PEFT = WantedPackage("peft", "model.lora", "0.21.2", "peft")
TENSORBOARD = WantedPackage("tensorboard", "run.trackers: tensorboard", "2.21.0", "tensorboard")
NOT_REAL = "not-a-real-package-xyz"


def lora_spec(tmp_path: Path, **sections) -> dict:
    return {"model": {"path": str(tmp_path / "model"), "lora": {"r": 8}},
            "data": {"train": str(tmp_path / "train.jsonl")}, **sections}


# --- the rule, on hand-made facts


def test_a_missing_package_before_the_job_is_a_warning_naming_it_its_field_and_the_fix():
    [found] = job_package_findings(Facts(job_packages={"peft": None}), JobPackages((PEFT,)))
    assert (found.rule, found.severity, found.node) == ("job_packages", "warning", None)
    assert "peft" in found.message and "model.lora" in found.message
    assert found.fix == ("the job's runtime_env must install peft==0.21.2: render/submit add it; on an air-gapped "
                         "cluster, bake it into the image or set PIP_INDEX_URL to a mirror")


def test_a_missing_package_inside_the_job_is_an_error_labelled_with_its_node():
    facts = Facts(job_packages={"peft": None, "tensorboard": "2.21.0"})
    found = job_package_findings(facts, JobPackages((PEFT, TENSORBOARD), in_job=True), node="10.0.0.2/abcd1234")
    assert [(f.severity, f.node) for f in found] == [("error", "10.0.0.2/abcd1234")]
    assert "peft" in found[0].message and "job's environment" in found[0].message


def test_packages_in_place_give_no_finding_whatever_their_local_label():
    facts = Facts(job_packages={"peft": "0.21.2+local", "tensorboard": "2.21.0", "extra": "1.0"})
    wanted = JobPackages((PEFT, TENSORBOARD, WantedPackage("extra", "runtime.pip")), in_job=True)
    assert job_package_findings(facts, wanted) == []


def test_another_release_than_pinned_is_a_warning_naming_both_versions():
    [found] = job_package_findings(Facts(job_packages={"peft": "0.20.0"}), JobPackages((PEFT,), in_job=True))
    assert found.severity == "warning" and "0.20.0" in found.message and "0.21.2" in found.message
    assert "peft==0.20.0" in found.fix


def test_a_package_the_probe_was_not_asked_about_is_not_judged():
    assert job_package_findings(Facts(), JobPackages((PEFT,))) == []


def test_the_table_cell_says_missing_or_the_version():
    assert packages_line({"peft": None, "tensorboard": "2.21.0"}) == "peft missing, tensorboard 2.21.0"


# --- the request: from the spec, through the environment


def test_the_spec_asks_for_its_features_packages_then_its_runtime_pip_lines(tmp_path):
    spec = validate_job_spec(lora_spec(tmp_path, run={"trackers": ["mlflow"]},
                                       runtime={"pip": [f"{NOT_REAL}==1.0", "PEFT==0.20.0", "Liger_Kernel"]}))
    wanted = job_packages(spec).packages
    assert [(p.name, p.needed_by, p.version, p.module) for p in wanted] == [
        ("peft", "model.lora", "0.21.2", "peft"),
        ("mlflow-skinny", "run.trackers: mlflow", "3.18.0", "mlflow"),
        (NOT_REAL, "runtime.pip", "1.0", None),
        ("liger-kernel", "runtime.pip", None, None),
    ]


def test_a_spec_without_extra_packages_sets_no_variable(tmp_path):
    spec = validate_job_spec({"model": {"path": str(tmp_path)}, "data": {"train": str(tmp_path / "t.jsonl")}})
    assert job_packages(spec).env() == {}


def test_the_request_survives_the_environment_and_a_malformed_one_is_a_value_error():
    wanted = JobPackages((PEFT, WantedPackage(NOT_REAL, "runtime.pip")), in_job=True)
    assert from_env(wanted.env()) == wanted
    assert from_env({}) == JobPackages()
    with pytest.raises(ValueError, match=ENV_VAR):
        from_env({ENV_VAR: '[{"name": "peft"}]'})


# --- the probe, on this virtualenv


def test_installed_version_finds_what_is_here_and_not_what_is_not():
    assert installed_version("peft", "peft") and installed_version("tensorboard", "tensorboard")
    assert installed_version("mlflow-skinny", "mlflow")
    assert installed_version(NOT_REAL) is None and installed_version(NOT_REAL, "not_a_real_module") is None
    assert installed_version("peft", "not_a_real_module") is None  # metadata without its module is missing
    assert installed_version("", None) is None


def test_the_probe_records_each_named_package_and_never_raises(monkeypatch):
    wanted = JobPackages((PEFT, TENSORBOARD, WantedPackage(NOT_REAL, "runtime.pip", "1.0")))
    monkeypatch.setenv(ENV_VAR, wanted.env()[ENV_VAR])
    facts = probe()
    assert facts.job_packages == {"peft": installed_version("peft"), "tensorboard": installed_version("tensorboard"),
                                  NOT_REAL: None}
    assert Facts.from_dict(json.loads(json.dumps(facts.to_dict()))).job_packages == facts.job_packages
    monkeypatch.setenv(ENV_VAR, "not json")
    broken = probe()
    assert broken.job_packages == {} and any(ENV_VAR in note for note in broken.notes)


# --- the CLI


def test_every_node_of_a_cluster_gets_its_own_labelled_finding(monkeypatch):
    from trainlift.cli import doctor as cli
    from trainlift.doctor import nodes

    probed = [NodeProbe("10.0.0.1/aaaa (head)", "a", "10.0.0.1", True, Facts(job_packages={"peft": "0.21.2"})),
              NodeProbe("10.0.0.2/bbbb", "b", "10.0.0.2", False, Facts(job_packages={"peft": None}))]
    monkeypatch.setattr(nodes, "connect", lambda *args, **kwargs: None)
    monkeypatch.setattr(nodes, "probe_nodes", lambda: probed)
    monkeypatch.setenv(ENV_VAR, JobPackages((PEFT,), in_job=True).env()[ENV_VAR])
    report = cli._probe_cluster("auto", "any", {})
    found = [f for f in report["findings"] if f["rule"] == "job_packages"]
    assert [(f["node"], f["severity"]) for f in found] == [("10.0.0.2/bbbb", "error")] and not report["ok"]


def run_doctor(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k not in (ENV_VAR, "MLFLOW_TRACKING_URI")}, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "trainlift", "doctor", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=120)


def test_doctor_job_reports_each_package_and_names_the_missing_one(tmp_path):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(lora_spec(tmp_path, runtime={"pip": [f"{NOT_REAL}==1.0"]})))
    proc = run_doctor("--job", "job.yaml", "--json", cwd=tmp_path)
    report = json.loads(proc.stdout)
    assert proc.returncode == (0 if report["ok"] else 1), proc.stderr
    assert report["facts"]["job_packages"] == {"peft": installed_version("peft"), NOT_REAL: None}
    [found] = [f for f in report["findings"] if f["rule"] == "job_packages"]
    assert found["severity"] == "warning" and NOT_REAL in found["message"] and f"{NOT_REAL}==1.0" in found["fix"]

    table = run_doctor("--job", "job.yaml", cwd=tmp_path)
    assert f"{NOT_REAL} missing" in " ".join(table.stdout.split())


def test_doctor_refuses_a_bad_job_spec_in_one_line(tmp_path):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(lora_spec(tmp_path, runtime={"pip": ["not a requirement!"]})))
    proc = run_doctor("--job", "job.yaml", cwd=tmp_path)
    assert proc.returncode == 2 and "runtime.pip" in proc.stderr and "Traceback" not in proc.stderr
    assert run_doctor("--job", "missing.yaml", cwd=tmp_path).returncode == 2
