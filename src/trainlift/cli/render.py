"""`trainlift profiles` and `trainlift render`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from trainlift import catalog
from trainlift.cli.app import app, console, err_console, print_json
from trainlift.config.cluster import ClusterSpec, cluster_spec_from_yaml
from trainlift.config.job import load_job_spec
from trainlift.errors import SpecError, UsageError


@app.command("profiles")
def profiles(json_out: bool = typer.Option(False, "--json", help="Print JSON (every field and its source).")) -> None:
    """The hardware catalog: GPU worker types and CPU types for the system group."""
    rows = [catalog.lookup(name) for name in catalog.instance_types()]
    if json_out:
        print_json([{**p.model_dump(), "efa_supported": p.efa_supported} for p in rows])
        return
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True, caption="net: Gb/s; bf16: dense TFLOP/s per GPU; "
                  "busbw: fabric check floor, GB/s; trainlift profiles --json names each figure's source")
    for column in ("type", "GPU", "GPUs", "GPU GiB", "vCPU", "GiB", "net", "EFA", "GDR", "bf16", "busbw"):
        left = column in ("type", "GPU")
        table.add_column(column, justify="left" if left else "right", no_wrap=left)
    for p in sorted(rows, key=lambda p: (p.gpus == 0, p.instance_type)):
        table.add_row(
            p.instance_type, p.gpu_model or "-", str(p.gpus),
            f"{p.gpu_memory_mib / 1024:.0f}" if p.gpus else "-", str(p.vcpus), f"{p.memory_gib:.0f}",
            ("≤" if p.network_burst else "") + f"{p.network_gbps:g}",
            str(p.efa_interfaces) if p.efa_supported else "no", "yes" if p.gpudirect_rdma else "no",
            f"{p.peak_bf16_flops_per_gpu / 1e12:.0f}" if p.gpus else "-",
            f"{p.busbw_floor_gbps:g}" if p.busbw_floor_gbps is not None else "-",
        )
    console.print(table)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise SpecError(f"{path}: no such spec file") from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot read ({exc.strerror})") from None


def _job_inputs(job_path: Path, job, cluster: ClusterSpec, shutdown: bool, working_dir: str | None,
                trainlift_uri: str | None):
    from trainlift.catalog.packages import image_lock, runtime_pip
    from trainlift.render import JobInputs

    pip = runtime_pip(job, image_lock(cluster.image.uri))
    overrides: tuple[str, ...] = ()
    if "://" not in job.run.storage:
        if cluster.storage is None:
            raise SpecError(
                f"{job_path}: run.storage: {job.run.storage!r} is a local directory; checkpoints of a "
                "multi-node job need storage every node shares",
                hint="set storage in the cluster spec, or an s3:// run.storage in the job spec",
            )
        overrides = (f"run.storage={cluster.storage.path}",)
    try:
        spec_path = job_path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        spec_path = job_path.name
    workers = job.scaling.min_workers  # an elastic job can start on its minimum
    return JobInputs(
        name=job.run.name,
        spec_path=spec_path,
        workers=workers,
        working_dir=working_dir,
        trainlift_uri=trainlift_uri,
        shutdown_after_finish=shutdown,
        overrides=overrides,
        pip=tuple(pip),
        max_hours=job.run.max_hours,
    )


def _cache_account(cluster: ClusterSpec) -> ClusterSpec:
    """`image.cache: ecr` without `image.account`: the account of this machine's credentials, where there are any
    (render then refuses the spec in one line without one)."""
    from trainlift.cloud.aws import Aws, CredentialsError
    from trainlift.render.image_cache import with_account

    if cluster.image.cache != "ecr" or cluster.image.account:
        return cluster
    try:
        return with_account(cluster, Aws(cluster.region).identity()["account"])
    except CredentialsError:
        return cluster


def _credentials_present() -> bool:
    import boto3

    return boto3.session.Session().get_credentials() is not None


def _check_image(cluster: ClusterSpec) -> str | None:
    """With AWS credentials on this machine, ask the image's registry whether the image the pods run exists: a
    SpecError in one line when it does not; its digest (ECR Public gives one) when it does. Without credentials,
    render stays offline."""
    from trainlift.catalog.lookup import pinned_image
    from trainlift.cloud import ecr

    if not _credentials_present():
        return None
    found = ecr.check_image(pinned_image(cluster.image.uri) or cluster.image.uri)  # as ops.lifecycle.upstream_image
    if isinstance(found, ecr.ImageLookup) and not found.found:
        raise SpecError(f"image.uri: {found.absent_line()}", hint=ecr.ABSENT_HINT)
    return found.digest if isinstance(found, ecr.ImageLookup) and found.digest else None


def _pin_image(cluster: ClusterSpec) -> tuple[ClusterSpec, str | None]:
    """The spec with its image pinned by digest where its registry can be asked; otherwise a warning that names
    the image the pods run instead (the catalog's release tag for a floating DLC tag)."""
    from trainlift.cloud import ecr

    from trainlift.render.raycluster import image_ref

    cluster = _cache_account(cluster)
    upstream_digest = _check_image(cluster)
    target = image_ref(cluster)
    if "@" in target:
        return cluster, None
    found = ecr.image_digest(target) if upstream_digest is None or cluster.image.cache == "ecr" else upstream_digest
    if isinstance(found, str):
        image = cluster.image.model_copy(update={"uri": f"{target}@{found}"})
        return cluster.model_copy(update={"image": image}), None
    return cluster, f"image not pinned by digest: {found.reason}; the pods run {target}"


def _job_s3_uses(job, cluster: ClusterSpec) -> list:
    """The S3 URIs the job spec reads and writes, for render to check against the pods' S3 role; first, one
    line when the pods would lack the job's MLflow credentials."""
    from trainlift.render.job_secrets import mlflow_secret_problems
    from trainlift.render.problems import raise_problems
    from trainlift.render.s3_access import job_s3_uses

    if job is None:
        return []
    raise_problems(mlflow_secret_problems(cluster, job))
    return job_s3_uses(job)


def sized_system(cluster: ClusterSpec) -> ClusterSpec:
    """The spec with a system node type that keeps the DaemonSets' headroom (render.fit), saying so when it changed."""
    from trainlift.render.fit import with_system_headroom

    cluster, note = with_system_headroom(cluster)
    if note:
        err_console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
    return cluster


@app.command("render")
def render(
    spec_path: Path = typer.Argument(..., metavar="CLUSTER_SPEC", help="Cluster spec (YAML)."),
    out: Optional[Path] = typer.Option(None, "-o", "--out", help="Directory to write the manifests to."),
    check: bool = typer.Option(False, "--check", help="Validate only; write nothing."),
    job: Optional[Path] = typer.Option(None, "--job", help="Also render a RayJob for this job spec."),
    job_shutdown: bool = typer.Option(
        False, "--job-shutdown",
        help="The RayJob brings its own RayCluster and deletes it when the job ends (queued, under a scheduler) "
        "(default: run on the rendered standing RayCluster, through clusterSelector, outside the queue).",
    ),
    working_dir: Optional[str] = typer.Option(
        None, "--working-dir", help="Remote URI (s3://.../code.zip) of the job's working dir for the RayJob."
    ),
    trainlift_uri: Optional[str] = typer.Option(
        None, "--trainlift-uri", help="Remote URI of trainlift's wheel, as printed by "
        "`trainlift package --upload s3://bucket/code/`, shipped to the RayJob as py_modules."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Render eksctl, Helm, RayCluster (and RayJob) manifests from one cluster spec; validate them first."""
    from trainlift.render import admissions, image_ref, pod_placements, render_cluster
    from trainlift.render.cold_start import cold_start
    from trainlift.render.eksctl import image_pulls
    from trainlift.render.helm import render_helm_releases

    if out is None and not check:
        raise UsageError("render: pass -o DIR to write the manifests, or --check to validate only")
    if out is not None and check:
        raise UsageError("render: --check writes nothing; drop -o or --check")
    cluster = sized_system(cluster_spec_from_yaml(_read(spec_path), source=str(spec_path)))
    job_spec = load_job_spec(job) if job is not None else None
    inputs = _job_inputs(job, job_spec, cluster, job_shutdown, working_dir, trainlift_uri) if job_spec else None
    cluster, warning = _pin_image(cluster)
    manifests = render_cluster(cluster, inputs, s3_uses=_job_s3_uses(job_spec, cluster))
    if warning:
        err_console.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)
    summary: dict[str, Any] = {
        "spec": str(spec_path),
        "valid": True,
        "fabric": cluster.fabric, "scheduler": cluster.scheduler,
        "image": image_ref(cluster),
        "manifests": [{"path": m.path, "kind": m.kind} for m in manifests],
        "placement": [p.to_dict() for p in pod_placements(cluster, manifests)],
        "admission": admissions(manifests),
        "charts": [{k: r[k] for k in ("name", "chart", "version", "digest", "digestFrom")}
                   for r in render_helm_releases(cluster)],
        "image_pull": image_pulls(cluster),
        "waits": cold_start(cluster).lines(),
    }
    if out is not None:
        for m in manifests:
            target = out / m.path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(m.text())
        summary["out"] = str(out)
        summary["written"] = [str(out / m.path) for m in manifests]
    if json_out:
        print_json(summary)
    else:
        _print_rendered(cluster, manifests, out)


def _print_rendered(cluster: ClusterSpec, manifests: list, out: Path | None) -> None:
    from trainlift.render import admissions, pod_placements
    from trainlift.render.cold_start import cold_start
    from trainlift.render.eksctl import image_pulls
    from trainlift.render.helm import digest_line, render_helm_releases

    verb = "wrote" if out is not None else "valid"
    for m in manifests:
        where = out / m.path if out is not None else m.path
        console.print(f"{verb}  {where}  [dim]{m.kind}[/]", highlight=False)
    for p in pod_placements(cluster, manifests):
        console.print(f"fits   {p.line()}", highlight=False)
    for line in admissions(manifests):
        console.print(f"queue  {line}", highlight=False)
    for release in render_helm_releases(cluster):
        console.print(f"chart  {digest_line(release)}", highlight=False)
    for line in image_pulls(cluster).values():
        console.print(f"pull   {line}", highlight=False)
    for line in cold_start(cluster).lines():
        console.print(f"wait   {line}", highlight=False)
    console.print(
        f"{len(manifests)} manifests, fabric {cluster.fabric}, {cluster.gpu_count} GPUs, scheduler "
        f"{cluster.scheduler}, checked against eksctl v0.230.0, nodeadm v20260724, KubeRay v1.7.0, Kueue v0.19.2, Volcano v1.15.1 CRDs and Kubernetes "
        f"{cluster.kubernetes_version} schemas",
        highlight=False,
    )
