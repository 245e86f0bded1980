"""Shared fixtures. One Ray instance serves every test that needs Ray (starting Ray on 2 cores is slow)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_local():
    """A real local Ray instance shared across the session (4 logical CPUs on 2 cores)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
