"""`trainlift estimate`: will the job fit, how long will it take, what will it cost, before anything starts."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from trainlift.cli.app import app, console, print_json
from trainlift.errors import UsageError

GIB = 2**30
_ITEMS = {
    "parameters": "weights (fp32 master copy; LoRA: the frozen base in the compute dtype), sharded",
    "gradients": "fp32, sharded (unsharded between micro-batches when gradients sync at the last one)",
    "optimizer": "AdamW's two fp32 moments, sharded",
    "unsharded": "FSDP's gathered layers and LM head, and their gradients before the reduce-scatter",
    "activations": "what autograd keeps for the backward pass",
    "loss": "one chunk of fp32 logits and its gradient",
    "runtime": "the process itself",
}


@app.command("estimate")
def estimate(
    spec_file: Path = typer.Argument(..., help="Job spec, e.g. examples/qwen2.5-1.5b-eks.yaml."),
    cluster: Optional[Path] = typer.Option(None, "--cluster", help="Cluster spec the job runs on (its GPU group "
                                           "and, for the cost, every node group)."),
    instance: Optional[str] = typer.Option(None, "--instance", help="GPU instance type, e.g. p5.48xlarge "
                                           "(instead of --cluster)."),
    nodes: int = typer.Option(1, "--nodes", min=1, help="Instances of --instance."),
    region: Optional[str] = typer.Option(None, "--region", "-r", help="Region of --instance's price (default: "
                                         "AWS_REGION, AWS_DEFAULT_REGION or the profile's region, else us-east-1); --cluster prices in the "
                                         "spec's region."),
    live: bool = typer.Option(False, "--live", help="Ask AWS's Price List API for today's prices (needs "
                              "credentials) instead of the catalog's dated ones."),
    model_config: Optional[Path] = typer.Option(
        None, "--model-config", help="The model's config.json, read instead of the model's own (e.g. where the hub "
        "is out of reach; examples/model-configs/ has a few)."),
    set_: List[str] = typer.Option([], "--set", metavar="KEY=VALUE", help="Override a job spec field (repeatable)."),
    json_out: bool = typer.Option(False, "--json", help="Print the estimate as JSON."),
) -> None:
    """Memory per GPU item by item, step time, hours and dollars of a job, from its spec, the model's config.json
    and the hardware catalog: no GPU, no weights, nothing started.

    Without --cluster or --instance it estimates `trainlift train` on this machine (CPU workers, fp32, host
    memory). A job that does not fit gets the cheapest changes that would make it fit, each with its new figure.
    Exit code 1 when the job does not fit.

    Example: trainlift estimate examples/qwen2.5-1.5b-eks.yaml --cluster examples/cluster-reference.yaml

    Example: trainlift estimate examples/llama-3.1-70b-eks.yaml --instance p5.48xlarge --nodes 4 --json
    """
    from trainlift.config.job import load_job_spec
    from trainlift.estimate.plan import plan
    from trainlift.estimate.shape import shape_of
    from trainlift.ops.model_config import read_config_file, read_model_config

    if cluster is not None and instance is not None:
        raise UsageError("--cluster and --instance both name the hardware", hint="pass one of them")
    job = load_job_spec(spec_file, list(set_))
    target = _target(cluster, instance, nodes, region, live)
    config = read_config_file(model_config) if model_config else read_model_config(job.model)
    result = plan(job, shape_of(config), target)
    if json_out:
        print_json(result.to_dict())
    else:
        print_estimate(result)
    if not result.fits:
        sys.exit(1)


def _target(cluster: Optional[Path], instance: Optional[str], nodes: int, region: Optional[str], live: bool):
    from trainlift import catalog
    from trainlift.catalog.prices import PRICE_REGION
    from trainlift.cloud.aws import default_region
    from trainlift.estimate.plan import Target

    if cluster is None and instance is None:
        return Target(None, host_memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    if cluster is not None:
        from trainlift.cli.cluster import load_cluster_spec

        spec = load_cluster_spec(cluster)
        types = {w.instance_type for w in spec.workers}
        if len(types) > 1:
            raise UsageError(f"{cluster}: worker groups of {len(types)} instance types",
                             hint="estimate one type at a time with --instance TYPE --nodes N")
        profile = spec.workers[0].profile
        nodes = sum(w.count for w in spec.workers)
        usd, source = _cluster_price(spec, live)
    else:
        profile, region = catalog.lookup(instance), region or default_region() or PRICE_REGION
        usd, source = _instances_price(instance, nodes, region, live)
    if not profile.gpus:
        raise UsageError(f"{profile.instance_type} has no GPUs", hint="estimate a GPU instance type, e.g. "
                         "g6.12xlarge or p5.48xlarge")
    return Target(profile, nodes, usd_per_hour=usd, price_source=source)


def _price(instance_type: str, region: str, live: bool):
    from trainlift import catalog

    if live:
        from trainlift.cloud.aws import Aws

        return Aws(region).on_demand_price(instance_type)
    return catalog.on_demand_price(instance_type, region)


def _describe(price) -> str:
    return (f"AWS Price List API, published {price.as_of.isoformat()}" if price.source == "aws-price-list-api"
            else f"catalog {price.region} on-demand price, checked {price.as_of.isoformat()}")


def _instances_price(instance_type: str, nodes: int, region: str, live: bool):
    price = _price(instance_type, region, live)
    if price is None:
        return None, f"no catalog price for {instance_type} in {region} (pass --live)"
    return nodes * price.usd_per_hour, _describe(price)


def _cluster_price(spec, live: bool):
    """The whole cluster's $/hour, the system group included."""
    from trainlift.estimate.cost import cluster_cost

    cost = cluster_cost(spec, lambda t, r: _price(t, r, True)) if live else cluster_cost(spec)
    if cost.total_usd_per_hour is None or not cost.complete:
        blocks = [g for g in cost.groups if g.price is None and g.why_unknown]
        if blocks:  # --live cannot help: no on-demand price applies
            return None, f"{blocks[0].instance_type}: {blocks[0].why_unknown}"
        return None, f"no price for {', '.join(cost.unknown_types)} in {spec.region} (pass --live)"
    price = next(g.price for g in cost.groups if g.price is not None)
    return cost.total_usd_per_hour, _describe(price) + ", every node group"


