"""`trainlift rehearse OUT_DIR`: the rendered RayJob, run as KubeRay would run it, minus Kubernetes and GPUs.

A local Ray head and one raylet per worker pod start with the rendered `rayStartParams` (each GPU becomes a CPU
slot) and the rendered container env; the RayJob's entrypoint and `runtimeEnvYAML` go through the Jobs API as
its submitter pod sends them. `s3://` URIs are fetched from whatever S3 endpoint this environment names
(`AWS_ENDPOINT_URL`), so working_dir, py_modules, data and checkpoints travel the way they will on EKS. What
this machine cannot show (EFA, NCCL, GPU memory, the image's own Python and Ray, Kubernetes scheduling) is said.

The first part reads the manifests and judges them (pure); `run` starts the processes and submits.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainlift.errors import UsageError
from trainlift.render.s3_access import split_s3

# Run by the job before its entrypoint: where `import trainlift` resolves on the head. Ray unpacks a job's
# py_modules under its session's runtime_resources; from anywhere else (this machine's own install) the
# import would fail on the image, so the job stops there.
ORIGIN_MARK = "trainlift-imported-from "
RUNTIME_RESOURCES = "runtime_resources"
ORIGIN_PROBE = ("python -c \"import sys, trainlift; print('" + ORIGIN_MARK + "' + trainlift.__file__, flush=True); "
                "sys.exit('" + RUNTIME_RESOURCES + "' not in trainlift.__file__)\"")
NOT_PROVEN = ("EFA and the NCCL transport", "GPU memory and speed", "the image's own Python, torch and Ray",
              "Kubernetes scheduling (node selectors, taints, hugepages, device plugins)",
              "IRSA credentials (this environment's are used)")


@dataclass(frozen=True)
class PodGroup:
    """One kind of Ray pod: how many, the `ray start` flags, its env (values written in the manifest)."""

    name: str
    replicas: int
    ray_start: dict[str, str]
    env: dict[str, str]
    from_secrets: tuple[str, ...] = ()  # env filled from Kubernetes Secrets: not available here


@dataclass(frozen=True)
class Rehearsal:
    head: PodGroup
    workers: tuple[PodGroup, ...]
    entrypoint: str
    runtime_env: dict[str, Any]
    s3_uses: tuple[tuple[str, str, bool], ...]  # (what, uri, written)
    s3_grants: tuple[tuple[str, str], ...] = field(default=())  # (action, resource pattern) of the pods' role


def _read_yaml(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise UsageError(f"{path}: no {what} here", hint="render with a job first: trainlift render CLUSTER "
                                                          "--job JOB --working-dir s3://... --trainlift-uri s3://... -o DIR")
    return yaml.safe_load(path.read_text())


def _pod_group(name: str, replicas: int, group: dict[str, Any]) -> PodGroup:
    params = {k: str(v) for k, v in group.get("rayStartParams", {}).items() if k != "dashboard-host"}
    gpus = params.pop("num-gpus", "0")
    if gpus != "0":  # a GPU becomes a CPU slot: the job runs one CPU worker where it would run one GPU worker
        params["num-cpus"] = gpus
    container = group["template"]["spec"]["containers"][0]
    env = {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}
    secrets = tuple(e["name"] for e in container.get("env", []) if "valueFrom" in e)
    return PodGroup(name, replicas, params, env, secrets)


def _grants(eksctl: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    grants = []
    for account in eksctl.get("iam", {}).get("serviceAccounts", []):
        for statement in account.get("attachPolicy", {}).get("Statement", []):
            actions = statement.get("Action", [])
            resources = statement.get("Resource", [])
            for action in [actions] if isinstance(actions, str) else actions:
                grants += [(action, r) for r in ([resources] if isinstance(resources, str) else resources)]
    return tuple(grants)


def rehearsal_of(out_dir: Path) -> Rehearsal:
    """The head, worker pods, entrypoint and runtime_env of a render's RayCluster and RayJob, and the S3 URIs the
    job uses with what the pods' role grants."""
    cluster = _read_yaml(out_dir / "k8s" / "20-raycluster.yaml", "RayCluster (k8s/20-raycluster.yaml)")["spec"]
    job = _read_yaml(out_dir / "k8s" / "30-rayjob.yaml", "RayJob (k8s/30-rayjob.yaml)")["spec"]
    eksctl = yaml.safe_load((out_dir / "eksctl.yaml").read_text()) if (out_dir / "eksctl.yaml").is_file() else {}
    head = _pod_group("head", 1, cluster["headGroupSpec"])
    workers = tuple(_pod_group(g["groupName"], int(g.get("replicas", 1)), g) for g in cluster["workerGroupSpecs"])
    runtime_env = yaml.safe_load(job.get("runtimeEnvYAML") or "{}") or {}
    uses = [("runtime_env.working_dir", runtime_env.get("working_dir", ""), False)]
    uses += [("runtime_env.py_modules", m, False) for m in runtime_env.get("py_modules", [])]
    if storage := re.search(r"--set[ =]run\.storage=(\S+)", job["entrypoint"]):
        uses.append(("run.storage", storage.group(1), True))
    return Rehearsal(head, workers, job["entrypoint"], runtime_env,
                     tuple(u for u in uses if str(u[1]).startswith("s3://")), _grants(eksctl))


