"""`trainlift submit` and `trainlift jobs ...`: jobs on any Ray cluster."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from trainlift.cli.app import app, console, err_console, print_json
from trainlift.errors import UsageError

jobs_app = typer.Typer(rich_markup_mode=None, help="List, inspect, follow and stop jobs on a Ray cluster.",
                       no_args_is_help=True)
app.add_typer(jobs_app, name="jobs")

ADDRESS_HELP = "Ray dashboard URL (default: RAY_ADDRESS, else the head from `trainlift local up`)."
CLUSTER_OPTION = typer.Option(
    None, "--cluster", metavar="CLUSTER_SPEC", help="Instead of --address: the EKS cluster `cluster up` made from this "
    "spec, its head reached through kubectl port-forward with the RayCluster's token (from its Secret).")
DIR_OPTION = typer.Option(None, "--dir", help="With --cluster: where `cluster up` wrote the cluster's kubeconfig "
                          "(default .trainlift/<name>/).")


def _follow(job_client, job_id: str, total_steps: int | None, quiet: bool, submitted_at: float,
            verbose: bool = False) -> tuple[str, float | None]:
    """The job's progress as a bar and its other lines as they come, unwrapped (Ray's own lines only with
    `verbose`; all of them stay in the job's log). `total_steps` None: read from the progress rows."""
    from trainlift.cli.progress import step_figures
    from trainlift.ops import jobs
    from trainlift.ops.ray_output import is_ray_line

    first_step_at: list[float] = []
    if not console.is_terminal and not quiet and not verbose:
        return _follow_lines(job_client, job_id, submitted_at)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=console, disable=quiet) as progress:
        task = progress.add_task(job_id, total=total_steps, info="waiting for the first step…")

        def on_line(line: str) -> None:
            row = jobs.parse_progress(line)
            if row is None:
                if not quiet and line.strip() and (verbose or not is_ray_line(line)):
                    progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
                return
            if row.get("total_steps"):
                progress.update(task, total=row["total_steps"])
            if row.get("step") and not first_step_at:
                first_step_at.append(time.time())
            if "loss" in row:
                progress.update(task, completed=row["step"], info=step_figures(row))

        status = jobs.follow(job_client, job_id, on_line)
    return status, (first_step_at[0] - submitted_at) if first_step_at else None


def _follow_lines(job_client, job_id: str, submitted_at: float) -> tuple[str, float | None]:
    """Off a terminal: the job's log as `trainlift train` prints it there (progress lines, trainlift's own lines),
    whole lines, never cut to a width."""
    from trainlift.cli.progress import JobLogLines
    from trainlift.ops import jobs
    from trainlift.ops.ray_output import is_ray_line

    readable, first_step_at = JobLogLines(jobs.parse_progress, is_ray_line), []

    def on_line(line: str) -> None:
        if not first_step_at and jobs.parse_progress(line):
            first_step_at.append(time.time())
        for text in readable(line):
            _print_line(text)

    status = jobs.follow(job_client, job_id, on_line)
    for text in readable.flush():
        _print_line(text)
    return status, (first_step_at[0] - submitted_at) if first_step_at else None


