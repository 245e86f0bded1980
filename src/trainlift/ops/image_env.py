"""A virtualenv that mirrors a cluster image's Python packages (its lock, CPU builds), built once and cached under
$TRAINLIFT_HOME/image-envs, so a rehearsal runs Ray, the job's entrypoint and its runtime_env on the image's
releases rather than this machine's. trainlift itself is not installed there: it arrives through py_modules."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trainlift.catalog.packages import ImageLock, cpu_requirements
from trainlift.errors import TrainliftError
from trainlift.ops import run
from trainlift.home import trainlift_home

INSTALL_TIMEOUT_S = 1800.0
DONE = "built.json"  # written last: a directory without it is a build cut off, and is built again
# What the environment must import, checked once built (a release of one of these that fails on import here would
# fail the job the same way).
IMPORT_CHECK = ("ray", "ray.train.torch", "torch", "transformers", "pyarrow", "boto3", "pydantic", "typer", "rich")


@dataclass(frozen=True)
class ImageEnv:
    path: Path
    python: str  # this environment's Python version
    image_python: str  # the image's
    left_out: dict[str, str]
    relaxed: dict[str, str]  # lock lines this Python has no build of, taken at the newest release up to them
    built_s: float  # how long the first build took
    cached: bool

    @property
    def bin_dir(self) -> Path:
        return self.path / "bin"

    def python_note(self) -> str:
        if self.python.rsplit(".", 1)[0] == self.image_python.rsplit(".", 1)[0]:
            return f"Python {self.python}"
        return (f"Python {self.python} instead of the image's {self.image_python} (this machine's; torch's CPU build "
                f"is taken for it)")


def home() -> Path:
    """$TRAINLIFT_IMAGE_ENVS, else $TRAINLIFT_HOME/image-envs."""
    if override := os.environ.get("TRAINLIFT_IMAGE_ENVS"):
        return Path(override).expanduser()
    return trainlift_home() / "image-envs"


def env_dir(lock: ImageLock) -> Path:
    """One directory per lock content and Python: a new lock (or another interpreter) builds a new environment."""
    requirements, _ = cpu_requirements(lock)
    key = hashlib.sha256("\n".join([sys.version, *requirements]).encode()).hexdigest()[:10]
    stem = Path(lock.file).stem or "image"
    return home() / f"{stem}-py{sys.version_info.major}.{sys.version_info.minor}-{key}"


def ensure(lock: ImageLock, echo: Callable[[str], None] = lambda line: None) -> ImageEnv:
    """The image's environment, built now (minutes, once) unless a complete one is cached."""
    path = env_dir(lock)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # one build at a time; a second caller then finds it built
        if not (path / DONE).is_file():
            _build(lock, path, echo)
            cached = False
        else:
            cached = True
    record = json.loads((path / DONE).read_text())
    return ImageEnv(path, record["python"], lock.python, record["left_out"], record["relaxed"], record["built_s"],
                    cached)


def _build(lock: ImageLock, path: Path, echo: Callable[[str], None]) -> None:
    requirements, left_out = cpu_requirements(lock)
    started = time.monotonic()
    shutil.rmtree(path, ignore_errors=True)
    echo(f"building the image's Python environment in {path} ({len(requirements)} packages from {lock.file}; "
         "minutes, once)")
    _step([sys.executable, "-m", "venv", str(path)], "create the virtualenv")
    python = path / "bin" / "python"
    # torch by pip: a CPU build that pip's configuration offers (a wheel directory, PyTorch's CPU index) is taken.
    _step([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", requirements[0]],
          f"install {requirements[0]} (CPU build)")
    relaxed = _install_locked(_installer(python), requirements[1:], path / "requirements.txt", echo)
    _step([str(path / "bin" / "python"), "-c", "import " + ", ".join(IMPORT_CHECK)], "import " + ", ".join(IMPORT_CHECK))
    built_s = round(time.monotonic() - started, 1)
    (path / DONE).write_text(json.dumps({"python": platform.python_version(), "left_out": left_out,
                                         "relaxed": relaxed, "built_s": built_s, "lock": lock.file}, indent=2))
    echo(f"built the image's environment in {built_s:.0f} s")


def _installer(python: Path) -> list[str]:
    """uv (resolves the lock's ~120 lines in seconds) where it is installed, else pip, into `python`'s venv."""
    uv = Path(sys.executable).with_name("uv")
    uv = str(uv) if uv.is_file() else shutil.which("uv")
    if uv:
        return [uv, "pip", "install", "--quiet", "--python", str(python)]
    return [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]


# The two installers' words for "this release has no build for this Python".
NO_BUILD = (r"No matching distribution found for ([A-Za-z0-9._-]+)==(\S+)",
            r"([A-Za-z0-9._-]+)==(\S+) depends on Python")


def _install_locked(install: list[str], requirements: list[str], listed: Path,
                    echo: Callable[[str], None]) -> dict[str, str]:
    """Install the lock's lines. A release with no build for this Python (the image's is newer: numpy 2.5 needs
    3.12) becomes `<=` that release, i.e. the newest one this Python has; returns name -> why, each one said."""
    relaxed: dict[str, str] = {}
    lines = list(requirements)
    while True:
        listed.write_text("\n".join(lines) + "\n")
        done = run.run([*install, "-r", str(listed)], timeout=INSTALL_TIMEOUT_S)
        if done.returncode == 0:
            return relaxed
        output = (done.stderr or "") + (done.stdout or "")
        missing = next((m for m in (re.search(p, output) for p in NO_BUILD) if m), None)
        if not missing or missing.group(1) in relaxed:
            _fail(done, f"install the image's packages ({listed})")
        name, version = missing.groups()
        relaxed[name] = f"{version} has no build for Python {platform.python_version()}; the newest one up to it"
        echo(f"{name}=={version} has no build for this Python: taking the newest release up to it")
        lines = [f"{name}<={version}" if line == f"{name}=={version}" else line for line in lines]


def _step(cmd: list[str], what: str) -> None:
    done = run.run(cmd, timeout=INSTALL_TIMEOUT_S)
    if done.returncode != 0:
        _fail(done, what)


def _fail(done: run.Completed, what: str) -> None:
    last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    raise TrainliftError(f"building the image's environment failed to {what}: {last[0]}",
                         hint="check network access to the package index; `trainlift rehearse --no-image` "
                              "rehearses in this environment instead")
