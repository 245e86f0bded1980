"""bench/gpu_pass.sh --smoke: the prepared GPU pass at toy size on the CPU, with Ray hidden, so it never rots.

The lent GPU machine has no Ray; here a sitecustomize.py makes `ray` absent the same way (`import ray` fails,
`importlib.util.find_spec("ray")` is None) for the pass's interpreter.

What a CPU run shows: every stage runs without Ray — the recipe imports, builds (meta, FSDP2, fill), steps
through `recipe.train`, exports and checkpoints; doctor's probe and rules run in this process; the packed
synthetic rows, the micro-batch search, the per-layer torch.compile wrapping (Dynamo, eager backend) and the
JSON and Markdown outputs work; the loss falls; the export reproduces the trained model's logits (fp32).

What it cannot show: anything the GPU decides — bf16 numerics, NCCL (gloo here, so the NCCL log's
classification is not asserted), inductor's code generation, which micro-batch fits at 1.5B, tokens/s and MFU
(null without a GPU peak), GPU memory, checkpoint bandwidth. Those come from `bash bench/gpu_pass.sh --out $OUT`
on the device.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
HIDE_RAY = 'import sys\n\nsys.modules["ray"] = None  # as where Ray is not installed\n'
STAGES = ("doctor", "packed", "tiny_recipe", "nccl", "checkpoint", "qwen15b", "qwen15b_lora")


@pytest.fixture(scope="module")
def no_ray_env(tmp_path_factory) -> dict[str, str]:
    hide = tmp_path_factory.mktemp("no-ray")
    (hide / "sitecustomize.py").write_text(HIDE_RAY)
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PYTHONPATH")}
    return {**env, "PYTHONPATH": str(hide), "PYTHON": sys.executable}


@pytest.fixture(scope="module")
def smoke(no_ray_env, tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("gpu-pass")
    done = subprocess.run(["bash", "bench/gpu_pass.sh", "--smoke", "--out", str(out)], cwd=REPO, env=no_ray_env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads((out / "gpu_pass.json").read_text()), (out / "gpu_pass.md").read_text()


def test_ray_is_installed_here_but_absent_under_the_pass_environment(no_ray_env):
    assert importlib.util.find_spec("ray") is not None
    probe = "import importlib.util, sys; assert importlib.util.find_spec('ray') is None; import ray"
    done = subprocess.run([sys.executable, "-c", probe], env=no_ray_env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr, done.stderr


def test_every_stage_ran_without_ray_and_without_error(smoke):
    report, _ = smoke
    assert report["smoke"] and not report["ray_importable"]
    assert tuple(report["stages"]) == STAGES
    for name, stage in report["stages"].items():
        assert stage["error"] is None and not stage.get("skipped"), (name, stage.get("traceback"))
    assert not report["stages"]["doctor"]["ray_loaded"] and report["stages"]["doctor"]["facts"]["python"]


def test_the_recipe_lowers_the_loss_and_its_export_gives_the_trained_logits(smoke):
    recipe = smoke[0]["stages"]["tiny_recipe"]
    assert recipe["steps"] == 3 and recipe["dtype"] == "fp32"
    assert recipe["eval_loss"] < recipe["initial_eval_loss"] and recipe["last_loss"] < recipe["first_loss"]
    assert recipe["export_relative_diff"] <= 1e-5 and recipe["export_argmax_agreement"] == 1.0
    assert recipe["export_matches"]


def test_throughput_rows_have_tokens_per_second_and_peak_memory(smoke):
    stages = smoke[0]["stages"]
    rows = stages["qwen15b"]["results"] + stages["qwen15b_lora"]["results"]
    assert [(r["activation_checkpointing"], r["compile"], r["lora"]) for r in rows] == [
        (False, False, False), (False, True, False), (True, False, False), (True, True, False), (True, False, True)]
    for row in rows:
        assert row["error"] is None and row["micro_batch"] == 4 and row["tokens_per_s"] > 0
        assert row["peak_memory_gib"] > 0 and row["mfu"] is None  # no GPU peak to divide by
    assert all(r["compiled_layers"] == 2 and r["dynamo_frames"] >= 1 for r in rows if r["compile"])
    assert stages["qwen15b"]["tokens_per_s"] > 0 and stages["qwen15b"]["peak_memory_gib"] > 0


def test_checkpoint_saves_are_timed_sync_and_async(smoke):
    """The synchronous save and the recipe's asynchronous one (`saving.start_write`: DCP's process-based
    checkpointer; pinned host memory on a GPU, none on this CPU) write the same state; the async one is timed."""
    checkpoint = smoke[0]["stages"]["checkpoint"]
    assert len(checkpoint["saves"]) == 2 and checkpoint["upload"] is True
    assert checkpoint["blocked_s"] > 0 and all(s["bytes"] > 0 for s in checkpoint["saves"])
    assert len(checkpoint["async"]) == 2 and all(a["bytes"] > 0 and not a["pinned"] for a in checkpoint["async"])
    assert checkpoint["async_blocked_s"] > 0 and checkpoint["async_over_sync"] > 0


def test_the_all_reduce_runs_one_rank_per_device_and_gives_the_right_sum(smoke):
    """On the CPU the stage takes its multi-GPU path with two gloo ranks, each its own process."""
    nccl = smoke[0]["stages"]["nccl"]
    assert nccl["backend"] == "gloo" and nccl["world"] == 2 and nccl["measured"] and nccl["sum_correct"]
    assert nccl["busbw_gb_per_s"] == pytest.approx(nccl["algbw_gb_per_s"])  # 2(n-1)/n is 1 at two ranks
    assert nccl["verdict"] is None  # gloo writes no NCCL log


def test_with_one_gpu_the_all_reduce_is_recorded_as_not_measured(monkeypatch, tmp_path):
    gpu_pass = load_gpu_pass(monkeypatch)
    monkeypatch.setattr(gpu_pass, "nccl_ranks", lambda ctx: 1)
    ctx = SimpleNamespace(device=SimpleNamespace(type="cuda"), sizes=gpu_pass.SMOKE)
    result = gpu_pass.stage_nccl(ctx)
    assert result["measured"] is False and "bandwidth" not in " ".join(result) and result["world"] == 1
    line = gpu_pass.nccl_line({**result, "error": None})
    assert line.startswith("All-reduce: not measured (one GPU lent: NCCL needs a rank on each of two or more GPUs")


def test_the_markdown_is_a_benchmarks_section(smoke):
    _, markdown = smoke
    lines = markdown.splitlines()
    assert lines[0] == "<!-- bench:gpu_pass -->" and lines[-1] == "<!-- /bench:gpu_pass -->"
    assert lines[1].startswith("## ") and "- Command: `python bench/gpu_pass.py --smoke" in markdown
    assert "- Date: " in markdown and "| tiny_recipe | ok |" in markdown


def load_gpu_pass(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # it imports benchlib and gpu_mfu as a script does
    spec = importlib.util.spec_from_file_location("gpu_pass_under_test", REPO / "bench" / "gpu_pass.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_the_micro_batch_search_steps_down_past_out_of_memory_only(monkeypatch):
    """What only a GPU can trigger, with `measure` standing in for the 1.5B run."""
    import torch

    gpu_pass = load_gpu_pass(monkeypatch)

    def measure(ctx, micro_batch, ac, compiled, lora):
        if micro_batch > 2:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory at {micro_batch}")
        return {"tokens_per_s": 1.0}

    monkeypatch.setattr(gpu_pass, "measure", measure)
    ctx = SimpleNamespace(device=torch.device("cpu"), left=lambda: 100.0, sizes=gpu_pass.FULL)
    row = gpu_pass.combination(ctx, (8, 4, 2, 1), True, False, None)
    assert row["micro_batch"] == 2 and list(row["out_of_memory"]) == [8, 4] and row["error"] is None

    monkeypatch.setattr(gpu_pass, "measure", lambda *args: 1 / 0)
    assert gpu_pass.combination(ctx, (8, 4), True, False, None)["error"].startswith("ZeroDivisionError")
    ctx.left = lambda: gpu_pass.FULL.min_combination_s - 1
    assert "time budget" in gpu_pass.combination(ctx, (8, 4), True, False, None)["skipped"]


def test_packed_rows_stay_apart_on_every_kernel_that_runs_here(smoke):
    """On the CPU: flex attention and sdpa, two packed rows at head_dim 128 (on a GPU, flash-attn too)."""
    packed = smoke[0]["stages"]["packed"]
    assert set(packed["kernels"]) == {"flex_attention", "sdpa"}
    for kernel, result in packed["kernels"].items():
        assert result["error"] is None and result["kept_apart"], (kernel, result)
    assert packed["kernels"]["sdpa"]["backward"] is True
    assert packed["kernels"]["flex_attention"]["backward"] is None  # torch has no flex backward on a CPU
