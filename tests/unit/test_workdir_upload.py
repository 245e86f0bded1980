"""What `submit` uploads as the job's working_dir: never a credential file, not what git ignores unless asked, and
`submit --dry-run` shows both lists (with the reason each file stays behind) without contacting a cluster. What
it lists is what Ray's own packaging of the directory puts in the upload."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile

import pytest
from typer.testing import CliRunner

from trainlift.cli import app, main
from trainlift.ops import workdir

CREDENTIAL_FILES = [
    ".git-credentials", ".pypirc", ".npmrc", ".netrc", ".huggingface/token", "home/.huggingface/hub/token",
    ".cache/huggingface/token", "cache/.cache/huggingface/stored/token",
    ".config/gcloud/application_default_credentials.json", "gcp/application_default_credentials.json",
    ".dockercfg", ".docker/config.json", "ci/.docker/config.json", ".boto", "certs/client.p12", "certs/client.pfx",
    "certs/server.pem", "certs/server.key", "id_rsa", "id_rsa.pub", "keys/id_ed25519", ".ssh/id_ecdsa",
    "credentials.json", "sa/credentials.json", ".aws/credentials", "infra/prod.tfstate", "infra/terraform.tfstate",
    "infra/terraform.tfstate.backup", ".env", ".env.production", "app/.env",
]
PLAIN_FILES = ["train.py", "job.yaml", "data/train.jsonl", "src/pkg/model.py", "configs/token_budget.yaml"]


def write(root, rel: str, text: str = "x") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def git(root, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


@pytest.fixture
def project(tmp_path, monkeypatch):
    for rel in PLAIN_FILES + CREDENTIAL_FILES:
        write(tmp_path, rel)
    write(tmp_path, "job.yaml", "model: {path: m}\ndata: {train: data/train.jsonl}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return tmp_path


def dry_run(*args: str) -> dict:
    result = CliRunner().invoke(app, ["submit", "job.yaml", "--address", "http://127.0.0.1:9", "--dry-run", "--json",
                                      *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def why_left_out(report: dict, rel: str) -> str | None:
    """The reason for `rel`, or for the directory holding it that was left out whole."""
    reasons = {entry["path"]: entry["reason"] for entry in report["left_out"]}
    parts = rel.split("/")
    for i in range(1, len(parts) + 1):
        held = "/".join(parts[:i]) + ("" if i == len(parts) else "/")
        if held in reasons:
            return reasons[held]
    return None


def ray_upload(root, excludes: list[str], include_gitignore: bool, scratch) -> set[str]:
    """The file names in the package Ray's job client builds from the directory with these runtime_env excludes."""
    from ray._private.runtime_env.packaging import create_package

    archive = scratch / "working_dir.zip"
    create_package(str(root), archive, include_gitignore=include_gitignore, excludes=excludes)
    return {name for name in zipfile.ZipFile(archive).namelist() if not name.endswith("/")}


@pytest.mark.parametrize("flags", [[], ["--include-ignored"]])
def test_every_credential_file_is_listed_as_left_out_and_never_uploaded(project, flags, tmp_path_factory):
    report = dry_run(*flags)
    listed = {entry["path"] for entry in report["files"]}
    for rel in CREDENTIAL_FILES:
        assert (why_left_out(report, rel) or "").startswith("credential file"), rel
    assert set(PLAIN_FILES) <= listed
    uploaded = ray_upload(project, report["excludes"], not flags, tmp_path_factory.mktemp("z"))
    assert uploaded == listed and not uploaded & set(CREDENTIAL_FILES)


@pytest.fixture
def repo(project):
    """The project as a git work tree: ignored through .gitignore files, .git/info/exclude, and one tracked file."""
    git(project, "init", "-q")
    write(project, ".gitignore", "outputs/\n*.log\n")
    write(project, "src/.gitignore", "generated.py\n")
    write(project, ".git/info/exclude", "scratch.ipynb\n")
    for rel in ("outputs/model.safetensors", "train.log", "src/generated.py", "scratch.ipynb", "src/pkg/notes.log"):
        write(project, rel)
    git(project, "add", "train.py")
    return project


IGNORED = {"outputs/", "train.log", "src/generated.py", "scratch.ipynb", "src/pkg/notes.log"}


def test_what_git_ignores_stays_behind_and_is_listed_as_gitignored(repo, tmp_path_factory):
    report = dry_run()
    uploaded = {entry["path"] for entry in report["files"]}
    reasons = {entry["path"]: entry["reason"] for entry in report["left_out"]}
    assert {rel: reasons.get(rel) for rel in IGNORED} == {rel: "gitignored" for rel in IGNORED}
    assert not any(path.startswith(".git/") for path in uploaded) and reasons[".git/"].startswith("excluded")
    assert {"train.py", "src/pkg/model.py", ".gitignore"} <= uploaded
    plan = workdir.scan(repo)  # only .git/info/exclude is unknown to Ray: it travels as an anchored exclude
    assert ray_upload(repo, plan.excludes, True, tmp_path_factory.mktemp("z")) == uploaded


def test_include_ignored_uploads_what_git_ignores_but_never_credentials(repo, tmp_path_factory):
    from ray._private.ray_constants import RAY_RUNTIME_ENV_IGNORE_GITIGNORE

    report = dry_run("--include-ignored")
    uploaded = {entry["path"] for entry in report["files"]}
    assert {"outputs/model.safetensors", "train.log", "src/generated.py", "scratch.ipynb"} <= uploaded
    assert not uploaded & set(CREDENTIAL_FILES)
    plan = workdir.scan(repo, include_ignored=True)
    with workdir.uploading(plan):  # as submit uploads: Ray's job client then leaves .gitignore files to trainlift
        include_gitignore = os.environ.get(RAY_RUNTIME_ENV_IGNORE_GITIGNORE) != "1"
    assert ray_upload(repo, plan.excludes, include_gitignore, tmp_path_factory.mktemp("z")) == uploaded


def test_dry_run_lists_both_sides_in_text_and_exits_0_without_a_cluster(repo, capsys):
    saved = sys.argv
    sys.argv = ["trainlift", "submit", "job.yaml", "--address", "http://127.0.0.1:9", "--dry-run"]
    try:
        with pytest.raises(SystemExit) as exited:
            main()
    finally:
        sys.argv = saved
    out, err = capsys.readouterr()
    assert exited.value.code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("would upload ") and any(line.split()[0] == "train.py" for line in lines)
    listed = {line.split()[0]: " ".join(line.split()[1:]) for line in lines if line.startswith("  ")}
    assert listed["train.log"] == "gitignored" and listed[".env"] == "credential file (.env)"
    assert "cannot reach" not in err


def test_dry_run_of_an_oversized_directory_lists_it_then_refuses_in_one_line(project, capsys):
    with open(project / "data" / "huge.bin", "wb") as f:
        f.truncate(workdir.DEFAULT_LIMIT_BYTES + 1)  # sparse: large on paper, nothing on disk
    saved = sys.argv
    sys.argv = ["trainlift", "submit", "job.yaml", "--dry-run"]
    try:
        with pytest.raises(SystemExit) as exited:
            main()
    finally:
        sys.argv = saved
    out, err = capsys.readouterr()
    # The listing counts per top-level folder (data/ with its 100 MiB); the refusal names the file.
    assert exited.value.code == 2 and re.search(r"^  data/\s+\d+ files, 100\.0 MiB", out, re.M), out
    errors = [line for line in err.splitlines() if line.strip()]
    assert len(errors) == 1 and "upload limit; largest files: data/huge.bin" in errors[0]
