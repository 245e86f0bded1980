"""Fixtures of the unit tests."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist


@pytest.fixture
def single_process_group():
    """A one-process gloo group: what FSDP2 and the recipe's collectives need, without Ray."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def stubbed_aws(monkeypatch, tmp_path):
    """`stubbed_aws(service)`: an Aws for us-east-2 with fake credentials and no profile or endpoint from this
    machine, and a botocore Stubber activated on its `service` client (deactivated after the test)."""
    from botocore.stub import Stubber

    from trainlift.cloud.aws import Aws

    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    stubbers = []

    def make(service: str):
        monkeypatch.delenv(f"AWS_ENDPOINT_URL_{service.upper()}", raising=False)
        aws = Aws("us-east-2")
        stubber = Stubber(aws.client(service))
        stubber.activate()
        stubbers.append(stubber)
        return aws, stubber

    yield make
    for stubber in stubbers:
        stubber.deactivate()
