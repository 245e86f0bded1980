"""S3 storage failing under a training run: the server stopping mid-upload, and a shard upload the server rejects.

The S3 server is moto, over HTTP on loopback, started by these tests in the test process on a fixed free port.
moto keeps buckets and objects in the process, so a server started again on the same port serves what was
written before it stopped. `trainlift train` runs as a subprocess against it, as a user would run it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import boto3
import pytest
import yaml
from botocore.config import Config

BUCKET, PREFIX, RUN = "trainlift-faults", "runs", "faulty"
RUN_PREFIX = f"{PREFIX}/{RUN}/"
EXIT_TIMEOUT_S = 150  # from stopping the server to `trainlift train` exiting; longer is a hang
HOLD_LIMIT_S = 120  # a held upload goes through after this, so a test that never stops the server cannot hang


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_bindable(port: int, timeout: float = 15) -> None:
    """ThreadedMotoServer.start() waits forever when its port is taken; fail here instead."""
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                return
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"port {port} is still taken; cannot start the S3 server again")
        time.sleep(0.2)


class S3Server:
    """moto on 127.0.0.1:`port` that can be stopped abruptly and started again on the same port.

    `stop()` closes the listening socket and every open connection, as a crashed server would. While it is
    down a bare TCP listener holds the port and resets each connection, counting them: every count is a
    client attempt that found no server. `fault(environ)` may answer a request instead of moto. Uploads whose
    path contains `hold` wait until the server is stopped and are then cut off: `held` is set when the first
    one arrives, so a test can stop the server in the middle of that upload for certain."""

    def __init__(self, port: int, hold: str | None = None, fault=None):
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.hold, self.fault = hold, fault
        self.held = threading.Event()
        self.attempts_while_down: list[float] = []
        self.moto = self.stub = None

    def start(self) -> "S3Server":
        from moto.server import ThreadedMotoServer

        if self.stub is not None:
            self._close_stub()
        wait_until_bindable(self.port)
        down, conns = threading.Event(), []  # per server generation: a late request of a stopped one never lands
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.moto.start()
        srv = self.moto._server
        accept, app = srv.get_request, srv.app

        def get_request():
            conn, addr = accept()
            conns.append(conn)
            return conn, addr

        def wrapped(environ, start_response):
            if self.hold and environ["REQUEST_METHOD"] == "PUT" and self.hold in environ["PATH_INFO"]:
                self.held.set()
                down.wait(HOLD_LIMIT_S)
            if down.is_set():
                raise ConnectionAbortedError("the server was stopped while this request waited")
            answer = self.fault(environ, start_response) if self.fault else None
            return answer if answer is not None else app(environ, start_response)

        srv.get_request, srv.app = get_request, wrapped
        srv.handle_error = lambda *args: None  # requests cut off by stop() are the point
        self._down, self._conns = down, conns
        return self

    def _halt(self) -> None:
        self._down.set()
        srv = self.moto._server
        srv.shutdown()
        srv.server_close()
        for conn in self._conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        self.moto._thread.join(timeout=10)
        self.moto = None

    def stop(self) -> None:
        self._halt()
        self.stub = socket.socket()
        self.stub.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.stub.bind(("127.0.0.1", self.port))
        self.stub.listen(128)
        threading.Thread(target=self._reset_all, args=(self.stub,), daemon=True).start()

    def _reset_all(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            self.attempts_while_down.append(time.monotonic())
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
            conn.close()

    def _close_stub(self) -> None:
        self.stub.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked in _reset_all, which holds the port
        self.stub.close()
        self.stub = None

    def close(self) -> None:
        if self.stub is not None:
            self._close_stub()
        elif self.moto is not None:
            self._halt()

    def s3(self):
        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id="testing",
                            aws_secret_access_key="testing",
                            config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10))


def empty_bucket(s3) -> None:
    """The bucket, with nothing in it: moto's store outlives each server and each test in this process."""
    s3.create_bucket(Bucket=BUCKET)
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for obj in page.get("Contents", []):
            s3.delete_object(Bucket=BUCKET, Key=obj["Key"])


def checkpoints(s3) -> dict[str, set[str]]:
    """Checkpoint directory name -> names of the files in it, as the bucket lists them."""
    found: dict[str, set[str]] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=RUN_PREFIX):
        for obj in page.get("Contents", []):
            parts = obj["Key"][len(RUN_PREFIX):].split("/", 1)
            if parts[0].startswith("checkpoint_") and len(parts) == 2 and parts[1]:
                found.setdefault(parts[0], set()).add(parts[1])
    return found


