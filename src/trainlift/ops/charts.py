"""Each pinned Helm chart is pulled before anything billable is created, its archive's sha256 taken, and `cluster
up` installs that very file. A chart whose digest is pinned (the spec's `versions.chart_digests`, or the catalog's
for its pinned version) must match it; a chart pinned by version only has the digest first pulled recorded in the
cluster directory (`charts/digests.json`), and a later pull that differs is refused: a chart re-released under the
same version never reaches the cluster unnoticed."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainlift.ops.run import run as run_command
from trainlift.render.helm import chart_archive, helm_pull_args

DIGESTS_FILE = "charts/digests.json"


@dataclass(frozen=True)
class PulledChart:
    path: str
    digest: str  # sha256:<hex> of the archive


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
        return PulledChart(target, sha256_of(target))
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
