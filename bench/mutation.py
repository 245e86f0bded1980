"""Mutation testing of the code whose mistakes are silent: the token loss, packing, the LR schedule, the DPO loss,
FLOPs, the memory estimate and exact-match scoring. A tool, not a gate of `make test`.

mutmut (pinned with hashes in mutation/requirements.txt; `make mutation` installs it into .venv/mutmut, outside the
project's site-packages) changes one operator, constant, argument or call at a time in the functions that
mutation/targets.toml names, and runs the unit tests that cover each one. A mutant that no test fails survives.
A survivor that changes nothing a user can observe (or one held by a source bug that a strict xfail test
documents) is listed, with the reason, in mutation/equivalent.toml; any other survivor is unexplained: it is
printed with its diff and the command exits 1 (kill it with a test).

Each target runs in its own snapshot of the repository (src/, tests/, examples/, pyproject.toml) under
bench/out/mutation/TARGET/, where mutmut writes its mutants/ directory: never in the checkout, and a source file
edited during the run does not change what was tested. The per-target results are kept in
mutation/results.json, and the docs/BENCHMARKS.md section is rewritten from all of them.

  make mutation                                           # every target, in the order of targets.toml
  make mutation MUTATION_ARGS="--target lr_schedule --target packing --max-children 2"
  python bench/mutation.py --target lr_schedule           # once mutmut is installed (make mutation does it)
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "mutation"
MUTMUT_LIB = ROOT / ".venv" / "mutmut"
STAGE = ROOT / "bench" / "out" / "mutation"
COPIED = ("src", "examples", "docs", "pyproject.toml")
CLASS_SEPARATOR = "ǁ"  # how mutmut names a method's mutants: module.xǁClassǁmethod__mutmut_N
DETECTED = {"killed", "timeout", "segfault"}  # a test failed, hung or crashed: the mutant was noticed
TITLE = "23. Mutation testing of the core math"


def load_targets() -> list[dict]:
    return tomllib.loads((CONFIG / "targets.toml").read_text())["target"]


def load_equivalents() -> list[dict]:
    return tomllib.loads((CONFIG / "equivalent.toml").read_text()).get("equivalent", [])


def module_of(file: str) -> str:
    return file.removeprefix("src/").removesuffix(".py").replace("/", ".")


def mutant_globs(target: dict) -> list[str]:
    module = module_of(target["file"])
    globs = []
    for name in target["functions"]:
        if name == "*":
            globs.append(f"{module}.*__mutmut_*")
        elif "." in name:
            cls, method = name.split(".", 1)
            globs.append(f"{module}.x{CLASS_SEPARATOR}{cls}{CLASS_SEPARATOR}{method}__mutmut_*")
        else:
            globs.append(f"{module}.x_{name}__mutmut_*")
    return globs


def function_of(mutant: str) -> str:
    """`lr_lambda` or `StepFlops.per_token`: the function a mutant's name points at."""
    mangled = mutant.rsplit(".", 1)[1].split("__mutmut_")[0]
    if mangled.startswith("x" + CLASS_SEPARATOR):
        return ".".join(mangled[2:].split(CLASS_SEPARATOR))
    return mangled.removeprefix("x_")


def stage(target: dict) -> Path:
    """A fresh snapshot of the repository for `target`, with mutmut's config in its setup.cfg."""
    where = STAGE / target["name"]
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "integration", "golden")
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, where / name, ignore=ignore)
        else:
            shutil.copy2(source, where / name)
    shutil.copytree(ROOT / "tests", where / "tests", ignore=ignore)
    lines = ["[mutmut]", "source_paths = src", f"only_mutate = {target['file']}",
             "also_copy =", "    examples", "    docs",  # the tests read the demo data, tokenizer and docs
             "pytest_add_cli_args_test_selection =", *(f"    {t}" for t in target["tests"]),
             "pytest_add_cli_args =", "    -p", "    no:cacheprovider",
             # torch is not fork-safe once its thread pools run: each mutant forks from a clean server process.
             "process_isolation = forkserver", ""]
    (where / "setup.cfg").write_text("\n".join(lines))
    return where