def needed_files(world: int) -> set[str]:
    return {".metadata", "trainer_state.json"} | {f"__{r}_0.distcp" for r in range(world)} | {
        f"rng_rank{r}.pt" for r in range(world)}


def assert_complete_means_whole(s3, ckpts: dict[str, set[str]]) -> None:
    """Every checkpoint with COMPLETE holds everything its ranks wrote."""
    for name, files in ckpts.items():
        if "COMPLETE" in files:
            world = json.loads(s3.get_object(Bucket=BUCKET, Key=f"{RUN_PREFIX}{name}/COMPLETE")["Body"].read())["world_size"]
            assert needed_files(world) <= files, f"{name} is marked COMPLETE but lacks {sorted(needed_files(world) - files)}"


@pytest.fixture
def job(tiny_assets, tmp_path):
    spec = {"model": {"path": str(tiny_assets / "model")},
            "data": {"train": str(tiny_assets / "train.jsonl"), "seq_len": 64},
            "train": {"steps": 6, "micro_batch_size": 2, "warmup_steps": 1},
            "scaling": {"workers": 2},
            "checkpoint": {"every_steps": 2, "keep": 2},
            "run": {"name": RUN, "storage": f"s3://{BUCKET}/{PREFIX}", "max_failures": 1}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def start_train(job, server: S3Server) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL=server.url, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
               AWS_CONFIG_FILE=str(job.parent / "no-aws-config"),
               AWS_SHARED_CREDENTIALS_FILE=str(job.parent / "no-aws-credentials"),
               RAY_ADDRESS="", TRAINLIFT_HOME=str(job.parent / "home"))
    return subprocess.Popen([sys.executable, "-m", "trainlift", "train", str(job), "--json"], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and the local Ray it started
        out, err = proc.communicate()
        pytest.fail(f"`trainlift train` still running {timeout} s later (a hang); stderr tail:\n{err[-3000:]}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_server_stopped_mid_upload_is_retried_then_one_clear_error_and_rerun_resumes(job):
    """The user's S3 goes away while a checkpoint is being uploaded: the client retries, then `trainlift train`
    exits non-zero (no hang) with one line naming the run's s3:// URI, the unreachable endpoint and how to
    resume, and no traceback. The half-uploaded checkpoint is not marked COMPLETE, and once S3 is back,
    rerunning the same command resumes from the last complete checkpoint and finishes."""
    server = S3Server(free_port(), hold="/checkpoint_00000004/__1_0.distcp").start()  # one shard of the two
    try:
        s3 = server.s3()
        empty_bucket(s3)
        proc = start_train(job, server)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None and not server.held.is_set():
            time.sleep(0.05)
        assert server.held.is_set(), f"checkpoint_00000004 never started uploading:\n{finish(proc, 60)[1][-3000:]}"
        seen = checkpoints(s3).get("checkpoint_00000004", set())
        server.stop()
        stopped = time.monotonic()

        out, err = finish(proc, EXIT_TIMEOUT_S)
        took = time.monotonic() - stopped
        print(f"exit {proc.returncode} {took:.1f} s after the stop; {len(server.attempts_while_down)} connection "
              f"attempts while down; uploaded before the stop: {sorted(seen)}\n{err}")
        assert proc.returncode == 1, err[-3000:]
        assert "Traceback" not in err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, err[-3000:]
        line = errors[0]
        assert f"s3://{BUCKET}/{PREFIX}/{RUN}" in line and f"127.0.0.1:{server.port}" in line, line
        assert "unreachable" in line and "rerun the same command to resume from the last complete checkpoint" in line
        # Retries: the S3 client kept knocking for seconds, not one attempt and out.
        attempts = server.attempts_while_down
        assert len(attempts) >= 10 and attempts[-1] - attempts[0] >= 3, attempts

        server.hold = None  # back up, the server takes every upload
        server.start()
        ckpts = checkpoints(s3)
        assert "COMPLETE" in ckpts["checkpoint_00000002"]
        cut_off = ckpts.get("checkpoint_00000004", set())
        assert "COMPLETE" not in cut_off and needed_files(2) - cut_off, cut_off
        assert_complete_means_whole(s3, ckpts)

        proc = start_train(job, server)
        out, err = finish(proc, 300)
        assert proc.returncode == 0, err[-3000:]
        summary = json.loads(out)
        assert summary["finished"] and summary["steps"] == 6
        assert summary["resumed_from"].endswith("checkpoint_00000002")
        ckpts = checkpoints(s3)
        assert "COMPLETE" in ckpts["checkpoint_00000006"]
        assert_complete_means_whole(s3, ckpts)
        # Everything else of the run lives on S3 too, and pruning (keep=2) happened there.
        assert sorted(name for name, files in ckpts.items() if "COMPLETE" in files) == [
            "checkpoint_00000004", "checkpoint_00000006"]
        keys = {o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=RUN_PREFIX)
                for o in page.get("Contents", [])}
        assert {f"{RUN_PREFIX}metrics.jsonl", f"{RUN_PREFIX}summary.json", f"{RUN_PREFIX}final/config.json"} <= keys
        rows = s3.get_object(Bucket=BUCKET, Key=f"{RUN_PREFIX}metrics.jsonl")["Body"].read().decode().splitlines()
        assert {json.loads(r)["step"] for r in rows if '"loss"' in r} == set(range(1, 7))
    finally:
        server.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_shard_upload_rejected_is_not_marked_complete_and_the_run_recovers(job):
    """S3 answers 503 SlowDown to every upload of one file of a checkpoint. pyarrow retries it, then gives
    up without raising (its copy_files drops a failed part upload), so Ray Train takes the checkpoint as
    saved. trainlift checks the files before writing COMPLETE: the checkpoint is not marked complete, Ray
    Train restarts the workers (run.max_failures=1), they resume from the previous complete checkpoint and
    the run finishes with every complete checkpoint whole."""
    rejected: list[str] = []

    def reject_first_upload(environ, start_response):
        query = environ.get("QUERY_STRING", "")
        if environ["REQUEST_METHOD"] == "PUT" and environ["PATH_INFO"].endswith("/checkpoint_00000004/trainer_state.json"):
            upload = next((p for p in query.split("&") if p.startswith("uploadId=")), query)
            if not rejected or rejected[0] == upload:
                rejected.append(upload)
                stream = environ["wsgi.input"]
                stream.read() if environ.get("wsgi.input_terminated") else stream.read(int(environ.get("CONTENT_LENGTH") or 0))
                start_response("503 Slow Down", [("Content-Type", "application/xml")])
                return [b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"]
        return None

    server = S3Server(free_port(), fault=reject_first_upload).start()
    try:
        s3 = server.s3()
        empty_bucket(s3)
        proc = start_train(job, server)
        out, err = finish(proc, 400)
        print(f"{len(rejected)} uploads of trainer_state.json rejected\n{err}")
        assert proc.returncode == 0, err[-3000:]
        summary = json.loads(out)
        assert len(rejected) > 1  # the client retried the upload
        ckpts = checkpoints(s3)
        assert_complete_means_whole(s3, ckpts)
        assert {"checkpoint_00000004", "checkpoint_00000006"} <= {n for n, f in ckpts.items() if "COMPLETE" in f}
        assert summary["finished"] and summary["steps"] == 6
        assert (summary["resumed_from"] or "").endswith("checkpoint_00000002")  # the restart skipped the lost one
        body = s3.get_object(Bucket=BUCKET, Key=f"{RUN_PREFIX}metrics.jsonl")["Body"].read().decode()
        steps = [json.loads(line)["step"] for line in body.splitlines() if '"loss"' in line]
        assert sorted(set(steps)) == [1, 2, 3, 4, 5, 6] and steps.count(3) == 2  # steps 3-4 ran twice
    finally:
        server.close()


def test_mark_complete_refuses_a_checkpoint_missing_a_file(tmp_path):
    import pyarrow.fs as pafs

    from trainlift.train.run import checkpoint

    fs, path = pafs.LocalFileSystem(), str(tmp_path / "checkpoint_00000004")
    os.makedirs(path)
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp", "rng_rank0.pt", "rng_rank1.pt"):
        open(os.path.join(path, name), "wb").close()
    with pytest.raises(checkpoint.IncompleteCheckpointError, match=r"missing trainer_state.json"):
        checkpoint.mark_complete(fs, path, 4, 2)
    assert not checkpoint.is_complete(fs, path)
    open(os.path.join(path, checkpoint.TRAINER_STATE), "w").close()
    checkpoint.mark_complete(fs, path, 4, 2)
    assert checkpoint.is_complete(fs, path)
