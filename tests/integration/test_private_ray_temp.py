"""Every Ray trainlift starts (the one `train` and `doctor` embed, and `local up`'s head) keeps its files in this
user's private temporary directory, not in Ray's shared default: under a fresh TMPDIR, Ray's sessions are in
`<TMPDIR>/trainlift-<uid>/ray`, that directory's parent is 0700 and this user's, and when Ray has stopped no
directory below TMPDIR is writable by others (Ray makes each directory it creates 0777)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

TRAINLIFT = [sys.executable, "-m", "trainlift"]
IN_PROCESS = """
import json, ray
from trainlift.ops import localray
localray.start_in_process(num_cpus=1)
print(json.dumps({"temp_dir": ray.get_runtime_context().get_temp_dir(),
                  "ran": ray.get(ray.remote(lambda: 1).remote())}))
ray.shutdown()
"""


@pytest.fixture
def fresh_tmp(tmp_path):
    """A short, fresh TMPDIR (Ray's socket paths must fit in 107 bytes) and the environment of a user whose
    trainlift state is in tmp_path."""
    tmp = Path(tempfile.mkdtemp(prefix="tl", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "TRAINLIFT_HOME"))}
    env.update(TMPDIR=str(tmp), TRAINLIFT_HOME=str(tmp_path / "home"), RAY_AUTH_TOKEN="t" * 64)
    yield tmp, env
    subprocess.run(["rm", "-rf", str(tmp)], check=False)


def writable_by_others(root: Path) -> list[str]:
    found = []
    for dirpath, dirnames, _ in os.walk(root):
        for path in [dirpath, *(os.path.join(dirpath, d) for d in dirnames)]:
            info = os.lstat(path)
            if stat.S_ISDIR(info.st_mode) and info.st_mode & 0o022:
                found.append(f"{path} {stat.S_IMODE(info.st_mode):04o}")
    return found


def assert_private(tmp: Path) -> None:
    own = tmp / f"trainlift-{os.geteuid()}"
    info = os.lstat(own)
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
    assert any((own / "ray").glob("session_*")), "Ray kept its session elsewhere"
    assert writable_by_others(tmp) == []


def test_the_embedded_ray_keeps_its_files_in_a_private_directory(fresh_tmp):
    tmp, env = fresh_tmp
    result = subprocess.run([sys.executable, "-c", IN_PROCESS], env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["ran"] == 1 and report["temp_dir"] == str(tmp / f"trainlift-{os.geteuid()}" / "ray")
    assert_private(tmp)


def test_local_up_keeps_its_files_in_a_private_directory(fresh_tmp):
    from trainlift.ops.localray import free_port

    tmp, env = fresh_tmp
    up = subprocess.run([*TRAINLIFT, "local", "up", "--port", str(free_port()), "--num-cpus", "1", "--json"],
                        env=env, capture_output=True, text=True, timeout=120)
    down = subprocess.run([*TRAINLIFT, "local", "down"], env=env, capture_output=True, text=True, timeout=60)
    assert up.returncode == 0, up.stderr[-2000:]
    assert down.returncode == 0, down.stderr[-2000:]
    assert_private(tmp)
