"""The `trainlift doctor` commands as a user runs them: JSON shapes and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

LOGS = Path(__file__).resolve().parents[1] / "fixtures" / "nccl_logs"
TRAINLIFT = os.path.join(os.path.dirname(sys.executable), "trainlift")


def trainlift(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([TRAINLIFT, *args], capture_output=True, text=True, timeout=120)


def test_doctor_json_has_every_fact_and_finding():
    proc = trainlift("doctor", "--json")
    report = json.loads(proc.stdout)
    assert proc.returncode == (0 if report["ok"] else 1), proc.stderr
    assert report["facts"]["python"] and "fi_info_efa" in report["facts"] and "env" in report["facts"]
    assert report["findings"] and all({"rule", "severity", "message", "fix"} <= set(f) for f in report["findings"])
    assert report["ok"] == all(f["severity"] != "error" for f in report["findings"])


def test_doctor_expecting_efa_on_a_machine_without_it_exits_1():
    proc = trainlift("doctor", "--expect-fabric", "efa", "--json")
    assert proc.returncode == 1
    assert any(f["rule"] == "efa_device" and f["severity"] == "error" for f in json.loads(proc.stdout)["findings"])


def test_doctor_says_when_the_mlflow_server_needs_credentials_this_machine_lacks(mlflow_auth_server):
    """Against a server that answers as MLflow behind authentication does (tests/conftest.py)."""
    url, token = mlflow_auth_server["url"], mlflow_auth_server["token"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    without = subprocess.run([TRAINLIFT, "doctor", "--json", "--mlflow-uri", url],
                             capture_output=True, text=True, timeout=120, env=env)
    finding = next(f for f in json.loads(without.stdout)["findings"] if f["rule"] == "mlflow_access")
    assert without.returncode == 1 and finding["severity"] == "error"
    assert "needs credentials (HTTP 401)" in finding["message"] and "run.mlflow_secret" in finding["fix"]

    with_token = subprocess.run([TRAINLIFT, "doctor", "--json"], capture_output=True, text=True, timeout=120,
                                env={**env, "MLFLOW_TRACKING_URI": url, "MLFLOW_TRACKING_TOKEN": token})
    report = json.loads(with_token.stdout)
    finding = next(f for f in report["findings"] if f["rule"] == "mlflow_access")
    assert finding["severity"] == "ok" and "MLFLOW_TRACKING_TOKEN" in finding["message"]
    assert token not in with_token.stdout + with_token.stderr
    assert report["facts"]["mlflow"]["status"] == 200


def test_doctor_refuses_an_mlflow_uri_with_credentials_in_it():
    proc = trainlift("doctor", "--mlflow-uri", "https://bob:pw@mlflow.example")
    assert proc.returncode == 2 and "--mlflow-uri: the URI holds credentials" in proc.stderr
    assert "pw@" not in proc.stderr + proc.stdout


def test_nccl_log_json_shape_and_expect():
    files = [str(LOGS / "efa_gdrdma_p4d.log"), str(LOGS / "socket_after_plugin_failure.log")]
    proc = trainlift("doctor", "nccl-log", *files, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["transport"] == "socket"
    assert [(f["transport"], f["gdrdma"]) for f in report["files"]] == [("efa", True), ("socket", False)]
    assert all(f["evidence"] for f in report["files"])
    assert trainlift("doctor", "nccl-log", files[0], "--expect", "efa").returncode == 0
    mismatch = trainlift("doctor", "nccl-log", *files, "--expect", "efa")
    assert mismatch.returncode == 1 and "expected efa" in mismatch.stdout


def test_nccl_log_reads_stdin():
    proc = subprocess.run([TRAINLIFT, "doctor", "nccl-log", "-", "--json"], input=(LOGS / "ib_gdrdma.log").read_text(),
                          capture_output=True, text=True, timeout=60)
    assert json.loads(proc.stdout)["transport"] == "ib"


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    unreadable = trainlift("doctor", "nccl-log", str(tmp_path / "missing.log"))
    assert unreadable.returncode == 2 and "cannot read" in unreadable.stderr and "Traceback" not in unreadable.stderr
    unknown = trainlift("doctor", "fabric", "--instance-type", "g9.huge")
    assert unknown.returncode == 2 and "g9.huge" in unknown.stderr and "not in the hardware catalog" in unknown.stderr
    sizes = trainlift("doctor", "fabric", "--sizes", "1X")
    assert sizes.returncode == 2 and "--sizes" in sizes.stderr
    choice = trainlift("doctor", "--expect-fabric", "carrier-pigeon")
    assert choice.returncode == 2


def test_nccl_log_table_prints_log_lines_as_written(tmp_path):
    """Evidence lines are log text, not Rich markup: `[send]` stays, and `:1234:` is not read as an emoji code."""
    line = "ip-10-0-0-1:1234:1234 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0"
    log = tmp_path / "run[1].log"
    log.write_text(line + "\n")
    proc = subprocess.run([TRAINLIFT, "doctor", "nccl-log", str(log)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "400"})
    assert proc.returncode == 0, proc.stderr
    assert line in proc.stdout and "run[1].log: socket" in proc.stdout
