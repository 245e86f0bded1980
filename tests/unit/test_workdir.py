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


def ray_py_modules_upload(runtime_env: dict, scratch) -> list[str]:
    """The names in what Ray's job client uploads for py_modules: Ray's own walk over the runtime_env, and Ray's own
    packaging of a directory entry (with the runtime_env's `excludes` and the parent folder, as the job SDK does)."""
    import zipfile

    from ray._private.runtime_env.packaging import create_package
    from ray._private.runtime_env.py_modules import upload_py_modules_if_needed

    names: list[str] = []

    def upload_fn(module_path, excludes, is_file=False):
        archive = module_path
        if not is_file:
            archive = scratch / f"module{len(names)}.zip"
            create_package(module_path, archive, include_gitignore=True, include_parent_dir=True, excludes=excludes)
        names.extend(zipfile.ZipFile(archive).namelist())

    upload_py_modules_if_needed(dict(runtime_env), include_gitignore=True, upload_fn=upload_fn)
    return names


def test_trainlift_ships_whole_whatever_the_projects_gitignore_says(project, tmp_path_factory):
    """A project that ignores *.yaml still ships trainlift with its catalog: Ray applies `excludes` to py_modules
    directories too, so trainlift must not travel as a directory under the project's patterns."""
    from trainlift.ops import jobs

    (project / ".gitignore").write_text("*.yaml\n*.json\ncatalog/\n")
    plan = workdir.scan(project)
    assert "*.yaml" in plan.excludes
    env = jobs.runtime_env(project, plan.excludes, [], {})
    shipped = ray_py_modules_upload(env, tmp_path_factory.mktemp("upload"))
    assert "trainlift/catalog/platform.yaml" in shipped
    assert "trainlift/render/schemas/eksctl-v0.230.0-clusterconfig.schema.json" in shipped
