"""What of a project directory travels to the cluster as the job's `working_dir`, and what stays behind and why.

Left out: credential files (always), version control, virtualenvs, caches, run directories, what a job does not
need (the project's top-level tests/, docs/, bench/ and render output out/: `submit --include DIR` sends one), and
--exclude patterns, what git ignores (.gitignore files, .git/info/exclude, the global excludes file) unless the user
includes it, and what .rayignore files name. The size is computed before upload so an oversized directory fails
here, naming its largest files, instead of as "Request Entity Too Large" later.

Links travel as Ray's packaging follows them (a file's link as the file it points at, a folder's as its
contents), so they are listed so: a link that would carry something from outside the project (`~/.aws/credentials`,
a folder elsewhere) or into a loop is refused in one line, and a link to a credential file stays behind with it.

Ray's job client applies the .gitignore and .rayignore files inside the directory itself (unless
RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1) and the runtime_env `excludes`; what git ignores for other reasons travels
to it as anchored `excludes`, so what is listed here is what Ray uploads. Ray applies `excludes` to py_modules
directories as well, which is why trainlift travels as a wheel (ops/package.py) that these patterns never trim.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import pathspec

from trainlift.errors import UsageError
from trainlift.ops.run import environ_set, run

ALWAYS_EXCLUDED = [
    ".git/", ".hg/", ".venv/", "venv/", "env/", "__pycache__/", "*.pyc", ".pytest_cache/", ".mypy_cache/",
    ".ruff_cache/", "*.egg-info/", ".trainlift/", "runs/", ".ipynb_checkpoints/", "node_modules/",
]
CREDENTIAL_LIKE = [
    ".env", ".env.*", ".netrc", "_netrc", ".git-credentials", ".pypirc", ".npmrc", ".boto", ".dockercfg",
    "**/.docker/config.json", "**/.huggingface/**/token", "**/.cache/huggingface/**/token",
    "**/.cache/huggingface/stored_tokens", "application_default_credentials.json", "**/.config/gcloud/",
    "credentials", "credentials.json", ".aws/", ".ssh/", ".kube/", "*.kubeconfig", "id_rsa*", "id_ed25519*",
    "id_ecdsa*", "id_dsa*", "*.pem", "*.key", "*.p12", "*.pfx", "*.tfstate", "*.tfstate.*", "terraform.tfstate*",
    ".envrc", ".pgpass", ".my.cnf", ".s3cfg", ".passwd-s3fs", "kubeconfig", "kubeconfig.*", "*.tfvars",
    "*.tfvars.json", ".databrickscfg", "rclone.conf", "sa-key.json", "*-sa-key.json", "service-account*.json",
    ".htpasswd", ".vault-token", "*.keytab",
]
# Top-level folders of a project that a training job does not read: its tests, documentation, benchmarks and the
# manifests `trainlift render -o out/` writes. Anchored: a data/docs/ folder of the project's data still travels.
NOT_FOR_THE_JOB = ["/tests/", "/docs/", "/bench/", "/out/"]
CREDENTIAL = "credential file"
NOT_NEEDED = "not needed by the job"
BROKEN_LINK = "broken link (Ray skips it)"
GITIGNORED = "gitignored"
RAYIGNORED = "rayignored (.rayignore)"
RAY_IGNORE_GITIGNORE = "RAY_RUNTIME_ENV_IGNORE_GITIGNORE"  # "1": Ray's job client uploads what .gitignore names
DEFAULT_LIMIT_BYTES = 100 * 2**20
GIT_TIMEOUT_S = 60
LINK_FIX = "replace the link with a copy of what the job needs, or leave it out with --exclude PATH"


@dataclass
class WorkdirPlan:
    root: Path
    files: list[tuple[str, int]] = field(default_factory=list)
    left_out: list[tuple[str, str]] = field(default_factory=list)  # (path, reason); a directory's path ends in /
    excludes: list[str] = field(default_factory=list)
    include_ignored: bool = False

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)

    @property
    def credentials(self) -> list[str]:
        return [path for path, reason in self.left_out if reason.startswith(CREDENTIAL)]


def git_ignored(root: Path) -> set[str] | None:
    """What git ignores under `root`, relative to it (a wholly ignored directory as `dir/`); None when `root` is not
    in a git work tree or git is not installed."""
    result = run(["git", "-C", str(root), "ls-files", "-z", "--others", "--ignored", "--exclude-standard",
                  "--directory"], GIT_TIMEOUT_S)
    return {path for path in result.stdout.split("\0") if path} if result.ok else None


def _gitignore_patterns(root: Path) -> list[str]:
    ignore = root / ".gitignore"
    if not ignore.is_file():
        return []
    return [line.strip() for line in ignore.read_text().splitlines() if line.strip() and not line.startswith("#")]


def _anchored(rel: str) -> str:
    """A path as a gitignore pattern that matches it alone, from the directory's root."""
    return "/" + re.sub(r"([\\*?\[\]!#])", r"\\\1", rel)


