"""Every Ray trainlift starts (the one `train` and `doctor` embed, and `local up`'s head) keeps its files in this
user's private temporary directory, not in Ray's shared default: under a fresh TMPDIR, Ray's sessions are in
`<TMPDIR>/trainlift-<uid>/ray`, that directory's parent is 0700 and this user's, and no directory below TMPDIR is
writable by others, while `local up`'s head runs a job or after Ray has stopped (Ray chmods each directory it
creates or reuses 0777)."""

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


A_JOB = """
import json, sys, time
from trainlift.ops import localray
localray.use_head_auth()  # before Ray reads RAY_AUTH_MODE on import
from ray.job_submission import JobSubmissionClient
client = JobSubmissionClient(sys.argv[1])
job = client.submit_job(entrypoint="python job.py", runtime_env={"working_dir": sys.argv[2]})
while not client.get_job_status(job).is_terminal():
    time.sleep(1)
print(json.dumps([client.get_job_status(job).value, client.get_job_logs(job)]))
"""


def test_local_up_keeps_its_files_in_a_private_directory_while_a_job_runs(fresh_tmp):
    """A job makes Ray create (and chmod again) its runtime_env and log directories while the head runs: none of
    them is writable by others then, nor after `local down`."""
    from trainlift.ops.localray import free_port

    tmp, env = fresh_tmp
    port = free_port()
    project = tmp / "project"
    project.mkdir()
    (project / "job.py").write_text("print('ran')\n")
    up = subprocess.run([*TRAINLIFT, "local", "up", "--port", str(port), "--num-cpus", "1", "--json"],
                        env=env, capture_output=True, text=True, timeout=120)
    try:
        assert up.returncode == 0, up.stderr[-2000:]
        job = subprocess.run([sys.executable, "-c", A_JOB, f"http://127.0.0.1:{port}", str(project)], env=env,
                             capture_output=True, text=True, timeout=240)
        assert job.returncode == 0, job.stderr[-2000:]
        status, logs = json.loads(job.stdout.strip().splitlines()[-1])
        assert status == "SUCCEEDED" and logs.strip().endswith("ran"), logs
        assert any((tmp / f"trainlift-{os.geteuid()}" / "ray").glob("session_*/runtime_resources/working_dir_files/*"))
        assert writable_by_others(tmp) == []
    finally:
        down = subprocess.run([*TRAINLIFT, "local", "down"], env=env, capture_output=True, text=True, timeout=60)
    assert down.returncode == 0, down.stderr[-2000:]
    assert_private(tmp)
