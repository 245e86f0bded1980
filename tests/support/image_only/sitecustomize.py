"""Makes this Python look like the cluster image's: every installed distribution that neither the image's locked
package set (the file named by TRAINLIFT_IMAGE_LOCK) lists nor one of those needs here is hidden, so importing it
fails as it would on a node. (This environment may hold newer releases of the image's packages, whose own new
requirements are not trainlift's to ship.)

Put this folder first on PYTHONPATH; Ray's processes (GCS, raylets, dashboard, workers) inherit it.
"""

import importlib.abc
import os
import re
import sys
from importlib import metadata


IMAGE_EXTRAS = {"ray": ("default", "train", "tune", "data")}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(lock_path: str) -> set[str]:
    with open(lock_path, encoding="utf-8") as fh:
        lines = [line.split("#")[0].strip() for line in fh]
    return {_norm(line.split("==")[0]) for line in lines if "==" in line}


def _with_requirements(names: set[str]) -> set[str]:
    """The names and everything their installed releases require here (ray with the image's extras)."""
    from packaging.requirements import Requirement

    todo, seen = list(names), set(names)
    while todo:
        name = todo.pop()
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            extras = ("",) + IMAGE_EXTRAS.get(name, ())
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in extras):
                continue
            if _norm(req.name) not in seen:
                seen.add(_norm(req.name))
                todo.append(_norm(req.name))
    return seen


class _ImageOnly:
    """Wraps a meta path finder: hidden modules and distributions are not found, as when they are not installed
    (`importlib.util.find_spec` gives None, `import` raises ModuleNotFoundError, `metadata.version` fails)."""

    def __init__(self, finder, modules: set[str], dists: set[str]):
        self.finder, self.modules, self.dists = finder, modules, dists

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.modules or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)

    def find_distributions(self, context=metadata.DistributionFinder.Context()):
        found = getattr(self.finder, "find_distributions", lambda context: [])(context)
        return (d for d in found if _norm(d.metadata["Name"] or "") not in self.dists)

    def invalidate_caches(self):
        getattr(self.finder, "invalidate_caches", lambda: None)()


def _install() -> None:
    lock = os.environ.get("TRAINLIFT_IMAGE_LOCK")
    if not lock:
        return
    allowed = _with_requirements(_names(lock)) | {"trainlift"}
    owners = metadata.packages_distributions()
    modules = {module for module, dists in owners.items() if not any(_norm(d) in allowed for d in dists)}
    dists = {_norm(d) for ds in owners.values() for d in ds} - allowed
    sys.meta_path[:] = [_ImageOnly(finder, modules, dists) for finder in sys.meta_path]


_install()
