"""`submit`, `jobs` and `local` against a real local Ray head with its dashboard (Jobs API over HTTP)."""

import json
import re
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import yaml


PLANTED_TOKEN = "hf_plantedsecretvalue0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("tlhome")


def cli(home, *args, cwd=None, timeout=300, **extra_env):
    env = {**os.environ, "TRAINLIFT_HOME": str(home), "RAY_ADDRESS": "", **extra_env}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "trainlift", *args], capture_output=True, text=True, cwd=cwd,
                            env=env, timeout=timeout)
    result.elapsed = time.monotonic() - started
    return result


@pytest.fixture(scope="module")
def head(home):
    """`trainlift local up` on a free loopback port, started from a shell holding a token; `local down` afterwards."""
    up = cli(home, "local", "up", "--port", str(free_port()), "--num-cpus", "4", "--json", HF_TOKEN=PLANTED_TOKEN)
    assert up.returncode == 0, up.stderr
    state = json.loads(up.stdout)
    yield state
    assert cli(home, "local", "down").returncode == 0


@pytest.fixture(scope="module")
def project(tiny_assets, tmp_path_factory):
    """A small project directory: spec, data, model, plus things that must not be uploaded."""
    root = tmp_path_factory.mktemp("project")
    shutil.copytree(tiny_assets / "model", root / "model")
    shutil.copy(tiny_assets / "train.jsonl", root / "train.jsonl")
    spec = {"model": {"path": "model"}, "data": {"train": "train.jsonl", "seq_len": 64},
            "train": {"steps": 6, "micro_batch_size": 2, "warmup_steps": 1},
            "checkpoint": {"every_steps": 3}, "run": {"name": "sub", "storage": "runs"}}
    (root / "job.yaml").write_text(yaml.safe_dump(spec))
    (root / ".git").mkdir()
    (root / ".git" / "big.pack").write_bytes(b"x" * 2_000_000)
    (root / "runs" / "old").mkdir(parents=True)
    (root / "runs" / "old" / "leftover.bin").write_bytes(b"x" * 1000)
    (root / ".env").write_text(f"HF_TOKEN={PLANTED_TOKEN}\n")
    (root / ".gitignore").write_text("*.yaml\n!job.yaml\n")  # must not trim trainlift's own catalog/*.yaml
    return root


def test_local_status_reports_the_head_and_its_dashboard_listens_on_loopback_only(home, head):
    import psutil

    result = cli(home, "local", "status", "--json")
    status = json.loads(result.stdout)
    assert result.returncode == 0 and status["running"] and status["dashboard_reachable"]
    assert status["dashboard_url"].startswith("http://127.0.0.1:")
    port = int(status["dashboard_url"].rsplit(":", 1)[1])
    listening = {c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port}
    assert listening == {"127.0.0.1"}


def test_submit_follows_to_success_and_jobs_commands_show_it(home, head, project):
    # A token never travels in the job's runtime_env (the dashboard shows it): --env refuses it, in one line.
    refused = cli(home, "submit", "job.yaml", "--env", "HF_TOKEN", "--json", cwd=project, HF_TOKEN=PLANTED_TOKEN)
    assert refused.returncode == 2 and "Kubernetes Secret" in refused.stderr and refused.stdout == ""
    assert PLANTED_TOKEN not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    result = cli(home, "submit", "job.yaml", "--json", cwd=project)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["status"] == "SUCCEEDED" and report["created"] and report["time_to_first_step_s"] > 0
    job_id = report["submission_id"]
    assert (project / "runs" / "sub" / "final" / "config.json").is_file()  # storage on the submitting side

    listed = json.loads(cli(home, "jobs", "list", "--json").stdout)
    assert job_id in [row["id"] for row in listed]
    status = json.loads(cli(home, "jobs", "status", job_id, "--json").stdout)
    assert status["status"] == "SUCCEEDED"
    logs = cli(home, "jobs", "logs", job_id, "--raw").stdout
    assert "trainlift-progress" in logs and '"step": 6' in logs
    # Byte for byte: the progress lines are far over 80 characters and each still parses whole.
    progress_lines = [line for line in logs.splitlines() if line.startswith("trainlift-progress ")]
    assert max(map(len, progress_lines)) > 100 and all(jobs_rows(line) for line in progress_lines)
    assert logs == client_logs(head, job_id)
    # As a person reads it: a local run's progress lines, not Ray's lines or the machine's json; any unique prefix
    # of the id names the job.
    readable = cli(home, "jobs", "logs", job_id[:-3])
    assert readable.returncode == 0, readable.stderr
    shown = readable.stdout.splitlines()
    assert [line for line in shown if line.startswith("step ")][-1].startswith("step 6/6  loss ")
    assert not [line for line in shown if "trainlift-progress" in line or line.startswith(("(autoscaler)", "(raylet)"))]
    assert json.loads(cli(home, "jobs", "logs", job_id, "--json").stdout)["log"] == logs
    assert job_id in cli(home, "jobs", "list").stdout  # whole, off a terminal
    assert "not uploading credential file .env" in result.stderr
    job_info = json.dumps(json.loads(cli(home, "jobs", "status", job_id, "--json").stdout))
    metrics = (project / "runs" / "sub" / "metrics.jsonl").read_text()
    assert PLANTED_TOKEN not in logs + job_info + result.stdout + result.stderr + metrics
    from trainlift.ops import jobs

    client = jobs.client(head["dashboard_url"])
    assert "HF_TOKEN" not in client.get_job_info(job_id).runtime_env["env_vars"]
    # The token reaches a job from the environment the node was started in.
    probe = client.submit_job(entrypoint="python -c \"import os; print('token chars', len(os.environ['HF_TOKEN']))\"")
    deadline = time.monotonic() + 120
    while str(client.get_job_status(probe).value) not in jobs.TERMINAL and time.monotonic() < deadline:
        time.sleep(1)
    assert f"token chars {len(PLANTED_TOKEN)}" in client.get_job_logs(probe)


