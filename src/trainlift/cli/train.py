"""`trainlift train` (fine-tune a job spec on Ray) and `trainlift eval` (score a model on a data split)."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from trainlift.cli.app import app, console, err_console, print_json
from trainlift.cli.progress import MODES, Eta, ProgressLines, duration, start_line, step_figures
from trainlift.config.job import load_job_spec
from trainlift.errors import UsageError
from trainlift.progress_lines import PROGRESS_ENV


def _fmt(value, spec: str = ".4g") -> str:
    return "—" if value is None else format(value, spec)


@app.command()
def train(
    spec_file: Path = typer.Argument(..., help="Job spec (YAML), e.g. examples/tiny-local.yaml."),
    set_: List[str] = typer.Option([], "--set", metavar="KEY=VALUE", help="Override a spec field: --set train.steps=20 (repeatable)."),
    steps: Optional[int] = typer.Option(None, help="Shortcut for --set train.steps=N."),
    workers: Optional[int] = typer.Option(None, help="Shortcut for --set scaling.workers=N (default 2).", show_default=False),
    run_dir: Optional[str] = typer.Option(None, help="Shortcut for --set run.storage=DIR (local path or s3://)."),
    address: Optional[str] = typer.Option(
        None, help="Ray cluster to attach to (default: RAY_ADDRESS, else the `trainlift local up` head, else an embedded local Ray)."),
    stop_at_step: Optional[int] = typer.Option(
        None, min=1, help="Checkpoint and stop after this step (exit 3); it prints the command that resumes."),
    skip_doctor: bool = typer.Option(False, "--skip-doctor", help="Train even when the workers' stack checks fail."),
    progress_mode: str = typer.Option(
        "auto", "--progress", envvar=PROGRESS_ENV, show_envvar=False,
        help="auto: a bar on a terminal, else a line every --log-every seconds; lines: those lines even on a "
             "terminal; json: a `trainlift-progress {json}` line per update (what `submit --follow` reads)."),
    log_every: float = typer.Option(30.0, "--log-every", min=0.0, help="Seconds between progress lines off a terminal."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also show what Ray, the workers and the Hugging "
                                 "Face libraries print (always in the run's driver.log; on by itself inside a Ray "
                                 "job, whose log is the record)."),
    allow_spec_change: bool = typer.Option(
        False, "--allow-spec-change", help="Resume a run whose model, data, sequence length, optimizer, schedule "
        "or LoRA changed since it started (refused otherwise; steps, eval and checkpoint cadence, trackers, "
        "workers and the micro-batch may always change)."),
    json_out: bool = typer.Option(False, "--json", help="Print the run summary as JSON."),
) -> None:
    """Fine-tune a causal LM with FSDP2 on Ray Train.

    With no --address: RAY_ADDRESS, else the head `trainlift local up` started,
    else an embedded local Ray (CPU, gloo) stopped at the end. Re-running the
    same run.name resumes from its latest complete checkpoint; a finished run
    is left as it is unless --steps asks for more. Relative paths in the spec
    file are relative to its directory; in --set values, to the current one.
    Writes
    <run.storage>/<run.name>/{metrics.jsonl,summary.json,driver.log,final/}.
    """
    from trainlift.ops import ray_output
    from trainlift.train.launch import EXIT_STOPPED, run_training

    if progress_mode not in MODES:
        raise UsageError(f"--progress {progress_mode!r}: expected one of {', '.join(MODES)}",
                         hint=f"unset {PROGRESS_ENV} or pass --progress auto")
    shortcuts = {"train.steps": steps, "scaling.workers": workers, "run.storage": run_dir}
    # The shortcuts are overrides like --set, so the spec's own validation checks them before Ray starts.
    spec = load_job_spec(spec_file, [*set_, *(f"{key}={value}" for key, value in shortcuts.items() if value is not None)])
    if skip_doctor:
        err_console.print("[bold yellow]WARNING: --skip-doctor: the workers' stack and transport checks are OFF; "
                          "a broken EFA/NCCL setup will train slowly or fail late[/]")
    with _progress_display(spec, progress_mode, log_every, hidden=json_out) as on_update:
        # Ray prints cluster events (a node lost) to stdout; with --json, stdout holds the summary alone.
        with contextlib.redirect_stdout(sys.stderr) if json_out else contextlib.nullcontext():
            summary = run_training(spec, address=_ray_address(address), stop_at_step=stop_at_step,
                                   skip_doctor=skip_doctor, on_update=_with_ray_line(on_update),
                                   verbose=verbose or ray_output.in_ray_job(), allow_spec_change=allow_spec_change)
    _print_summary(summary, json_out)
    if not summary.get("finished"):
        raise typer.Exit(EXIT_STOPPED)


def _print_summary(summary: dict, json_out: bool) -> None:
    """The summary (a table, or JSON), with what a finished run's rerun or a stopped run's next step is."""
    if summary.get("already_finished") and not json_out:
        err_console.print(f"run {summary['name']} already finished at step {summary['steps']} "
                          f"({summary['run']}); nothing to train. Ask for more with --steps N (the LR then stays "
                          "at its final value; --set train.schedule_extension=restart or stretch to change that), "
                          f"or remove {summary['run']} to start over.")
    if not summary.get("finished") and summary.get("eval_loss") is None and summary.get("run"):
        summary = _with_recorded_eval(summary)
    _summary_table(summary, json_out)
    if not summary.get("finished"):
        why = f"{summary['stopped_by']} received" if summary.get("stopped_by") else "--stop-at-step reached"
        err_console.print(f"stopped at step {summary['steps']} ({why}); a checkpoint was saved; resume with: "
                          f"{resume_command(sys.argv)}", markup=False, highlight=False)


def _with_recorded_eval(summary: dict) -> dict:
    """A stopped run's summary with the last evaluation its metrics.jsonl holds (report.with_recorded_eval)."""
    from trainlift.errors import TrainliftError
    from trainlift.report import with_recorded_eval
    from trainlift.rundir import read_run

    try:
        return with_recorded_eval(summary, read_run(summary["run"]).rows)
    except (OSError, TrainliftError, AttributeError):
        return summary