def print_estimate(result) -> None:
    d, items = result.to_dict(), result.items
    w = result.workload
    where = "per GPU" if w.gpu else "per worker (host memory)"
    precision = "bf16 compute" if w.bf16 else "fp32"
    mesh = (f"HSDP {w.replicas} x {w.shard_group} (replicate x shard)" if w.replicas > 1
            else f"FSDP over {w.workers}")
    console.print(f"[bold]estimate[/] {result.job.run.name} on {result.target.describe()}: {w.workers} workers, "
                  f"{mesh}, {precision}, activation checkpointing {w.describe_checkpointing()}"
                  f"{', compiled blocks' if w.compiled else ''}", highlight=False)
    unit, size = ("GiB", GIB) if items["total"] >= 4 * GIB else ("MiB", 2**20)
    console.print(f"memory {where}, {unit}", highlight=False)
    for key, note in _ITEMS.items():
        console.print(f"  {key:<12}{items[key] / size:>8.2f}  {note}", highlight=False)
    verdict = "[green]fits[/]" if result.fits else "[bold red]does not fit[/]"
    spare = result.capacity_bytes - items["total"]
    margin = (f"{spare / result.capacity_bytes:.0%} headroom" if result.fits
              else f"{-spare / GIB:.1f} GiB too much")
    console.print(f"  {'total':<12}{items['total'] / size:>8.2f}  of {result.capacity_bytes / size:,.1f}: {verdict} "
                  f"({margin})", highlight=False)
    if not w.gpu:
        console.print("  (memory in use; glibc's malloc keeps what tensors free, so a worker's resident memory can be "
                      "well above it (1.5-2x for a 134M-parameter model): MALLOC_MMAP_THRESHOLD_=131072 in the environment of `trainlift train` holds "
                      "it near the estimate, with slower steps; docs/BENCHMARKS.md benchmark 15)", highlight=False)
    if w.grad_accum == 1:
        console.print("  (gradients grow while activations are freed: the total counts the larger of the two)",
                      highlight=False)
    _print_time(result, d, w)
    if result.job.checkpoint.every_steps:
        where_staged = (f"of the {d['staging_gib']:,.0f} GiB staging volume" if d["staging_gib"] is not None
                        else "in the staging directory")
        ok = "" if result.staging_fits else " [bold red](two do not fit)[/]"
        console.print(f"disk   {d['checkpoint_gib_per_node']:,.1f} GiB per node per checkpoint, "
                      f"{where_staged}{ok}", highlight=False)
    if d["start_s"]:
        start = d["start_s"]
        console.print(f"start  {_took(sum(start.values()))} before the first step on nodes launched for the job: "
                      f"node {_took(start['node'])}, image pull {_took(start['image_pull'])}, weights staged "
                      f"{_took(start['model_staging'])} (assumed; catalog/estimate.yaml cold_start)", highlight=False)
    if d["usd_per_hour"] is not None:
        total = f": ${d['usd_total']:,.2f} for the run, its start included" if d["usd_total"] is not None else ""
        console.print(f"cost   ${d['usd_per_hour']:,.2f}/h ({d['price_source']}){total}", highlight=False)
    elif w.gpu:
        console.print(f"cost   unknown: {d['price_source']}", highlight=False)
    for advice in result.advice:
        mark = "fits" if advice.fits else "still does not fit"
        cost = f", ${advice.usd_per_hour * advice.hours:,.2f}" if advice.hours and advice.usd_per_hour else ""
        console.print(f"  try  {advice.change}: {advice.per_gpu_bytes / GIB:.1f} GiB, {mark}{cost}", highlight=False)


