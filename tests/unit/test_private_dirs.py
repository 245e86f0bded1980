"""The directories trainlift keeps per user (private_dir.py): $TRAINLIFT_HOME and what `local up` writes there, the
node's model cache and tokenize-once data cache. Each is created 0700 (files 0600); one that was there first and is
group- or world-writable, or another user's, is refused in one line naming the path, why and the fix, and its
contents are never read. Owning a directory as another user takes root (os.chown): run as anyone else, the cases
of a directory another user owns are skipped; the writable-by-others cases run for everyone."""

from __future__ import annotations

import json
import os
import stat
import tempfile

import pytest
import pyarrow.fs as pafs

from trainlift.errors import TrainliftError
from trainlift.home import trainlift_home
from trainlift.ops import localray
from trainlift.train.data import cache as datacache
from trainlift.train.model import fetch

OTHER_UID = 4242  # no user of this machine's: the planted directories' owner
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a directory to another user")


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def temp_root(tmp_path, monkeypatch):
    """The system's temporary directory, as every user of the machine shares it (1777)."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setenv("TMPDIR", str(shared))
    monkeypatch.setattr(tempfile, "tempdir", None)
    for name in (fetch.STAGING_ENV, fetch.CACHE_ENV):
        monkeypatch.delenv(name, raising=False)
    return shared


def planted_model(temp_root, path: str, owner: int | None = None, dir_mode: int = 0o755):
    """A complete-looking cache entry for `path`, made by someone before this user ran trainlift."""
    models = temp_root / f"trainlift-{os.geteuid()}" / "models"
    entry = models / fetch.cache_name(path)
    entry.mkdir(parents=True)
    (entry / "config.json").write_text(json.dumps({"model_type": "planted"}))
    (entry / fetch.MARKER).write_text("{}")
    for directory in (models.parent, models):
        directory.chmod(dir_mode)
        if owner is not None:
            os.chown(directory, owner, -1)
    return models


def test_the_state_directory_and_the_head_record_are_private(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINLIFT_HOME", str(tmp_path / "home"))
    assert mode(trainlift_home()) == 0o700
    localray.write_private(localray.state_file(), "{}")
    assert mode(localray.state_file()) == 0o600
    (tmp_path / "old-home").mkdir(mode=0o755)  # made by an earlier trainlift: closed, as it is this user's
    monkeypatch.setenv("TRAINLIFT_HOME", str(tmp_path / "old-home"))
    assert mode(trainlift_home()) == 0o700


def test_a_state_directory_others_may_write_is_refused(tmp_path, monkeypatch):
    shared = tmp_path / "shared-home"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("TRAINLIFT_HOME", str(shared))
    with pytest.raises(TrainliftError) as refused:
        trainlift_home()
    line = refused.value.one_line()
    assert f"{shared} is writable by users other than you (mode 0777)" in line
    assert "chmod go-w" in line and "TRAINLIFT_HOME" in line and "\n" not in line


def test_the_caches_in_the_temporary_directory_are_this_users_and_private(temp_root):
    models = fetch.cache_root()
    assert models == temp_root / f"trainlift-{os.geteuid()}" / "models"
    assert mode(models) == mode(models.parent) == 0o700
    assert fetch.cached_dir("Qwen/Qwen2.5-1.5B") is None

    storage = pafs.SubTreeFileSystem(str(temp_root.parent / "storage"), pafs.LocalFileSystem())
    assert datacache.local_copy(storage, "runs", "somekey") is None  # nothing on storage: nothing copied
    data = temp_root / f"trainlift-{os.geteuid()}" / "data-cache"
    assert mode(data) == 0o700


def test_the_staging_directory_and_the_explicit_cache_keep_their_places(tmp_path, monkeypatch):
    monkeypatch.delenv(fetch.CACHE_ENV, raising=False)
    monkeypatch.setenv(fetch.STAGING_ENV, str(tmp_path / "nvme"))
    (tmp_path / "nvme").mkdir(mode=0o777)  # a pod's emptyDir: world-writable, the models directory in it is not
    (tmp_path / "nvme").chmod(0o777)
    assert fetch.cache_root() == tmp_path / "nvme" / "models" and mode(tmp_path / "nvme" / "models") == 0o700
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "team-cache"))
    assert fetch.cache_root() == tmp_path / "team-cache"


def test_a_model_planted_where_anyone_may_create_it_is_not_taken_for_the_cache(temp_root):
    """`<tmp>/models/<name>`, the name every user's cache once had: anyone could make it first."""
    planted = temp_root / "models" / fetch.cache_name("Qwen/Qwen2.5-1.5B")
    planted.mkdir(parents=True)
    (planted / "config.json").write_text(json.dumps({"model_type": "planted"}))
    (planted / fetch.MARKER).write_text("{}")
    assert fetch.cached_dir("Qwen/Qwen2.5-1.5B") is None


def test_a_planted_model_others_may_write_is_refused_not_loaded(temp_root):
    models = planted_model(temp_root, "Qwen/Qwen2.5-1.5B", dir_mode=0o777)
    with pytest.raises(TrainliftError) as refused:
        fetch.cached_dir("Qwen/Qwen2.5-1.5B")
    line = refused.value.one_line()
    assert str(models.parent) in line and "mode 0777" in line and "TMPDIR" in line


