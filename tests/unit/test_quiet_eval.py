"""`trainlift eval` prints trainlift's lines only: the Hugging Face "Loading weights" bar stays off the console."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def test_eval_prints_no_loading_bar(tiny_assets):
    done = subprocess.run([str(BIN / "trainlift"), "eval", str(tiny_assets / "model"), "--data",
                           str(tiny_assets / "eval.jsonl"), "--limit", "2", "--show", "0", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Loading weights" not in done.stderr and "it/s" not in done.stderr, done.stderr
    assert json.loads(done.stdout)["total"] == 2
