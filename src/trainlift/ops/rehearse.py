"""`trainlift rehearse OUT_DIR`: the rendered RayJob, run as KubeRay would run it, minus Kubernetes and GPUs.

A local Ray head and one raylet per worker pod start with the rendered `rayStartParams` (each GPU becomes a CPU
slot) and the rendered container env; the RayJob's entrypoint and `runtimeEnvYAML` go through the Jobs API as
its submitter pod sends them. `s3://` URIs are fetched from whatever S3 endpoint this environment names
(`AWS_ENDPOINT_URL`), so working_dir, py_modules, data and checkpoints travel the way they will on EKS. What
this machine cannot show (EFA, NCCL, GPU memory, the image's CUDA builds, Kubernetes scheduling) is said.

A GPU pod's job runs on its CPU slots: the rehearsal appends `ON_CPU_SLOTS` to the entrypoint's `trainlift train`
(before the user's `--set`, which win). Every failure that can be known before Ray starts (no credentials, no S3
endpoint, a runtime_env object or a bucket that is not there) is one `UsageError` from `s3_preflight`.

The pods' S3 role is checked twice: on paper before anything starts (`role_problems`: each URI's first requests,
HeadBucket included), and on every request the job really made, recorded at the S3 server (`rehearse_s3`).

The first part reads the manifests and judges them (pure); `run` checks S3, starts the processes and submits.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainlift.errors import UsageError
from trainlift.ops.rehearse_run import RehearsalRun, entrypoint_spec, job_run, run_line, spec_from_zip
from trainlift.ops.rehearse_s3 import RoleVerdict, Tape, policy_partition, recording, role_verdict, s3_endpoint
from trainlift.render import admission
from trainlift.render.iam_eval import PolicyError, evaluate, make_request
from trainlift.render.s3_access import split_s3

# Run by the job before its entrypoint: where `import trainlift` resolves on the head. Ray unpacks a job's
# py_modules under its session's runtime_resources; from anywhere else (this machine's own install) the
# import would fail on the image, so the job stops there.
ORIGIN_MARK = "trainlift-imported-from "
RUNTIME_RESOURCES = "runtime_resources"
ORIGIN_PROBE = ("python -c \"import sys, trainlift; print('" + ORIGIN_MARK + "' + trainlift.__file__, flush=True); "
                "sys.exit('" + RUNTIME_RESOURCES + "' not in trainlift.__file__)\"")
NOT_PROVEN = ("EFA and the NCCL transport", "GPU memory and speed",
              "the image's CUDA builds (torch, NCCL, flash-attn) and its Python 3.13 where another one runs here",
              "Kubernetes scheduling and Kueue admission on a live API server (checked on paper only: node "
              "selectors, taints, device plugins, quotas)",
              "IAM beyond the role's own policy (bucket policies, SCPs, KMS keys); without an S3 server that "
              "records requests (moto_server), IAM enforcement of the role itself")
# What a GPU job asks of a worker that a CPU slot cannot give, and what the rehearsal asks instead. The job spec
# lies inside the working_dir zip on S3, so these go in whatever it says (each is what `auto` means on a CPU).
# model.dtype stays: bf16 compute runs on CPU (FSDP2 over gloo), slower but the same code path.
ON_CPU_SLOTS = ("scaling.device=cpu", "scaling.cpus_per_worker=1", "scaling.expect_fabric=any",
                "model.attn_implementation=auto")
EVIDENCE_LINES, EVIDENCE_CHARS = 3, 400  # a check's evidence: the end of a log, never a whole traceback


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
    s3_policy: dict[str, Any] | None = None  # the pods' role's rendered policy; None: an existing role_arn
    rehearsed_as: tuple[str, ...] = ()  # `--set` overrides the job gets because its GPUs are CPU slots here
    image: str = ""  # what the pods run
    queue: tuple[tuple[str, ...], tuple[str, ...]] | None = None  # Kueue on paper: (admitted lines, problems)
    job_name: str = ""  # the RayJob's metadata.name (made from the job's run.name)
    run: RehearsalRun | None = None  # where the rehearsal's own run goes (`own_run`)


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


def _policy(eksctl: dict[str, Any], service_account: str | None) -> dict[str, Any] | None:
    """The policy eksctl attaches to the pods' service account (every account's, when none is named)."""
    accounts = eksctl.get("iam", {}).get("serviceAccounts", [])
    ours = [a for a in accounts if a.get("metadata", {}).get("name") == service_account] or accounts
    found = [s for a in ours for s in _as_list(a.get("attachPolicy", {}).get("Statement", []))]
    return {"Version": "2012-10-17", "Statement": found} if found else None


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def rehearsal_of(out_dir: Path) -> Rehearsal:
    """The head, worker pods, entrypoint and runtime_env of a render's RayCluster and RayJob, and the S3 URIs the
    job uses with what the pods' role grants."""
    cluster = _read_yaml(out_dir / "k8s" / "20-raycluster.yaml", "RayCluster (k8s/20-raycluster.yaml)")["spec"]
    job = _read_yaml(out_dir / "k8s" / "30-rayjob.yaml", "RayJob (k8s/30-rayjob.yaml)")["spec"]
    eksctl = yaml.safe_load((out_dir / "eksctl.yaml").read_text()) if (out_dir / "eksctl.yaml").is_file() else {}
    head = _pod_group("head", 1, cluster["headGroupSpec"])
    workers = tuple(_pod_group(g["groupName"], int(g.get("replicas", 1)), g) for g in cluster["workerGroupSpecs"])
    gpu_pods = any(str(g.get("rayStartParams", {}).get("num-gpus", "0")) != "0" for g in cluster["workerGroupSpecs"])
    runtime_env = yaml.safe_load(job.get("runtimeEnvYAML") or "{}") or {}
    job_name = _read_yaml(out_dir / "k8s" / "30-rayjob.yaml", "RayJob")["metadata"].get("name", "job")
    uses = [("runtime_env.working_dir", runtime_env.get("working_dir", ""), False)]
    uses += [("runtime_env.py_modules", m, False) for m in runtime_env.get("py_modules", [])]
    if storage := re.search(r"--set[ =]run\.storage=(\S+)", job["entrypoint"]):
        uses.append(("run.storage", storage.group(1), True))
    account = cluster["headGroupSpec"]["template"]["spec"].get("serviceAccountName")
    return Rehearsal(head, workers, job["entrypoint"], runtime_env,
                     tuple(u for u in uses if str(u[1]).startswith("s3://")), _policy(eksctl, account),
                     ON_CPU_SLOTS if gpu_pods else (),
                     cluster["headGroupSpec"]["template"]["spec"]["containers"][0].get("image", ""),
                     _queue_on_paper(out_dir), job_name, _run_before_reading_the_spec(job["entrypoint"], job_name))


