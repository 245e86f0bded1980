"""What Python packages a job needs on its nodes, what a cluster image already has, and what must travel in the
job's runtime_env `pip` (pure: data files and the spec in, lists out)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from trainlift.catalog.lookup import image_entry, load_data, pinned_image
from trainlift.errors import SpecError


@dataclass(frozen=True)
class JobPackage:
    name: str  # the distribution, as pip names it
    version: str  # pinned: the release the suite runs with
    module: str  # what the job imports
    needed_by: str  # the spec field that asks for it

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


def normalize(name: str) -> str:
    """PEP 503: what pip and the lock files compare names by."""
    return re.sub(r"[-_.]+", "-", name).lower()


@lru_cache(maxsize=1)
def _catalog() -> dict[str, JobPackage]:
    return {name: JobPackage(name, str(e["version"]), e["module"], e["needed_by"])
            for name, e in load_data("job_packages.yaml")["packages"].items()}


def feature_packages(spec: Any) -> list[JobPackage]:
    """The packages the job's features import that trainlift does not require everywhere (peft, trackers)."""
    names = (["peft"] if spec.model.lora is not None else []) + [
        {"tensorboard": "tensorboard", "mlflow": "mlflow-skinny"}[t] for t in spec.run.trackers]
    return [_catalog()[n] for n in names]


def requirement_name(text: str) -> str:
    """The distribution a pip requirement line names (`peft==0.21.2`, `foo[bar]>=1`, `baz`)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", text)
    return normalize(match.group(1)) if match else ""


def requirement_problem(line: str) -> str | None:
    """Why `line` may not travel in a job's runtime_env pip: not a requirement, or one installed from a URL (a VCS
    checkout, an archive, a file), whose content no version pins."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        requirement = Requirement(line)
    except InvalidRequirement:
        return f"'{line}' is not a pip requirement (a name, optionally ==version)"
    if requirement.url:
        return (f"'{requirement.name} @ ...' installs from a URL, whose content no version pins; name a release of "
                f"the package index instead ({requirement.name}==VERSION)")
    return None


def refuse_requirement(where: str, line: str) -> None:
    """One line naming `where` when `line` holds a credential (not echoed) or may not travel in a job's pip."""
    from trainlift.redact import refuse_credentials

    refuse_credentials(where, line)
    if (problem := requirement_problem(line)) is not None:
        raise SpecError(f"{where}: {problem}", hint="pin a release: NAME==VERSION")


def pinned_version(text: str) -> str | None:
    match = re.search(r"===?\s*([^\s;,]+)\s*(?:;.*)?$", text)
    return match.group(1) if match else None


# --- the image's locked package set -------------------------------------------------------------------------------

@dataclass(frozen=True)
class ImageLock:
    """An image's Python environment as its own lock file records it: name -> version, which lines are CUDA
    builds, and the header's facts (python, source commit)."""

    file: str
    packages: dict[str, str]
    gpu: frozenset[str]
    header: tuple[str, ...]

    @property
    def python(self) -> str:
        for line in self.header:
            if match := re.match(r"python:\s*([0-9.]+)", line):
                return match.group(1)
        return "unknown"


def parse_lock(text: str, file: str = "") -> ImageLock:
    packages, gpu, header = {}, set(), []
    for raw in text.splitlines():
        line, _, comment = raw.partition("#")
        line = line.strip()
        if not line:
            if raw.startswith("#"):
                header.append(raw.lstrip("# ").strip())
            continue
        name, sep, version = line.partition("==")
        if not sep:
            raise ValueError(f"{file}: '{raw}' is not name==version")
        packages[normalize(name)] = version.strip()
        if comment.strip() == "gpu":
            gpu.add(normalize(name))
    return ImageLock(file, packages, frozenset(gpu), tuple(header))


@lru_cache(maxsize=None)
def image_lock(image: str) -> ImageLock | None:
    """The locked package set of a catalog image (its `lock` file under catalog/images/); None when unknown."""
    entry = image_entry(pinned_image(image) or image)
    if not entry or "lock" not in entry:
        return None
    path = resources.files("trainlift.catalog").joinpath("images", entry["lock"])
    return parse_lock(path.read_text(), entry["lock"])


def runtime_pip(spec: Any, lock: ImageLock | None) -> list[str]:
    """The job's runtime_env `pip` list. Feature packages the image lacks travel pinned (all of them when the image
    is unknown); `runtime.pip` lines travel as written, unless one pins a package the image has at another version,
    which would replace the image's build (torch's CUDA build, Ray) under the running cluster: SpecError."""
    have = lock.packages if lock else {}
    pip = [p.requirement for p in feature_packages(spec) if normalize(p.name) not in have]
    for line in spec.runtime.pip:
        name, version = requirement_name(line), pinned_version(line)
        if name in have and version is not None and version.split("+")[0] != have[name].split("+")[0]:
            raise SpecError(f"runtime.pip: {line} would replace the image's {name} {have[name]}",
                            hint=f"drop the line (the image's {name} is used) or pin {name}=={have[name]}")
        if name not in {requirement_name(p) for p in pip}:
            pip.append(line)
    return pip


# Lock lines a CPU rehearsal environment leaves out, and why. The other `# gpu` lines are CUDA libraries; torch
# comes as the CPU build of the same release.
CPU_LEFT_OUT = {
    "deepspeed": "builds its extensions against a CUDA torch; trainlift does not import it",
    "torchvision": "PyPI's CUDA build does not load beside torch's CPU build; trainlift does not import it",
}


def cpu_requirements(lock: ImageLock) -> tuple[list[str], dict[str, str]]:
    """(name==version lines a CPU environment mirroring the image installs, left-out name -> why). torch first: the
    rest must find it already there rather than pull a CUDA build in."""
    keep, left_out = [f"torch=={lock.packages['torch'].split('+')[0]}"], {}
    for name, version in sorted(lock.packages.items()):
        if name == "torch":
            continue
        if name in CPU_LEFT_OUT:
            left_out[name] = CPU_LEFT_OUT[name]
        elif name in lock.gpu:
            left_out[name] = "a CUDA library"
        else:
            keep.append(f"{name}=={version}")
    return keep, left_out