def mutmut(where: Path, *args: str, check: bool = True, log: Path | None = None) -> subprocess.CompletedProcess:
    """mutmut's command line in `where`; its output captured, or written to `log` as it runs."""
    # One thread per test process: the models under test are tiny, and a second thread only waits on a busy machine.
    env = dict(os.environ, PYTHONPATH=str(MUTMUT_LIB), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", PYTHONDONTWRITEBYTECODE="1")
    command = [sys.executable, "-c", "import sys; from mutmut.__main__ import cli; sys.exit(cli())", *args]
    if log is not None:
        with open(log, "w") as out:
            done = subprocess.run(command, cwd=where, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        done.stdout, done.stderr = log.read_text()[-6000:], ""
    else:
        done = subprocess.run(command, cwd=where, env=env, capture_output=True, text=True)
    if check and done.returncode != 0:
        sys.exit(f"mutmut {' '.join(args[:1])} failed in {where} ({done.returncode}):\n{done.stdout[-4000:]}\n"
                 f"{done.stderr[-4000:]}")
    return done


def statuses(where: Path, globs: list[str]) -> dict[str, str]:
    """mutant name -> mutmut's status, for the mutants of the target's functions."""
    out = mutmut(where, "results", "--all", "true").stdout
    found = dict(line.strip().rsplit(": ", 1) for line in out.splitlines() if "__mutmut_" in line)
    return {name: status for name, status in found.items() if any(fnmatch.fnmatch(name, g) for g in globs)}


def changed_lines(where: Path, mutant: str) -> tuple[list[str], list[str]]:
    """The lines a mutant removes and adds, stripped."""
    diff = mutmut(where, "show", mutant).stdout.splitlines()
    removed = [line[1:].strip() for line in diff if line.startswith("-") and not line.startswith("---")]
    added = [line[1:].strip() for line in diff if line.startswith("+") and not line.startswith("+++")]
    return removed, added


def squeeze(text: str) -> str:
    return " ".join(text.split())


def explanation(target: dict, function: str, removed: list[str], added: list[str],
                equivalents: list[dict]) -> dict | None:
    """The entry of equivalent.toml that explains this survivor: same file and function, and its `was`/`now`
    found in the lines the mutant removes and adds."""
    for entry in equivalents:
        if entry["file"] != target["file"] or entry["function"] != function:
            continue
        if squeeze(entry["was"]) in squeeze(" ".join(removed)) and squeeze(entry["now"]) in squeeze(" ".join(added)):
            return entry
    return None


def run_target(target: dict, max_children: int, equivalents: list[dict]) -> dict:
    where = stage(target)
    globs = mutant_globs(target)
    source = (ROOT / target["file"]).read_bytes()
    load = benchlib.load()
    start = time.monotonic()
    run = mutmut(where, "run", "--max-children", str(max_children), *globs, check=False, log=where / "run.log")
    seconds = time.monotonic() - start
    if run.returncode != 0:
        sys.exit(f"{target['name']}: mutmut run failed ({run.returncode}); see {where / 'run.log'}:\n"
                 f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    found = statuses(where, globs)
    counts: dict[str, int] = {}
    for status in found.values():
        counts[status] = counts.get(status, 0) + 1
    survivors = []
    for name, status in sorted(found.items(), key=lambda kv: (kv[0].split("__mutmut_")[0],
                                                             int(kv[0].rsplit("_", 1)[1]))):
        if status in DETECTED:
            continue
        function = function_of(name)
        removed, added = changed_lines(where, name)
        entry = explanation(target, function, removed, added, equivalents)
        survivors.append({"mutant": name, "status": status, "function": function, "removed": removed,
                          "added": added, "reason": entry["reason"] if entry else None})
    return {
        "name": target["name"], "file": target["file"], "functions": target["functions"], "tests": target["tests"],
        "source_sha256": hashlib.sha256(source).hexdigest()[:12], "mutants": len(found), "counts": counts,
        "killed": sum(n for s, n in counts.items() if s in DETECTED), "survivors": survivors,
        "seconds": round(seconds), "max_children": max_children, "load": list(load),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": benchlib.command_line(),
    }


def section(results: dict[str, dict], order: list[str]) -> str:
    rows, notes = [], []
    for name in [n for n in order if n in results]:
        r = results[name]
        explained = [s for s in r["survivors"] if s["reason"]]
        unexplained = [s for s in r["survivors"] if not s["reason"]]
        functions = ", ".join(f"`{f}`" for f in r["functions"]) if r["functions"] != ["*"] else "every function"
        tests = ", ".join(Path(t).stem for t in r["tests"])
        timeouts = r["counts"].get("timeout", 0)
        rows.append([name, f"`{r['file'].removeprefix('src/trainlift/')}`: {functions}", tests, r["mutants"],
                     f"{r['killed']} ({timeouts} by timeout)" if timeouts else r["killed"], len(explained),
                     f"**{len(unexplained)}**" if unexplained else "0",
                     r["seconds"], f"{r['date']}, {r['source_sha256']}"])
        for s in r["survivors"]:
            change = f"`{' / '.join(s['removed'])}` → `{' / '.join(s['added'])}`"
            why = s["reason"] or "**unexplained: no test kills it**"
            notes.append(f"- {name}, `{s['function']}` ({s['status']}): {change}. {squeeze(why)}")
    body = ("mutmut 3.8.1 (mutation/requirements.txt) over the functions of mutation/targets.toml, each target "
            "against the unit tests listed there, in a snapshot of the repository (bench/out/mutation/); `make "
            "mutation` runs it (docs/layout.md). Killed counts a test failing, hanging (timeout) or crashing on the "
            "mutant; a timeout on a busy machine may be a slow test rather than a hang, so those are counted apart "
            "(a rerun can turn one into a survivor). Explained: a survivor no test can kill because it changes "
            "nothing a user can observe (or, named as such, one held by a source bug that a strict xfail test "
            "documents), listed with the reason in mutation/equivalent.toml; every other survivor is unexplained "
            "and makes the command exit 1. Wall time is one target's `mutmut run` under `nice -n 10` with the "
            "given children on the 2 shared cores (mutant generation, one pass of the tests with coverage, the "
            "clean run, then the mutants); the snapshot's source digest is the first 12 hex digits of its "
            "sha256.\n\n")
    body += benchlib.table(["target", "code", "tests", "mutants", "killed", "explained", "unexplained",
                            "wall s", "run (UTC), source sha256"], rows)
    if notes:
        body += "\n\nSurvivors, each with the reason no test kills it:\n\n" + "\n".join(notes)
    commands = sorted({results[n]["command"] for n in order if n in results})
    body += "\n\nCommands of these runs: " + "; ".join(f"`{c}`" for c in commands) + "."
    return body


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", help="a target of mutation/targets.toml (repeatable; "
                                                          "default: all)")
    parser.add_argument("--max-children", type=int, default=2, help="mutants tested at once (default 2)")
    benchlib.add_common_args(parser)
    args = parser.parse_args()
    benchlib.configure(args)
    if not (MUTMUT_LIB / "mutmut").is_dir():
        return f"mutmut is not installed in {MUTMUT_LIB}: run `make mutation`"
    targets = load_targets()
    order = [t["name"] for t in targets]
    chosen = args.target or order
    unknown = sorted(set(chosen) - set(order))
    if unknown:
        return f"unknown target(s) {', '.join(unknown)}; mutation/targets.toml has {', '.join(order)}"
    results_file = CONFIG / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    equivalents = load_equivalents()
    for target in [t for t in targets if t["name"] in chosen]:
        print(f"{target['name']}: mutating {target['file']} ({', '.join(target['functions'])})", flush=True)
        result = run_target(target, args.max_children, equivalents)
        unexplained = [s for s in result["survivors"] if not s["reason"]]
        print(f"  {result['mutants']} mutants, {result['killed']} killed, "
              f"{len(result['survivors']) - len(unexplained)} explained, {len(unexplained)} unexplained, "
              f"{result['seconds']} s", flush=True)
        for s in unexplained:
            print(f"  UNEXPLAINED {s['mutant']} ({s['status']}):\n    - " + "\n    - ".join(s["removed"])
                  + "\n    + " + "\n    + ".join(s["added"]), flush=True)
        if benchlib.QUIET["record"]:
            results[target["name"]] = result
            results_file.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    if benchlib.QUIET["record"]:
        loads = [results[n]["load"] for n in order if n in results]
        benchlib.record(TITLE, loads, section(results, order), key="mutation")
    left = [s["mutant"] for n in chosen for s in results.get(n, {}).get("survivors", []) if not s["reason"]]
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