def test_uploads_skip_git_run_directories_and_credentials(home, head, project):
    """The job lists its own working directory: neither .git, runs/ nor .env travelled."""
    from trainlift.ops import jobs, workdir

    client = jobs.client(head["dashboard_url"])
    env = jobs.runtime_env(project, workdir.scan(project, ["/runs/"]).excludes, [], {})
    job_id = client.submit_job(entrypoint="python -c \"import os; print(sorted(os.listdir('.')))\"", runtime_env=env)
    deadline = time.monotonic() + 120
    while str(client.get_job_status(job_id).value) not in jobs.TERMINAL and time.monotonic() < deadline:
        time.sleep(1)
    listing = client.get_job_logs(job_id)
    assert "job.yaml" in listing and "'.git'" not in listing and "'runs'" not in listing and "'.env'" not in listing


def test_resubmitting_the_same_spec_attaches_and_a_changed_spec_waits_for_its_run(home, head, project):
    first = json.loads(cli(home, "submit", "job.yaml", "--detach", "--json", "--set", "train.steps=400",
                           cwd=project).stdout)
    again = json.loads(cli(home, "submit", "job.yaml", "--detach", "--json", "--set", "train.steps=400",
                           cwd=project).stdout)
    assert first["created"] and not again["created"] and again["submission_id"] == first["submission_id"]
    assert again["status"] in ("PENDING", "RUNNING")
    # An edited spec on the same run would write into the same run directory: refused while the first is active.
    edited = cli(home, "submit", "job.yaml", "--detach", "--json", "--set", "train.steps=401", cwd=project)
    assert edited.returncode == 2 and edited.stdout == ""
    assert f"already has an active job {first['submission_id']}" in edited.stderr
    assert f"trainlift jobs stop {first['submission_id']}" in edited.stderr and "run.name" in edited.stderr
    other = json.loads(cli(home, "submit", "job.yaml", "--detach", "--json", "--set", "train.steps=401",
                           "--set", "run.name=sub-other", cwd=project).stdout)
    assert other["created"] and other["submission_id"] != first["submission_id"]

    for job_id in (first["submission_id"], other["submission_id"]):
        stop = cli(home, "jobs", "stop", job_id, "--json")
        assert stop.returncode == 0 and json.loads(stop.stdout)["stop_requested"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = json.loads(cli(home, "jobs", "status", first["submission_id"], "--json").stdout)["status"]
        if status == "STOPPED":
            break
        time.sleep(2)
    assert status == "STOPPED"


def test_a_failing_job_exits_1_and_resubmitting_starts_a_new_attempt(home, head, project):
    (project / "broken.jsonl").write_text('{"messages": []}\n{oops\n')
    broken = ["--set", "data.train=broken.jsonl", "--set", "run.name=broken"]  # "sub" has finished: nothing to do
    result = cli(home, "submit", "job.yaml", *broken, "--json", cwd=project)
    assert result.returncode == 1
    assert "broken.jsonl:1: no assistant message" in result.stderr and "FAILED" in result.stderr
    failed = json.loads(result.stdout)

    # The data fixed, the same command must run the job again, not replay the failed one.
    shutil.copy(project / "train.jsonl", project / "broken.jsonl")
    result = cli(home, "submit", "job.yaml", *broken, "--json", cwd=project)
    assert result.returncode == 0, result.stderr[-2000:]
    retry = json.loads(result.stdout)
    assert retry["created"] and retry["status"] == "SUCCEEDED"
    assert retry["submission_id"] == failed["submission_id"] + "-2"


def test_oversized_working_directory_is_refused_before_upload(home, project, tmp_path):
    big = tmp_path / "bigproject"
    shutil.copytree(project, big, ignore=shutil.ignore_patterns(".git", "runs"))
    (big / "weights.bin").write_bytes(b"\0" * (101 * 2**20))
    result = cli(home, "submit", "job.yaml", "--address", "http://127.0.0.1:9", cwd=big)
    assert result.returncode == 2
    assert "over the 100 MiB upload limit; largest files: weights.bin" in result.stderr


def jobs_rows(line: str) -> dict:
    return json.loads(line.split(" ", 1)[1])


def client_logs(head, job_id: str) -> str:
    from trainlift.ops import jobs

    return jobs.client(head["dashboard_url"]).get_job_logs(job_id)


def test_unreachable_address_fails_fast_with_a_hint(home, project):
    result = cli(home, "submit", "job.yaml", "--address", f"http://127.0.0.1:{free_port()}", cwd=project)
    assert result.returncode == 1 and result.elapsed <= 15
    assert "cannot reach the Ray dashboard" in result.stderr and "port-forward" in result.stderr


def test_train_uses_the_local_head_when_one_is_running(home, head, project):
    result = cli(home, "train", "job.yaml", "--steps", "2", "--set", "run.name=warm", "--json", cwd=project)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["steps"] == 2
    log = (project / "runs" / "warm" / "driver.log").read_text()
    assert "existing Ray cluster" in log and "Started a local Ray instance" not in log
    # Ray's lines and the workers' output are in the run's log, and none of them on the console.
    assert "(RayTrainWorker pid=" in log and "(TrainController pid=" in log
    assert not re.search(r"RayTrainWorker|TrainController|INFO|WARNING|\x1b\[", result.stderr), result.stderr


def test_doctor_through_the_dashboard_runs_the_probe_as_a_job_on_the_cluster(home, head, mlflow_auth_server):
    """`doctor --address http://HEAD:8265` never connects this process to the cluster (Ray Client refuses a laptop
    whose Ray or Python differs from the image's): it submits the every-node probe as a Ray job with trainlift as
    a wheel and reads the report back from the job's log. The node checks the MLflow server (one answering as
    MLflow behind authentication, tests/conftest.py) with its own environment, which holds no credentials."""
    result = cli(home, "doctor", "--address", head["dashboard_url"], "--json", "--mlflow-uri",
                 mlflow_auth_server["url"], timeout=600)
    report = json.loads(result.stdout)
    assert result.returncode == 1, result.stderr
    assert report["job_id"].startswith("trainlift-doctor-") and report["address"] == head["dashboard_url"]
    assert len(report["nodes"]) == 1 and report["nodes"][0]["is_head"] and report["nodes"][0]["facts"]["python"]
    assert report["nodes"][0]["facts"]["mlflow"]["status"] == 401
    assert any(f["rule"] == "mlflow_access" and f["severity"] == "error" and f["node"] for f in report["findings"])
    jobs = json.loads(cli(home, "jobs", "list", "--address", head["dashboard_url"], "--json").stdout)
    assert any(j["id"] == report["job_id"] and j["status"] == "FAILED" for j in jobs)  # its exit 1: an error found


def test_the_pods_stop_hooks_let_a_running_job_checkpoint_before_ray_stops(head):
    """The rendered preStop scripts, run against a real head's Jobs API as kubelet runs them on a pod's deletion
    (preStop first, then SIGTERM, within terminationGracePeriodSeconds): the head's stops the job, whose driver gets
    SIGTERM and finishes (a stand-in for trainlift's checkpoint-on-stop), and returns once it has ended; a worker's
    waits while the job runs and returns when it is gone."""
    from ray.job_submission import JobSubmissionClient

    from trainlift.ops.jobs import auth_headers
    from trainlift.render import stop_hooks

    port = head["dashboard_url"].rstrip("/").rsplit(":", 1)[1]
    token = auth_headers()["Authorization"].removeprefix("Bearer ")  # the local head's, as KubeRay injects a pod's
    env = {**os.environ, "FQ_RAY_IP": "127.0.0.1", "RAY_JOB_STOP_WAIT_TIME_S": "60", "RAY_ADDRESS": "",
           "RAY_AUTH_TOKEN": token}
    client = JobSubmissionClient(head["dashboard_url"], headers=auth_headers())
    driver = ("import signal, sys, time; "
              "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(2), print('final checkpoint written', flush=True), "
              "sys.exit(0))); print('training', flush=True); time.sleep(300)")
    job = client.submit_job(entrypoint=f"python -c \"{driver}\"")
    deadline = time.monotonic() + 60
    while "training" not in client.get_job_logs(job) and time.monotonic() < deadline:
        time.sleep(0.5)
    worker = subprocess.Popen([sys.executable, "-c", stop_hooks.WORKER_WAIT.replace(":8265", f":{port}")], env=env)
    time.sleep(3)
    assert worker.poll() is None  # still waiting: the job runs
    started = time.monotonic()
    stopped = subprocess.run([sys.executable, "-c", stop_hooks.HEAD_WAIT.replace(":8265", f":{port}")], env=env,
                             capture_output=True, text=True, timeout=90)
    waited = time.monotonic() - started
    assert stopped.returncode == 0 and "could not stop" not in stopped.stdout, stopped.stdout + stopped.stderr
    assert str(client.get_job_status(job)) in ("STOPPED", "JobStatus.STOPPED")
    assert "final checkpoint written" in client.get_job_logs(job) and 2 <= waited < 60
    assert worker.wait(timeout=30) == 0