@as_root
def test_a_planted_model_another_user_owns_is_refused_not_loaded(temp_root):
    models = planted_model(temp_root, "Qwen/Qwen2.5-1.5B", owner=OTHER_UID)
    with pytest.raises(TrainliftError) as refused:
        fetch.model_dir("Qwen/Qwen2.5-1.5B", weights=False)
    line = refused.value.one_line()
    assert f"{models.parent} is owned by uid {OTHER_UID}, not by you" in line
    assert "have its owner or root remove it" in line and "TMPDIR" in line


@as_root
def test_a_planted_data_cache_another_user_owns_is_refused(temp_root):
    data = temp_root / f"trainlift-{os.geteuid()}" / "data-cache"
    data.mkdir(parents=True, mode=0o700)
    os.chown(data, OTHER_UID, -1)
    storage = pafs.SubTreeFileSystem(str(temp_root.parent / "storage"), pafs.LocalFileSystem())
    with pytest.raises(TrainliftError, match=f"{data} is owned by uid {OTHER_UID}"):
        datacache.local_copy(storage, "runs", "somekey")


@as_root
def test_a_link_another_user_planted_to_a_directory_of_this_users_is_refused(temp_root, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = temp_root / f"trainlift-{os.geteuid()}"
    link.symlink_to(mine)
    os.chown(link, OTHER_UID, -1, follow_symlinks=False)
    with pytest.raises(TrainliftError, match=f"{link} is owned by uid {OTHER_UID}"):
        fetch.cache_root()


@pytest.fixture
def short_tmp(monkeypatch):
    """A short temporary directory as TMPDIR (Ray's socket paths fit under it), removed afterwards."""
    short = tempfile.mkdtemp(prefix="tl", dir="/tmp")
    monkeypatch.setenv("TMPDIR", short)
    monkeypatch.setattr(tempfile, "tempdir", None)
    yield short
    import shutil

    shutil.rmtree(short, ignore_errors=True)


def test_rays_directory_is_in_this_users_private_temporary_directory(short_tmp):
    ray_dir = localray.ray_temp_dir()
    assert str(ray_dir) == f"{short_tmp}/trainlift-{os.geteuid()}/ray"
    assert mode(ray_dir) == mode(ray_dir.parent) == 0o700
    env = localray.private_ray_env(ray_dir)
    assert env["RAY_TMPDIR"] == str(ray_dir.parent) and env["PYTHONPATH"].split(os.pathsep)[0] == str(localray.RAY_SITE)


def test_rays_directory_leaves_a_temporary_directory_too_long_for_its_sockets(short_tmp, monkeypatch, tmp_path):
    long_tmp = tmp_path / ("t" * 60)
    long_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(long_tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setattr(localray, "SHORT_TMP", localray.Path(short_tmp))
    ray_dir = localray.ray_temp_dir()
    assert str(ray_dir) == f"{short_tmp}/trainlift-{os.geteuid()}/ray" and mode(ray_dir.parent) == 0o700
    assert len(str(ray_dir)) + localray.SOCKET_TAIL <= localray.SOCKET_PATH_MAX


def test_seal_closes_the_directories_ray_opened_and_follows_no_link(tmp_path):
    """Ray makes each directory it creates 0777; a link in its tree is not followed."""
    root, outside = tmp_path / "ray", tmp_path / "outside"
    (root / "session_1" / "sockets").mkdir(parents=True)
    outside.mkdir()
    for path in (root, root / "session_1", root / "session_1" / "sockets", outside):
        path.chmod(0o777)
    (root / "session_latest").symlink_to(outside)
    localray.seal(root)
    assert [mode(p) for p in (root, root / "session_1", root / "session_1" / "sockets")] == [0o700] * 3
    assert mode(outside) == 0o777


@pytest.fixture
def password_home(tmp_path, monkeypatch):
    """This user's home as the password database has it: a directory of tmp_path."""
    import pwd

    from trainlift import home

    entry = tmp_path / "from-passwd"
    entry.mkdir()
    real = pwd.getpwuid(os.geteuid())
    monkeypatch.setattr(home.pwd, "getpwuid", lambda uid: type(real)((*real[:5], str(entry), real[6])))
    return entry


def test_an_empty_trainlift_home_is_unset_not_the_working_directory(tmp_path, monkeypatch, password_home):
    work = tmp_path / "project"
    work.mkdir(mode=0o755)
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRAINLIFT_HOME", "")
    assert trainlift_home() == tmp_path / "home" / ".trainlift"
    assert mode(work) == 0o755


@pytest.mark.parametrize("empty", ["", "  "])
def test_an_empty_home_is_the_password_databases_not_the_root(monkeypatch, password_home, empty):
    monkeypatch.setenv("HOME", empty)
    monkeypatch.delenv("TRAINLIFT_HOME", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    assert trainlift_home() == password_home / ".trainlift" and mode(password_home / ".trainlift") == 0o700
    assert localray.auth_token_path() == password_home / ".ray" / "auth_token"
