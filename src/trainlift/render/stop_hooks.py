"""What a Ray pod does when Kubernetes stops it (RayJob deleted, Kueue preemption, activeDeadlineSeconds, a node
drained): its preStop hook runs first, then SIGTERM, all within terminationGracePeriodSeconds (30 s unless set),
then SIGKILL. `ray stop` as the hook killed the workers at once, before the job could write its final checkpoint.

The head's hook stops each running job through the Jobs API (the driver gets SIGTERM, finishes the step in flight
and checkpoints) and waits for it to end, up to RAY_JOB_STOP_WAIT_TIME_S; a worker's hook waits while the head
still runs a job, for as long, so its training worker can write its shard. Then `ray stop`. The pods' grace
period covers that wait and a margin for `ray stop` itself. The hooks use only the image's Python and Ray.
"""

from __future__ import annotations

STOP_MARGIN_S = 30  # `ray stop` and the container's own exit after the wait

# Run by the image's `python` on the head: stop every running job, wait for all of them to end. RAY_AUTH_TOKEN: set
# by KubeRay in every Ray container when the cluster uses token authentication.
HEAD_WAIT = """
import os, time
from ray.job_submission import JobSubmissionClient
token = os.environ.get("RAY_AUTH_TOKEN")
try:
    client = JobSubmissionClient("http://127.0.0.1:8265", headers={"Authorization": "Bearer " + token} if token else None)
    running = [j.submission_id for j in client.list_jobs() if j.status == "RUNNING" and j.submission_id]
    for job in running:
        client.stop_job(job)
    deadline = time.time() + float(os.environ.get("RAY_JOB_STOP_WAIT_TIME_S", "3"))
    while running and time.time() < deadline:
        time.sleep(1)
        running = [job for job in running if not client.get_job_status(job).is_terminal()]
except Exception as exc:
    print("trainlift preStop: could not stop the jobs:", exc)
"""

# Run by the image's `python` on a worker: wait while the head (FQ_RAY_IP, set by KubeRay) reports a running job.
WORKER_WAIT = """
import json, os, time, urllib.request
url = "http://%s:8265/api/jobs/" % os.environ.get("FQ_RAY_IP", "127.0.0.1")
headers = {"Authorization": "Bearer " + os.environ["RAY_AUTH_TOKEN"]} if os.environ.get("RAY_AUTH_TOKEN") else {}
deadline = time.time() + float(os.environ.get("RAY_JOB_STOP_WAIT_TIME_S", "3"))
while time.time() < deadline:
    try:
        jobs = json.load(urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5))
    except Exception:
        break
    if not any(job.get("status") == "RUNNING" for job in jobs):
        break
    time.sleep(1)
"""


def pre_stop(script: str) -> dict:
    """A container's lifecycle: run `script`, then `ray stop` whatever it did."""
    return {"preStop": {"exec": {"command": ["/bin/sh", "-c", f"python -c '{script.strip()}'; ray stop"]}}}


def grace_period_s(stop_wait_s: int) -> int:
    return stop_wait_s + STOP_MARGIN_S
