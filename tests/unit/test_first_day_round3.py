"""A first day without surprises, round three: the rehearsal's own run, a submitted job's output, what an upload
sends, the offline hub, and the smaller things a newcomer met (the final evaluation on the last progress line, a
stopped run's eval loss, the CPU estimate's time line, a per-task eval breakdown, where the image locks are).

A job's log here is a real one: `trainlift submit examples/tiny-local.yaml --set train.steps=40 --set
train.eval_every=20 --set checkpoint.every_steps=30` on a `trainlift local up` head (Ray 2.58 on this machine),
read back with `trainlift jobs logs ID --raw` (tests/fixtures/recorded/ray-job-tiny-demo.log)."""

from __future__ import annotations

import io
import json
import re
import socket
import time
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
GOLDEN = ROOT / "tests" / "golden" / "reference"
RECORDED_JOB_LOG = ROOT / "tests" / "fixtures" / "recorded" / "ray-job-tiny-demo.log"


# --- item 1: the rehearsal's own run -------------------------------------------------------------------------

def test_the_rehearsal_trains_a_run_of_its_own_next_to_the_jobs():
    from dataclasses import replace

    from trainlift.ops.rehearse import job_entrypoint, rehearsal_of, rehearsed_as
    from trainlift.ops.rehearse_run import job_run, spec_from_zip

    spec_text = (EXAMPLES / "qwen2.5-1.5b-eks.yaml").read_text()
    data = io.BytesIO()
    with zipfile.ZipFile(data, "w") as z:  # as docs/rehearse.md zips examples/
        z.writestr("qwen2.5-1.5b-eks.yaml", spec_text)
        z.writestr("data/tasks-train.jsonl", "{}\n")
    assert spec_from_zip(data.getvalue(), "qwen2.5-1.5b-eks.yaml") == spec_text
    run = job_run(spec_from_zip(data.getvalue(), "qwen2.5-1.5b-eks.yaml"), [], [], "qwen2-5-1-5b-tasks")
    job = yaml.safe_load(spec_text)["run"]
    assert run.job_uri == f"{job['storage']}/{job['name']}"
    assert run.uri == "s3://my-trainlift-checkpoints/ray-train/qwen2.5-1.5b-tasks-rehearsal" != run.job_uri
    plan = replace(rehearsal_of(GOLDEN), run=run)
    assert rehearsed_as(plan, 2)[-1] == "run.name=qwen2.5-1.5b-tasks-rehearsal"
    entry = job_entrypoint(plan, ["train.steps=4"], 2)
    assert entry.endswith("--set run.name=qwen2.5-1.5b-tasks-rehearsal --set train.steps=4")
    # Without the spec (not readable), the rendered entrypoint's storage and the RayJob's name still keep it apart.
    assert rehearsal_of(GOLDEN).run.uri == "s3://my-trainlift-checkpoints/ray-train/qwen2-5-1-5b-sft-rehearsal"
    # A run.name the user gives `rehearse --set` is theirs, as every --set of theirs.
    chosen = job_run(spec_text, [], ["run.name=try-1"], "x")
    assert chosen.uri.endswith("/ray-train/try-1") and "run.name=" not in " ".join(
        rehearsed_as(replace(plan, run=chosen), 2))


def test_the_rehearsal_says_where_its_run_went_with_its_steps_and_loss():
    from trainlift.ops.rehearse import Outcome
    from trainlift.ops.rehearse_run import RehearsalRun, run_line

    run = RehearsalRun("qwen2.5-1.5b-tasks", "s3://my-trainlift-checkpoints/ray-train")
    line = run_line(run, {"steps": 4, "final_loss": 5.83114, "eval_loss": 5.829})
    assert line.startswith("rehearsal run: s3://my-trainlift-checkpoints/ray-train/qwen2.5-1.5b-tasks-rehearsal: "
                           "4 steps, loss 5.8311, eval loss 5.8290")
    assert "s3://my-trainlift-checkpoints/ray-train/qwen2.5-1.5b-tasks, is not touched" in line
    outcome = Outcome("SUCCEEDED", "", "", [], (), {}, {"uri": run.uri, "line": line, "steps": 4})
    assert outcome.to_dict()["run"]["uri"] == run.uri


