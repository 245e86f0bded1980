"""Local Ray: a persistent head with its dashboard, bound to loopback, for `submit` and `train`, and the
Ray instance `train` and `doctor` embed in their own process when no cluster is given.

`up` starts `ray start --head --block` in its own process group and records
it in $TRAINLIFT_HOME/local.json (default ~/.trainlift); `down` ends that
process group only, never other Ray instances on the machine.

Every Ray that trainlift starts requires Ray's token (RAY_AUTH_MODE=token), found as Ray finds it:
RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH names, else ~/.ray/auth_token. On first use the file is
written with a fresh token (0600, its directory 0700) and reused afterwards.

Every Ray that trainlift starts keeps its files in this user's private temporary directory
(`<tmp>/trainlift-<uid>/ray`, 0700 above it), not in Ray's shared default (`/tmp/ray`), where another user could
create a session's or a package's directory first. Ray chmods every directory it creates or reuses 0777: in
each Python process of a Ray trainlift starts, a sitecustomize (ray_site/, on its PYTHONPATH) makes that 0700, the
head runs under umask 077, and trainlift takes the others' access off whatever is left as Ray starts and ends.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import signal
import socket
import stat
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from trainlift.errors import TrainliftError
from trainlift.home import expand_user, trainlift_home
from trainlift.ops import run
from trainlift.private_dir import TMPDIR_FIX, private_dir, user_temp_dir

LOOPBACK = "127.0.0.1"
# Ray's single-machine mode (its default on macOS and Windows): `ray start` keeps the node's address on loopback
# instead of turning 127.0.0.1 into the machine's address, so every server of the head listens on 127.0.0.1 only,
# GCS, raylet and the Prometheus metrics endpoints (dashboard, autoscaler, agent) included. No node can join it.
SINGLE_MACHINE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Ray's sockets are <temp dir>/session_<date>_<time>_<microseconds>_<pid>/sockets/plasma_store (raylet is shorter),
# and a Unix socket's path has at most 107 bytes (103 on macOS).
SOCKET_TAIL = len("/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store.99")
SOCKET_PATH_MAX = 103 if sys.platform == "darwin" else 107
SHORT_TMP = Path("/tmp")  # where Ray's directory goes when TMPDIR is too long for its sockets
RAY_TMPDIR = "RAY_TMPDIR"  # Ray's base for its default temp dir (<base>/ray) and Ray Train's lock files


def state_file() -> Path:
    return trainlift_home() / "local.json"


def is_loopback(address: str) -> bool:
    """Whether a Ray address (HOST:PORT, ray://..., http://...) names this machine's loopback interface."""
    host = address.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def auth_token_path() -> Path:
    """The file Ray reads its token from when RAY_AUTH_TOKEN is unset."""
    return expand_user(os.environ.get("RAY_AUTH_TOKEN_PATH", "").strip() or "~/.ray/auth_token")


def read_auth_token() -> str | None:
    """The token a Ray client sends: RAY_AUTH_TOKEN, else the token file's content."""
    if token := os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return token
    path = auth_token_path()
    return (path.read_text().strip() or None) if path.is_file() else None


def token_auth_env() -> dict[str, str]:
    """The environment under which a Ray process requires the token and finds this user's: RAY_AUTH_TOKEN when
    set, else the token file, written with a fresh token on first use (the same length as `ray get-auth-token
    --generate` writes) and made 0600 when others may read it."""
    if token := os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    path = auth_token_path()
    if not path.is_file():
        private_dir(path.parent, elsewhere="set RAY_AUTH_TOKEN_PATH to a file in a directory of yours")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another trainlift wrote it just now
            pass
        else:
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_hex(32))
    if path.stat().st_uid == os.geteuid() and path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}