def resume_command(argv: list[str]) -> str:
    """The command that was run, without --stop-at-step: run again, it resumes and goes on to train.steps."""
    import shlex

    kept, skip = [], False
    for arg in argv[1:]:
        if skip:
            skip = False
        elif arg == "--stop-at-step":
            skip = True
        elif not arg.startswith("--stop-at-step="):
            kept.append(arg)
    return " ".join([program(argv[0]), shlex.join(kept)])


def program(argv0: str) -> str:
    """How to run trainlift again from this shell: `trainlift` where that is on PATH, else the path it was run by
    (`.venv/bin/trainlift` after `make demo`), or `python -m trainlift`."""
    import shutil

    import shlex

    if argv0.endswith("__main__.py"):
        return "python -m trainlift"
    found = shutil.which("trainlift")
    if os.sep not in argv0 or (found and os.path.realpath(found) == os.path.realpath(argv0)):
        return "trainlift"
    relative = os.path.relpath(argv0)
    return shlex.quote(os.path.abspath(argv0) if relative.startswith("..") else relative)


def _ray_address(address: str | None) -> str | None:
    """--address, else RAY_ADDRESS (read by Ray), else the head `trainlift local up` started, else None (embedded).
    A local head another user started under a shared $TRAINLIFT_HOME is refused: its Ray would not take this
    user's driver."""
    from trainlift.ops import localray

    local_head = localray.read_state()
    if address is not None or os.environ.get("RAY_ADDRESS"):
        if local_head and (address or os.environ["RAY_ADDRESS"]) == local_head["gcs_address"]:
            localray.use_head_auth()  # the `local up` head given by its address: reached as the head runs
        return address
    if not local_head:
        return None
    owner, me = _process_user(local_head["pid"]), _process_user(os.getpid())
    if owner and owner != me:
        raise UsageError(f"the local Ray head at {local_head['gcs_address']} (recorded in {localray.state_file()}) "
                         f"was started by user {owner}, not {me}",
                         hint="give each user a TRAINLIFT_HOME of their own (unset it for ~/.trainlift), "
                              "or attach on purpose with --address")
    localray.use_head_auth()
    return local_head["gcs_address"]


def _process_user(pid: int) -> str | None:
    import psutil

    try:
        return psutil.Process(pid).username()
    except psutil.Error:
        return None


def ray_line(address: str | None) -> str:
    """Which Ray the run uses, said before it starts or attaches."""
    if not address:
        return "Ray: starting an embedded local Ray in this process; it stops when the run ends"
    from trainlift.ops import localray

    head = localray.read_state()
    if head and head["gcs_address"] == address:
        since = time.strftime("%H:%M", time.localtime(head.get("started_at", 0)))
        return (f"Ray: attaching to the `trainlift local up` head at {address} (pid {head['pid']}, user "
                f"{_process_user(head['pid'])}, up since {since}); `trainlift local down` stops it")
    return f"Ray: attaching to the cluster at {address}"


def _with_ray_line(on_update):
    """The run's `ray` event (the address it is about to use) shown as a note."""
    def forward(row: dict) -> None:
        on_update({"event": "note", "text": ray_line(row["address"])} if row.get("event") == "ray" else row)

    return forward


