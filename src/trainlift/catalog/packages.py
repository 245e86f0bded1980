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


# The job's runtime_env installs with pip's hash-checking mode: each file pip downloads must match a listed sha256,
# and a dependency the image lacks that no line lists stops the install (Ray writes the packages into a requirements
# file and appends these options to `pip install -r`: ray/_private/runtime_env/pip.py).
HASHED_PIP_OPTIONS = ("--require-hashes", "--disable-pip-version-check", "--no-cache-dir")
_HASH = re.compile(r"--hash=sha256:[0-9a-f]{64}")
HASHED_LINE_HINT = ("write NAME==VERSION --hash=sha256:DIGEST, one --hash per file pip may pick (`pip hash FILE`, or "
                    "the digests on https://pypi.org/simple/NAME/), and a line like it for each dependency the image "
                    "lacks (`uv pip compile --generate-hashes` lists them)")


def split_hashes(line: str) -> tuple[str, list[str]]:
    """(the requirement, the options after it) of a requirements-file line such as `peft==0.21.2 --hash=sha256:…`."""
    requirement, _, options = line.partition(" -")
    return requirement.strip(), (f"-{options}".split() if options else [])


def requirement_problem(line: str) -> str | None:
    """Why `line` may not stand in a job spec's runtime.pip: not a requirement (an option other than --hash among
    it), or one installed from a URL (a VCS checkout, an archive, a file), whose content no version pins."""
    from packaging.requirements import InvalidRequirement, Requirement

    text, options = split_hashes(line)
    try:
        requirement = Requirement(text)
    except InvalidRequirement:
        requirement = None
    if requirement is None or any(not _HASH.fullmatch(o) for o in options):
        return f"'{line}' is not a pip requirement (NAME==VERSION --hash=sha256:DIGEST)"
    if requirement.url:
        return (f"'{requirement.name} @ ...' installs from a URL, whose content no version pins; name a release of "
                f"the package index instead ({requirement.name}==VERSION --hash=sha256:DIGEST)")
    return None


def install_problem(line: str) -> str | None:
    """Why `line` may not travel in a job's runtime_env pip: `requirement_problem`, or one not pinned to a release
    (==VERSION) or without the sha256 of its files (--hash=sha256:…), which pip's hash-checking mode needs."""
    from packaging.requirements import Requirement

    if (problem := requirement_problem(line)) is not None:
        return problem
    text, options = split_hashes(line)
    requirement = Requirement(text)
    if len(requirement.specifier) != 1 or next(iter(requirement.specifier)).operator not in ("==", "===") \
            or "*" in str(requirement.specifier):
        return (f"'{text}' is not pinned to one release: the job's installs are hash-checked (pip --require-hashes), "
                f"which needs {requirement.name}==VERSION with the sha256 of its files")
    if not options:
        return (f"'{text}' has no --hash=sha256:…: the job's installs are hash-checked (pip --require-hashes), "
                f"so each file pip may install needs its sha256")
    return None


def refuse_requirement(where: str, line: str) -> None:
    """One line naming `where` when `line` holds a credential (not echoed) or may not travel in a job's pip."""
    from trainlift.redact import refuse_credentials

    refuse_credentials(where, line)
    if (problem := install_problem(line)) is not None:
        raise SpecError(f"{where}: {problem}", hint=HASHED_LINE_HINT)


def pinned_version(text: str) -> str | None:
    match = re.search(r"===?\s*([^\s;,]+)\s*(?:;.*)?$", split_hashes(text)[0])
    return match.group(1) if match else None


@dataclass(frozen=True)
class HashedPackage:
    """A package a job feature installs, or one of its dependencies that the catalog's image lacks, with the
    sha256 of every file pip may pick for it (job_package_hashes.yaml)."""

    name: str
    version: str
    features: tuple[str, ...]
    sha256: tuple[str, ...]

    @property
    def line(self) -> str:
        return " ".join([f"{self.name}=={self.version}", *(f"--hash=sha256:{h}" for h in self.sha256)])


@lru_cache(maxsize=1)
def hashed_packages() -> dict[str, HashedPackage]:
    return {normalize(name): HashedPackage(normalize(name), str(e["version"]), tuple(e["for"]), tuple(e["sha256"]))
            for name, e in load_data("job_package_hashes.yaml")["packages"].items()}


def hashed_lines(features: list[JobPackage], have: dict[str, str]) -> list[str]:
    """The hashed requirement lines of `features` and of the dependencies each brings that `have` lacks."""
    wanted = {normalize(p.name) for p in features}
    return [p.line for name, p in sorted(hashed_packages().items())
            if name not in have and (name in wanted or wanted & {normalize(f) for f in p.features})]


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
    """The job's runtime_env `pip` packages, each pinned with its sha256 (installed with HASHED_PIP_OPTIONS). Feature
    packages the image lacks travel with their dependencies the catalog's image lacks (for an unknown image the
    same lines: a dependency it lacks too stops the install, in pip's words); `runtime.pip` lines travel as
    written (hashed: config.job refuses others), unless one pins a package the image has at another version, which
    would replace the image's build (torch's CUDA build, Ray) under the running cluster: SpecError."""
    have = lock.packages if lock else {}
    pip = hashed_lines([p for p in feature_packages(spec) if normalize(p.name) not in have], have)
    for line in spec.runtime.pip:
        name, version = requirement_name(line), pinned_version(line)
        if name in have and version is not None and version.split("+")[0] != have[name].split("+")[0]:
            raise SpecError(f"runtime.pip: {split_hashes(line)[0]} would replace the image's {name} {have[name]}",
                            hint=f"drop the line (the image's {name} is used) or pin {name}=={have[name]}")
        if (problem := install_problem(line)) is not None:
            raise SpecError(f"runtime.pip: {problem}", hint=HASHED_LINE_HINT)
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
