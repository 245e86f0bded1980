"""What a job's state means, in one line: a queued RayJob's Kueue `Workload`, and why a Ray job ended.

Pure functions of the objects Kueue and Ray report; `jobs status` prints what they return.
"""

from __future__ import annotations

from typing import Any

# Ray's own words (Ray 2.5x: ray/exceptions.py, the GCS's actor-death messages, the job manager's) when a job's
# head, node or driver went away under it, and what trainlift calls each. First match wins.
RAY_CAUSES = (
    ("The actor died because its node has died", "its node went away"),
    ("the actor's node was terminated", "its node went away"),
    ("Task failed because the node it was running on is dead", "its node went away"),
    ("The task's local raylet died", "its node's raylet died (the node went away)"),
    ("Job supervisor actor died", "its driver's supervisor died with the head or its node"),
    ("failed to get job supervisor", "its driver's supervisor was lost with the head or its node"),
    ("The actor is dead because its owner has died", "the process that owned its workers died"),
)
RESUME = "resubmit the same spec: it resumes from the run's latest complete checkpoint"


def ended_cause(status: str, message: str | None) -> str | None:
    """Why a FAILED job ended, when Ray's message says its head, node or driver went away; else None."""
    if status != "FAILED" or not message:
        return None
    for words, cause in RAY_CAUSES:
        if words in message:
            return cause
    return None


def job_line(row: dict[str, Any]) -> str:
    """`jobs status`'s line for a row of `ops.jobs.job_row`."""
    cause = ended_cause(row["status"], row.get("message"))
    if cause:
        return f"{row['id']}: FAILED because {cause} — {RESUME}"
    message = " ".join((row.get("message") or "").split())
    return f"{row['id']}: {row['status']}" + (f" — {message}" if message else "")


def _conditions(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c.get("type", ""): c for c in (workload.get("status") or {}).get("conditions") or []}


def _true(condition: dict[str, Any] | None) -> bool:
    return condition is not None and condition.get("status") == "True"


def _message(condition: dict[str, Any]) -> str:
    return " ".join(str(condition.get("message") or condition.get("reason") or "").split())


def pending_position(summary: dict[str, Any] | None, name: str) -> tuple[str, int] | None:
    """(LocalQueue, 1-based position) of Workload `name` in a visibility API `PendingWorkloadsSummary`."""
    for item in (summary or {}).get("items") or []:
        if (item.get("metadata") or {}).get("name") == name:
            return item.get("localQueueName") or "?", int(item.get("positionInLocalQueue", 0)) + 1
    return None


def workload_line(workload: dict[str, Any], summary: dict[str, Any] | None = None) -> str:
    """A Kueue Workload's state in one line: admitted, queued (with its position or Kueue's reason), evicted,
    waiting on admission checks, or finished. `summary`: the queue's pending workloads, when readable."""
    status = workload.get("status") or {}
    conditions = _conditions(workload)
    cluster_queue = (status.get("admission") or {}).get("clusterQueue")
    if _true(conditions.get("Finished")):
        return f"finished: {_message(conditions['Finished'])}"
    if _true(conditions.get("Admitted")):
        return f"admitted in ClusterQueue {cluster_queue}" if cluster_queue else "admitted"
    if _true(conditions.get("QuotaReserved")):
        checks = [f"{c.get('name')} ({c.get('state')})" for c in status.get("admissionChecks") or []
                  if c.get("state") != "Ready"]
        waiting = f"; waiting for admission checks: {', '.join(checks)}" if checks else ""
        return f"quota reserved in ClusterQueue {cluster_queue}{waiting}"
    line = _queued(workload, conditions, summary)
    evicted = conditions.get("Evicted")
    if _true(evicted):
        return f"evicted ({evicted.get('reason')}: {_message(evicted)}), {line}"
    return line


def _queued(workload: dict[str, Any], conditions: dict[str, dict[str, Any]], summary: dict[str, Any] | None) -> str:
    name = (workload.get("metadata") or {}).get("name", "")
    requeue = (workload.get("status") or {}).get("requeueState")
    reserved = conditions.get("QuotaReserved")
    reason = _message(reserved) if reserved else "not yet considered by Kueue's scheduler"
    position = pending_position(summary, name) if name else None
    if position:
        return f"queued in {position[0]}: position {position[1]} ({reason})"
    if requeue:
        return (f"queued: requeued after {requeue.get('count', 0)} eviction(s), next try at "
                f"{requeue.get('requeueAt', '?')}")
    return f"queued: {reason}"
