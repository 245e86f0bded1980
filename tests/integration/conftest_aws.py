"""One moto server per test session, on loopback, reached over HTTP through AWS_ENDPOINT_URL.

Not a conftest pytest loads by itself: test modules load it with `load()` below and
use `server()`; the server starts on first use and stops when the process exits.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import sys
import urllib.request
from pathlib import Path

_state: dict[str, object] = {}


def load():
    """This module, imported once by path (the test directories are not packages)."""
    name = "trainlift_tests_conftest_aws"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    return sys.modules[name]


def server() -> str:
    """The endpoint URL of the session's moto server."""
    if "url" not in _state:
        from moto.server import ThreadedMotoServer

        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        moto.start()
        host, port = moto.get_host_and_port()
        _state["url"] = f"http://{host}:{port}"
        atexit.register(moto.stop)
    return str(_state["url"])


def _post(path: str, body: bytes) -> dict:
    request = urllib.request.Request(server() + path, data=body, method="POST",
                                     headers={"Content-Type": "text/plain"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read() or b"{}")


def reset() -> None:
    """Forget every resource the server holds."""
    _post("/moto-api/reset", b"")


def reject_credentials(on: bool) -> None:
    """Make the server check credentials (unknown keys are rejected) or stop checking."""
    _post("/moto-api/reset-auth", b"0" if on else b"inf")


def aws_env(tmp_path: Path) -> dict[str, str]:
    """Fake credentials and an isolated AWS configuration pointed at the server."""
    return {
        "AWS_ENDPOINT_URL": server(),
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_MAX_ATTEMPTS": "1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
    }


CLEARED = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION",
           "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
           "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")


def use(monkeypatch, tmp_path: Path) -> dict[str, str]:
    """Point the calling test at a freshly reset server, with fake credentials and no other AWS configuration."""
    reset()
    for key in CLEARED:
        monkeypatch.delenv(key, raising=False)
    env = aws_env(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def use_bucket(monkeypatch, tmp_path: Path, bucket: str) -> dict[str, str]:
    """`use`, in us-east-1, with `bucket` created empty on the server."""
    env = use(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    import boto3

    boto3.client("s3").create_bucket(Bucket=bucket)
    return env
