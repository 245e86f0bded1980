"""A stand-in for `helm pull` (no chart repository is reachable here), for the shell scripts tests put on PATH as
`helm`: it writes the archive Helm writes (`<chart>-<version>.tgz` under --destination), holding a fixed text, so
a test knows its digest. Loaded with runpy, like docs_text.py."""

from __future__ import annotations

import hashlib

# A `case "$1" in` branch.
PULL = """pull) dest=""; ver=""; prev=""; for a in "$@"; do case "$prev" in --destination) dest="$a";;
    --version) ver="$a";; esac; prev="$a"; done
  name=${2##*/}; printf 'chart %s %s%s' "$name" "$ver" "$FAKE_CHART_CHANGE" > "$dest/$name-$ver.tgz"; exit 0;;"""


def digest(chart: str, version: str, change: str = "") -> str:
    """The digest of what PULL writes for a chart version (`change`: FAKE_CHART_CHANGE, a re-released chart)."""
    return "sha256:" + hashlib.sha256(f"chart {chart} {version}{change}".encode()).hexdigest()


def with_fake_chart_digests(spec: dict) -> dict:
    """A cluster spec (as loaded from YAML) that pins the NVIDIA and Volcano charts, whose real digests trainlift's
    catalog holds, to what PULL writes; the other charts stay pinned by version."""
    pins = {"nvidia-device-plugin": digest("nvidia-device-plugin", "0.20.0"), "volcano": digest("volcano", "1.15.1")}
    versions = spec.get("versions", {})
    return {**spec, "versions": {**versions, "chart_digests": {**pins, **versions.get("chart_digests", {})}}}
