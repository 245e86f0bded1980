"""The docs' script blocks (`<!-- run as a script: REASON -->` above a shell block; tests/unit/test_docs_commands.py
finds them and holds the repository copy they run in) run whole with bash, as a user pastes them into a shell with
the virtualenv active: a rehearsal against a local S3 server, whose Ray head, two raylets and 4 steps make it an
integration test."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = runpy.run_path(str(ROOT / "tests" / "unit" / "test_docs_commands.py"))
SCRIPTS, SCRIPT_SAYS = DOCS["SCRIPTS"], DOCS["SCRIPT_SAYS"]
repo_copy, at_repo_copy = DOCS["repo_copy"], DOCS["at_repo_copy"]  # the fixtures, as the unit module defines them
SCRIPT_TIMEOUT_S = 900  # a rehearsal: Ray head, two raylets, 4 steps; about 60 s on 2 quiet cores, 400 s on busy ones


def test_the_docs_have_a_script_block():
    assert [b.where.rsplit(":", 1)[0] for b in SCRIPTS] == ["docs/rehearse.md"]


@pytest.mark.parametrize("block", SCRIPTS, ids=[b.where for b in SCRIPTS])
def test_the_script_block_runs_as_written(at_repo_copy, block, tmp_path):
    """The whole block through bash in the repository copy, the virtualenv's bin first on PATH (as after
    `source .venv/bin/activate`), a fresh HOME and TRAINLIFT_HOME, no AWS account. What it leaves running (a server
    it started, when a line failed before it stops it) is stopped with its process group."""
    import os
    import signal
    import subprocess
    import sys

    env = {"PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin", "/bin"]), "HOME": str(tmp_path),
           "TRAINLIFT_HOME": os.environ["TRAINLIFT_HOME"], "HF_HUB_OFFLINE": "1", "LANG": "C.UTF-8",
           "AWS_CONFIG_FILE": os.environ["AWS_CONFIG_FILE"],
           "AWS_SHARED_CREDENTIALS_FILE": os.environ["AWS_SHARED_CREDENTIALS_FILE"], "AWS_EC2_METADATA_DISABLED": "true"}
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", "\n".join(block.lines)], cwd=at_repo_copy, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=SCRIPT_TIMEOUT_S)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"{block.where}: exited {proc.returncode}\n{output[-4000:]}"
    says = SCRIPT_SAYS.get(block.where.rsplit(":", 1)[0])
    assert says is None or says in output, f"{block.where}: the output does not say {says!r}\n{output[-4000:]}"