class _Rules:
    """Why a path stays behind, first rule first: credential, default or --exclude pattern, ignored by git, named
    by a .rayignore. Ignore files apply below their own directory, as Ray applies them."""

    def __init__(self, root: Path, patterns: list[str], include_ignored: bool, not_needed: list[str]):
        self.root, self.patterns = root, patterns + not_needed
        self.specs = ((CREDENTIAL, pathspec.GitIgnoreSpec.from_lines(CREDENTIAL_LIKE), CREDENTIAL_LIKE),
                      (NOT_NEEDED, pathspec.GitIgnoreSpec.from_lines(not_needed), not_needed),
                      ("excluded", pathspec.GitIgnoreSpec.from_lines(patterns), patterns))
        self.ignore_names = ((".rayignore", RAYIGNORED),) if include_ignored else \
            ((".gitignore", GITIGNORED), (".rayignore", RAYIGNORED))
        self.git = None if include_ignored else git_ignored(root)
        self.ignore_files: dict[str, list[tuple[str, pathspec.GitIgnoreSpec, str]]] = {}

    def enter(self, rel_dir: str) -> None:
        """Read `rel_dir`'s own ignore files; its subdirectories inherit them."""
        specs = list(self.ignore_files.get(rel_dir.rpartition("/")[0], [])) if rel_dir else []
        for name, reason in self.ignore_names:
            path = self.root / rel_dir / name
            if path.is_file():
                specs.append((rel_dir, pathspec.GitIgnoreSpec.from_lines(path.read_text().splitlines()), reason))
        self.ignore_files[rel_dir] = specs

    def reason(self, rel: str, rel_dir: str) -> tuple[str, bool] | None:
        """None when `rel` (a directory's ends in /) travels; else why not, and whether Ray's own rules (the
        runtime_env patterns, the ignore files) leave it out too."""
        for label, spec, patterns in self.specs:
            hit = spec.check_file(rel)
            if hit.include:
                return f"{label} ({patterns[hit.index]})", True
        for base, spec, reason in self.ignore_files[rel_dir]:
            if spec.match_file(rel[len(base) + 1:] if base else rel):
                return reason, True
        if self.git is not None and (rel in self.git or rel.rstrip("/") in self.git):  # git lists a link as a file
            return GITIGNORED, False
        return None

    def _folders_above(self, path: Path) -> set[Path]:
        """The real folders the walk went through to reach `path` (links resolved)."""
        folders, here = set(), path.parent
        while here != self.root and here != here.parent:
            folders.add(here.resolve())
            here = here.parent
        return folders | {self.root}

    def through_link(self, path: Path, rel: str) -> tuple[str, bool] | None:
        """For a link that would travel: refused when Ray would carry what is outside the project (or go round a
        loop); left out when it leads to a credential file of the project; else None (it travels as its target)."""
        target = path.resolve()
        if not target.exists():
            return BROKEN_LINK, True
        if not target.is_relative_to(self.root):
            raise UsageError(f"{rel.rstrip('/')} is a link to {target}, outside {self.root}: Ray would upload what it "
                             "points at with the job", hint=LINK_FIX)
        if target.is_dir() and target in self._folders_above(path):
            raise UsageError(f"{rel.rstrip('/')} is a link to {target}, a folder holding it: Ray would go round it "
                             "forever", hint=LINK_FIX)
        inner = target.relative_to(self.root).as_posix() + ("/" if target.is_dir() else "")
        hit = self.specs[0][1].check_file(inner)
        return (f"{CREDENTIAL} (link to {inner}: {CREDENTIAL_LIKE[hit.index]})", False) if hit.include else None


