"""The packages a job imports beyond trainlift's core, judged on each node (pure: probe.py looks for them).

`doctor --job SPEC` names them in every node's environment as TRAINLIFT_JOB_PACKAGES, a JSON object
`{"in_job": false, "packages": [{"name", "needed_by", "version", "module"}, ...]}`; the probe records which of them
are installed (`Facts.job_packages`), and `job_package_findings` says what is missing. `in_job: true` means the
probe runs inside the job, after its runtime_env has installed what it installs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping

from trainlift.doctor.probe import Facts
from trainlift.doctor.rules import Finding

ENV_VAR = "TRAINLIFT_JOB_PACKAGES"
RULE = "job_packages"
OFFLINE_FIX = "on an air-gapped cluster, bake it into the image or set PIP_INDEX_URL to a mirror"


@dataclass(frozen=True)
class WantedPackage:
    name: str  # the distribution, as pip names it
    needed_by: str  # the spec field that asks for it
    version: str | None = None  # the pinned release; None: any
    module: str | None = None  # what the job imports; None: unknown (a runtime.pip line)

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}" if self.version else self.name


@dataclass(frozen=True)
class JobPackages:
    packages: tuple[WantedPackage, ...] = ()
    in_job: bool = False  # the probe runs inside the job: what is missing now stays missing

    def env(self) -> dict[str, str]:
        """The environment variable that carries this request to every node's probe (none for an empty one)."""
        if not self.packages:
            return {}
        return {ENV_VAR: json.dumps({"in_job": self.in_job, "packages": [asdict(p) for p in self.packages]})}


def from_env(environ: Mapping[str, str]) -> JobPackages:
    """The request in `environ` (empty without one); ValueError when the variable is not what `env` writes."""
    text = environ.get(ENV_VAR)
    if not text:
        return JobPackages()
    try:
        data = json.loads(text)
        return JobPackages(tuple(WantedPackage(**p) for p in data["packages"]), bool(data.get("in_job", False)))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{ENV_VAR} is not {{\"in_job\": ..., \"packages\": [{{\"name\", \"needed_by\", "
                         f"\"version\", \"module\"}}, ...]}}: {exc}") from None


def job_packages(spec: Any) -> JobPackages:
    """What the job spec imports beyond trainlift's core: its features' packages, then each runtime.pip line's."""
    from trainlift.catalog.packages import feature_packages, normalize, pinned_version, requirement_name

    wanted = [WantedPackage(p.name, p.needed_by, p.version, p.module) for p in feature_packages(spec)]
    for line in spec.runtime.pip:
        name = requirement_name(line)
        if name not in {normalize(p.name) for p in wanted}:
            wanted.append(WantedPackage(name, "runtime.pip", pinned_version(line)))
    return JobPackages(tuple(wanted))


def job_package_findings(facts: Facts, wanted: JobPackages, node: str | None = None) -> list[Finding]:
    """One finding per wanted package that `facts` show missing or at another release than pinned; nothing for the
    ones in place, nor for the ones the probe was not asked about."""
    findings = []
    for package in wanted.packages:
        if package.name not in facts.job_packages:
            continue
        found = _judge(package, facts.job_packages[package.name], wanted.in_job)
        if found is not None:
            findings.append(replace(found, node=node))
    return findings


def _judge(package: WantedPackage, have: str | None, in_job: bool) -> Finding | None:
    if have is None:
        where = "in the job's environment" if in_job else "here"
        return Finding(RULE, "error" if in_job else "warning",
                       f"{package.name}, which {package.needed_by} needs, is not installed {where}",
                       f"the job's runtime_env must install {package.requirement}: render/submit add it; {OFFLINE_FIX}")
    if package.version and _release(have) != _release(package.version):
        return Finding(RULE, "warning",
                       f"{package.name} {have} is installed; {package.needed_by} pins {package.version}",
                       f"the job imports {package.name} {have} unless its runtime_env installs {package.requirement}: "
                       f"pin {package.name}=={have} in runtime.pip, or bake {package.requirement} into the image")
    return None


def _release(version: str) -> str:
    """A version without its local label: torch's 2.13.0+cu130 is release 2.13.0."""
    return version.split("+")[0]


def packages_line(versions: Mapping[str, str | None]) -> str:
    """`Facts.job_packages` for a table cell: 'peft missing, tensorboard 2.21.0'."""
    return ", ".join(f"{name} {version or 'missing'}" for name, version in versions.items())
