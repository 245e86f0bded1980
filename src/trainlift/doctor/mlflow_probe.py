"""Whether this machine can reach the MLflow server of MLFLOW_TRACKING_URI with the credentials its environment
holds: one authenticated request to the REST API, as MLflow's client makes it."""

from __future__ import annotations

import base64
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from trainlift.redact import uri_credentials

CREDENTIAL_ENV = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
TIMEOUT_S = 5.0


def auth_header(environ: Mapping[str, str]) -> str | None:
    """What MLflow's client sends: a bearer token, else basic auth from user and password."""
    if environ.get("MLFLOW_TRACKING_TOKEN"):
        return f"Bearer {environ['MLFLOW_TRACKING_TOKEN']}"
    user, password = environ.get("MLFLOW_TRACKING_USERNAME"), environ.get("MLFLOW_TRACKING_PASSWORD")
    if user and password:
        return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    return None


def mlflow_access(environ: Mapping[str, str], timeout_s: float = TIMEOUT_S) -> dict[str, Any] | None:
    """{uri (credentials masked), credentials (the variable names set), status (HTTP), error}; None when no
    http(s) tracking URI is set."""
    uri = environ.get("MLFLOW_TRACKING_URI", "")
    if not uri.startswith(("http://", "https://")):
        return None
    request = urllib.request.Request(uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1")
    header = auth_header(environ)
    if header:
        request.add_header("Authorization", header)
    facts: dict[str, Any] = {"uri": uri_credentials(uri), "credentials": [k for k in CREDENTIAL_ENV if environ.get(k)],
                             "status": None, "error": None}
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            facts["status"] = response.status
    except urllib.error.HTTPError as exc:
        facts["status"] = exc.code
    except (urllib.error.URLError, OSError) as exc:
        facts["error"] = str(getattr(exc, "reason", exc))[:200]
    return facts
