"""bench/gpu_mfu.py runs end to end on a CPU with its tiny configuration (the GPU run itself needs a GPU)."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gpu_mfu_tiny_smoke_run_reports_throughput_and_no_mfu_on_cpu():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, "bench/gpu_mfu.py", "--tiny", "--steps", "2", "--no-record"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["device"] == "cpu"
    assert result["tokens_per_s"] > 0
    assert result["mfu"] is None
    assert all(r["error"] is None for r in result["results"])
