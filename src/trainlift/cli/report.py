"""`trainlift report` (a run's curves as an HTML page and PNGs) and `trainlift runs` (the runs under a storage root)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from trainlift.cli.app import app, console, print_json
from trainlift.errors import UsageError


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _fmt(value, spec: str = ".4f") -> str:
    return "—" if value is None else format(value, spec)


@app.command()
def report(
    run_dir: str = typer.Argument(..., help="A run directory, <run.storage>/<run.name> (local or s3://)."),
    output: Path = typer.Option(None, "-o", "--output", help="HTML file to write (default: report.html in a local run's directory; <run name>-report.html "
                                "here for a run on S3)."),
    png: Optional[Path] = typer.Option(None, "--png", help="Also write each plot as DIR/<plot>.png."),
    compare: List[str] = typer.Option([], "--compare", help="Another run directory to overlay (repeatable)."),
    json_out: bool = typer.Option(False, "--json", help="Print what was written, and the restarts found, as JSON."),
) -> None:
    """Plot a run: loss and eval loss, learning rate, tokens/s, MFU and HFU over steps (DPO: rewards and reward
    accuracy too), restarts marked.

    Reads metrics.jsonl and summary.json and writes one self-contained HTML page (plots embedded, with the
    summary table) that opens in any browser: e.g. `trainlift report runs/tiny-demo -o report.html`.
    """
    from trainlift import rundir
    from trainlift import report as render

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("trainlift report needs matplotlib", hint="pip install 'trainlift[report]'") from None
    runs = [rundir.read_run(uri) for uri in (run_dir, *compare)]
    labels = [r.name for r in runs]
    if len(set(labels)) < len(labels):
        labels = [r.uri for r in runs]
    page, pngs = render.build([(label, r.rows, r.summary) for label, r in zip(labels, runs)])
    output = output or default_output(run_dir, runs[0].name)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(page, encoding="utf-8")
    written = [str(output)]
    if png is not None:
        png.mkdir(parents=True, exist_ok=True)
        for stem, data in pngs.items():
            (png / f"{stem}.png").write_bytes(data)
            written.append(str(png / f"{stem}.png"))
    marks = {label: [m.__dict__ for m in render.restarts(r.rows)] for label, r in zip(labels, runs)}
    if json_out:
        print_json({"html": str(output), "files": written, "plots": list(pngs), "restarts": marks})
        return
    for path in written:
        console.print(f"wrote {path}")


def default_output(run_dir: str, name: str) -> Path:
    """report.html beside the run's metrics when the run is on this disk, else <name>-report.html here."""
    return Path(f"{name}-report.html") if "://" in run_dir else Path(run_dir) / "report.html"


@app.command()
def runs(
    storage: str = typer.Argument("runs", help="A storage root (run.storage): local directory or s3://bucket/prefix."),
    json_out: bool = typer.Option(False, "--json", help="Print the runs as JSON."),
) -> None:
    """List the runs under a storage root: steps, last loss and eval loss, state, age (newest first).

    State is `finished`, `running` (metrics written in the last few minutes), `checkpointed at step N`
    (stopped or failed; rerunning its spec resumes there) or `no checkpoint`.
    """
    from trainlift import rundir

    rows = rundir.list_runs(storage)
    if json_out:
        print_json(rows)
        return
    if not rows:
        console.print(f"no runs under {storage}")
        return
    table = Table(title=f"runs under {storage}")
    for col in ("name", "steps", "loss", "eval loss", "state", "age"):
        table.add_column(col)
    for row in rows:
        done = f"{row['steps']}/{row['total_steps']}" if row["total_steps"] else str(row["steps"])
        table.add_row(row["name"], done, _fmt(row["loss"]), _fmt(row["eval_loss"]), row["state"], _age(row["age_s"]))
    console.print(table)