def _print_time(result, d: dict, w) -> None:
    """The time line: the step's FLOPs at the assumed HFU on a GPU; on CPU workers, why there is none."""
    if result.timing:
        t = result.timing
        console.print(f"time   {t.hardware_flops_per_token / 1e9:.2f} GFLOPs/token executed at {d['hfu']:.0%} HFU "
                      f"({d['hfu_basis']}), {t.flops_per_token / 1e9:.2f} of them model FLOPs: {d['mfu']:.0%} MFU; "
                      f"step {t.step_s:.2f} s (compute {t.compute_s:.2f} s, FSDP collectives {t.comm_s:.2f} s); "
                      f"{t.tokens_per_s_per_gpu:,.0f} tokens/s per GPU; {result.job.train.steps} steps: "
                      f"{result.hours:.2f} h", highlight=False)
        if result.reference_s is not None:
            console.print(f"       DPO's reference pass, once at the start: {_took(result.reference_s)} (a forward of "
                          "the preference data, as many tokens as the steps train on; counted in the hours above). "
                          "It holds no second model: LoRA scores with the adapters off, a full fine-tune before its "
                          "first step", highlight=False)
    elif not w.gpu:
        console.print("time   not estimated for CPU workers: the time model is FLOPs at a GPU's measured utilisation, "
                      "which a CPU does not have; `trainlift train` prints tokens/s and an ETA from its first steps",
                      highlight=False)


def check_fits_cluster(job, spec_file: Path, cluster_file: Path, force: bool, json_out: bool) -> None:
    """`submit --cluster`: the job's estimate in one line; a job that does not fit stops here unless `force`.
    A model config out of reach (no hub here) skips the estimate with a warning rather than the submit."""
    from trainlift.cli.app import err_console
    from trainlift.errors import TrainliftError
    from trainlift.estimate.plan import plan
    from trainlift.estimate.shape import shape_of
    from trainlift.ops.model_config import read_model_config

    from trainlift.train.run.mesh import MeshError

    try:
        result = plan(job, shape_of(read_model_config(job.model)), _target(cluster_file, None, 1, None, False),
                      advise=False)
    except MeshError:  # explicit parallel degrees the cluster's nodes cannot hold: refused before anything runs
        raise
    except TrainliftError as exc:
        err_console.print(f"[yellow]estimate skipped:[/] {exc.one_line()}", highlight=False, soft_wrap=True)
        return
    (err_console if json_out else console).print(f"estimate: {summary_line(result)}", highlight=False)
    if not result.fits and not force:
        raise UsageError(f"the job does not fit {result.target.describe()}: {result.items['total'] / GIB:.1f} GiB "
                         f"per GPU of {result.capacity_bytes / GIB:.1f}",
                         hint=f"see `trainlift estimate {spec_file} --cluster {cluster_file}` for what would "
                         "make it fit, or pass --force")
    if not result.staging_fits and not force:
        raise UsageError(f"two checkpoints of {result.checkpoint_bytes_per_node / GIB:.0f} GiB per node do not fit "
                         f"the {result.staging_bytes / GIB:.0f} GiB staging volume of "
                         f"{result.target.instance.instance_type}",
                         hint="add nodes (each holds a smaller part), use LoRA, or pass --force")


def summary_line(result) -> str:
    d = result.to_dict()
    fits = "fits" if result.fits else "DOES NOT FIT"
    parts = [f"{fits} ({result.items['total'] / GIB:.1f} of {result.capacity_bytes / GIB:.1f} GiB per GPU)"]
    if result.hours is not None:
        parts.append(f"{result.hours:.2f} h for {result.job.train.steps} steps")
    if d["usd_total"] is not None:
        parts.append(f"${d['usd_total']:,.2f} at ${d['usd_per_hour']:,.2f}/h")
    return ", ".join(parts)


def _took(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 60 else f"{seconds / 60:.1f} min"
