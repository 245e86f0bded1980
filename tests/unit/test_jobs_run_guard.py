"""`submit` never starts a second job on a run that has an active one: both would write into
<storage>/<run.name>. The dashboard here is a stand-in holding Ray's own JobDetails records and answering a
missing id the way JobSubmissionClient does (RuntimeError on HTTP 404); tests/integration/test_submit.py
checks the same against a real Ray dashboard."""

from __future__ import annotations

import pytest
from ray.job_submission import JobDetails, JobStatus, JobType

from trainlift.errors import UsageError
from trainlift.ops import jobs


def details(submission_id: str, status: str, run: str) -> JobDetails:
    return JobDetails(type=JobType.SUBMISSION, submission_id=submission_id, job_id=None, status=JobStatus(status),
                      entrypoint="python -m trainlift train job.yaml", metadata={"trainlift_run": run})


class Dashboard:
    """The calls `jobs.submit` makes on a JobSubmissionClient."""

    def __init__(self, *records: JobDetails):
        self.records = {r.submission_id: r for r in records}
        self.submitted: list[str] = []

    def get_job_info(self, job_id: str) -> JobDetails:
        if job_id not in self.records:
            raise RuntimeError(f"Request failed with status code 404: Job {job_id} does not exist.")
        return self.records[job_id]

    def list_jobs(self) -> list[JobDetails]:
        return list(self.records.values())

    def submit_job(self, *, entrypoint, submission_id, runtime_env, metadata):
        self.records[submission_id] = details(submission_id, "PENDING", metadata["trainlift_run"])
        self.submitted.append(submission_id)
        return submission_id


def submit(dashboard: Dashboard, sub_id: str, run: str = "demo"):
    return jobs.submit(dashboard, sub_id, "python -m trainlift train job.yaml", {}, {"trainlift_run": run})


@pytest.mark.parametrize("status", ["PENDING", "RUNNING"])
def test_an_edited_spec_is_refused_while_its_run_has_an_active_job(status):
    dashboard = Dashboard(details("trainlift-demo-aaaa", status, "demo"))
    with pytest.raises(UsageError) as refused:
        submit(dashboard, "trainlift-demo-bbbb")
    line = refused.value.one_line()
    assert f"run 'demo' already has an active job trainlift-demo-aaaa ({status})" in line
    assert "trainlift jobs stop trainlift-demo-aaaa" in line and "--set run.name=" in line
    assert "\n" not in line and dashboard.submitted == []


def test_the_same_spec_attaches_to_its_active_job():
    dashboard = Dashboard(details("trainlift-demo-aaaa", "RUNNING", "demo"))
    assert submit(dashboard, "trainlift-demo-aaaa") == ("trainlift-demo-aaaa", False)
    assert dashboard.submitted == []


def test_ended_jobs_of_the_run_and_active_jobs_of_other_runs_do_not_block():
    dashboard = Dashboard(details("trainlift-demo-aaaa", "FAILED", "demo"),
                          details("trainlift-demo-cccc", "STOPPED", "demo"),
                          details("trainlift-other-dddd", "RUNNING", "other"))
    assert submit(dashboard, "trainlift-demo-bbbb") == ("trainlift-demo-bbbb", True)


def test_a_new_attempt_of_the_same_spec_is_not_blocked_by_its_ended_attempts():
    dashboard = Dashboard(details("trainlift-demo-aaaa", "FAILED", "demo"))
    assert submit(dashboard, "trainlift-demo-aaaa") == ("trainlift-demo-aaaa-2", True)
