"""`trainlift doctor`: the stack on this machine or every node, NCCL transport from logs, fabric bandwidth."""

from __future__ import annotations

import os
import sys
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer
from rich.table import Table
from rich.text import Text

from trainlift.cli.app import app, console, print_json
from trainlift.doctor.rules import Finding, has_errors, sort_findings
from trainlift.errors import UsageError

if TYPE_CHECKING:
    from trainlift.doctor.packages import JobPackages
    from trainlift.doctor.probe import Facts

doctor_app = typer.Typer(
    rich_markup_mode=None,  # plain help: flags without a type, values by their metavar
    help="Prove the stack and the fabric: versions, EFA/NCCL setup, transport, bandwidth.",
    invoke_without_command=True,
    no_args_is_help=False,
)
app.add_typer(doctor_app, name="doctor")


class Fabric(str, Enum):
    efa = "efa"
    socket = "socket"
    any = "any"


_STYLE = {"error": "bold red", "warning": "yellow", "ok": "green"}
_FACT_ROWS = (
    "hostname", "instance_type", "python", "torch", "torch_cuda", "torch_cudnn", "torch_nccl", "ray", "transformers",
    "gpu_count", "gpu_model", "attention", "driver", "driver_cuda", "ofi_plugin", "ofi_plugin_version", "ofi_plugin_missing_deps",
    "libfabric", "efa_installer", "fi_info_efa", "uverbs", "memlock_bytes", "shm_bytes", "mlflow",
)


@doctor_app.callback()
def doctor(
    ctx: typer.Context,
    address: Optional[str] = typer.Option(
        None, "--address", help="Probe every node of a Ray cluster: its dashboard http://HEAD:8265 (the probe runs "
        "there as a Ray job, whatever this machine's Ray and Python versions), or HOST:6379 / auto from a node."),
    expect_fabric: Fabric = typer.Option(Fabric.any, "--expect-fabric", help="The fabric the job needs."),
    mlflow_uri: Optional[str] = typer.Option(
        None, "--mlflow-uri", envvar="MLFLOW_TRACKING_URI", show_envvar=False,
        help="Also check that this MLflow server (default: MLFLOW_TRACKING_URI) answers with the credentials the "
        "environment holds (MLFLOW_TRACKING_TOKEN, or _USERNAME and _PASSWORD), on every node with --address."),
    job: Optional[Path] = typer.Option(
        None, "--job", metavar="SPEC", help="Also check the Python packages this job spec imports beyond trainlift's "
        "core (peft for model.lora, tensorboard / mlflow-skinny for run.trackers, each runtime.pip line), on every "
        "node with --address. A missing one is a warning here, before the job (render and submit put what the image "
        "lacks in the job's runtime_env), and an error inside the job."),
    storage: Optional[str] = typer.Option(
        None, "--storage", metavar="S3_URI", help="Also check that this machine (every node with --address, with the "
        "pods' own role) may use this run storage as a job does: HeadBucket, then put, get and delete of a probe "
        "object under it; one finding per refusal, naming the permission. Default: run.storage of --job, when on S3."),
    as_json: bool = typer.Option(False, "--json", help="Print every fact and finding as JSON."),
) -> None:
    """Check this machine's stack, or every node's with --address (then run `doctor nccl-log` / `doctor fabric`)."""
    if ctx.invoked_subcommand is not None:
        return
    env_vars = {**_mlflow_env(mlflow_uri), **_job_env(job), **_storage_env(storage, job)}
    os.environ.update(env_vars)
    if address:
        _doctor_cluster(address, expect_fabric.value, as_json, env_vars)
        return
    from trainlift.doctor.packages import job_package_findings
    from trainlift.doctor.probe import probe
    from trainlift.doctor.rules import stack_rules
    from trainlift.doctor.storage import storage_findings

    facts = probe()
    findings = sort_findings(stack_rules(facts, expect_fabric.value) + job_package_findings(facts, _wanted_packages())
                             + storage_findings(facts))
    if as_json:
        print_json({"facts": facts.to_dict(), "findings": [f.to_dict() for f in findings], "ok": not has_errors(findings)})
    else:
        console.print(_facts_table(facts))
        _print_findings(findings)
    _exit(findings)


