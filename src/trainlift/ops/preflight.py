"""The plan's first steps: is every tool there, and did trainlift create this cluster? Pure.

Both are checked before the first step that costs money: a missing tool blocks the plan
instead of failing after the node groups exist, and a cluster (or a stack left by a
failed create) that carries no trainlift tag is neither adopted nor deleted without
`--force`.
"""

from __future__ import annotations

from trainlift.config.cluster import ClusterSpec
from trainlift.ops.run import INSTALL
from trainlift.render.eksctl import OWNER_TAG
from trainlift.ops.steps import Observed, Op, Step

TOOLS = ("eksctl", "helm", "kubectl", "aws")
KUBE_WAITS = ("secret/", "head-ready", "workers-running", "nodes/")


def tools_needed(steps: list[Step]) -> list[str]:
    """The command-line tools the steps' operations run; kubectl authenticates through the aws CLI."""
    needed: set[str] = set()
    for step in steps:
        for op in step.ops:
            if op.kind in ("run", "crds") and op.argv:
                needed.update(cmd[0] for cmd in (op.argv, op.then) if cmd)
            elif op.kind in ("adopt", "doctor") or (op.kind == "wait" and op.until.startswith(KUBE_WAITS)):
                needed.add("kubectl")
    if "kubectl" in needed:
        needed.add("aws")
    return [t for t in TOOLS if t in needed]


def tools_step(steps: list[Step], seen: Observed) -> Step:
    needed = tools_needed(steps)
    title = "command-line tools: " + (", ".join(needed) or "none needed")
    if seen.tools is None:
        return Step("tools", title, "not looked up", "nothing")
    missing = [t for t in needed if not seen.tools.get(t)]
    if not missing:
        return Step("tools", title, "all found", "nothing")
    return Step("tools", title, "not found: " + ", ".join(missing), "blocked",
                note=f"{missing[0]} is needed by a later step; nothing is created until every tool is there",
                fix="; ".join(INSTALL.get(t, f"install {t}") for t in missing))


def _exists(seen: Observed) -> bool:
    return not seen.absent or seen.stack is not None


def ownership_step(spec: ClusterSpec, seen: Observed, verb: str, force: bool) -> Step:
    """Whether this cluster is trainlift's to change: `up` adopts and `down` deletes only a tagged one."""
    tag = f"{OWNER_TAG}={spec.name}"
    title = f"created by trainlift (tag {tag})"
    if seen.assumed:
        return Step("ownership", title, "not looked up", "nothing")
    if seen.control_plane is not None and not _exists(seen):
        return Step("ownership", title, "nothing exists yet", "nothing", note="what trainlift creates carries the tag")
    if seen.tags is not None and seen.tags.get(OWNER_TAG) == spec.name:
        return Step("ownership", title, "tagged", "nothing")
    observed = seen.why("tags") if seen.tags is None else "exists without the tag"
    if not force:
        act = "adopt it" if verb == "up" else "delete it anyway"
        return Step("ownership", title, observed, "blocked",
                    note=f"{spec.name} in {spec.region} may not be trainlift's: it is neither adopted nor deleted",
                    fix=f"pass --force to {act}, or give the spec another name")
    if verb == "up" and seen.cluster_arn:
        return Step("ownership", title, observed, "apply", (Op("tag", (seen.cluster_arn, tag)),),
                    note="--force: adopted; the tag is added so that later runs recognise it")
    return Step("ownership", title, observed, "nothing", note="--force: proceeding without the tag")