def _print_line(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _finish(job_client, job_id: str, status: str, json_out: bool, extra: dict) -> None:
    from trainlift.job_state import RESUME, ended_cause
    from trainlift.ops import jobs

    cause = ended_cause(status, _job_message(job_client, job_id)) if status == "FAILED" else None
    if json_out:
        print_json({"submission_id": job_id, "status": status, **extra, **({"cause": cause} if cause else {})})
    if status == "SUCCEEDED":
        if not json_out:
            console.print(f"job {job_id} [green]SUCCEEDED[/]")
        return
    for line in jobs.error_tail(job_client, job_id):
        err_console.print(line, markup=False, highlight=False)
    ended = f" because {cause} — {RESUME}" if cause else ""
    err_console.print(f"job {job_id} [red]{status}[/]{ended}", highlight=False)
    raise typer.Exit(1)


def _job_message(job_client, job_id: str) -> str | None:
    """Ray's message for the job; None when the head cannot say (it is gone: `error_tail` then says so)."""
    try:
        return job_client.get_job_info(job_id).message
    except Exception:  # noqa: BLE001 - any failure to reach the head leaves the line as it was
        return None


def _job_files(spec_file: Path, working_dir: Path, overrides: list[str], exclude: list[str], include_ignored: bool,
               include: list[str] = ()):
    """The spec, its path inside the working dir, and the plan of what of that directory travels; a relative local
    run.storage is pointed back at the submitting side (not the job's temporary copy) and left behind."""
    from trainlift.config.job import load_job_spec
    from trainlift.ops import workdir

    root = working_dir.resolve()
    spec_path = spec_file.resolve()
    if not spec_path.is_relative_to(root):
        raise UsageError(f"{spec_file}: the spec must be inside the working directory {root}",
                         hint="run from the project directory or pass --working-dir")
    spec = load_job_spec(spec_path, overrides)
    extra = []
    if not spec.is_remote_storage:  # relative to the spec file, or to here for --set: absolute for the job's copy
        storage = (Path.cwd() / spec.run.storage).resolve()
        if storage.is_relative_to(root) and storage != root:
            extra.append(f"/{storage.relative_to(root).as_posix()}/")
        overrides.append(f"run.storage={storage}")
    return spec, spec_path, workdir.scan(root, list(exclude) + extra, include_ignored, include)


def _show_upload(plan, dry_run: bool, json_out: bool) -> None:
    """With --dry-run, what would travel and what stays behind, and why; else a warning per credential file held
    back. Either way an oversized directory stops here."""
    from trainlift.ops import workdir

    if dry_run and json_out:
        print_json(workdir.describe(plan))
    elif dry_run:
        console.print("\n".join(workdir.listing(plan)), markup=False, highlight=False)
    else:
        for name in plan.credentials:
            err_console.print(f"[yellow]warning:[/] not uploading credential file {name}", highlight=False)
    workdir.check_size(plan)


def _detached(job_client, job_id: str, address: str, json_out: bool, details: dict) -> None:
    if json_out:
        print_json({"submission_id": job_id, "status": str(job_client.get_job_status(job_id).value), **details})
    else:
        console.print(f"follow it: trainlift jobs logs {job_id} --follow --address {address}")


@app.command()
def submit(
    spec_file: Path = typer.Argument(..., help="Job spec inside the working directory, e.g. examples/tiny-local.yaml."),
    address: Optional[str] = typer.Option(None, help=ADDRESS_HELP),
    set_: List[str] = typer.Option([], "--set", metavar="KEY=VALUE", help="Override a spec field (repeatable)."),
    follow: bool = typer.Option(True, "--follow/--detach", help="Stream logs and progress until the job ends."),
    submission_id: Optional[str] = typer.Option(None, help="Job id (default: derived from run name and spec content)."),
    pip: List[str] = typer.Option([], "--pip", help="Extra pip package for the job's environment (repeatable)."),
    env: List[str] = typer.Option([], "--env", metavar="KEY[=VALUE]", help="Environment variable for the job: KEY=VALUE, or KEY to pass "
                                  "this shell's value (repeatable). Not for secrets: those come from the workers' "
                                  "environment (a Kubernetes Secret in the cluster spec's `secrets`)."),
    working_dir: Path = typer.Option(Path("."), help="Project directory shipped as the job's working_dir."),
    exclude: List[str] = typer.Option([], "--exclude", help="Extra gitignore-style pattern not to upload."),
    include_ignored: bool = typer.Option(False, "--include-ignored", help="Also upload what git ignores "
                                         "(.gitignore, .git/info/exclude); credential files never travel."),
    include: List[str] = typer.Option([], "--include", metavar="DIR", help="Also upload this top-level folder that "
                                      "a job does not need by default: tests, docs, bench or out (repeatable)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List the files that would be uploaded and those left "
                                 "out with the reason, check the spec, and stop before contacting any cluster."),
    cluster: Optional[Path] = typer.Option(
        None, "--cluster", help="The cluster spec the job runs on: its S3 role must reach run.storage and the data "
        "and its pods must get the job's MLflow credentials (checked before anything is uploaded)."),
    force: bool = typer.Option(False, "--force", help="Submit even when the estimate says the job does not fit "
                               "the --cluster's GPUs."),
    cluster_dir: Optional[Path] = typer.Option(
        None, "--dir", help="With --cluster and no --address: where `cluster up` wrote the cluster's kubeconfig "
        "(default .trainlift/<name>/); the head is reached through kubectl port-forward for as long as submit runs."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also show Ray's own lines: the SDK's while "
                                 "uploading, the job's workers' while following (all are in the job's log)."),
    json_out: bool = typer.Option(False, "--json", help="Print the job id and final status (with --dry-run: the "
                                  "upload) as JSON."),
) -> None:
    """Submit a job spec to a Ray cluster through the Job Submission API.

    The project directory travels as working_dir (without credential files, .git, virtualenvs, caches, runs, the
    top-level tests/, docs/, bench/ and out/ a job does not need, and what git ignores; --dry-run lists it) and trainlift itself as a wheel in py_modules. Submitting the same spec
    again attaches to its job while that is pending or running; once it has ended (failed, stopped), a new attempt
    `<id>-2`, `<id>-3`, ... resumes from the newest checkpoint. A different spec with the same run name is refused
    while that run has an active job. Exit code: 0 when the job SUCCEEDED, 1 when it FAILED or was STOPPED.
    """
    from trainlift.catalog.packages import refuse_requirement
    from trainlift.cli.estimate import check_fits_cluster
    from trainlift.ops import jobs

    env_vars = jobs.parse_env(env, os.environ)
    for requirement in pip:
        refuse_requirement("--pip", requirement)
    overrides = list(set_)
    spec, spec_path, plan = _job_files(spec_file, working_dir, overrides, exclude, include_ignored, include)
    _show_upload(plan, dry_run, json_out)
    lock, cluster_spec = None, None
    if cluster is not None:
        cluster_spec, lock = _check_cluster_serves(cluster, spec)
        check_fits_cluster(spec, spec_file, cluster, force, json_out)
    if dry_run:
        return
    with _head(cluster_spec, cluster_dir, address, json_out) as forwarded:
        _submit(spec, spec_path, plan, overrides, lock, jobs.resolve_address(forwarded or address), pip, env_vars,
                submission_id, follow, json_out, verbose)


def _head(cluster_spec, cluster_dir: Path | None, address: str | None, quiet: bool, over_env: bool = False):
    """The forwarded head of the --cluster's RayCluster when no address was given (nor RAY_ADDRESS, unless
    `over_env`); else nothing to do."""
    from contextlib import nullcontext

    from trainlift.ops.jobs import forwarded_head
    from trainlift.render.raycluster import auth_secret_name

    if cluster_spec is None or address or (os.environ.get("RAY_ADDRESS") and not over_env):
        return nullcontext(None)
    root = cluster_dir or Path(".trainlift") / cluster_spec.name
    if not quiet:
        err_console.print(f"reaching the head of {cluster_spec.name} through kubectl port-forward "
                          f"svc/{cluster_spec.name}-head-svc ({root / 'kubeconfig'})", highlight=False)
    return forwarded_head(root / "kubeconfig", cluster_spec.namespace, cluster_spec.name, auth_secret_name(cluster_spec))


def _submit(spec, spec_path: Path, plan, overrides: list[str], lock, address: str, pip: list[str], env_vars: dict,
            submission_id: str | None, follow: bool, json_out: bool, verbose: bool) -> None:
    from trainlift.ops import jobs, localray, ray_output, workdir

    job_pip = _job_pip(spec, lock, address)
    if not spec.is_remote_storage and not localray.is_loopback(address):
        err_console.print(f"[yellow]warning:[/] run.storage {spec.run.storage!r} is a local path; a multi-node "
                          "cluster needs s3://... or a shared volume for checkpoints")
    entry = jobs.entrypoint(spec_path.relative_to(plan.root).as_posix(), overrides)
    runtime_env = jobs.runtime_env(plan.root, plan.excludes, job_pip + list(pip), env_vars)
    job_id = submission_id or jobs.submission_id(spec.run.name, spec_path.read_text(), entry, runtime_env)
    # What Ray's SDK says while uploading and streaming goes to a log file, not the console.
    with ray_output.RunOutput(ray_output.home_log_path(f"submit-{spec.run.name}"), verbose), workdir.uploading(plan):
        _submit_and_follow(spec, plan, entry, runtime_env, job_id, address, follow, json_out, verbose)


def _submit_and_follow(spec, plan, entry: str, runtime_env: dict, job_id: str, address: str, follow: bool,
                       json_out: bool, verbose: bool) -> None:
    from trainlift.ops import jobs

    job_client = jobs.client(address, gone=lambda: jobs.submit_gone(spec.run.name, _run_uri(spec)))
    submitted_at = time.time()
    job_id, created = jobs.submit(job_client, job_id, entry, runtime_env, {jobs.RUN_METADATA: spec.run.name})
    if not json_out:
        console.print(f"{'submitted' if created else 'attached to running'} job [bold]{job_id}[/] on {address} "
                      f"({len(plan.files)} files, {plan.total_bytes / 2**20:.1f} MiB)")
    details = {"created": created, "address": address}
    if not follow:
        return _detached(job_client, job_id, address, json_out, details)
    try:
        status, to_first_step = _follow(job_client, job_id, spec.train.steps, json_out, submitted_at, verbose)
    except KeyboardInterrupt:
        err_console.print(f"detached; the job keeps running. Reattach: trainlift jobs logs {job_id} --follow; "
                          f"stop: trainlift jobs stop {job_id}")
        raise typer.Exit(130) from None
    _finish(job_client, job_id, status, json_out, {**details, "time_to_first_step_s": to_first_step})


def _run_uri(spec) -> str:
    """Where the run's checkpoints are, as seen from here (a local run.storage is relative to this directory)."""
    if spec.is_remote_storage:
        return spec.run_uri
    return str((Path.cwd() / spec.run.storage).resolve() / spec.run.name)


def _job_pip(spec, lock, address: str) -> list[str]:
    """What the job's runtime_env installs: the packages its spec needs that the cluster's image lacks (the --cluster
    image's lock; on this machine's own Ray, this environment; on another cluster, all of them), pinned."""
    from trainlift.catalog.packages import ImageLock, normalize, runtime_pip
    from trainlift.ops import localray

    if lock is None and localray.is_loopback(address):
        from importlib import metadata

        lock = ImageLock("this environment", {normalize(d.metadata["Name"]): d.version
                                              for d in metadata.distributions()}, frozenset(), ())
    return runtime_pip(spec, lock)


def _check_cluster_serves(cluster_file: Path, spec):
    """One line (exit 2) when the cluster's pods could not read the data or write the run under their S3 role,
    or lack the MLflow credentials the job names. Returns the cluster spec and the locked package set of its image."""
    from trainlift.catalog.packages import image_lock
    from trainlift.cli.cluster import load_cluster_spec
    from trainlift.render.job_secrets import mlflow_secret_problems
    from trainlift.render.problems import raise_problems
    from trainlift.render.s3_access import job_s3_uses, s3_access_problems

    cluster_spec = load_cluster_spec(cluster_file)
    raise_problems(s3_access_problems(cluster_spec, job_s3_uses(spec)) + mlflow_secret_problems(cluster_spec, spec))
    return cluster_spec, image_lock(cluster_spec.image.uri)


def _cluster_head(cluster: Path | None, cluster_dir: Path | None, address: str | None):
    """A block's Ray address: --address, or the --cluster's head forwarded (with its token) while the block runs;
    --cluster is taken over RAY_ADDRESS, as it is named on the command line."""
    from contextlib import contextmanager

    from trainlift.cli.cluster import load_cluster_spec

    if cluster is not None and address:
        raise UsageError("--cluster reaches the head by itself; drop --address (or --cluster)")
    cluster_spec = load_cluster_spec(cluster) if cluster is not None else None

    @contextmanager
    def block():
        from trainlift.ops.run import environ_set

        with _head(cluster_spec, cluster_dir, None, quiet=True, over_env=True) as forwarded:
            # Ray's job client prefers RAY_ADDRESS to the address it is given
            with environ_set({"RAY_ADDRESS": forwarded} if forwarded else {}):
                yield forwarded or address
    return block()


@jobs_app.command("list")
def jobs_list(address: Optional[str] = typer.Option(None, help=ADDRESS_HELP),
              cluster: Optional[Path] = CLUSTER_OPTION, cluster_dir: Optional[Path] = DIR_OPTION,
              json_out: bool = typer.Option(False, "--json")) -> None:
    """Jobs on the cluster, newest first."""
    from trainlift.ops import jobs

    with _cluster_head(cluster, cluster_dir, address) as head:
        listed = jobs.client(jobs.resolve_address(head)).list_jobs()
    rows = sorted((jobs.job_row(i) for i in listed), key=lambda r: -(r["start_time"] or 0))
    if json_out:
        print_json(rows)
        return
    _print_jobs(rows)


def _print_jobs(rows: list[dict]) -> None:
    """One row a job, its id whole (it is what `jobs logs` and `jobs stop` take); off a terminal no line is cut to
    a width, on one the entrypoint column wraps instead of the id."""
    table = Table()
    table.add_column("id", no_wrap=True, min_width=max((len(row["id"]) for row in rows), default=2))
    table.add_column("status", no_wrap=True)
    table.add_column("entrypoint")
    for row in rows:
        table.add_row(row["id"], row["status"], row["entrypoint"])
    if console.is_terminal:
        console.print(table)
        return
    saved = console.width
    console.width = _wide(table)  # a pipe or a file has no width to keep to
    try:
        console.print(table)
    finally:
        console.width = saved


def _wide(table: Table) -> int:
    """The width a table needs to print every cell on one line."""
    from rich.console import Console

    return Console(width=100_000).measure(table).maximum


@jobs_app.command("status")
def jobs_status(job_id: str = typer.Argument(..., help="The job's submission id; with --kubeconfig, a RayJob's name."),
                address: Optional[str] = typer.Option(None, help=ADDRESS_HELP),
                kubeconfig: Optional[Path] = typer.Option(
                    None, help="Read RayJob JOB_ID's Kueue admission (queued, position, admitted, evicted) through "
                    "this kubeconfig, e.g. .trainlift/<cluster>/kubeconfig."),
                namespace: str = typer.Option("default", help="The RayJob's namespace (with --kubeconfig)."),
                cluster: Optional[Path] = CLUSTER_OPTION, cluster_dir: Optional[Path] = DIR_OPTION,
                json_out: bool = typer.Option(False, "--json")) -> None:
    """One job's status and message; a job that ended because its head or node went away says so."""
    from trainlift.job_state import ended_cause, job_line
    from trainlift.ops import jobs

    if kubeconfig is not None:
        return _rayjob_status(kubeconfig, namespace, job_id, json_out)
    try:
        with _cluster_head(cluster, cluster_dir, address) as head:
            row = jobs.job_row(jobs.client(jobs.resolve_address(head), gone=jobs.status_gone(job_id)).get_job_info(job_id))
    except RuntimeError:
        raise UsageError(f"no job {job_id!r} on this cluster",
                         hint="trainlift jobs list; a restarted head knows none of the jobs of the one before: "
                              "resubmit the spec, it resumes from the run's latest complete checkpoint") from None
    if json_out:
        print_json({**row, "cause": ended_cause(row["status"], row["message"])})
    else:
        console.print(job_line(row), markup=False, highlight=False)


def _rayjob_status(kubeconfig: Path, namespace: str, name: str, json_out: bool) -> None:
    """A RayJob's place in Kueue: its Workload's state, with its queue position while pending."""
    from trainlift.cloud.capacity import Unknown
    from trainlift.errors import TrainliftError
    from trainlift.job_state import workload_line
    from trainlift.ops.kube import kube_for

    got = kube_for(kubeconfig).rayjob_workload(namespace, name)
    if isinstance(got, Unknown):
        raise TrainliftError(f"cannot read RayJob {namespace}/{name}'s Kueue Workload: {got.reason}")
    workload, summary = got
    line = (workload_line(workload, summary) if workload else
            "no Kueue Workload (the RayJob has no kueue.x-k8s.io/queue-name label, or Kueue has not seen it yet)")
    if json_out:
        print_json({"rayjob": name, "namespace": namespace, "state": line,
                    "workload_status": (workload or {}).get("status")})
    else:
        console.print(f"{name}: {line}", markup=False, highlight=False)


@jobs_app.command("logs")
def jobs_logs(job_id: str = typer.Argument(..., help="The job's submission id, or any prefix of it that names one job."),
              address: Optional[str] = typer.Option(None, help=ADDRESS_HELP),
              follow: bool = typer.Option(False, "--follow", help="Keep streaming until the job ends."),
              raw: bool = typer.Option(False, "--raw", help="The job's log byte for byte, as Ray keeps it (Ray's and "
                                       "the libraries' lines, the `trainlift-progress {json}` lines): for grep and "
                                       "`doctor nccl-log`."),
              cluster: Optional[Path] = CLUSTER_OPTION, cluster_dir: Optional[Path] = DIR_OPTION,
              json_out: bool = typer.Option(False, "--json", help="The job's id, status, log (byte for byte) and "
                                            "progress rows as JSON.")) -> None:
    """A job's log as `trainlift train` prints it off a terminal: its progress lines (step, loss, the latest
    evaluation, tokens/s, ETA) and trainlift's own lines, without what Ray and the libraries print (--raw, --json
    have everything). With --follow on a terminal, its progress as a bar and every other line as it comes."""
    from trainlift.cli.progress import JobLogLines
    from trainlift.ops import jobs
    from trainlift.ops.ray_output import is_ray_line

    with _cluster_head(cluster, cluster_dir, address) as head:
        job_client = jobs.client(jobs.resolve_address(head))
        job_id = jobs.job_with_prefix(job_client, job_id)
        if json_out:
            log = job_client.get_job_logs(job_id)
            rows = [row for row in map(jobs.parse_progress, log.splitlines()) if row is not None]
            print_json({"submission_id": job_id, "status": str(job_client.get_job_status(job_id).value),
                        "log": log, "progress": rows})
            return
        if not follow:
            log = job_client.get_job_logs(job_id)
            if raw:
                sys.stdout.write(log)
                return
            readable = JobLogLines(jobs.parse_progress, is_ray_line)
            for line in [*(text for line in log.splitlines() for text in readable(line)), *readable.flush()]:
                _print_line(line)
            return
        if raw:
            status = jobs.follow(job_client, job_id, lambda line: sys.stdout.write(line + "\n"))
        elif console.is_terminal:
            status, _ = _follow(job_client, job_id, None, False, time.time(), verbose=True)
        else:
            status, _ = _follow_lines(job_client, job_id, time.time())
    raise typer.Exit(0 if status == "SUCCEEDED" else 1)


@jobs_app.command("stop")
def jobs_stop(job_id: str, address: Optional[str] = typer.Option(None, help=ADDRESS_HELP),
              cluster: Optional[Path] = CLUSTER_OPTION, cluster_dir: Optional[Path] = DIR_OPTION,
              json_out: bool = typer.Option(False, "--json")) -> None:
    """Ask a running job to stop."""
    from trainlift.ops import jobs

    with _cluster_head(cluster, cluster_dir, address) as head:
        stopped = jobs.client(jobs.resolve_address(head)).stop_job(job_id)
    if json_out:
        print_json({"submission_id": job_id, "stop_requested": bool(stopped)})
    else:
        console.print(f"stop requested for {job_id}" if stopped else f"{job_id} was not running")
