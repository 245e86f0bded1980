"""Everything pinned is checked before anything billable is created: each Helm chart version exists where the
spec pins it and its archive has the digest it is pinned to (ops/charts.py), and each tool is at least the release that does what `cluster up` asks of it. Pure: the tools'
outputs in, a plan step out (lifecycle.py runs the commands)."""

from __future__ import annotations

import json
import re
from typing import Any

from trainlift.catalog.lookup import load_data
from trainlift.config.cluster import ClusterSpec
from trainlift.ops.steps import Observed, Step

VERSION_ARGS = {"helm": ["version", "--short"], "eksctl": ["version"], "kubectl": ["version", "--client", "-o", "json"]}


def tool_version(tool: str, stdout: str) -> str | None:
    """The x.y.z a tool's version command printed (kubectl's as JSON), or None when it cannot be read."""
    if tool == "kubectl":
        try:
            stdout = json.loads(stdout)["clientVersion"]["gitVersion"]
        except (ValueError, KeyError, TypeError):
            return None
    match = re.search(r"v?(\d+)\.(\d+)\.(\d+)", stdout)
    return ".".join(match.groups()) if match else None


def _tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split(".")[:3])


def minimum(spec: ClusterSpec, tool: str) -> tuple[str, str]:
    """The tool's floor for this spec, and why."""
    entry = load_data("platform.yaml")["tools"][tool]
    if "skew" in entry:
        major, minor = (int(x) for x in spec.kubernetes_version.split(".")[:2])
        return f"{major}.{minor - entry['skew']}.0", f"{entry['why']} (Kubernetes {spec.kubernetes_version})"
    return entry["min"], entry["why"]


def crds_folder_charts() -> dict[str, str]:
    return load_data("platform.yaml")["crds_in_crds_folder"]


def pins_step(spec: ClusterSpec, seen: Observed, releases: list[dict[str, Any]], tools: list[str]) -> Step:
    """Blocked when a pinned chart version is not found or a tool is older than its floor; checked only where
    the tool is there to ask (a missing tool blocks the tools step)."""
    title = f"pins: {len(releases)} chart version(s), tool floors"
    problems, fixes, seen_parts = [], [], []
    for tool in tools:
        found = (seen.tool_versions or {}).get(tool)
        if found is None:
            continue
        floor, why = minimum(spec, tool)
        seen_parts.append(f"{tool} {found}")
        if _tuple(found) < _tuple(floor):
            problems.append(f"{tool} {found} is older than {floor}: {why}")
            fixes.append(f"upgrade {tool} to {floor} or later")
    if seen.charts is None and "charts" in seen.unknown:
        problems.append(f"could not ask for the pinned charts: {seen.unknown['charts']}")
        fixes.append("check this machine's access to the chart repositories, then run up again")
    elif seen.charts is None:
        seen_parts.append("charts not looked up (no helm)")
    else:
        for r in releases:
            error = seen.charts.get(r["name"])
            if error:
                problems.append(f"chart {r['chart']} {r['version']} not found in {r['repo']}: {error}")
                fixes.append(f"pin a {r['chart']} version that exists in the cluster spec's `versions`")
        seen_parts.append(f"{len(releases) - sum(1 for r in releases if seen.charts.get(r['name']))} of "
                          f"{len(releases)} chart versions found")
        digest_problems, checked = _digest_problems(releases, seen)
        problems += digest_problems
        fixes += ["if the chart was re-released on purpose, read what changed, then pin its new digest in "
                  "versions.chart_digests"] * bool(digest_problems)
        seen_parts.append(f"{checked} checked by digest")
    observed = ", ".join(seen_parts) or "not looked up"
    if problems:
        return Step("pins", title, observed, "blocked", note="; ".join(problems), fix="; ".join(fixes))
    return Step("pins", title, observed, "nothing")


def _digest_problems(releases: list[dict[str, Any]], seen: Observed) -> tuple[list[str], int]:
    """A line for each pulled chart whose archive is not the one it is pinned to; and how many were checked."""
    problems, checked = [], 0
    for r in releases:
        pulled = seen.chart_digests.get(r["name"])
        want, pinned_by = seen.chart_pins.get(r["name"], (None, ""))
        if pulled is None or want is None:
            continue
        checked += 1
        if pulled != want:
            problems.append(f"chart {r['chart']} {r['version']} from {r['repo']} is {pulled}, not the {want} "
                            f"pinned by {pinned_by}")
    return problems, checked
