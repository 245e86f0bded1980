"""`trainlift package`: trainlift as a wheel for a Ray cluster's runtime_env py_modules."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from trainlift.cli.app import app, err_console, print_json


@app.command()
def package(
    output_dir: Optional[Path] = typer.Option(None, "--output-dir", "-o",
                                              help="Where to write the wheel (default: $TRAINLIFT_HOME/packages)."),
    upload: Optional[str] = typer.Option(None, "--upload", help="S3 folder to put the wheel in, e.g. "
                                         "s3://bucket/code/; the wheel keeps its content-addressed name."),
    region: Optional[str] = typer.Option(None, help="AWS region of the client (default: AWS_REGION)."),
    json_out: bool = typer.Option(False, "--json", help="Print the wheel's path, version and URI as JSON."),
) -> None:
    """Build trainlift as a wheel (reproducibly) and print its URI for py_modules / `render --trainlift-uri`.

    The same code gives the same bytes and name; changed code a new name, which is what Ray caches by on each
    node. The wheel declares no dependencies: the cluster's image provides torch, ray and transformers.
    """
    from trainlift.ops import package as packaging

    if upload is not None:
        packaging.s3_destination(upload, "trainlift.whl")  # a bad destination fails before the build
    wheel = packaging.build_wheel(output_dir or packaging.default_dir())
    uri = packaging.upload(wheel, upload, region) if upload else str(wheel)
    if json_out:
        print_json({"wheel": str(wheel), "version": wheel.name.split("-")[1], "uri": uri})
        return
    if upload:
        err_console.print(f"built {wheel}")
    typer.echo(uri)
