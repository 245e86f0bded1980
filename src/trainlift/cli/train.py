"""`trainlift train` and `trainlift eval`."""

from __future__ import annotations

from trainlift.cli.app import app  # noqa: F401
