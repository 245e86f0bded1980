"""A URI's user:password@ is never shown (command lines, errors, job listings) and never shipped: `submit --env`,
`--pip`, `--set` and every job-spec field refuse it in one line that names where it was and keeps the value out."""

from __future__ import annotations

import sys

import pytest

from trainlift.cli import main
from trainlift.ops.run import CommandFailed, check, display, redact

PASSWORD = "plantedpw"
URI = f"https://alice:{PASSWORD}@mlflow.example:5000"


def run_cli(argv: list[str], capsys) -> tuple[int, list[str], str]:
    """The console script in-process: exit code, the non-empty lines of stderr, stdout."""
    saved = sys.argv
    sys.argv = ["trainlift", *argv]
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = saved
    out, err = capsys.readouterr()
    return code, [line for line in err.splitlines() if line.strip()], out


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "job.yaml").write_text("model: {path: m}\ndata: {train: t.jsonl}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return tmp_path


@pytest.mark.parametrize("cmd, shown", [
    (["git", "clone", URI + "/repo.git"], ["git", "clone", "https://***@mlflow.example:5000/repo.git"]),
    (["tool", f"--tracking-uri={URI}"], ["tool", "--tracking-uri=https://***@mlflow.example:5000"]),
    (["tool", "--set", f"run.mlflow_uri={URI}"], ["tool", "--set", "run.mlflow_uri=https://***@mlflow.example:5000"]),
    (["env", f"MLFLOW_TRACKING_URI={URI}", "python"], ["env", "MLFLOW_TRACKING_URI=https://***@mlflow.example:5000",
                                                        "python"]),
    (["pip", "install", "git+https://ghp_tok@github.com/o/r.git"],
     ["pip", "install", "git+https://***@github.com/o/r.git"]),
    (["curl", "https://alice:p@ss@host/x"], ["curl", "https://***@host/x"]),
    (["pip", "install", "x @ git+ssh://git@github.com/o/r.git", URI, "https://host/a?to=b@c"],
     ["pip", "install", "x @ git+ssh://git@github.com/o/r.git", "https://***@mlflow.example:5000",
      "https://host/a?to=b@c"]),
])
def test_every_token_of_a_shown_command_loses_its_uri_credentials(cmd, shown):
    assert redact(cmd) == shown
    assert PASSWORD not in display(cmd) and "ghp_tok" not in display(cmd) and "p@ss" not in display(cmd)


def test_a_failed_command_that_echoes_a_credentialed_uri_is_reported_without_it():
    script = f"import sys; sys.stderr.write('fatal: could not read from {URI}/repo'); sys.exit(1)"
    with pytest.raises(CommandFailed) as failed:
        check([sys.executable, "-c", script], timeout=30, attempts=1)
    assert PASSWORD not in failed.value.one_line()
    assert "could not read from https://***@mlflow.example:5000/repo" in failed.value.one_line()


def test_job_listings_show_entrypoints_without_uri_credentials():
    from ray.job_submission import JobDetails, JobStatus

    from trainlift.ops.jobs import job_row

    info = JobDetails(type="SUBMISSION", submission_id="j1", status=JobStatus.RUNNING,
                      entrypoint=f"python -m trainlift train job.yaml --set run.mlflow_uri={URI}")
    assert job_row(info)["entrypoint"] == ("python -m trainlift train job.yaml --set "
                                           "run.mlflow_uri=https://***@mlflow.example:5000")


@pytest.mark.parametrize("args, where", [
    (["--env", f"MLFLOW_TRACKING_URI={URI}"], "--env MLFLOW_TRACKING_URI"),
    (["--env", "TRACKING"], "--env TRACKING"),
    (["--pip", "x @ git+https://ghp_plantedpw@github.com/o/r.git"], "--pip"),
    (["--set", "run.trackers=[mlflow]", "--set", f"run.mlflow_uri={URI}"], "run.mlflow_uri"),
    (["--set", f"data.train={URI}/train.jsonl"], "data.train"),
    (["--set", f"runtime.pip=['x @ git+https://u:{PASSWORD}@github.com/o/r.git']"], "runtime.pip[0]"),
])
def test_submit_refuses_a_credentialed_uri_in_one_line_naming_where_and_the_fix(project, capsys, monkeypatch, args,
                                                                                 where):
    monkeypatch.setenv("TRACKING", URI)
    code, errors, out = run_cli(["submit", "job.yaml", "--address", "http://127.0.0.1:9", *args], capsys)
    assert code == 2 and len(errors) == 1, errors
    assert f"{where}: the URI holds credentials" in errors[0]
    assert "Kubernetes Secret" in errors[0] and "MLFLOW_TRACKING_USERNAME" in errors[0]
    assert PASSWORD not in errors[0] + out
    assert "cannot reach" not in errors[0]  # refused before any connection


def test_a_spec_file_field_with_a_credentialed_uri_is_refused_by_train_too(project, capsys):
    (project / "job.yaml").write_text(f"model: {{path: m}}\ndata: {{train: t.jsonl}}\n"
                                      f"run: {{trackers: [mlflow], mlflow_uri: '{URI}'}}\n")
    code, errors, out = run_cli(["train", "job.yaml"], capsys)
    assert code == 2 and len(errors) == 1 and "run.mlflow_uri: the URI holds credentials" in errors[0]
    assert PASSWORD not in errors[0] + out


def test_the_tracking_uri_from_the_environment_is_refused_before_it_is_shipped_to_the_workers(tmp_path, monkeypatch):
    from trainlift.config.job import validate_job_spec
    from trainlift.errors import UsageError
    from trainlift.train.run import trackers

    monkeypatch.setenv("MLFLOW_TRACKING_URI", URI)
    spec = validate_job_spec({"model": {"path": "m"}, "data": {"train": "t.jsonl"},
                              "run": {"storage": str(tmp_path), "trackers": ["mlflow"]}})
    with pytest.raises(UsageError, match="MLFLOW_TRACKING_URI: the URI holds credentials") as refused:
        trackers.check(spec)
    assert PASSWORD not in refused.value.one_line()
