"""`trainlift train` says which Ray it uses before it starts or attaches, and refuses a local head another user
started under a shared $TRAINLIFT_HOME (whose Ray would not take this user's driver). The heads here are real
processes recorded the way `trainlift local up` records its head; the other user's is started as `nobody`,
which needs root (that case is skipped otherwise)."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from trainlift.cli import train as train_cli
from trainlift.errors import UsageError
from trainlift.ops import localray


@pytest.fixture
def recorded_head(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINLIFT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    procs = []

    def record(**popen):
        proc = subprocess.Popen(["sleep", "60"], **popen)
        procs.append(proc)
        localray.state_file().parent.mkdir(parents=True, exist_ok=True)
        localray.state_file().write_text(json.dumps({"pid": proc.pid, "gcs_address": "127.0.0.1:6390",
                                                     "dashboard_url": "http://127.0.0.1:8265",
                                                     "started_at": time.time()}))
        return proc

    yield record
    for proc in procs:
        proc.kill()
        proc.wait()


def test_an_embedded_ray_and_a_cluster_address_are_named():
    assert train_cli.ray_line(None) == "Ray: starting an embedded local Ray in this process; it stops when the run ends"
    assert train_cli.ray_line("10.0.0.5:6379") == "Ray: attaching to the cluster at 10.0.0.5:6379"


def test_the_local_up_head_is_named_with_its_pid_and_user(recorded_head):
    proc = recorded_head()
    address = train_cli._ray_address(None)
    assert address == "127.0.0.1:6390"
    line = train_cli.ray_line(address)
    assert line.startswith(f"Ray: attaching to the `trainlift local up` head at 127.0.0.1:6390 (pid {proc.pid}, "
                           f"user {train_cli._process_user(os.getpid())}, up since ")
    assert line.endswith("`trainlift local down` stops it")


@pytest.mark.skipif(os.geteuid() != 0, reason="starting a process as another user needs root")
def test_a_head_another_user_started_is_refused_with_the_fix(recorded_head):
    recorded_head(user="nobody")
    with pytest.raises(UsageError) as caught:
        train_cli._ray_address(None)
    assert caught.value.message.startswith("the local Ray head at 127.0.0.1:6390 (recorded in ")
    assert caught.value.message.endswith("was started by user nobody, not root")
    assert "TRAINLIFT_HOME of their own" in caught.value.hint