def _facts_table(facts: Facts) -> Table:
    from trainlift.doctor.packages import packages_line

    table = Table(title=f"facts: {facts.hostname}", show_header=False)
    for key in _FACT_ROWS:
        value = getattr(facts, key)
        table.add_row(key, "unlimited" if key == "memlock_bytes" and value is None else _cell(value))
    if facts.job_packages:
        table.add_row("job_packages", packages_line(facts.job_packages))
    for key, value in facts.env.items():
        table.add_row(f"env.{key}", value)
    return table


def _job_env(spec_path: Path | None) -> dict[str, str]:
    """What the probe needs in every node's environment to look for the job's packages (doctor.packages)."""
    if spec_path is None:
        return {}
    from trainlift.config.job import load_job_spec
    from trainlift.doctor.packages import job_packages

    return job_packages(load_job_spec(spec_path)).env()


def _wanted_packages() -> JobPackages:
    """The packages this process's environment names: by --job, or by the job that runs doctor inside it."""
    from trainlift.doctor.packages import ENV_VAR, from_env

    try:
        return from_env(os.environ)
    except ValueError as exc:
        raise UsageError(str(exc), hint=f"unset {ENV_VAR}, or pass --job SPEC") from None


def _storage_env(uri: str | None, spec_path: Path | None) -> dict[str, str]:
    """The run storage every node's probe checks: --storage, else the --job spec's run.storage when on S3."""
    from trainlift.doctor.storage import storage_env

    if uri is None and spec_path is not None:
        from trainlift.config.job import load_job_spec

        run_storage = load_job_spec(spec_path).run.storage
        uri = run_storage if run_storage.startswith("s3://") else None
    if uri is not None and (not uri.startswith("s3://") or len(uri) <= len("s3://")):
        raise UsageError(f"--storage {uri!r} is not an s3:// URI", hint="e.g. --storage s3://my-bucket/ray-train")
    return storage_env(uri)


def _mlflow_env(uri: str | None) -> dict[str, str]:
    """What the probe needs in every node's environment to check MLflow: the URI, never a credential."""
    from trainlift.redact import refuse_uri_credentials

    if not uri:
        return {}
    refuse_uri_credentials("--mlflow-uri", uri)
    return {"MLFLOW_TRACKING_URI": uri}


def _doctor_cluster(address: str, expect: str, as_json: bool, env_vars: dict[str, str]) -> None:
    if address.startswith(("http://", "https://")):
        from trainlift.doctor.remote import run_on_cluster

        report = run_on_cluster(address.rstrip("/"), expect, env_vars)
    else:
        report = _probe_cluster(address, expect, env_vars)
    findings = [Finding(**f) for f in report["findings"]]
    if as_json:
        print_json(report)
    else:
        _print_nodes(report)
        _print_findings(findings)
    _exit(findings)


def _probe_cluster(address: str, expect: str, env_vars: dict[str, str]) -> dict[str, Any]:
    """Connected to the cluster as a driver (from one of its nodes, or a machine with its Ray and Python)."""
    import ray

    from trainlift.doctor.nodes import connect, probe_nodes
    from trainlift.doctor.packages import job_package_findings
    from trainlift.doctor.rules import differences, judge_nodes
    from trainlift.doctor.storage import storage_findings

    # `auto`: on a node, inside a job that brought trainlift and its environment
    connect(address, ship_code=address != "auto", env_vars=env_vars if address != "auto" else None)
    try:
        nodes = probe_nodes()
    finally:
        ray.shutdown()
    findings: list[Finding] = [Finding("node_probe", "error", f"probe failed on {n.name}: {n.error}", node=n.name)
                               for n in nodes if n.facts is None]
    wanted = _wanted_packages()
    findings += [x for n in nodes if n.facts for x in job_package_findings(n.facts, wanted, n.name)]
    findings += [x for n in nodes if n.facts for x in storage_findings(n.facts, n.name)]
    findings = sort_findings(findings + judge_nodes([(n.name, n.facts, n.is_head) for n in nodes if n.facts], expect))
    return {"address": address, "nodes": [n.to_dict() for n in nodes],
            "differences": differences([(n.name, n.facts) for n in nodes if n.facts is not None]),
            "findings": [f.to_dict() for f in findings], "ok": not has_errors(findings)}


