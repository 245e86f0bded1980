"""HSDP on CPU (gloo): 4 workers on 2 Ray nodes (2 local raylets of 2 CPUs each), mesh (2, 2).

- `parallel: auto` picks (2, 2) there; its loss sequence equals plain FSDP's over the same 4 workers (1e-4 relative).
- Checkpoints reshard across meshes and world sizes: the (2, 2) run's step-2 checkpoint resumes on 2 workers with a
  1-D mesh (micro-batches of 4 rows: the same global batch), which stops at step 4; that 1-D checkpoint resumes on
  (2, 2). Every resumed step's loss equals the uninterrupted (2, 2) run's.
"""

from __future__ import annotations

import json
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

nodes = runpy.run_path(str(Path(__file__).with_name("ray_nodes.py")))
pytestmark = pytest.mark.slow
REL = 1e-4


@pytest.fixture(scope="module")
def two_raylets():
    with nodes["two_local_nodes"](cpus=2) as address:
        yield address


def train(address: str, spec: dict, tmp_path: Path, *args: str) -> tuple[int, str, dict | None]:
    job = tmp_path / f"{spec['run']['name']}.yaml"
    job.write_text(yaml.safe_dump(spec))
    env = nodes["env"](TRAINLIFT_HOME=str(tmp_path / "home"))
    proc = subprocess.run([sys.executable, "-m", "trainlift", "train", str(job), "--address", address, "--json",
                           "--progress", "lines", *args], env=env, capture_output=True, text=True, timeout=420)
    return proc.returncode, proc.stderr, json.loads(proc.stdout) if proc.returncode == 0 else None


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row and "step" in row}


def close(a: dict[int, float], b: dict[int, float], steps) -> float:
    """The largest relative difference over `steps`, asserted within REL."""
    worst = max(abs(a[s] - b[s]) / abs(b[s]) for s in steps)
    assert worst <= REL, (a, b)
    return worst


@pytest.mark.timeout(1500)
def test_hsdp_matches_fsdp_and_checkpoints_reshard_across_meshes(two_raylets, tiny_assets, tmp_path):
    runs = tmp_path / "runs"

    def spec(name: str, workers: int, micro_batch: int, **parallel) -> dict:
        return {"model": {"path": str(tiny_assets / "model")},
                "data": {"train": str(tiny_assets / "train.jsonl"), "seq_len": 64},
                "train": {"steps": 6, "micro_batch_size": micro_batch, "lr": 1e-3, "warmup_steps": 1, "seed": 0},
                "scaling": {"workers": workers}, "parallel": parallel or {"replicate": "auto", "shard": "auto"},
                "checkpoint": {"every_steps": 2, "keep": 3},
                "run": {"name": name, "storage": str(runs), "max_failures": 0}}

    rc, err, hsdp = train(two_raylets, spec("hsdp", 4, 2), tmp_path)
    assert rc == 0, err[-3000:]
    assert hsdp["mesh"]["replicate"] == 2 and hsdp["mesh"]["shard"] == 2, hsdp["mesh"]
    assert "on 4 workers, mesh 2 × 2 (replicate × shard: shard within a node, replicate across nodes)" in err
    assert json.loads((runs / "hsdp" / "summary.json").read_text())["mesh"]["replicate"] == 2

    rc, err, fsdp = train(two_raylets, spec("fsdp", 4, 2, replicate=1), tmp_path)
    assert rc == 0, err[-3000:]
    assert (fsdp["mesh"]["replicate"], fsdp["mesh"]["shard"]) == (1, 4)
    reference = losses(runs / "hsdp")
    print(f"HSDP (2, 2) vs FSDP over 4: max relative loss difference "
          f"{close(losses(runs / 'fsdp'), reference, range(1, 7)):.2e}")

    # (2, 2) -> 1-D over 2 workers: the run's directory starts with the HSDP run's step-2 checkpoint.
    (runs / "moved").mkdir()
    shutil.copytree(runs / "hsdp" / "checkpoint_00000002", runs / "moved" / "checkpoint_00000002")
    rc, err, _ = train(two_raylets, spec("moved", 2, 4, replicate=1), tmp_path, "--stop-at-step", "4")
    assert rc == 3, err[-3000:]
    assert "resumed at step 2 on 2 workers, mesh 1 × 2" in err
    print(f"(2, 2) -> 1-D over 2: {close(losses(runs / 'moved'), reference, (3, 4)):.2e}")

    # 1-D over 2 -> (2, 2) over 4: the same run resumes from the checkpoint the 2 workers left at step 4.
    rc, err, back = train(two_raylets, spec("moved", 4, 2), tmp_path)
    assert rc == 0, err[-3000:]
    assert back["resumed_from"].endswith("checkpoint_00000004") and back["mesh"]["replicate"] == 2
    print(f"1-D over 2 -> (2, 2): {close(losses(runs / 'moved'), reference, (5, 6)):.2e}")
