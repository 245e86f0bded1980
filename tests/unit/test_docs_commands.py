"""The commands README.md and docs/*.md show run as written, or say why they are not run here.

Every shell code block (```bash, ```sh, ```shell or a bare ```) with a line starting `trainlift ` is either run
here, each such line through the real CLI in this process (typer's CliRunner), or preceded by an HTML comment
`<!-- not run: REASON -->`: it needs AWS, a cluster, a GPU or a Ray head, trains (the integration tests train),
or is a synopsis. A block with neither fails. A line's trailing comment may document another exit code
(`# exit 1: does not fit`, `# exits 0, or 1 when …`); otherwise it must exit 0. A block preceded by
`<!-- run as a script: REASON -->` (a recipe whose lines depend on each other: a server started, variables exported,
a command's output used) is run whole with bash, as a user pastes it into a shell with the virtualenv active, and
must exit 0: tests/integration/test_doc_scripts.py runs them (a script starts Ray).

The lines run from a copy of the repository root: the examples, and beside them a finished run at
runs/tiny-demo written without training (its metrics, its summary and a tiny randomly initialized model with the
demo's tokenizer as its export), so `runs`, `report` and `eval` after the demo run as a newcomer pastes them, and
nothing is written into the working tree. TRAINLIFT_HOME is a fresh directory, and no AWS credentials, profile or
Ray address are set (the Hugging Face hub is asked to stay offline), so a command that needs them fails here
instead of reaching out.

Also: README.md fits a first screen and a first day, and every relative link in the docs resolves (a file, and a
heading for a #fragment).
"""

from __future__ import annotations

import json
import re
import runpy
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
doc_files = runpy.run_path(str(ROOT / "tests" / "docs_text.py"))["doc_files"]

README_MAX_LINES = 150
SHELL = {"", "bash", "sh", "shell"}
FENCE = re.compile(r"^\s*```\s*(\S*)")
NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(\S.*?)\s*-->\s*$")
SCRIPT = re.compile(r"^\s*<!--\s*run as a script:\s*(\S.*?)\s*-->\s*$")
# What a script block's output must say, beyond its exit code (page: text).
SCRIPT_SAYS = {"docs/rehearse.md": "rehearsal run: s3://my-trainlift-checkpoints/ray-train/qwen2.5-1.5b-tasks-rehearsal: "
                                   "4 steps, loss "}
PLACEHOLDER = re.compile(r"\.\.\.|…|<[^<>\s]+>|\[--?\w")  # ..., <NAME>, [--option]: a synopsis
EXIT = re.compile(r"\s#.*?\bexits? (\d+)(?:,? or (\d+))?")


@dataclass
class Block:
    where: str  # path:line of the opening fence
    lang: str
    lines: list[str]
    not_run: str | None  # the reason of a `<!-- not run: ... -->` right above the block
    script: str | None = None  # the reason of a `<!-- run as a script: ... -->` right above the block

    def commands(self) -> list[str]:
        """The block's `trainlift …` lines, continued lines joined."""
        joined = re.sub(r"\\\n\s*", " ", "\n".join(self.lines))
        return [line.strip() for line in joined.splitlines() if line.strip().startswith("trainlift ")]


def blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if re.match(r"^\s*```\s*$", lines[j])), len(lines))
        above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        reason, script = NOT_RUN.match(above), SCRIPT.match(above)
        found.append(Block(f"{path.relative_to(ROOT)}:{i + 1}", opening.group(1).lower(), lines[i + 1:end],
                           reason.group(1) if reason else None, script.group(1) if script else None))
        i = end + 1
    return found


def shell_blocks() -> list[Block]:
    return [b for path in doc_files() for b in blocks(path) if b.lang in SHELL and b.commands()]


RUN = [(b.where, command) for b in shell_blocks() if b.not_run is None and b.script is None
       for command in b.commands()]
SCRIPTS = [b for b in shell_blocks() if b.script is not None]


def expected_exit(command: str) -> set[int]:
    m = EXIT.search(command)
    return {int(code) for code in m.groups() if code is not None} if m else {0}