def _print_nodes(report: dict[str, Any]) -> None:
    from trainlift.doctor.packages import packages_line
    from trainlift.doctor.probe import Facts
    from trainlift.doctor.rules import comparable

    probed = [(n["name"], Facts.from_dict(n["facts"])) for n in report["nodes"] if n["facts"] is not None]
    table = Table(title=f"{len(report['nodes'])} nodes at {report['address']} (red: differs across nodes)")
    table.add_column("fact")
    for name, _ in probed:
        table.add_column(name)
    values = [comparable(f) for _, f in probed]
    for key in sorted({k for v in values for k in v}, key=lambda k: (k.startswith("env."), k)):
        row = [_cell(v.get(key)) for v in values]
        style = "bold red" if key in report["differences"] else None
        table.add_row(key, *[f"[{style}]{c}[/]" if style and i else c for i, c in enumerate(row)])
    if any(f.job_packages for _, f in probed):
        table.add_row("job_packages", *[packages_line(f.job_packages) or "-" for _, f in probed])
    console.print(table)


@doctor_app.command("nccl-log")
def nccl_log(
    files: list[Path] = typer.Argument(..., help="NCCL_DEBUG=INFO output ('-' reads stdin)."),
    expect: Fabric = typer.Option(Fabric.any, "--expect", help="Exit 1 unless every file shows this transport."),
    as_json: bool = typer.Option(False, "--json", help="Print verdicts and evidence as JSON."),
) -> None:
    """Classify the transport NCCL used (efa, ib, socket, none, unknown), per file and per host:rank; `none` means
    NCCL found no usable network plugin at all (`Failed to initialize any NET plugin`)."""
    from trainlift.doctor.nccl_log import classify_log_text, combine_transports

    verdicts = [classify_log_text(_read_log(path), source=str(path)) for path in files]
    overall = combine_transports(v.transport for v in verdicts)
    flags = [v.gdrdma for v in verdicts if v.gdrdma is not None]
    mismatched = [v for v in verdicts if expect != Fabric.any and v.transport != expect.value]
    if as_json:
        print_json({
            "transport": overall, "gdrdma": all(flags) if flags else None, "expect": expect.value,
            "ok": not mismatched, "files": [v.to_dict() for v in verdicts],
        })
    else:
        for v in verdicts:
            # Log lines and file names are shown as written: `[send]` is not markup, `:1234:` not an emoji code.
            table = Table(title=Text(f"{v.source}: {v.transport} (GPUDirect RDMA: {_cell(v.gdrdma)})"))
            for column in ("process", "transport", "GDRDMA", "evidence"):
                table.add_column(column)
            for s in v.streams:
                table.add_row(*(Text(cell) for cell in (s.key, s.transport, _cell(s.gdrdma),
                                                        "\n".join(s.evidence[:3]) or "-")))
            console.print(table)
        for v in mismatched:
            console.print(Text(f"expected {expect.value}, {v.source} shows {v.transport}", style="bold red"))
    if mismatched:
        raise typer.Exit(1)