def _run_before_reading_the_spec(entrypoint: str, job_name: str) -> RehearsalRun:
    """The rehearsal's run as far as the manifests tell (the entrypoint's `--set`, the RayJob's name); `own_run`
    reads the job spec for the rest."""
    found = entrypoint_spec(entrypoint)
    return job_run(None, found[1] if found else [], [], job_name)


def _queue_on_paper(out_dir: Path) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """Render's Kueue admission check, rerun on the files as they are now (None: no ClusterQueue rendered)."""
    files = sorted((out_dir / "k8s").glob("*.yaml"))
    bodies = [(str(f.relative_to(out_dir)), yaml.safe_load(f.read_text())) for f in files]
    queue = admission.cluster_queue(bodies)
    if queue is None:
        return None
    workloads = admission.queued_workloads(bodies)
    problems = admission.admit(queue, workloads)
    return (tuple(admission.admission_lines(queue, workloads) + admission.unqueued_lines(bodies)),
            tuple(p.line() for p in problems))


# What a written location needs beyond GetObject and PutObject: pyarrow's create_dir (trainlift's writes, Ray
# Train's storage setup) sends HeadBucket first, which S3 authorises as s3:ListBucket with no s3:prefix.
HEAD_BUCKET = " with no s3:prefix (HeadBucket, which pyarrow sends before it writes)"


def _needed(uri: str, written: bool, partition: str) -> list[tuple[str, str, str]]:
    """(action, resource ARN, note) the job's first requests to `uri` need."""
    bucket, key = split_s3(uri)
    arn = f"arn:{partition}:s3:::{bucket}"
    if not written:
        return [("s3:GetObject", f"{arn}/{key}", "")]
    probe = f"{arn}/{key}/trainlift-rehearsal" if key else f"{arn}/trainlift-rehearsal"
    return [("s3:GetObject", probe, ""), ("s3:PutObject", probe, ""), ("s3:ListBucket", arn, HEAD_BUCKET)]