def scan(root: str | Path, extra_excludes: Sequence[str] = (), include_ignored: bool = False,
         include: Sequence[str] = ()) -> WorkdirPlan:
    """Walk `root` with the rules Ray's upload applies; `excludes` is the runtime_env list that makes Ray leave out
    the same paths. `include_ignored`: what git ignores travels too (credential files never do). `include`: folders
    of NOT_FOR_THE_JOB that travel all the same (`tests`, `docs/`, ...)."""
    root = Path(root).resolve()
    wanted = {f"/{name.strip('/')}/" for name in include}
    rules = _Rules(root, ALWAYS_EXCLUDED + list(extra_excludes), include_ignored,
                   [p for p in NOT_FOR_THE_JOB if p not in wanted])
    plan = WorkdirPlan(root=root, include_ignored=include_ignored)
    only_git_knows = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):  # as Ray's packaging walks
        rel_dir = "" if Path(dirpath) == root else Path(dirpath).relative_to(root).as_posix()
        rules.enter(rel_dir)
        kept = []
        for name, is_dir in [(d, True) for d in sorted(dirnames)] + [(f, False) for f in sorted(filenames)]:
            rel = f"{rel_dir}/{name}".lstrip("/") + ("/" if is_dir else "")
            why = rules.reason(rel, rel_dir)
            if why is None and (Path(dirpath) / name).is_symlink():
                why = rules.through_link(Path(dirpath) / name, rel)
            if why is None and is_dir:
                kept.append(name)
            elif why is None:
                plan.files.append((rel, (Path(dirpath) / name).stat().st_size))
            else:
                plan.left_out.append((rel, why[0]))
                if not why[1]:
                    only_git_knows.append(_anchored(rel))
        dirnames[:] = kept
    ignored_here = [] if include_ignored else _gitignore_patterns(root)
    plan.excludes = ignored_here + rules.patterns + CREDENTIAL_LIKE + only_git_knows
    return plan


def uploading(plan: WorkdirPlan) -> contextlib.AbstractContextManager:
    """While Ray's job client uploads the plan: with `include_ignored`, it must not apply .gitignore files itself."""
    return environ_set({RAY_IGNORE_GITIGNORE: "1"}) if plan.include_ignored else contextlib.nullcontext()


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


def describe(plan: WorkdirPlan, limit_bytes: int = DEFAULT_LIMIT_BYTES) -> dict:
    """`submit --dry-run --json`: what would be uploaded and what is left out, with the reason."""
    return {"working_dir": str(plan.root), "files": [{"path": p, "bytes": size} for p, size in plan.files],
            "total_bytes": plan.total_bytes, "limit_bytes": limit_bytes,
            "left_out": [{"path": p, "reason": why} for p, why in plan.left_out],
            "include_ignored": plan.include_ignored, "excludes": plan.excludes}


def listing(plan: WorkdirPlan) -> list[str]:
    """`submit --dry-run`: the same in a few lines: what travels counted per top-level folder (a file at the top
    named), what stays behind per top-level folder and reason (a credential file always named; `--json` lists
    every file)."""
    sent: dict[str, list[int]] = {}
    for path, size in plan.files:
        sent.setdefault(_top(path), []).append(size)
    kept_back: dict[tuple[str, str], int] = {}
    for path, why in plan.left_out:
        key = (path, why) if why.startswith(CREDENTIAL) or "/" not in path.rstrip("/") else (_top(path), why)
        kept_back[key] = kept_back.get(key, 0) + 1
    width = max((len(name) for name in [*sent, *(path for path, _ in kept_back)]), default=0)
    lines = [f"would upload {len(plan.files)} files ({plan.total_bytes / 2**20:.1f} MiB) from {plan.root}:"]
    lines += [f"  {name:<{width}}  {_count(sizes)}" for name, sizes in sorted(sent.items())]
    lines += [f"left out ({len(plan.left_out)}):"]
    lines += [f"  {path:<{width}}  {why}" + (f" ({n} paths)" if n > 1 else "")
              for (path, why), n in sorted(kept_back.items())]
    return lines


def _top(path: str) -> str:
    """A path's top-level folder (`examples/`), or the path itself for a file at the top."""
    head, sep, _ = path.partition("/")
    return head + "/" if sep else path


def _count(sizes: list[int]) -> str:
    total = sum(sizes)
    amount = f"{total / 2**20:.1f} MiB" if total >= 2**20 else f"{total:,} bytes"
    return amount if len(sizes) == 1 else f"{len(sizes)} files, {amount}"