def role_problems(rehearsal: Rehearsal) -> list[str]:
    """Each S3 URI the job reads (or writes) that no statement of the pods' role allows, as the role would see it.
    A render without the role's policy (an existing `storage.s3.role_arn`) leaves nothing to check against."""
    problems = []
    if not rehearsal.s3_grants:
        return problems
    for what, uri, written in rehearsal.s3_uses:
        bucket, key = split_s3(uri)
        obj = f"{bucket}/{key}/trainlift-rehearsal" if written else f"{bucket}/{key}"
        for action in ("s3:GetObject", "s3:PutObject") if written else ("s3:GetObject",):
            # Resources compared after `arn:<partition>:s3:::`, so China and GovCloud renders check the same way.
            if not any(a in (action, "s3:*", "*") and fnmatch.fnmatchcase(obj, r.partition(":::")[2])
                       for a, r in rehearsal.s3_grants):
                problems.append(f"{what}: the pods' S3 role does not allow {action} on {uri}")
    return problems


def job_entrypoint(rehearsal: Rehearsal, overrides: list[str], workers: int) -> str:
    """The RayJob's entrypoint, after a line saying where trainlift is imported from, with the rehearsal's
    overrides (toy size, one worker per worker pod) appended to its `trainlift train`."""
    extra = [f"scaling.workers={workers}", *overrides]
    return f"{ORIGIN_PROBE} && {rehearsal.entrypoint} " + " ".join(f"--set {shlex.quote(o)}" for o in extra)


def imported_from(logs: str) -> list[str]:
    """The paths the job's probe printed (not the entrypoint's own echo, which also holds the mark)."""
    return [line[len(ORIGIN_MARK):].strip() for line in logs.splitlines() if line.startswith(ORIGIN_MARK)]


def trainlift_origin_problem(logs: str) -> str | None:
    """None when the job imported trainlift from its runtime_env's py_modules; else what went wrong. This machine
    has trainlift installed, the DLC image does not: an import from anywhere else would fail on the cluster."""
    origins = imported_from(logs)
    if not origins:
        return "the job did not get as far as importing trainlift"
    if RUNTIME_RESOURCES not in origins[0]:
        return (f"trainlift was imported from this machine's install ({origins[0]}), not from py_modules: the image "
                "has no trainlift, so on the cluster `python -m trainlift` fails with ModuleNotFoundError; ship "
                "it with `trainlift package --upload s3://...` and render with the URI it prints")
    return None


# --- running it ----------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    status: str
    logs: str
    message: str
    checks: list[tuple[str, str, str]]  # (what, ok | failed, evidence)

    @property
    def ok(self) -> bool:
        return all(state == "ok" for _, state, _ in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "ok": self.ok, "message": self.message,
                "checks": [{"check": c, "state": s, "evidence": e} for c, s, e in self.checks],
                "not_proven": list(NOT_PROVEN)}


def run(rehearsal: Rehearsal, overrides: list[str], timeout_s: float = 900.0,
        echo=lambda line: None) -> Outcome:
    """Start the local cluster, submit the job as the submitter pod does, wait, judge, stop the cluster."""
    if problems := role_problems(rehearsal):
        raise UsageError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
                         hint="put it under the cluster spec's storage.s3.uri or storage.s3.read, and render again")
    from trainlift.ops.rehearse_cluster import LocalCluster

    pods = sum(g.replicas for g in rehearsal.workers)
    with LocalCluster(rehearsal, echo) as cluster:
        status, logs, message = cluster.submit_and_wait(job_entrypoint(rehearsal, overrides, pods),
                                                        rehearsal.runtime_env, timeout_s)
    return Outcome(status, logs, message, judge(rehearsal, status, logs, message))


def judge(rehearsal: Rehearsal, status: str, logs: str, message: str) -> list[tuple[str, str, str]]:
    started = bool(imported_from(logs))
    checks = [("the Jobs API took the RayJob's entrypoint and runtime_env, and it set up on the nodes",
               "ok" if started else "failed", "" if started else (message or _tail(logs)))]
    if started:
        problem = trainlift_origin_problem(logs)
        checks.append(("trainlift imports from py_modules, as on an image without it",
                       "failed" if problem else "ok", problem or "imported from the job's runtime_env"))
    checks.append(("the job ran to its end (data read, steps trained, checkpoints and export written)",
                   "ok" if status == "SUCCEEDED" else "failed", status if status == "SUCCEEDED" else _tail(logs)))
    covered = ", ".join(uri for _, uri, _ in rehearsal.s3_uses) or "no s3:// URI"
    checks.append((f"the pods' S3 role covers {len(rehearsal.s3_uses)} URI(s) of the RayJob", "ok",
                   covered if rehearsal.s3_grants else "not checked: the render holds no policy of the role "
                   "(an existing role_arn)"))
    return checks


def _tail(logs: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in logs.strip().splitlines()[-lines:]) or "no output"