def test_a_seq_len_refusal_from_a_stored_run_names_that_run_and_asks_for_a_new_run_name(monkeypatch, tmp_path):
    """The reference job (a hub model, seq_len 2048) where a 256-position model's checkpoint is stored under its
    run.name: the limit is the stored model's, so the hint is a run of this job's own, not `--set
    data.seq_len=256`."""
    from trainlift.config.job import load_job_spec
    from trainlift.errors import UsageError
    from trainlift.train.run import preflight

    monkeypatch.setattr(preflight, "checkpointed_config_fields",
                        lambda spec: {"model_type": "qwen2", "max_position_embeddings": 256})
    spec = load_job_spec(EXAMPLES / "qwen2.5-1.5b-eks.yaml", [f"run.storage={tmp_path}"])
    with pytest.raises(UsageError) as refused:
        preflight.check(spec)
    line = refused.value.one_line()
    assert f"model stored in run qwen2.5-1.5b-tasks ({tmp_path}/qwen2.5-1.5b-tasks)" in line
    assert "--set run.name=NEW_NAME" in line and "--set data.seq_len" not in line


# --- item 3: a rehearsal without an AWS account -----------------------------------------------------------------

def test_the_rehearsal_page_has_a_recipe_for_a_machine_without_an_aws_account():
    """Its block runs whole in tests/unit/test_docs_commands.py; here: it brings everything itself."""
    text = (ROOT / "docs" / "rehearse.md").read_text()
    section = text[text.index("## Without an AWS account"):]
    assert re.search(r"<!-- run as a script: .+ -->\n```bash\n", section)
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    for needed in ("moto_server -p $PORT", "AWS_ENDPOINT_URL=http://127.0.0.1:$PORT", "AWS_ACCESS_KEY_ID=", "AWS_REGION=",
                   "create_bucket(", "WHEEL=$(trainlift package --upload ", '--trainlift-uri "$WHEEL"',
                   "trainlift rehearse ", "kill "):
        assert needed in block, needed
    assert "…" not in block and "..." not in block


# --- item 4: a submitted job reads like a local run ---------------------------------------------------------------

def _readable(lines):
    from trainlift.cli.progress import JobLogLines
    from trainlift.ops.jobs import parse_progress
    from trainlift.ops.ray_output import is_ray_line

    readable = JobLogLines(parse_progress, is_ray_line)
    return [text for line in lines for text in readable(line)] + readable.flush()


def test_a_jobs_log_reads_as_a_local_run_without_ray_chatter_or_machine_lines():
    raw = RECORDED_JOB_LOG.read_text().splitlines()
    assert any(line.startswith("trainlift-progress ") for line in raw)  # what the recording holds
    shown = _readable(raw)
    assert not [line for line in shown if "trainlift-progress" in line or line.startswith(("(autoscaler)", "(raylet)"))
                or "%|" in line]
    steps = [line for line in shown if line.startswith("step ")]
    assert steps and len(steps) <= 25 and steps[-1].startswith("step 40/40  loss ")
    progress = [json.loads(line.split(" ", 1)[1]) for line in raw if line.startswith("trainlift-progress ")]
    final = progress[-1]
    assert f"eval {final['eval_loss']:.4f} at {final['eval_step']}" in steps[-1]  # the final evaluation
    assert any(line.startswith("Running entrypoint for job trainlift-tiny-demo-") for line in shown)


def test_a_worker_line_of_trainlifts_own_shows_and_ray_lines_and_bars_do_not():
    shown = _readable([
        "\x1b[36m(RayTrainWorker pid=4242, ip=127.0.0.1)\x1b[0m trainlift: data cache written",
        "(autoscaler) Resized to 4 CPUs.",
        "(RayTrainWorker pid=4242, ip=127.0.0.1) some library chatter",
        "2026-12-06 01:02:03,456 INFO worker.py:1 -- Connecting to existing Ray cluster",
        "Writing model shards: 100%|██████████| 1/1 [00:00<00:00, 12.31it/s]",
        "run tiny-demo"])
    assert shown == ["trainlift: data cache written", "run tiny-demo"]


def test_submit_off_a_terminal_prints_progress_lines_as_the_job_runs(capsys):
    """`submit` without a terminal, following a job: the recorded real log, as Ray's tail_job_logs streams it."""
    import asyncio

    from trainlift.cli import jobs as jobs_cli

    text = RECORDED_JOB_LOG.read_text()

    class RecordedJob:
        async def _chunks(self):
            for start in range(0, len(text), 700):  # chunks that cut lines, as the stream does
                yield text[start:start + 700]
                await asyncio.sleep(0)

        def tail_job_logs(self, job_id):
            return self._chunks()

        def get_job_status(self, job_id):
            class Status:
                value = "SUCCEEDED"
            return Status()

    assert not jobs_cli.console.is_terminal
    status, first_step = jobs_cli._follow(RecordedJob(), "trainlift-tiny-demo-x", 40, False, time.time())
    out = capsys.readouterr().out.splitlines()
    assert status == "SUCCEEDED" and first_step is not None
    assert [line for line in out if line.startswith("step ")][-1].startswith("step 40/40  loss ")
    assert not [line for line in out if "trainlift-progress" in line or line.startswith("(autoscaler)")]