@doctor_app.command("topology")
def topology(
    ray_cluster: str = typer.Argument(..., help="The job's RayCluster (a RayJob's is named in its status)."),
    kubeconfig: Path = typer.Option(..., help="The cluster's kubeconfig, e.g. .trainlift/<cluster>/kubeconfig."),
    namespace: str = typer.Option("default", help="The RayCluster's namespace."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """How many layer-3 network nodes (EKS label topology.k8s.aws/network-node-layer-3) a job's nodes span."""
    from trainlift.cloud.capacity import Unknown
    from trainlift.doctor.topology import layer3_line, layer3_span, pod_node_names
    from trainlift.errors import TrainliftError
    from trainlift.ops.kube import kube_for

    got = kube_for(kubeconfig).job_topology(namespace, ray_cluster)
    if isinstance(got, Unknown):
        raise TrainliftError(f"cannot read RayCluster {namespace}/{ray_cluster}'s nodes: {got.reason}")
    pods, nodes = got
    span = layer3_span(nodes, pod_node_names(pods))
    if as_json:
        print_json({"ray_cluster": ray_cluster, "namespace": namespace, **span})
    else:
        console.print(f"{ray_cluster}: {layer3_line(span)}", markup=False, highlight=False)


@doctor_app.command("fabric")
def fabric(
    address: Optional[str] = typer.Option(None, "--address", help="Ray cluster address; default: a local Ray."),
    workers: int = typer.Option(2, "--workers", min=1, help="Ray Train workers (one per GPU on GPU nodes)."),
    sizes: str = typer.Option("1M,16M,128M", "--sizes", help="Buffer sizes (K, M, G = powers of 1024)."),
    instance_type: Optional[str] = typer.Option(None, "--instance-type", help="Compare with this type's busbw floor."),
    floor_gbps: Optional[float] = typer.Option(
        None, "--floor-gbps", min=0, help="Fail when all_reduce busbw at the largest size is below this many GB/s "
        "(instead of the instance type's floor)."),
    as_json: bool = typer.Option(False, "--json", help="Print one row per op and size as JSON."),
) -> None:
    """Time all_reduce, all_gather and reduce_scatter across Ray Train workers; report algbw and busbw."""
    import ray

    from trainlift.doctor.fabric import fabric_findings, parse_sizes, run_fabric
    from trainlift.doctor.nodes import connect
    from trainlift.doctor.probe import detect_instance_type
    from trainlift.ops import localray

    byte_sizes = parse_sizes(sizes)
    profile = _instance_profile(instance_type)
    if profile is None and instance_type is None:
        detected = detect_instance_type()
        profile = _instance_profile(detected, strict=False) if detected else None
    if address:
        connect(address)
    elif not ray.is_initialized():
        localray.start_in_process()
    try:
        result = run_fabric(workers=workers, sizes=byte_sizes)
    finally:
        ray.shutdown()
    name = profile.instance_type if profile else None
    floor = floor_gbps if floor_gbps is not None else profile.busbw_floor_gbps if profile else None
    result.findings = sort_findings(fabric_findings(result, name, floor, profile.efa_interfaces if profile else 0,
                                                    floor_from="given" if floor_gbps is not None else None))
    if as_json:
        print_json({**result.to_dict(), "instance_type": name, "floor_gbps": floor, "ok": not has_errors(result.findings)})
    else:
        table = Table(title=f"{result.backend}, {result.world_size} workers" + (f", {name}" if name else ""))
        for column in ("op", "size", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "method"):
            table.add_column(column, justify="right" if "(" in column else "left")
        for r in result.rows:
            table.add_row(r.op, _bytes(r.bytes), f"{r.time_us:.1f}", f"{r.algbw_gbps:.3f}", f"{r.busbw_gbps:.3f}", r.method)
        console.print(table)
        _print_findings(result.findings)
    _exit(result.findings)


def _instance_profile(instance_type: str | None, strict: bool = True) -> Any:
    if not instance_type:
        return None
    from trainlift.catalog import lookup
    from trainlift.errors import SpecError

    try:
        return lookup(instance_type)
    except SpecError:
        if strict:
            raise
        return None


def _read_log(path: Path) -> str:
    if str(path) == "-":
        return sys.stdin.read()
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None


def _print_findings(findings: list[Finding]) -> None:
    with_node = any(f.node for f in findings)
    table = Table(title="findings")
    for column in ("severity", "node", "finding", "fix") if with_node else ("severity", "finding", "fix"):
        table.add_column(column)
    for f in findings:
        cells = [f"[{_STYLE[f.severity]}]{f.severity}[/]", f.node or "", f.message, f.fix]
        table.add_row(*(cells if with_node else cells[:1] + cells[2:]))
    console.print(table)
    counts = {s: sum(f.severity == s for f in findings) for s in _STYLE}
    console.print(", ".join(f"{n} {s}" for s, n in counts.items()))


def _exit(findings: list[Finding]) -> None:
    if has_errors(findings):
        raise typer.Exit(1)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) or "-"
    return str(value)


def _bytes(n: int) -> str:
    for unit, scale in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return f"{n}B"