def role_problems(rehearsal: Rehearsal) -> list[str]:
    """Each S3 URI the job reads (or writes) that the pods' role does not allow, judged by IAM's rules on the
    requests the job starts with. A render without the role's policy (an existing `storage.s3.role_arn`) leaves
    nothing to check against."""
    policy = rehearsal.s3_policy
    if not policy:
        return []
    partition, problems = policy_partition(policy), []
    for what, uri, written in rehearsal.s3_uses:
        for action, resource, note in _needed(uri, written, partition):
            try:
                allowed = evaluate(policy, make_request(action, resource, {"aws:SecureTransport": "true"})).allowed
            except PolicyError:
                return []  # a policy this check cannot judge: the recorded requests' check says so
            if not allowed:
                problems.append(f"{what}: the pods' S3 role does not allow {action}{note} on {uri}")
    return problems


def rehearsed_as(rehearsal: Rehearsal, workers: int) -> tuple[str, ...]:
    """What the rehearsal sets on the job before the user's overrides: one worker per worker pod, on CPU slots, and
    a run of its own."""
    own = (f"run.name={rehearsal.run.name}",) if rehearsal.run is not None and not rehearsal.run.chosen else ()
    return (f"scaling.workers={workers}", *rehearsal.rehearsed_as, *own)


def own_run(rehearsal: Rehearsal, overrides: list[str]) -> Rehearsal:
    """The rehearsal with its own run: the job's spec is read from its working_dir (S3) for the run's name and
    storage. Call after `preflight` (the working_dir is known to be there)."""
    from dataclasses import replace

    found = entrypoint_spec(rehearsal.entrypoint)
    if found is None:
        return rehearsal
    spec_path, entry_overrides = found
    working_dir = str(rehearsal.runtime_env.get("working_dir", ""))
    spec_text = None
    if working_dir.startswith("s3://"):
        s3, _ = _s3_client(working_dir)
        bucket, key = split_s3(working_dir)
        try:
            spec_text = spec_from_zip(s3.get_object(Bucket=bucket, Key=key)["Body"].read(), spec_path)
        except Exception:  # noqa: BLE001 - the run is then named from the RayJob; the job itself reports the rest
            spec_text = None
    return replace(rehearsal, run=job_run(spec_text, entry_overrides, overrides, rehearsal.job_name))


def run_summary(run: RehearsalRun | None) -> dict[str, Any]:
    """The rehearsal run's summary.json (steps, loss, eval loss) from S3; {} when it cannot be read."""
    if run is None or not run.storage.startswith("s3://"):
        return {}
    import json

    try:
        s3, _ = _s3_client(run.uri)
        bucket, key = split_s3(f"{run.uri}/summary.json")
        return json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    except Exception:  # noqa: BLE001 - the job's log and checks say what went wrong
        return {}


def job_entrypoint(rehearsal: Rehearsal, overrides: list[str], workers: int) -> str:
    """The RayJob's entrypoint, after a line saying where trainlift is imported from, with the rehearsal's
    overrides (one worker per worker pod, on CPU slots) and then the user's (toy size; they win) appended to its
    `trainlift train`."""
    extra = [*rehearsed_as(rehearsal, workers), *overrides]
    return f"{ORIGIN_PROBE} && {rehearsal.entrypoint} " + " ".join(f"--set {shlex.quote(o)}" for o in extra)


NOT_IMPORTABLE = ("the job's python cannot import trainlift (No module named 'trainlift'): py_modules must hold "
                  "trainlift's wheel, as `trainlift package --upload s3://...` makes it; a zip of the source folder "
                  "is unpacked without its top folder")


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


# --- S3, before anything starts -------------------------------------------------------------------------------

NO_CREDENTIALS_HINT = ("set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or AWS_ENDPOINT_URL for an "
                       "S3-compatible server such as moto_server (with any keys)")
