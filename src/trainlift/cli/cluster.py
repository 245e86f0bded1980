"""`trainlift cluster up | status | down`: one planned, resumable operation on EKS."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from trainlift.cli.app import app, console, err_console, print_json
from trainlift.errors import TrainliftError, UsageError

cluster_app = typer.Typer(
    rich_markup_mode=None,  # plain help: flags without a type, values by their metavar
    help="The EKS cluster of a cluster spec: plan first, then apply; re-running continues where it stopped.",
    no_args_is_help=True,
)
app.add_typer(cluster_app, name="cluster")

SPEC = typer.Argument(..., metavar="CLUSTER_SPEC", help="Cluster spec (YAML), e.g. examples/cluster-reference.yaml.")
DIR = typer.Option(None, "--dir", help="Where the rendered files and kubeconfig go (default .trainlift/<name>/).")
JSON = typer.Option(False, "--json", help="Print the plan (observations, actions, commands) as JSON.")
FORCE = typer.Option(False, "--force", help="Act on a cluster that does not carry trainlift's tag (one trainlift did not create).")
_MARK = {"nothing": "dim", "blocked": "bold red", "wait": "yellow", "check": "cyan"}


def load_cluster_spec(path: Path):
    from trainlift.cli.render import _read, sized_system
    from trainlift.config.cluster import cluster_spec_from_yaml

    return sized_system(cluster_spec_from_yaml(_read(path), source=str(path)))


def print_plan(plan, header: str) -> None:
    todo = len(plan.todo)
    console.print(f"[bold]{header}[/]: {len(plan.steps)} steps, {todo} with work to do", highlight=False)
    for i, step in enumerate(plan.steps, 1):
        style = _MARK.get(step.action, "bold green")
        console.print(f"{i:>2}. {step.title}", highlight=False)
        console.print(f"    observed: {step.observed}  ->  [{style}]{step.action}[/]", highlight=False)
        if step.note:
            console.print(f"    {step.note}", highlight=False, style="red" if step.action == "blocked" else None)
        for op in step.ops:
            console.print(f"    $ {op.text()}", highlight=False, soft_wrap=True)
        if step.fix:
            console.print(f"    fix: {step.fix}", highlight=False, soft_wrap=True)


def _capacity_lines(prepared) -> None:
    for name, p in prepared.placements.items():
        where = p.zone or "no AZ"
        console.print(f"capacity  {name}: {where} ({p.blocking or p.reason})", highlight=False)


def _scheduling_lines(prepared) -> None:
    for line in prepared.files.scheduling:
        console.print(line, highlight=False, soft_wrap=True)


def _unknown_lines(seen) -> None:
    if seen.assumed:
        console.print(f"[yellow]{seen.assumed}[/]: the plan is what a new cluster needs", highlight=False)
    for area, why in seen.unknown.items():
        console.print(f"[yellow]unknown[/] {area}: {why}", highlight=False)


def _cost(spec):
    from trainlift.estimate.cost import cluster_cost

    return cluster_cost(spec)


def _cost_lines(spec) -> None:
    for line in _cost(spec).lines():
        console.print(line, highlight=False, markup=False, soft_wrap=True)


def _unknowns(seen) -> dict[str, str]:
    return {**({"aws": seen.assumed} if seen.assumed else {}), **seen.unknown}


def _confirm(yes: bool, what: str) -> None:
    if yes:
        return
    if not sys.stdin.isatty():
        raise UsageError(f"{what} needs confirmation", hint="pass --yes to apply without a prompt")
    if not typer.confirm(f"{what}?", default=False):
        raise TrainliftError("nothing applied")


def _apply(prepared, plan, json_out: bool, extra: dict | None = None) -> None:
    from trainlift.ops.apply_plan import apply, image_pull_line

    out = err_console if json_out else console

    def on_step(step) -> None:
        out.print(f"[bold]==>[/] {step.title}: {step.action}", highlight=False)

    done = apply(prepared, plan, echo=lambda line: out.print(f"    {line}", highlight=False, markup=False),
                 on_step=on_step)
    pulled = image_pull_line(prepared.spec, prepared.files) if plan.verb == "up" else ""
    if json_out:
        print_json({**plan.to_dict(), **(extra or {}), "applied": done, **({"image_pull": pulled} if pulled else {})})
    else:
        if pulled:
            console.print(pulled, highlight=False, markup=False, soft_wrap=True)
        console.print(f"[green]done[/]: {len(done)} steps applied", highlight=False)


@cluster_app.command("up")
def up(
    spec_path: Path = SPEC,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan, its commands and the files; change nothing."),
    show_files: bool = typer.Option(False, "--show-files", help="Also print every rendered file."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Apply without asking."),
    force: bool = FORCE,
    root: Optional[str] = DIR,
    json_out: bool = JSON,
) -> None:
    """Bring the cluster up, or continue bringing it up after any failure.

    Steps: control plane, node groups (AZ from the capacity check unless pinned), NVIDIA and EFA device plugins, KubeRay, namespace and service account, the RayCluster; then waits for the head, the workers and every node's GPUs and EFA, and runs `trainlift doctor`.

    The plan is printed first: each step with what was observed and what will be done. A step that cannot succeed (a missing tool, no capacity, a quota shortfall, a cluster being deleted, a cluster trainlift did not create) blocks the plan before anything is created. A dry run without AWS credentials plans a new cluster and says what it could not look up.

    Example: trainlift cluster up examples/cluster-reference.yaml --dry-run
    """
    from trainlift.ops.lifecycle import prepare
    from trainlift.ops.plan import plan_up

    spec = load_cluster_spec(spec_path)
    prepared = prepare(spec, root, write=True, need_credentials=not dry_run)
    plan = plan_up(prepared.spec, prepared.seen, prepared.placements, prepared.files, force=force)
    cost = {"cost": _cost(prepared.spec).to_dict()}
    if json_out and (dry_run or plan.blocked):
        print_json({**plan.to_dict(), **cost, "files": prepared.written, "unknown": _unknowns(prepared.seen),
                    "scheduling": list(prepared.files.scheduling)})
    elif not json_out:
        _capacity_lines(prepared)
        _scheduling_lines(prepared)
        print_plan(plan, f"cluster up {spec.name} ({spec.region})" + (" --dry-run" if dry_run else ""))
        _unknown_lines(prepared.seen)
        _cost_lines(prepared.spec)
        if prepared.written:
            console.print(f"files in {prepared.files.root}/: " + ", ".join(
                str(Path(p).relative_to(prepared.files.root)) for p in prepared.written), highlight=False)
        for path in prepared.written if show_files else ():
            console.rule(path)
            console.print(Path(path).read_text(), highlight=False, markup=False, soft_wrap=True)
    if plan.blocked:
        first = plan.blocked[0]
        raise TrainliftError(f"blocked at {first.title}: {first.note}", hint=first.fix or None)
    if dry_run:
        return
    _confirm(yes, f"apply {len(plan.todo)} steps to {spec.name}")
    _apply(prepared, plan, json_out, cost)


@cluster_app.command("status")
def status(spec_path: Path = SPEC, root: Optional[str] = DIR, json_out: bool = JSON) -> None:
    """Observe the cluster without acting: each step of `up`, what exists now, what `up` would do.

    A missing kubectl or helm shows as unknown, with how to install it.

    Example: trainlift cluster status examples/cluster-reference.yaml --json
    """
    from trainlift.ops.lifecycle import prepare
    from trainlift.ops.plan import plan_up

    spec = load_cluster_spec(spec_path)
    prepared = prepare(spec, root, write=False)
    plan = plan_up(prepared.spec, prepared.seen, prepared.placements, prepared.files)
    if json_out:
        data = plan.to_dict()
        data["verb"] = "status"
        data["unknown"] = _unknowns(prepared.seen)
        data["cost"] = _cost(prepared.spec).to_dict()
        print_json(data)
        return
    _capacity_lines(prepared)
    print_plan(plan, f"cluster status {spec.name} ({spec.region}); actions are what `up` would do")
    _unknown_lines(prepared.seen)
    _cost_lines(prepared.spec)


@cluster_app.command("down")
def down(
    spec_path: Path = SPEC,
    yes: bool = typer.Option(False, "--yes", "-y", help="Delete without asking."),
    keep_control_plane: bool = typer.Option(
        False, "--keep-control-plane", help="Delete the RayCluster and node groups, keep the control plane."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; delete nothing."),
    force: bool = FORCE,
    root: Optional[str] = DIR,
    json_out: bool = JSON,
) -> None:
    """Take the cluster down in reverse order: RayCluster, worker node groups, system node group, control plane.

    Idempotent: what is already gone is skipped; re-run after any failure. A control plane stack left by a failed create is deleted too. A cluster without trainlift's tag is not deleted without --force.

    Example: trainlift cluster down examples/cluster-reference.yaml --keep-control-plane --yes
    """
    from trainlift.ops.lifecycle import prepare
    from trainlift.ops.plan import plan_down

    spec = load_cluster_spec(spec_path)
    prepared = prepare(spec, root, write=False, for_up=False, need_credentials=not dry_run)
    plan = plan_down(prepared.spec, prepared.seen, prepared.files, keep_control_plane, force=force)
    if json_out and (dry_run or plan.blocked or not plan.todo):
        print_json({**plan.to_dict(), "unknown": _unknowns(prepared.seen)})
    elif not json_out:
        print_plan(plan, f"cluster down {spec.name} ({spec.region})" + (" --dry-run" if dry_run else ""))
        _unknown_lines(prepared.seen)
    if plan.blocked:
        first = plan.blocked[0]
        raise TrainliftError(f"blocked at {first.title}: {first.note}", hint=first.fix or None)
    if dry_run or not plan.todo:
        return
    _confirm(yes, f"delete {len(plan.todo)} parts of {spec.name}")
    _apply(prepared, plan, json_out)