def ray_temp_dir() -> Path:
    """The directory every Ray trainlift starts keeps its sessions in: `ray` in this user's private temporary
    directory, or in `/tmp/trainlift-<uid>` when TMPDIR is too long for Ray's socket paths; its directories are
    made private (`seal`) before Ray uses it."""
    base = user_temp_dir()
    if len(str(base / "ray").encode()) + SOCKET_TAIL > SOCKET_PATH_MAX:
        base = private_dir(SHORT_TMP / f"trainlift-{os.geteuid()}", TMPDIR_FIX)
    path = base / "ray"
    path.mkdir(mode=0o700, exist_ok=True)
    seal(path)
    return path


def seal(root: Path) -> None:
    """Take the group's and others' access off every directory of this user's below `root` (Ray makes each
    directory it creates 0777); links are not followed. Directories Ray removes meanwhile are skipped."""
    me = os.geteuid()
    for dirpath, dirnames, _ in os.walk(root):
        for path in [dirpath, *(os.path.join(dirpath, name) for name in dirnames)]:
            with contextlib.suppress(FileNotFoundError):
                info = os.lstat(path)
                if stat.S_ISDIR(info.st_mode) and info.st_uid == me and info.st_mode & 0o077:
                    os.chmod(path, 0o700, follow_symlinks=False)


RAY_SITE = Path(__file__).with_name("ray_site")  # its sitecustomize keeps Ray's directories 0700, not 0777


def private_ray_env(temp_dir: Path | None = None) -> dict[str, str]:
    """The environment that puts a Ray process's default temp dir (`temp_dir`, default `ray_temp_dir()`) and Ray
    Train's lock files in this user's private directory, and has each of its Python processes make the directories
    Ray creates 0700 (ray_site/sitecustomize.py)."""
    path = [str(RAY_SITE), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(RAY_SITE))]
    return {RAY_TMPDIR: str((temp_dir or ray_temp_dir()).parent), "PYTHONPATH": os.pathsep.join(path)}


def write_private(path: Path, text: str) -> None:
    """`path` holding `text`, readable by this user alone (0600), whatever mode an earlier file had."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)


def skip_cluster_only_train_features() -> None:
    """Ray Train's preemption watcher (the only node is this machine) and Prometheus metrics (nothing scrapes
    them) serve clusters; on one machine they cost every run's start about 2.5 s (2 cores). Off unless the
    environment sets them; Ray Train reads both in the driver."""
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    os.environ.setdefault("RAY_TRAIN_METRICS_ENABLED", "0")


def start_in_process(num_cpus: int | None = None, log_to_driver: bool = False) -> None:
    """Start a Ray instance inside this process, without a dashboard: nothing asks this instance's state API
    (Ray Train's placement-group cleaner did, and trainlift leaves it out), and the dashboard was 2 s of every
    cold start on 2 cores. No job runtime env either: Ray hands its prestarted idle workers only to actors of a
    job without one, and the progress board and Ray Train's autoscaling coordinator then start in those."""
    import ray

    from ray._raylet import Config

    skip_cluster_only_train_features()
    temp_dir = ray_temp_dir()
    os.environ.update({**token_auth_env(), **private_ray_env(temp_dir)})
    Config.initialize("")  # Ray read RAY_AUTH_MODE when first imported; re-read it, as Ray's own token default does
    from trainlift.ops.ray_site import sitecustomize  # this process's Ray: its directories 0700 too

    sitecustomize.install()
    atexit.register(seal, temp_dir)  # before ray.init: runs after Ray's own exit handler has stopped it
    # Ray starts workers at nice 15 by default; here the training workers are the point, not a background job.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=log_to_driver,
             _temp_dir=str(temp_dir), _system_config={"worker_niceness": 0})
    seal(temp_dir)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def dashboard_up(url: str, timeout: float = 2.0) -> bool:
    """The dashboard answers (401 counts: Ray's token authentication is on, and the SDK sends the token)."""
    try:
        with urllib.request.urlopen(f"{url}/api/version", timeout=timeout) as resp:
            return resp.status == 200
    except urllib.error.HTTPError as exc:
        return exc.code in (401, 403)
    except OSError:
        return False


