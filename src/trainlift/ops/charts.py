"""Each pinned Helm chart is pulled before anything billable is created, its digest taken, and `cluster up`
installs that very file. A chart's digest is what its publisher lists: from an HTTP repository the sha256 of the
archive (index.yaml's `digest`), from an OCI registry the manifest digest Helm prints as it pulls. A chart whose
digest is pinned (the spec's `versions.chart_digests`, or the catalog's
for its pinned version) must match it; a chart pinned by version only has the digest first pulled recorded in the
cluster directory (`charts/digests.json`), and a later pull that differs is refused: a chart re-released under the
same version never reaches the cluster unnoticed."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainlift.ops.run import run as run_command
from trainlift.render.helm import chart_archive, helm_pull_args

DIGESTS_FILE = "charts/digests.json"


OCI_DIGEST = re.compile(r"^Digest: (sha256:[0-9a-f]{64})$", re.MULTILINE)  # helm pkg/registry/client.go, Pull


@dataclass(frozen=True)
class PulledChart:
    path: str
    digest: str  # what the chart is pinned by: the manifest digest of an OCI chart, else the archive's sha256
    archive_sha256: str = ""


def manifest_digest(helm_output: str) -> str | None:
    """The manifest digest `helm pull` prints for an OCI chart ("Digest: sha256:..."); None when it printed none."""
    match = OCI_DIGEST.search(helm_output)
    return match.group(1) if match else None


def archive_path(root: str, release: dict[str, Any]) -> str:
    return f"{root.rstrip('/')}/charts/{chart_archive(release)}"


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return f"sha256:{digest.hexdigest()}"


def pull(release: dict[str, Any], root: str) -> PulledChart | str:
    """The release's chart archive in `<root>/charts/`, or Helm's last error line. Pulled into a fresh folder
    first, so a failed pull never leaves a partial archive under the name that is installed."""
    charts = Path(root) / "charts"
    charts.mkdir(parents=True, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".pull-", dir=charts)
    try:
        result = run_command(helm_pull_args(release, staging), timeout=120)
        pulled = Path(staging) / chart_archive(release)
        if result.returncode != 0 or not pulled.is_file():
            lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
            return lines[-1] if lines else f"helm pull wrote no {chart_archive(release)}"
        target = archive_path(root, release)
        os.replace(pulled, target)
        archive = sha256_of(target)
        if release["repo"].startswith("oci://"):
            # Helm prints an OCI chart's manifest digest as it pulls (since 3.8.0, trainlift's floor); were it
            # missing, the archive's sha256 stands in, and matches no manifest digest pinned for it.
            found = manifest_digest(result.stderr + "\n" + result.stdout)
            return PulledChart(target, found or archive, archive)
        return PulledChart(target, archive, archive)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _key(release: dict[str, Any]) -> str:
    return f"{release['name']}@{release['version']}"


def recorded(root: str) -> dict[str, str]:
    """`<release>@<version>` -> the digest first pulled for it on this cluster."""
    path = Path(root) / DIGESTS_FILE
    try:
        found = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    return {k: v for k, v in found.items() if isinstance(k, str) and isinstance(v, str)}


def expected(release: dict[str, Any], root: str) -> tuple[str | None, str]:
    """(the digest the release's archive must have, where that pin comes from), or (None, "") for none yet."""
    if release["digest"]:
        return release["digest"], release["digestFrom"]
    found = recorded(root).get(_key(release))
    return (found, f"{DIGESTS_FILE}, recorded when first pulled") if found else (None, "")


def record(root: str, release: dict[str, Any], digest: str) -> None:
    """Trust on first pull: written once per release and version, replaced atomically."""
    path = Path(root) / DIGESTS_FILE
    table = {**recorded(root), _key(release): digest}
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    os.replace(partial, path)