MISSING_CODES = {"404", "NoSuchKey", "NoSuchBucket", "NotFound"}
DENIED_CODES = {"403", "AccessDenied", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch"}


def s3_preflight(rehearsal: Rehearsal) -> None:
    """Read what the pods will read, as Ray on them would, before any Ray process starts: with this environment's
    credentials and endpoint (`AWS_ENDPOINT_URL`), every bucket of the RayJob's s3:// URIs exists and each
    runtime_env object (working_dir, py_modules) is there. The first failure is one UsageError naming the URI and
    the fix; a job without s3:// URIs makes no call."""
    if not rehearsal.s3_uses:
        return
    s3, endpoint = _s3_client(rehearsal.s3_uses[0][1])
    buckets: set[str] = set()
    for what, uri, written in rehearsal.s3_uses:
        bucket, key = split_s3(uri)
        if bucket not in buckets:
            _head(lambda: s3.head_bucket(Bucket=bucket), what, uri, endpoint, _missing_bucket(what, uri, bucket))
            buckets.add(bucket)
        if not written:  # run.storage is a prefix the job writes under: its bucket is all there is to check
            _head(lambda: s3.head_object(Bucket=bucket, Key=key), what, uri, endpoint, _missing_object(what, uri))


def _s3_client(first_uri: str) -> tuple[Any, str]:
    """An S3 client of this environment's configuration, quick to give up (a preflight, not a transfer)."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError

    try:
        session = boto3.session.Session(region_name=os.environ.get("AWS_REGION") or None)
        if session.get_credentials() is None:
            raise UsageError(f"no AWS credentials: the rehearsal reads {first_uri} as the pods would",
                             hint=NO_CREDENTIALS_HINT)
        config = Config(connect_timeout=5, read_timeout=10, retries={"total_max_attempts": 2, "mode": "standard"})
        s3 = session.client("s3", config=config)
    except BotoCoreError as exc:  # a profile that is not there, an SSO token that expired, ...
        raise UsageError(f"AWS configuration: {_one_line(str(exc))}", hint=NO_CREDENTIALS_HINT) from None
    return s3, s3.meta.endpoint_url


def _missing_bucket(what: str, uri: str, bucket: str) -> UsageError:
    return UsageError(f"{what}: the bucket of {uri} does not exist",
                      hint=f"create it (aws s3 mb s3://{bucket}), or render with a bucket of yours")


def _missing_object(what: str, uri: str) -> UsageError:
    if what == "runtime_env.py_modules":
        return UsageError(f"{what}: {uri} does not exist", hint=f"upload trainlift there (trainlift package --upload "
                          f"{uri.rsplit('/', 1)[0]}/) and render with the URI it prints")
    return UsageError(f"{what}: {uri} does not exist",
                      hint=f"upload it (cd my-project && zip -qr ../job.zip . && aws s3 cp ../job.zip {uri})")


def _head(call, what: str, uri: str, endpoint: str, missing: UsageError) -> None:
    """`call` (a HEAD request); a failure becomes one UsageError naming `uri`."""
    from botocore import exceptions as bce

    try:
        call()
    except (bce.NoCredentialsError, bce.PartialCredentialsError):
        raise UsageError(f"no AWS credentials: the rehearsal reads {uri} as the pods would",
                         hint=NO_CREDENTIALS_HINT) from None
    except (bce.ConnectionError, bce.HTTPClientError) as exc:
        raise UsageError(f"{what}: cannot reach S3 at {endpoint} to read {uri} ({type(exc).__name__})",
                         hint="start the S3-compatible server AWS_ENDPOINT_URL names, or unset it to use AWS; "
                              "check the network") from None
    except bce.ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in MISSING_CODES:
            raise missing from None
        if code in DENIED_CODES:
            raise UsageError(f"{what}: {uri}: access denied (HTTP 403) to this environment's credentials at "
                             f"{endpoint}", hint="the rehearsal reads as you, not as the pods' role: use "
                             "credentials that may read it (AWS_PROFILE)") from None
        raise UsageError(f"{what}: {uri}: {code or type(exc).__name__}: {_one_line(str(exc))}") from None
    except bce.BotoCoreError as exc:
        raise UsageError(f"{what}: {uri}: {_one_line(str(exc))}", hint=NO_CREDENTIALS_HINT) from None


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]


# --- running it ----------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    status: str
    logs: str
    message: str
    checks: list[tuple[str, str, str]]  # (what, ok | failed, evidence)
    rehearsed_as: tuple[str, ...] = ()  # the `--set` the rehearsal put before the user's (`rehearsed_as()`)
    s3_requests: dict[str, Any] = field(default_factory=dict)  # rehearse_s3.RoleVerdict.report
    run: dict[str, Any] = field(default_factory=dict)  # {"uri", "line", and the run's summary figures}

    @property
    def ok(self) -> bool:
        return all(state == "ok" for _, state, _ in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "ok": self.ok, "message": self.message,
                "checks": [{"check": c, "state": s, "evidence": e} for c, s, e in self.checks],
                "rehearsed_as": list(self.rehearsed_as), "s3_requests": self.s3_requests, "run": self.run,
                "not_proven": list(NOT_PROVEN)}


def preflight(rehearsal: Rehearsal) -> None:
    """The role and S3 checks: one UsageError, before any process starts (or any environment is built)."""
    if problems := role_problems(rehearsal):
        hint = ("render again: the role trainlift renders now allows s3:ListBucket on the storage bucket without "
                "a prefix condition (docs/security.md says what that exposes)" if HEAD_BUCKET in problems[0] else
                "put it under the cluster spec's storage.s3.uri or storage.s3.read, and render again")
        raise UsageError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""), hint=hint)
    s3_preflight(rehearsal)


def run(rehearsal: Rehearsal, overrides: list[str], timeout_s: float = 900.0,
        echo=lambda line: None, bin_dir: Path | None = None) -> Outcome:
    """After `preflight`: start the local cluster (its Ray and `python` from `bin_dir`, the image's environment,
    when given), submit the job as the submitter pod does, wait, judge, stop the cluster."""
    from trainlift.ops.rehearse_cluster import LocalCluster

    pods = sum(g.replicas for g in rehearsal.workers)
    settings = rehearsed_as(rehearsal, pods)
    echo("rehearsed as: " + " ".join(f"--set {o}" for o in settings) + (" (then yours)" if overrides else ""))
    echo(run_line(rehearsal.run, {}))
    with LocalCluster(rehearsal, echo, bin_dir) as cluster, recording(s3_endpoint()) as tape:
        status, logs, message = cluster.submit_and_wait(job_entrypoint(rehearsal, overrides, pods),
                                                        rehearsal.runtime_env, timeout_s)
    verdict = role_verdict(rehearsal.s3_policy, tape, len(rehearsal.s3_uses))
    summary = run_summary(rehearsal.run)
    run = {"uri": rehearsal.run.uri if rehearsal.run else None, "line": run_line(rehearsal.run, summary),
           **{k: summary.get(k) for k in ("steps", "final_loss", "eval_loss", "finished")}}
    return Outcome(status, logs, message, judge(rehearsal, status, logs, message, verdict), settings, verdict.report,
                   run)


def judge(rehearsal: Rehearsal, status: str, logs: str, message: str,
          role: RoleVerdict | None = None) -> list[tuple[str, str, str]]:
    started = bool(imported_from(logs))
    not_started = NOT_IMPORTABLE if "No module named 'trainlift'" in logs else _tail(message or logs)
    checks = [("the Jobs API took the RayJob's entrypoint and runtime_env, and it set up on the nodes",
               "ok" if started else "failed", "" if started else not_started)]
    if started:
        problem = trainlift_origin_problem(logs)
        checks.append(("trainlift imports from py_modules, as on an image without it",
                       "failed" if problem else "ok", problem or "imported from the job's runtime_env"))
    checks.append(("the job ran to its end (data read, steps trained, checkpoints and export written)",
                   "ok" if status == "SUCCEEDED" else "failed", status if status == "SUCCEEDED" else _tail(logs)))
    role = role or role_verdict(rehearsal.s3_policy, Tape("", why_not="no S3 requests recorded"),
                                len(rehearsal.s3_uses))
    checks.append((role.title, role.state, role.evidence))
    if rehearsal.queue is not None:
        admitted, refused = rehearsal.queue
        checks.append(("Kueue admits what the render queues, on paper (quotas, in apply order)",
                       "failed" if refused else "ok", "; ".join(refused or admitted)))
    return checks


def _tail(text: str, lines: int = EVIDENCE_LINES) -> str:
    """The last non-blank lines of a log or of Ray's message (where a traceback ends in its exception), as one line
    of at most EVIDENCE_CHARS, its end kept."""
    joined = " | ".join([" ".join(line.split()) for line in text.splitlines() if line.strip()][-lines:])
    if len(joined) > EVIDENCE_CHARS:
        joined = "…" + joined[-(EVIDENCE_CHARS - 1):]
    return joined or "no output"