@contextlib.contextmanager
def _progress_display(spec, progress_mode: str, log_every: float, hidden: bool):
    """A progress bar on a terminal, else progress lines; yields the function the run's updates go to. On the
    bar, what the run starts on and notes are printed above it, where the next step does not overwrite them."""
    bar = console.is_terminal and progress_mode == "auto"
    lines = None if bar else ProgressLines(progress_mode, log_every)
    eta, last_start = Eta(), [None]
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("{task.fields[eta]}"),
        console=console, transient=hidden, disable=hidden or not bar,
    ) as progress:
        task = progress.add_task(f"train {spec.run.name}", total=spec.train.steps, info="starting Ray…", eta="")

        def on_update(row: dict) -> None:
            if lines is not None:
                lines(row)
                return
            if row.get("event") == "note" and not hidden:
                progress.console.print(row["text"], markup=False, highlight=False)
            elif row.get("event") == "step":
                left = eta(row)
                info = step_figures(row)
                progress.update(task, completed=row["step"], info=info, eta="" if left is None else f"ETA {duration(left)}")
            elif row.get("event") == "start" and (row["step"], row.get("time")) != last_start[0]:
                last_start[0] = (row["step"], row.get("time"))
                eta.restarted(row["step"])
                if not hidden:
                    progress.console.print(start_line(row), markup=False, highlight=False)
                progress.update(task, completed=row["step"], info="first step…", eta="")

        yield on_update


def _summary_table(summary: dict, json_out: bool) -> None:
    if json_out:
        print_json(summary)
        return
    table = Table(title=f"run {summary['name']}", show_header=False)
    for key, fmt in (("steps", "d"), ("final_loss", ".4f"), ("initial_eval_loss", ".4f"), ("eval_loss", ".4f"),
                     ("eval_rewards/accuracy", ".1%"), ("eval_rewards/margin", ".3f"),
                     ("tokens_per_s", ".0f"), ("step_time_s", ".3f"), ("mfu", ".1%"), ("wall_time_s", ".1f"),
                     ("trainable_params", ",d"), ("total_params", ",d")):
        if key.startswith("eval_rewards/") and summary.get(key) is None:
            continue  # a DPO run's last evaluation; no row at all for an SFT run
        table.add_row(key, _fmt(summary.get(key), fmt))
    table.add_row("run", summary["run"])
    console.print(table)


@app.command("eval")
def eval_(
    model_dir: Path = typer.Argument(..., help="An HF model directory, e.g. runs/tiny-demo/final."),
    data_file: Path = typer.Option(..., "--data", help="JSONL in the messages or prompt_completion format."),
    limit: int = typer.Option(200, help="Score at most this many examples."),
    show: int = typer.Option(6, help="Print this many prompts with the model's answers."),
    max_new_tokens: int = typer.Option(16, help="Greedy decoding length."),
    reference: Optional[Path] = typer.Option(
        None, "--reference", help="Preference pairs: the model the DPO run started from; a reply's reward is then "
        "beta x (its log-prob - the reference's), as training reports it."),
    beta: float = typer.Option(0.1, help="Preference pairs with --reference: the run's train.dpo.beta."),
    json_out: bool = typer.Option(False, "--json", help="Print accuracy and samples as JSON."),
) -> None:
    """Greedy-decode answers and report exact-match accuracy against the reference answers; on preference pairs
    ({prompt, chosen, rejected}), how often the model prefers the chosen reply (by reward with --reference)."""
    from trainlift.evaluate import exact_match
    from trainlift.evaluate_preference import is_preference_file, preference_accuracy

    if data_file.is_file() and is_preference_file(str(data_file)):
        _print_preferences(preference_accuracy(str(model_dir), str(data_file), str(reference) if reference else None,
                                               beta, limit), show, json_out)
        return
    if reference is not None and data_file.is_file():
        raise UsageError(f"--reference: {data_file} holds no preference pairs; --reference scores those only")
    report = exact_match(str(model_dir), str(data_file), limit=limit, max_new_tokens=max_new_tokens)
    if json_out:
        print_json(report)
        return
    table = Table(title=f"{report['model']}: {report['correct']}/{report['total']} exact match ({report['accuracy']:.1%})")
    for col in ("prompt", "expected", "answer", ""):
        table.add_column(col)
    for s in report["samples"][:show]:
        table.add_row(s["prompt"], s["expected"], s["answer"], "✓" if s["correct"] else "✗")
    console.print(table)
    if report.get("by_task"):  # the data's rows carry a task (or category) field
        console.print("by task: " + ", ".join(f"{task} {t['correct']}/{t['total']} ({t['accuracy']:.0%})"
                                              for task, t in report["by_task"].items()), markup=False, highlight=False)


def _print_preferences(report: dict, show: int, json_out: bool) -> None:
    if json_out:
        print_json(report)
        return
    by = f"reward, beta {report['beta']:g}, against {report['reference']}" if report["reference"] else "log-prob"
    table = Table(title=f"{report['model']}: chosen preferred in {report['correct']}/{report['total']} pairs "
                        f"({report['accuracy']:.1%}) by {by}; mean margin {report['mean_margin']:.3f}")
    for col in ("prompt", "chosen", "rejected", "margin", ""):
        table.add_column(col, justify="left" if col == "prompt" else "right")
    for s in report["samples"][:show]:
        table.add_row(s["prompt"], f"{s['chosen']:.3f}", f"{s['rejected']:.3f}", f"{s['margin']:.3f}",
                      "✓" if s["correct"] else "✗")
    console.print(table)
