"""What `jobs status` and `doctor topology` say, from recorded objects.

Kueue: the Workload statuses printed in Kueue's v0.19 docs (kubernetes-sigs/kueue,
site/content/en/v0.19/docs/tasks/troubleshooting/troubleshooting_jobs.md and docs/concepts/workload.md), and the
visibility API's PendingWorkloadsSummary from docs/tasks/manage/monitor_pending_workloads/
pending_workloads_on_demand.md (tests/fixtures/recorded/README.md has the details). The real local Ray head cannot
run Kueue, so admission is tested on those objects, through the CLI with a stand-in kubectl that prints them.

Ray: FAILED messages built from Ray 2.5x's own templates (the job manager's "Job supervisor actor died: {e}", the
ActorDiedError text, the GCS's "The actor died because its node has died. Node Id: ...").
"""

from __future__ import annotations

import copy
import json
import stat
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from trainlift.cli import app
from trainlift.doctor.topology import LAYER3, layer3_line, layer3_span, pod_node_names
from trainlift.job_state import ended_cause, job_line, pending_position, workload_line

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "recorded"
WORKLOADS = yaml.safe_load((RECORDED / "kueue-workloads.yaml").read_text())
PENDING = json.loads((RECORDED / "kueue-pendingworkloads.json").read_text())
QUOTA = "couldn't assign flavors to pod set main: insufficient quota for cpu in flavor default-flavor in ClusterQueue"


@pytest.mark.parametrize("case, line", [
    ("admitted", "admitted in ClusterQueue cluster-queue"),
    ("pending_quota", f"queued: {QUOTA}"),
    ("inadmissible", "queued: LocalQueue user-queue doesn't exist"),
    ("admission_check_pending", "quota reserved in ClusterQueue dws-cluster-queue; waiting for admission checks: "
                                "dws-prov (Pending)"),
    ("preempted", "evicted (Preempted: Preempted to accommodate a higher priority Workload), queued: couldn't "
                  "assign flavors to pod set main: insufficient unused quota for cpu in flavor default-flavor, "
                  "9 more needed"),
    ("requeued", "queued: requeued after 5 eviction(s), next try at 2024-02-11T04:51:03Z"),
])
def test_each_recorded_workload_becomes_one_line(case, line):
    assert workload_line(WORKLOADS[case]) == line


def test_a_pending_workload_shows_its_position_in_its_local_queue():
    second = PENDING["items"][1]["metadata"]["name"]
    workload = {"metadata": {"name": second}, **copy.deepcopy(WORKLOADS["pending_quota"])}
    assert pending_position(PENDING, second) == ("user-queue", 2)
    assert workload_line(workload, PENDING) == f"queued in user-queue: position 2 ({QUOTA})"
    assert workload_line({"metadata": {"name": "other"}, **WORKLOADS["pending_quota"]}, PENDING) == f"queued: {QUOTA}"


def test_a_finished_workload_and_one_kueue_has_not_seen():
    finished = {"status": {"conditions": [{"type": "Finished", "status": "True", "reason": "Succeeded",
                                           "message": "Job finished successfully"}]}}
    assert workload_line(finished) == "finished: Job finished successfully"
    assert workload_line({}) == "queued: not yet considered by Kueue's scheduler"


NODE_ID = "0a9e5a8d6f5e0c0e3b8d4a4f7d9e3c1b2a6f8e7d5c4b3a2f1e0d9c8b"
SUPERVISOR_DIED = ("Job supervisor actor died: The actor died unexpectedly before finishing this task.\n"
                   "\tclass_name: JobSupervisor\n\tactor_id: 6c5f1a2b3c4d5e6f7a8b9c0d01000000\n\tpid: 4242\n"
                   f"\tname: _ray_internal_job_actor_trainlift-run-1\n\tnamespace: SUPERVISOR_ACTOR_RAY_NAMESPACE\n"
                   f"\tip: 10.0.1.17\nThe actor died because its node has died. Node Id: {NODE_ID}\n"
                   "\tthe actor's node was terminated unexpectedly: health check failed due to missing too many "
                   "heartbeats")


def test_a_job_that_lost_its_node_names_the_cause_not_a_bare_failed():
    row = {"id": "trainlift-run-1", "status": "FAILED", "message": SUPERVISOR_DIED}
    assert ended_cause("FAILED", SUPERVISOR_DIED) == "its node went away"
    assert job_line(row) == ("trainlift-run-1: FAILED because its node went away — resubmit the same spec: it "
                             "resumes from the run's latest complete checkpoint")
    lost = "Unexpected error occurred: failed to get job supervisor."
    assert "supervisor was lost" in ended_cause("FAILED", lost)
    # A job's own failure stays as Ray reports it, on one line.
    own = "Job entrypoint command failed with exit code 1, last available logs:\nValueError: x"
    assert ended_cause("FAILED", own) is None
    assert job_line({"id": "j", "status": "FAILED", "message": own}) == f"j: FAILED — {' '.join(own.split())}"
    assert ended_cause("SUCCEEDED", SUPERVISOR_DIED) is None


