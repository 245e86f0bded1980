"""`trainlift rehearse`: run a render's RayJob locally, as KubeRay would, before anyone pays for a node."""

from __future__ import annotations

from pathlib import Path
from typing import List

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
    timeout: float = typer.Option(900.0, "--timeout", min=1.0, help="Seconds the job may take."),
    json_out: bool = typer.Option(False, "--json", help="Print the checks as JSON."),
) -> None:
    """Run the rendered RayJob on a local Ray cluster shaped like the rendered RayCluster.

    A head and one raylet per worker pod start with the rendered rayStartParams (a GPU becomes a CPU slot) and
    env; the RayJob's entrypoint and runtimeEnvYAML are submitted through the Jobs API as its submitter pod
    would, with one training worker per worker pod. s3:// URIs are read from the S3 endpoint this environment
    names (AWS_ENDPOINT_URL), so code, trainlift, data and checkpoints travel as on EKS. Exit 1 when a check fails.
    """
    from trainlift.ops import rehearse as rehearsal_ops

    plan = rehearsal_ops.rehearsal_of(out_dir)
    outcome = rehearsal_ops.run(plan, list(set_), timeout, echo=(lambda line: None) if json_out else
                                (lambda line: err_console.print(Text(line, style="dim"))))
    if json_out:
        print_json(outcome.to_dict())
    else:
        table = Table(title=Text(f"rehearsal of {out_dir}: job {outcome.status}"))
        for column in ("check", "", "evidence"):
            table.add_column(column)
        for check, state, evidence in outcome.checks:
            table.add_row(Text(check), Text(state, style=STATE_STYLE[state]), Text(evidence))
        console.print(table)
        console.print(Text("not proven here: " + "; ".join(rehearsal_ops.NOT_PROVEN)))
    if not outcome.ok:
        raise typer.Exit(1)
