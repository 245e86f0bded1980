"""What travels as the job's working_dir: exclusions, credentials held back, the size limit."""

import pytest

from trainlift.errors import UsageError
from trainlift.ops import workdir


@pytest.fixture
def project(tmp_path):
    for rel, size in {"train.py": 10, "data/train.jsonl": 100, ".git/objects/ab": 50, ".venv/bin/python": 50,
                      "runs/r1/metrics.jsonl": 50, "src/pkg/__pycache__/m.pyc": 5, "big/model.bin": 3000,
                      "notes.tmp": 7, ".env": 3, "keys/server.pem": 3}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)
    (tmp_path / ".gitignore").write_text("*.tmp\n")
    return tmp_path


def test_vcs_venv_caches_runs_and_gitignored_files_stay_behind(project):
    plan = workdir.scan(project)
    names = {name for name, _ in plan.files}
    assert names == {"train.py", "data/train.jsonl", "big/model.bin", ".gitignore"}
    assert ".git/" in plan.excludes and "*.tmp" in plan.excludes


def test_credential_like_files_are_held_back_and_reported(project):
    plan = workdir.scan(project)
    assert sorted(plan.credentials) == [".env", "keys/server.pem"]
    assert "*.pem" in plan.excludes and ".env" in plan.excludes


def test_oversized_directory_is_refused_naming_the_largest_files(project):
    plan = workdir.scan(project)
    with pytest.raises(UsageError, match=r"over the 0 MiB upload limit; largest files: big/model.bin"):
        workdir.check_size(plan, limit_bytes=1000)
    workdir.check_size(plan, limit_bytes=10_000)


def test_extra_excludes_apply(project):
    names = {name for name, _ in workdir.scan(project, ["big/"]).files}
    assert "big/model.bin" not in names
