"""`trainlift rehearse`: run a render's RayJob locally, as KubeRay would, before anyone pays for a node."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, List, Optional

import typer
from rich.table import Table
from rich.text import Text

from trainlift.cli.app import app, console, err_console, print_json

STATE_STYLE = {"ok": "green", "failed": "bold red"}


@app.command()
def rehearse(
    out_dir: Path = typer.Argument(..., help="A render's output directory (`trainlift render ... --job ... -o DIR`)."),
    set_: List[str] = typer.Option([], "--set", metavar="KEY=VALUE", help="Override a job spec field for the rehearsal, e.g. a toy model: "
                                   "--set model.path=s3://bucket/code/tiny-model (repeatable)."),
    image: Optional[bool] = typer.Option(
        None, "--image/--no-image", help="Run the head, the raylets and the job in a virtualenv built from the "
        "rendered image's locked packages (CPU builds; trainlift only through py_modules), as in the pods. Default: "
        "on when trainlift knows the image's lock. The first build takes about a minute (with uv) and is cached "
        "under $TRAINLIFT_HOME/image-envs; --no-image rehearses in this environment."),
    timeout: float = typer.Option(900.0, "--timeout", min=1.0, help="Seconds the job may take."),
    json_out: bool = typer.Option(False, "--json", help="Print the checks as JSON."),
) -> None:
    """Run the rendered RayJob on a local Ray cluster shaped like the rendered RayCluster.

    A head and one raylet per worker pod start with the rendered rayStartParams (a GPU becomes a CPU slot) and
    env; the RayJob's entrypoint and runtimeEnvYAML are submitted through the Jobs API as its submitter pod
    would, with one training worker per worker pod and the job's GPU settings mapped to CPU ones (printed as
    "rehearsed as"; your --set come after). s3:// URIs are read from the S3 endpoint this environment
    names (AWS_ENDPOINT_URL), so code, trainlift, data and checkpoints travel as on EKS; on a moto_server, every
    S3 request the job and its Ray make is recorded and judged against the pods' role with IAM's rules. With the image's
    environment, a package the job imports that the image lacks, or a Ray or transformers API that differs in the
    image's releases, fails here as it would on the cluster. The rehearsal trains a run of its own,
    <run.storage>/<run.name>-rehearsal, never the job's (printed as "rehearsal run", with its steps and loss).
    Exit 1 when a check fails.
    """
    from trainlift.ops import rehearse as rehearsal_ops

    echo = (lambda line: None) if json_out else (lambda line: err_console.print(Text(line, style="dim")))
    plan = rehearsal_ops.rehearsal_of(out_dir)
    rehearsal_ops.preflight(plan)
    plan = rehearsal_ops.own_run(plan, list(set_))
    env = _image_env(plan.image, image, echo)
    outcome = rehearsal_ops.run(plan, list(set_), timeout, echo=echo, bin_dir=env.bin_dir if env else None)
    where = _where(env)
    if json_out:
        print_json({**outcome.to_dict(), "environment": where})
    else:
        table = Table(title=Text(f"rehearsal of {out_dir}: job {outcome.status}"))
        for column in ("check", "", "evidence"):
            table.add_column(column)
        for check, state, evidence in outcome.checks:
            table.add_row(Text(check), Text(state, style=STATE_STYLE[state]), Text(evidence))
        console.print(table)
        console.print(Text("rehearsed as: " + " ".join(f"--set {o}" for o in outcome.rehearsed_as)))
        console.print(Text(outcome.run["line"]))
        console.print(Text("rehearsed in: " + where["summary"]))
        console.print(Text("not proven here: " + "; ".join(rehearsal_ops.NOT_PROVEN)))
    if not outcome.ok:
        raise typer.Exit(1)


def _image_env(image: str, wanted: Optional[bool], echo: Callable[[str], None]):
    """The image's environment (built or cached) when asked for, or by default when the image's lock is known."""
    from trainlift.catalog.packages import image_lock
    from trainlift.errors import UsageError
    from trainlift.ops import image_env

    if wanted is False:
        return None
    lock = image_lock(image)
    if lock is None:
        if wanted:
            raise UsageError(f"--image: trainlift knows no package lock for {image}",
                             hint="rehearse with --no-image, or render with a catalog image (the `images` of "
                                  "src/trainlift/catalog/platform.yaml, e.g. the cluster spec's default)")
        echo(f"no package lock known for {image}: rehearsing in this environment")
        return None
    env = image_env.ensure(lock, echo)
    echo(f"rehearsing in the image's environment {env.path} ({env.python_note()}"
         f"{'' if env.cached else f', built in {env.built_s:.0f} s'})")
    return env


def _where(env) -> dict[str, Any]:
    import platform

    if env is None:
        return {"image": False, "summary": f"this environment (Python {platform.python_version()}), not the image's"}
    left = ", ".join(sorted(env.left_out))
    relaxed = ", ".join(f"{name} ({why})" for name, why in sorted(env.relaxed.items()))
    summary = f"the image's packages in {env.path}: {env.python_note()}; left out: {left}"
    return {"image": True, "path": str(env.path), "python": env.python, "image_python": env.image_python,
            "left_out": env.left_out, "relaxed": env.relaxed,
            "summary": summary + (f"; at another release: {relaxed}" if relaxed else "")}