def test_jobs_logs_takes_any_unique_prefix_of_an_id():
    from trainlift.errors import UsageError
    from trainlift.ops.jobs import matching_job

    ids = ["trainlift-tiny-demo-59bc745a7f", "trainlift-tiny-demo-59bc745a7f-2", "trainlift-other-0123456789"]
    assert matching_job(ids, "trainlift-tiny-demo-59bc745a7f") == ids[0]  # whole, though it prefixes another
    assert matching_job(ids, "trainlift-oth") == ids[2]
    with pytest.raises(UsageError) as ambiguous:
        matching_job(ids, "trainlift-tiny")
    assert "names 2 jobs: trainlift-tiny-demo-59bc745a7f, trainlift-tiny-demo-59bc745a7f-2" in str(ambiguous.value)
    with pytest.raises(UsageError, match="no job 'nope'"):
        matching_job(ids, "nope")


def test_jobs_list_shows_whole_ids_off_a_terminal():
    from trainlift.cli import jobs as jobs_cli

    long_id = "trainlift-qwen2.5-1.5b-tasks-with-a-longer-name-0123456789-2"
    entry = "python -m trainlift train qwen2.5-1.5b-eks.yaml --set run.storage=s3://my-trainlift-checkpoints/ray-train"
    with jobs_cli.console.capture() as captured:
        jobs_cli._print_jobs([{"id": long_id, "status": "SUCCEEDED", "entrypoint": entry}])
    lines = captured.get().splitlines()
    assert any(long_id in line and entry in line for line in lines), "\n".join(lines)


