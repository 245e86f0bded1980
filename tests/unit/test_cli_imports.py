"""Every command's --help, and the commands that only render or ask AWS, start without torch, transformers or Ray:
those imports are seconds on a laptop, paid by commands that never train. Commands import what they need inside."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter: every command path of the Typer app with --help, one after another, noting which one
# first brought in a heavy module; then the command lines given on argv, the same way.
PROBE = """
import json, sys
import typer.main
from trainlift.cli import app

HEAVY = ("torch", "transformers", "ray")

def heavy():
    return sorted(m for m in HEAVY if m in sys.modules)

def invoke(args):
    try:
        command.main(args=args, prog_name="trainlift", standalone_mode=True)
    except SystemExit:
        pass
    return heavy()

command = typer.main.get_command(app)

def paths(group, prefix=()):
    yield prefix
    for name, sub in getattr(group, "commands", {}).items():
        yield from paths(sub, (*prefix, name))

found = {}
for path in [*paths(command), *json.loads(sys.argv[1])]:
    args = [*path, "--help"] if path and path[-1] != "--run" else list(path[:-1])
    if (loaded := invoke(args)) and not found:
        found = {"command": " ".join(args), "heavy": loaded}
print(json.dumps({"first_heavy": found, "commands": sum(1 for _ in paths(command))}))
"""


def probe(*command_lines: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps([[*c, "--run"] for c in command_lines])],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_help_of_every_command_and_rendering_import_no_torch_transformers_or_ray(tmp_path):
    result = probe(["render", "examples/cluster-reference.yaml", "-o", str(tmp_path / "out")])
    assert result["commands"] >= 20  # the walk reached the subcommands (doctor, cluster, jobs, local ...)
    assert result["first_heavy"] == {}, result
    assert (tmp_path / "out").is_dir()  # the render command line really ran
