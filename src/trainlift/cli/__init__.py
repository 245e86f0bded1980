"""Command-line interface. Each module below registers its commands on `app`."""

from trainlift.cli.app import app, main
from trainlift.cli import train  # noqa: F401  (registers commands)
from trainlift.cli import doctor  # noqa: F401
from trainlift.cli import render  # noqa: F401  (registers commands)
from trainlift.cli import capacity  # noqa: F401  (registers commands)
from trainlift.cli import estimate  # noqa: F401
from trainlift.cli import price  # noqa: F401
from trainlift.cli import cluster  # noqa: F401  (registers commands)
from trainlift.cli import jobs  # noqa: F401
from trainlift.cli import local  # noqa: F401
from trainlift.cli import report  # noqa: F401  (registers report, runs)
from trainlift.cli import package  # noqa: F401
from trainlift.cli import rehearse  # noqa: F401

__all__ = ["app", "main"]
