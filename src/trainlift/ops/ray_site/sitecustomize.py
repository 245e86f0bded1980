"""Imported at startup by every Python process of a Ray that trainlift starts (`local up`'s head, the Ray `train`
and `doctor` embed): their environment puts this directory on PYTHONPATH (ops/localray.private_ray_env).

Ray makes each directory it creates, and again each time it reuses one (a job's runtime_env resources, its logs),
world-writable: `ray._common.utils.try_make_directory_shared` chmods it 0777, which no umask undoes. Here that
function makes the directory 0700 instead, once Ray's module is imported; nothing else is imported or changed, and
a process that never imports Ray is untouched. The sitecustomize it hides on the path still runs. Self-contained: it
must not import trainlift.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

MODULE = "ray._common.utils"


def private(directory_path) -> None:
    """What Ray's `try_make_directory_shared` does, with 0700 for 0777 (a directory of another user's: left)."""
    try:
        os.chmod(directory_path, 0o700)
    except OSError:
        pass


def patch(module) -> None:
    module.try_make_directory_shared = private


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                run = spec.loader.exec_module

                def exec_module(module, run=run):
                    run(module)
                    patch(module)

                spec.loader.exec_module = exec_module
                return spec
        return None


def run_the_one_shadowed() -> None:
    """The sitecustomize this one hides (the next on sys.path: the environment's, a profiler's), run as Python would
    have run it."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def install() -> None:
    """Patch Ray's module now when it is loaded, else as it is imported."""
    if MODULE in sys.modules:
        patch(sys.modules[MODULE])
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


install()
if __name__ == "sitecustomize":  # at start-up, not when trainlift imports it to patch its own process
    run_the_one_shadowed()
