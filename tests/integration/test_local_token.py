"""`trainlift local up` on a machine where nothing of Ray or trainlift was set up (an empty HOME): the head starts,
requires Ray's token, which trainlift wrote on first use for this user alone, and serves nothing but on loopback.
A client without the token is refused; one with it, as `trainlift jobs` sends it, is answered."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

TRAINLIFT = [sys.executable, "-m", "trainlift"]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def listening(pgid: int) -> set[str]:
    """The addresses the head's processes listen on."""
    hosts = set()
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                hosts |= {c.laddr.ip for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN}
        except (ProcessLookupError, psutil.Error):
            continue
    return hosts


def jobs_api(url: str, headers: dict[str, str]) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/api/jobs/", headers=headers), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture
def fresh_user(tmp_path):
    """The environment of a user who never ran Ray or trainlift here."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "TRAINLIFT_HOME"))}
    return home, {**env, "HOME": str(home)}


def test_local_up_on_an_empty_home_requires_the_token_it_wrote(fresh_user):
    from trainlift.ops.localray import free_port

    home, env = fresh_user
    up = subprocess.run([*TRAINLIFT, "local", "up", "--port", str(free_port()), "--num-cpus", "1", "--json"],
                        env=env, capture_output=True, text=True, timeout=120)
    try:
        assert up.returncode == 0, up.stderr[-2000:]
        head = json.loads(up.stdout)
        token_file = home / ".ray" / "auth_token"
        assert mode(token_file) == 0o600 and mode(token_file.parent) == 0o700
        assert mode(home / ".trainlift") == 0o700 and mode(home / ".trainlift" / "local.json") == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32

        assert jobs_api(head["dashboard_url"], {}) == 401
        assert jobs_api(head["dashboard_url"], {"Authorization": "Bearer not-the-token"}) == 403
        assert jobs_api(head["dashboard_url"], {"Authorization": f"Bearer {token}"}) == 200
        listed = subprocess.run([*TRAINLIFT, "jobs", "list", "--json"], env=env, capture_output=True, text=True,
                                timeout=60)
        assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stderr[-2000:]

        assert listening(head["pid"]) <= {"127.0.0.1", "::ffff:127.0.0.1"}  # GCS and the metrics endpoints too
    finally:
        down = subprocess.run([*TRAINLIFT, "local", "down"], env=env, capture_output=True, text=True, timeout=60)
    assert down.returncode == 0, down.stderr
    assert (home / ".ray" / "auth_token").read_text().strip() == token  # kept for the next head