@pytest.fixture
def kubectl(tmp_path, monkeypatch):
    """A stand-in kubectl on PATH that prints the answer for the first of its arguments found in `answers`."""

    def install(answers: dict) -> Path:
        script = tmp_path / "kubectl"
        script.write_text(f"#!{sys.executable}\nimport json, sys\nanswers = json.loads({json.dumps(answers)!r})\n"
                          "print(json.dumps([v for k, v in answers.items() if k in sys.argv][0]))\n")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
        monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
        (tmp_path / "kubeconfig").write_text("apiVersion: v1\n")
        return tmp_path / "kubeconfig"

    return install


def test_jobs_status_reads_a_rayjobs_workload_through_kubectl(kubectl):
    workload = {"metadata": {"name": PENDING["items"][2]["metadata"]["name"]}, "spec": {"queueName": "user-queue"},
                **WORKLOADS["pending_quota"]}
    config = kubectl({"rayjobs.ray.io": {"metadata": {"uid": "5863cf0e"}},  # the RayJob's uid is made up
                      "workloads.kueue.x-k8s.io": {"items": [workload]}, "--raw": PENDING})
    result = CliRunner().invoke(app, ["jobs", "status", "fine-tune", "--kubeconfig", str(config),
                                      "--namespace", "team"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"fine-tune: queued in user-queue: position 3 ({QUOTA})"


def test_doctor_topology_counts_the_layer3_nodes_of_a_rayclusters_pods(kubectl):
    nodes = eks_nodes()
    pods = [{"spec": {"nodeName": n["metadata"]["name"]}} for n in nodes[:3]]
    config = kubectl({"pods": {"items": pods}, "nodes": {"items": nodes}})
    result = CliRunner().invoke(app, ["doctor", "topology", "job-raycluster-x", "--kubeconfig", str(config)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "job-raycluster-x: 3 node(s) span 2 layer-3 network node(s)"


# The recorded EKS node (kubectl-get-nodes.json) is a t3.small, which has no network topology: the layer labels are
# added in code, their values shaped like the EKS user guide's example (nn-e50490a237cb0f01a).
def eks_nodes() -> list[dict]:
    node = json.loads((RECORDED / "kubectl-get-nodes.json").read_text())["items"][0]
    nodes = []
    for i, layer3 in enumerate(["nn-3a1f0c9e2b7d4e6a1", "nn-3a1f0c9e2b7d4e6a1", "nn-8c2e5b1d9f0a3c7e4", None]):
        copy_ = copy.deepcopy(node)
        copy_["metadata"]["name"] = f"ip-10-0-10-{170 + i}.ec2.internal"
        if layer3:
            copy_["metadata"]["labels"][LAYER3] = layer3
        nodes.append(copy_)
    return nodes


def test_layer3_span_counts_distinct_values_over_a_jobs_nodes():
    nodes = eks_nodes()
    pods = [{"spec": {"nodeName": n["metadata"]["name"]}} for n in nodes[:3]] + [{"spec": {}}]
    span = layer3_span(nodes, pod_node_names(pods))
    assert span == {"nodes": 3, "layer3": ["nn-3a1f0c9e2b7d4e6a1", "nn-8c2e5b1d9f0a3c7e4"], "unlabelled": []}
    assert layer3_line(span) == "3 node(s) span 2 layer-3 network node(s)"
    everything = layer3_span(nodes)
    assert everything["unlabelled"] == ["ip-10-0-10-173.ec2.internal"]
    assert layer3_line(everything).endswith(f"; 1 without {LAYER3}: ip-10-0-10-173.ec2.internal")
    assert layer3_line(layer3_span([node for node in nodes[:2]])) == "2 node(s) span 1 layer-3 network node(s)"


class RecordedJobClient:
    """Answers `get_job_info` and `get_job_logs` as Ray's JobSubmissionClient did for a job whose node died (the
    message recorded above); the head's dashboard itself cannot run here without a cluster to lose."""

    def get_job_info(self, job_id):
        from types import SimpleNamespace

        return SimpleNamespace(message=SUPERVISOR_DIED)

    def get_job_logs(self, job_id):
        return "step 3/40  loss 2.1\n"


def test_submit_follow_ends_a_failed_job_with_its_cause(capsys):
    import typer

    from trainlift.cli import jobs as cli_jobs

    with pytest.raises(typer.Exit) as ended:
        cli_jobs._finish(RecordedJobClient(), "trainlift-run-1", "FAILED", False, {})
    assert ended.value.exit_code == 1  # a failed job fails the command: scripts and CI read the exit status
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("job trainlift-run-1 FAILED because its node went away — resubmit the same spec")
    with pytest.raises(typer.Exit) as ended:
        cli_jobs._finish(RecordedJobClient(), "trainlift-run-1", "FAILED", True, {})
    assert ended.value.exit_code == 1
    assert '"cause": "its node went away"' in capsys.readouterr().out
