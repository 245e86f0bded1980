"""Command-line interface. Each module below registers its commands on `app`."""

from trainlift.cli.app import app, main
from trainlift.cli import train  # noqa: F401  (registers commands)

__all__ = ["app", "main"]
