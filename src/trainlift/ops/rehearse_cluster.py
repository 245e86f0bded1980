"""The processes of a rehearsal: a Ray head with its dashboard and one raylet per worker pod, all on loopback,
each started with its pod group's `ray start` flags and env, and the job submitted through the Jobs API.

The Ray processes require this user's Ray token (ops/localray.py) and get the environment a pod has, not this
shell's: this machine's basics (PATH with the rehearsed Python first, HOME, the locale), the rendered env, and
S3 as the pods reach it. On EKS that is the pods' IAM role; here it is this environment's endpoint and region and
its resolved credentials, handed over in a credentials file of the rehearsal's own (0600 in its 0700 temporary
directory), so no AWS key, HF_TOKEN or other secret of the shell is in any Ray process's environment."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from trainlift.errors import TrainliftError
from trainlift.ops import jobs, run
from trainlift.ops.localray import (LOOPBACK, dashboard_up, free_port, kill_group, path_with_this_python,
                                    ray_start_on_loopback, token_auth_env)
from trainlift.train.model.fetch import STAGING_ENV

START_TIMEOUT_S = 120.0
# Each raylet would size its object store at 30% of this machine's memory; several on one machine overcommit it
# (a process then fails to map a large library). The rehearsal moves no large objects.
OBJECT_STORE_BYTES = 512 << 20
# What a pod's processes have that is this machine's, not the job's: taken from this environment when set.
MACHINE_ENV = ("HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TZ", "TMPDIR")
# Where and how this environment reaches S3, less its credentials (those go in a file: `aws_env`).
S3_ENDPOINT_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_MAX_ATTEMPTS",
                   "AWS_EC2_METADATA_DISABLED")


def aws_env(directory: str) -> dict[str, str]:
    """S3 for the pods, as this environment reaches it: its endpoint and region variables, and its credentials
    (whatever AWS_PROFILE, SSO or keys resolve to) in a 0600 credentials file under `directory`, with an empty AWS
    config beside it so no profile of this user's applies. No credentials resolved: an empty credentials file."""
    import boto3
    from botocore.exceptions import BotoCoreError

    env = {k: os.environ[k] for k in S3_ENDPOINT_ENV if os.environ.get(k)}
    try:
        session = boto3.session.Session()
        credentials = session.get_credentials()
        frozen = credentials.get_frozen_credentials() if credentials else None
    except BotoCoreError:
        session, frozen = None, None
    if session is not None and session.region_name and "AWS_REGION" not in env:
        env["AWS_REGION"] = session.region_name
    lines = ["[default]"]
    if frozen is not None:
        lines += [f"aws_access_key_id = {frozen.access_key}", f"aws_secret_access_key = {frozen.secret_key}"]
        lines += [f"aws_session_token = {frozen.token}"] if frozen.token else []
    aws = os.path.join(directory, "aws")
    os.makedirs(aws, mode=0o700, exist_ok=True)
    for name, text in (("credentials", "\n".join(lines) + "\n"), ("config", "")):
        fd = os.open(os.path.join(aws, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(text)
    return {**env, "AWS_SHARED_CREDENTIALS_FILE": os.path.join(aws, "credentials"),
            "AWS_CONFIG_FILE": os.path.join(aws, "config")}


def ray_process_env(temp: str, bin_dir: Path | None = None) -> dict[str, str]:
    """The environment every Ray process of a rehearsal has before its pod's rendered env: this machine's basics,
    the rehearsed Python first on PATH (the job's `python` is the pods' own), no other cluster's address, this
    user's Ray token required, and S3 as the pods reach it (`aws_env`, its files under `temp`)."""
    machine = {k: os.environ[k] for k in MACHINE_ENV if k in os.environ}
    return {**machine, "PATH": path_with_this_python(bin_dir), "RAY_ADDRESS": "", **token_auth_env(),
            **aws_env(temp)}


class LocalCluster:
    """`with LocalCluster(rehearsal, echo) as cluster:` the cluster is up inside the block, and gone after it."""

    def __init__(self, rehearsal, echo: Callable[[str], None], bin_dir: Path | None = None):
        """bin_dir: the Python environment whose Ray and `python` the pods run (the image's); default this one."""
        self.rehearsal, self.echo, self.bin_dir = rehearsal, echo, bin_dir
        self.groups: list[int] = []  # process group ids of the `ray start --block` processes
        self.temp = ""
        self.dashboard = ""
        self.base_env: dict[str, str] = {}

    def __enter__(self) -> "LocalCluster":
        self.temp = tempfile.mkdtemp(prefix="tlr-", dir="/tmp")  # short: Ray's unix socket paths are limited
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for pgid in reversed(self.groups):
            kill_group(pgid)
        shutil.rmtree(self.temp, ignore_errors=True)

    def _ray_start(self, name: str, flags: list[str], params: dict[str, str], env: dict[str, str]) -> None:
        params = {"object-store-memory": str(OBJECT_STORE_BYTES), **params}
        if STAGING_ENV in env:  # the pod's staging volume: a directory of this "pod" under the rehearsal's temp
            env = {**env, STAGING_ENV: os.path.join(self.temp, "staging", name)}
            os.makedirs(env[STAGING_ENV])
        cmd = ray_start_on_loopback(*flags, *(f"--{k}={v}" for k, v in params.items()), bin_dir=self.bin_dir)
        proc = run.spawn_detached(cmd, os.path.join(self.temp, f"{name}.log"),
                                  env={**self.base_env, **env}, inherit_env=False)
        self.groups.append(proc.pid)

    def _start(self) -> None:
        head, gcs_port, dashboard_port = self.rehearsal.head, free_port(), free_port()
        self.base_env = ray_process_env(self.temp, self.bin_dir)
        self.dashboard = f"http://{LOOPBACK}:{dashboard_port}"
        self.echo(f"starting a Ray head ({_flags(head.ray_start)}) on {self.dashboard}")
        # Not Ray's single-machine mode (localray.SINGLE_MACHINE_ENV): a joining `ray start` turns the loopback
        # address into the machine's own and dials GCS there. Its servers listen where Ray puts them, behind the token.
        self._ray_start("head", ["--head", f"--port={gcs_port}", f"--temp-dir={self.temp}",
                                 f"--dashboard-host={LOOPBACK}", f"--dashboard-port={dashboard_port}",
                                 "--disable-usage-stats"], head.ray_start, head.env)
        self._wait(lambda: dashboard_up(self.dashboard), f"the Ray head on {self.dashboard}")
        self._wait(lambda: self._alive_nodes() >= 1, "the Ray head's node")
        # Ray before 2.59 (the image's 2.58) turns a loopback --node-ip-address into the machine's own address and
        # serves GCS there: the raylets join the head where it says it is.
        gcs = f"{self._head_ip() or LOOPBACK}:{gcs_port}"
        nodes = 1
        for group in self.rehearsal.workers:
            self.echo(f"starting {group.replicas} raylet(s) for worker group {group.name} ({_flags(group.ray_start)})")
            for i in range(group.replicas):  # one after another: raylets starting side by side time out on 2 cores
                # A temporary directory of its own, as on its own machine: raylets sharing one unpack the job's
                # working_dir into the same place at the same time, under each other's running job.
                own = os.path.join(self.temp, f"w{nodes}")
                self._ray_start(f"{group.name}-{i}", [f"--address={gcs}", f"--temp-dir={own}"],
                                group.ray_start, group.env)
                nodes += 1
                self._wait(lambda: self._alive_nodes() >= nodes, f"Ray node {group.name}-{i}")

    def _nodes(self) -> list:
        from ray.util.state.api import StateApiClient
        from ray.util.state.common import ListApiOptions, StateResource

        try:
            client = StateApiClient(address=self.dashboard, headers=jobs.auth_headers())
            nodes = client.list(StateResource.NODES, options=ListApiOptions(), raise_on_missing_output=False)
            return [n for n in nodes if n.state == "ALIVE"]
        except Exception:  # noqa: BLE001 - the state API answers errors while the head is still starting
            return []

    def _alive_nodes(self) -> int:
        return len(self._nodes())

    def _head_ip(self) -> str | None:
        return next((n.node_ip for n in self._nodes() if n.is_head_node), None)

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            if time.monotonic() > deadline:
                logs = sorted(Path(self.temp).glob("*.log"), key=lambda p: p.stat().st_mtime)
                tail = logs[-1].read_text(errors="replace").strip().splitlines()[-2:] if logs else []
                raise TrainliftError(f"{what} did not come up within {START_TIMEOUT_S:.0f} s: {' | '.join(tail)}")
            time.sleep(1.0)

    def submit_and_wait(self, entrypoint: str, runtime_env: dict[str, Any], timeout_s: float) -> tuple[str, str, str]:
        """Submit as KubeRay's submitter pod does; returns (final status, the job's log, Ray's message)."""
        from ray.job_submission import JobSubmissionClient

        client = JobSubmissionClient(self.dashboard, headers=jobs.auth_headers())
        job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env,
                                   submission_id=f"rehearsal-{uuid.uuid4().hex[:8]}")
        self.echo(f"submitted {job_id}: {entrypoint}")
        status = jobs.wait(client, job_id, timeout_s) or "TIMED OUT"
        info = client.get_job_info(job_id)
        return status, client.get_job_logs(job_id), info.message or ""


def _flags(params: dict[str, str]) -> str:
    return " ".join(f"--{k}={v}" for k, v in params.items()) or "no flags"
