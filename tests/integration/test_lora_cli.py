"""`trainlift train` with a LoRA target the model does not have: one line naming the layers it has, exit 2,
before Ray starts."""

import os
import subprocess
import sys

import yaml


def test_unknown_lora_target_is_one_line_and_exit_2(tiny_assets, tmp_path):
    spec = {
        "model": {"path": str(tiny_assets / "model"), "lora": {"r": 4, "target_modules": ["q_proj", "qkv"]}},
        "data": {"train": str(tiny_assets / "train.jsonl"), "seq_len": 64},
        "run": {"storage": str(tmp_path / "runs")},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = subprocess.run([sys.executable, "-m", "trainlift", "train", str(path)], capture_output=True, text=True,
                            env={**os.environ, "RAY_ADDRESS": ""}, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert "model.lora.target_modules: 'qkv' matches no module of Qwen2ForCausalLM" in errors[0]
    assert "k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in errors[0]
    assert not (tmp_path / "runs" / "run").exists() or not any((tmp_path / "runs" / "run").iterdir())
