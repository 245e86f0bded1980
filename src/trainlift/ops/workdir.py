"""What of a project directory travels to the cluster as the job's `working_dir`.

Excluded: version control, virtualenvs, caches, run directories, whatever the
project's .gitignore excludes, and credential-looking files (with a warning).
The size is computed before upload so an oversized directory fails here,
naming its largest files, instead of as "Request Entity Too Large" later.

Ray applies runtime_env `excludes` to py_modules directories as well, which is
why trainlift travels as a wheel (ops/package.py) that these patterns never trim.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pathspec

from trainlift.errors import UsageError

ALWAYS_EXCLUDED = [
    ".git/", ".hg/", ".venv/", "venv/", "env/", "__pycache__/", "*.pyc", ".pytest_cache/", ".mypy_cache/",
    ".ruff_cache/", "*.egg-info/", ".trainlift/", "runs/", ".ipynb_checkpoints/", "node_modules/",
]
CREDENTIAL_LIKE = [".env", ".env.*", "*.pem", "*.key", ".aws/", ".ssh/", "id_rsa*", "id_ed25519*", ".netrc",
                   "credentials", "*.kubeconfig", ".kube/"]
DEFAULT_LIMIT_BYTES = 100 * 2**20


@dataclass
class WorkdirPlan:
    root: Path
    files: list[tuple[str, int]] = field(default_factory=list)
    credentials: list[str] = field(default_factory=list)
    excludes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)


def _gitignore_patterns(root: Path) -> list[str]:
    ignore = root / ".gitignore"
    if not ignore.is_file():
        return []
    return [line.strip() for line in ignore.read_text().splitlines() if line.strip() and not line.startswith("#")]


def scan(root: str | Path, extra_excludes: list[str] = ()) -> WorkdirPlan:
    """Walk `root` with the exclusion rules; the same patterns go to Ray as runtime_env `excludes`."""
    root = Path(root).resolve()
    excludes = ALWAYS_EXCLUDED + list(extra_excludes) + _gitignore_patterns(root)
    skip = pathspec.GitIgnoreSpec.from_lines(excludes)
    secret = pathspec.GitIgnoreSpec.from_lines(CREDENTIAL_LIKE)
    plan = WorkdirPlan(root=root)
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        kept = []
        for d in sorted(dirnames):
            rel = f"{(rel_dir / d).as_posix()}/"
            if secret.match_file(rel):
                plan.credentials.append(rel)
            elif not skip.match_file(rel):
                kept.append(d)
        dirnames[:] = kept
        for name in sorted(filenames):
            rel = (rel_dir / name).as_posix()
            if secret.match_file(rel):
                plan.credentials.append(rel)
            elif not skip.match_file(rel):
                plan.files.append((rel, (Path(dirpath) / name).stat().st_size))
    plan.excludes = excludes + CREDENTIAL_LIKE
    return plan


def check_size(plan: WorkdirPlan, limit_bytes: int = DEFAULT_LIMIT_BYTES) -> None:
    if plan.total_bytes <= limit_bytes:
        return
    largest = sorted(plan.files, key=lambda f: -f[1])[:5]
    names = ", ".join(f"{name} ({size / 2**20:.1f} MiB)" for name, size in largest)
    raise UsageError(
        f"working directory {plan.root} is {plan.total_bytes / 2**20:.1f} MiB, over the {limit_bytes / 2**20:.0f} MiB "
        f"upload limit; largest files: {names}",
        hint="add them to .gitignore or pass --exclude PATTERN; put data and models on S3 or a shared volume",
    )