def use_head_auth() -> None:
    """Let this process's Ray client reach the local head: in Ray's single-machine mode, as the head is (else Ray
    dials the machine's own address instead of loopback), and with the token Ray keeps for it. Before Ray is
    imported: Ray reads both when it is."""
    os.environ.update(SINGLE_MACHINE_ENV)
    os.environ.setdefault("RAY_AUTH_MODE", "token")


def read_state() -> dict[str, Any] | None:
    """The recorded head, if its process is still alive."""
    path = state_file()
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    return state if _alive(state["pid"]) else None


def last_dashboard_url() -> str | None:
    """The dashboard of the last head `up` recorded, alive or not: a command aimed at a head that died says so."""
    path = state_file()
    return json.loads(path.read_text()).get("dashboard_url") if path.is_file() else None


def status() -> dict[str, Any]:
    state = read_state()
    if state is None:
        return {"running": False}
    return {"running": True, "dashboard_reachable": dashboard_up(state["dashboard_url"]), **state}


def ray_start_on_loopback(*flags: str, bin_dir: Path | None = None) -> list[str]:
    """`ray start --block` of this interpreter's Ray (or the one in `bin_dir`), on loopback, with `flags`."""
    # Ray's fixed default ports for these collide with any other Ray instance on the machine.
    ports = [f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}"]
    ray = (bin_dir or Path(sys.executable).parent) / "ray"
    return [str(ray), "start", "--block", f"--node-ip-address={LOOPBACK}", *ports, *flags]


def path_with_this_python(bin_dir: Path | None = None) -> str:
    """PATH with this interpreter's directory (or `bin_dir`) first: a job's `python` is then that one."""
    return f"{bin_dir or Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def up(port: int = 8265, num_cpus: int | None = None, wait_s: float = 90.0) -> dict[str, Any]:
    """Start the head unless one is recorded and alive; returns its record."""
    existing = read_state()
    if existing is not None:
        return {**existing, "started": False}
    gcs_port = free_port()
    temp_dir = ray_temp_dir()
    cmd = ray_start_on_loopback("--head", f"--port={gcs_port}", f"--dashboard-host={LOOPBACK}",
                                f"--dashboard-port={port}", "--disable-usage-stats", f"--temp-dir={temp_dir}",
                                '--system-config={"worker_niceness": 0}')
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    log_path = state_file().with_name("local-head.log")
    os.close(os.open(log_path, os.O_WRONLY | os.O_CREAT, 0o600))
    umask = os.umask(0o077)  # inherited by the head and every process it starts: what they create is theirs alone
    try:
        proc = run.spawn_detached(cmd, str(log_path), env={"PATH": path_with_this_python(), **SINGLE_MACHINE_ENV,
                                                           **token_auth_env(), **private_ray_env(temp_dir)})
    finally:
        os.umask(umask)
    url = f"http://{LOOPBACK}:{port}"
    deadline = time.monotonic() + wait_s
    while not dashboard_up(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_group(proc.pid)
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise TrainliftError(f"the local Ray head did not come up on {url}: {' | '.join(tail)}",
                                 hint=f"is port {port} free? try --port; full log: {log_path}")
        time.sleep(1)
    seal(temp_dir)
    state = {"pid": proc.pid, "gcs_address": f"{LOOPBACK}:{gcs_port}", "dashboard_url": url, "started_at": time.time()}
    write_private(state_file(), json.dumps(state, indent=2))
    return {**state, "started": True}


def _group_alive(pgid: int) -> bool:
    """Any live (non-zombie) process left in the group."""
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False


def kill_group(pgid: int, grace_s: float = 8.0) -> None:
    """SIGTERM, then SIGKILL after a grace period (a head drains for up to 30 s otherwise)."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.waitpid(pgid, os.WNOHANG)  # reap the leader if this process started it
        except ChildProcessError:
            pass
        if not _group_alive(pgid):
            return
        time.sleep(0.5)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def down() -> bool:
    """Stop the recorded head; returns whether one was running."""
    state = read_state()
    state_file().unlink(missing_ok=True)
    if state is None:
        return False
    kill_group(state["pid"])
    seal(ray_temp_dir())
    return True
