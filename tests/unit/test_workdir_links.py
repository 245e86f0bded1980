"""What `submit` uploads is what `submit --dry-run` lists, links included, and no credential travels: each
credential file name of the deny list stays behind (file by file, at the top and in a folder), a link travels as
Ray's packaging follows it (a folder's link as its contents), a link to a credential file stays behind with it, and
a link that would carry something from outside the project (~/.aws/credentials) or go round a loop is refused in
one line. Ray's own packaging of the directory is the reference for what travels."""

from __future__ import annotations

import zipfile

import pytest

from trainlift.errors import UsageError
from trainlift.ops import workdir

DENIED = [".envrc", ".pgpass", ".s3cfg", "kubeconfig", "sa-key.json", "terraform.tfvars", ".databrickscfg",
          "rclone.conf", ".my.cnf", "prod.auto.tfvars", "kubeconfig.yaml", "gcp-sa-key.json"]


def write(root, rel: str, text: str = "x") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def project(tmp_path):
    root = tmp_path / "project"
    for rel in ("train.py", "job.yaml", "shared/data/train.jsonl", ".env"):
        write(root, rel)
    return root


def ray_upload(root, excludes: list[str], scratch) -> set[str]:
    """The file names in the package Ray's job client builds from the directory with these runtime_env excludes."""
    from ray._private.runtime_env.packaging import create_package

    archive = scratch / "working_dir.zip"
    create_package(str(root), archive, include_gitignore=True, excludes=excludes)
    return {name for name in zipfile.ZipFile(archive).namelist() if not name.endswith("/")}


def listed_and_uploaded(root, scratch) -> tuple[set[str], set[str], dict[str, str]]:
    plan = workdir.scan(root)
    return {p for p, _ in plan.files}, ray_upload(root, plan.excludes, scratch), dict(plan.left_out)


@pytest.mark.parametrize("name", DENIED)
@pytest.mark.parametrize("folder", ["", "infra/"])
def test_each_credential_file_of_the_deny_list_stays_behind(project, tmp_path_factory, name, folder):
    write(project, folder + name, "secret")
    listed, uploaded, left_out = listed_and_uploaded(project, tmp_path_factory.mktemp("z"))
    assert left_out[folder + name].startswith(workdir.CREDENTIAL)
    assert folder + name not in uploaded and listed == uploaded


def test_a_linked_folder_is_listed_as_ray_uploads_it(project, tmp_path_factory):
    (project / "data").symlink_to(project / "shared" / "data")
    listed, uploaded, _ = listed_and_uploaded(project, tmp_path_factory.mktemp("z"))
    assert "data/train.jsonl" in listed and listed == uploaded


def test_a_link_to_a_credential_file_of_the_project_stays_behind_with_it(project, tmp_path_factory):
    (project / "settings.txt").symlink_to(project / ".env")
    listed, uploaded, left_out = listed_and_uploaded(project, tmp_path_factory.mktemp("z"))
    assert left_out["settings.txt"].startswith(f"{workdir.CREDENTIAL} (link to .env")
    assert "settings.txt" not in uploaded and listed == uploaded


def test_a_broken_link_is_listed_as_left_out(project, tmp_path_factory):
    (project / "gone.txt").symlink_to(project / "nowhere.txt")
    listed, uploaded, left_out = listed_and_uploaded(project, tmp_path_factory.mktemp("z"))
    assert left_out["gone.txt"] == workdir.BROKEN_LINK and listed == uploaded


@pytest.mark.parametrize("name", ["creds", "notes/aws.txt"])
def test_a_link_to_the_users_aws_credentials_is_refused(project, tmp_path, name):
    credentials = tmp_path / "home" / ".aws" / "credentials"
    write(credentials.parent, credentials.name, "[default]\naws_secret_access_key = x\n")
    (project / name).parent.mkdir(parents=True, exist_ok=True)
    (project / name).symlink_to(credentials)
    with pytest.raises(UsageError) as refused:
        workdir.scan(project)
    line = refused.value.one_line()
    assert line.startswith(f"{name} is a link to {credentials}, outside {project}") and "--exclude" in line


def test_a_linked_folder_outside_the_project_is_refused(project, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (project / "data").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UsageError, match=rf"^data is a link to {tmp_path / 'elsewhere'}, outside"):
        workdir.scan(project)


@pytest.mark.parametrize("links", [{"shared/loop": ".."}, {"a/to_b": "b", "b/to_a": "a"}])
def test_a_link_round_a_loop_is_refused(project, links):
    for rel, target in links.items():
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / target).mkdir(exist_ok=True)
        (project / rel).symlink_to(project / target if target != ".." else project)
    with pytest.raises(UsageError, match=r"a folder holding it: Ray would go round it forever"):
        workdir.scan(project)


def test_an_excluded_link_out_of_the_project_is_left_out_not_refused(project, tmp_path, tmp_path_factory):
    (tmp_path / "elsewhere").mkdir()
    (project / "data").symlink_to(tmp_path / "elsewhere")
    plan = workdir.scan(project, extra_excludes=["data"])
    assert dict(plan.left_out)["data/"].startswith("excluded")