def test_a_submitted_job_turns_the_libraries_progress_bars_off(monkeypatch):
    from trainlift.ops import jobs, package

    monkeypatch.setattr(package, "build_wheel", lambda where: Path("/wheel/trainlift.whl"))
    env = jobs.runtime_env(Path("."), [], [], {})["env_vars"]
    assert env["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and env["TRAINLIFT_PROGRESS"] == "json"


# --- item 6: the upload sends what the job needs -----------------------------------------------------------------

@pytest.fixture
def project(tmp_path):
    files = ["job.yaml", "train.py", "data/train.jsonl", "data/docs/notes.jsonl", "tests/test_x.py", "docs/a.md",
             "bench/b.py", "out/k8s/30-rayjob.yaml", *(f"src/pkg/m{i}.py" for i in range(30))]
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x\n")
    return tmp_path


def test_the_upload_leaves_tests_docs_bench_and_render_output_behind_and_lists_it_in_a_few_lines(project):
    from trainlift.ops import workdir

    plan = workdir.scan(project)
    sent = {path for path, _ in plan.files}
    assert {"job.yaml", "train.py", "data/train.jsonl", "data/docs/notes.jsonl", "src/pkg/m0.py"} <= sent
    assert not [p for p in sent if p.startswith(("tests/", "docs/", "bench/", "out/"))]
    assert dict(plan.left_out)["tests/"].startswith("not needed by the job")
    lines = workdir.listing(plan)
    assert len(lines) <= 12 and "  src/      30 files, 60 bytes" in lines, "\n".join(lines)
    assert "docs/a.md" in {p for p, _ in workdir.scan(project, include=["docs"]).files}


def test_the_dry_run_of_the_eks_page_lists_this_repository_in_a_few_lines():
    from trainlift.ops import workdir

    plan = workdir.scan(ROOT)
    assert not [p for p, _ in plan.files if p.startswith(("tests/", "docs/", "bench/", "out/", "runs/"))]
    assert len(workdir.listing(plan)) < 40
    assert "trainlift submit examples/qwen2.5-1.5b-eks.yaml --dry-run" in (ROOT / "docs" / "eks.md").read_text()


# --- item 7: offline, the hub fails fast -------------------------------------------------------------------------

def test_an_unreachable_hub_fails_in_one_line_within_seconds(monkeypatch, tmp_path):
    from huggingface_hub import constants
    from transformers import AutoConfig  # noqa: F401 - imported before the clock starts, as a warm process has it

    from trainlift.config.job import load_job_spec
    from trainlift.errors import SpecError
    from trainlift.ops.model_config import read_model_config

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    spec = load_job_spec(EXAMPLES / "qwen2.5-1.5b-eks.yaml")
    started = time.monotonic()
    with pytest.raises(SpecError) as failed:
        read_model_config(spec.model)
    assert time.monotonic() - started < 3.0
    assert "the hub cannot be asked" in failed.value.one_line() and "--model-config" in failed.value.one_line()


def test_estimate_of_the_demo_has_a_time_line():
    from typer.testing import CliRunner

    from trainlift.cli import app

    result = CliRunner().invoke(app, ["estimate", str(EXAMPLES / "tiny-local.yaml")])
    assert result.exit_code == 0, result.output
    assert [line for line in result.output.splitlines() if line.startswith("time ")]


# --- item 8: the smaller ones --------------------------------------------------------------------------------------

def test_the_last_progress_line_shows_the_final_evaluation():
    from trainlift.cli.progress import ProgressLines

    out = io.StringIO()
    lines = ProgressLines("lines", 30.0, out, clock=lambda: 0.0)
    row = {"event": "step", "step": 400, "total_steps": 400, "loss": 0.2, "tokens_per_s": 4000.0,
           "eval_step": 300, "eval_loss": 0.2353}
    lines(row)
    lines({**row, "eval_step": 400, "eval_loss": 0.2124})  # the final evaluation, posted with the last step
    assert out.getvalue().splitlines()[-1].startswith("step 400/400  loss 0.2000  eval 0.2124 at 400")


def test_the_final_evaluation_is_posted_with_the_last_step():
    from trainlift.train.run.runlog import RunLog

    posted = []

    class Board:
        class update:
            @staticmethod
            def remote(row):
                posted.append(row)

    class Sink:
        def write(self, row):
            pass

    log = RunLog.__new__(RunLog)
    log.board, log.sink, log.last_eval = Board(), Sink(), {}
    log.last_posted = {"event": "step", "step": 400, "total_steps": 400, "loss": 0.2}
    log.evaluated(400, 0.2124, {})
    assert posted[-1]["step"] == 400 and posted[-1]["eval_loss"] == 0.2124 and posted[-1]["eval_step"] == 400


def test_a_stopped_runs_summary_shows_the_last_recorded_evaluation():
    from trainlift.report import table_values

    rows = [{"step": 0, "eval_loss": 3.0}, {"step": 100, "loss": 1.0}, {"step": 100, "eval_loss": 0.5},
            {"step": 200, "eval_loss": 0.3}, {"step": 250, "loss": 0.2}]
    values = table_values(rows, {"finished": False, "steps": 250, "eval_loss": None})
    assert values["eval_loss"] == 0.3 and values["eval_step"] == 200 and values["initial_eval_loss"] == 3.0
    assert table_values(rows[:2], {"eval_loss": None})["eval_loss"] is None  # only the initial one: none of its own


def test_eval_breaks_down_by_task_when_the_rows_name_one():
    from trainlift.evaluate import by_task, task_of

    assert task_of({"messages": [], "task": "sort"}) == "sort" and task_of({"category": 3}) == "3"
    assert task_of({"messages": []}) is None
    samples = [{"task": "sort", "correct": True}, {"task": "sort", "correct": False}, {"task": "add", "correct": True}]
    assert by_task(samples) == {"add": {"total": 1, "correct": 1, "accuracy": 1.0},
                                "sort": {"total": 2, "correct": 1, "accuracy": 0.5}}


def test_the_rehearsal_page_says_where_the_image_locks_are():
    from trainlift.catalog.packages import image_lock

    text = (ROOT / "docs" / "rehearse.md").read_text()
    assert "DLC tags in\n  `trainlift profiles`" not in text and "src/trainlift/catalog/platform.yaml" in text
    images = yaml.safe_load((ROOT / "src" / "trainlift" / "catalog" / "platform.yaml").read_text())["images"]
    for tag in re.findall(r"`ray:(train-ml-cuda[\w.-]*)`", text):
        assert f"public.ecr.aws/deep-learning-containers/ray:{tag}" in images
    for suffix in re.findall(r"`(-v1[\w.]*)`", text):
        assert image_lock(f"public.ecr.aws/deep-learning-containers/ray:train-ml-cuda{suffix}") is not None