def test_every_block_of_trainlift_commands_is_run_or_says_why_not():
    unrunnable = [f"{b.where}: {c}" for b in shell_blocks() if b.not_run is None for c in b.commands()
                  if PLACEHOLDER.search(" ".join(shlex.split(c, comments=True)))]
    assert all(b.script for b in SCRIPTS) and all(not (b.script and b.not_run) for b in shell_blocks())
    assert unrunnable == [], ("these lines hold placeholders, so they cannot run as written: make them real "
                              "commands, or put `<!-- not run: REASON -->` right above their block\n"
                              + "\n".join(unrunnable))
    marked = [b for b in shell_blocks() if b.not_run is not None]
    assert marked and all(b.not_run for b in marked)
    # The newcomer's path after `make demo` is among what runs here, not only marked.
    run = {command for where, command in RUN if where.startswith("README.md:")}
    for command in ("trainlift runs runs", "trainlift report runs/tiny-demo",
                    "trainlift eval runs/tiny-demo/final --data examples/data/tasks-eval.jsonl --show 8"):
        assert command in run, f"README.md's after-the-demo command is not run: {command}"
    assert any(c.startswith("trainlift estimate ") for c in run) and any(c.startswith("trainlift doctor") for c in run)


def _tiny_export(final: Path) -> None:
    """A tiny randomly initialized Qwen2 with the demo's tokenizer: what `trainlift eval` loads from <run>/final."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(ROOT / "examples" / "tiny" / "tokenizer"))
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(final)
    tokenizer.save_pretrained(final)


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory):
    """The repository root as commands see it after `make demo`, with a finished run written without training."""
    root = tmp_path_factory.mktemp("repo")
    shutil.copytree(ROOT / "examples", root / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    for entry in ROOT.iterdir():  # copied, not linked: `submit` refuses a link out of the project it uploads
        if not entry.name.startswith(".") and entry.name not in {"examples", "runs", "out"}:
            if entry.is_dir():
                shutil.copytree(entry, root / entry.name, ignore=shutil.ignore_patterns("__pycache__", "out"))
            else:
                shutil.copy2(entry, root / entry.name)
    run = root / "runs" / "tiny-demo"
    run.mkdir(parents=True)
    rows = [{"event": "start", "step": 0, "total_steps": 4, "world": 2, "resumed_from": None, "time": 0.0},
            {"step": 0, "eval_loss": 3.0, "time": 0.0},
            *({"step": s, "loss": 3.0 / s, "lr": 1e-3, "grad_norm": 1.0, "world": 2, "tokens": 1024,
               "tokens_per_s": 500.0, "step_time_s": 2.0, "mfu": None, "time": 2.0 * s} for s in range(1, 5)),
            {"step": 4, "eval_loss": 1.0, "time": 8.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"name": "tiny-demo", "finished": True, "steps": 4,
                                                  "final_loss": 0.75, "eval_loss": 1.0, "mfu": None}))
    _tiny_export(run / "final")
    return root


@pytest.fixture
def at_repo_copy(repo_copy, tmp_path, monkeypatch):
    monkeypatch.chdir(repo_copy)
    monkeypatch.setenv("TRAINLIFT_HOME", str(tmp_path / "trainlift-home"))
    for name in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                 "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo_copy


@pytest.mark.parametrize(("where", "command"), RUN, ids=[f"{w} {c[:60]}" for w, c in RUN])
def test_the_command_runs_as_written(at_repo_copy, where, command):
    from typer.testing import CliRunner

    from trainlift.cli import app

    argv = shlex.split(command, comments=True)
    assert argv[0] == "trainlift"
    result = CliRunner().invoke(app, argv[1:])
    crashed = result.exception is not None and not isinstance(result.exception, SystemExit)
    assert not crashed and result.exit_code in expected_exit(command), (
        f"{where}: `{command}` exited {result.exit_code}, expected {sorted(expected_exit(command))}\n"
        f"{result.output[-3000:]}{result.exception!r}")


def test_the_readme_fits_a_first_day():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move reference material to docs/"
    text = "\n".join(lines)
    assert "## After the demo" in text and "## Security" in text
    # How to call the CLI is said before the first `trainlift` command.
    first_block = next(b for b in blocks(ROOT / "README.md") if b.commands())
    first_line = int(first_block.where.rsplit(":", 1)[1])
    assert any("source .venv/bin/activate" in line for line in lines[:first_line])
    # Every docs page is linked from the README.
    linked = set(re.findall(r"\]\((docs/[^)#\s]+\.md)", text))
    assert {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")} <= linked


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6}\s+(.*)$", line)):
            anchors.add(_slug(m.group(1)))
    return anchors


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    prose = re.sub(r"`[^`\n]*`", "", page.read_text(encoding="utf-8"))  # inline code holds no links
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"^[a-z]+:", target):
            continue  # https:, mailto:
        file_part, _, fragment = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in _anchors(resolved):
            broken.append(f"{target}: no heading #{fragment} in {resolved.name}")
    assert broken == [], f"{page.relative_to(ROOT)}: " + "; ".join(broken)
